"""Turning a Report into text or JSON, and into the exit code every entry point returns.

Kept apart from the engine, which returns data. The exit codes live here (the lowest layer both
``launch/`` and ``cli/`` may import); ``cli.common`` re-exports them. README "Exit codes" documents them.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from .engine import Report
from .errors import OverlayError, short_repr
from .text import MAX_MESSAGE_CHARS, bounded, shown

# An error's whole text under --json: its problems, each bounded (core/text.py), up to errors.MAX_PROBLEMS_SHOWN.
MAX_ERROR_CHARS = 40 * MAX_MESSAGE_CHARS

EXIT_OK = 0          # passed: our rules and Bridge's validation accept the config
EXIT_REJECTED = 1    # rejected by our rules or by Bridge's validation; nothing was changed
EXIT_USAGE = 2       # bad arguments or input files
EXIT_INCOMPLETE = 3  # our rules passed, but Bridge's validation stopped at a check this host cannot run
EXIT_UNKNOWN = 4     # plan / recommend: the fit is unknown (a feature that changes memory is not modelled)
from .console import EXIT_OUTPUT  # noqa: E402  standard output is closed or full (`| head -0`, `> /dev/full`)

SCHEMA_VERSION = 1   # of every --json / run.json=true object; bump when a key changes meaning


def exit_code(report: Report) -> int:
    """0 passed (or not validated), 1 rejected, 3 incomplete: a host that could not finish Bridge's
    validation must not look like a pass to a script (issue 14 item 6)."""
    v = report.validation
    if v is None:
        return EXIT_OK
    if not v.ok:
        return EXIT_REJECTED
    return EXIT_OK if v.complete else EXIT_INCOMPLETE


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


def validation_lines(v) -> list[str]:
    """The verdict, and for an incomplete one exactly which upstream checks did not run."""
    if v is None:
        return ["validation: not run (Bridge's own validation was skipped)"]
    lines = [f"validation: {v.verdict}"]
    if v.ok and not v.complete:
        stopped = [n for n in v.not_checkable if "validation stopped here" in n] or v.not_checkable[-1:]
        lines += [f"  stopped at: {n}" for n in stopped]
        lines.append("  not run here: every check of Bridge's runtime_config_update after that one "
                     "(megatron-core TransformerConfig/DDP/optimizer finalize checks that follow it)")
        lines += [f"  not checkable here: {n}" for n in v.not_checkable if n not in stopped]
        lines.append(f"  exit code {EXIT_INCOMPLETE} (incomplete): run the same command on a host with "
                     "Transformer Engine to finish the validation")
    else:
        lines += [f"  not checkable here: {n}" for n in v.not_checkable]
    lines += [f"  needed at launch: {n}" for n in v.launch_requirements]
    return lines


def render_text(report: Report, *, recipe: str | None = None, summary: dict[str, Any] | None = None,
                world_size: int | None = None, user_changes: Iterable[tuple[str, Any, Any]] = (),
                verbose: bool = False, next_step: str | None = None) -> str:
    """Short by default: the changes (the user's overrides marked ``[you]``), the verdict, the next step.
    ``verbose`` adds the parameters and the list of rules checked (issue 17, "Fast, quiet, visible")."""
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
    if verbose:
        for name, params in report.params.items():
            if params:
                lines.append(f"  {name}: " + ", ".join(f"{k}={val!r}" for k, val in params.items()))
    user_changes = list(user_changes)
    lines.append("changes:" if report.changes or user_changes else "changes: none")
    lines += [f"  [you] {path}: {old!r} -> {new!r}" for path, old, new in user_changes]
    lines += [f"  {c.render()}" for c in report.changes]
    lines += section("environment to export (before CUDA is initialized)",
                     (f"export {k}={shlex.quote(v)}" for k, v in sorted(report.env_to_export.items())), marker="")
    # Warnings and notes quote user files and values (a broken user overlay's YAML error, its path): escaped.
    lines += section("warnings", (shown(w, one_line=False) for w in report.warnings), marker="!")
    lines += section("notes", (shown(n, one_line=False) for n in report.notes))
    if verbose:
        lines.append(f"rules checked: {len(report.checks)} ({', '.join(report.checks)})")
    else:
        lines.append(f"rules checked: {len(report.checks)} (-v lists them)")
    lines += validation_lines(v)
    if next_step:
        lines.append(f"next: {next_step}")
    return "\n".join(lines)


def to_dict(report: Report, *, user_changes: Iterable[tuple[str, Any, Any]] = (), **extra: Any) -> dict[str, Any]:
    v = report.validation
    out = {
        "schema_version": SCHEMA_VERSION,
        "ok": exit_code(report) == EXIT_OK,
        "exit_code": exit_code(report),
        "overlays": list(report.overlays),
        "params": report.params,
        "user_overrides": [{"target": p, "old": old, "new": new} for p, old, new in user_changes],
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


MAX_JSON_INT = 1 << 64


def json_safe(value: Any, depth: int = 0) -> Any:
    """``value`` as strict JSON holds it: a NaN or an infinity becomes null, an integer past 64 bits its bounded
    text (json.dumps of a many-thousand-digit integer raises), tuples lists, keys text; what is not plain data is
    left to ``default=repr``. Nothing a user gave reaches stdout as ``NaN`` (issue 39 #10)."""
    t = type(value)
    if t is float:
        return value if math.isfinite(value) else None
    if t is int:
        return value if -MAX_JSON_INT < value < MAX_JSON_INT else short_repr(value)
    if depth > 200:
        return short_repr(value)
    if t is dict:
        return {k if type(k) is str else bounded(short_repr(k) if type(k) is int else k):
                json_safe(v, depth + 1) for k, v in value.items()}
    if t in (list, tuple):
        return [json_safe(v, depth + 1) for v in value]
    return value


def json_text(obj: Any, default=repr) -> str:
    """The one way mbmem writes a JSON object to stdout: strict JSON (``allow_nan=False``) of ``json_safe(obj)``;
    a value that is not plain data is ``default(value)`` (its repr; ``str`` for paths)."""
    return json.dumps(json_safe(obj), indent=2, default=lambda o: json_safe(default(o)), allow_nan=False)


def render_json(report: Report, **extra: Any) -> str:
    return json_text(to_dict(report, **extra))


def error_dict(message: str, code: int, *, problems: Iterable[Any] = (), **extra: Any) -> dict[str, Any]:
    """The JSON object of a failed command: never an empty stdout under --json."""
    return {"schema_version": SCHEMA_VERSION, "ok": False, "exit_code": code,
            "error": bounded(message, MAX_ERROR_CHARS), "problems": [_json_safe(asdict(p)) for p in problems], **extra}


def _json_safe(problem: dict[str, Any]) -> dict[str, Any]:
    """A problem's value as JSON can hold it: a value json cannot write (an integer over Python's int-digit
    limit, a recursive structure) becomes its bounded repr (errors.short_repr)."""
    try:
        if len(json.dumps(problem["value"], default=repr)) > MAX_MESSAGE_CHARS:  # a huge value: bounded too
            problem = {**problem, "value": short_repr(problem["value"])}
    except (ValueError, TypeError, RecursionError):
        problem = {**problem, "value": short_repr(problem["value"])}
    return {**problem, **{k: bounded(problem[k]) for k in ("message", "fix") if isinstance(problem.get(k), str)}}


def render_error_json(exc: BaseException, code: int, **extra: Any) -> str:
    problems = exc.problems if isinstance(exc, OverlayError) else []
    report = getattr(exc, "report", None)
    if isinstance(report, Report):  # ValidationRejected: what the overlays would have changed, and the verdict
        extra["report"] = to_dict(report)
    return json_text(error_dict(str(exc), code, problems=problems, **extra))
