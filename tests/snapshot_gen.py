"""Generated PyTorch memory snapshots: a small model of the CUDA caching allocator that writes the documented
schema (torch/cuda/memory.py ``_snapshot``; torch/csrc/cuda/Module.cpp) in each format version, with the
ground truth the reader is tested against.

The model follows c10/cuda/CUDACachingAllocator.cpp where the reader depends on it: ``round_size`` (512 B), the
small pool (requests <= 1 MiB, 2 MiB segments) and the large pool (20 MiB segments below 10 MiB, else rounded to
2 MiB), best fit within the stream's pool, ``should_split`` (small or expandable: remainder >= 512 B; large:
remainder > 1 MiB), ``free`` then ``free_block`` with neighbour merging, ``release_cached_blocks`` before an OOM,
and expandable segments that map granules of 2 MiB (small pool) or 20 MiB (large pool) at their end. Trace entries carry the requested size, as torch's do.

    python tests/snapshot_gen.py tests/fixtures/snapshots     # rewrite the committed fixtures

Nothing here is copied from a real snapshot; stacks are made up in Megatron's shape.
"""

from __future__ import annotations

import gzip
import pickle
import sys
from dataclasses import dataclass, field
from pathlib import Path

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
MIN_BLOCK, SMALL_SIZE, SMALL_BUFFER, LARGE_BUFFER, MIN_LARGE_ALLOC, ROUND_LARGE = 512, MiB, 2 * MiB, 20 * MiB, \
    10 * MiB, 2 * MiB
# expandable segments map granules of the pool's segment size: 2 MiB (small pool), 20 MiB (large pool)
def granule(small: bool) -> int:
    return SMALL_BUFFER if small else LARGE_BUFFER


T0 = 1_764_000_000_000_000   # time_us of the first entry (2025-11-24)


def frame(filename: str, line: int, name: str) -> dict:
    return {"filename": filename, "line": line, "name": name}


SITE = "/usr/local/lib/python3.12/site-packages/"
_FRAMES: dict[tuple, dict] = {}


def shared(filename: str, line: int, name: str) -> dict:
    """One dict per distinct frame, shared by every stack (torch's py_symbolize dedups them; pickle memoizes)."""
    key = (filename, line, name)
    if key not in _FRAMES:
        _FRAMES[key] = frame(filename, line, name)
    return _FRAMES[key]


CPP = [("??", 0, "torch::unwind::unwind()"), ("??", 0, "torch::CapturedTraceback::gather(bool, bool, bool)"),
       ("memory_snapshot.cpp", 0, "torch::cuda::(anonymous namespace)::gather_with_cpp()"),
       ("CUDACachingAllocator.cpp", 0, "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(int, "
                                       "unsigned long, CUstream_st*)"),
       ("??", 0, "at::detail::empty_strided_cuda(c10::ArrayRef<long>, c10::ArrayRef<long>, c10::ScalarType)"),
       ("RegisterCUDA.cpp", 0, "at::(anonymous namespace)::wrapper_CUDA__empty_strided(...)"),
       ("??", 0, "_PyEval_EvalFrameDefault")]
OUTER = [(SITE + "megatron/core/pipeline_parallel/schedules.py", 2018, "forward_step"),
         (SITE + "megatron/core/pipeline_parallel/schedules.py", 2210, "forward_backward_pipelining_without_interleaving"),
         (SITE + "megatron/bridge/training/train.py", 612, "train_step"),
         (SITE + "megatron/bridge/training/train.py", 301, "train"),
         ("/workspace/train.py", 88, "main")]
STACKS = {  # name -> innermost frames (framework internals first, then the Megatron site)
    "embedding": [(SITE + "torch/nn/functional.py", 2551, "embedding"),
                  (SITE + "megatron/core/models/common/embeddings/language_model_embedding.py", 112, "forward")],
    "qkv": [(SITE + "transformer_engine/pytorch/module/linear.py", 310, "forward"),
            (SITE + "megatron/core/extensions/transformer_engine.py", 420, "forward"),
            (SITE + "megatron/core/transformer/attention.py", 1012, "forward")],
    "core_attn": [(SITE + "torch/nn/functional.py", 5900, "scaled_dot_product_attention"),
                  (SITE + "megatron/core/transformer/dot_product_attention.py", 180, "forward")],
    "fc1": [(SITE + "transformer_engine/pytorch/module/linear.py", 310, "forward"),
            (SITE + "megatron/core/transformer/mlp.py", 150, "forward")],
    "logits": [(SITE + "megatron/core/tensor_parallel/layers.py", 990, "forward"),
               (SITE + "megatron/core/models/gpt/gpt_model.py", 480, "_postprocess")],
    "params": [(SITE + "torch/nn/parameter.py", 40, "__new__"),
               (SITE + "megatron/core/tensor_parallel/layers.py", 760, "__init__")],
    "grad_buffer": [(SITE + "torch/utils/_device.py", 104, "__torch_function__"),
                    (SITE + "megatron/core/distributed/param_and_grad_buffer.py", 820, "__init__")],
    "optimizer": [(SITE + "torch/optim/adam.py", 170, "_init_group"),
                  (SITE + "megatron/core/optimizer/optimizer.py", 520, "step")],
    "allgather": [(SITE + "torch/distributed/distributed_c10d.py", 3800, "all_gather_into_tensor"),
                  (SITE + "megatron/core/tensor_parallel/mappings.py", 280, "_gather_along_first_dim")],
}
SETUP_OUTER = [(SITE + "megatron/bridge/training/setup.py", 390, "setup"), ("/workspace/train.py", 80, "main")]


def stack(name: str, cpp: bool = False) -> list[dict]:
    outer = SETUP_OUTER if name in ("params", "grad_buffer") else OUTER
    frames = (CPP if cpp else []) + STACKS[name] + outer
    return [shared(*f) for f in frames]


def round_size(size: int) -> int:
    return MIN_BLOCK if size < MIN_BLOCK else MIN_BLOCK * ((size + MIN_BLOCK - 1) // MIN_BLOCK)


class SimOOM(Exception):
    pass


@dataclass
class Blk:
    addr: int
    size: int
    req: int = 0
    state: str = "inactive"          # active_allocated | active_pending_free | inactive
    frames: list = field(default_factory=list)


@dataclass
class Seg:
    addr: int
    size: int
    stream: int
    small: bool
    expandable: bool
    blocks: list[Blk]
    pool: tuple = (0, 0)


class Allocator:
    """One device's caching allocator (see the module docstring)."""

    def __init__(self, device: int = 0, capacity: int = 80 * GiB, other: int = 0, expandable: bool = False,
                 cpp_frames: bool = False, max_entries: int = 100_000, base: int = 0x7F0000000000):
        self.device, self.capacity, self.other, self.expandable = device, capacity, other, expandable
        self.cpp, self.max_entries = cpp_frames, max_entries
        self.next_addr = base + device * (1 << 40)
        self.segs: list[Seg] = []
        self.trace: list[dict] = []
        self.tick = 0
        self.truth: dict[str, int] = {}      # the state at the OOM, as the allocator saw it

    # ------------------------------------------------------------------ bookkeeping
    def _entry(self, action: str, addr: int, size: int, stream: int, frames: list | None) -> None:
        self.tick += 1
        e = {"action": action, ("device_free" if action == "oom" else "addr"): addr, "size": size, "stream": stream,
             "time_us": T0 + 37 * self.tick}
        if frames:
            e["frames"] = frames
        self.trace.append(e)

    @property
    def reserved(self) -> int:
        return sum(s.size for s in self.segs)

    def allocated(self) -> int:
        return sum(b.size for s in self.segs for b in s.blocks if b.state == "active_allocated")

    def active(self) -> int:
        return sum(b.size for s in self.segs for b in s.blocks if b.state != "inactive")

    @property
    def device_free(self) -> int:
        return self.capacity - self.other - self.reserved

    def _find(self, addr: int) -> tuple[Seg, int]:
        for s in self.segs:
            for i, b in enumerate(s.blocks):
                if b.addr == addr:
                    return s, i
        raise KeyError(hex(addr))

    # ------------------------------------------------------------------ allocation
    def malloc(self, req: int, site: str, stream: int = 0) -> int:
        r = round_size(req)
        small = r <= SMALL_SIZE
        frames = stack(site, self.cpp)
        found = self._best_fit(r, small, stream)
        if found is None:
            found = self._grow(r, small, stream, frames)
        if found is None:
            self.release_cached()
            found = self._grow(r, small, stream, frames)
        if found is None:
            self.truth = {"request": r, "device_free": self.device_free, "allocated": self.allocated(),
                          "reserved": self.reserved, "active": self.active(), "position": len(self.trace)}
            self._entry("oom", self.device_free, r, stream, frames)
            raise SimOOM(site)
        seg, i = found
        blk = seg.blocks[i]
        remaining = blk.size - r
        split = remaining >= MIN_BLOCK if (small or self.expandable) else remaining > SMALL_SIZE
        if split:
            seg.blocks.insert(i + 1, Blk(blk.addr + r, remaining))
            blk.size = r
        blk.state, blk.req, blk.frames = "active_allocated", req, frames
        self._entry("alloc", blk.addr, req, stream, frames)
        return blk.addr

    def _best_fit(self, r: int, small: bool, stream: int):
        best = None
        for s in self.segs:
            if s.small != small or s.stream != stream:
                continue
            for i, b in enumerate(s.blocks):
                if b.state == "inactive" and b.size >= r and (best is None or b.size < best[0].blocks[best[1]].size):
                    best = (s, i)
        return best

    def _grow(self, r: int, small: bool, stream: int, frames: list):
        if self.expandable:
            return self._map(r, small, stream, frames)
        size = SMALL_BUFFER if small else LARGE_BUFFER if r < MIN_LARGE_ALLOC else \
            ROUND_LARGE * ((r + ROUND_LARGE - 1) // ROUND_LARGE)
        if size > self.device_free:
            return None
        addr = self.next_addr
        self.next_addr += size + 64 * MiB          # cudaMalloc's addresses: increasing, not adjacent
        seg = Seg(addr, size, stream, small, False, [Blk(addr, size)])
        self.segs.append(seg)
        self._entry("segment_alloc", addr, size, stream, frames)
        return seg, 0

    def _map(self, r: int, small: bool, stream: int, frames: list):
        seg = next((s for s in self.segs if s.small == small and s.stream == stream), None)
        if seg is None:
            seg = Seg(self.next_addr, 0, stream, small, True, [])
            self.next_addr += 1 << 36               # the virtual reservation of an expandable segment
            self.segs.append(seg)
        tail = seg.blocks[-1] if seg.blocks and seg.blocks[-1].state == "inactive" else None
        need = r - (tail.size if tail else 0)
        page = granule(small)
        pages = page * ((need + page - 1) // page)
        if pages > self.device_free:
            return None
        start = seg.addr + seg.size
        seg.size += pages
        if tail:
            tail.size += pages
        else:
            seg.blocks.append(Blk(start, pages))
        self._entry("segment_map", start, pages, stream, frames)
        return seg, len(seg.blocks) - 1

    def free(self, addr: int, pending: bool = False) -> None:
        seg, i = self._find(addr)
        b = seg.blocks[i]
        b.state = "active_pending_free"
        self._entry("free_requested", addr, b.req, seg.stream, b.frames)
        if not pending:
            self.complete(addr)

    def complete(self, addr: int) -> None:
        seg, i = self._find(addr)
        b = seg.blocks[i]
        self._entry("free_completed", addr, b.req, seg.stream, b.frames)
        b.state, b.req, b.frames = "inactive", 0, []
        if i + 1 < len(seg.blocks) and seg.blocks[i + 1].state == "inactive":
            b.size += seg.blocks.pop(i + 1).size
        if i > 0 and seg.blocks[i - 1].state == "inactive":
            seg.blocks[i - 1].size += seg.blocks.pop(i).size

    def release_cached(self) -> None:
        """empty_cache: whole free segments go back to CUDA; expandable segments unmap their free tail pages."""
        for s in list(self.segs):
            if s.expandable:
                tail = s.blocks[-1] if s.blocks and s.blocks[-1].state == "inactive" else None
                page = granule(s.small)
                if tail and tail.size >= page:
                    pages = page * (tail.size // page)
                    tail.size -= pages
                    s.size -= pages
                    self._entry("segment_unmap", s.addr + s.size, pages, s.stream, None)
                    if not tail.size:
                        s.blocks.pop()
            elif len(s.blocks) == 1 and s.blocks[0].state == "inactive":
                self.segs.remove(s)
                self._entry("segment_free", s.addr, s.size, s.stream, None)

    def snapshot_marker(self) -> None:
        """What torch's snapshot() records in the trace: the device's active bytes."""
        self._entry("snapshot", 0, self.active(), 0, None)

    # ------------------------------------------------------------------ dump
    def segments(self, fmt: str) -> list[dict]:
        out = []
        for s in sorted(self.segs, key=lambda s: s.addr):
            if not s.size:
                continue
            blocks = []
            for b in s.blocks:
                if fmt == "legacy":
                    d = {"size": b.size, "state": b.state}
                    if b.state != "inactive":
                        d["history"] = [{"addr": b.addr, "real_size": b.req, "frames": b.frames}]
                else:
                    d = {"address": b.addr, "size": b.size, "requested_size": b.req, "state": b.state,
                         "frames": b.frames}
                blocks.append(d)
            seg = {"device": self.device, "address": s.addr, "total_size": s.size,
                   "allocated_size": sum(b.size for b in s.blocks if b.state == "active_allocated"),
                   "active_size": sum(b.size for b in s.blocks if b.state != "inactive"),
                   "stream": s.stream, "segment_type": "small" if s.small else "large", "blocks": blocks}
            if fmt != "legacy":
                seg.update(requested_size=sum(b.req for b in s.blocks if b.state == "active_allocated"),
                           segment_pool_id=s.pool, is_expandable=s.expandable, frames=[])
            out.append(seg)
        return out

    def entries(self, fmt: str) -> list[dict]:
        kept = self.trace[-self.max_entries:]
        if fmt in ("legacy", "no_time"):
            kept = [{k: v for k, v in e.items() if k != "time_us"} for e in kept]
        if fmt == "compile":
            kept = [{**e, "compile_context": "N/A", "user_metadata": ""} for e in kept]
        return kept


SETTINGS = {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1, "garbage_collection_threshold": 0.0,
            "expandable_segments": False, "pinned_num_register_threads": 1, "release_lock_on_cudamalloc": False,
            "pinned_use_cuda_host_register": False, "roundup_power2_divisions": {str(1 << i): 0 for i in range(16)}}


def dump(allocators: list[Allocator], fmt: str = "modern") -> object:
    """The snapshot object in one format: modern | no_time | compile | legacy | segment_list."""
    segments = [s for a in allocators for s in a.segments(fmt)]
    if fmt == "segment_list":
        return segments
    traces: list[list[dict]] = [[] for _ in range(max((a.device for a in allocators), default=-1) + 1)]
    for a in allocators:
        traces[a.device] = a.entries(fmt)
    out: dict = {"segments": segments, "device_traces": traces}
    if fmt in ("modern", "compile"):
        settings = dict(SETTINGS)
        if any(a.expandable for a in allocators):
            settings.update(PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True", expandable_segments=True)
        out["allocator_settings"] = settings
        out["external_annotations"] = []
    return out


# ----------------------------------------------------------------------------- scenarios
def model_state(a: Allocator, params: int = 8 * GiB, optimizer: bool = True) -> dict[str, list[int]]:
    """Parameters in 8 tensors, a grad buffer, Adam's two moments."""
    live: dict[str, list[int]] = {"params": [], "grad_buffer": [], "optimizer": []}
    for _ in range(8):
        live["params"].append(a.malloc(params // 8, "params"))
    live["grad_buffer"].append(a.malloc(params, "grad_buffer"))
    if optimizer:
        for _ in range(2):
            live["optimizer"].append(a.malloc(params, "optimizer"))
    return live


def forward(a: Allocator, layers: int, act: int, keep: list[int]) -> None:
    """One microbatch's forward: per layer the saved activations stay, a temporary is freed."""
    keep.append(a.malloc(act // 2, "embedding"))
    for _ in range(layers):
        keep.append(a.malloc(act, "qkv"))
        tmp = a.malloc(act // 4, "core_attn")
        keep.append(a.malloc(act * 2, "fc1"))
        gathered = a.malloc(3 * MiB + 4096, "allgather")
        a.free(gathered)
        a.free(tmp)
        keep.append(a.malloc(600 * KiB, "qkv"))   # small-pool tensors


def oom_run(capacity: int = 40 * GiB, unwind: bool = False, expandable: bool = False, cpp: bool = False,
            act: int = 512 * MiB, device: int = 0, other: int = 0) -> Allocator:
    """Model state, then microbatches until the allocator runs out; ``unwind`` frees the failing step's
    activations after the OOM (what a dump taken in an exception handler sees)."""
    a = Allocator(device, capacity, other=other, expandable=expandable, cpp_frames=cpp)
    model_state(a)
    acts: list[int] = []
    try:
        for _ in range(64):
            forward(a, 4, act, acts)
    except SimOOM:
        pass
    if unwind:
        for addr in reversed(acts):
            a.free(addr)
    a.snapshot_marker()
    return a


def fragmentation_run() -> Allocator:
    """Four 960 MiB segments cut into 96 MiB tensors with every other one freed (1.875 GiB free in holes that no
    release can return, none larger than 96 MiB), the rest of the GPU filled, then a 160 MiB request."""
    a = Allocator(0, capacity=8 * GiB)
    for _ in range(4):
        a.free(a.malloc(960 * MiB, "fc1"))       # a cached 960 MiB segment
        parts = [a.malloc(96 * MiB, "fc1") for _ in range(10)]
        for addr in parts[::2]:
            a.free(addr)
    try:
        while True:
            a.malloc(200 * MiB, "qkv")
    except SimOOM:
        a.trace.pop()       # the filling loop's own OOM is not the one of interest
    try:
        a.malloc(160 * MiB, "logits")
    except SimOOM:
        pass
    a.snapshot_marker()
    return a


def peak_run(device: int = 0, act: int = 256 * MiB, steps: int = 3) -> Allocator:
    """Training steps without an OOM: the peak is at the end of a forward, the dump after the step."""
    a = Allocator(device, 80 * GiB)
    model_state(a)
    for _ in range(steps):
        acts: list[int] = []
        forward(a, 4, act, acts)
        for addr in reversed(acts):
            a.free(addr)
    a.snapshot_marker()
    return a


def one_f_one_b_run(capacity: int = 14 * GiB, period: int = 5, last: int = 6, ring: int = 3000) -> Allocator:
    """A real-shaped what-if case (issue 34): the trace ring starts mid-run, two streams (an all-gather on stream
    1 whose frees wait on events), sequence lengths that vary per microbatch, 1F1B (the next microbatch's forward
    before the previous one's activations are freed), then a longer sequence that does not fit."""
    def forward(a: Allocator, seq: int) -> list[int]:
        keep = []
        for layer in range(6):
            keep.append(a.malloc(seq * 48 * MiB + 4096 * layer, "qkv", stream=0))
            keep.append(a.malloc(seq * 96 * KiB, "qkv", stream=0))
            comm = a.malloc(seq * 6 * MiB, "allgather", stream=1)
            a.free(comm, pending=True)
            tmp = a.malloc(seq * 20 * MiB, "core_attn", stream=0)
            a.complete(comm)
            keep.append(a.malloc(seq * 64 * MiB, "fc1", stream=0))
            a.free(tmp)
        return keep
    a = Allocator(0, capacity=capacity, max_entries=ring)
    model_state(a, params=2 * GiB)
    previous: list[int] = []
    try:
        for step in range(150):
            current = forward(a, 1 + (step * 3) % period)
            for addr in reversed(previous):
                a.free(addr)
            previous = current
        forward(a, last)
    except SimOOM:
        pass
    a.snapshot_marker()
    return a


def write(path: Path, obj: object) -> None:
    data = pickle.dumps(obj, protocol=4)
    if path.suffix == ".gz":
        data = gzip.compress(data, mtime=0)
    path.write_bytes(data)


FIXTURES = {
    "snapshot_oom_rank-0.pickle": lambda: dump([oom_run()]),
    "unwound_oom.pickle": lambda: dump([oom_run(unwind=True)]),
    "fragmentation.pickle": lambda: dump([fragmentation_run()]),
    "expandable_oom.pickle": lambda: dump([oom_run(expandable=True)]),
    "cpp_frames.pickle": lambda: dump([oom_run(cpp=True)]),
    "snapshot_0.pickle": lambda: dump([peak_run()]),
    "two_devices.pickle": lambda: dump([peak_run(0), oom_run(device=1)]),
    "no_time.pickle.gz": lambda: dump([oom_run()], "no_time"),
    "compile_context.pickle": lambda: dump([peak_run()], "compile"),
    "legacy_history.pickle": lambda: dump([peak_run()], "legacy"),
    "segment_list.pickle": lambda: dump([peak_run()], "segment_list"),
    "empty.pickle": lambda: {"segments": [], "device_traces": [[]]},
    "whatif_1f1b_oom.pickle": lambda: dump([one_f_one_b_run()]),
    "regression_before.pickle": lambda: dump([peak_run(act=256 * MiB)]),
    "regression_after.pickle": lambda: _with_settings(dump([oom_run(capacity=40 * GiB, act=768 * MiB)]),
                                                      PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:512",
                                                      max_split_size=512 * MiB),
}


def _with_settings(obj: dict, **changes) -> dict:
    obj["allocator_settings"] = {**obj["allocator_settings"], **changes}
    return obj


def main(folder: str) -> None:
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    for name, make in FIXTURES.items():
        _FRAMES.clear()
        write(out / name, make())
        print(f"{out / name}: {(out / name).stat().st_size:,} bytes")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(Path(__file__).parent / "fixtures" / "snapshots"))


def expandable_snapshot(n: int, prefix: str = "") -> dict:
    """``n`` expandable segments, each one mapped range with one live block, mapped and allocated in the trace, the
    segments listed in reverse (the dump's order is no help): the shape that made the reader quadratic (issue 33 #7;
    tests/test_hostile_round4_snapshot.py and bench/snapshot_read.py)."""
    base, gran = 0x7E0000000000, 20 * MiB
    segs, trace = [], []
    frames = [{"filename": prefix + "megatron/core/transformer/mlp.py", "line": 150, "name": "forward"}]
    for k in range(n):
        addr = base + k * 2 * gran   # a gap between ranges: each stays its own segment
        segs.append({"device": 0, "address": addr, "total_size": gran, "stream": 0, "segment_type": "large",
                     "is_expandable": True, "blocks": [{"address": addr, "size": gran, "requested_size": gran,
                                                        "state": "active_allocated", "frames": frames}]})
        trace.append({"action": "segment_map", "addr": addr, "size": gran, "stream": 0})
        trace.append({"action": "alloc", "addr": addr, "size": gran, "stream": 0, "frames": frames})
    segs.reverse()
    return {"segments": segs, "device_traces": [trace], "allocator_settings": {"expandable_segments": True}}
