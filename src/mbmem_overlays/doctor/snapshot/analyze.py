"""From a checked snapshot to figures and a verdict: per device, at the OOM (or the peak), by site.

Pure functions over frozen dataclasses; nothing here reads files or prints. The verdict follows the log
doctor's rule (memory-tuning skill, Failure Diagnosis; doctor/diagnose.py ``assess``) on exact replayed numbers:
fragmentation only when CUDA's free memory plus the reserved-but-unallocated memory that could serve this
request (same stream, same pool size class, the default pool) covers it; other processes when the GPU's
capacity is known and what is neither PyTorch's nor free would have covered it; else capacity.
"""

from __future__ import annotations

import bisect
import os
import re
from dataclasses import dataclass, field
from typing import Any

from . import model as M
from .replay import LARGE_GRANULE, SMALL_GRANULE, SMALL_SIZE, Replayer, Rounding, State
from .sites import Attributor, plan_component

GiB = 1 << 30
RING_FULL = 100_000          # Bridge's trace_alloc_max_entries: a trace this long lost its oldest events
OTHERS_MIN = 2 * GiB         # non-PyTorch memory below this is the CUDA context, NCCL and workspaces as usual
_OOM_NAME = re.compile(r"_oom_rank-(\d+)(\.[^/]*)?$")
_SCHEDULED_NAME = re.compile(r"_(\d+)(\.pickle|\.pkl)(\.gz)?$")
_OOM_WORD = re.compile(r"(^|[^a-z])oom([^a-z]|$)", re.I)   # oom_snapshot.pickle, rank0-OOM.pkl; not "room"


def gib(n: float | None) -> str:
    """A byte count for people: GiB from 1 GiB up, else MiB, KiB or bytes (JSON keeps the exact bytes)."""
    if n is None:
        return "unknown"
    size = abs(n)
    for unit, scale in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class Totals:
    reserved: int
    allocated: int
    active: int
    requested: int
    segments: int
    largest_free: int

    @property
    def inactive(self) -> int:
        return self.reserved - self.active

    @property
    def pending(self) -> int:
        return self.active - self.allocated

    def as_json(self) -> dict[str, int]:
        return {"reserved_bytes": self.reserved, "allocated_bytes": self.allocated, "active_bytes": self.active,
                "requested_bytes": self.requested, "inactive_bytes": self.inactive,
                "largest_free_block_bytes": self.largest_free, "segments": self.segments}


def dump_totals(segments: list[M.Segment]) -> Totals:
    """Exact sums over the snapshot's segments and blocks."""
    blocks = [b for s in segments for b in s.blocks]
    return Totals(sum(s.total_size for s in segments),
                  sum(b.size for b in blocks if b.state == "allocated"),
                  sum(b.size for b in blocks if b.state != "inactive"),
                  sum(b.requested for b in blocks if b.state == "allocated"),
                  len(segments), max((b.size for b in blocks if b.state == "inactive"), default=0))


@dataclass(frozen=True)
class SegmentView:
    address: int
    size: int
    stream: int
    kind: str                 # small | large
    pool: tuple | None
    expandable: bool
    blocks: tuple[tuple[int, int, str, str], ...]   # (offset, size, allocated|pending|free, site)
    largest_free: int
    tail_free: int            # the free block at the end (an expandable segment can grow there)


@dataclass(frozen=True)
class Usage:
    name: str
    bytes: int
    count: int
    category: str = ""


@dataclass(frozen=True)
class Moment:
    device: int
    kind: str                 # oom | peak | dump
    position: int             # the state after this many trace entries
    entries: int
    time_us: int | None
    totals: Totals
    error_bytes: int          # the real allocated bytes may be up to this much larger (estimated block sizes)
    estimated_blocks: int
    segments: tuple[SegmentView, ...]
    sites: tuple[Usage, ...]
    categories: tuple[Usage, ...]
    outside_segments: int = 0

    @property
    def components(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.categories:
            key = plan_component(c.name)
            out[key] = out.get(key, 0) + c.bytes
        return out


@dataclass(frozen=True)
class OOMFinding:
    device: int
    entry: int
    count: int                # oom entries in this device's trace
    time_us: int | None
    request: int              # the rounded request (what the allocator tried to find)
    device_free: int
    stream: int
    allocated: int
    reserved: int
    usable_free: int          # reserved-but-unallocated that could serve this request
    largest_usable_free: int
    expandable: bool
    mapping_could_give: int | None    # expandable: the largest tail free block + what CUDA still had free
    other_bytes: int | None   # capacity - reserved - device_free (with --gpu-memory)
    freed_after: int          # allocated bytes freed between the OOM and the dump (unwinding)
    kind: str                 # fragmentation | capacity | other_processes
    reasons: tuple[str, ...]
    margin_uncertain: bool    # estimated block sizes could change the verdict


@dataclass(frozen=True)
class DeviceReport:
    device: int
    dump: Totals
    entries: int
    ring_full: bool
    peak_position: int | None
    peak_allocated: int | None
    peak_time_us: int | None
    inconsistent: int
    snapshot_checks: tuple[int, int]
    moment: Moment | None
    oom: OOMFinding | None


@dataclass(frozen=True)
class Report:
    path: str
    rank: int | None
    dump_kind: str            # oom_observer | scheduled | oom_named | unknown (from the file name)
    format: M.Format
    devices: tuple[DeviceReport, ...]
    lead: int | None          # the device reported first: the failing one, else the highest peak
    kind: str                 # fragmentation | capacity | other_processes | oom_unknown | none | empty
    confidence: str
    reasons: tuple[str, ...]
    problems: tuple[str, ...]
    allocator_settings: dict[str, Any] = field(default_factory=dict)
    file_bytes: int = 0
    torch_predates_expandable: bool = False

    @property
    def lead_device(self) -> DeviceReport | None:
        return next((d for d in self.devices if d.device == self.lead), None)

    @property
    def oom(self) -> OOMFinding | None:
        d = self.lead_device
        return d.oom if d else None

    @property
    def moment(self) -> Moment | None:
        d = self.lead_device
        return d.moment if d else None


def name_hints(path: str) -> tuple[int | None, str]:
    """(rank, dump kind) from Bridge's file names: <base>_oom_rank-<R><ext> and <base>_<R><ext>."""
    base = os.path.basename(path)
    m = _OOM_NAME.search(base)
    if m:
        return int(m.group(1)), "oom_observer"
    m = _SCHEDULED_NAME.search(base)
    if m:
        return int(m.group(1)), "scheduled"
    if _OOM_WORD.search(base):
        return None, "oom_named"
    return None, "unknown"


def _time(trace: M.Trace, position: int) -> int | None:
    if not len(trace):
        return None
    t = trace.time_us[min(max(position - 1, 0), len(trace) - 1)]
    return t or None


def _kinds(segments: list[M.Segment]) -> tuple[dict[int, str], list[tuple[int, int, str]]]:
    plain = {s.address: s.kind for s in segments if not s.expandable}
    exp = sorted((s.address, s.stream, s.kind) for s in segments if s.expandable)
    return plain, exp


def _expandable_kind(start: int, size: int, stream: int, exp_kinds: list[tuple[int, int, str]], exp_addrs: list[int],
                     state: State, block_addrs: list[int]) -> str:
    """The pool (small | large) of a mapped range of an expandable segment. Each pool and stream has its own
    segment, a virtual range of its own; the dump names the kind of the ranges it shows. A range the replay
    re-created (unmapped by the dump) is judged by its blocks, as get_pool routes them: a block over kSmallSize
    can only be the large pool's, one at most kSmallSize only the small pool's (round_size keeps it there);
    else by the granule: the small pool maps 2 MiB at a time, the large 20 MiB."""
    end = start + size
    # a dump range inside this one (the replay only merges ranges of one segment); the dump's ranges are sorted by
    # address, so only those inside [start, end) are looked at: linear over all ranges, not ranges x segments
    for j in range(bisect.bisect_left(exp_addrs, start), bisect.bisect_left(exp_addrs, end)):
        if exp_kinds[j][1] == stream:
            return exp_kinds[j][2]
    i = bisect.bisect_left(block_addrs, start)
    if i < len(block_addrs) and block_addrs[i] < end:   # the range's first block decides
        return "large" if state.blocks[block_addrs[i]].size > SMALL_SIZE else "small"
    return "large" if size % LARGE_GRANULE == 0 or size % SMALL_GRANULE else "small"


def moment_of(snap_segments: list[M.Segment], trace: M.Trace, state: State, kind: str, device: int,
              attributor: Attributor) -> Moment:
    """Totals, segment layout, sites and categories of one captured state."""
    plain_kinds, exp_kinds = _kinds(snap_segments)
    segs: list[tuple[int, int, int, str, tuple | None, bool]] = []
    for addr, (size, stream, pool) in state.segments.items():
        segs.append((addr, size, stream, plain_kinds.get(addr, "small" if size == M.SMALL_SEGMENT else "large"),
                     pool, False))
    block_addrs = sorted(state.blocks)
    exp_addrs = [a for a, _, _ in exp_kinds]
    for start, size, stream in state.mapped.ranges():
        segs.append((start, size, stream, _expandable_kind(start, size, stream, exp_kinds, exp_addrs, state,
                                                           block_addrs), None, True))
    # a total order: a plain and an expandable segment may share an address in a hostile file, and None (an
    # expandable range's pool) does not compare with a tuple
    segs.sort(key=lambda s: (s[0], s[1], s[2], s[3], s[5], s[4] or ()))
    starts = [s[0] for s in segs]
    per_segment: list[list[tuple[int, Any]]] = [[] for _ in segs]
    outside = 0
    for addr, b in state.blocks.items():
        i = bisect.bisect_right(starts, addr) - 1
        if i < 0 or addr >= segs[i][0] + segs[i][1]:
            outside += 1
            continue
        per_segment[i].append((addr, b))
    sites: dict[str, list] = {}
    cats: dict[str, list] = {}
    views = []
    allocated = active = requested = error = estimated = 0
    largest_free = 0
    for (addr, size, stream, skind, pool, exp), blocks in zip(segs, per_segment):
        blocks.sort(key=lambda x: x[0])
        layout: list[tuple[int, int, str, str]] = []
        cursor, seg_largest, tail = addr, 0, 0
        private = pool is not None and pool != (0, 0)
        for baddr, b in blocks:
            if baddr > cursor:
                gap = baddr - cursor
                layout.append((cursor - addr, gap, "free", ""))
                seg_largest = max(seg_largest, gap)
            site = attributor.site(b.frames, private)
            state_name = "pending" if b.pending else "allocated"
            layout.append((baddr - addr, b.size, state_name, site.text))
            active += b.size
            if not b.pending:
                allocated += b.size
                requested += b.requested
                error += b.error
                estimated += b.error > 0
                for table, key in ((sites, site.text), (cats, site.category)):
                    entry = table.setdefault(key, [0, 0, site.category])
                    entry[0] += b.size
                    entry[1] += 1
            cursor = max(cursor, baddr + b.size)
        end = addr + size
        if cursor < end:
            tail = end - cursor
            layout.append((cursor - addr, tail, "free", ""))
            seg_largest = max(seg_largest, tail)
        largest_free = max(largest_free, seg_largest)
        views.append(SegmentView(addr, size, stream, skind, pool, exp, tuple(layout), seg_largest, tail))
    reserved = sum(s[1] for s in segs)
    totals = Totals(reserved, allocated, active, requested, len(segs), largest_free)
    order = lambda table: tuple(Usage(k, v[0], v[1], v[2]) for k, v in  # noqa: E731
                                sorted(table.items(), key=lambda kv: (-kv[1][0], kv[0])))
    return Moment(device, kind, state.position, len(trace), _time(trace, state.position), totals, error, estimated,
                  tuple(views), order(sites), tuple(Usage(u.name, u.bytes, u.count) for u in order(cats)), outside)


def oom_finding(moment: Moment, trace: M.Trace, entry: int, count: int, dump_allocated: int, expandable_on: bool,
                capacity: float | None) -> OOMFinding:
    request, device_free, stream = trace.size[entry], trace.addr[entry], trace.stream[entry]
    small = request <= SMALL_SIZE
    pool_kind = "small" if small else "large"
    # The pool the request was served from (the oom entry's pool_id, newer torch): a private pool while a CUDA
    # graph is captured (get_pool), whose failing malloc may not release the default pool's cached blocks
    # (release_cached_blocks only when captures_underway is empty): only that pool's free blocks could serve it.
    request_pool = trace.pool[entry] if entry < len(trace.pool) else None
    private = request_pool is not None and request_pool != (0, 0)
    usable = [s for s in moment.segments if s.kind == pool_kind and s.stream == stream
              and (s.pool == request_pool if private else (s.pool is None or s.pool == (0, 0)))]
    usable_free = sum(size for s in usable for _, size, st, _ in s.blocks if st == "free")
    largest_usable = max((s.largest_free for s in usable), default=0)
    t = moment.totals
    reasons: list[str] = []
    where = f"device {moment.device}, trace entry {entry + 1} of {len(trace)}"
    pool_words = f"private pool {request_pool} (CUDA graph capture)" if private else f"{pool_kind} pool"
    reasons.append(f"{where}: the allocator could not find {gib(request)} ({request:,} bytes, {pool_words}, "
                   f"stream {stream}); CUDA reported {gib(device_free)} free")
    reasons.append(f"at that moment PyTorch had {gib(t.allocated)} allocated and {gib(t.reserved)} reserved "
                   f"({gib(t.reserved - t.allocated)} reserved but unallocated, {gib(usable_free)} of it in "
                   f"{pool_kind}-{'block segments of that private pool' if private else 'pool segments'} of this "
                   f"stream that could serve the request; largest such free block {gib(largest_usable)})")
    if private:
        reasons.append("during a capture the allocator does not release the default pool's cached blocks to serve "
                       "a private pool (release_cached_blocks runs only when no capture is under way), so the "
                       "default pool's free memory could not help")
    freed_after = max(0, t.allocated - dump_allocated)
    if freed_after and moment.position < len(trace):
        reasons.append(f"the dump was taken {len(trace) - moment.position} trace entries after the OOM: "
                       f"{gib(freed_after)} allocated at the failure had been freed by then (the exception unwound), "
                       "so the dump shows it as inactive, which looks like fragmentation; these figures are the "
                       "state replayed back to the OOM")
    mapping = None
    granule = SMALL_GRANULE if small else LARGE_GRANULE
    if expandable_on:
        tails = [s.tail_free for s in moment.segments if s.expandable and s.kind == pool_kind and s.stream == stream]
        mapping = max(tails, default=0) + (device_free // granule) * granule
    other = None
    if capacity is not None:
        other = max(0, int(capacity) - t.reserved - device_free)
    avail = device_free + usable_free
    uncertain = False
    if expandable_on:
        reasons.append(f"expandable segments are on: the largest request mapping could still serve is "
                       f"{gib(mapping)} (a free tail of {gib(mapping - (device_free // granule) * granule)} plus CUDA's "
                       f"free memory in whole {gib(granule)} granules of the {pool_kind} pool)"
                       + (", so the memory was really used up" if mapping < request else
                          ", which covers the request: the failure is not this allocator's mapping (another process "
                          "took the memory meanwhile, or a limit such as set_per_process_memory_fraction)"))
        kind = "capacity"
        if other is not None and other >= OTHERS_MIN and avail + other >= request:
            kind = "other_processes"
    elif avail >= request:
        reasons.append(f"{gib(device_free)} free + {gib(usable_free)} usable reserved-but-unallocated = {gib(avail)} "
                       f">= the {gib(request)} request: the memory exists but no single free block is large enough "
                       "(fragmentation)")
        kind = "fragmentation"
        uncertain = avail - moment.error_bytes < request
    else:
        reasons.append(f"{gib(device_free)} free + {gib(usable_free)} usable reserved-but-unallocated = {gib(avail)} "
                       f"< the {gib(request)} request (short by {gib(request - avail)}): defragmenting cannot serve it")
        kind = "capacity"
        if other is not None and other >= OTHERS_MIN and avail + other >= request:
            kind = "other_processes"
    if other is not None:
        reasons.append(f"of the {gib(capacity)} GPU, {gib(other)} was neither PyTorch's nor free: this process's CUDA "
                       "context, NCCL and library workspaces, and any other process"
                       + ("; without the other processes the request would have fitted"
                          if kind == "other_processes" else ""))
    if count > 1:
        reasons.append(f"the trace holds {count} OOM entries on this device; this is the last")
    return OOMFinding(moment.device, entry, count, _time(trace, entry + 1), request, device_free, stream, t.allocated,
                      t.reserved, usable_free, largest_usable, expandable_on, mapping, other, freed_after, kind,
                      tuple(reasons), uncertain)


def _device(device: int, segments: list[M.Segment], trace: M.Trace, rounding: Rounding, capacity: float | None,
            attributor: Attributor, expandable_on: bool) -> DeviceReport:
    dump = dump_totals(segments)
    n = len(trace)
    if not n:
        state = Replayer(segments, trace, rounding).state_at(0)
        moment = moment_of(segments, trace, state, "dump", device, attributor)
        return DeviceReport(device, dump, 0, False, None, None, None, 0, (0, 0), moment, None)
    replayer = Replayer(segments, trace, rounding)
    tl = replayer.timeline()
    allocs = tl.allocated
    peak = max(range(len(allocs)), key=allocs.__getitem__)
    ooms = [i for i in range(n) if trace.action[i] == M.OOM]
    if ooms:
        entry = ooms[-1]
        state = replayer.state_at(entry + 1)
        moment = moment_of(segments, trace, state, "oom", device, attributor)
        oom = oom_finding(moment, trace, entry, len(ooms), dump.allocated, expandable_on, capacity)
    else:
        state = replayer.state_at(peak)
        moment = moment_of(segments, trace, state, "peak", device, attributor)
        oom = None
    return DeviceReport(device, dump, n, n >= RING_FULL, peak, allocs[peak], _time(trace, peak), tl.inconsistent,
                        tl.snapshot_checks, moment, oom)


def analyze(snap: M.Snapshot, path: str, file_bytes: int = 0, capacity: float | None = None) -> Report:
    rank, dump_kind = name_hints(path)
    all_segments = [s for segs in snap.segments.values() for s in segs]
    expandable_on = any(s.expandable for s in all_segments) or snap.allocator_settings.get("expandable_segments") \
        is True or "expandable segments" in snap.format.features
    rounding = Rounding.from_settings(snap.allocator_settings, expandable_on)
    attributor = Attributor()
    devices = tuple(_device(d, snap.segments.get(d, []), snap.traces.get(d, M.Trace()), rounding, capacity,
                            attributor, expandable_on) for d in snap.devices)
    problems = list(snap.problems)
    for d in devices:
        if d.inconsistent:
            problems.append(f"device {d.device}: {d.inconsistent} trace entr{'y' if d.inconsistent == 1 else 'ies'} "
                            "contradict the dump (e.g. a free of a block that was not live); they were skipped")
        if d.moment and d.moment.outside_segments:
            problems.append(f"device {d.device}: {d.moment.outside_segments} live block(s) outside every segment")
    failing = [d for d in devices if d.oom is not None]
    predates = bool(all_segments) and not snap.allocator_settings and not any(
        "expandable" in f for f in snap.format.features) and "block history (older torch)" in snap.format.features
    reasons: list[str] = []
    if failing:
        lead = max(failing, key=lambda d: (d.oom.time_us or 0, d.device))
        f = lead.oom
        kind = f.kind
        exact = not lead.inconsistent and not f.margin_uncertain
        confidence = "high" if exact else "medium"
        reasons += f.reasons
        if len(failing) > 1:
            reasons.append(f"devices {', '.join(str(d.device) for d in failing)} each have an OOM entry; device "
                           f"{lead.device} failed last")
    elif not devices:
        lead, kind, confidence = None, "empty", "high"
        reasons.append("the snapshot is empty: no segment and no trace entry on any device (nothing was allocated, "
                       "or the dump came from a process that never used the GPU)")
    else:
        lead = max(devices, key=lambda d: (d.peak_allocated if d.peak_allocated is not None else d.dump.allocated,
                                           -d.device))
        if dump_kind in ("oom_observer", "oom_named"):
            kind, confidence = "oom_unknown", "low"
            who = "Bridge's OOM observer wrote it" if dump_kind == "oom_observer" else "it was written at an OOM"
            failure = " (the state at the failure)" if dump_kind == "oom_observer" else ""
            reasons.append(f"the file name says {who}, but its trace has no 'oom' entry (history was not recorded, or "
                           "the ring lost it): the failed request and CUDA's free memory are unknown; "
                           + (f"the figures are the state at the dump{failure}" if lead.moment.kind == "dump" else
                              f"the figures below are the state at the trace's peak allocation; the dump{failure} "
                              f"holds {gib(lead.dump.allocated)} allocated"))
            t = lead.dump
            if t.reserved and t.reserved - t.allocated < 0.02 * t.reserved:
                reasons.append(f"at the dump only {gib(t.reserved - t.allocated)} of the {gib(t.reserved)} reserved "
                               "was unallocated: if this is the state at the failure, fragmentation was not the "
                               "cause")
        else:
            kind, confidence = "none", "high"
            where = ("the peak of the recorded trace" if lead.entries else "the dump (no trace: history was not "
                     "recorded)")
            reasons.append(f"no OOM in this snapshot; device {lead.device} is reported at {where}")
    return Report(path, rank, dump_kind, snap.format, devices, lead.device if lead else None, kind, confidence,
                  tuple(reasons), tuple(problems), dict(snap.allocator_settings), file_bytes, predates)


# ----------------------------------------------------------------------------- comparing two runs
@dataclass(frozen=True)
class Change:
    name: str
    a: int
    b: int

    @property
    def delta(self) -> int:
        return self.a - self.b


@dataclass(frozen=True)
class Comparison:
    a: Report
    b: Report
    settings: tuple[tuple[str, Any, Any], ...]      # allocator_settings that differ: (key, A, B)
    totals: tuple[Change, ...]
    categories: tuple[Change, ...]
    sites: tuple[Change, ...]


def _changes(a: tuple[Usage, ...], b: tuple[Usage, ...]) -> tuple[Change, ...]:
    av, bv = {u.name: u.bytes for u in a}, {u.name: u.bytes for u in b}
    rows = [Change(k, av.get(k, 0), bv.get(k, 0)) for k in set(av) | set(bv)]
    return tuple(sorted(rows, key=lambda c: (-c.delta, c.name)))


def compare(a: Report, b: Report) -> Comparison:
    """What grew in A against B, each at its moment (the OOM, else the peak), allocator settings first."""
    keys = sorted(set(a.allocator_settings) | set(b.allocator_settings))
    settings = tuple((k, a.allocator_settings.get(k), b.allocator_settings.get(k)) for k in keys
                     if a.allocator_settings.get(k) != b.allocator_settings.get(k))
    ma, mb = a.moment, b.moment
    empty: tuple[Usage, ...] = ()
    totals = ()
    if ma and mb:
        totals = tuple(Change(name, getattr(ma.totals, attr), getattr(mb.totals, attr))
                       for name, attr in (("allocated", "allocated"), ("reserved", "reserved"),
                                          ("active", "active"), ("largest free block", "largest_free")))
    return Comparison(a, b, settings, totals, _changes(ma.categories if ma else empty, mb.categories if mb else empty),
                      _changes(ma.sites if ma else empty, mb.sites if mb else empty))
