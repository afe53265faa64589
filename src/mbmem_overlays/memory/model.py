"""The memory plan: per-GPU bytes for the most-loaded GPU, before and after each overlay.

Shaped like Bridge's ``training/utils/theoretical_memory_utils.py``: pure functions over
frozen dataclasses, assumptions returned as data, formatting kept separate. Bridge's
estimator ignores recompute, offload, SP, LoRA and precision (bridge-config-surface.md §5);
this model accounts for each, term by term, from what the training step keeps alive.

Units: bytes. "Per token" terms are multiplied by the tokens a GPU holds per microbatch
(seq x MBS / CP) and by the microbatches in flight on the pipeline stage.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

BF16 = 2            # bytes per bf16/fp16 element
FP32 = 4
FP8 = 1
ADAM_MOMENTS = 2    # exp_avg and exp_avg_sq

ASSUMPTIONS = (
    "allocated memory only (torch's max_memory_allocated, what Bridge reports as mem-max-allocated): allocator "
    "fragmentation (reserved-but-unallocated) is not modelled; expandable_segments therefore shows 0 B of change "
    "although it is the fix for that gap",
    "CUDA context, NCCL communicators, userbuffers and cuBLAS/TE workspaces are outside torch's allocated memory "
    "and not counted",
    "the peak is the largest of three phases on the first and last pipeline ranks: the 1F1B steady state (most "
    "microbatches in flight, plus the last stage's loss and deferred output-layer gradients), CUDA graph capture "
    "and the optimizer step (fp32 copies of bf16 gradients)",
    "per-layer CUDA graphs (cuda_graph_modules, or the deprecated cuda_graph_scope; none: the whole layer) follow "
    "megatron-core's TECudaGraphHelper (transformer/cuda_graphs.py): one graph per graphable layer "
    "(_layer_is_graphable: attn, mlp, moe/moe_router, mamba by layer type) and per microbatch in the pipeline "
    "order (one microbatch without PP), captured after the warm-up steps with model, gradient and optimizer state "
    "alive but no eager activations; the captured scopes' saved activations for the in-flight microbatches are "
    "the capture peak and stay as the graphs' private pool (reserved, not allocated, in replay). Each graphed "
    "layer and in-flight microbatch also holds, allocated throughout, its static input (the hidden state, plus "
    "for attention graphs the bool attention mask mbs x s/cp x s, _get_layer_static_inputs) and its static "
    "output. Transformer Engine is not installed here, so TE's make_graphed_callables was not read: its "
    "input/output buffer reuse across consumed microbatches (TE >= 2.7, _reuse_graph_input_output_buffers) is "
    "taken to keep one static input and output per in-flight graph, and static gradient buffers are not "
    "counted. The local implementation is modelled the same way",
    "attention uses a fused/flash kernel (TE default): only softmax statistics are kept, so core_attn recompute "
    "saves almost nothing; an unfused backend would keep the s x s scores",
    "a GEMM input is kept only for a weight gradient (TE backward_needs_input): frozen LoRA base GEMMs keep theirs "
    "only when an adapter reads the same tensor; under SP a column-parallel LoRA-A keeps the full gathered input "
    "unless input re-gather lets it reuse the sequence-local shard",
    "FP8 weights keep a transposed FP8 copy (Hopper GEMMs take only the TN layout); on Blackwell this byte is not "
    "needed and the plan overstates parameters by 1 byte per layer weight",
    "MoE tokens are balanced across experts; capacity factor and token imbalance are not modelled",
    "'moe' selective recompute checkpoints the MoE layer with the pre-MLP norm output as its saved input "
    "(moe/moe_layer.py tensor_parallel.checkpoint(custom_forward, False, hidden_states, ...)): that output stays "
    "unless 'layernorm' is selected too, which megatron-core turns off for MoE layers under a TE moe_router "
    "graph unless moe_preprocess is graphed with the alltoall dispatcher (transformer_layer.py "
    "can_recompute_pre_mlp_layernorm_for_cudagraph)",
    "hybrid (Mamba) blocks use the fused conv1d+scan kernel, which keeps its input projection and scan output",
    "a vocabulary the recipe leaves to the tokenizer (model.vocab_size None) is the tokenizer's vocab_size, or for "
    "a Hugging Face tokenizer the model's shipped config.json vocab_size (Bridge sets it from the tokenizer at setup)",
    "activation CPU offload removes the offloaded layers' activations from the GPU (double buffering adds one layer back)",
    "optimizer CPU offload (HybridDeviceOptimizer, optimizer/cpu_offloading/hybrid_optimizer.py) clones the "
    "offloaded fraction of the optimizer's parameters to pinned CPU memory and copies each CPU step's result back "
    "to the GPU parameter: with the distributed optimizer and a non-precision-aware optimizer that parameter is "
    "DistributedOptimizer's fp32 master shard, which therefore stays on the GPU, and only the offloaded Adam "
    "moments leave; the fp32 gradient copy at the step is still made for every shard (distrib_optimizer.py "
    "_copy_model_grads_to_main_grads). With the precision-aware optimizer megatron-core keeps no master "
    "(shard_main_param=None) and the hybrid optimizer makes fp32 masters itself, the offloaded part on the CPU "
    "and the rest on the GPU with fp32 moments (its GPU Adam gets no exp_avg_dtype, optimizer/__init__.py). "
    "Without the distributed optimizer, Float16Optimizer's fp32 masters stay beside the hybrid optimizer's own "
    "fp32 copies of the GPU part",
    "the distributed optimizer shards over DP x CP / ddp.num_distributed_optimizer_instances ranks (expert state "
    "over expert DP / instances: parallel_state.py intra-partial distributed-optimizer groups)",
    "Megatron FSDP shards, per ddp.data_parallel_sharding_strategy, the optimizer state (optim), also the "
    "gradients (optim_grads) and also the parameters (optim_grads_params) across the same groups "
    "(megatron_fsdp/param_and_grad_buffer.py _init_each_parameter_group_buffers; with several optimizer "
    "instances optimizer state spans all of DP only when outer_dp_sharding_strategy is optim); every layer is one "
    "FSDP unit, and the transient unsharded copies are two units of parameters (the current one and the prefetched "
    "next) and one unit of gradients; the embedding and output layer are sharded like the rest and their own "
    "gathered copy is not counted; no fp32 gradient copy is made at the step (FSDP owns its main-grad buffers)",
)


# ----------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    gated: bool = True
    tied: bool = False
    experts: int = 0
    moe_ffn: int = 0
    topk: int = 0
    shared_ffn: int = 0
    moe_layers: int = 0           # how many of the layers are MoE
    mla: bool = False
    qk_head_dim: int = 0
    qk_pos_dim: int = 0
    v_head_dim: int = 0
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_norm: bool = False         # LayerNorm on q and k (Qwen3)
    # One entry per layer: "attn+mlp" / "attn+moe" for GPT layers; hybrid models (Nemotron-H) stack single
    # blocks "mamba", "attn", "mlp", "moe" (hybrid_layer_pattern M * - E). Empty: GPT, MoE layers spread evenly.
    layer_kinds: tuple[str, ...] = ()
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 0
    mamba_state: int = 0
    mamba_conv: int = 4


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sp: bool = False
    seq: int = 4096
    mbs: int = 1
    gbs: int = 1

    @property
    def dp(self) -> int:
        return max(1, self.world // (self.tp * self.pp * self.cp))

    @property
    def microbatches(self) -> int:
        return max(1, self.gbs // (self.mbs * self.dp))


@dataclass(frozen=True)
class Settings:
    recompute: str | None = None              # None | "selective" | "full"
    modules: tuple[str, ...] = ()
    recompute_method: str | None = None
    recompute_layers: int = 1
    cpu_offload_layers: int = 0
    cpu_offload_double_buffer: bool = False
    dist_optimizer: bool = False
    optimizer_offload: float = 0.0
    grad_bytes: int = FP32
    param_bytes: int = BF16
    state_bytes: int = FP32                   # exp_avg / exp_avg_sq (bf16 with the precision-aware optimizer)
    master_bytes: int = FP32
    fp8: bool = False
    lora_rank: int = 0                        # 0: full training
    lora_targets: tuple[str, ...] = ()
    lora_regather: tuple[str, ...] = ()       # targets that really re-gather (see rules.regather_fallbacks)
    # Extra bytes per transformer-layer GEMM weight for a second FP8 layout kept between steps (see weight_copy_bytes)
    fp8_weight_copy_bytes: int = 0
    swiglu_fused: bool = True                 # bias_activation_fusion: the fused SwiGLU keeps only its input
    deferred_wgrad_microbatches: int = 0      # defer_embedding_wgrad_compute: output-layer dY kept per microbatch
    graph_scopes: tuple[str, ...] = ()        # per-layer CUDA graph scopes (see GRAPH_SCOPE_TERMS)
    logits_bytes: int = BF16 + FP32           # per logit element at the loss (see loss_bytes)
    step_upcasts_grads: bool = True           # the optimizer step copies bf16 grads to fp32 (not precision-aware)
    precision_aware: bool = False             # optimizer.use_precision_aware_optimizer (see optimizer_gpu_bytes)
    optimizer_instances: int = 1              # ddp.num_distributed_optimizer_instances (see data_parallel_shards)
    fsdp: str | None = None                   # Megatron FSDP on: ddp.data_parallel_sharding_strategy
    fsdp_outer_optim: bool = False            # ddp.outer_dp_sharding_strategy == "optim" (HSDP across instances)
    shared_expert_overlap: bool = False       # moe_shared_expert_overlap: the shared expert is outside router graphs


@dataclass(frozen=True)
class Breakdown:
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    other: float
    detail: tuple[tuple[str, float], ...] = ()   # named buffers inside the totals, bytes
    rank: int = 0                                 # the pipeline rank this breakdown is for
    phase: str = "steady 1F1B"                    # when that rank peaks (see estimate)
    # Memory the allocator must hold in the steady state when CUDA graphs keep a private pool beside the
    # allocated tensors (0: nothing beyond ``total``); what fits the GPU is judged on the larger of the two.
    resident: float = 0.0

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.other

    @property
    def footprint(self) -> float:
        return max(self.total, self.resident)

    def as_dict(self) -> dict[str, float]:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "other": self.other, "total": self.total}


# ----------------------------------------------------------------------------- parameters
def _attention_params(s: Shape) -> float:
    if s.mla:
        q = s.hidden * s.heads * (s.qk_head_dim + s.qk_pos_dim) if not s.q_lora_rank else \
            s.hidden * s.q_lora_rank + s.q_lora_rank * s.heads * (s.qk_head_dim + s.qk_pos_dim)
        kv = s.hidden * (s.kv_lora_rank + s.qk_pos_dim) + s.kv_lora_rank * s.heads * (s.qk_head_dim + s.v_head_dim)
        return q + kv + s.heads * s.v_head_dim * s.hidden
    return s.hidden * (s.heads + 2 * s.groups) * s.head_dim + s.heads * s.head_dim * s.hidden


def _mlp_params(hidden: int, ffn: int, gated: bool) -> float:
    return (3 if gated else 2) * hidden * ffn


def _mamba_params(s: Shape) -> float:
    inner = s.mamba_heads * s.mamba_head_dim
    bc = 2 * s.mamba_groups * s.mamba_state
    in_proj = s.hidden * (2 * inner + bc + s.mamba_heads)            # z, x, B, C, dt
    return in_proj + (inner + bc) * s.mamba_conv + 3 * s.mamba_heads + inner + inner * s.hidden


HYBRID_SYMBOLS = {"M": "mamba", "*": "attn", "-": "mlp", "E": "moe"}


def layer_kinds(s: Shape) -> tuple[str, ...]:
    if s.layer_kinds:
        return s.layer_kinds
    moe = [round((i + 1) * s.moe_layers / s.layers) - round(i * s.moe_layers / s.layers) for i in range(s.layers)]
    return tuple("attn+moe" if m else "attn+mlp" for m in moe)


def rank_layers(s: Shape, lay: Layout, rank: int) -> dict[str, int]:
    """How many layers of each kind pipeline rank ``rank`` holds (its ``vpp`` interleaved chunks)."""
    return dict(_rank_layers(layer_kinds(s), lay.pp, lay.vpp, rank))


@functools.lru_cache(maxsize=4096)
def _rank_layers(kinds: tuple[str, ...], pp: int, vpp: int, rank: int) -> tuple[tuple[str, int], ...]:
    chunks = pp * vpp
    counts: dict[str, int] = {}
    for chunk in range(rank, chunks, pp):
        for kind in kinds[round(chunk * len(kinds) / chunks):round((chunk + 1) * len(kinds) / chunks)]:
            counts[kind] = counts.get(kind, 0) + 1
    return tuple(counts.items())


def _block_params(s: Shape, lay: Layout, block: str) -> tuple[float, float]:
    """(dense, expert) parameters of one block on one GPU; every block has its own norm."""
    if block == "attn":
        return _attention_params(s) / lay.tp + s.hidden, 0.0
    if block == "mlp":
        return _mlp_params(s.hidden, s.ffn, s.gated) / lay.tp + s.hidden, 0.0
    if block == "moe":
        router_and_shared = s.hidden * s.experts + _mlp_params(s.hidden, s.shared_ffn, s.gated) / lay.tp
        return router_and_shared + s.hidden, s.experts * _mlp_params(s.hidden, s.moe_ffn, s.gated) / (lay.ep * lay.etp)
    if block == "mamba":
        return _mamba_params(s) / lay.tp + s.hidden, 0.0
    raise ValueError(f"unknown layer block {block!r}")


def stage_params(s: Shape, lay: Layout, first: bool, last: bool) -> tuple[float, float, float]:
    """(transformer-layer params, embedding/output params, expert params) on one GPU of the first or last stage."""
    dense = expert = 0.0
    for kind, count in rank_layers(s, lay, 0 if first else lay.pp - 1).items():
        for block in kind.split("+"):
            d, e = _block_params(s, lay, block)
            dense += count * d
            expert += count * e
    embed = 0.0
    if first:
        embed += s.vocab * s.hidden / lay.tp
    if last and (not s.tied or lay.pp > 1):
        embed += s.vocab * s.hidden / lay.tp
    return dense, embed, expert


def lora_params(s: Shape, lay: Layout, st: Settings, rank: int = 0) -> float:
    if not st.lora_rank:
        return 0.0
    inner = s.mamba_heads * s.mamba_head_dim
    dims = {"attn": {"linear_qkv": (s.hidden, (s.heads + 2 * s.groups) * s.head_dim),
                     "linear_proj": (s.heads * s.head_dim, s.hidden)},
            "mlp": {"linear_fc1": (s.hidden, (2 if s.gated else 1) * s.ffn), "linear_fc2": (s.ffn, s.hidden)},
            # expert adapters: one shared set per layer (LoRA share_expert_adapters, Bridge's default)
            "moe": {"linear_fc1": (s.hidden, (2 if s.gated else 1) * s.moe_ffn), "linear_fc2": (s.moe_ffn, s.hidden)},
            "mamba": {"in_proj": (s.hidden, 2 * inner + 2 * s.mamba_groups * s.mamba_state + s.mamba_heads),
                      "out_proj": (inner, s.hidden)}}
    total = 0.0
    for kind, count in rank_layers(s, lay, rank).items():
        for block in kind.split("+"):
            total += count * sum(st.lora_rank * (i + o) / lay.tp
                                 for t, (i, o) in dims[block].items() if t in st.lora_targets)
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
    f = st.optimizer_offload
    if not f:
        return st.master_bytes + ADAM_MOMENTS * st.state_bytes
    if st.precision_aware:
        # Offload makes use_precision_aware_optimizer_no_fp8_or_ds_fp8 true (optimizer_config.py __post_init__):
        # the distributed optimizer keeps no master (shard_main_param = None, distrib_optimizer.py
        # _build_model_and_main_param_groups) and hands bf16 shards to the hybrid optimizer, whose
        # param_update_in_fp32 makes fp32 masters: on the CPU for the offloaded part, on the GPU for the rest.
        # Its GPU Adam is built without exp_avg_dtype (optimizer/__init__.py optimizer_defaults): fp32 moments.
        return (1.0 - f) * (FP32 + ADAM_MOMENTS * FP32)
    # The parameters the hybrid optimizer receives are the fp32 master shards the distributed optimizer made on
    # the GPU (shard_fp32_from_float16_groups): the offloaded ones are cloned to the CPU, the GPU masters stay
    # (Bridge's sync_hybrid_device_optimizer_fp32_master_copies calls them level 1). Only moments leave.
    master = float(st.master_bytes)
    if not st.dist_optimizer:
        # Float16OptimizerWithFloat16Params makes its fp32 masters after the hybrid optimizer was built from the
        # bf16 parameters, which already made fp32 copies of its GPU part (param_update_in_fp32; optimizer.py)
        master += (1.0 - f) * FP32
    return master + (1.0 - f) * ADAM_MOMENTS * st.state_bytes


def model_state(s: Shape, lay: Layout, st: Settings, first: bool, last: bool) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer) bytes on one GPU of the stage."""
    layer_params, embed, expert = stage_params(s, lay, first, last)
    dense = layer_params + embed
    adapters = lora_params(s, lay, st, 0 if first else lay.pp - 1)
    frozen = st.lora_rank > 0
    trainable_dense = adapters if frozen else dense
    trainable_expert = 0.0 if frozen else expert
    (p_dense, p_expert), (g_dense, g_expert) = fsdp_shards(lay, st)
    # FP8 parameters (fp8_param_gather) cover transformer-layer GEMM weights; embeddings stay bf16.
    weight_bytes = st.param_bytes + st.fp8_weight_copy_bytes
    params = (layer_params * weight_bytes + embed * BF16 + adapters * BF16) / p_dense + expert * weight_bytes / p_expert
    grads = (trainable_dense / g_dense + trainable_expert / g_expert) * st.grad_bytes
    dense_shards, expert_shards = optimizer_shards(lay, st)
    opt = (trainable_dense / dense_shards + trainable_expert / expert_shards) * optimizer_gpu_bytes(st)
    return params, grads, opt


# ----------------------------------------------------------------------------- activations
def layer_activation_terms(s: Shape, lay: Layout, st: Settings, kind: str = "attn+mlp") -> dict[str, float]:
    """Bytes kept per token of one microbatch for one layer of ``kind`` on one GPU (before recompute)."""
    t = lay.tp
    sp_div = t if lay.sp else 1   # LayerNorm-region tensors are split across TP only with SP
    gemm_in = FP8 if st.fp8 else BF16
    frozen = st.lora_rank > 0
    # A LoRA adapter asks TE for the norm output, which turns off the quantized norm: it is then kept in bf16.
    ln_out = BF16 if frozen else gemm_in

    def keeps_input(target: str) -> bool:
        # Transformer Engine saves a GEMM input only for the weight gradient (linear.py / layernorm_linear.py:
        # backward_needs_input = weight.requires_grad); a frozen base GEMM keeps its input only when a LoRA
        # adapter on it reads the same tensor.
        return not frozen or target in st.lora_targets

    def lora_gathered(target: str) -> None:
        # Under SP, LoRA-A of a column-parallel target reading a norm output keeps the full gathered input until
        # backward; input re-gather keeps only the sequence-local shard, which the base GEMM keeps anyway
        # (memory-tuning skill, PEFT + SP input re-gather). Row-parallel adapters read a tensor already kept.
        if frozen and lay.sp and target in st.lora_targets and target not in st.lora_regather:
            terms[f"lora_a_gathered_input_{target}"] = BF16 * s.hidden

    terms: dict[str, float] = {}
    blocks = kind.split("+")
    # Every block's norm input (the residual stream) is kept for the norm's backward; TE fuses the norm into
    # the block's first GEMM.
    for block in blocks:
        terms[f"{block}_layernorm_input"] = BF16 * s.hidden / sp_div
    if "attn" in blocks:
        # the norm output is the QKV GEMM input, kept sequence-local (TE re-gathers it in backward)
        if keeps_input("linear_qkv"):
            terms["attention_layernorm_output"] = ln_out * s.hidden / sp_div
        if s.mla:
            terms["attention_qkv"] = BF16 * s.heads * (2 * (s.qk_head_dim + s.qk_pos_dim) + s.v_head_dim) / t
            terms["mla_up_proj_inputs"] = BF16 * (s.kv_lora_rank + (s.q_lora_rank or 0)) / sp_div
        else:
            # The attention kernel keeps q, k, v: RoPE returns new q and k, and TE copies the strided v view out
            # of the QKV output (get_qkv_layout finds no layout for the mix and makes all three contiguous), so
            # the QKV output itself is freed: together the same size as that output.
            terms["attention_qkv"] = BF16 * (s.heads + 2 * s.groups) * s.head_dim / t
            if s.qk_norm:
                # q/k LayerNorm (Qwen3): TE's norm saves a contiguous copy of its input (ops/basic/rmsnorm.py)
                terms["attention_qk_norm_inputs"] = BF16 * (s.heads + s.groups) * s.head_dim / t
        terms["attention_softmax_stats"] = FP32 * s.heads / t
        # The fused attention kernel keeps its bf16 output for its own backward; under FP8 the output
        # projection keeps a quantized copy of it as well.
        terms["attention_output"] = BF16 * s.heads * (s.v_head_dim or s.head_dim) / t
        if st.fp8 and not frozen:
            terms["attention_output_fp8"] = FP8 * s.heads * (s.v_head_dim or s.head_dim) / t
        lora_gathered("linear_qkv")
    if "mlp" in blocks:
        if keeps_input("linear_fc1"):
            terms["mlp_layernorm_output"] = ln_out * s.hidden / sp_div
        terms["mlp_fc1_output"] = BF16 * (2 if s.gated else 1) * s.ffn / t
        if s.gated and not st.swiglu_fused:
            # unfused SwiGLU is silu(a) * b: autograd keeps silu(a) for the product's backward as well
            terms["mlp_silu_output"] = BF16 * s.ffn / t
        if keeps_input("linear_fc2"):
            terms["mlp_act_output"] = (BF16 if frozen else gemm_in) * s.ffn / t
        lora_gathered("linear_fc1")
    if "moe" in blocks:
        # Each rank routes its own sequence-local tokens (megatron-core needs SP with TP for MoE) topk times.
        # Expert-TP all-gathers the dispatched tokens across its group and splits the FFN: the expert input
        # grows ETP-fold, the FFN activations per rank stay the same (token_dispatcher.py, alltoall).
        routed = s.topk / sp_div
        # MoE layers have a separate (unfused) pre-MLP norm; the router's gating function saves its output
        # whether or not the router trains (moe_utils.py RouterGatingLinearFunction)
        terms["moe_layernorm_output"] = BF16 * s.hidden / sp_div
        terms["moe_router"] = FP32 * s.experts / sp_div
        if keeps_input("linear_fc1"):  # grouped GEMMs keep inputs only for a weight gradient (grouped_linear.py)
            terms["moe_permuted_input"] = routed * lay.etp * BF16 * s.hidden
        terms["moe_fc1_output"] = routed * BF16 * (2 if s.gated else 1) * s.moe_ffn
        if s.gated and not st.swiglu_fused:
            terms["moe_silu_output"] = routed * BF16 * s.moe_ffn
        if keeps_input("linear_fc2"):
            terms["moe_act_output"] = routed * (BF16 if frozen else gemm_in) * s.moe_ffn
        # unpermute weights each expert output by its routing probability and keeps it for that gradient
        terms["moe_unpermute_input"] = routed * BF16 * s.hidden
        if s.shared_ffn:
            terms["shared_expert"] = (BF16 * (2 if s.gated else 1) + gemm_in) * s.shared_ffn / t
            lora_gathered("linear_fc1")  # the shared expert's adapter is an ordinary column-parallel one
    if "mamba" in blocks:
        inner = s.mamba_heads * s.mamba_head_dim
        bc = 2 * s.mamba_groups * s.mamba_state
        if keeps_input("in_proj"):
            terms["mamba_layernorm_output"] = ln_out * s.hidden / sp_div
        # The fused conv1d + chunked-scan kernel (mamba_split_conv1d_scan_combined) keeps its input z, x, B, C,
        # dt and the scan output, and recomputes the rest in backward; out_proj keeps its input for its weight.
        terms["mamba_in_proj_output"] = BF16 * (2 * inner + bc + s.mamba_heads) / t
        terms["mamba_scan_output"] = BF16 * inner / t
        if keeps_input("out_proj"):
            terms["mamba_out_proj_input"] = BF16 * inner / t
        lora_gathered("in_proj")
    if frozen:
        terms["lora_intermediates"] = 2 * BF16 * st.lora_rank * len(st.lora_targets)
    return terms


RECOMPUTE_DROPS = {  # selective label -> terms it discards (activation-recompute skill, Decision Table)
    "core_attn": ("attention_softmax_stats",),
    # the MLP checkpoint (TE: the pre-MLP norm is fused into FC1) keeps only its input
    "mlp": ("mlp_layernorm_output", "mlp_fc1_output", "mlp_silu_output", "mlp_act_output",
            "lora_a_gathered_input_linear_fc1"),
    # "layernorm" checkpoints only norms that are separate modules: with TE's fused norm+GEMM the input norm is
    # an IdentityOp and is skipped (transformer_layer.py: recompute_input_layernorm); MoE's pre-MLP norm is separate
    "layernorm": ("moe_layernorm_output",),
    "moe_act": ("moe_silu_output", "moe_act_output"),
    # The MoE checkpoint's saved input is the pre-MLP norm output (moe/moe_layer.py: tensor_parallel.checkpoint(
    # custom_forward, False, hidden_states, ...)): it stays unless "layernorm" drops it as well.
    "moe": ("moe_permuted_input", "moe_fc1_output", "moe_silu_output", "moe_act_output",
            "moe_router", "moe_unpermute_input", "shared_expert"),
    "shared_experts": ("shared_expert",),
    "mla_up_proj": ("attention_qkv",),
}


# CUDA graph module -> the activation terms a captured graph of that scope keeps inside its private memory pool.
# Everything a graph saves is written by replay into pool memory the caching allocator has already handed to
# the graph, so it is reserved but not counted as allocated (torch.cuda.graphs: private mempools; megatron-core
# transformer/cuda_graphs.py captures the scopes, transformer_layer.py _get_submodules_under_cudagraphs).
GRAPH_SCOPE_TERMS = {
    "attn": ("attn_layernorm_input", "attention_layernorm_output", "attention_qkv", "attention_qk_norm_inputs",
             "attention_softmax_stats", "attention_output", "attention_output_fp8", "mla_up_proj_inputs",
             "lora_a_gathered_input_linear_qkv"),
    "mlp": ("mlp_layernorm_input", "mlp_layernorm_output", "mlp_fc1_output", "mlp_silu_output", "mlp_act_output",
            "lora_a_gathered_input_linear_fc1"),
    "moe": ("moe_layernorm_input", "moe_layernorm_output", "moe_permuted_input", "moe_fc1_output",
            "moe_silu_output", "moe_act_output", "moe_router", "moe_unpermute_input", "shared_expert"),
    # up to the router: the pre-MLP norm and the router, and the shared experts unless they overlap with the
    # EP communication (then they run outside the graph)
    "moe_router": ("moe_layernorm_input", "moe_layernorm_output", "moe_router", "shared_expert"),
    "mamba": ("mamba_layernorm_input", "mamba_layernorm_output", "mamba_in_proj_output", "mamba_scan_output",
              "mamba_out_proj_input", "lora_a_gathered_input_in_proj"),
}
WHOLE_LAYER = ("attn", "mlp", "moe", "mamba")   # empty cuda_graph_modules: every graphable layer, whole


def graphed_blocks(kind: str, scopes: tuple[str, ...]) -> dict[str, str]:
    """Block -> the graph module that captures (part of) it, for one layer of ``kind``; {} when the layer is eager
    (cuda_graphs.py _layer_is_graphable: attn for layers with attention, mlp for dense MLP layers, moe or
    moe_router for MoE layers, mamba for Mamba layers)."""
    out = {}
    for block in kind.split("+"):
        if block in scopes:
            out[block] = block
        elif block == "moe" and "moe_router" in scopes:
            out[block] = "moe_router"
    return out


def layer_graph_parts(s: Shape, lay: Layout, st: Settings, kind: str) -> tuple[float, float, float]:
    """(eager, pool, static) bytes one layer of ``kind`` keeps per microbatch under CUDA graphs.

    TE captures one graph per graphable layer and microbatch (transformer_layer.py _te_cuda_graph_capture: the
    selected parts of the layer, in order). Its saved activations go to the pool; its static input
    (_get_layer_static_inputs: the bf16 hidden state, and for attention the bool mask mbs x s/cp x s) and its
    static output are allocated for as long as the graph lives. The first graphed block reads the static input
    directly, so that block's norm input is the static input rather than a tensor of its own.
    """
    terms = _selected_terms(s, lay, st, kind)
    graphed = graphed_blocks(kind, st.graph_scopes)
    if not graphed:
        return sum(terms.values()) * _tokens(lay), 0.0, 0.0
    first = next(iter(graphed))
    hidden = BF16 * s.hidden / (lay.tp if lay.sp else 1)
    static = terms.pop(f"{first}_layernorm_input", hidden) + hidden      # static input + static output
    if "attn" in graphed:
        static += 1.0 * lay.seq                                           # bool mask: s bytes per local token
    inside = {name for block, module in graphed.items() for name in GRAPH_SCOPE_TERMS[module]}
    if graphed.get("moe") == "moe_router" and st.shared_expert_overlap:
        inside.discard("shared_expert")
    pool = sum(v for k, v in terms.items() if k in inside)
    eager = sum(v for k, v in terms.items() if k not in inside)
    return eager * _tokens(lay), pool * _tokens(lay), static * _tokens(lay)


def _tokens(lay: Layout) -> float:
    return lay.seq * lay.mbs / lay.cp


def _selected_terms(s: Shape, lay: Layout, st: Settings, kind: str) -> dict[str, float]:
    terms = layer_activation_terms(s, lay, st, kind)
    if st.recompute == "selective":
        for label in st.modules:
            for name in RECOMPUTE_DROPS.get(label, ()):
                terms.pop(name, None)
    return terms


def layer_activation(s: Shape, lay: Layout, st: Settings, kind: str = "attn+mlp") -> float:
    """Bytes one layer of ``kind`` keeps per microbatch in eager mode (after selective recompute)."""
    return sum(_selected_terms(s, lay, st, kind).values()) * _tokens(lay)


def in_flight(lay: Layout, rank: int) -> float:
    """Layer-microbatches of activations alive on pipeline rank ``rank``, in units of 'all this stage's layers'."""
    m = lay.microbatches
    if lay.pp == 1:
        return 1.0
    if lay.vpp > 1:  # interleaved 1F1B: warm-up chunks, each 1/vpp of the stage's layers (Megatron schedules)
        chunks = min((lay.pp - rank - 1) * 2 + (lay.vpp - 1) * lay.pp + 1, m * lay.vpp)
        return chunks / lay.vpp
    return float(min(lay.pp - rank, m))


@dataclass(frozen=True)
class StageActivations:
    """Activation bytes on one pipeline rank in the two phases that can hold the most of them."""
    steady: float             # the 1F1B steady state: everything eager, plus the last stage's loss buffers
    capture: float = 0.0      # CUDA graph capture: the graphed scopes' activations for every in-flight microbatch
    pool: float = 0.0         # the graphs' private pool, reserved through the steady state
    detail: tuple[tuple[str, float], ...] = ()


def stage_activations(s: Shape, lay: Layout, st: Settings, rank: int) -> StageActivations:
    counts = rank_layers(s, lay, rank)
    per_stage = sum(counts.values()) or 1

    def mean(value) -> float:
        return sum(n * value(kind) for kind, n in counts.items()) / per_stage

    tokens = lay.seq * lay.mbs / lay.cp
    hidden_local = BF16 * s.hidden * tokens / (lay.tp if lay.sp else 1)   # one sequence-local hidden state
    per_layer = full_layer = mean(lambda kind: layer_activation(s, lay, st, kind))
    mbs_alive = in_flight(lay, rank)
    detail: list[tuple[str, float]] = []
    capture = pool = 0.0
    graphed = bool(st.graph_scopes) and st.recompute != "full" and not st.cpu_offload_layers
    if graphed:
        # Graphed scopes keep their activations in the graphs' private pool: allocated while the graphs are
        # captured (after the warm-up steps, in pipeline order, no eager activations alive), reserved-only in
        # replay. Static inputs and outputs are allocated in both phases; megatron-core reuses a static input
        # once its microbatch's backward is done (cuda_graphs.py _get_sample_arguments), so there is one per
        # in-flight microbatch.
        parts = {kind: layer_graph_parts(s, lay, st, kind) for kind in counts}
        eager, inside, static = (mean(lambda kind, i=i: parts[kind][i]) for i in range(3))
        per_layer = eager + static
        capture = per_stage * (inside + static) * mbs_alive
        pool = per_stage * inside * mbs_alive
        detail.append(("CUDA graph pool (reserved; allocated only while capturing)", pool))
        detail.append(("CUDA graph static inputs and outputs", per_stage * static * mbs_alive))
    if st.recompute == "full":
        # Only each checkpointed group's input survives; one group is re-materialized at a time.
        boundary = 2 * BF16 * s.hidden / (lay.tp if lay.sp else 1) * lay.seq * lay.mbs / lay.cp
        n = max(1, st.recompute_layers)
        if st.recompute_method == "block":
            ckpt = min(per_stage / lay.vpp, n) * lay.vpp
            kept = (per_stage - ckpt) * per_layer + ckpt * boundary
        else:
            kept = per_stage / n * boundary
        acts = kept * mbs_alive + n * full_layer
        detail.append(("full recompute working set", n * full_layer))
    else:
        layers_on_gpu = per_stage
        if st.cpu_offload_layers:
            layers_on_gpu -= min(per_stage, st.cpu_offload_layers) - (1 if st.cpu_offload_double_buffer else 0)
        acts = layers_on_gpu * per_layer * mbs_alive
    if rank == 0:
        acts += hidden_local * mbs_alive  # embedding output
    if rank == lay.pp - 1:
        logits = st.logits_bytes * s.vocab / lay.tp * tokens
        detail.append(("loss: logits and their fp32 softmax/gradient (last stage)", logits))
        acts += logits
        if st.deferred_wgrad_microbatches:
            # defer_embedding_wgrad_compute: the output layer keeps each microbatch's bf16 dY (tokens x vocab/tp)
            # and its sequence-local input until the pipeline flush (megatron-core tensor_parallel/layers.py)
            per_mb = BF16 * tokens * s.vocab / lay.tp + hidden_local
            deferred = st.deferred_wgrad_microbatches * per_mb
            detail.append(("deferred output-layer wgrad inputs", deferred))
            acts += deferred
    return StageActivations(acts, capture, pool, tuple(detail))


# ----------------------------------------------------------------------------- the most-loaded GPU
def optimizer_step_buffers(s: Shape, lay: Layout, st: Settings, first: bool, last: bool) -> float:
    """fp32 gradient copies the distributed optimizer makes at its step when gradients are kept in bf16
    (distrib_optimizer.py _copy_model_grads_to_main_grads: shard_main_param.grad = shard_model_grad.float())."""
    if st.grad_bytes >= FP32 or not st.master_bytes or st.lora_rank:
        return 0.0  # fp32 gradients are used in place (.float() is a no-op); adapters only: negligible
    if st.fsdp is not None:
        return 0.0  # Megatron FSDP owns its main-grad buffers: _copy_model_grads_to_main_grads returns early
    if st.precision_aware or not st.step_upcasts_grads:
        # decoupled_grad is the bf16 shard itself; under CPU offload the hybrid optimizer upcasts the GPU part
        # for its fp32 masters (fp32_param.grad = grad.to(fp32), hybrid_optimizer.py _set_sub_optimizer_grads)
        fraction = 1.0 - st.optimizer_offload if st.optimizer_offload else 0.0
    else:
        # every shard is upcast, offloaded or not: the hybrid optimizer copies the offloaded ones to the CPU from
        # this fp32 gradient (cpu_copy_map_grad[param].copy_(gpu_param.grad))
        fraction = 1.0
    if not fraction:
        return 0.0
    layer_params, embed, expert = stage_params(s, lay, first, last)
    shards, expert_shards = optimizer_shards(lay, st)
    return FP32 * ((layer_params + embed) / shards + expert / expert_shards) * fraction


def largest_layer_params(s: Shape, lay: Layout, rank: int) -> float:
    """Parameters of the largest layer pipeline rank ``rank`` holds, on one GPU (dense + its experts)."""
    return max((sum(sum(_block_params(s, lay, block)) for block in kind.split("+"))
                for kind in rank_layers(s, lay, rank)), default=0.0)


def communication_buffers(s: Shape, lay: Layout, st: Settings, rank: int, params: float) -> float:
    """Transient unsharded copies the data-parallel communication keeps beside the sharded state."""
    if st.fsdp is not None:
        # Megatron FSDP: each layer is one FSDP unit (mcore_fsdp_adapter.py fsdp_unit_modules: TransformerLayer,
        # MoETransformerLayer, MambaLayer). Sharded parameters are all-gathered per unit, the next unit prefetched
        # (megatron_fsdp.py prefetch=True); sharded gradients are reduce-scattered from one unsharded unit.
        (p_shard, _), (g_shard, _) = fsdp_shards(lay, st)
        unit = largest_layer_params(s, lay, rank)
        gathered = 2 * unit * (st.param_bytes + st.fp8_weight_copy_bytes) if p_shard > 1 else 0.0
        unsharded_grads = unit * st.grad_bytes if g_shard > 1 and not st.lora_rank else 0.0
        return gathered + unsharded_grads
    if st.dist_optimizer and lay.dp * lay.cp > 1:
        # overlap_param_gather keeps one bucket's all-gathered params (Megatron bucket_size 40M params)
        return min(40e6, (params / st.param_bytes)) * st.param_bytes
    return 0.0


def estimate(s: Shape, lay: Layout, st: Settings) -> Breakdown:
    """The most-loaded GPU at its peak: over the first and last pipeline ranks, the largest of the steady
    1F1B state, CUDA graph capture and the optimizer step (each on top of parameters, gradients, optimizer)."""
    best: Breakdown | None = None
    for rank in sorted({0, lay.pp - 1}):
        first, last = rank == 0, rank == lay.pp - 1
        p, g, o = model_state(s, lay, st, first=first, last=last)
        acts = stage_activations(s, lay, st, rank)
        other = communication_buffers(s, lay, st, rank, p)
        step = optimizer_step_buffers(s, lay, st, first, last)
        phases = {"steady 1F1B": (acts.steady, other), "CUDA graph capture": (acts.capture, other),
                  "optimizer step": (0.0, other + step)}
        phase, (a, x) = max(phases.items(), key=lambda kv: sum(kv[1]))
        detail = acts.detail + ((("fp32 gradient copies at the optimizer step", step),) if step else ())
        if st.fsdp is not None and other:
            detail += (("Megatron FSDP gathered parameters and unsharded gradients", other),)
        resident = p + g + o + other + acts.steady + acts.pool if acts.pool else 0.0
        b = Breakdown(p, g, o, a, x, detail, rank, phase, resident)
        if best is None or b.footprint > best.footprint:
            best = b
    return best


# ----------------------------------------------------------------------------- from a Bridge config
def loss_bytes(m: Any) -> int:
    """Bytes per logit element at the loss's peak.

    Unfused megatron-core cross entropy and TE's kernel: the bf16 logits plus one fp32 tensor (the upcast logits
    turned into the softmax in place, or TE's fp32 gradient). The torch.compile'd "native" fusion
    (fusions/fused_cross_entropy.py) is the same in forward, but its compiled calculate_gradients allocates a
    fresh fp32 buffer and the bf16 result beside the saved fp32 softmax: 4 + 4 + 2 bytes (inductor's generated
    code for it, checked with torch 2.14).
    """
    fused = bool(getattr(m, "cross_entropy_loss_fusion", False))
    if fused and str(getattr(m, "cross_entropy_fusion_impl", "native")) == "native":
        return FP32 + FP32 + BF16
    return BF16 + FP32


def graph_scopes(m: Any) -> tuple[str, ...]:
    """Per-layer CUDA graph modules whose activations leave allocated memory; () when graphs are off or capture
    the whole iteration (then every activation is allocated at capture exactly as in eager mode).

    megatron-core reads ``cuda_graph_modules`` (default "full": the whole layer); the deprecated
    ``cuda_graph_scope`` is migrated into it (transformer_config.py __post_init__). Bridge's own helpers read both
    the same way before finalize (megatron/bridge/utils/cuda_graph.py), so we call them.
    """
    from megatron.bridge.utils.cuda_graph import cuda_graph_module_names, is_full_iteration_cuda_graph
    impl = str(getattr(m, "cuda_graph_impl", None) or "none")
    if impl == "none" or is_full_iteration_cuda_graph(m):
        return ()
    modules = tuple(cuda_graph_module_names(m))
    return modules or WHOLE_LAYER


def recompute_modules(m: Any, impl_scopes: tuple[str, ...]) -> tuple[str, ...]:
    """The selective-recompute labels that take effect. "layernorm" on MoE layers is switched off under a TE
    moe_router graph unless moe_preprocess is graphed with the alltoall dispatcher (or a latent MoE) and the
    shared expert does not overlap (transformer_layer.py can_recompute_pre_mlp_layernorm_for_cudagraph)."""
    modules = tuple(m.recompute_modules if m.recompute_modules is not None else ["core_attn"])
    if "layernorm" not in modules or "moe_router" not in impl_scopes:
        return modules
    if str(getattr(m, "cuda_graph_impl", "none")) == "local":
        return modules
    overlap = getattr(m, "moe_shared_expert_intermediate_size", None) is not None and \
        bool(getattr(m, "moe_shared_expert_overlap", False))
    preprocess = "moe_preprocess" in impl_scopes and (
        getattr(m, "moe_token_dispatcher_type", None) == "alltoall" or bool(getattr(m, "moe_latent_size", None)))
    if not overlap and preprocess:
        return modules
    return tuple(x for x in modules if x != "layernorm")  # only MoE layers have a separate norm in this model


def fp8_weight_copy_bytes(fp8: bool, fp8_params: bool, transpose_cache_disabled: bool) -> int:
    """Bytes per layer GEMM weight kept beside the parameter itself for FP8 GEMMs.

    FP8 parameters (fp8_param_gather) keep a second, transposed FP8 layout after each all-gather, because
    Hopper's FP8 GEMM takes only the TN layout (TE tensor/utils.py post_all_gather_processing:
    _create_transpose when non-TN FP8 GEMM is unsupported). bf16 parameters with FP8 compute keep a cached FP8
    copy in both layouts across microbatches unless disable_parameter_transpose_cache is set (megatron-core
    passes is_first_microbatch=None then, so TE quantizes the weight afresh each time).
    """
    if not fp8:
        return 0
    if fp8_params:
        return FP8
    return 0 if transpose_cache_disabled else 2 * FP8


def _dtype_bytes(dtype: Any, default: int) -> int:
    name = str(dtype)
    return {"torch.float32": FP32, "torch.bfloat16": BF16, "torch.float16": BF16, "torch.uint8": FP8}.get(name, default)


def vocab_size(cfg: Any) -> int:
    """model.vocab_size, or, when the recipe leaves it to the tokenizer (Nemotron-3-Nano pretrain: None), what
    the tokenizer will give: Bridge sets the model's vocab from the tokenizer at setup. For a Hugging Face
    tokenizer we read vocab_size from the model's shipped config.json (bridge/hf_configs), 0 if we have none."""
    vocab = getattr(cfg.model, "vocab_size", None)
    if vocab:
        return int(vocab)
    tok = getattr(cfg, "tokenizer", None)
    if getattr(tok, "vocab_size", None):
        return int(tok.vocab_size)
    hub_id = getattr(tok, "tokenizer_model", None)
    if not isinstance(hub_id, str):
        return 0
    import json

    from ..bridge.hf_offline import available_models
    path = available_models().get(hub_id)
    if path is None:
        return 0
    return int(json.loads(path.read_text()).get("vocab_size") or 0)


def from_config(cfg: Any, world: int) -> tuple[Shape, Layout, Settings]:
    from ..core.engine import View
    from ..core.paths import read
    from ..core.rules import mixed_precision_config, regather_fallbacks
    m = cfg.model
    layers = m.num_layers
    freq = getattr(m, "moe_layer_freq", 1)
    experts = getattr(m, "num_moe_experts", None) or 0
    pattern = getattr(m, "hybrid_override_pattern", None) or getattr(m, "hybrid_layer_pattern", None)
    if getattr(m, "is_hybrid_model", False) and isinstance(pattern, str) and pattern:
        # hybrid stacks (Nemotron-H): one block per symbol; MTP blocks after "/" are not modelled
        kinds = tuple(HYBRID_SYMBOLS[c] for c in pattern.split("/")[0] if c in HYBRID_SYMBOLS)
        layers = len(kinds)
    else:
        if not experts:
            is_moe = [False] * layers
        elif isinstance(freq, int):
            is_moe = [i % freq == 0 for i in range(layers)]
        else:
            is_moe = [bool(int(x)) for x in freq]
        kinds = tuple("attn+moe" if x else "attn+mlp" for x in is_moe)
    moe_layers = sum(1 for k in kinds if "moe" in k)
    vocab = vocab_size(cfg)
    div = int(getattr(m, "make_vocab_size_divisible_by", 128) or 128) * m.tensor_model_parallel_size
    vocab = int(math.ceil(vocab / div) * div) if vocab else 0
    shape = Shape(
        layers=layers, hidden=m.hidden_size, ffn=m.ffn_hidden_size or 4 * m.hidden_size, heads=m.num_attention_heads,
        groups=m.num_query_groups or m.num_attention_heads, head_dim=m.kv_channels or m.hidden_size // m.num_attention_heads,
        vocab=vocab, gated=bool(getattr(m, "gated_linear_unit", False)),
        tied=bool(getattr(m, "share_embeddings_and_output_weights", False)),
        experts=experts, moe_ffn=getattr(m, "moe_ffn_hidden_size", 0) or 0, topk=getattr(m, "moe_router_topk", 0) or 0,
        shared_ffn=getattr(m, "moe_shared_expert_intermediate_size", 0) or 0, moe_layers=moe_layers,
        mla=bool(getattr(m, "multi_latent_attention", False)), qk_head_dim=getattr(m, "qk_head_dim", 0) or 0,
        qk_pos_dim=getattr(m, "qk_pos_emb_head_dim", 0) or 0, v_head_dim=getattr(m, "v_head_dim", 0) or 0,
        kv_lora_rank=getattr(m, "kv_lora_rank", 0) or 0, q_lora_rank=getattr(m, "q_lora_rank", 0) or 0,
        qk_norm=bool(getattr(m, "qk_layernorm", False)), layer_kinds=kinds,
        mamba_heads=getattr(m, "mamba_num_heads", 0) or 0, mamba_head_dim=getattr(m, "mamba_head_dim", 0) or 0,
        mamba_groups=getattr(m, "mamba_num_groups", 0) or 0, mamba_state=getattr(m, "mamba_state_dim", 0) or 0,
        mamba_conv=getattr(m, "linear_conv_kernel_dim", 4) or 4)
    lay = Layout(world=world, tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size,
                 vpp=m.virtual_pipeline_model_parallel_size or 1, cp=m.context_parallel_size,
                 ep=getattr(m, "expert_model_parallel_size", 1) or 1,
                 etp=getattr(m, "expert_tensor_parallel_size", None) or m.tensor_model_parallel_size,  # mcore default
                 sp=bool(m.sequence_parallel) and m.tensor_model_parallel_size > 1,
                 seq=m.seq_length, mbs=cfg.train.micro_batch_size, gbs=cfg.train.global_batch_size)
    mp = mixed_precision_config(getattr(cfg, "mixed_precision", None))
    grad_fp32 = getattr(mp, "grad_reduce_in_fp32", None)
    if grad_fp32 is None:
        grad_fp32 = bool(read(cfg, "ddp.grad_reduce_in_fp32", True))
    opt = cfg.optimizer
    precision_aware = bool(getattr(opt, "use_precision_aware_optimizer", False))
    peft = getattr(cfg, "peft", None)
    fp8 = bool(getattr(mp, "fp8", None) or getattr(m, "fp8", None))
    fp8_params = bool(getattr(m, "fp8_param", False) or getattr(mp, "fp8_param_gather", False))
    overlap = getattr(cfg, "comm_overlap", None)
    defer = getattr(overlap, "defer_embedding_wgrad_compute", None)
    defer = bool(getattr(m, "defer_embedding_wgrad_compute", False) if defer is None else defer)
    limit = getattr(overlap, "wgrad_deferral_limit", None)
    limit = int(getattr(m, "wgrad_deferral_limit", 0) or 0) if limit is None else int(limit)
    fsdp_on = bool(read(cfg, "ddp.use_megatron_fsdp", False) or getattr(getattr(cfg, "dist", None),
                                                                       "use_megatron_fsdp", False))
    scopes = graph_scopes(m)
    regather: tuple[str, ...] = ()
    if peft is not None and getattr(peft, "sequence_parallel_input_regather", False):
        view = View(cfg, {}, {}, world, (), {})
        regather = tuple(t for t, r in regather_fallbacks(view).items() if r is None)
    settings = Settings(
        recompute=m.recompute_granularity,
        modules=recompute_modules(m, scopes) if m.recompute_granularity == "selective" else (),
        recompute_method=m.recompute_method, recompute_layers=m.recompute_num_layers or 1,
        cpu_offload_layers=(m.cpu_offloading_num_layers if m.cpu_offloading and m.cpu_offloading_activations else 0),
        cpu_offload_double_buffer=bool(getattr(m, "cpu_offloading_double_buffering", False)),
        # Bridge forces both distributed-optimizer flags on under Megatron FSDP (config.py
        # _validate_and_apply_megatron_fsdp_configs)
        dist_optimizer=bool(opt.use_distributed_optimizer or read(cfg, "ddp.use_distributed_optimizer", False)
                            or fsdp_on),
        precision_aware=precision_aware,
        optimizer_instances=int(read(cfg, "ddp.num_distributed_optimizer_instances", 1) or 1),
        fsdp=str(read(cfg, "ddp.data_parallel_sharding_strategy", "no_shard") or "no_shard") if fsdp_on else None,
        fsdp_outer_optim=str(read(cfg, "ddp.outer_dp_sharding_strategy", "no_shard")) == "optim",
        shared_expert_overlap=bool(getattr(m, "moe_shared_expert_overlap", False)),
        optimizer_offload=float(opt.optimizer_offload_fraction or 0.0) if opt.optimizer_cpu_offload else 0.0,
        grad_bytes=FP32 if grad_fp32 else BF16,
        param_bytes=FP8 if fp8_params else BF16,
        fp8_weight_copy_bytes=fp8_weight_copy_bytes(fp8, fp8_params, bool(getattr(m, "disable_parameter_transpose_cache", False))),
        swiglu_fused=bool(getattr(m, "bias_activation_fusion", True)),
        graph_scopes=scopes,
        logits_bytes=loss_bytes(m),
        step_upcasts_grads=not precision_aware,
        deferred_wgrad_microbatches=(min(limit, lay.microbatches) if limit > 0 else lay.microbatches)
        if defer and lay.pp > 1 else 0,
        state_bytes=_dtype_bytes(getattr(opt, "exp_avg_dtype", None), FP32) if precision_aware else FP32,
        master_bytes=_dtype_bytes(getattr(opt, "main_params_dtype", None), FP32) if precision_aware else FP32,
        fp8=fp8,
        lora_rank=int(getattr(peft, "dim", 0) or 0) if type(peft).__name__ in ("LoRA", "DoRA") else 0,
        lora_targets=tuple(getattr(peft, "target_modules", ()) or ()),
        lora_regather=regather)
    return shape, lay, settings


# ----------------------------------------------------------------------------- steps
@dataclass(frozen=True)
class Step:
    name: str                 # "baseline" or the overlay added at this step
    breakdown: Breakdown
    note: str = ""

    def as_dict(self, previous: "Step | None") -> dict[str, Any]:
        d = {"name": self.name, **{k: int(v) for k, v in self.breakdown.as_dict().items()}}
        d["total_bytes"] = d.pop("total")
        d["delta_bytes"] = 0 if previous is None else int(self.breakdown.total - previous.breakdown.total)
        d["peak_rank"], d["peak_phase"] = self.breakdown.rank, self.breakdown.phase
        d["detail_bytes"] = {k: int(v) for k, v in self.breakdown.detail}
        if self.breakdown.resident:
            d["resident_bytes"] = int(self.breakdown.resident)
        if self.note:
            d["note"] = self.note
        return d


@dataclass(frozen=True)
class Plan:
    recipe: str
    world: int
    layout: Layout
    steps: tuple[Step, ...]
    capacity: float | None
    margin: float
    bridge_estimate: float | None
    assumptions: tuple[str, ...] = ASSUMPTIONS

    @property
    def total(self) -> float:
        return self.steps[-1].breakdown.total

    def fits(self, step: Step) -> bool | None:
        return None if self.capacity is None else step.breakdown.footprint <= self.capacity * (1 - self.margin)

    def as_dict(self) -> dict[str, Any]:
        steps = []
        for i, s in enumerate(self.steps):
            d = s.as_dict(self.steps[i - 1] if i else None)
            d["fits"] = self.fits(s)
            steps.append(d)
        return {"recipe": self.recipe, "world_size": self.world,
                "layout": {k: getattr(self.layout, k) for k in ("tp", "pp", "vpp", "cp", "ep", "sp", "seq", "mbs", "gbs")}
                | {"dp": self.layout.dp, "microbatches": self.layout.microbatches},
                "total_bytes": int(self.total), "capacity_bytes": None if self.capacity is None else int(self.capacity),
                "margin": self.margin, "fits": self.fits(self.steps[-1]),
                "bridge_estimator_bytes": None if self.bridge_estimate is None else int(self.bridge_estimate),
                "steps": steps, "assumptions": list(self.assumptions)}


STEP_NOTES = {"expandable_segments": "no change in allocated memory; removes fragmentation (reserved-but-unallocated)"}
