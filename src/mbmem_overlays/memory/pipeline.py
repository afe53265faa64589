"""Which layers each pipeline rank holds, how many microbatches are in flight on it, and which ranks can be the
most loaded (Megatron's pipeline schedules)."""

from __future__ import annotations

import functools
import itertools

from .inputs import Layout, Shape

# models/hybrid/hybrid_layer_allocation.py Symbols (:14-26) -> the plan's blocks: G a gated delta net, D DeepSeek
# sparse attention (absorbed MLA with an indexer), + MLA (hybrid_layer_specs.py gdn_layer, dsa_layer, mla_layer)
HYBRID_SYMBOLS = {"M": "mamba", "*": "attn", "-": "mlp", "E": "moe", "G": "gdn", "D": "dsa", "+": "mla"}
# Appended to the kind of a layer that runs outside FP8 in an FP8 job (Shape.bf16_layers): "attn+mlp@bf16"
BF16_LAYER = "@bf16"


def blocks_of(kind: str) -> tuple[str, ...]:
    """The blocks of one layer kind ("attn+mlp" -> attn, mlp), without its precision mark."""
    return tuple(kind.removesuffix(BF16_LAYER).split("+"))


def runs_bf16(kind: str) -> bool:
    """Whether a layer of ``kind`` is one of an FP8 job's first/last layers kept in bf16 (Shape.bf16_layers)."""
    return kind.endswith(BF16_LAYER)


def layer_kinds(s: Shape) -> tuple[str, ...]:
    """One kind per main-decoder layer, in global layer order; with FP8 the first/last layers the job keeps in bf16
    carry BF16_LAYER: fp8_utils.py is_first_last_bf16_layer takes the global layer index (layer_number - 1 over
    every pipeline rank, transformer_block.py get_fp8_context(config, layer.layer_number - 1); a hybrid stack
    counts each block symbol as a layer, hybrid_block.py :128, :363-365) against num_layers, so the marks fall
    on the first ``start`` and the last ``end`` layers of the whole stack, whichever ranks hold them."""
    if s.layer_kinds:
        kinds = s.layer_kinds
    else:
        moe = [round((i + 1) * s.moe_layers / s.layers) - round(i * s.moe_layers / s.layers) for i in range(s.layers)]
        kinds = tuple("attn+moe" if m else "attn+mlp" for m in moe)
    start, end = s.bf16_layers
    if not (start or end):
        return kinds
    n = len(kinds)
    return tuple(k + BF16_LAYER if (i < start or i >= n - end) else k for i, k in enumerate(kinds))


def rank_layers(s: Shape, lay: Layout, rank: int) -> dict[str, int]:
    """How many layers of each kind pipeline rank ``rank`` holds (its ``vpp`` interleaved chunks)."""
    return dict(_rank_layers(layer_kinds(s), lay.pp, lay.vpp, rank, lay.chunk_layers))


def rank_chunks(s: Shape, lay: Layout, rank: int) -> tuple[tuple[str, ...], ...]:
    """The layer kinds of each model chunk pipeline rank ``rank`` holds, in order."""
    return _rank_chunks(layer_kinds(s), lay.pp, lay.vpp, rank, lay.chunk_layers)


# The per-rank splits are asked for every pipeline rank, several times each: keyed by the identity of the layer
# kinds and chunk sizes (the Shape's and Layout's own tuples), not their contents, which an lru_cache would hash
# whole on every call (one entry per layer: the plan was O(pp x layers), minutes at a few thousand stages). Each
# entry keeps its tuples alive, so an id is never reused while its entry exists.
_SPLITS: dict[tuple, tuple] = {}
_SPLITS_MAX = 8192


def _cached(kind: str, kinds: tuple, pp: int, vpp: int, rank: int, sizes: tuple, build):
    key = (kind, id(kinds), id(sizes), pp, vpp, rank)
    hit = _SPLITS.get(key)
    if hit is not None and hit[0] is kinds and hit[1] is sizes:
        return hit[2]
    value = build()
    if len(_SPLITS) >= _SPLITS_MAX:
        _SPLITS.clear()
    _SPLITS[key] = (kinds, sizes, value)
    return value


def _rank_chunks(kinds: tuple[str, ...], pp: int, vpp: int, rank: int,
                 sizes: tuple[int, ...] = ()) -> tuple[tuple[str, ...], ...]:
    """The layers of each model chunk pipeline rank ``rank`` holds, in order (chunk c sits on rank c % pp).

    ``sizes``: the decoder layers of each chunk in chunk order (Layout.chunk_layers, from a pipeline layout or an
    uneven split); empty: the even split (transformer_block.py get_num_layers_to_build). Only this rank's chunk
    bounds are computed (the whole list of pp x vpp bounds per rank made the plan quadratic in the stages)."""
    def build():
        chunks = pp * vpp
        if sizes and len(sizes) == chunks:
            starts = _cached("starts", (), 0, 0, 0, sizes, lambda: tuple(itertools.accumulate(sizes, initial=0)))
            return tuple(kinds[starts[c]:starts[c + 1]] for c in range(rank, chunks, pp))
        n = len(kinds)
        return tuple(kinds[round(c * n / chunks):round((c + 1) * n / chunks)] for c in range(rank, chunks, pp))
    return _cached("chunks", kinds, pp, vpp, rank, sizes, build)


def _rank_layers(kinds: tuple[str, ...], pp: int, vpp: int, rank: int,
                 sizes: tuple[int, ...] = ()) -> tuple[tuple[str, int], ...]:
    def build():
        counts: dict[str, int] = {}
        for chunk in _rank_chunks(kinds, pp, vpp, rank, sizes):
            for kind in chunk:
                counts[kind] = counts.get(kind, 0) + 1
        return tuple(counts.items())
    return _cached("layers", kinds, pp, vpp, rank, sizes, build)


def vp_group(lay: Layout) -> int:
    """The interleaved schedule's microbatch group per virtual stage (microbatch_group_size_per_vp_stage): the
    pipeline size unless set (model_parallel_config.py:567-568). megatron-core refuses a group outside
    [pp, microbatches] (schedules.py:1133-1141); the plan keeps such a layout plannable (the search tries other
    pipeline sizes with the same settings) by holding the group to that range."""
    group = lay.vp_group or lay.pp
    return max(lay.pp, min(group, max(lay.pp, lay.microbatches)))


@functools.lru_cache(maxsize=4096)
def alive_chunk_microbatches(pp: int, vpp: int, rank: int, microbatches: int,
                             group: int) -> tuple[tuple[int, ...], ...]:
    """The distinct counts, per model chunk of pipeline rank ``rank``, of the microbatches whose forward has run
    and whose backward has not, right after each forward step (the moments the rank's activations peak), less those
    another count matches or exceeds in every chunk.

    Non-interleaved 1F1B (schedules.py forward_backward_pipelining_without_interleaving :2243-2245): min(pp - rank
    - 1, m) warm-up forwards, then one forward and one backward per step: pp - rank microbatches alive at most.
    Interleaved (forward_backward_pipelining_with_interleaving): get_pp_rank_microbatches (:937-951) gives the
    warm-up forwards, (pp - rank - 1) x 2 + (vpp - 1) x group, all m x vpp when that is as many; the virtual
    microbatch k runs model chunk get_schedule_table(m, vpp, group)[k] (:962-989) forward, and the backward k
    runs chunk vpp - 1 - that (get_model_chunk_id :1217-1222), each step a forward then a backward
    (forward_backward_helper_wrapper, the steady loop :1706-1900), the rest backward in the cool-down. A chunk's
    backward pops its oldest input and output (backward_step_helper_preprocess :1392-1409)."""
    m = max(1, microbatches)
    if vpp <= 1:
        return ((min(pp - rank, m),),)
    total = m * vpp
    warmup = min((pp - rank - 1) * 2 + (vpp - 1) * group, total)
    # get_schedule_table: the whole groups of `group` microbatches, each run through chunks 0..vpp-1 (a period of
    # group x vpp virtual microbatches), then the last group of `rem` microbatches; computed per index, not built
    period, whole = group * vpp, (m // group) * group * vpp
    rem = m - (m // group) * group

    def chunk(i: int) -> int:
        return (i % period) // group if i < whole else (i - whole) // rem

    def forwards(n: int) -> list[int]:
        """Per chunk: the forwards among the first n virtual microbatches."""
        q, r = divmod(min(n, whole), period)
        out = [q * group + min(group, max(0, r - c * group)) for c in range(vpp)]
        if n > whole:
            out = [x + min(rem, max(0, n - whole - c * rem)) for c, x in enumerate(out)]
        return out

    alive = forwards(warmup)
    if warmup == total:   # everything in warm-up: all forwards, then all backwards
        return (tuple(alive),)
    # In warm-up the counts only grow, so the first steady-state one covers them all; every steady step runs one
    # forward and one backward, so its counts all sum to warmup + 1 and none covers another. While step k's forward
    # is inside the whole groups, step k + period repeats step k's counts (each chunk gains `group` forwards and
    # loses `group` backwards in between): only the first period and the steps from the last whole group on are
    # walked, so the work is at most 2 x group x vpp steps whatever the number of microbatches.
    steps = total - warmup
    repeats_until = max(0, whole - warmup)          # steps k < this have their forward inside the whole groups
    seen: dict[tuple[int, ...], None] = {}
    for first, last in ((0, min(steps, period)), (max(period, repeats_until), steps)):
        if first >= last:
            continue
        if first > 0:   # the counts before step `first`: its forwards less the first `first` backwards
            done = forwards(first)
            alive = [f - done[vpp - 1 - c] for c, f in enumerate(forwards(warmup + first))]
        for k in range(first, last):
            alive[chunk(warmup + k)] += 1
            seen.setdefault(tuple(alive))
            alive[vpp - 1 - chunk(k)] -= 1
    return tuple(seen)


def rank_alive(lay: Layout, rank: int) -> tuple[tuple[int, ...], ...]:
    """alive_chunk_microbatches for pipeline rank ``rank`` of ``lay``."""
    return alive_chunk_microbatches(lay.pp, lay.vpp if lay.pp > 1 else 1, rank if lay.pp > 1 else 0,
                                    lay.microbatches, vp_group(lay))


def in_flight(lay: Layout, rank: int, chunk_weights: tuple[float, ...] | None = None) -> float:
    """Layer-microbatches of activations alive on pipeline rank ``rank`` at its peak, in units of 'all this
    stage's layers': the largest rank_alive count weighted by each chunk's share (``chunk_weights``, one per
    chunk of the rank: its layers or their bytes; None: the layers of Layout.chunk_layers, else equal chunks)."""
    if lay.pp == 1:
        return 1.0
    if chunk_weights is None:
        sizes = lay.chunk_layers
        chunk_weights = (tuple(float(sizes[c]) for c in range(rank, len(sizes), lay.pp))
                         if sizes and len(sizes) == lay.pp * lay.vpp else (1.0,) * lay.vpp)
    stage = sum(chunk_weights)
    if stage <= 0:
        return float(max(max(counts) for counts in rank_alive(lay, rank)))
    return max(sum(n * w for n, w in zip(counts, chunk_weights)) for counts in rank_alive(lay, rank)) / stage


def _candidate_ranks(s: Shape, lay: Layout) -> list[int]:
    """The ranks that can be the most loaded: the first and last, and any middle rank whose layers differ
    from theirs (an even split of a uniform stack gives middle ranks fewer in-flight microbatches than the
    first and neither embedding nor output layer)."""
    ends = sorted({0, lay.pp - 1})
    seen = {_rank_layers(layer_kinds(s), lay.pp, lay.vpp, r, lay.chunk_layers) for r in ends}
    return ends + [r for r in range(1, lay.pp - 1) if _rank_layers(layer_kinds(s), lay.pp, lay.vpp, r, lay.chunk_layers)
                           not in seen]


def combined_step_extra(forward: tuple, backward: tuple, delay: bool = False) -> float:
    """The most bytes one combined 1F1B step (overlap_moe_expert_parallel_comm) holds beyond what it starts with:
    the backward microbatch's chunk alive whole, the forward microbatch's chunk not yet run. ``forward`` and
    ``backward`` are the two chunks' layers in order, each an activations.OverlapLayer; ``delay``:
    delay_wgrad_compute.

    TransformerModelChunkSchedulePlan.run (models/common/model_chunk_schedule_plan.py:548-582) pairs forward layer
    i with backward layer n - 1 - i, then runs the backward's remaining layers, then the forward's. One pair
    (TransformerLayerSchedulePlan.run :224-291): the backward's combine, the forward's pre-dispatch (attention ..
    dispatch preprocess), the backward's mlp (its kept tensors freed, or with the delay only those not kept for the
    weight gradient), the forward's dispatch, the backward's mlp backward_dw, its dispatch, the forward's mlp and
    combine, the backward's pre-dispatch, then (except for the chunk's last backward layer, whose runs after the
    p2p sends, :596-602, before the forward's loss) its pre-dispatch backward_dw. Each node's backward frees what
    its forward saved (pipeline_parallel/utils.py ScheduleNode)."""
    nf, nb = len(forward), len(backward)
    cur = peak = 0.0
    for i in range(min(nf, nb)):
        f, b = forward[i], backward[nb - 1 - i]
        cur += f.pre                                             # forward pre-dispatch
        cur += -b.mlp + (b.mlp_wgrad if delay else 0.0)          # backward mlp: dgrad only with the delay
        cur += f.dispatched                                      # forward dispatch: the experts' input arrives
        peak = max(peak, cur)
        cur -= b.mlp_wgrad if delay else 0.0                     # backward mlp backward_dw
        cur += f.mlp - f.dispatched                              # forward mlp and combine
        peak = max(peak, cur)
        cur += -b.pre + (b.pre_wgrad if delay else 0.0)          # backward pre-dispatch
        peak = max(peak, cur)
        cur -= b.pre_wgrad if delay else 0.0                     # its backward_dw
    for j in range(nb - min(nf, nb) - 1, -1, -1):                # the backward's remaining layers
        b = backward[j]
        cur += -b.mlp + (b.mlp_wgrad if delay else 0.0)
        peak = max(peak, cur)
        cur += -(b.mlp_wgrad if delay else 0.0) - b.pre + (b.pre_wgrad if delay else 0.0)
        peak = max(peak, cur)
        cur -= b.pre_wgrad if delay else 0.0
    for i in range(min(nf, nb), nf):                             # the forward's remaining layers
        cur += forward[i].pre + forward[i].mlp
        peak = max(peak, cur)
    return peak
