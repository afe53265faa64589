"""The doctor's report as text and as JSON (``schema_version`` names the JSON layout; docs/doctor.md).

Everything shown that came from a log is escaped (core.text.shown, issue 22 #9) by the command that prints
it; JSON escapes control characters itself.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ..core.report import section
from .diagnose import Diagnosis, gib
from .parse import Findings, world_disagreement
from .run_report import fmt_size


def render(d: Diagnosis, f: Findings, verbose: bool = False) -> str:
    """The answer first (summary, verdict, next command, why, the run table, the remedies and what not to try
    first), warnings about the input always; ``verbose`` (-v): the reference detail too (what else is in the log,
    the evidence lines), which the default names in one line."""
    label = "report" if d.verdict == "reported" else "diagnosis"
    lines = [f"{label}: {d.summary}", f"verdict: {d.verdict} (exit {d.exit_code}); confidence: {d.confidence}"]
    if d.rank is not None:
        lines.append(f"rank: {d.rank}")
    if d.next_command:
        lines.append(f"next command: {d.next_command}")
        if d.command_check:
            lines.append(f"  checked: {d.command_check}")
    lines += section("why", d.reasons)
    if d.run_lines:
        lines += d.run_lines
    if d.unknown:
        lines += section("unknown (not in the log)", d.unknown)
    lines += section("notes from the logged config", d.notes, marker="!")
    remedies = []
    # How a remedy's command was checked is said where it differs from how the next command was: one job's
    # remedies are mostly checked the same way, and eight copies of that line bury the remedies.
    said = d.command_check if d.next_command else None
    folded = []

    def checked(check: Any) -> list[str]:
        if check == said:
            folded.append(check)
            return []
        return [f"   checked: {check}"]
    for i, r in enumerate(d.remedies, 1):
        saves = "" if r["saves_bytes"] is None else f"; saves {gib(r['saves_bytes'])}"
        remedies.append(f"{i}. {r['name']}: {r['action']}" + (f" (cost: {r['cost']}{saves})" if r["cost"] or saves else ""))
        if r.get("step_cost"):   # --plan: the cost model's price for this job (memory/cost/)
            remedies.append(f"   step cost: {r['step_cost']['text']}")
        if r.get("predicted_peak_bytes") is not None:
            size = (lambda b, u=(d.run or {}).get("display_unit", "GiB"): fmt_size(b, u))
            planned = "" if r.get("planned_hot_bytes") is None else f"planned {size(r['planned_hot_bytes'])}; "
            fits = ({True: "fits with the margin", False: "does NOT fit with the margin"}.get(
                r["fits"], "fit unknown (no capacity)") if r.get("fit") != "unknown" else "fit unknown: " + ", ".join(
                    f"{g['name']}={g['value']}" for g in r.get("unmodelled", [])) + " not modelled")
            remedies.append(f"   plan: hot rank {planned}predicted peak {size(r['predicted_peak_bytes'])} (the measured "
                            f"peak plus the plan's change): {fits}")
        if r.get("megatron") is not None:
            m = r["megatron"]
            remedies += megatron_lines(r)[:1] + (checked(m.get("check")) if m.get("ok") else [])
        elif r.get("train_command"):
            remedies.append(f"   {r['train_command']}")
            remedies += checked(r["check"])
        elif r.get("check"):
            remedies.append(f"   not possible here: {r['check']}")
    title = "remedies, in order" if d.verdict != "reported" else "changes, in order"
    if folded:
        title += " (each command checked as the next command, unless it says otherwise)"
    lines += section(title, remedies, marker="")
    if d.savings:
        lines.append(f"  {d.savings}")
    lines += section("not first", d.why_not)   # what not to try first is advice, not reference
    reference = (("also in the log", d.also, "-"), ("evidence", d.evidence, ""))
    if verbose:
        for title, items, marker in reference:
            lines += section(title, items, marker=marker)
    lines += section("inputs", f.problems, marker="!")
    lines += section("world sizes in the log disagree", world_disagreement(f), marker="!")
    if f.memory_unreadable_count and not d.run:   # with a run report, its own lines list them
        lines += section(f"memory lines that could not be used ({f.memory_unreadable_count}; no verdict is drawn "
                         "from them)", unreadable_memory_lines(f), marker="!")
    ranks = {o.rank for o in f.ooms if o.rank is not None}
    lines.append(f"read {f.bytes_read / 1e6:.1f} MB from {len(f.files)} file(s); {len(f.ooms)} allocator OOM message(s)"
                 + (f" on rank(s) {', '.join(map(str, sorted(ranks)[:16]))}" if ranks else "")
                 + (f"; {len(f.events)} other failure/signal line(s)" if f.events else "")
                 + (f"; memory lines from {len(d.run['ranks'])} rank(s)" if d.run else ""))
    held = [f"{title} ({len(items)})" for title, items, _ in reference if items]
    if held and not verbose:
        lines.append(f"more with -v: {', '.join(held)}")
    return "\n".join(lines)


def as_json(d: Diagnosis, f: Findings) -> dict[str, Any]:
    out = asdict(d)
    out.pop("run_lines", None)
    out["exit_code"] = d.exit_code
    out.update({"files": f.files, "problems": f.problems, "bytes_read": f.bytes_read,
                "world_size": f.world.value if f.world else None,
                "torch_version": ".".join(map(str, f.torch_version.value)) if f.torch_version else None,
                "layout": f.layout, "events": [asdict(e) for e in f.events[:64]],
                "world_sizes": [{"value": c.value, "kind": c.kind, "text": c.text, "where": c.where,
                                 "used": bool(f.world) and c.value == f.world.value and c.where == f.world.where}
                                for c in f.world_sizes],
                "memory_unreadable": {"count": f.memory_unreadable_count,
                                      "reports": [{"where": r.where, "why": r.unreadable, "line": r.line[:400]}
                                                  for r in f.memory_unreadable]}})
    return out


def unreadable_memory_lines(f: Findings) -> list[str]:
    """Each memory report that could not be used, with why (the first ones; the count of the rest)."""
    rows = [f"{r.where}: {r.unreadable}" for r in f.memory_unreadable]
    if f.memory_unreadable_count > len(f.memory_unreadable):
        rows.append(f"... and {f.memory_unreadable_count - len(f.memory_unreadable)} more")
    return rows


def megatron_lines(r: dict) -> list[str]:
    """A Megatron-LM job's remedy: its flags (or the whole command) and how megatron-core checked them, or why no
    flags can make it."""
    m = r["megatron"]
    if not m.get("ok"):
        return [f"   not possible for this job: {m.get('reason')}"]
    return [f"   {m.get('text')}", f"   checked: {m.get('check')}"]
