"""A training step's time on one GPU type, from the demand of every layer (work.py), and the cost of a change.

The step (per pipeline rank, per microbatch, then the schedule):
- compute: tensor-core FLOPs at the GPU's dense peak times the efficiency (gpus.EFFICIENCY), memory-bound bytes at
  its HBM bandwidth; in backward what recompute replays (selective: the labels' regions; full: every checkpointed
  layer's whole forward, work.LayerWork.full), each on the critical path;
- the pipeline: the most loaded rank's microbatch time x (m + (pp - 1) / vpp): the interleaved 1F1B schedule's
  bubble is (pp - 1) / (vpp x m) of the ideal time (megatron-core pipeline_parallel/schedules.py
  forward_backward_pipelining_with_interleaving: (pp - rank - 1) x 2 + (vpp - 1) x group warm-up microbatches,
  get_pp_rank_microbatches :937-951; without interleaving pp - rank - 1, :2243-2245); every rank waits for the
  slowest, so an uneven stage (the last one's output layer and loss) sets the pace;
- communication, each over its group's link (NVLink inside an NVLink domain, the GPU's NIC across; rank order
  tp-cp-ep-dp-pp, parallel_state.py initialize_model_parallel ``order``), with an overlap assumption each:
  TP collectives exposed unless TP comm overlap is on (then hidden up to the layer's compute at best, exposed at
  worst); expert all-to-alls likewise with overlap_moe_expert_parallel_comm; the context-parallel ring hidden up
  to the attention it feeds at best; pipeline send/receive hidden at best only with overlap_p2p_comm;
  the data-parallel gradient reduce-scatter (or all-reduce) hidden behind one microbatch's backward at best with
  overlap_grad_reduce (megatron-core launches it in the last microbatch's backward,
  distributed/distributed_data_parallel.py), the parameter all-gather behind one forward with
  overlap_param_gather; Megatron FSDP's per-layer all-gathers (forward and backward) and reduce-scatters hidden up
  to the layer's compute at best (its prefetch; megatron_fsdp.py:755-773 reduces every microbatch under
  optim_grads and optim_grads_params); LoRA's input re-gather hidden behind the backward at best; activation
  offload (layer-level and fine-grained) overlapped with the layer's own compute at best; every one exposed at
  worst;
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
from dataclasses import dataclass, field, replace

from ..inputs import Layout, Settings, Shape, _tokens
from ..pipeline import rank_chunks, rank_layers
from ..weights import data_parallel_shards, lora_params, mtp_blocks, optimizer_shards, stage_params
from .gpus import EFFICIENCY, EFFICIENCY_SOURCE, Gpu, gpu
from .inputs import CostInputs, dp_overlaps, p2p_overlap, tp_overlap
from .work import (ZERO, LayerWork, layer_work, mtp_eh, optimizer_bytes_per_param, output_layer_work,
                   recompute_flops, step_flops)

CPU_ADAM_BYTES = 28    # torch fused AdamW on fp32: reads param, grad, exp_avg, exp_avg_sq; writes param and moments
LINKS = ("nvlink", "network", "host")


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


def _count(kinds) -> dict[str, int]:
    out: dict[str, int] = {}
    for kind in kinds:
        out[kind] = out.get(kind, 0) + 1
    return out


def _rank_demand(s: Shape, lay: Layout, st: Settings, ci: CostInputs, rank: int,
                 chunks: tuple[tuple[str, ...], ...], work=None) -> RankDemand:
    """One pipeline rank's demand; ``work(kind, offloaded)``: the layers' LayerWork (work.layer_work)."""
    if work is None:
        def work(kind: str, offloaded: bool = False) -> LayerWork:
            return layer_work(s, lay, st, kind, ci.dispatcher, offloaded)
    last = rank == lay.pp - 1
    full = [0.0] * 7
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
    p2p = 2 * max(1, lay.vpp) * tokens * s.hidden * st.dtype_bytes / sp if lay.pp > 1 else 0.0
    # parameters on this GPU (memory/weights.py stage_params) and what the data-parallel group moves of them
    layer_p, embed, expert = stage_params(s, lay, rank == 0, last, rank)
    dense_p = layer_p + embed
    frozen = st.lora_rank > 0
    adapters = lora_params(s, lay, st, rank)
    train_dense, train_expert = (adapters, 0.0) if frozen else (dense_p, expert)
    dense_dp, expert_dp = data_parallel_shards(lay, st)
    ring_d = (dense_dp - 1) / dense_dp if dense_dp > 1 else 0.0
    ring_e = (expert_dp - 1) / expert_dp if expert_dp > 1 else 0.0
    pb = 1.0 if ci.fp8_param_gather else float(st.param_bytes)
    grad_bytes = (train_dense * ring_d + train_expert * ring_e) * st.grad_bytes
    param_bytes = (train_dense * ring_d + train_expert * ring_e) * pb
    fsdp = 0.0
    dp_grad = dp_param = 0.0
    if st.fsdp is not None and st.fsdp in ("optim_grads_params", "optim_grads"):
        # per microbatch: the gradients reduce-scattered (every bprop, megatron_fsdp.py:755-773); with the weights
        # sharded too, every unit all-gathered before its forward and again before its backward
        fsdp = grad_bytes
        if st.fsdp == "optim_grads_params":
            fsdp += 2 * (dense_p * ring_d + expert * ring_e) * pb
        else:
            dp_param = param_bytes
    elif st.dist_optimizer or st.fsdp is not None:
        dp_grad, dp_param = grad_bytes, param_bytes
    else:
        dp_grad = 2 * grad_bytes    # an all-reduce
    if st.fsdp is not None:
        shards_d, shards_e = dense_dp, expert_dp
    else:
        shards_d, shards_e = optimizer_shards(lay, st) if st.dist_optimizer else (1, 1)
    opt_params = train_dense / shards_d + train_expert / shards_e
    flops = sum(n * step_flops(w) for w, n in kinds) + step_flops(extra) + deferred / m
    recompute = sum(n * recompute_flops(w) for w, n in kinds) + full[0] + full[1] + full[2]
    return RankDemand(kinds, extra, tuple(full), p2p, fsdp, dp_grad, dp_param, opt_params, flops, recompute,
                      deferred)


def demand(s: Shape, lay: Layout, st: Settings, ci: CostInputs, domain: int = 8) -> Demand:
    """What one training step asks of every pipeline rank's GPUs (before any GPU's speed); cached (a few hundred)."""
    return _demand_cached(s, lay, st, ci, domain)


def _demand(s: Shape, lay: Layout, st: Settings, ci: CostInputs, domain: int = 8) -> Demand:
    """What one training step asks of every pipeline rank's GPUs (before any GPU's speed)."""
    made: dict = {}
    works: dict = {}

    def work(kind: str, offloaded: bool = False) -> LayerWork:
        if (kind, offloaded) not in works:
            works[kind, offloaded] = layer_work(s, lay, st, kind, ci.dispatcher, offloaded)
        return works[kind, offloaded]
    ranks = []
    for r in range(lay.pp):
        chunks = rank_chunks(s, lay, r)
        key = (chunks, r == 0, r == lay.pp - 1)
        if key not in made:
            made[key] = _rank_demand(s, lay, st, ci, r, chunks, work)
        ranks.append(made[key])
    ranks = tuple(ranks)
    grad, param = dp_overlaps(ci, lay, st)
    overlaps = (("tp", tp_overlap(ci, lay)), ("ep", ci.ep_overlap), ("pp", p2p_overlap(ci, lay)),
                ("dp_grad", grad), ("dp_param", param), ("optimizer_offload", ci.optimizer_offload_overlap))
    per_param = 2.0 if st.precision_aware else 4.0
    seen: dict = {}
    index = []
    for rd in ranks:
        key = id(rd)   # ranks with the same layers are one RankDemand (made above)
        if key not in seen:
            seen[key] = (len(seen), (rd, _rows(rd)))
        index.append(seen[key][0])
    return Demand(ranks, lay.microbatches, lay.pp, max(1, lay.vpp) if lay.pp > 1 else 1, _links(lay, domain),
                  st.optimizer_offload, per_param, optimizer_bytes_per_param(st), lay.tp * lay.cp * lay.dp, overlaps,
                  tuple(v[1] for v in seen.values()), tuple(index))


_demand_cached = functools.lru_cache(maxsize=512)(_demand)


@dataclass(frozen=True)
class Speeds:
    p8: float
    p16: float
    hbm: float
    bw: dict
    host_dram: float


def _speeds(g: Gpu, efficiency: float, part: int) -> Speeds:
    p16 = g.bf16[part] * efficiency
    p8 = (g.fp8[part] or g.bf16[part]) * efficiency
    return Speeds(p8, p16, g.hbm[part], {"nvlink": g.nvlink, "network": g.network, "host": g.host_link[part]},
                  g.host_dram[part])


@dataclass(frozen=True)
class StepTime:
    seconds: float
    rank: int                                 # the slowest pipeline rank
    raw: tuple = field(default=(), repr=False)   # what ``parts`` is built from (step_times' per-rank parts, ...)

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


PARTS = ("compute", "recompute", "tp", "ep", "cp", "regather", "offload", "fsdp", "pp")


def _rows(rd: RankDemand) -> tuple[tuple[float, ...], ...]:
    """A rank's layer kinds (and its output layer) as plain tuples for step_time's inner loop."""
    return tuple((n, w.f8, w.f16, w.fm, w.b8, w.b16, w.bm, w.r8, w.r16, w.rm, w.tp_f + w.tp_b + w.r_tp,
                  w.ep_f + w.ep_b + w.r_ep, w.cp_f + w.cp_b + w.r_cp, w.attn, w.regather, w.d2h, w.h2d)
                 for w, n in rd.kinds + ((rd.extra, 1),))


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


def _rank_times(rows, rd: RankDemand, combos: list[tuple]) -> list[tuple[float, tuple, float, float]]:
    """For each combination (_combo_params: one speed set, then the best and the worst overlap case), (microbatch
    time, its parts in PARTS order, forward time, backward time) of one rank, in one pass over its rows. The
    compute of a speed set is the same for both cases; only what the overlaps hide differs."""
    out = []
    full = rd.full_replay
    replay = full[0] or full[1] or full[2] or full[3]
    for i8, i16, ih, itp, iep, icp, ihost, idp, ipp, o_tp, o_ep, o_pp in combos:
        compute = recompute = regather = fwd = bwd = 0.0
        tp_b = tp_w = ep_b = ep_w = cp_b = cp_w = off_b = off_w = 0.0
        for n, f8, f16, fm, b8, b16, bm, r8, r16, rm, t_tp, t_ep, t_cp, attn, rg, d2h, h2d in rows:
            cf = f8 * i8 + f16 * i16 + fm * ih
            cb = b8 * i8 + b16 * i16 + bm * ih
            rc = r8 * i8 + r16 * i16 + rm * ih
            fwd += n * cf
            bwd += n * (cb + rc)
            compute += n * (cf + cb)
            recompute += n * rc
            layer = cf + cb + rc
            if t_tp:
                x = t_tp * itp
                tp_w += n * x
                tp_b += n * ((x - layer if x > layer else 0.0) if o_tp else x)
            if t_ep:
                x = t_ep * iep
                ep_w += n * x
                ep_b += n * ((x - layer if x > layer else 0.0) if o_ep else x)
            if t_cp:
                x, y = t_cp * icp, 3.5 * attn * i16
                cp_w += n * x
                cp_b += n * (x - y if x > y else 0.0)
            if rg:
                regather += n * rg * itp
            if d2h or h2d:
                x, y = d2h * ihost, h2d * ihost
                off_w += n * (x + y)
                off_b += n * (max(0.0, x - cf) + max(0.0, y - cb))
        if replay:
            f = full[0] * i8 + (full[1] + full[2]) * i16 + full[3] * ih
            recompute += f
            bwd += f
            x = full[4] * itp
            tp_w += x
            tp_b += max(0.0, x - f) if o_tp else x
            x = full[5] * iep
            ep_w += x
            ep_b += max(0.0, x - f) if o_ep else x
            x = full[6] * icp
            cp_w += x
            cp_b += max(0.0, x - f)
        layer_time = fwd + bwd
        fsdp_w = rd.fsdp * idp
        fsdp_b = max(0.0, fsdp_w - layer_time)
        pp_w = rd.p2p * ipp
        pp_b = max(0.0, pp_w - layer_time) if o_pp else pp_w
        for best in (True, False):
            parts = ((compute, recompute, tp_b, ep_b, cp_b, regather, off_b, fsdp_b, pp_b) if best else
                     (compute, recompute, tp_w, ep_w, cp_w, regather, off_w, fsdp_w, pp_w))
            out.append((sum(parts), parts, fwd, bwd))
    return out


def _combo_params(d: Demand, sp: Speeds) -> tuple:
    """One speed set as step_times' inner loop reads it: inverse rates, and which overlaps are on (best case)."""
    bw = {name: sp.bw[link] for name, link in d.links}
    ov = dict(d.overlaps)
    return (1 / sp.p8, 1 / sp.p16, 1 / sp.hbm, 1 / bw["tp"], 1 / bw["ep"], 1 / bw["cp"], 1 / bw["host"],
            1 / bw["dp"], 1 / bw["pp"], ov["tp"], ov["ep"], ov["pp"])


def step_times(d: Demand, speeds: tuple[tuple[Speeds, bool], ...]) -> tuple[StepTime, ...]:
    """The step time under each (Speeds, best) of ``speeds`` (pairs of one Speeds, best then worst): one pass per
    distinct rank (_rank_times)."""
    sets = [sp for sp, best in speeds if best]
    assert list(speeds) == [p for sp in sets for p in ((sp, True), (sp, False))], "speeds come in (best, worst) pairs"
    params = [_combo_params(d, sp) for sp in sets]
    per_rank = [_rank_times(rows, rd, params) for rd, rows in d.distinct]
    ov = dict(d.overlaps)
    links = dict(d.links)
    return tuple(_assemble(d, sp, best, [t[c] for t in per_rank], ov, links)
                 for c, (sp, best) in enumerate(speeds))


def step_time(d: Demand, sp: Speeds, best: bool) -> StepTime:
    """The step time under one speed set and one overlap case."""
    return step_times(d, ((sp, True), (sp, False)))[0 if best else 1]


def _assemble(d: Demand, sp: Speeds, best: bool, timed: list, ov: dict, links: dict) -> StepTime:
    index = d.index
    pick = 0
    for i in range(1, len(timed)):
        if timed[i][0] > timed[pick][0]:
            pick = i
    best_work, best_parts, fwd, bwd = timed[pick]
    rd = d.distinct[pick][0]
    m = d.microbatches
    # m microbatches of the slowest rank, and the schedule's bubble: (pp - 1) / vpp more of its microbatch time
    bubble = best_work * ((d.pp - 1) / d.vpp if d.pp > 1 else 0.0)
    # the last rank's deferred output-layer wgrads after its schedule: hidden in its cool-down at best (the
    # bubble), on the path at worst; a rank that is not the slowest runs them in its own slack first
    deferred = d.ranks[-1].deferred
    if deferred:
        slack = (best_work - timed[index[-1]][0]) * m
        idle = bubble + slack if best else slack
        deferred = deferred / sp.p16 - idle
        deferred = deferred if deferred > 0.0 else 0.0
    dp_bw = sp.bw[links["dp"]]
    dp = (_hide(rd.dp_grad / dp_bw, bwd, ov["dp_grad"], best) + _hide(rd.dp_param / dp_bw, fwd, ov["dp_param"], best))
    f = d.offload_fraction
    optimizer = (1.0 - f) * rd.opt_params * d.opt_bytes / sp.hbm
    offload = 0.0
    if f:
        pcie = f * rd.opt_params * 2 * d.offload_param_bytes / sp.bw["host"]
        cpu = f * rd.opt_params * CPU_ADAM_BYTES / sp.host_dram
        offload = max(pcie, cpu) if ov["optimizer_offload"] and best else pcie + cpu
    seconds = best_work * m + bubble + deferred + dp + optimizer + offload
    return StepTime(seconds, index.index(pick), (best_parts, m, bubble, deferred if d.ranks[-1].deferred else None,
                                                 dp, optimizer, offload if f else None))


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
        """What the ladder, search and doctor rank by: the high end first (what the change costs when the
        overlaps it relies on do not hide its communication), then the low end."""
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
    """The order of two costs: by their high ends, then their low ends (rounded to 0.1% so noise ties)."""
    return round(high, 3), round(low, 3)


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
