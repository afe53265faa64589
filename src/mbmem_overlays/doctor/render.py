"""The doctor's report as text and as JSON (``schema_version`` names the JSON layout)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ..core.report import section
from .diagnose import Diagnosis, gib
from .parse import Findings


def render(d: Diagnosis, f: Findings) -> str:
    lines = [f"diagnosis: {d.summary}", f"verdict: {d.verdict} (exit {d.exit_code}); confidence: {d.confidence}"]
    if d.rank is not None:
        lines.append(f"rank: {d.rank}")
    if d.next_command:
        lines.append(f"next command: {d.next_command}")
        if d.command_check:
            lines.append(f"  checked: {d.command_check}")
    lines += section("why", d.reasons)
    if d.unknown:
        lines += section("unknown (not in the log)", d.unknown)
    lines += section("notes from the logged config", d.notes, marker="!")
    remedies = []
    for i, r in enumerate(d.remedies, 1):
        saves = "" if r["saves_bytes"] is None else f"; saves {gib(r['saves_bytes'])}"
        remedies.append(f"{i}. {r['name']}: {r['action']}" + (f" (cost: {r['cost']}{saves})" if r["cost"] or saves else ""))
    lines += section("remedies, in order", remedies, marker="")
    if d.savings:
        lines.append(f"  {d.savings}")
    lines += section("not first", d.why_not) + section("also in the log", d.also)
    lines += section("evidence", d.evidence, marker="") + section("inputs", f.problems, marker="!")
    ranks = {o.rank for o in f.ooms if o.rank is not None}
    lines.append(f"read {f.bytes_read / 1e6:.1f} MB from {len(f.files)} file(s); {len(f.ooms)} allocator OOM message(s)"
                 + (f" on rank(s) {', '.join(map(str, sorted(ranks)[:16]))}" if ranks else "")
                 + (f"; {len(f.events)} other failure/signal line(s)" if f.events else ""))
    return "\n".join(lines)


def as_json(d: Diagnosis, f: Findings) -> dict[str, Any]:
    out = asdict(d)
    out["exit_code"] = d.exit_code
    out.update({"files": f.files, "problems": f.problems, "bytes_read": f.bytes_read,
                "world_size": f.world.value if f.world else None,
                "torch_version": ".".join(map(str, f.torch_version.value)) if f.torch_version else None,
                "layout": f.layout, "events": [asdict(e) for e in f.events[:64]]})
    return out
