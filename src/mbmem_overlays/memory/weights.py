"""Model state on one GPU: parameters per block and stage, LoRA adapters, gradients, and the optimizer state as
the distributed optimizer, Megatron FSDP and optimizer CPU offload shard or move it."""

from __future__ import annotations

from dataclasses import replace

from . import variants
from .activations import latent_width
from .inputs import ADAM_MOMENTS, FP8, FP32, Layout, Settings, Shape, quantized_params
from .optimizers import emerging_optimizer_bytes, muon_state
from .pipeline import blocks_of, layer_kinds, rank_layers, runs_bf16

def _attention_params(s: Shape) -> float:
    if s.mla:
        q = s.hidden * s.heads * (s.qk_head_dim + s.qk_pos_dim) if not s.q_lora_rank else \
            s.hidden * s.q_lora_rank + s.q_lora_rank * s.heads * (s.qk_head_dim + s.qk_pos_dim)
        kv = s.hidden * (s.kv_lora_rank + s.qk_pos_dim) + s.kv_lora_rank * s.heads * (s.qk_head_dim + s.v_head_dim)
        return q + kv + s.heads * s.v_head_dim * s.hidden
    # attention_output_gate widens linear_qkv by one gate per query head (attention.py :1678-1680)
    gate = s.heads * s.head_dim if s.attn_gate else 0
    return s.hidden * ((s.heads + 2 * s.groups) * s.head_dim + gate) + s.heads * s.head_dim * s.hidden


def _mlp_params(hidden: int, ffn: int, gated: bool) -> float:
    return (3 if gated else 2) * hidden * ffn


def _mamba_params(s: Shape) -> float:
    """One Mamba mixer's parameters over all TP ranks (megatron-core ssm/mamba_mixer.py MambaMixer.__init__):
    in_proj (hidden -> z, x, B, C, dt), the depthwise conv1d's weight and bias over x, B and C (conv_dim x d_conv,
    conv_dim), dt_bias, A_log and D (one per head), the group RMSNorm's weight (d_inner) and out_proj
    (d_inner -> hidden); no linear biases (``assert not bias``). The layer's own norm is in_proj's fused one."""
    inner = s.mamba_heads * s.mamba_head_dim
    bc = 2 * s.mamba_groups * s.mamba_state
    in_proj = s.hidden * (2 * inner + bc + s.mamba_heads)            # z, x, B, C, dt
    conv = (inner + bc) * (s.mamba_conv + 1)                          # weight and bias
    return in_proj + conv + 3 * s.mamba_heads + inner + inner * s.hidden

def latent_projection_params(s: Shape) -> float:
    """One latent-MoE layer's fc1_latent_proj (hidden -> latent) and fc2_latent_proj (latent -> hidden), with
    their biases under add_bias_linear: TELinear with parallel_mode "duplicated" (moe_layer.py:264-296), so every
    TP rank holds both whole, and they are dense parameters (is_expert=False: the dense DDP buffer and optimizer
    shards, not the expert ones). The router reads the hidden states before fc1_latent_proj (router.py: its weight
    stays experts x hidden), the shared experts too (mlp.py:218-220: only routed experts use the latent size)."""
    width = latent_width(s)
    if width == s.hidden:
        return 0.0
    return 2 * s.hidden * width + ((width + s.hidden) if s.linear_bias else 0)


def _block_params(s: Shape, lay: Layout, block: str) -> tuple[float, float]:
    """(dense, expert) parameters of one block on one GPU; every block has its own norm."""
    if block == "attn":
        return _attention_params(s) / lay.tp + s.hidden, 0.0
    if block == "mla":   # a hybrid stack's "+" layer (hybrid_layer_specs.py mla_layer)
        return _attention_params(replace(s, mla=True)) / lay.tp + s.hidden, 0.0
    if block in variants.VARIANT_BLOCKS:
        return variants.block_params(s, lay, block), 0.0
    if block == "mlp":
        return _mlp_params(s.hidden, s.ffn, s.gated) / lay.tp + s.hidden, 0.0
    if block == "moe":
        router_and_shared = s.hidden * s.experts + _mlp_params(s.hidden, s.shared_ffn, s.gated) / lay.tp
        # moe_shared_expert_gate's (1, hidden) weight, whole on every TP rank (moe/shared_experts.py :131-138)
        router_and_shared += s.hidden if s.shared_gate else 0
        return (router_and_shared + latent_projection_params(s) + s.hidden,
                s.experts * _mlp_params(latent_width(s), s.moe_ffn, s.gated) / (lay.ep * lay.etp))
    if block == "mamba":
        return _mamba_params(s) / lay.tp + s.hidden, 0.0
    raise ValueError(f"unknown layer block {block!r}")


def mtp_blocks(s: Shape) -> tuple[str, ...]:
    """The decoder blocks of one MTP depth: a hybrid pattern's MTP part ("*E": attention, then MoE, each its own
    layer; models/hybrid/hybrid_layer_allocation.py parse_hybrid_pattern), else one layer of the model's last kind
    (GPT: the decoder's layer spec)."""
    if s.mtp_blocks:
        return s.mtp_blocks
    return tuple(blocks_of(layer_kinds(s)[-1] if s.layers else "attn+mlp"))


def stage_params(s: Shape, lay: Layout, first: bool, last: bool, rank: int | None = None) -> tuple[float, float, float]:
    """(transformer-layer params, embedding/output params, expert params) on one GPU of pipeline rank ``rank``
    (default: the first stage when ``first``, else the last)."""
    rank = (0 if first else lay.pp - 1) if rank is None else rank
    dense = expert = 0.0
    for kind, count in rank_layers(s, lay, rank).items():
        for block in blocks_of(kind):
            d, e = _block_params(s, lay, block)
            dense += count * d
            expert += count * e
    embed = 0.0
    if first:
        embed += s.vocab * s.hidden / lay.tp
    if last and (not s.tied or lay.pp > 1):
        embed += s.vocab * s.hidden / lay.tp
    if last and s.mtp_layers:
        # MTP on the last stage (transformer/multi_token_prediction.py MultiTokenPredictionLayer): per layer an
        # enorm and hnorm, eh_proj (2h -> h, column-parallel), its decoder blocks (mtp_blocks) and a final norm;
        # with mtp_use_repeated_layer one such layer serves every depth (MultiTokenPredictionBlock._build_layers,
        # "build one layer, use it for all depths"). With PP the last stage builds its own embedding for the
        # shifted inputs (models/gpt/gpt_model.py:167, models/hybrid/hybrid_model.py:234: pre_process or mtp_process)
        built = 1 if s.mtp_shared else s.mtp_layers
        for block in mtp_blocks(s):
            d, e = _block_params(s, lay, block)
            dense += built * d
            expert += built * e
        dense += built * (3 * s.hidden + 2 * s.hidden * s.hidden / lay.tp)
        if lay.pp > 1:
            embed += s.vocab * s.hidden / lay.tp
    return dense, embed, expert


def stage_bf16_params(s: Shape, lay: Layout, st: Settings, rank: int) -> tuple[float, float]:
    """(dense, expert) parameters on one GPU of pipeline rank ``rank`` that belong to an FP8 job's first/last layers
    kept in bf16 (pipeline.BF16_LAYER); (0, 0) without FP8. Those layers are built outside fp8_model_init
    (transformer_block.py:341-353 and hybrid_block.py:127-131: get_fp8_context(config, layer_number - 1,
    is_init=True) is a nullcontext for them, fp8_utils.py:686, :792), so with fp8_param their weights are
    params-dtype tensors, and they run outside fp8_autocast, so TE keeps no FP8 copy of a bf16 weight either."""
    if not st.fp8:
        return 0.0, 0.0
    dense = expert = 0.0
    for kind, count in rank_layers(s, lay, rank).items():
        if runs_bf16(kind):
            for block in blocks_of(kind):
                d, e = _block_params(s, lay, block)
                dense += count * d
                expert += count * e
    if st.fp4 and s.mtp_layers and rank == lay.pp - 1:
        # MTP layers build and run under get_fp8_context alone (transformer/multi_token_prediction.py :1179-1186,
        # :1708, :1725: "currently MTP only use global fp8 context"), a nullcontext without FP8: an FP4 job's MTP
        # layers have params-dtype weights and no quantized copy (their eh_proj included, stage_params)
        built = 1 if s.mtp_shared else s.mtp_layers
        for block in mtp_blocks(s):
            d, e = _block_params(s, lay, block)
            dense += built * d
            expert += built * e
        dense += built * 2 * s.hidden * s.hidden / lay.tp
    return dense, expert


def lora_params(s: Shape, lay: Layout, st: Settings, rank: int = 0) -> float:
    if not st.lora_rank:
        return 0.0
    inner = s.mamba_heads * s.mamba_head_dim
    dims = {"attn": {"linear_qkv": (s.hidden, (s.heads + 2 * s.groups) * s.head_dim),
                     "linear_proj": (s.heads * s.head_dim, s.hidden)},
            "mlp": {"linear_fc1": (s.hidden, (2 if s.gated else 1) * s.ffn), "linear_fc2": (s.ffn, s.hidden)},
            # expert adapters: one shared set per layer (LoRA share_expert_adapters, Bridge's default)
            "moe": {"linear_fc1": (latent_width(s), (2 if s.gated else 1) * s.moe_ffn),
                    "linear_fc2": (s.moe_ffn, latent_width(s))},
            "mamba": {"in_proj": (s.hidden, 2 * inner + 2 * s.mamba_groups * s.mamba_state + s.mamba_heads),
                      "out_proj": (inner, s.hidden)}}
    total = 0.0
    for kind, count in rank_layers(s, lay, rank).items():
        for block in blocks_of(kind):
            total += count * sum(st.lora_rank * (i + o) / lay.tp
                                 for t, (i, o) in dims.get(block, {}).items() if t in st.lora_targets)
    return total


def data_parallel_shards(lay: Layout, st: Settings) -> tuple[int, int]:
    """(dense, expert) ranks one distributed-optimizer instance spans: DP x CP and expert DP, each divided by
    ddp.num_distributed_optimizer_instances (parallel_state.py: intra_partial_data_parallel_size =
    DP*CP // instances; intra_partial_expert_data_parallel_size = expert DP // instances; the DDP buffers shard
    over intra_dp_cp_group / intra_expt_dp_group, distributed_data_parallel.py)."""
    instances = max(1, st.optimizer_instances)
    expert_dp = max(1, lay.world // (lay.pp * lay.ep * lay.etp))
    return max(1, lay.dp * lay.cp // instances), max(1, expert_dp // instances)


FSDP_SHARDS = {  # data_parallel_sharding_strategy -> (params, grads, optimizer state) sharded across DP
    "no_shard": (False, False, False), "optim": (False, False, True),
    "optim_grads": (False, True, True), "optim_grads_params": (True, True, True),
}  # megatron_fsdp/param_and_grad_buffer.py _init_each_parameter_group_buffers


def optimizer_shards(lay: Layout, st: Settings) -> tuple[int, int]:
    """How many ways the distributed optimizer splits dense and expert state (1, 1 without it)."""
    if not st.dist_optimizer:
        return 1, 1
    dense, expert = data_parallel_shards(lay, st)
    if st.fsdp is not None:
        if not FSDP_SHARDS.get(st.fsdp, FSDP_SHARDS["optim_grads_params"])[2]:
            return 1, 1
        if st.fsdp_outer_optim and st.optimizer_instances > 1:
            # HSDP with outer_dp_sharding_strategy="optim" shards optimizer state across the instances too
            # (mcore_fsdp_adapter.py hsdp_outer_dp_shard)
            return dense * st.optimizer_instances, expert * st.optimizer_instances
    return dense, expert


def fsdp_shards(lay: Layout, st: Settings) -> tuple[tuple[int, int], tuple[int, int]]:
    """((dense, expert) parameter shards, (dense, expert) gradient shards) under Megatron FSDP; 1s without it."""
    if st.fsdp is None:
        return (1, 1), (1, 1)
    params, grads, _ = FSDP_SHARDS.get(st.fsdp, FSDP_SHARDS["optim_grads_params"])
    shards = data_parallel_shards(lay, st)
    return (shards if params else (1, 1)), (shards if grads else (1, 1))


def optimizer_gpu_bytes(st: Settings) -> float:
    """Optimizer bytes per trainable parameter of this rank's optimizer shard that stay on the GPU.

    Optimizer CPU offload is megatron-core's HybridDeviceOptimizer (optimizer/cpu_offloading/hybrid_optimizer.py
    _get_sub_optimizer_param_groups): it clones the first ``offload_fraction`` of its parameters' elements to
    pinned CPU memory, steps them there, and copies the result back into the GPU parameter
    (param_copy_back_gpu_hook). Which GPU tensor that parameter is decides what leaves the GPU.
    """
    return sum(optimizer_gpu_parts(st))


def optimizer_gpu_parts(st: Settings) -> tuple[float, float]:
    """(master weights, Adam moments) of optimizer_gpu_bytes. The masters exist from the optimizer's
    construction; the moments only from the first step (TE v2.17.1 optimizers/fused_adam.py:615-616, torch's
    Adam alike: state is created when a parameter is first stepped)."""
    f = st.optimizer_offload
    if not f:
        return float(st.master_bytes), float(ADAM_MOMENTS * st.state_bytes)
    if st.precision_aware:
        # Offload makes use_precision_aware_optimizer_no_fp8_or_ds_fp8 true (optimizer_config.py __post_init__):
        # the distributed optimizer keeps no master (shard_main_param = None, distrib_optimizer.py
        # _build_model_and_main_param_groups) and hands bf16 shards to the hybrid optimizer, whose
        # param_update_in_fp32 makes fp32 masters: on the CPU for the offloaded part, on the GPU for the rest.
        # Its GPU Adam is built without exp_avg_dtype (optimizer/__init__.py optimizer_defaults): fp32 moments.
        return (1.0 - f) * FP32, (1.0 - f) * ADAM_MOMENTS * FP32
    # The parameters the hybrid optimizer receives are the fp32 master shards the distributed optimizer made on
    # the GPU (shard_fp32_from_float16_groups): the offloaded ones are cloned to the CPU, the GPU masters stay
    # (Bridge's sync_hybrid_device_optimizer_fp32_master_copies calls them level 1). Only moments leave.
    master = float(st.master_bytes)
    if not st.dist_optimizer:
        # Float16OptimizerWithFloat16Params makes its fp32 masters after the hybrid optimizer was built from the
        # bf16 parameters, which already made fp32 copies of its GPU part (param_update_in_fp32; optimizer.py)
        master += (1.0 - f) * FP32
    return master, (1.0 - f) * ADAM_MOMENTS * st.state_bytes


def optimizer_before_first_step(optimizer: float, st: Settings) -> float:
    """The optimizer state ``optimizer`` (bytes) before the first step: the masters only, the moments come with it
    (optimizer_gpu_parts)."""
    master, moments = optimizer_gpu_parts(st)
    return optimizer * master / (master + moments) if master + moments else optimizer


def model_state(s: Shape, lay: Layout, st: Settings, first: bool, last: bool,
                rank: int | None = None) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer) bytes on one GPU of the stage (``rank`` as in stage_params)."""
    rank = (0 if first else lay.pp - 1) if rank is None else rank
    layer_params, embed, expert = stage_params(s, lay, first, last, rank)
    dense = layer_params + embed
    adapters = lora_params(s, lay, st, rank)
    # LoRA's frozen base, or freeze_language_model: parameters with requires_grad False get no main-grad buffer
    # (distributed_data_parallel.py:114-116 skips them) and no optimizer state (optimizer/__init__.py:330-331)
    frozen = st.lora_rank > 0 or st.frozen_lm
    trainable_dense = adapters if st.lora_rank > 0 else (0.0 if st.frozen_lm else dense)
    trainable_expert = 0.0 if frozen else expert
    (p_dense, p_expert), (g_dense, g_expert) = fsdp_shards(lay, st)
    # FP8 parameters (fp8_param_gather) cover transformer-layer GEMM weights; embeddings stay bf16, and so do the
    # layers an FP8 job keeps in bf16 (stage_bf16_params: params dtype, no FP8 copy).
    weight_bytes = st.param_bytes + st.fp8_weight_copy_bytes
    # TE's operation fuser runs the experts' GEMMs in its own ops, which cache no FP8 copy of a bf16 weight across
    # microbatches (they quantize it per forward: activations.op_fuser_terms); GroupedLinear's cache is never made
    expert_bytes = st.param_bytes if st.moe_op_fuser and not quantized_params(st) else weight_bytes
    bf16_dense, bf16_expert = stage_bf16_params(s, lay, st, rank)
    params = ((layer_params - bf16_dense) * weight_bytes + (bf16_dense + embed + adapters) * st.dtype_bytes) / p_dense \
        + ((expert - bf16_expert) * expert_bytes + bf16_expert * st.dtype_bytes) / p_expert
    if st.output_proj_copy_bytes and rank == lay.pp - 1 and (not s.tied or lay.pp > 1):
        # fp8_output_proj: the bf16 output layer's MXFP8 weight workspace (from_config.output_proj_copy_bytes)
        params += s.vocab * s.hidden / lay.tp * st.output_proj_copy_bytes / p_dense
    grads = (trainable_dense / g_dense + trainable_expert / g_expert) * st.grad_bytes
    if st.embed_grad_bytes and not frozen and "fsdp_grad_dtypes" not in st.without:
        # Megatron FSDP keeps an FP8 weight's gradient in bf16 and every other parameter's in its own dtype
        # (param_and_grad_buffer.py _resolve_group_grad_dtype :2306-2315): the embeddings' in the params dtype
        grads += embed * (st.embed_grad_bytes - st.grad_bytes) / g_dense
    dense_shards, expert_shards = optimizer_shards(lay, st)
    opt = (trainable_dense / dense_shards + trainable_expert / expert_shards) * optimizer_gpu_bytes(st)
    if muon_state(st) and not frozen and not st.optimizer_offload:
        opt = emerging_optimizer_bytes(s, lay, st, rank)   # Muon's momentum, whole-parameter shards
    vision_all, vision_trainable = vision_params(s, lay, st, rank)
    if vision_all:
        # the vision encoder and projector on the first stage: params-dtype weights (Float16Module casts them), the
        # trainable ones with gradients and optimizer state like any dense parameter (vision.stage_vision_params)
        params += vision_all * st.dtype_bytes / p_dense
        grads += vision_trainable * st.grad_bytes / g_dense
        opt += vision_trainable / dense_shards * optimizer_gpu_bytes(st)
    return params, grads, opt


def vision_params(s: Shape, lay: Layout, st: Settings, rank: int) -> tuple[float, float]:
    """(every vision parameter, the trainable ones) on one GPU of pipeline rank ``rank``, LoRA adapters on the
    encoder's GEMMs included (vision.stage_vision_params, vision.lora_params)."""
    from .vision import lora_params as vision_lora, stage_vision_params
    total, trainable = stage_vision_params(s, lay, rank)
    if total and s.vision.lora and st.lora_rank:
        adapters = vision_lora(s.vision, lay, st)
        total, trainable = total + adapters, trainable + adapters
    return total, trainable

def largest_layer_params(s: Shape, lay: Layout, rank: int) -> float:
    """Parameters of the largest layer pipeline rank ``rank`` holds, on one GPU (dense + its experts)."""
    return max((sum(sum(_block_params(s, lay, block)) for block in blocks_of(kind))
                for kind in rank_layers(s, lay, rank)), default=0.0)
