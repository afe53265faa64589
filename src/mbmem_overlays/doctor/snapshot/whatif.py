"""What if the job had run with other allocator settings: the snapshot's trace replayed through the allocator
model (allocator.py) under the file's settings and under others, on a GPU of the capacity the OOM shows.

The capacity is the OOM entry's ``device_free`` plus the bytes the allocator had reserved at that moment: what
this process's allocator could have held. Without an OOM it is ``--gpu-memory`` (less nothing: memory outside
the allocator is unknown), and without either only the peaks are given. The replay starts from the state at
the first trace entry (replay.py) and makes the same requests in the same order on the same streams; it stops
at the first OOM entry, the request that failed, and tries it.

Limits (stated in every report): the program is assumed to make the same requests under other settings (a
program that adapts to free memory would not); memory outside the allocator (NCCL, the CUDA context, other
processes) is taken as constant; the layout before the ring's first entry is the recorded one; a CUDA graph's
private pool is never released (its graphs' destruction is not in the trace); garbage collection runs only
under ``torch.cuda.set_per_process_memory_fraction`` (CUDACachingAllocator.cpp malloc: ``set_fraction &&``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...core import allocconf
from ...core.errors import short_repr
from . import allocator as A
from . import model as M
from .analyze import gib
from .replay import Replayer, Rounding

# allocator_settings keys torch writes (torch/csrc/cuda/Module.cpp, _cuda_memorySnapshot "allocator_settings")
# that do not change where device memory goes: pinned host memory and locking.
NO_PLACEMENT_KEYS = {"PYTORCH_CUDA_ALLOC_CONF", "pinned_num_register_threads", "release_lock_on_cudamalloc",
                     "pinned_use_cuda_host_register", "pinned_use_background_threads", "pinned_max_register_threads",
                     "graph_capture_record_stream_reuse", "last_allocator_settings"}
MODELLED_KEYS = {"max_split_size", "garbage_collection_threshold", "expandable_segments", "roundup_power2_divisions",
                 "max_non_split_rounding_size"}
# what-if keys, written as in PYTORCH_CUDA_ALLOC_CONF (CUDAAllocatorConfig.cpp parseArgs); one more of our own:
# per_process_memory_fraction (torch.cuda.set_per_process_memory_fraction, not an allocator-config key).
WHAT_IF_KEYS = ("expandable_segments", "max_split_size_mb", "garbage_collection_threshold",
                "roundup_power2_divisions", "max_non_split_rounding_mb", "per_process_memory_fraction")
USEFUL = ("expandable_segments:True", "max_split_size_mb:512", "max_split_size_mb:128",
          "roundup_power2_divisions:4", "expandable_segments:True,roundup_power2_divisions:4")
MB = 1 << 20


class WhatIfError(ValueError):
    """A --what-if value that is not a setting the model knows."""


def settings_of_file(raw: dict, segments: list[M.Segment], trace: M.Trace | None) -> tuple[A.Settings, list[str]]:
    """The file's allocator settings as the model's, and what the model does not know (notes)."""
    notes: list[str] = []
    seen_expandable = any(s.expandable for s in segments) or (
        trace is not None and (M.SEGMENT_MAP in trace.action or M.SEGMENT_UNMAP in trace.action))
    if not raw:
        notes.append("the file does not record its allocator settings (older torch): the model assumes the defaults"
                     + (", with expandable segments (the file has them)" if seen_expandable else ""))
        return A.Settings(expandable_segments=seen_expandable), notes
    split = raw.get("max_split_size")
    max_split = split if type(split) is int and 0 < split < A.NO_LIMIT else A.NO_LIMIT
    gc = raw.get("garbage_collection_threshold")
    gc = float(gc) if type(gc) in (int, float) and 0 <= gc < 1 else 0.0
    table = raw.get("roundup_power2_divisions")
    divisions: tuple[int, ...] = ()
    if isinstance(table, dict):
        values = [table.get(str(1 << i)) for i in range(16)]
        if all(type(v) is int and v >= 0 for v in values):
            divisions = tuple(values) if any(values) else ()
        else:
            notes.append("roundup_power2_divisions in the file is not the 16-entry table the model reads: "
                         "rounding assumed off")
    rounding = raw.get("max_non_split_rounding_size")
    non_split = rounding if type(rounding) is int and rounding > 0 else A.K_LARGE_BUFFER
    unknown = sorted(k for k in raw if k not in MODELLED_KEYS and k not in NO_PLACEMENT_KEYS)
    if unknown:
        notes.append("allocator settings the model does not know (their effect is not replayed): "
                     + ", ".join(unknown[:8]))
    expandable = raw.get("expandable_segments") is True or seen_expandable
    return A.Settings(max_split, divisions, expandable, gc, non_split), notes


def parse_what_if(text: str, base: A.Settings) -> A.Settings:
    """One --what-if value (PYTORCH_CUDA_ALLOC_CONF syntax, parsed by core/allocconf.py) applied over ``base``.

    Every refusal shows the value through one bounded formatter (core/errors.py short_repr, as allocconf.py's own
    messages do): a 100,000-digit number was echoed whole (issue 39 #16)."""
    said = short_repr(text)
    try:
        pairs = allocconf.parse("--what-if", text)
    except allocconf.AllocConfError as exc:
        raise WhatIfError(str(exc)) from None
    if not pairs:
        raise WhatIfError("--what-if '' names no setting; e.g. --what-if expandable_segments:True, or --what-if all")
    s = base
    for key, value in pairs.items():
        try:
            if key == "expandable_segments":
                s = replace(s, expandable_segments=value == "True")
            elif key == "max_split_size_mb":
                mb = int(value)
                if mb <= A.K_LARGE_BUFFER // MB:   # CUDAAllocatorConfig::parseMaxSplitSize: must be > 20
                    raise WhatIfError(f"--what-if {said}: max_split_size_mb must be above 20 (torch refuses "
                                      "smaller), e.g. max_split_size_mb:512")
                s = replace(s, max_split_size=mb * MB)
            elif key == "max_non_split_rounding_mb":
                s = replace(s, max_non_split_rounding_size=int(value) * MB)
            elif key == "garbage_collection_threshold":
                v = float(value)
                if not 0 < v < 1:
                    raise WhatIfError(f"--what-if {said}: garbage_collection_threshold must be in (0, 1), "
                                      "e.g. garbage_collection_threshold:0.8")
                s = replace(s, garbage_collection_threshold=v)
            elif key == "per_process_memory_fraction":
                v = float(value)
                if not 0 < v <= 1:
                    raise WhatIfError(f"--what-if {said}: per_process_memory_fraction must be in (0, 1]")
                s = replace(s, memory_fraction=v)
            elif key == "roundup_power2_divisions":
                if value.startswith("["):
                    raise WhatIfError(f"--what-if {said}: the per-size list form of roundup_power2_divisions is "
                                      "not modelled; give one number, e.g. roundup_power2_divisions:4")
                v = int(value)
                if v != 0 and (v < 2 or v & (v - 1)):
                    raise WhatIfError(f"--what-if {said}: roundup_power2_divisions must be a power of 2 "
                                      "(torch's check), e.g. roundup_power2_divisions:4")
                s = replace(s, roundup_power2_divisions=(v,) * 16 if v else ())
            else:
                raise WhatIfError(f"--what-if {said}: {short_repr(key)} is not a setting the model replays; known: "
                                  + ", ".join(WHAT_IF_KEYS) + " (or --what-if all)")
        except ValueError as exc:
            if isinstance(exc, WhatIfError):
                raise
            raise WhatIfError(f"--what-if {said}: {short_repr(key)}:{short_repr(value)} is not a number where "
                              "one is needed") from None
    return s


@dataclass(frozen=True)
class Scenario:
    label: str                   # the --what-if text, or "the file's settings"
    settings: A.Settings
    peak_reserved: int
    peak_unallocated: int        # peak of reserved - allocated
    largest_free: int | None     # the largest free block of the request's stream and pool, at the request
    served: bool | None          # None: no capacity known or no failing request
    spare: int | None            # capacity left after serving the request
    short: int | None            # bytes missing when not served
    failed_at: int | None        # trace index where the model ran out before the request (None: it did not)
    note: str = ""

    def as_json(self) -> dict:
        return {"label": self.label, "settings": self.settings.describe(), "peak_reserved_bytes": self.peak_reserved,
                "peak_reserved_unallocated_bytes": self.peak_unallocated, "largest_free_block_bytes": self.largest_free,
                "served": self.served, "spare_bytes": self.spare, "short_bytes": self.short,
                "failed_at_trace_index": self.failed_at, "note": self.note}


def replay(trace: M.Trace, start: A.StartState, settings: A.Settings, capacity: int | None,
           request: int | None, label: str) -> Scenario:
    """The trace's requests under ``settings`` on a GPU of ``capacity`` bytes for this allocator, up to the
    entry ``request`` (the failing one), which is then tried."""
    alloc = A.Allocator(settings, A.ModelDevice(None, 0, 0))
    orphans = A.load_start(alloc, start)
    top = max([a + s for a, (s, *_r) in start.plain.items()] + [a + s for a, s, *_r in start.mapped] +
              [a + v[0] for a, v in start.blocks.items()] + [1 << 40])
    alloc.device = A.ModelDevice(capacity, alloc.stats.reserved, (top // A.K_LARGE_BUFFER + 2) * A.K_LARGE_BUFFER)
    if settings.memory_fraction is not None and capacity is None:
        settings = replace(settings, memory_fraction=None)
        alloc.s = settings
    where: dict[int, A.Block] = dict(alloc.live)       # the file's address -> the model's block
    act, addr, size, stream, pools = trace.action, trace.addr, trace.size, trace.stream, trace.pool
    deferred = A.deferred_frees(trace)
    empty_cache = A.empty_cache_calls(trace)
    end = len(act) if request is None else request
    failed_at = None
    for i in range(end):
        a = act[i]
        if a == M.ALLOC:
            b = alloc.malloc(size[i], stream[i], pools[i])
            if b is None:
                failed_at = i
                break
            where[addr[i]] = b
        elif a == M.FREE_REQUESTED:
            b = where.get(addr[i])
            if b is not None and b.allocated:
                alloc.free(b.ptr, deferred[i])
        elif a == M.FREE_COMPLETED:
            b = where.pop(addr[i], None)
            if b is not None and (b.allocated or b.pending):
                alloc.free_block(b)
        elif i in empty_cache:
            alloc.release_cached_blocks()
    st = alloc.stats
    note = f"{orphans} block(s) alive at the start lie in no known segment" if orphans else ""
    if failed_at is not None:
        return Scenario(label, settings, st.peak_reserved, st.peak_unallocated, None, False, None, None, failed_at,
                        note)
    if request is None:
        return Scenario(label, settings, st.peak_reserved, st.peak_unallocated, None, None, None, None, None, note)
    want = size[request]
    rsize = A.round_size(want, settings)
    pool = alloc.pool(rsize <= A.K_SMALL_SIZE, pools[request])
    largest = max((k[1] for k in pool.keys if k[0] == stream[request]), default=0)
    b = alloc.malloc(want, stream[request], pools[request])
    peak_r, peak_u = st.peak_reserved, st.peak_unallocated
    if capacity is None:
        return Scenario(label, settings, peak_r, peak_u, largest, None, None, None, None, note)
    if b is not None:
        return Scenario(label, settings, peak_r, peak_u, largest, True, capacity - alloc.device.reserved, None, None,
                        note)
    need = A.allocation_size(rsize) if not settings.expandable_segments else rsize
    return Scenario(label, settings, peak_r, peak_u, largest, False, None,
                    max(0, need - (capacity - alloc.device.reserved)), None, note)


@dataclass(frozen=True)
class DeviceWhatIf:
    device: int
    entries: int                 # trace entries of the device
    capacity: int | None
    capacity_source: str
    request: int | None          # trace index of the failing request
    request_bytes: int | None
    scenarios: tuple[Scenario, ...]
    proof: A.Proof
    notes: tuple[str, ...]

    @property
    def baseline(self) -> Scenario:
        return self.scenarios[0]

    def fitting(self) -> list[Scenario]:
        return [s for s in self.scenarios[1:] if s.served]


def analyse(snap: M.Snapshot, wanted: list[str], gpu_memory: int | None, keep_choices: bool = True
            ) -> list[DeviceWhatIf]:
    """Per device with a trace: the proof on the file and each wanted scenario (``all``: the useful ones)."""
    out = []
    for device in sorted(d for d, t in snap.traces.items() if len(t)):
        trace = snap.traces[device]
        segments = snap.segments.get(device, [])
        base, notes = settings_of_file(snap.allocator_settings, segments, trace)
        rounding = Rounding.from_settings(snap.allocator_settings, base.expandable_segments)
        replayer = Replayer(segments, trace, rounding)
        start = A.start_state(replayer.state_at(0), segments, trace)
        proof = A.prove(trace, start, base, keep_choices)
        ooms = [i for i in range(len(trace)) if trace.action[i] == M.OOM]
        request = ooms[0] if ooms else None
        if request is not None:
            reserved = replayer.timeline().reserved[request]
            capacity, source = trace.addr[request] + reserved, "the OOM entry's device_free + reserved"
        elif gpu_memory is not None:
            capacity, source = gpu_memory, "--gpu-memory"
        else:
            capacity, source = None, "unknown (no OOM in the trace, no --gpu-memory): peaks only"
        labels = [x for w in wanted for x in (USEFUL if w == "all" else (w,))]
        scenarios = [replay(trace, start, base, capacity, request, "the file's settings")]
        for label in dict.fromkeys(labels):
            s = parse_what_if(label, base)
            sc = replay(trace, start, s, capacity, request, label)
            if s.garbage_collection_threshold > 0 and s.memory_fraction is None:
                sc = replace(sc, note=(sc.note + "; " if sc.note else "") + "garbage_collection_threshold has no "
                             "effect without torch.cuda.set_per_process_memory_fraction (add "
                             "per_process_memory_fraction:F to replay both)")
            scenarios.append(sc)
        out.append(DeviceWhatIf(device, len(trace), capacity, source, request, trace.size[request] if request is not None else None,
                                tuple(scenarios), proof, tuple(notes)))
    return out


def verdict_line(d: DeviceWhatIf) -> str:
    """One line for a device: which setting would have served the failing request, by how much, or none."""
    if d.request is None:
        best = min(d.scenarios, key=lambda s: s.peak_reserved)
        return (f"no failing request in the trace; the lowest peak reserved is {gib(best.peak_reserved)} with "
                f"{best.label}")
    if d.capacity is None:
        return "capacity unknown: give --gpu-memory to judge the failing request"
    if d.baseline.served:
        return ("the model serves the failing request with the file's own settings too: the OOM is not reproduced "
                "(memory outside the allocator changed, or the model differs here); no setting can be judged")
    fits = d.fitting()
    if not fits:
        return "no allocator setting serves it (replayed): capacity"
    fits = sorted(fits, key=lambda s: -s.spare)
    # expandable segments first when they serve it: NVIDIA's first remedy for fragmentation, at no cost
    lead = next((s for s in fits if s.settings.expandable_segments and s.label.startswith("expandable_segments")),
                fits[0])
    line = f"with {lead.label} the failing request is served with {gib(lead.spare)} to spare (replayed)"
    others = [f"{s.label} ({gib(s.spare)})" for s in fits if s is not lead]
    return line + (f"; also served with: {', '.join(others)}" if others else "")


def check_values(wanted: list[str]) -> str | None:
    """A message for the first --what-if value that cannot be replayed (checked before any file is read)."""
    for w in wanted:
        if w == "all":
            continue
        try:
            parse_what_if(w, A.Settings())
        except WhatIfError as exc:
            return str(exc)
    return None
