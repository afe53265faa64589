"""The doctor's report as text."""

from __future__ import annotations

from ..core.report import section
from .diagnose import Diagnosis
from .parse import Findings


def render(d: Diagnosis, f: Findings) -> str:
    lines = [f"diagnosis: {d.summary}", f"confidence: {d.confidence}"]
    if d.next_command:
        lines.append(f"next command: {d.next_command}")
    lines += section("why", d.reasons) + section("not first", d.why_not)
    lines += section("evidence", d.evidence, marker="") + section("inputs", f.problems, marker="!")
    lines.append(f"read {f.bytes_read / 1e6:.1f} MB from {len(f.files)} file(s); {len(f.ooms)} OOM message(s) on "
                 f"{len({o.rank for o in f.ooms})} rank(s)")
    return "\n".join(lines)
