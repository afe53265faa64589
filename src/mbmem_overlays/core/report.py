"""Turning a Report into text or JSON. Kept apart from the engine, which returns data."""

from __future__ import annotations

import json
import shlex
from typing import Any

from .engine import Report


def section(title: str, items, marker: str = "-") -> list[str]:
    """A titled list, or nothing when the list is empty."""
    items = list(items)
    return [f"{title}:", *(f"  {marker} {i}" if marker else f"  {i}" for i in items)] if items else []


def _layout(summary: dict[str, Any], world_size: int | None, dp: int | None) -> str:
    parts = [f"TP{summary['tensor_model_parallel_size']}", f"PP{summary['pipeline_model_parallel_size']}"]
    if summary.get("virtual_pipeline_model_parallel_size"):
        parts.append(f"VPP{summary['virtual_pipeline_model_parallel_size']}")
    parts.append(f"CP{summary['context_parallel_size']}")
    if summary.get("expert_model_parallel_size", 1) and summary.get("expert_model_parallel_size", 1) > 1:
        parts.append(f"EP{summary['expert_model_parallel_size']}")
    if dp:
        parts.append(f"DP{dp}")
    text = " ".join(parts) + f", SP {'on' if summary['sequence_parallel'] else 'off'}"
    return f"world size {world_size}: {text}" if world_size else text


def render_text(report: Report, *, recipe: str | None = None, summary: dict[str, Any] | None = None,
                world_size: int | None = None) -> str:
    v = report.validation
    lines: list[str] = []
    if recipe:
        head = f"recipe: {recipe}"
        if summary:
            head += (f"  ({summary['num_layers']} layers, hidden {summary['hidden_size']}, seq {summary['seq_length']}, "
                     f"MBS {summary['micro_batch_size']}, GBS {summary['global_batch_size']}"
                     + (f", PEFT {summary['peft']}" if summary.get("peft") else "") + ")")
        lines.append(head)
        if summary:
            lines.append("layout: " + _layout(summary, world_size, getattr(v, "data_parallel_size", None)))
    lines.append("overlays: " + (", ".join(report.overlays) or "(none)"))
    for name, params in report.params.items():
        if params:
            lines.append(f"  {name}: " + ", ".join(f"{k}={val!r}" for k, val in params.items()))
    lines.append("changes:" if report.changes else "changes: none")
    lines += [f"  {c.render()}" for c in report.changes]
    lines += section("environment to export (before CUDA is initialized)",
                     (f"export {k}={shlex.quote(v)}" for k, v in sorted(report.env_to_export.items())), marker="")
    lines += section("warnings", report.warnings, marker="!")
    lines += section("notes", report.notes)
    lines.append(f"rules checked: {len(report.checks)} ({', '.join(report.checks)})")
    if v is not None:
        lines.append(f"validation: {v.verdict}")
        lines += [f"  not checkable here: {n}" for n in v.not_checkable]
        lines += [f"  needed at launch: {n}" for n in v.launch_requirements]
    return "\n".join(lines)


def to_dict(report: Report, **extra: Any) -> dict[str, Any]:
    v = report.validation
    out = {
        "overlays": list(report.overlays),
        "params": report.params,
        "changes": [{"overlay": c.overlay, "target": c.target, "old": c.old, "new": c.new} for c in report.changes],
        "env_to_export": report.env_to_export,
        "warnings": report.warnings,
        "notes": report.notes,
        "checks": report.checks,
        "validation": None if v is None else {
            "ok": v.ok, "complete": v.complete, "verdict": v.verdict, "error": v.error, "world_size": v.world_size,
            "data_parallel_size": v.data_parallel_size, "not_checkable": v.not_checkable,
            "launch_requirements": v.launch_requirements},
    }
    out.update(extra)
    return out


def render_json(report: Report, **extra: Any) -> str:
    return json.dumps(to_dict(report, **extra), indent=2, default=repr)
