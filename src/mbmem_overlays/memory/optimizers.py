"""The emerging optimizers' state (Muon), as megatron-core 0.19.2 builds it, and the layer-wise distributed
optimizer that shards it by whole parameters.

Muon (``optimizer: muon``) orthogonalizes the update of every 2-D parameter that is not an embedding or output
layer, and hands the rest to a scalar optimizer (Adam by default): megatron/core/optimizer/emerging_optimizers.py
``_is_nonlinear_or_embedding`` (:128-130) routes ``is_embedding_or_output_parameter`` and non-2-D parameters to
``muon_scalar_optimizer``. Its per-parameter state is one momentum buffer the size of the parameter it steps
(Emerging-Optimizers ``OrthogonalizedOptimizer._init_group``: ``state["momentum_buffer"] = torch.zeros_like(p)``),
and ``p`` is the fp32 master that ``Float16OptimizerWithFloat16Params`` wraps it with under bf16 (or the fp32
parameter itself): 4 bytes, where Adam keeps two moments.

An emerging optimizer is never megatron-core's DistributedOptimizer: Megatron-LM turns
``--use-distributed-optimizer`` into ``use_layer_wise_distributed_optimizer`` (megatron/training/arguments.py
:1670-1682), and with ``--no-use-layer-wise-param-layout`` (the legacy path) ``LayerWiseDistributedOptimizer``
assigns whole parameters of the data-parallel group to its ranks ping-pong by size
(optimizer/layer_wise_optimizer.py ``_shard_params_ping_pong`` :628-680: sorted by numel, ranks 0..n-1, n-1..0,
dense parameters over DP x CP, expert parameters over expert DP, each with its own counter): the rank that draws
the embedding holds its state, the others do not, so ranks of one job differ by it.
"""

from __future__ import annotations

from . import variants
from .inputs import ADAM_MOMENTS, FP32, Layout, Settings, Shape
from .pipeline import blocks_of, rank_layers

EMERGING = ("muon",)   # adaptive_muon adds a second moment: not modelled


def muon_state(st: Settings) -> bool:
    """Whether the plan counts Muon's state for this job."""
    return st.optimizer in EMERGING and "muon_state" not in st.without


def _norm(s: Shape, size: int) -> list[tuple[int, bool]]:
    return [(size, False)] * (2 if s.norm_bias else 1)


def _bias(s: Shape, size: int) -> list[tuple[int, bool]]:
    return [(size, False)] if s.linear_bias else []


def block_tensors(s: Shape, lay: Layout, block: str) -> tuple[list[tuple[int, bool]], list[tuple[int, bool]]]:
    """(dense, expert) parameter tensors of one block on one GPU, each (numel, Muon steps it), in model order:
    megatron-core's TE layer specs (gpt_layer_specs.py: the norm fused into linear_qkv / linear_fc1, a separate
    pre-MLP norm and router in MoE layers, TEGroupedMLP's weight{i} per local expert, MLA's separate input norm)."""
    h, t = s.hidden, lay.tp
    dense: list[tuple[int, bool]] = []
    expert: list[tuple[int, bool]] = []
    if block in variants.VARIANT_BLOCKS:
        dense += variants.block_tensors(s, lay, block)
    elif block in ("attn", "mla"):
        if s.mla or block == "mla":
            dense += _norm(s, h)
            qk = s.qk_head_dim + s.qk_pos_dim
            if s.q_lora_rank:
                dense += [(s.q_lora_rank * h, True), (s.heads * qk // t * s.q_lora_rank, True)]
                dense += _norm(s, s.q_lora_rank)
            else:
                dense += [(s.heads * qk // t * h, True)]
            dense += [((s.kv_lora_rank + s.qk_pos_dim) * h, True),
                      (s.heads * (s.qk_head_dim + s.v_head_dim) // t * s.kv_lora_rank, True)]
            dense += _norm(s, s.kv_lora_rank)
            dense += [(h * s.heads * s.v_head_dim // t, True)]
        else:
            qkv = (s.heads + 2 * s.groups + (s.heads if s.attn_gate else 0)) * s.head_dim // t
            dense += [(qkv * h, True)] + _bias(s, qkv) + _norm(s, h)
            if s.qk_norm:
                dense += _norm(s, s.head_dim) + _norm(s, s.head_dim)
            dense += [(h * s.heads * s.head_dim // t, True)] + _bias(s, h)
    elif block == "mlp":
        fc1 = (2 if s.gated else 1) * s.ffn // t
        dense += [(fc1 * h, True)] + _bias(s, fc1) + _norm(s, h) + [(h * s.ffn // t, True)] + _bias(s, h)
    elif block == "moe":
        dense += _norm(s, h) + [(s.experts * h, True)]
        if s.shared_ffn:
            fc1 = (2 if s.gated else 1) * s.shared_ffn // t
            dense += [(fc1 * h, True), (h * s.shared_ffn // t, True)] + ([(h, True)] if s.shared_gate else [])
        width = s.moe_latent or h   # latent MoE: duplicated hidden <-> latent projections, latent-width experts
        if width != h:
            dense += [(width * h, True)] + _bias(s, width) + [(h * width, True)] + _bias(s, h)
        local = max(1, s.experts // lay.ep)
        fc1 = (2 if s.gated else 1) * s.moe_ffn // lay.etp
        expert += [(fc1 * width, True)] * local + [(width * s.moe_ffn // lay.etp, True)] * local
    elif block == "mamba":
        inner = s.mamba_heads * s.mamba_head_dim
        bc = 2 * s.mamba_groups * s.mamba_state
        dense += _norm(s, h) + [((2 * inner + bc + s.mamba_heads) // t * h, True),
                                ((inner + bc) // t * s.mamba_conv, False), ((inner + bc) // t, False)]
        dense += [(s.mamba_heads // t, False)] * 3 + [(inner // t, False), (h * inner // t, True)]
    else:
        raise ValueError(f"unknown layer block {block!r}")
    return dense, expert


def stage_tensors(s: Shape, lay: Layout, rank: int) -> tuple[list[tuple[int, bool]], list[tuple[int, bool]]]:
    """(dense, expert) trainable parameter tensors of pipeline rank ``rank`` on one GPU, each (numel, Muon)."""
    first, last = rank == 0, rank == lay.pp - 1
    dense: list[tuple[int, bool]] = []
    expert: list[tuple[int, bool]] = []
    if first:
        dense.append((s.vocab * s.hidden // lay.tp, False))      # is_embedding_or_output_parameter
        if s.position_embeddings:
            # learned absolute positions are a plain 2-D weight: not flagged, so Muon steps them
            dense.append((s.position_embeddings * s.hidden, True))
    for kind, count in rank_layers(s, lay, rank).items():
        for _ in range(int(count)):
            for block in blocks_of(kind):
                d, e = block_tensors(s, lay, block)
                dense += d
                expert += e
    if last:
        dense += _norm(s, s.hidden)
        if not s.tied or lay.pp > 1:
            dense.append((s.vocab * s.hidden // lay.tp, False))
    return dense, expert


def _state_bytes(numel: int, muon: bool, st: Settings) -> float:
    """Optimizer bytes of one parameter: its master and Muon's momentum or the scalar optimizer's moments."""
    moments = FP32 if muon else ADAM_MOMENTS * st.state_bytes
    return numel * (st.master_bytes + moments)


def ping_pong_owner(tensors: list[tuple[int, bool]], ranks: int) -> list[int]:
    """The data-parallel rank LayerWiseDistributedOptimizer._shard_params_ping_pong gives each tensor (stable
    sort by numel, then ranks 0..n-1, n-1..0 in turn), in the order of ``tensors``."""
    loop = list(range(ranks)) + list(range(ranks))[::-1]
    order = sorted(range(len(tensors)), key=lambda i: tensors[i][0])
    owner = [0] * len(tensors)
    for k, i in enumerate(order):
        owner[i] = loop[k % len(loop)]
    return owner


def emerging_optimizer_bytes(s: Shape, lay: Layout, st: Settings, rank: int) -> float:
    """Optimizer bytes on one GPU of pipeline rank ``rank`` for Muon: every tensor of the stage, or with the
    layer-wise distributed optimizer the tensors its data-parallel rank draws (Settings.dp_rank; None: the most
    loaded dense and the most loaded expert share, an upper bound for one GPU)."""
    dense, expert = stage_tensors(s, lay, rank)
    if not st.layer_wise_optimizer:
        return sum(_state_bytes(n, m, st) for n, m in dense + expert)
    dense_ranks = max(1, lay.dp * lay.cp)
    expert_ranks = max(1, lay.world // (lay.pp * lay.ep * lay.etp))

    def share(tensors: list[tuple[int, bool]], ranks: int) -> float:
        per_rank = [0.0] * ranks
        for (n, m), r in zip(tensors, ping_pong_owner(tensors, ranks)):
            per_rank[r] += _state_bytes(n, m, st)
        if st.dp_rank is None:
            return max(per_rank)
        # -1: the last rank, the last of both groups (Megatron-LM's tensorboard writer); else clipped to the group
        return per_rank[ranks - 1 if st.dp_rank < 0 else min(st.dp_rank, ranks - 1)]

    return share(dense, dense_ranks) + share(expert, expert_ranks)
