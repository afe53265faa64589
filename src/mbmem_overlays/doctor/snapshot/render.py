"""A snapshot report (and a comparison) as text and as JSON; everything taken from the file is escaped.

JSON layout (``schema_version`` 1), one object per file; docs/snapshots.md documents every key.
"""

from __future__ import annotations

import datetime as _dt
import math
from typing import Any

from ...core.report import section
from ...core.text import shown
from .advice import Advice
from .analyze import Comparison, DeviceReport, Report, gib
from .model import shown_value
from .whatif import verdict_line as what_if_verdict

SCHEMA_VERSION = 1
VERDICT = {"fragmentation": "diagnosed", "capacity": "diagnosed", "other_processes": "diagnosed",
           "oom_unknown": "unsure", "none": "reported", "empty": "reported"}
EXIT = {"diagnosed": 0, "reported": 0, "unsure": 4}
SUMMARY = {
    "fragmentation": "allocator fragmentation: free + usable reserved-but-unallocated memory covered the request",
    "capacity": "genuine capacity limit at the OOM: free + usable reserved-but-unallocated memory was smaller than "
                "the request",
    "other_processes": "other processes on the GPU held the memory the request needed",
    "oom_unknown": "out of memory, but the snapshot does not hold the failed request (no 'oom' trace entry)",
    "none": "no OOM: the state at the peak of the recorded trace",
    "empty": "empty snapshot: nothing allocated",
}
DUMP = {"oom_observer": "written at the OOM by Bridge's observer (the file name says so)",
        "scheduled": "Bridge's scheduled dump at profile_step_end (the file name says so)",
        "oom_named": "written at an OOM (the file name says so)",
        "unknown": "dump kind unknown (not one of Bridge's file names)"}


def summary(report: Report) -> str:
    if report.kind == "none" and report.moment is not None and report.moment.kind == "dump":
        return "no OOM: the state at the dump (the file has no trace to replay)"
    oom = report.oom
    if report.kind == "capacity" and oom is not None and oom.expandable:
        # with expandable segments a request is served from a free block or by mapping more of CUDA's free memory
        # at the segment's end, so "free + reserved" is not the test (analyze.oom_finding)
        return ("genuine capacity limit at the OOM: with expandable segments, no free block and no mapping of "
                "CUDA's free memory could serve the request")
    return SUMMARY[report.kind]


def verdict(report: Report) -> str:
    return VERDICT[report.kind]


def exit_code(report: Report) -> int:
    return EXIT[verdict(report)]


def when(time_us: int | None) -> str:
    if not time_us:
        return ""
    try:
        return _dt.datetime.fromtimestamp(time_us / 1e6, tz=_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S.%f UTC")
    except (OverflowError, OSError, ValueError):
        return ""


def _pct(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "-"


# ----------------------------------------------------------------------------- text
def _device_rows(devices: tuple[DeviceReport, ...], lead: int | None) -> list[str]:
    head = (f"  {'device':>6}  {'reserved':>10}  {'allocated':>10}  {'active':>10}  {'requested':>10}  "
            f"{'inactive':>10}  {'segments':>8}  {'largest free':>12}  {'entries':>8}  {'peak alloc':>10}")
    rows = ["per device, at the dump (exact sums over segments and blocks):", head]
    for d in devices:
        t = d.dump
        mark = " *" if d.device == lead else ""
        rows.append(f"  {d.device:>6}  {gib(t.reserved):>10}  {gib(t.allocated):>10}  {gib(t.active):>10}  "
                    f"{gib(t.requested):>10}  {gib(t.inactive):>10}  {t.segments:>8}  {gib(t.largest_free):>12}  "
                    f"{d.entries:>8}  {gib(d.peak_allocated) if d.peak_allocated is not None else '-':>10}{mark}")
    rows.append("  (* the device reported above; peak alloc: the highest allocated bytes in the recorded trace)")
    return rows


def render(report: Report, advice: Advice, top: int, plan_lines: list[str] | None = None) -> str:
    lines = [f"snapshot: {shown(report.path)}"
             + (f" (rank {report.rank}, from the file name)" if report.rank is not None else ""),
             f"format: {shown(report.format.description)}; {DUMP[report.dump_kind]}",
             f"devices in the file: {', '.join(map(str, (d.device for d in report.devices))) or 'none'}"
             + (f"; device {report.oom.device} failed" if report.oom else ""),
             f"diagnosis: {summary(report)}",
             f"verdict: {verdict(report)} (exit {exit_code(report)}); confidence: {report.confidence}"]
    if advice.next_command:
        lines.append(f"next command: {shown(advice.next_command)}")
        lines.append(f"  checked: {shown(advice.command_check)}")
    lines += section("why", [shown(r) for r in (*report.reasons, *advice.reasons)])
    m = report.moment
    if m is not None:
        t = m.totals
        at = {"oom": "at the OOM", "peak": "at the peak of the trace", "dump": "at the dump"}[m.kind]
        stamp = when(m.time_us)
        where = f"after trace entry {m.position} of {m.entries}" if m.entries else "no trace in the file"
        lines.append(f"state {at} on device {m.device} ({where}" + (f", {stamp}" if stamp else "") + "):")
        exact = ("exact" if not m.error_bytes else
                 f"up to {gib(m.error_bytes)} more: {m.estimated_blocks} block(s) freed before the dump have sizes "
                 "estimated from their requested sizes")
        lines += [f"  allocated {gib(t.allocated)} ({exact}); requested {gib(t.requested)}; "
                  f"active {gib(t.active)} ({gib(t.pending)} freed but awaiting other streams)",
                  f"  reserved {gib(t.reserved)} in {t.segments} segment(s); reserved but unallocated "
                  f"{gib(t.reserved - t.allocated)}; largest free block {gib(t.largest_free)}"]
        frag = sorted(m.segments, key=lambda s: -s.largest_free)[:3]
        if frag and frag[0].largest_free:
            lines.append("  largest free blocks: " + "; ".join(
                f"{gib(s.largest_free)} in the {gib(s.size)} {s.kind}{' expandable' if s.expandable else ''} "
                f"segment at 0x{s.address:x}" for s in frag if s.largest_free))
        total = t.allocated or 1
        lines.append(f"live memory {at} by category (allocated blocks):")
        lines += [f"  {shown(c.name):<44} {gib(c.bytes):>11}  {_pct(c.bytes, total):>4}  {_blocks(c.count):>13}"
                  for c in m.categories[:top]]
        lines.append(f"top {min(top, len(m.sites))} allocation sites of {len(m.sites)} (first frame of user or "
                     "Megatron code):")
        lines += [f"  {i}. {shown(s.name)}\n       {gib(s.bytes)}  {_pct(s.bytes, total)}  {_blocks(s.count)}  "
                  f"[{shown(s.category)}]" for i, s in enumerate(m.sites[:top], 1)]
    if plan_lines:
        lines += plan_lines
    if len(advice.remedies) > 1:
        lines += section("remedies, in order", [f"{i}. {r.name}: {r.action}" + (f" (cost: {r.cost})" if r.cost else "")
                                               for i, r in enumerate(advice.remedies, 1)], marker="")
    lines += _device_rows(report.devices, report.lead) if report.devices else []
    notes = []
    for d in report.devices:
        if d.ring_full:
            notes.append(f"device {d.device}: the trace holds {d.entries:,} entries, Bridge's whole 100,000-event ring: "
                         "older events were dropped, so the peak is the peak of this window")
        matched, checked = d.snapshot_checks
        if checked:
            notes.append(f"device {d.device}: the replay matches {matched} of {checked} 'snapshot' markers of the trace "
                         "(each records the device's active bytes)")
    conf = report.allocator_settings.get("PYTORCH_CUDA_ALLOC_CONF")
    if isinstance(conf, str):
        notes.append(f"the job ran with PYTORCH_CUDA_ALLOC_CONF={shown(conf)}" if conf else
                     "the job ran without PYTORCH_CUDA_ALLOC_CONF settings (allocator_settings)")
    lines += section("notes", notes)
    lines += section("problems in the file", [shown(p) for p in report.problems], marker="!")
    lines.append("not in a snapshot: NCCL and other non-PyTorch allocations, the CUDA context, other ranks' memory")
    return "\n".join(lines)


def render_comparison(c: Comparison, top: int) -> str:
    a, b = c.a, c.b

    def moment(r: Report) -> str:
        m = r.moment
        if m is None:
            return "no state"
        return f"{ {'oom': 'at the OOM', 'peak': 'at its peak', 'dump': 'at the dump'}[m.kind]} on device {m.device}"

    lines = [f"comparing A: {shown(a.path)} ({moment(a)}, {summary(a)})",
             f"against  B: {shown(b.path)} ({moment(b)}, {summary(b)})"]
    lines += section("allocator settings that differ (A vs B)",
                     [f"{shown(k)}: {_setting(va)} vs {_setting(vb)}" for k, va, vb in c.settings]) or \
        ["allocator settings: the same (or not in the files)"]
    lines.append("totals (A - B):")
    lines += [f"  {ch.name:<20} {gib(ch.a):>11} vs {gib(ch.b):>11}  {_signed(ch.delta)}" for ch in c.totals]
    grew = [ch for ch in c.categories if ch.delta]
    lines.append("what changed, by category (largest growth first):")
    lines += [f"  {shown(ch.name):<44} {_signed(ch.delta)}  ({gib(ch.b)} -> {gib(ch.a)})" for ch in grew[:top]] or \
        ["  nothing"]
    lines.append("what changed, by allocation site (largest growth first):")
    lines += [f"  {_signed(ch.delta)}  {shown(ch.name)}  ({gib(ch.b)} -> {gib(ch.a)})"
              for ch in [s for s in c.sites if s.delta][:top]] or ["  nothing"]
    return "\n".join(lines)


def _setting(value: Any) -> str:
    """An allocator setting as written: text quoted (so an empty one shows as ''), absent as (not in the file)."""
    if value is None:
        return "(not in the file)"
    return shown_value(value, 200)


def _blocks(n: int) -> str:
    return f"{n:,} block{'' if n == 1 else 's'}"


def _signed(n: int) -> str:
    return ("+" if n > 0 else "-" if n < 0 else "±") + gib(abs(n))


# ----------------------------------------------------------------------------- JSON
def _device_json(d: DeviceReport, lead: int | None) -> dict[str, Any]:
    out: dict[str, Any] = {"device": d.device, **d.dump.as_json(), "trace_entries": d.entries, "ring_full": d.ring_full,
                           "failed": d.oom is not None, "reported": d.device == lead,
                           "peak": None if d.peak_allocated is None else
                           {"allocated_bytes": d.peak_allocated, "time_us": d.peak_time_us,
                            "trace_position": d.peak_position},
                           "replay_inconsistencies": d.inconsistent,
                           "snapshot_markers": {"matched": d.snapshot_checks[0], "checked": d.snapshot_checks[1]}}
    return out


MAX_SEGMENTS_JSON = 1000


def _segments_json(segments) -> list[dict[str, Any]]:
    """Per segment at the moment, largest free block first (at most MAX_SEGMENTS_JSON)."""
    ordered = sorted(segments, key=lambda s: (-s.largest_free, s.address))[:MAX_SEGMENTS_JSON]
    return [{"address": s.address, "size_bytes": s.size, "kind": s.kind, "stream": s.stream,
             "expandable": s.expandable, "private_pool": s.pool not in (None, (0, 0)),
             "largest_free_block_bytes": s.largest_free, "tail_free_bytes": s.tail_free} for s in ordered]


def as_json(report: Report, advice: Advice, top: int, plan: dict[str, Any] | None = None) -> dict[str, Any]:
    m, f = report.moment, report.oom
    lead = report.lead_device
    peak = None
    if lead is not None:
        peak = ({"device": lead.device, "allocated_bytes": lead.peak_allocated, "time_us": lead.peak_time_us,
                 "trace_position": lead.peak_position} if lead.peak_allocated is not None else
                {"device": lead.device, "allocated_bytes": lead.dump.allocated, "time_us": None,
                 "trace_position": None})
    oom = None
    if f is not None:
        oom = {"device": f.device, "request_bytes": f.request, "device_free_bytes": f.device_free,
               "allocated_bytes": f.allocated, "reserved_bytes": f.reserved,
               "usable_reserved_unallocated_bytes": f.usable_free, "largest_usable_free_block_bytes": f.largest_usable_free,
               "expandable_segments": f.expandable, "mapping_could_give_bytes": f.mapping_could_give,
               "other_bytes": f.other_bytes, "freed_after_oom_bytes": f.freed_after, "stream": f.stream,
               "trace_entry": f.entry, "time_us": f.time_us, "oom_entries": f.count}
    out: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "file": report.path, "file_bytes": report.file_bytes, "rank": report.rank,
        "dump_kind": report.dump_kind,
        "format": {"layout": report.format.layout, "features": list(report.format.features),
                   "description": report.format.description},
        "devices": [_device_json(d, report.lead) for d in report.devices],
        "failed_device": f.device if f else None,
        "oom": oom, "peak": peak,
        "moment": None if m is None else {"device": m.device, "kind": m.kind, "trace_position": m.position,
                                          "time_us": m.time_us, **m.totals.as_json(),
                                          "allocated_error_bytes": m.error_bytes,
                                          "estimated_blocks": m.estimated_blocks,
                                          "segment_list": _segments_json(m.segments),
                                          "segment_list_truncated": len(m.segments) > MAX_SEGMENTS_JSON},
        "top_sites": [] if m is None else [{"site": s.name, "bytes": s.bytes, "count": s.count, "category": s.category}
                                           for s in m.sites[:top]],
        "categories": [] if m is None else [{"category": c.name, "bytes": c.bytes, "count": c.count}
                                            for c in m.categories],
        "kind": report.kind, "verdict": verdict(report), "confidence": report.confidence,
        "summary": summary(report), "reasons": [*report.reasons, *advice.reasons],
        "next_command": advice.next_command, "command_check": advice.command_check,
        "remedies": [{"name": r.name, "action": r.action, "cost": r.cost, "overlay": r.overlay, "env": r.env or None,
                      "command": r.command} for r in advice.remedies],
        "plan": plan, "allocator_settings": report.allocator_settings, "problems": list(report.problems),
        "exit_code": exit_code(report),
    }
    return json_safe(out)


def comparison_json(c: Comparison, top: int) -> dict[str, Any]:
    def rows(changes):
        return [{"name": ch.name, "a_bytes": ch.a, "b_bytes": ch.b, "delta_bytes": ch.delta} for ch in changes]
    return json_safe({
        "schema_version": SCHEMA_VERSION, "kind": "comparison", "a": c.a.path, "b": c.b.path,
        "a_moment": c.a.moment.kind if c.a.moment else None, "b_moment": c.b.moment.kind if c.b.moment else None,
        "allocator_settings_differ": [{"key": k, "a": va, "b": vb} for k, va, vb in c.settings],
        "totals": rows(c.totals), "categories": rows(c.categories), "sites": rows(c.sites[:top]), "exit_code": 0})


MAX_JSON_INT = 1 << 64


def json_safe(value: Any) -> Any:
    """``value`` as strict JSON can hold it (json.dumps(..., allow_nan=False) never raises on it): a NaN or an
    infinity becomes null, an integer past 64 bits its bounded text (json.dumps of a many-thousand-digit integer
    raises), tuples lists, keys text. Values from a file are checked where they are read (model.py); this is
    the last guard of every snapshot JSON the doctor prints."""
    t = type(value)
    if t is float:
        return value if math.isfinite(value) else None
    if t is int:
        return value if -MAX_JSON_INT < value < MAX_JSON_INT else shown_value(value)
    if t is dict:
        return {k if type(k) is str else shown_value(k): json_safe(v) for k, v in value.items()}
    if t in (list, tuple):
        return [json_safe(v) for v in value]
    return value


# -- --what-if: the trace replayed through the allocator model (whatif.py) -------------------------------------
WHAT_IF_LIMITS = ("limits: the replay makes the recorded requests in the recorded order under every setting (a "
                  "program that adapts to free memory would ask otherwise); memory outside the allocator (NCCL, the "
                  "CUDA context, other processes) is taken as constant; the layout before the trace's first entry is "
                  "the recorded one")


def _agreement(p, n: int) -> str:
    if p.not_proven:
        return f"not proven: {p.not_proven}"
    if not p.allocations:
        return "no allocation in the trace: nothing to prove"
    seg = p.segments
    text = (f"{p.allocations} allocation(s) replayed, {p.at_recorded} at the recorded address ({p.agreement:.1%}); "
            f"{seg.as_recorded} of {seg.as_recorded + seg.differed} segment events as recorded")
    if p.first_divergence is None:
        return text + "; no divergence"
    i, chose, did = p.first_divergence
    return text + f"; first divergence at trace entry {i + 1} of {n}: the model chose {chose}, the allocator {did}"


def _outcome(s) -> str:
    if s.failed_at is not None:
        return f"runs out earlier, at trace entry {s.failed_at + 1}"
    if s.served is None:
        return "-"
    if s.served:
        return f"served, {gib(s.spare)} to spare"
    return f"not served (short by {gib(s.short)})"


def render_what_if(devices) -> str:
    lines = ["what if (the trace replayed forward through a model of torch's CUDACachingAllocator):"]
    if not devices:
        lines.append("  no device has trace entries: nothing to replay (the snapshot was taken without "
                     "_record_memory_history)")
    for d in devices:
        lines.append(f"  device {d.device}: proof on the file: {_agreement(d.proof, d.entries)}")
        for note in d.notes:
            lines.append(f"  device {d.device}: {shown(note)}")
        cap = gib(d.capacity) if d.capacity is not None else "unknown"
        req = (f"; the failing request: trace entry {d.request + 1} of {d.entries}, {gib(d.request_bytes)}"
               if d.request is not None
               else "")
        lines.append(f"  device {d.device}: capacity {cap} ({d.capacity_source}){req}")
        lines.append(f"    {'settings':<52} {'peak reserved':>13} {'peak unalloc':>13} {'largest free':>13}  "
                     "the request")
        for s in d.scenarios:
            largest = gib(s.largest_free) if s.largest_free is not None else "-"
            lines.append(f"    {shown(s.label)[:52]:<52} {gib(s.peak_reserved):>13} {gib(s.peak_unallocated):>13} "
                         f"{largest:>13}  {_outcome(s)}")
            if s.note:
                lines.append(f"      note: {shown(s.note)}")
        lines.append(f"  verdict (device {d.device}): {what_if_verdict(d)}")
    lines.append("  " + WHAT_IF_LIMITS)
    return "\n".join(lines)


def what_if_json(devices, with_choices: bool = True) -> list[dict[str, Any]]:
    out = []
    for d in devices:
        p = d.proof
        out.append({
            "device": d.device, "capacity_bytes": d.capacity, "capacity_source": d.capacity_source,
            "request_trace_index": d.request, "request_bytes": d.request_bytes, "notes": list(d.notes),
            "proof": {"allocations": p.allocations, "at_recorded_address": p.at_recorded,
                      "agreement": round(p.agreement, 6), "segments_as_recorded": p.segments.as_recorded,
                      "segments_differed": p.segments.differed, "not_proven": p.not_proven or None,
                      "first_divergence": None if p.first_divergence is None else
                      {"trace_index": p.first_divergence[0], "model_chose": p.first_divergence[1],
                       "allocator_did": p.first_divergence[2]},
                      "chosen": [{"trace_index": i, "address": a} for i, a in p.chosen] if with_choices else None},
            "scenarios": [s.as_json() for s in d.scenarios],
            "verdict": what_if_verdict(d)})
    return out
