"""The allocator's state at any trace entry: the dump's segments and blocks, with later entries undone.

The trace is a ring of the *last* events (Bridge keeps 100,000), so the state at the start of the ring is
unknown; the state at the dump is exact. The state after entry ``i`` is the dump with entries ``n-1 .. i+1``
undone, last first (as PyTorch's MemoryViz.js ``simulate_memory`` does). One backward pass gives the totals
after every entry; a second captures the full state (every live block and segment) at the chosen moment.
Both are linear in the number of entries.

Statistics follow the caching allocator (c10/cuda/CUDACachingAllocator.cpp): ``allocated`` drops at
``free_requested`` (``free()`` decreases allocated_bytes), ``active`` at ``free_completed`` (``free_block``);
``reserved`` changes with ``segment_alloc``/``segment_free`` and, for expandable segments,
``segment_map``/``segment_unmap``. Trace entries carry the *requested* size, not the block's. A block alive at
the dump has its exact size; a block that was freed later (and is re-created by undoing the free) gets the size
the allocator would have given it (``round_size``; the whole fresh segment when a ``segment_alloc`` precedes it
and the remainder is too small to split), and where that is not certain, an upper bound on the error is kept.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any

from . import model as M

MIN_BLOCK = 512                 # kMinBlockSize
SMALL_SIZE = 1 << 20            # kSmallSize: requests up to this use the small pool
LARGE_BUFFER = 20 << 20         # kLargeBuffer: slack an oversize block may carry
ROUNDUP_START = 1 << 20         # kRoundUpPowerOfTwoStart
# Expandable segments map memory in granules of the pool's segment size (CUDACachingAllocator ExpandableSegment:
# "2MB for small pool, 20MB for large pool"; segment_size = pool->is_small ? kSmallBuffer : large_segment_size()).
SMALL_GRANULE = 2 << 20         # kSmallBuffer
LARGE_GRANULE = 20 << 20        # kLargeBuffer
MAX_RANGES = 4096               # separate mapped ranges kept; a real trace has a handful per stream and pool



def rounded_size(size: int, div: int) -> int:
    """CUDACachingAllocator round_size for a request of ``size`` bytes with ``div`` power-of-two divisions in its
    size class (roundup_power2_next_division; 0 or 1: none): at least kMinBlockSize, else a multiple of it, or
    with divisions the next of ``div`` equal steps between two powers of two. One copy for the backward replay
    and the forward allocator model (allocator.py)."""
    if size < MIN_BLOCK:
        return MIN_BLOCK
    if div > 1 and size > MIN_BLOCK * div:
        if size & (size - 1) == 0:
            return size
        floor = 1 << (size.bit_length() - 1)
        step = floor >> (div.bit_length() - 1)
        if step == 0:
            return floor << 1
        rounded = size & ~(step - 1)
        return size if rounded == size else rounded + step
    return MIN_BLOCK * ((size + MIN_BLOCK - 1) // MIN_BLOCK)

@dataclass(frozen=True)
class Rounding:
    """What the allocator's settings say about block sizes (allocator_settings, when the file has them)."""
    divisions: tuple[int, ...] = ()    # roundup_power2_divisions per power-of-two interval from 1 MiB
    max_split: int = M.MAX_INT
    expandable: bool = False

    @classmethod
    def from_settings(cls, settings: dict[str, Any], expandable: bool) -> Rounding:
        table = settings.get("roundup_power2_divisions")
        divisions: tuple[int, ...] = ()
        if isinstance(table, dict):
            values = [table.get(str(1 << i)) for i in range(16)]
            if all(type(v) is int and v >= 0 for v in values):
                divisions = tuple(values)
        split = settings.get("max_split_size")
        max_split = split if type(split) is int and 0 < split < M.MAX_INT else M.MAX_INT
        on = settings.get("expandable_segments")
        return cls(divisions, max_split, expandable or on is True)

    def round_size(self, size: int) -> int:
        """CUDACachingAllocator round_size."""
        return rounded_size(size, self._divisions(size) if size >= MIN_BLOCK else 0)

    def _divisions(self, size: int) -> int:
        if not self.divisions:
            return 0
        index = max(0, (size.bit_length() - 1) - (ROUNDUP_START.bit_length() - 1))
        return self.divisions[min(index, len(self.divisions) - 1)]

    def block(self, requested: int, fresh_segment: int | None) -> tuple[int, int]:
        """(block size, bound on how much larger the real block may be)."""
        r = self.round_size(requested)
        small = r <= SMALL_SIZE
        if fresh_segment is not None and fresh_segment >= r:
            remaining = fresh_segment - r
            split = remaining >= MIN_BLOCK if (small or self.expandable) else (r < self.max_split
                                                                              and remaining > SMALL_SIZE)
            return (r if split else fresh_segment), 0
        if small or self.expandable:
            return r, MIN_BLOCK - 1          # a free block less than 512 B larger is taken whole
        return r, (LARGE_BUFFER if r >= self.max_split else SMALL_SIZE)


class Intervals:
    """Mapped address ranges of expandable segments: add merges neighbours, remove splits."""

    def __init__(self):
        self.starts: list[int] = []
        self.ends: dict[int, tuple[int, int]] = {}   # start -> (end, stream)
        self.total = 0

    def add(self, start: int, size: int, stream: int, force: bool = False) -> bool:
        """Map [start, start+size); False (nothing changed) when that would exceed MAX_RANGES separate ranges
        (``force``: the dump's own segments, which are always kept)."""
        if len(self.starts) >= MAX_RANGES and not force:
            return False
        end = start + size
        i = bisect.bisect_left(self.starts, start)
        if i > 0:
            prev = self.starts[i - 1]
            pend, pstream = self.ends[prev]
            if pend >= start:          # touching or overlapping the previous range: merge
                self.total -= pend - prev
                start, end = prev, max(end, pend)
                stream = pstream
                del self.starts[i - 1]
                del self.ends[prev]
                i -= 1
        while i < len(self.starts) and self.starts[i] <= end:
            nxt = self.starts[i]
            nend, _ = self.ends.pop(nxt)
            self.total -= nend - nxt
            end = max(end, nend)
            del self.starts[i]
        self.starts.insert(i, start)
        self.ends[start] = (end, stream)
        self.total += end - start
        return True

    def remove(self, start: int, size: int) -> bool:
        end = start + size
        i = bisect.bisect_right(self.starts, start) - 1
        if i < 0:
            return False
        s = self.starts[i]
        e, stream = self.ends[s]
        if e < end or (s < start and end < e and len(self.starts) >= MAX_RANGES):
            return False
        del self.starts[i]
        del self.ends[s]
        self.total -= e - s
        if s < start:
            self.add(s, start - s, stream, force=True)   # within the bound checked above
        if end < e:
            self.add(end, e - end, stream, force=True)
        return True

    def ranges(self) -> list[tuple[int, int, int]]:
        return [(s, self.ends[s][0] - s, self.ends[s][1]) for s in self.starts]

    def copy(self) -> Intervals:
        other = Intervals()
        other.starts, other.ends, other.total = list(self.starts), dict(self.ends), self.total
        return other


@dataclass
class LiveBlock:
    size: int
    requested: int
    pending: bool
    frames: Any
    error: int = 0               # how much larger the real block may be (0: exact)
    frames_from_free: bool = False


@dataclass(frozen=True)
class State:
    """Every live block and segment at one moment. ``position`` p is the state after p entries (0: the start of
    the ring, n: the dump)."""
    position: int
    blocks: dict[int, LiveBlock]
    segments: dict[int, tuple[int, int, tuple | None]]   # non-expandable: address -> (size, stream, pool)
    mapped: Intervals                                     # expandable segments' mapped ranges


@dataclass
class Timeline:
    """Totals after each entry: index p holds the state after p entries (p = 0 .. n). Plain lists: a hostile file's
    sums may pass any fixed-width integer."""
    allocated: list
    active: list
    requested: list
    reserved: list
    delta_frames: list          # per entry, the stack of the block whose allocation it changed (None: none)
    delta_bytes: list           # per entry, the change of allocated bytes
    inconsistent: int = 0       # entries the dump contradicts (e.g. a free of a block that was not live)
    estimated_error: list | None = None  # per position, the bound on allocated bytes from estimated block sizes
    snapshot_checks: tuple[int, int] = (0, 0)   # (markers matched, markers checked): 'snapshot' entries hold active


def dump_state(segments: list[M.Segment]) -> State:
    blocks: dict[int, LiveBlock] = {}
    plain: dict[int, tuple[int, int, tuple | None]] = {}
    mapped = Intervals()
    for seg in sorted((s for s in segments if s.expandable), key=lambda s: s.address):
        mapped.add(seg.address, seg.total_size, seg.stream, force=True)   # in address order: appends, not inserts
    for seg in segments:
        if not seg.expandable:
            plain[seg.address] = (seg.total_size, seg.stream, seg.pool)
        for b in seg.blocks:
            if b.state != "inactive":
                blocks[b.address] = LiveBlock(b.size, b.requested, b.state == "pending", b.frames)
    return State(-1, blocks, plain, mapped)


def _pairs(trace: M.Trace, rounding: Rounding) -> tuple[dict[int, int], dict[int, tuple[int, int]], set[int]]:
    """Forward pass: each free_completed's alloc (by address), each alloc's estimated (size, error), and the
    free_completed entries no free_requested announced.

    The allocator records free_requested in free() and free_completed in free_block() for every free (at once,
    or once the other streams' events complete), but _record_memory_history(skip_actions=["free_requested"])
    drops the first (torch/cuda/memory.py documents exactly that example; record_trace returns early for a
    skipped action). Undoing such a free_completed restores an *allocated* block, not a pending one."""
    free_to_alloc: dict[int, int] = {}
    estimate: dict[int, tuple[int, int]] = {}
    open_allocs: dict[int, int] = {}
    requested_since_alloc: set[int] = set()
    unannounced: set[int] = set()
    act, addr, size = trace.action, trace.addr, trace.size
    any_requested = M.FREE_REQUESTED in act
    for i in range(len(trace)):
        a = act[i]
        if a == M.ALLOC:
            fresh = None
            if i > 0 and act[i - 1] == M.SEGMENT_ALLOC and addr[i - 1] == addr[i]:
                fresh = size[i - 1]   # the block was cut from the segment just allocated for it
            estimate[i] = rounding.block(size[i], fresh)
            open_allocs[addr[i]] = i
            requested_since_alloc.discard(addr[i])
        elif a == M.FREE_REQUESTED:
            requested_since_alloc.add(addr[i])
        elif a == M.FREE_COMPLETED:
            j = open_allocs.pop(addr[i], None)
            if j is not None:
                free_to_alloc[i] = j
            announced = addr[i] in requested_since_alloc
            requested_since_alloc.discard(addr[i])
            # an alloc before the ring's start: its free_requested may be there too, unless none was recorded
            if not announced and (j is not None or not any_requested):
                unannounced.add(i)
    return free_to_alloc, estimate, unannounced


class Replayer:
    """Undo a device's trace from its dump state (see the module docstring)."""

    def __init__(self, segments: list[M.Segment], trace: M.Trace, rounding: Rounding):
        self.segments, self.trace, self.rounding = segments, trace, rounding
        self.free_to_alloc, self.estimate, self.unannounced = _pairs(trace, rounding)

    def _run(self, capture: int | None):
        """Undo every entry (or down to ``capture``); returns (state at capture or None, timeline)."""
        t = self.trace
        n = len(t)
        state = dump_state(self.segments)
        live, plain, mapped = state.blocks, state.segments, state.mapped
        allocated = sum(b.size for b in live.values() if not b.pending)
        active = sum(b.size for b in live.values())
        requested = sum(b.requested for b in live.values() if not b.pending)
        error = 0
        reserved = sum(s for s, _, _ in plain.values()) + mapped.total
        keep = capture is None
        if keep:
            a_arr, c_arr, q_arr, r_arr, e_arr = ([0] * (n + 1) for _ in range(5))
            d_bytes = [0] * n
            d_frames: list = [None] * n
        checked = matched = 0
        inconsistent = 0
        act, addr, size, frames, streams = t.action, t.addr, t.size, t.frames, t.stream
        captured = None
        for i in range(n - 1, -2, -1):
            p = i + 1      # the state now is the state after i+1 entries
            if keep:
                a_arr[p], c_arr[p], q_arr[p], r_arr[p], e_arr[p] = allocated, active, requested, reserved, error
            if capture is not None and p == capture:
                captured = State(p, {k: LiveBlock(b.size, b.requested, b.pending, b.frames, b.error,
                                                  b.frames_from_free) for k, b in live.items()},
                                 dict(plain), mapped.copy())
                break
            if i < 0:
                break
            a = act[i]
            if a == M.ALLOC:
                b = live.pop(addr[i], None)
                if b is None or b.pending:
                    inconsistent += 1
                    if b is not None:
                        live[addr[i]] = b
                    continue
                allocated -= b.size
                active -= b.size
                requested -= b.requested
                error -= b.error
                if keep:
                    d_bytes[i], d_frames[i] = b.size, (b.frames if b.frames else frames[i])
            elif a == M.FREE_REQUESTED:
                b = live.get(addr[i])
                if b is None or not b.pending:
                    inconsistent += 1
                    continue
                b.pending = False
                allocated += b.size
                requested += b.requested
                error += b.error
                if keep:
                    d_bytes[i], d_frames[i] = -b.size, b.frames
            elif a == M.FREE_COMPLETED:
                if addr[i] in live:
                    inconsistent += 1
                    continue
                j = self.free_to_alloc.get(i)
                if j is not None:
                    bsize, berr = self.estimate[j]
                    bframes, from_free = frames[j] or frames[i], not frames[j]
                else:
                    bsize, berr = self.rounding.block(size[i], None)
                    bframes, from_free = frames[i], True
                pending = i not in self.unannounced
                live[addr[i]] = LiveBlock(bsize, size[i], pending, bframes, berr, from_free)
                active += bsize
                if not pending:   # free_requested was not recorded: the block was allocated until here
                    allocated += bsize
                    requested += size[i]
                    error += berr
                    if keep:
                        d_bytes[i], d_frames[i] = -bsize, bframes
            elif a == M.SEGMENT_ALLOC:
                seg = plain.pop(addr[i], None)
                if seg is None:
                    inconsistent += 1
                    continue
                reserved -= seg[0]
            elif a == M.SEGMENT_FREE:
                if addr[i] in plain:
                    inconsistent += 1
                    continue
                plain[addr[i]] = (size[i], streams[i], t.pool[i])
                reserved += size[i]
            elif a == M.SEGMENT_MAP:
                if not mapped.remove(addr[i], size[i]):
                    inconsistent += 1
                    continue
                reserved -= size[i]
            elif a == M.SEGMENT_UNMAP:
                if not mapped.add(addr[i], size[i], streams[i]):
                    inconsistent += 1
                    continue
                reserved += size[i]
            elif a == M.SNAPSHOT and keep:
                checked += 1
                matched += active == size[i]    # the marker holds the device's active bytes after entry i
        timeline = None
        if keep:
            timeline = Timeline(a_arr, c_arr, q_arr, r_arr, d_frames, d_bytes, inconsistent, e_arr, (matched, checked))
        return captured, timeline

    def timeline(self) -> Timeline:
        return self._run(None)[1]

    def state_at(self, position: int) -> State:
        """The full state after ``position`` entries (0 .. n)."""
        n = len(self.trace)
        if position >= n:
            s = dump_state(self.segments)
            return State(n, s.blocks, s.segments, s.mapped)
        captured, _ = self._run(position)
        return captured
