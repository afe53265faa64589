"""A training step's time on one GPU type, from the demand of every layer (work.py), and the cost of a change.

The step (per pipeline rank, per microbatch, then the schedule):
- compute: each GEMM by the roofline, the larger of its FLOPs at the GPU's dense peak times the efficiency
  (gpus.EFFICIENCY, the one constant, for compute-bound kernels) and the bytes it reads and writes at HBM
  bandwidth (its arithmetic intensity against the GPU's FLOP/byte ratio: small per-rank shapes and few tokens
  per expert are bandwidth-bound); attention and the scan the same; the memory-bound kernels at HBM bandwidth; in
  backward what recompute replays (selective: the labels' regions; full: every checkpointed layer's whole
  forward), each on the critical path;
- collectives by NCCL's own model (gpus.NCCL_SOURCE): per collective the fastest protocol's latency (a base
  latency plus one per ring step) and its bytes (the ring's bus bytes, work.py) at NCCL's bandwidth for the link;
- the host: every kernel a layer runs is launched by the host (work.py KERNELS) at gpus.LAUNCH_SECONDS each; a
  layer's forward (backward) takes the longer of its GPU time and its launches (the host runs ahead of the GPU
  while it has work queued; a region inside a captured CUDA graph costs one graph launch per scope, and a
  full-iteration graph the whole step one);
- the pipeline: the most loaded rank's microbatch time x (m + (pp - 1) / vpp): the interleaved 1F1B schedule's
  bubble is (pp - 1) / (vpp x m) of the ideal time (megatron-core pipeline_parallel/schedules.py
  forward_backward_pipelining_with_interleaving: (pp - rank - 1) x 2 + (vpp - 1) x group warm-up microbatches,
  get_pp_rank_microbatches :937-951; without interleaving pp - rank - 1, :2243-2245); every rank waits for the
  slowest, so an uneven stage (the last one's output layer and loss) sets the pace;
- communication, each over its group's link (NVLink inside an NVLink domain, the GPU's NIC across; rank order
  tp-cp-ep-dp-pp, parallel_state.py initialize_model_parallel ``order``), with an overlap assumption each:
  TP collectives exposed unless TP comm overlap is on; then, at best, each is hidden behind the GEMMs it is
  paired with in TE's userbuffers overlap (the all-gather with the GEMM that consumes it, the reduce-scatter with
  the GEMM that produces it, a backward collective with its region's data- and weight-gradient GEMMs: TE
  module.base / linear.py ub_overlap_ag / ub_overlap_rs / ub_bulk_dgrad / ub_bulk_wgrad), exposed at worst;
  expert all-to-alls hidden up to the layer's compute at best with overlap_moe_expert_parallel_comm; the
  context-parallel ring hidden up to the attention it feeds at best; pipeline send/receive hidden at best only
  with overlap_p2p_comm; the data-parallel gradient reduce-scatter (or all-reduce) hidden behind one
  microbatch's backward at best with overlap_grad_reduce (megatron-core launches it in the last microbatch's
  backward, distributed/distributed_data_parallel.py), the parameter all-gather behind one forward with
  overlap_param_gather; Megatron FSDP's per-layer all-gathers (forward and backward) and reduce-scatters hidden up
  to the layer's compute at best (its prefetch; megatron_fsdp.py:755-773 reduces every microbatch under
  optim_grads and optim_grads_params); LoRA's input re-gather on the path; activation offload (layer-level and
  fine-grained) overlapped with the layer's own compute at best; every one exposed at worst;
- the optimizer step: the GPU's Adam over its shard at HBM bandwidth, and with optimizer CPU offload the gradients
  down and the parameters up over the host link and torch's fused AdamW over the offloaded part at the host's DRAM
  bandwidth per GPU (optimizer/__init__.py: torch.optim.AdamW(fused=True) on the CPU; hybrid_optimizer.py: D2H of
  the grads, the CPU step, H2D of the params), the copies overlapped with the CPU step at best only with
  overlap_cpu_optimizer_d2h_h2d.

The cost of a change is T(after) / T(before) - 1 under the same assumptions, for both efficiencies, both overlap
cases and both parts a compute capability covers: its range is the smallest and largest of these.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from ..inputs import Layout, Settings, Shape, _tokens
from ..pipeline import rank_chunks, rank_layers
from ..weights import data_parallel_shards, lora_params, mtp_blocks, optimizer_shards, stage_params
from .gpus import (EFFICIENCY, EFFICIENCY_SOURCE, LAUNCH_SECONDS, NCCL_BASE_LATENCY, NCCL_PROTOCOL_BW,
                   NCCL_STEP_LATENCY, Gpu, gpu)
from .inputs import CostInputs, dp_overlaps, p2p_overlap, tp_overlap
from .work import (CACHE_SIZE, CACHES, ZERO, LayerWork, Phase, Summary, _layer_key, layer_work, mtp_eh,
                   optimizer_bytes_per_param, output_layer_work, recompute_flops, step_flops, summarize)

CPU_ADAM_BYTES = 28    # torch fused AdamW on fp32: reads param, grad, exp_avg, exp_avg_sq; writes param and moments
LINKS = ("nvlink", "network", "host")
GROUPS = ("tp", "cp", "ep", "dp", "pp")


# ----------------------------------------------------------------------------- collectives (NCCL's model)
def collective_seconds(kind: str, moved: float, count: float, n: int, nodes: int, bw: float,
                       ll_max: float = math.inf) -> float:
    """Seconds ``count`` NCCL collectives of ``kind`` ("ar", "ag", "rs", "a2a", "p2p") take that move ``moved`` bus
    bytes in all from this GPU over a group of ``n`` ranks on ``nodes`` nodes, at link bandwidth ``bw``: per
    collective the fastest of NCCL's ring protocols, base latency + steps x step latency (the steps crossing nodes
    at the network's) + its bytes at the protocol's bandwidth (gpus.NCCL_SOURCE). An all-to-all runs as n - 1
    grouped send/receives (the ring's step count), a pipeline send/receive as one step."""
    if count <= 0 or moved <= 0:
        return 0.0
    if kind == "ar":
        steps, inter = 2 * (n - 1), 2 * (nodes - 1)
    elif kind == "p2p":
        steps, inter = 1, (1 if nodes > 1 else 0)
    else:
        steps, inter = n - 1, nodes - 1
    steps = max(1, steps)
    inter = min(max(0, inter), steps)
    each = moved / count
    best = math.inf
    nvl, net = NCCL_STEP_LATENCY["nvlink"], NCCL_STEP_LATENCY["network"]
    for p in (0, 1, 2):
        b = bw * NCCL_PROTOCOL_BW[p]
        if p == 0 and b > ll_max:
            b = ll_max
        t = NCCL_BASE_LATENCY[p] + (steps - inter) * nvl[p] + inter * net[p] + each / b
        if t < best:
            best = t
    return count * best


def _colls_seconds(colls, n: int, nodes: int, bw: float, ll_max: float) -> float:
    return sum(collective_seconds(kind, moved, count, n, nodes, bw, ll_max) for kind, moved, count in colls)


# ----------------------------------------------------------------------------- one layer's times
def _phase_seconds(ph: Phase, i8: float, i16: float, ih: float) -> float:
    f8, f16, hbm, small = ph
    t = f8 * i8 + f16 * i16 + hbm * ih
    for f, b, e in small:
        c = f * (i8 if e else i16)
        m = b * ih
        t += c if c > m else m
    return t


def _summary(w: LayerWork) -> Summary:
    """What step.py times of one LayerWork (built with it, work.summarize)."""
    return w.summary if w.summary is not None else summarize(w.regions, w.regather_f, w.regather_b)


def Ctx(tp: tuple[int, int, float], ep: tuple[int, int, float], cp: tuple[int, int, float],
        ll_max: float) -> tuple:
    """The groups' (ranks, nodes, link bandwidth) as a step's collectives see them (one speed set), and NCCL's LL
    cap: a plain tuple (tp, ep, cp, ll_max), a cheap cache key."""
    return (tp, ep, cp, ll_max)


def layer_times(w: LayerWork, sp: "Speeds", ctx: tuple) -> tuple[float, ...]:
    """One layer's seconds under one speed set (memoized on the LayerWork):
    (forward compute, backward compute, recompute, TP exposed forward / backward / recompute, the same with TP
    comm overlap at best, expert all-to-all forward / backward (+ recompute), context-parallel ring forward /
    backward, the attention they hide behind forward / backward, LoRA re-gather forward / backward, host launches
    forward / backward (+ recompute), host launches of the forward alone)."""
    cache = w.__dict__.get("_times")
    if cache is None:
        cache = {}
        object.__setattr__(w, "_times", cache)
    key = (sp.key, ctx)
    got = cache.get(key)
    if got is None:
        sm = _summary(w)
        comm = cache.get(ctx)
        if comm is None:
            comm = cache[ctx] = _comm_times(sm, ctx)
        got = cache[key] = _layer_times(sm, sp, comm)
    return got


def _comm_times(sm: Summary, ctx: tuple) -> tuple:
    """The collectives' seconds of one layer (they depend on the links, not on the efficiency or HBM)."""
    (n, nodes, bw), (en, enodes, ebw), (cn, cnodes, cbw), ll = ctx
    tp = tuple((_colls_seconds(cf, n, nodes, bw, ll), _colls_seconds(cb, n, nodes, bw, ll))
               for _, _, cf, cb, _ in sm.tp_regions)
    cpf = _colls_seconds(sm.cp_f, cn, cnodes, cbw, ll)
    return (tp, _colls_seconds(sm.ep_f, en, enodes, ebw, ll), _colls_seconds(sm.ep_r, en, enodes, ebw, ll),
            cpf, 2 * cpf + _colls_seconds(sm.cp_r, cn, cnodes, cbw, ll),
            _colls_seconds(sm.rg_f, n, nodes, bw, ll), _colls_seconds(sm.rg_b, n, nodes, bw, ll))


def _layer_times(sm: Summary, sp: "Speeds", comm: tuple) -> tuple[float, ...]:
    i8, i16, ih = 1 / sp.p8, 1 / sp.p16, 1 / sp.hbm
    cf = _phase_seconds(sm.fwd, i8, i16, ih)
    cb = _phase_seconds(sm.bwd, i8, i16, ih)
    rc = _phase_seconds(sm.rec, i8, i16, ih)
    tp, epf, epr, cpf, cpb, rgf, rgb = comm
    tpf = tpb = tpr = tpf_h = tpb_h = tpr_h = 0.0
    for (ph_f, ph_b, _, _, rec), (xf, xb) in zip(sm.tp_regions, tp):
        gf = _phase_seconds(ph_f, i8, i16, ih)
        gb = _phase_seconds(ph_b, i8, i16, ih)
        hf = xf - gf if xf > gf else 0.0
        hb = xb - gb if xb > gb else 0.0
        tpf += xf
        tpb += xb
        tpf_h += hf
        tpb_h += hb
        if rec:
            tpr += xf
            tpr_h += hf
    af = _phase_seconds(sm.attn_f, i8, i16, ih)
    ab = _phase_seconds(sm.attn_b, i8, i16, ih)
    lf, lb, lr = sm.launches
    gfl, gbl, grl = sm.graphs
    t = sp.launch
    return (cf, cb, rc, tpf, tpb, tpr, tpf_h, tpb_h, tpr_h, epf, epf + epr, cpf, cpb, af, ab, rgf, rgb,
            (lf + gfl) * t, (lb + lr + gbl + grl) * t, (lf + gfl) * t)


# ----------------------------------------------------------------------------- a step's demand
@dataclass(frozen=True)
class RankDemand:
    """One pipeline rank's demand: per layer kind its count and work (per microbatch), the output layer, the
    full-recompute extra, the pipeline send/receive and FSDP bytes per microbatch."""
    kinds: tuple[tuple[LayerWork, int], ...]
    extra: LayerWork            # output layer, loss (last rank)
    full_replay: tuple[float, ...]   # full recompute: the replayed forward (work.LayerWork.full summed)
    p2p: float                  # pipeline send/receive bytes per microbatch
    fsdp: float                 # Megatron FSDP bytes per microbatch (all-gathers and reduce-scatters)
    dp_grad: float              # data-parallel gradient reduce bytes per step
    dp_param: float             # data-parallel parameter all-gather bytes per step
    opt_params: float           # optimizer-shard parameters on this GPU
    flops: float                # step FLOPs per microbatch (forward + backward, no recompute)
    recompute: float            # recompute FLOPs per microbatch
    deferred: float = 0.0       # output-layer wgrad FLOPs run after the schedule, per step (last rank)
    replay: tuple[tuple[LayerWork, int], ...] = ()   # full recompute: the layers replayed, per kind
    p2p_n: int = 0              # pipeline sends and receives per microbatch
    fsdp_n: int = 0             # FSDP collectives per microbatch
    dp_buckets: int = 1         # the data-parallel buckets (one collective each way per bucket)
    layers: "RankLayers | None" = field(default=None, compare=False, repr=False)   # what is shared (RankLayers)


@dataclass(frozen=True, eq=False)
class RankLayers:
    """The part of a rank's demand its layers set (cached per shape, layout and the settings a layer reads, so
    that candidates differing only in the optimizer share it, and its timing: _rank_times memoizes on it)."""
    kinds: tuple
    extra: LayerWork
    full_replay: tuple[float, ...]
    replay: tuple
    p2p: float
    p2p_n: int
    flops: float
    recompute: float
    deferred: float
    layers_here: int
    rows: tuple = ()
    params: tuple[float, float, float] = (0.0, 0.0, 0.0)   # memory/weights.py stage_params of the rank


@dataclass(frozen=True)
class Demand:
    ranks: tuple[RankDemand, ...]
    microbatches: int
    pp: int
    vpp: int
    links: tuple[tuple[str, str], ...]    # mechanism -> link name
    offload_fraction: float
    offload_param_bytes: float            # bytes per parameter each way over the host link (optimizer offload)
    opt_bytes: float                      # HBM bytes per parameter of the GPU optimizer step
    gpus_per_rank: int                    # TP x CP x DP: the GPUs that share one pipeline rank's work
    overlaps: tuple[tuple[str, bool], ...]
    # per distinct rank (ranks with the same layers share one): (RankDemand, its rows for step_time); and each
    # rank's entry in it
    distinct: tuple = field(default=(), compare=False, hash=False, repr=False)
    index: tuple[int, ...] = field(default=(), compare=False, hash=False, repr=False)
    # each group's (ranks, nodes it spans), for the collectives' latency
    groups: tuple[tuple[str, int, int], ...] = ()
    graph_all: bool = False               # a full-iteration CUDA graph replays the whole step

    def overlap(self, name: str) -> bool:
        return dict(self.overlaps)[name]

    def link(self, name: str) -> str:
        return dict(self.links)[name]

    @property
    def bubble(self) -> float:
        return (self.pp - 1) / (self.vpp * self.microbatches) if self.pp > 1 else 0.0


def _links(lay: Layout, domain: int) -> tuple[tuple[str, str], ...]:
    """Which link each group's collectives cross (rank order tp-cp-ep-dp-pp: a group whose ranks span no more
    than an NVLink domain stays on NVLink)."""
    def inside(span: int) -> str:
        return "nvlink" if span <= domain else "network"
    return (("tp", inside(lay.tp)), ("cp", inside(lay.tp * lay.cp)), ("ep", inside(lay.ep * lay.etp)),
            ("dp", inside(max(1, lay.world // lay.pp))), ("pp", inside(lay.world)), ("host", "host"))


def _groups(lay: Layout, st: Settings, domain: int, dense_dp: int | None = None) -> tuple[tuple[str, int, int], ...]:
    """(group, ranks, nodes it spans) for the collectives' latency: a group's ranks are strided by the groups
    before it in the rank order, so it spans ceil(span / domain) nodes, at most one per rank."""
    def nodes(n: int, span: int) -> int:
        return max(1, min(n, -(-span // domain)))
    if dense_dp is None:
        dense_dp = data_parallel_shards(lay, st)[0]
    return (("tp", lay.tp, nodes(lay.tp, lay.tp)), ("cp", lay.cp, nodes(lay.cp, lay.tp * lay.cp)),
            ("ep", lay.ep, nodes(lay.ep, lay.ep * lay.etp)),
            ("dp", dense_dp, nodes(dense_dp, max(1, lay.world // lay.pp))),
            ("pp", 2, 2 if lay.world > domain and lay.pp > 1 else 1))


def _count(kinds) -> dict[str, int]:
    out: dict[str, int] = {}
    for kind in kinds:
        out[kind] = out.get(kind, 0) + 1
    return out


_LAYERS: dict = {}
CACHES.append(_LAYERS)


def _rank_layers_part(s: Shape, lay: Layout, st: Settings, ci: CostInputs, rank: int,
                      chunks: tuple[tuple[str, ...], ...], work) -> RankLayers:
    key = (s, lay, _layer_key(st), ci.dispatcher, rank)
    got = _LAYERS.get(key)
    if got is None:
        if len(_LAYERS) >= CACHE_SIZE:
            _LAYERS.clear()
        got = _LAYERS[key] = _make_rank_layers(s, lay, st, ci, rank, chunks, work)
    return got


def _make_rank_layers(s: Shape, lay: Layout, st: Settings, ci: CostInputs, rank: int,
                      chunks: tuple[tuple[str, ...], ...], work) -> RankLayers:
    last = rank == lay.pp - 1
    full = [0.0] * 7
    replay: tuple = ()
    first_layers = st.cpu_offload_layers if lay.pp == 1 else 0
    if first_layers:
        # layer-level CPU offload (PP = 1 only): the first cpu_offloading_num_layers layers
        order = [kind for chunk in chunks for kind in chunk]
        counts = _count(order[first_layers:])
        offloaded = _count(order[:first_layers])
    else:
        counts = rank_layers(s, lay, rank)
        offloaded = {}
    if st.recompute == "full":
        # full recompute: uniform checkpoints every layer (in groups of recompute_num_layers), block the first
        # recompute_num_layers of each model chunk (megatron-core transformer_block.py _checkpointed_forward)
        n = max(1, st.recompute_layers)
        replayed = _count([kind for chunk in chunks for kind in (chunk[:n] if st.recompute_method == "block"
                                                                else chunk)])
        for kind, k in replayed.items():
            full = [a + k * b for a, b in zip(full, work(kind).full)]
        replay = tuple((work(kind), k) for kind, k in replayed.items())
    kinds = tuple((work(k), n) for k, n in counts.items()) + tuple((work(k, True), n) for k, n in offloaded.items())
    extra = ZERO
    deferred = 0.0
    m = lay.microbatches
    if last:
        if st.deferred_wgrad_microbatches and lay.pp > 1 and not st.lora_rank:
            # defer_embedding_wgrad_compute: the output layer's weight-gradient GEMM of the first
            # wgrad_deferral_limit microbatches is buffered (tensor_parallel/layers.py:605-608) and run after the
            # schedule (schedules.py:2055-2059 finish_embedding_wgrad_compute), "enabling us to hide pipeline
            # flush latency" (model_parallel_config.py:410-413): the last stage's flush is its idle cool-down
            n_def = min(st.deferred_wgrad_microbatches, m)
            extra = output_layer_work(s, lay, st, s.mtp_layers, wgrad_share=1.0 - n_def / m)
            wgrad = extra.f16 - mtp_eh(s, lay) * _tokens(lay)      # one forward's worth of output-layer FLOPs
            deferred = wgrad * n_def
        else:
            extra = output_layer_work(s, lay, st, s.mtp_layers)
        if s.mtp_layers:
            kinds += ((work("+".join(mtp_blocks(s))), s.mtp_layers),)
    tokens = _tokens(lay)
    sp = lay.tp if lay.sp and lay.tp > 1 else 1
    chunks_here = max(1, lay.vpp)
    p2p = 2 * chunks_here * tokens * s.hidden * st.dtype_bytes / sp if lay.pp > 1 else 0.0
    p2p_n = 2 * chunks_here if lay.pp > 1 else 0
    flops = sum(n * step_flops(w) for w, n in kinds) + step_flops(extra) + deferred / m
    recompute = sum(n * recompute_flops(w) for w, n in kinds) + full[0] + full[1] + full[2]
    rows = tuple((n, w, w.d2h, w.h2d) for w, n in kinds + ((extra, 1),) if w is not ZERO)
    return RankLayers(kinds, extra, tuple(full), replay, p2p, p2p_n, flops, recompute, deferred,
                      sum(counts.values()) + sum(offloaded.values()), rows,
                      stage_params(s, lay, rank == 0, last, rank))


def _rank_demand(s: Shape, lay: Layout, st: Settings, ci: CostInputs, rank: int,
                 chunks: tuple[tuple[str, ...], ...], work=None, shards: tuple[int, int] | None = None,
                 grad_overlap: bool | None = None) -> RankDemand:
    """One pipeline rank's demand; ``work(kind, offloaded)``: the layers' LayerWork (work.layer_work); ``shards``,
    ``grad_overlap``: data_parallel_shards and dp_overlaps' first, when the caller has them."""
    if work is None:
        def work(kind: str, offloaded: bool = False) -> LayerWork:
            return layer_work(s, lay, st, kind, ci.dispatcher, offloaded)
    part = _rank_layers_part(s, lay, st, ci, rank, chunks, work)
    # parameters on this GPU (memory/weights.py stage_params) and what the data-parallel group moves of them
    layer_p, embed, expert = part.params
    dense_p = layer_p + embed
    frozen = st.lora_rank > 0
    adapters = lora_params(s, lay, st, rank) if frozen else 0.0
    train_dense, train_expert = (adapters, 0.0) if frozen else (dense_p, expert)
    dense_dp, expert_dp = shards if shards is not None else data_parallel_shards(lay, st)
    ring_d = (dense_dp - 1) / dense_dp if dense_dp > 1 else 0.0
    ring_e = (expert_dp - 1) / expert_dp if expert_dp > 1 else 0.0
    pb = 1.0 if ci.fp8_param_gather else float(st.param_bytes)
    grad_bytes = (train_dense * ring_d + train_expert * ring_e) * st.grad_bytes
    param_bytes = (train_dense * ring_d + train_expert * ring_e) * pb
    fsdp = 0.0
    fsdp_n = 0
    dp_grad = dp_param = 0.0
    if st.fsdp is not None and st.fsdp in ("optim_grads_params", "optim_grads"):
        # per microbatch: the gradients reduce-scattered (every bprop, megatron_fsdp.py:755-773); with the weights
        # sharded too, every unit all-gathered before its forward and again before its backward
        fsdp = grad_bytes
        fsdp_n = part.layers_here
        if st.fsdp == "optim_grads_params":
            fsdp += 2 * (dense_p * ring_d + expert * ring_e) * pb
            fsdp_n += 2 * part.layers_here
        else:
            dp_param = param_bytes
    elif st.dist_optimizer or st.fsdp is not None:
        dp_grad, dp_param = grad_bytes, param_bytes
    else:
        dp_grad = 2 * grad_bytes    # an all-reduce
    # the gradient buckets (distributed_data_parallel.py:66-72: bucket_size max(40M, 1M x dp) parameters with
    # overlap_grad_reduce, else one bucket): one reduce and one gather each
    if grad_overlap is None:
        grad_overlap = dp_overlaps(ci, lay, st)[0]
    trained = train_dense + train_expert
    buckets = max(1, math.ceil(trained / max(40e6, 1e6 * dense_dp))) if grad_overlap else 1
    if st.fsdp is not None:
        shards_d, shards_e = dense_dp, expert_dp
    else:
        shards_d, shards_e = optimizer_shards(lay, st) if st.dist_optimizer else (1, 1)
    opt_params = train_dense / shards_d + train_expert / shards_e
    return RankDemand(part.kinds, part.extra, part.full_replay, part.p2p, fsdp, dp_grad, dp_param, opt_params,
                      part.flops, part.recompute, part.deferred, part.replay, part.p2p_n, fsdp_n, buckets, part)


def demand(s: Shape, lay: Layout, st: Settings, ci: CostInputs, domain: int = 8) -> Demand:
    """What one training step asks of every pipeline rank's GPUs (before any GPU's speed); cached (a few hundred)."""
    return _demand_cached(s, lay, st, ci, domain)


_PLANS: dict = {}
CACHES.append(_PLANS)


def _layout_plan(s: Shape, lay: Layout) -> tuple[tuple[tuple[int, tuple], ...], tuple[int, ...]]:
    """The pipeline ranks that hold different layers ((a rank, its chunks) each, first appearance first) and each
    rank's entry among them (cached per shape and layout)."""
    key = (s, lay)
    got = _PLANS.get(key)
    if got is None:
        seen: dict = {}
        firsts = []
        order = []
        for r in range(lay.pp):
            chunks = rank_chunks(s, lay, r)
            k = (chunks, r == 0, r == lay.pp - 1)
            if k not in seen:
                seen[k] = len(firsts)
                firsts.append((r, chunks))
            order.append(seen[k])
        if len(_PLANS) >= CACHE_SIZE:
            _PLANS.clear()
        got = _PLANS[key] = (tuple(firsts), tuple(order))
    return got


def _demand(s: Shape, lay: Layout, st: Settings, ci: CostInputs, domain: int = 8) -> Demand:
    """What one training step asks of every pipeline rank's GPUs (before any GPU's speed)."""
    works: dict = {}

    def work(kind: str, offloaded: bool = False) -> LayerWork:
        got = works.get((kind, offloaded))
        if got is None:
            got = works[kind, offloaded] = layer_work(s, lay, st, kind, ci.dispatcher, offloaded)
        return got
    firsts, order = _layout_plan(s, lay)
    shards = data_parallel_shards(lay, st)
    grad, param = dp_overlaps(ci, lay, st)
    distinct = [_rank_demand(s, lay, st, ci, r, chunks, work, shards, grad) for r, chunks in firsts]
    ranks = tuple(distinct[i] for i in order)
    overlaps = (("tp", tp_overlap(ci, lay)), ("ep", ci.ep_overlap), ("pp", p2p_overlap(ci, lay)),
                ("dp_grad", grad), ("dp_param", param), ("optimizer_offload", ci.optimizer_offload_overlap))
    per_param = 2.0 if st.precision_aware else 4.0
    rows = tuple((rd, rd.layers.rows if rd.layers is not None else _rows(rd)) for rd in distinct)
    return Demand(ranks, lay.microbatches, lay.pp, max(1, lay.vpp) if lay.pp > 1 else 1, _links(lay, domain),
                  st.optimizer_offload, per_param, optimizer_bytes_per_param(st), lay.tp * lay.cp * lay.dp, overlaps,
                  rows, order, _groups(lay, st, domain, shards[0]), ci.graph_full_iteration)


_demand_cached = functools.lru_cache(maxsize=512)(_demand)


# ----------------------------------------------------------------------------- speeds and the step time
@dataclass(frozen=True)
class Speeds:
    p8: float
    p16: float
    hbm: float
    bw: dict
    host_dram: float
    ll_max: float = math.inf
    launch: float = LAUNCH_SECONDS
    key: tuple = ()


def _speeds(g: Gpu, efficiency: float, part: int) -> Speeds:
    p16 = g.bf16[part] * efficiency
    p8 = (g.fp8[part] or g.bf16[part]) * efficiency
    nvlink = g.nvlink_nccl or g.nvlink
    return Speeds(p8, p16, g.hbm[part], {"nvlink": nvlink, "network": g.network, "host": g.host_link[part]},
                  g.host_dram[part], g.nccl_ll_max or math.inf, LAUNCH_SECONDS, (g.name, efficiency, part))


class StepTime(NamedTuple):
    seconds: float
    rank: int                                 # the slowest pipeline rank
    raw: tuple = ()                           # what ``parts`` is built from (step_times' per-rank parts, ...)

    @property
    def parts(self) -> tuple[tuple[str, float], ...]:
        """Mechanism -> seconds on the step's critical path."""
        per_rank, m, bubble, deferred, dp, optimizer, offload = self.raw
        rest = [("bubble", bubble)] + ([("deferred_wgrad", deferred)] if deferred is not None else []) + \
            [("dp", dp), ("optimizer", optimizer)] + ([("optimizer_offload", offload)] if offload is not None else [])
        return tuple((k, v * m) for k, v in zip(PARTS, per_rank)) + tuple(rest)


def _hide(t: float, behind: float, overlapped: bool, best: bool) -> float:
    """What of ``t`` stays on the critical path: hidden behind ``behind`` at best when ``overlapped``."""
    return max(0.0, t - behind) if overlapped and best else t


PARTS = ("compute", "recompute", "tp", "ep", "cp", "regather", "offload", "host", "fsdp", "pp")


def _rows(rd: RankDemand) -> tuple:
    """A rank's layer kinds (and its output layer) as (count, LayerWork, d2h, h2d) for step_time's loop."""
    return tuple((n, w, w.d2h, w.h2d) for w, n in rd.kinds + ((rd.extra, 1),) if w is not ZERO)


def _moved(d: Demand, rd: RankDemand) -> dict[str, float]:
    """Bytes per microbatch the rank's GPU moves on each link (speed-independent)."""
    moved = dict.fromkeys(LINKS, 0.0)
    link = dict(d.links)
    for w, n in rd.kinds + ((rd.extra, 1),):
        moved[link["tp"]] += n * (w.tp_f + w.tp_b + w.r_tp + w.regather)
        moved[link["ep"]] += n * (w.ep_f + w.ep_b + w.r_ep)
        moved[link["cp"]] += n * (w.cp_f + w.cp_b + w.r_cp)
        moved["host"] += n * (w.d2h + w.h2d)
    f = rd.full_replay
    moved[link["tp"]] += f[4]
    moved[link["ep"]] += f[5]
    moved[link["cp"]] += f[6]
    moved[link["dp"]] += rd.fsdp
    moved[link["pp"]] += rd.p2p
    return moved


def _rank_times(rows, rd: RankDemand, d: Demand, sets: list[tuple[Speeds, tuple]],
                o_tp: bool, o_ep: bool, o_pp: bool) -> list[tuple[float, tuple, float, float]]:
    """For each speed set, then the best and the worst overlap case, (microbatch time, forward time, backward time,
    then its parts in PARTS order) of one rank. Best: each overlap the job asks for hides what it can (TP behind its
    paired GEMMs, the expert all-to-all behind the layer's compute, the context-parallel ring behind the attention,
    offload copies behind the layer's own compute); worst: all exposed. A layer's forward (backward) takes the
    longer of its GPU time and its host launches."""
    out = []
    links = dict(d.links)
    g = {name: (n, nodes) for name, n, nodes in d.groups} if d.groups else {}
    dp_n, dp_nodes = g.get("dp", (1, 1))
    pp_nodes = g.get("pp", (2, 1))[1]
    no_host = d.graph_all
    for sp, ctx in sets:
        ihost = 1 / sp.bw["host"]
        # best case (b_*) and worst case (w_*) accumulators
        comp = rec = rg = 0.0
        b_tp = b_ep = b_cp = b_off = b_host = b_fwd = b_bwd = 0.0
        w_tp = w_ep = w_cp = w_off = w_host = w_fwd = w_bwd = 0.0
        for n, w, d2h, h2d in rows:
            (cf, cb, rc, tpf, tpb, tpr, tpf_h, tpb_h, tpr_h, epf, epb, cpf, cpb, af, ab, rgf, rgb,
             hf, hb, _) = layer_times(w, sp, ctx)
            if no_host:
                hf = hb = 0.0
            # worst: every collective and copy exposed
            xo_f, xo_b = d2h * ihost, h2d * ihost
            wt_b = tpb + tpr
            w_gf = cf + tpf + epf + cpf + rgf + xo_f
            w_gb = cb + rc + wt_b + epb + cpb + rgb + xo_b
            w_lf = hf - w_gf if hf > w_gf else 0.0
            w_lb = hb - w_gb if hb > w_gb else 0.0
            # best: what each overlap hides
            if o_tp:
                bt_f, bt_b = tpf_h, tpb_h + tpr_h
            else:
                bt_f, bt_b = tpf, wt_b
            if o_ep:
                be_f = epf - cf if epf > cf else 0.0
                be_b = epb - cb - rc if epb > cb + rc else 0.0
            else:
                be_f, be_b = epf, epb
            bc_f = cpf - af if cpf > af else 0.0
            bc_b = cpb - ab if cpb > ab else 0.0
            bo_f = xo_f - cf if xo_f > cf else 0.0
            bo_b = xo_b - cb if xo_b > cb else 0.0
            b_gf = cf + bt_f + be_f + bc_f + rgf + bo_f
            b_gb = cb + rc + bt_b + be_b + bc_b + rgb + bo_b
            b_lf = hf - b_gf if hf > b_gf else 0.0
            b_lb = hb - b_gb if hb > b_gb else 0.0
            comp += n * (cf + cb)
            rec += n * rc
            rg += n * (rgf + rgb)
            b_tp += n * (bt_f + bt_b)
            w_tp += n * (tpf + wt_b)
            b_ep += n * (be_f + be_b)
            w_ep += n * (epf + epb)
            b_cp += n * (bc_f + bc_b)
            w_cp += n * (cpf + cpb)
            b_off += n * (bo_f + bo_b)
            w_off += n * (xo_f + xo_b)
            b_host += n * (b_lf + b_lb)
            w_host += n * (w_lf + w_lb)
            b_fwd += n * (b_gf + b_lf)
            w_fwd += n * (w_gf + w_lf)
            b_bwd += n * (b_gb + b_lb)
            w_bwd += n * (w_gb + w_lb)
        for w, n in rd.replay:
            # full recompute: each replayed layer's forward again in backward, its collectives included
            t = layer_times(w, sp, ctx)
            cf, tpf, tpf_h, epf, cpf, af, hf = t[0], t[3], t[6], t[9], t[11], t[13], t[17]
            if no_host:
                hf = 0.0
            bt = tpf_h if o_tp else tpf
            be = (epf - cf if epf > cf else 0.0) if o_ep else epf
            bc = cpf - af if cpf > af else 0.0
            b_g = cf + bt + be + bc
            w_g = cf + tpf + epf + cpf
            b_l = hf - b_g if hf > b_g else 0.0
            w_l = hf - w_g if hf > w_g else 0.0
            rec += n * cf
            b_tp += n * bt
            w_tp += n * tpf
            b_ep += n * be
            w_ep += n * epf
            b_cp += n * bc
            w_cp += n * cpf
            b_host += n * b_l
            w_host += n * w_l
            b_bwd += n * (b_g + b_l)
            w_bwd += n * (w_g + w_l)
        fsdp_w = collective_seconds("ag", rd.fsdp, rd.fsdp_n, dp_n, dp_nodes, sp.bw[links["dp"]],
                                    sp.ll_max) if rd.fsdp else 0.0
        pp_w = collective_seconds("p2p", rd.p2p, rd.p2p_n, 2, pp_nodes, sp.bw[links["pp"]],
                                  sp.ll_max) if rd.p2p else 0.0
        b_layers = b_fwd + b_bwd
        b_fsdp = fsdp_w - b_layers if fsdp_w > b_layers else 0.0
        b_pp = (pp_w - b_layers if pp_w > b_layers else 0.0) if o_pp else pp_w
        # (microbatch time, forward, backward, then the parts in PARTS order): flat, so a cache of them is cheap
        out.append((b_layers + b_fsdp + b_pp, b_fwd, b_bwd, comp, rec, b_tp, b_ep, b_cp, rg, b_off, b_host, b_fsdp,
                    b_pp))
        out.append((w_fwd + w_bwd + fsdp_w + pp_w, w_fwd, w_bwd, comp, rec, w_tp, w_ep, w_cp, rg, w_off, w_host,
                    fsdp_w, pp_w))
    return tuple(out)


def _rank_times_memo(rows, rd: RankDemand, d: Demand, sets: list[tuple[Speeds, tuple]], overlaps: tuple,
                     sets_key: tuple = ()) -> list:
    """_rank_times, memoized on the rank's shared layer part for what else it reads (the TP, EP and pipeline
    overlaps, the FSDP bytes, the groups and links, the speed sets)."""
    part = rd.layers
    if part is None:
        return _rank_times(rows, rd, d, sets, *overlaps)
    cache = part.__dict__.get("_rank_times")
    if cache is None:
        cache = {}
        object.__setattr__(part, "_rank_times", cache)
    key = (overlaps, rd.fsdp, rd.fsdp_n, d.groups, d.links, d.graph_all, sets_key)
    got = cache.get(key)
    if got is None:
        got = cache[key] = _rank_times(rows, rd, d, sets, *overlaps)
    return got


_CONTEXTS: dict = {}


def _contexts(sets: tuple, l_tp: str, l_ep: str, l_cp: str, g_tp: tuple, g_ep: tuple, g_cp: tuple) -> tuple:
    """Each speed set with the collectives' context it gives these groups (equal contexts shared), and a key of
    the speed sets (cached: the speed sets are _all_speeds' own objects)."""
    key = (tuple(map(id, sets)), l_tp, l_ep, l_cp, g_tp, g_ep, g_cp)
    got = _CONTEXTS.get(key)
    if got is None:
        if len(_CONTEXTS) >= 1024:
            _CONTEXTS.clear()
        got = _CONTEXTS[key] = _make_contexts(sets, l_tp, l_ep, l_cp, g_tp, g_ep, g_cp)
    return got


def _make_contexts(sets: tuple, l_tp: str, l_ep: str, l_cp: str, g_tp: tuple, g_ep: tuple, g_cp: tuple) -> tuple:
    ctxs: dict = {}
    out = []
    for sp in sets:
        bws = (sp.bw[l_tp], sp.bw[l_ep], sp.bw[l_cp], sp.ll_max)
        ctx = ctxs.get(bws)
        if ctx is None:
            ctx = ctxs[bws] = Ctx(g_tp + (bws[0],), g_ep + (bws[1],), g_cp + (bws[2],), sp.ll_max)
        out.append((sp, ctx))
    return tuple(out), tuple(sp.key for sp in sets)


def step_times(d: Demand, speeds: tuple[tuple[Speeds, bool], ...]) -> tuple[StepTime, ...]:
    """The step time under each (Speeds, best) of ``speeds`` (pairs of one Speeds, best then worst): one pass per
    distinct rank (_rank_times)."""
    sets = [sp for sp, best in speeds if best]
    if len(sets) * 2 != len(speeds):
        raise ValueError("speeds come in (best, worst) pairs")
    ov = dict(d.overlaps)
    links = dict(d.links)
    g = {name: (n, nodes) for name, n, nodes in d.groups} if d.groups else {}
    with_ctx, sets_key = _contexts(tuple(sets), links["tp"], links["ep"], links["cp"], g.get("tp", (1, 1)),
                                   g.get("ep", (1, 1)), g.get("cp", (1, 1)))
    overlaps = (ov["tp"], ov["ep"], ov["pp"])
    per_rank = [_rank_times_memo(rows, rd, d, with_ctx, overlaps, sets_key) for rd, rows in d.distinct]
    dp_n, dp_nodes = g.get("dp", (2, 1))
    dp_n = max(2, dp_n)
    out = []
    dp_link = links["dp"]
    dp_caches: dict = {}
    for c, sp in enumerate(sets):
        timed_best = [t[2 * c] for t in per_rank]
        timed_worst = [t[2 * c + 1] for t in per_rank]
        # the data-parallel collectives of the slowest rank (the same in both overlap cases and for every speed
        # set with the same link)
        dp_bw = sp.bw[dp_link]
        dp_cache = dp_caches.setdefault((dp_bw, sp.ll_max), {})

        def dp_times(rd, dp_bw=dp_bw, dp_cache=dp_cache, ll=sp.ll_max):
            got = dp_cache.get(id(rd))
            if got is None:
                kind = "rs" if rd.dp_grad and rd.dp_param else "ar"
                got = dp_cache[id(rd)] = (
                    collective_seconds(kind, rd.dp_grad, rd.dp_buckets, dp_n, dp_nodes, dp_bw, ll),
                    collective_seconds("ag", rd.dp_param, rd.dp_buckets, dp_n, dp_nodes, dp_bw, ll))
            return got
        out.append(_assemble(d, sp, True, timed_best, ov, dp_times))
        out.append(_assemble(d, sp, False, timed_worst, ov, dp_times))
    return tuple(out)


def step_time(d: Demand, sp: Speeds, best: bool) -> StepTime:
    """The step time under one speed set and one overlap case."""
    return step_times(d, ((sp, True), (sp, False)))[0 if best else 1]


def _assemble(d: Demand, sp: Speeds, best: bool, timed: list, ov: dict, dp_times) -> StepTime:
    pick = 0
    if len(timed) > 1:
        top = timed[0][0]
        for i in range(1, len(timed)):
            if timed[i][0] > top:
                pick, top = i, timed[i][0]
    entry = timed[pick]
    best_work, fwd, bwd = entry[0], entry[1], entry[2]
    rd = d.distinct[pick][0]
    m = d.microbatches
    # m microbatches of the slowest rank, and the schedule's bubble: (pp - 1) / vpp more of its microbatch time
    bubble = best_work * (d.pp - 1) / d.vpp if d.pp > 1 else 0.0
    # the last rank's deferred output-layer wgrads after its schedule: hidden in its cool-down at best (the
    # bubble), on the path at worst; a rank that is not the slowest runs them in its own slack first
    deferred = d.ranks[-1].deferred
    if deferred:
        slack = (best_work - timed[d.index[-1]][0]) * m
        idle = bubble + slack if best else slack
        deferred = deferred / sp.p16 - idle
        deferred = deferred if deferred > 0.0 else 0.0
    t_grad, t_param = dp_times(rd)
    if best:
        if ov["dp_grad"]:
            t_grad = t_grad - bwd if t_grad > bwd else 0.0
        if ov["dp_param"]:
            t_param = t_param - fwd if t_param > fwd else 0.0
    dp = t_grad + t_param
    f = d.offload_fraction
    optimizer = (1.0 - f) * rd.opt_params * d.opt_bytes / sp.hbm
    offload = 0.0
    if f:
        pcie = f * rd.opt_params * 2 * d.offload_param_bytes / sp.bw["host"]
        cpu = f * rd.opt_params * CPU_ADAM_BYTES / sp.host_dram
        offload = max(pcie, cpu) if ov["optimizer_offload"] and best else pcie + cpu
    seconds = best_work * m + bubble + deferred + dp + optimizer + offload
    return StepTime(seconds, d.index.index(pick), (entry[3:], m, bubble,
                                                   deferred if d.ranks[-1].deferred else None, dp, optimizer,
                                                   offload if f else None))


def link_bytes(d: Demand, rank: int) -> dict[str, float]:
    """Bytes per step rank ``rank``'s GPU moves on each link."""
    rd = d.ranks[rank]
    moved = {k: v * d.microbatches for k, v in _moved(d, rd).items()}
    link = dict(d.links)
    moved[link["dp"]] += rd.dp_grad + rd.dp_param
    if d.offload_fraction:
        moved["host"] += d.offload_fraction * rd.opt_params * 2 * d.offload_param_bytes
    return moved


def combos(g: Gpu) -> list[tuple[float, int, bool]]:
    parts = (0, 1) if any(x[0] != x[1] for x in (g.bf16, g.fp8, g.hbm, g.host_link, g.host_dram)) else (0,)
    return list(itertools.product(EFFICIENCY, parts, (True, False)))


# ----------------------------------------------------------------------------- the price of a change
@dataclass(frozen=True)
class Cost:
    """A change's price for this job: the step-time cost as a fraction of the step before it (a range), and its
    parts: extra FLOPs as a share of the step's, extra bytes per step on each link of the slowest GPU, the
    pipeline bubble before and after, the step time before and after (seconds, a range each)."""
    low: float
    high: float
    flops: float                                   # extra FLOPs / the step's FLOPs before
    link_bytes: tuple[tuple[str, float], ...]      # link -> extra bytes per step on the slowest rank's GPU
    bubble: tuple[float, float]
    seconds_before: tuple[float, float]
    seconds_after: tuple[float, float]
    parts: tuple[tuple[str, float, float], ...]    # mechanism -> (low, high) change in seconds
    gpu: str
    note: str = ""

    @property
    def mid(self) -> float:
        """The middle of the range."""
        return (self.low + self.high) / 2

    @property
    def key(self) -> tuple[float, float]:
        """What the ladder, search and doctor rank by (rank_key: the middle, then the high end)."""
        return rank_key(self.low, self.high)

    @property
    def text(self) -> str:
        rng = (f"{self.low:+.1%}" if abs(self.high - self.low) < 0.0005 else f"{self.low:+.1%} .. {self.high:+.1%}")
        bits = [f"{rng} step time"]
        if abs(self.flops) >= 0.0005:
            bits.append(f"FLOPs {self.flops:+.1%}")
        for link, b in self.link_bytes:
            if abs(b) >= 1e6:
                bits.append(f"{link} {_gb(b)}/step")
        if abs(self.bubble[1] - self.bubble[0]) >= 0.0005:
            bits.append(f"bubble {self.bubble[0]:.1%} -> {self.bubble[1]:.1%}")
        return "; ".join(bits) + f" ({self.gpu})"

    def as_dict(self) -> dict:
        return {"text": self.text, "low": round(self.low, 4), "high": round(self.high, 4), "mid": round(self.mid, 4),
                "rank_key": list(self.key),
                "flops": round(self.flops, 4), "bytes_per_link": {k: int(v) for k, v in self.link_bytes},
                "bubble": [round(x, 4) for x in self.bubble],
                "step_seconds_before": [round(x, 4) for x in self.seconds_before],
                "step_seconds_after": [round(x, 4) for x in self.seconds_after],
                "parts_seconds": {k: [round(lo, 5), round(hi, 5)] for k, lo, hi in self.parts},
                "gpu": self.gpu, "efficiency": list(EFFICIENCY), "efficiency_source": EFFICIENCY_SOURCE,
                **({"note": self.note} if self.note else {})}


def _gb(b: float) -> str:
    sign = "+" if b > 0 else "-"
    return f"{sign}{abs(b) / 1e9:.2f} GB" if abs(b) >= 1e8 else f"{sign}{abs(b) / 1e6:.0f} MB"


Job = tuple[Shape, Layout, Settings, CostInputs]


@functools.lru_cache(maxsize=64)
def _all_speeds(arch: int | None) -> tuple[tuple[Speeds, bool], ...]:
    g, _ = gpu(arch)
    return tuple((_speeds(g, eff, part), best) for eff, part, best in combos(g))


def _evaluate(job: Job, arch: int | None = None, cached: bool = True) -> tuple[Demand, tuple[StepTime, ...]]:
    g, _ = gpu(arch)
    d = (demand if cached else _demand)(*job, domain=g.nvlink_domain)
    return d, step_times(d, _all_speeds(arch))


@functools.lru_cache(maxsize=512)
def evaluate(job: Job, arch: int | None = None) -> tuple[Demand, tuple[StepTime, ...]]:
    """``job``'s demand and its step time under every assumption combination (combos), in a fixed order (cached:
    a ladder or a search prices many changes from one configuration)."""
    return _evaluate(job, arch)


def times(job: Job, arch: int | None = None) -> tuple[StepTime, ...]:
    """The step time of ``job`` under every assumption combination (combos), in a fixed order."""
    return evaluate(job, arch)[1]


def rank_key(low: float, high: float) -> tuple[float, float]:
    """The order of two costs: by the middle of their ranges, then by their high ends (rounded to 0.1% so noise
    ties). The ends of a range are the same assumptions taken both ways (the efficiency, the part a compute
    capability covers, every overlap working or failing), so its middle is the model's estimate with no
    assumption favoured, and the high end (all of them failing) only breaks ties between equal estimates: the
    less a cost rests on overlaps, the better (docs/cost-model.md, "What ranks by it")."""
    return round((low + high) / 2, 3), round(high, 3)


def cost_range(before: Job, after: Job, arch: int | None = None) -> tuple[float, float]:
    """(low, high) of price(before, after).low/.high, without its parts: what a search ranks thousands by (``after``
    is not cached: each candidate is priced once)."""
    t0 = evaluate(before, arch)[1]
    t1 = _evaluate(after, arch, cached=False)[1]
    ratios = [_ratio(a.seconds, b.seconds) for a, b in zip(t0, t1)]
    return min(ratios), max(ratios)


def _ratio(before: float, after: float) -> float:
    """after / before - 1; 0 for a step the model gives no time (nothing to price against)."""
    return after / before - 1.0 if before > 0 else 0.0


def price(before: Job, after: Job, arch: int | None = None) -> Cost:
    """The cost of going from ``before`` to ``after`` (each (Shape, Layout, Settings, CostInputs)) on GPUs of
    compute capability ``arch``."""
    g, note = gpu(arch)
    d0, t0 = evaluate(before, arch)
    d1, t1 = evaluate(after, arch)
    ratios = [_ratio(a.seconds, b.seconds) for a, b in zip(t0, t1)]
    f0 = _total(d0)
    f1 = _total(d1)
    ref0, ref1 = t0[-1], t1[-1]   # slowest efficiency, worst overlap: the bytes of the critical GPU
    b0, b1 = link_bytes(d0, ref0.rank), link_bytes(d1, ref1.rank)
    links = tuple((k, b1.get(k, 0.0) - b0.get(k, 0.0)) for k in LINKS)
    deltas = []
    p0 = [dict(a.parts) for a in t0]
    p1 = [dict(b.parts) for b in t1]
    for name in dict.fromkeys([k for k, _ in ref0.parts] + [k for k, _ in ref1.parts]):
        ch = [b.get(name, 0.0) - a.get(name, 0.0) for a, b in zip(p0, p1)]
        lo, hi = min(ch), max(ch)
        if lo or hi:
            deltas.append((name, lo, hi))
    return Cost(min(ratios), max(ratios), (f1 - f0) / f0 if f0 else 0.0, links, (d0.bubble, d1.bubble),
                (min(t.seconds for t in t0), max(t.seconds for t in t0)),
                (min(t.seconds for t in t1), max(t.seconds for t in t1)), tuple(deltas), g.name, note)


def _total(d: Demand) -> float:
    """The step's FLOPs over every rank (one GPU per rank, m microbatches), recompute included."""
    return sum((rd.flops + rd.recompute) * d.microbatches for rd in d.ranks) * d.gpus_per_rank


def flops_share(job: Job) -> float:
    """Recompute FLOPs as a share of the step's FLOPs without them (work.py's layer-by-layer count)."""
    d = demand(*job)
    base = sum(rd.flops for rd in d.ranks)
    return sum(rd.recompute for rd in d.ranks) / base if base else 0.0
