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
from dataclasses import dataclass, replace
from typing import Any

BF16 = 2            # bytes per bf16/fp16 element
FP32 = 4
FP8 = 1
ADAM_MOMENTS = 2    # exp_avg and exp_avg_sq

# The assumptions a plan's uncertainty ranges qualify (memory/ranges.py); each range names one of these.
MOE_BALANCE = (
    "MoE tokens are balanced across experts (each GPU's experts take topk x its tokens); the range for "
    "activations runs to the most one GPU's experts can receive: capacity factor x that share when tokens beyond "
    "moe_expert_capacity_factor are dropped (moe_utils.py get_capacity, per source rank and expert), or, dropless, "
    "every token of the expert-parallel group routed to this GPU's experts; with "
    "moe_pad_expert_input_to_capacity the load is the capacity itself")
VOCAB_FROM_TOKENIZER = (
    "the vocabulary is the one Bridge sets at setup (training/setup.py:293-299, _validate_and_set_vocab_size): "
    "the tokenizer's, padded to make_vocab_size_divisible_by x TP, when tokenizer.use_tokenizer_vocab_size is set "
    "(the pretrain recipes' NullTokenizer) or model.vocab_size is None; else model.vocab_size as it is. The "
    "tokenizer's is tokenizer.vocab_size, or for a Hugging Face tokenizer the model's shipped config.json "
    "vocab_size (the padded embedding size, which can exceed the tokenizer's own by a few hundred tokens); when "
    "neither is known (and the recipe presets none) the embedding, output layer and logits are not counted and "
    "the range says how large a vocabulary still fits")
FP8_TRANSPOSE = (
    "FP8 weights keep a transposed FP8 copy (Hopper GEMMs take only the TN layout: TE v2.17.1 tensor/utils.py "
    "post_all_gather_processing _create_transpose); on a GPU with non-TN FP8 GEMMs (Blackwell) that byte per "
    "layer weight is not kept: the low end of the parameters' range")
GRAPH_WARMUP = (
    "with TE CUDA graphs the first cuda_graph_warmup_steps (W) iterations run eagerly and the graphs are captured "
    "at the start of iteration W + 1 (Bridge training/train.py:429-438), before that iteration's zero_grad "
    "(train.py:866-869; megatron-core zeroes the gradients only after capture, cuda_graphs.py:2671-2681 "
    "_reset_after_capture). With W >= 1 the capture therefore runs beside the Adam moments and the W-th step's "
    "fp32 gradient copies; with W = 0 it runs before the first step, when FusedAdam has not created its moments "
    "yet (TE v2.17.1 optimizers/fused_adam.py:615-616 initialize_state on first use). The eager iterations hold "
    "every activation (beside the moments from the second on). These one-time phases come before training and "
    "are the high end of the activations' range; the headline plan is training after capture: graph replay and "
    "the optimizer step")
PRECISION_AWARE_PATH = (
    "use_precision_aware_optimizer keeps the gradients in bf16 at the step (decoupled_grad) and gives the "
    "master weights to FusedAdam only where megatron-core's use_precision_aware_optimizer_no_fp8_or_ds_fp8 holds "
    "(optimizer_config.py:404-411: main params not fp32, an fp8_recipe of None or delayed, or CPU offload). "
    "Bridge's mixed-precision setup copies mixed_precision.fp8_recipe (default 'tensorwise', also without FP8) "
    "into the optimizer config (mixed_precision.py setup) before finalize computes it, so with fp32 main params "
    "the step takes the regular path: DistributedOptimizer's fp32 masters and fp32 gradient copies "
    "(distrib_optimizer.py:2782), with the moments in exp_avg_dtype")

ASSUMPTIONS = (
    "allocated memory only (torch's max_memory_allocated, what Bridge reports as mem-max-allocated): allocator "
    "fragmentation (reserved-but-unallocated) is not modelled; expandable_segments therefore shows 0 B of change "
    "although it is the fix for that gap. The caching allocator rounds every request up to 512 bytes (negligible) "
    "and hands out a cached large block whole when less than 1 MiB would be left over (CUDACachingAllocator "
    "should_split): that slack depends on the order of allocations and is not modelled",
    "CUDA context, NCCL communicators, TE userbuffers (cudaMalloc/cuMemCreate outside torch: TE v2.17.1 "
    "comm_gemm_overlap.cpp:421, userbuffers-host.cpp:660) and cuBLAS/TE workspaces are outside torch's allocated "
    "memory and not counted",
    "the headline peak is the larger of the two phases every training iteration goes through, on the first and "
    "last pipeline ranks (and any middle rank whose layers differ): the 1F1B steady state (most microbatches in "
    "flight, plus the last stage's loss, deferred output-layer gradients and megatron-core's global memory "
    "buffer) and the optimizer step (fp32 copies of bf16 gradients, the params-dtype casts of FP8 master "
    "weights, and the CUDA graphs' static inputs). The one-time phases before training, eager warm-up "
    "iterations and CUDA graph capture, are planned per rank too and bound the activations' range",
    "per-layer CUDA graphs (cuda_graph_modules, or the deprecated cuda_graph_scope; none: the whole layer) follow "
    "megatron-core's TECudaGraphHelper (transformer/cuda_graphs.py) and TE v2.17.1's make_graphed_callables "
    "(pytorch/graph.py): one graph per graphable layer (_layer_is_graphable: attn, mlp, moe/moe_router, mamba by "
    "layer type) and per microbatch in the pipeline order (one microbatch without PP), captured after the warm-up "
    "steps; the captured scopes' saved activations for the in-flight microbatches are the capture peak and stay "
    "as the graphs' private pool (reserved, not allocated, in replay). Each graphed layer and in-flight microbatch "
    "has a static input (the hidden state, plus for attention graphs the bool mask mbs x s/cp x s: "
    "_get_layer_static_inputs), allocated throughout, and a static output, allocated while capturing and "
    "weak-referenced into the pool after its backward graph is captured (_reuse_graph_input_output_buffers), so "
    "in replay it and the next eager norm's saved copy of it are pool memory. Static gradient buffers (reused by "
    "shape; the previous graph's weak-referenced) are not counted. The local implementation is modelled the same "
    "way",
    GRAPH_WARMUP,
    PRECISION_AWARE_PATH,
    "attention uses a fused/flash kernel (TE default): only softmax statistics and the output are kept beside q, "
    "k, v, so core_attn recompute drops the statistics and the kernel's output (a quantized or adapter-read copy "
    "for linear_proj stays); an unfused backend would keep the s x s scores",
    "a GEMM input is kept only for a weight gradient (TE backward_needs_input): frozen LoRA base GEMMs keep theirs "
    "only when an adapter reads the same tensor; under SP a column-parallel LoRA-A keeps the full gathered input "
    "unless input re-gather lets it reuse the sequence-local shard",
    FP8_TRANSPOSE,
    MOE_BALANCE,
    "'moe' selective recompute checkpoints the MoE layer with the pre-MLP norm output as its saved input "
    "(moe/moe_layer.py tensor_parallel.checkpoint(custom_forward, False, hidden_states, ...)): that output stays "
    "unless 'layernorm' is selected too, which megatron-core turns off for MoE layers under a TE moe_router "
    "graph unless moe_preprocess is graphed with the alltoall dispatcher (transformer_layer.py "
    "can_recompute_pre_mlp_layernorm_for_cudagraph)",
    "hybrid (Mamba) blocks use the fused conv1d+scan kernel, which keeps its input projection and scan output",
    VOCAB_FROM_TOKENIZER,
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


# Terms added for issue 25, each found in the code path of a measured configuration (bench/plan_accuracy.py) and
# physically general; Settings.without switches any of them off so the bench can show what each one changes.
# name -> (what the model now counts, where it comes from: installed megatron-core 0.19.2 / Bridge 0.6.2 files,
# Transformer Engine at tag v2.17.1, the commit Bridge 0.6.x's uv.lock pins).
ADDED_TERMS = {
    "glu_linear_copy": (
        "unfused GLU (bias_activation_fusion off): the linear half plus glu_linear_offset is a new tensor the "
        "product keeps, a clamped gate is a new tensor silu keeps; MoE experts without the fused weighted kernel "
        "also keep the activation output for the probabilities' gradient",
        "megatron/core/transformer/mlp.py:324-331 (glu: activation_func(x_glu) * (x_linear + glu_linear_offset)); "
        "transformer/moe/experts.py:861-879 (the same, then intermediate_parallel * permuted_probs)"),
    "core_attn_output": (
        "core_attn recompute keeps q, k, v only: the fused kernel's bf16 output is dropped unless linear_proj "
        "keeps that same tensor for a bf16 weight gradient (under FP8 it keeps a quantized copy instead)",
        "megatron/core/transformer/attention.py:461,494 (_checkpointed_attention_forward: checkpoint(custom_forward, "
        "False, query, key, value, ...)); tensor_parallel/random.py:618 (CheckpointFunction: "
        "ctx.save_for_backward(*args))"),
    "te_cross_entropy_in_place": (
        "TE's fused cross entropy writes the gradient into the bf16 logits and saves them: 2 bytes per logit, "
        "not 6",
        "TE v2.17.1 transformer_engine/pytorch/cross_entropy.py:53-62; common/triton/cross_entropy.py:190 "
        "(tl.store(X_ptr + X_offsets, X_block.to(grad_dtype))); megatron/core/models/common/language_module/"
        "language_module.py:186 (te_parallel_cross_entropy(logits, ...))"),
    "graph_outputs_in_pool": (
        "in CUDA graph replay a graph's static output, and the next eager norm's saved copy of it, are pool "
        "memory (weak references), not allocated",
        "TE v2.17.1 transformer_engine/pytorch/graph.py:719-723 (make_weak_ref(static_outputs)), :866 (replay "
        "returns static_outputs); megatron/core/transformer/cuda_graphs.py:2593-2595 "
        "(_reuse_graph_input_output_buffers=True for TE >= 2.7)"),
    "graph_static_inputs_at_step": (
        "CUDA graph static inputs (one hidden state per in-flight layer-microbatch) stay allocated at the optimizer "
        "step",
        "megatron/core/transformer/module.py:257 (get_layer_static_inputs: torch.ones hidden state), "
        "transformer/cuda_graphs.py:2231 (_get_sample_arguments: reused per signature), TE v2.17.1 graph.py:848 "
        "(replay copies each input into its static buffer)"),
    "block_recompute_one_layer": (
        "full recompute with method block checkpoints each of its first n layers on its own, so one layer is "
        "re-materialized at a time (uniform re-materializes a group of n)",
        "megatron/core/recompute.py:167-181 (block: chunk_runner(layer_idx, layer_idx + 1, use_checkpoint)); "
        ":157-166 (uniform: chunk_runner(layer_idx, layer_idx + recompute_num_layers, True))"),
    "global_memory_buffer": (
        "the last stage's trainable output layer under SP all-gathers into megatron-core's global memory buffer "
        "(full sequence x hidden, bf16), kept for the job; the deferred-wgrad drain keeps a second one",
        "megatron/core/tensor_parallel/layers.py:570 (get_global_memory_buffer().get_tensor(dim_size, input.dtype, "
        "\"mpu\")); megatron/core/utils.py:1259 (drain_embedding_wgrad_compute: \"mpu_0\")"),
    "fp8_master_cast_copies": (
        "FP8 primary weights with the distributed optimizer: at the step TE first casts every fp32 master shard of a "
        "quantized weight to the params dtype and holds all the casts in a list until it has quantized them into "
        "the FP8 weights, beside the step's fp32 gradient copies: 2 bytes per quantized weight element of this "
        "rank's optimizer shard (bf16 params)",
        "megatron/core/optimizer/optimizer.py:786,808 (optimizer.step(), then _copy_main_params_to_model_params); "
        "optimizer/distrib_optimizer.py:2815,2837 (fp8_param_gather: quantize_param_shard); fp8_utils.py:415 "
        "(cast_master_weights_to_fp8); TE v2.17.1 transformer_engine/pytorch/tensor/utils.py:139-144 "
        "(master_weight = master_weight.to(model_weight.dtype)), :148-167 (appended to the per-recipe lists), "
        ":171-181 (cast after the loop)"),
    "precision_aware_grad_upcast": (
        "use_precision_aware_optimizer with fp32 main params and an fp8_recipe other than delayed (Bridge's default "
        "'tensorwise', also without FP8) and no CPU offload takes megatron-core's regular path: the step makes "
        "fp32 gradient copies (the plan said bf16 decoupled gradients)",
        "megatron/core/optimizer/optimizer_config.py:404-411 (use_precision_aware_optimizer_no_fp8_or_ds_fp8); "
        "optimizer/distrib_optimizer.py:2774-2782 (decoupled_grad only under that flag, else .float()); "
        "megatron/bridge/training/mixed_precision.py:130-131 (setup copies fp8_recipe into the optimizer config), "
        "megatron/bridge/training/config.py:136-142 (OptimizerConfig.finalize runs the post-init after that)"),
    "graph_capture_after_warmup": (
        "the CUDA graph capture as Bridge runs it, once, before training: with cuda_graph_warmup_steps >= 1 beside "
        "the last warm-up step's fp32 gradient copies, with 0 before the Adam moments exist; a one-time phase "
        "like the eager warm-up, so it bounds the range and the headline is replay and the optimizer step (before: "
        "the capture's activations beside the full state, in the headline)",
        "megatron/bridge/training/train.py:429-438 (create_cudagraphs when step - start == "
        "cuda_graph_warmup_steps, before train_step), :866-869 (train_step: optimizer.zero_grad); "
        "megatron/core/transformer/cuda_graphs.py:2671-2681 (_reset_after_capture zeroes after capture); TE "
        "v2.17.1 transformer_engine/pytorch/optimizers/fused_adam.py:615-616 (moments created at the first step)"),
}

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
    cross_entropy_impl: str = "unfused"       # "te", "native" (fused) or "unfused" (see loss_bytes)
    # the optimizer step copies bf16 grads to fp32: megatron-core's use_precision_aware_optimizer_no_fp8_or_ds_fp8
    # is false (see PRECISION_AWARE_PATH)
    step_upcasts_grads: bool = True
    # Bytes per quantized weight element of the optimizer shard that the step casts the fp32 master to before
    # quantizing it into an FP8 primary weight (fp8_master_cast_copies): the params dtype's, 0 without FP8 params
    fp8_cast_copy_bytes: int = 0
    precision_aware: bool = False             # optimizer.use_precision_aware_optimizer (see optimizer_gpu_bytes)
    optimizer_instances: int = 1              # ddp.num_distributed_optimizer_instances (see data_parallel_shards)
    fsdp: str | None = None                   # Megatron FSDP on: ddp.data_parallel_sharding_strategy
    fsdp_outer_optim: bool = False            # ddp.outer_dp_sharding_strategy == "optim" (HSDP across instances)
    shared_expert_overlap: bool = False       # moe_shared_expert_overlap: the shared expert is outside router graphs
    glu_clamped: bool = False                 # activation_func_clamp_value set: the unfused GLU clamps x_glu first
    moe_load: float = 1.0                     # tokens on this rank's experts / a balanced load (see moe_load_range)
    moe_capacity_factor: float | None = None  # moe_expert_capacity_factor (None: dropless)
    moe_probs_mul: bool = False               # experts weight their activation output by the probs separately
    graph_warmup_steps: int = 0               # cuda_graph_warmup_steps: eager iterations before TE graph capture
    # Model terms switched off (names in ADDED_TERMS), so a reviewer can see what each term adds
    # (bench/plan_accuracy.py); empty in every plan.
    without: frozenset[str] = frozenset()


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
def _rank_chunks(kinds: tuple[str, ...], pp: int, vpp: int, rank: int) -> tuple[tuple[str, ...], ...]:
    """The layers of each model chunk pipeline rank ``rank`` holds, in order (chunk c sits on rank c % pp)."""
    chunks = pp * vpp
    return tuple(kinds[round(c * len(kinds) / chunks):round((c + 1) * len(kinds) / chunks)]
                 for c in range(rank, chunks, pp))


@functools.lru_cache(maxsize=4096)
def _rank_layers(kinds: tuple[str, ...], pp: int, vpp: int, rank: int) -> tuple[tuple[str, int], ...]:
    counts: dict[str, int] = {}
    for chunk in _rank_chunks(kinds, pp, vpp, rank):
        for kind in chunk:
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


def stage_params(s: Shape, lay: Layout, first: bool, last: bool, rank: int | None = None) -> tuple[float, float, float]:
    """(transformer-layer params, embedding/output params, expert params) on one GPU of pipeline rank ``rank``
    (default: the first stage when ``first``, else the last)."""
    rank = (0 if first else lay.pp - 1) if rank is None else rank
    dense = expert = 0.0
    for kind, count in rank_layers(s, lay, rank).items():
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
        # The fused attention kernel keeps its bf16 output for its own backward. linear_proj keeps that same
        # tensor as its input when it computes a bf16 weight gradient (its own, or an adapter's); under FP8 it
        # keeps a quantized copy instead. core_attn recompute checkpoints the kernel with only q, k, v saved
        # (attention.py _checkpointed_attention_forward -> random.py CheckpointFunction save_for_backward(*args)),
        # so the kernel's copy is then dropped unless linear_proj holds the same tensor.
        out = BF16 * s.heads * (s.v_head_dim or s.head_dim) / t
        if (keeps_input("linear_proj") and (frozen or not st.fp8)) or "core_attn_output" in st.without:
            terms["attention_output"] = out
        else:
            terms["attention_kernel_output"] = out
        if st.fp8 and not frozen:
            terms["attention_output_fp8"] = FP8 * s.heads * (s.v_head_dim or s.head_dim) / t
        lora_gathered("linear_qkv")
    if "mlp" in blocks:
        if keeps_input("linear_fc1"):
            terms["mlp_layernorm_output"] = ln_out * s.hidden / sp_div
        terms["mlp_fc1_output"] = BF16 * (2 if s.gated else 1) * s.ffn / t
        if s.gated and not st.swiglu_fused:
            # unfused SwiGLU is silu(a) * (b + glu_linear_offset) (mlp.py glu): autograd keeps silu(a) for the
            # product's backward, and b + offset too, a new tensor (b is a view of FC1's output, the offset a
            # Python float: the sum is materialized even at 0.0); a clamped a (activation_func_clamp_value) is
            # a new tensor that silu keeps as its input
            terms["mlp_silu_output"] = BF16 * s.ffn / t
            if "glu_linear_copy" not in st.without:
                terms["mlp_glu_linear_input"] = BF16 * s.ffn / t
                if st.glu_clamped:
                    terms["mlp_glu_clamped_input"] = BF16 * s.ffn / t
        if keeps_input("linear_fc2"):
            terms["mlp_act_output"] = (BF16 if frozen else gemm_in) * s.ffn / t
        lora_gathered("linear_fc1")
    if "moe" in blocks:
        # Each rank routes its own sequence-local tokens (megatron-core needs SP with TP for MoE) topk times.
        # Expert-TP all-gathers the dispatched tokens across its group and splits the FFN: the expert input
        # grows ETP-fold, the FFN activations per rank stay the same (token_dispatcher.py, alltoall).
        routed = s.topk / sp_div * st.moe_load
        # MoE layers have a separate (unfused) pre-MLP norm; the router's gating function saves its output
        # whether or not the router trains (moe_utils.py RouterGatingLinearFunction)
        terms["moe_layernorm_output"] = BF16 * s.hidden / sp_div
        terms["moe_router"] = FP32 * s.experts / sp_div
        if keeps_input("linear_fc1"):  # grouped GEMMs keep inputs only for a weight gradient (grouped_linear.py)
            terms["moe_permuted_input"] = routed * lay.etp * BF16 * s.hidden
        terms["moe_fc1_output"] = routed * BF16 * (2 if s.gated else 1) * s.moe_ffn
        if s.gated and not st.swiglu_fused:
            terms["moe_silu_output"] = routed * BF16 * s.moe_ffn
            if "glu_linear_copy" not in st.without:  # experts.py bias_act_func glu: as the dense MLP's
                terms["moe_glu_linear_input"] = routed * BF16 * s.moe_ffn
                if st.glu_clamped:
                    terms["moe_glu_clamped_input"] = routed * BF16 * s.moe_ffn
        if st.moe_probs_mul and "glu_linear_copy" not in st.without:
            # without the fused weighted activation the expert output of the activation is multiplied by the
            # routing probabilities afterwards (experts.py bias_act_func: intermediate * permuted_probs), and that
            # product keeps its bf16 input for the probabilities' gradient
            terms["moe_probs_mul_input"] = routed * BF16 * s.moe_ffn
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
    "core_attn": ("attention_softmax_stats", "attention_kernel_output"),
    # the MLP checkpoint (TE: the pre-MLP norm is fused into FC1) keeps only its input
    "mlp": ("mlp_layernorm_output", "mlp_fc1_output", "mlp_silu_output", "mlp_glu_linear_input",
            "mlp_glu_clamped_input", "mlp_act_output", "lora_a_gathered_input_linear_fc1"),
    # "layernorm" checkpoints only norms that are separate modules: with TE's fused norm+GEMM the input norm is
    # an IdentityOp and is skipped (transformer_layer.py: recompute_input_layernorm); MoE's pre-MLP norm is separate
    "layernorm": ("moe_layernorm_output",),
    "moe_act": ("moe_silu_output", "moe_glu_linear_input", "moe_glu_clamped_input", "moe_probs_mul_input",
                "moe_act_output"),
    # The MoE checkpoint's saved input is the pre-MLP norm output (moe/moe_layer.py: tensor_parallel.checkpoint(
    # custom_forward, False, hidden_states, ...)): it stays unless "layernorm" drops it as well.
    "moe": ("moe_permuted_input", "moe_fc1_output", "moe_silu_output", "moe_glu_linear_input",
            "moe_glu_clamped_input", "moe_probs_mul_input", "moe_act_output", "moe_router", "moe_unpermute_input",
            "shared_expert"),
    "shared_experts": ("shared_expert",),
    "mla_up_proj": ("attention_qkv",),
}


# CUDA graph module -> the activation terms a captured graph of that scope keeps inside its private memory pool.
# Everything a graph saves is written by replay into pool memory the caching allocator has already handed to
# the graph, so it is reserved but not counted as allocated (torch.cuda.graphs: private mempools; megatron-core
# transformer/cuda_graphs.py captures the scopes, transformer_layer.py _get_submodules_under_cudagraphs).
GRAPH_SCOPE_TERMS = {
    "attn": ("attn_layernorm_input", "attention_layernorm_output", "attention_qkv", "attention_qk_norm_inputs",
             "attention_softmax_stats", "attention_output", "attention_kernel_output", "attention_output_fp8",
             "mla_up_proj_inputs", "lora_a_gathered_input_linear_qkv"),
    "mlp": ("mlp_layernorm_input", "mlp_layernorm_output", "mlp_fc1_output", "mlp_silu_output",
            "mlp_glu_linear_input", "mlp_glu_clamped_input", "mlp_act_output", "lora_a_gathered_input_linear_fc1"),
    "moe": ("moe_layernorm_input", "moe_layernorm_output", "moe_permuted_input", "moe_fc1_output",
            "moe_silu_output", "moe_glu_linear_input", "moe_glu_clamped_input", "moe_probs_mul_input",
            "moe_act_output", "moe_router", "moe_unpermute_input", "shared_expert"),
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
    selected parts of the layer, in order). Its saved activations go to the pool. ``static`` is its static
    input (_get_layer_static_inputs: the bf16 hidden state, and for attention the bool mask mbs x s/cp x s) plus
    its static output; layer_graph_buffers splits the two. The first graphed block reads the static input
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


def layer_graph_buffers(s: Shape, lay: Layout, st: Settings, kind: str) -> tuple[float, float]:
    """(static input, static output) bytes of one graphed layer of ``kind`` per microbatch; (0, 0) when eager.

    The static input is megatron-core's sample argument (module.py get_layer_static_inputs: a torch.ones
    hidden state, plus the attention mask for attention graphs), allocated before capture and written by
    every replay (TE graph.py Graphed.forward: static_input_surface[i].copy_(inputs[i])); megatron-core reuses
    one once its microbatch's backward is captured (cuda_graphs.py _get_sample_arguments), so there is one per
    in-flight microbatch, allocated in every phase. The static output is allocated while capturing; TE then
    weak-references it once its backward graph exists (graph.py, _reuse_graph_input_output_buffers, which
    megatron-core passes for TE >= 2.7: cuda_graphs.py), so in replay it is pool memory, as is the saved input
    of whatever eager norm reads it next (see graph_outputs_read_eagerly).
    """
    if not graphed_blocks(kind, st.graph_scopes):
        return 0.0, 0.0
    hidden = BF16 * s.hidden / (lay.tp if lay.sp else 1) * _tokens(lay)
    static_in = hidden + (1.0 * lay.seq * _tokens(lay) if "attn" in graphed_blocks(kind, st.graph_scopes) else 0.0)
    return static_in, hidden


def graph_outputs_read_eagerly(s: Shape, lay: Layout, st: Settings, rank: int) -> int:
    """How many graphed layers per microbatch on pipeline rank ``rank`` hand their output to an eager norm.

    That norm saves its input for its backward, and the input is the graph's static output, which replay
    writes into pool memory the allocator does not count (layer_graph_buffers). The norm is the next block of
    the same layer, or the first block of the next layer of the same model chunk when that block is eager; a
    chunk's last layer hands its output to the next stage instead. A moe_router graph covers only part of its
    block (the dispatcher reads its outputs), so it is not counted.
    """
    n = 0
    for chunk in _rank_chunks(layer_kinds(s), lay.pp, lay.vpp, rank):
        for j, kind in enumerate(chunk):
            graphed = graphed_blocks(kind, st.graph_scopes)
            blocks = kind.split("+")
            whole = [b for b, module in graphed.items() if module == b]
            if not whole or len(whole) != len(graphed):
                continue
            last = max(blocks.index(b) for b in whole)
            if last + 1 < len(blocks):
                n += 1
            elif j + 1 < len(chunk) and chunk[j + 1].split("+")[0] not in graphed_blocks(chunk[j + 1],
                                                                                         st.graph_scopes):
                n += 1
    return n


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
    persistent: float = 0.0   # allocated in every phase, the optimizer step included (graph static inputs)


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
    persistent = 0.0
    if graphed:
        # Graphed scopes keep their activations in the graphs' private pool: allocated while the graphs are
        # captured (after the warm-up steps, in pipeline order, no eager activations alive), reserved-only in
        # replay. Static inputs and outputs are allocated while capturing; in replay only the static inputs are
        # (layer_graph_buffers), one per in-flight microbatch, and they stay allocated through the optimizer step.
        parts = {kind: layer_graph_parts(s, lay, st, kind) for kind in counts}
        eager, inside, static = (mean(lambda kind, i=i: parts[kind][i]) for i in range(3))
        capture = per_stage * (inside + static) * mbs_alive
        buffers = {kind: layer_graph_buffers(s, lay, st, kind) for kind in counts}
        static_in, static_out = (mean(lambda kind, i=i: buffers[kind][i]) for i in range(2))
        if "graph_outputs_in_pool" in st.without:
            per_layer = eager + static
            pool = per_stage * inside * mbs_alive
            detail.append(("CUDA graph static inputs and outputs", per_stage * static * mbs_alive))
        else:
            read = graph_outputs_read_eagerly(s, lay, st, rank) * hidden_local / per_stage
            per_layer = eager - read + static_in
            pool = per_stage * (inside + static_out) * mbs_alive
            detail.append(("CUDA graph static inputs", per_stage * static_in * mbs_alive))
        if "graph_static_inputs_at_step" not in st.without:
            persistent = per_stage * static_in * mbs_alive
        detail.insert(0, ("CUDA graph pool (reserved; allocated only while capturing)", pool))
    if st.recompute == "full":
        # Only each checkpointed group's input survives; one group is re-materialized at a time.
        boundary = 2 * BF16 * s.hidden / (lay.tp if lay.sp else 1) * lay.seq * lay.mbs / lay.cp
        n = max(1, st.recompute_layers)
        working = n * full_layer   # uniform: each group of n layers is re-materialized at once
        if st.recompute_method == "block":
            ckpt = min(per_stage / lay.vpp, n) * lay.vpp
            kept = (per_stage - ckpt) * per_layer + ckpt * boundary
            if "block_recompute_one_layer" not in st.without:
                working = full_layer   # block checkpoints (and replays) its first n layers one at a time
        else:
            kept = per_stage / n * boundary
        acts = kept * mbs_alive + working
        detail.append(("full recompute working set", working))
    else:
        layers_on_gpu = per_stage
        if st.cpu_offload_layers:
            layers_on_gpu -= min(per_stage, st.cpu_offload_layers) - (1 if st.cpu_offload_double_buffer else 0)
        acts = layers_on_gpu * per_layer * mbs_alive
    if rank == 0:
        acts += hidden_local * mbs_alive  # embedding output
    if rank == lay.pp - 1:
        per_logit = st.logits_bytes
        if "te_cross_entropy_in_place" in st.without and st.cross_entropy_impl == "te":
            per_logit = BF16 + FP32
        logits = per_logit * s.vocab / lay.tp * tokens
        detail.append(("loss: logits and their fp32 softmax/gradient (last stage)", logits))
        acts += logits
        if st.deferred_wgrad_microbatches:
            # defer_embedding_wgrad_compute: the output layer keeps each microbatch's bf16 dY (tokens x vocab/tp)
            # and its sequence-local input until the pipeline flush (megatron-core tensor_parallel/layers.py)
            per_mb = BF16 * tokens * s.vocab / lay.tp + hidden_local
            deferred = st.deferred_wgrad_microbatches * per_mb
            detail.append(("deferred output-layer wgrad inputs", deferred))
            acts += deferred
    return StageActivations(acts, capture, pool, tuple(detail), persistent)


# ----------------------------------------------------------------------------- the most-loaded GPU
def optimizer_step_buffers(s: Shape, lay: Layout, st: Settings, first: bool, last: bool,
                           rank: int | None = None) -> float:
    """fp32 gradient copies the distributed optimizer makes at its step when gradients are kept in bf16
    (distrib_optimizer.py _copy_model_grads_to_main_grads: shard_main_param.grad = shard_model_grad.float()).
    They stay allocated until the next iteration's zero_grad (Bridge train.py:866-869)."""
    if st.grad_bytes >= FP32 or not st.master_bytes or st.lora_rank:
        return 0.0  # fp32 gradients are used in place (.float() is a no-op); adapters only: negligible
    if st.fsdp is not None:
        return 0.0  # Megatron FSDP owns its main-grad buffers: _copy_model_grads_to_main_grads returns early
    upcasts = st.step_upcasts_grads
    if "precision_aware_grad_upcast" in st.without:
        upcasts = upcasts and not st.precision_aware
    if not upcasts:
        # decoupled_grad is the bf16 shard itself; under CPU offload the hybrid optimizer upcasts the GPU part
        # for its fp32 masters (fp32_param.grad = grad.to(fp32), hybrid_optimizer.py _set_sub_optimizer_grads)
        fraction = 1.0 - st.optimizer_offload if st.optimizer_offload else 0.0
    else:
        # every shard is upcast, offloaded or not: the hybrid optimizer copies the offloaded ones to the CPU from
        # this fp32 gradient (cpu_copy_map_grad[param].copy_(gpu_param.grad))
        fraction = 1.0
    if not fraction:
        return 0.0
    layer_params, embed, expert = stage_params(s, lay, first, last, rank)
    shards, expert_shards = optimizer_shards(lay, st)
    return FP32 * ((layer_params + embed) / shards + expert / expert_shards) * fraction


def fp8_master_cast_copies(s: Shape, lay: Layout, st: Settings, first: bool, last: bool,
                           rank: int | None = None) -> float:
    """The params-dtype casts of the FP8 weights' fp32 master shards, alive together at the end of the step.

    With FP8 primary weights (fp8_param_gather) the distributed optimizer's step ends in quantize_param_shard
    (distrib_optimizer.py:2815,2837), TE's quantize_master_weights, which first casts each master shard to the
    weight's nominal dtype and appends it to a per-recipe list (TE v2.17.1 tensor/utils.py:139-167), and only
    after the loop quantizes the list into the FP8 weights (:171-181). The step's fp32 gradient copies are still
    allocated then (optimizer.py:786,808: the inner step, then the copy to the model params). Only the layer
    GEMM weights are FP8 (embeddings and the output layer stay bf16: stage_params' embed)."""
    if not st.fp8_cast_copy_bytes or st.lora_rank or "fp8_master_cast_copies" in st.without:
        return 0.0
    layer_params, _, expert = stage_params(s, lay, first, last, rank)
    shards, expert_shards = optimizer_shards(lay, st)
    return st.fp8_cast_copy_bytes * (layer_params / shards + expert / expert_shards)


def largest_layer_params(s: Shape, lay: Layout, rank: int) -> float:
    """Parameters of the largest layer pipeline rank ``rank`` holds, on one GPU (dense + its experts)."""
    return max((sum(sum(_block_params(s, lay, block)) for block in kind.split("+"))
                for kind in rank_layers(s, lay, rank)), default=0.0)


def communication_buffers(s: Shape, lay: Layout, st: Settings, rank: int, params: float) -> float:
    """Transient unsharded copies the data-parallel communication keeps beside the sharded state, and
    megatron-core's global memory buffer on the last stage."""
    if st.fsdp is not None:
        # Megatron FSDP: each layer is one FSDP unit (mcore_fsdp_adapter.py fsdp_unit_modules: TransformerLayer,
        # MoETransformerLayer, MambaLayer). Sharded parameters are all-gathered per unit, the next unit prefetched
        # (megatron_fsdp.py prefetch=True); sharded gradients are reduce-scattered from one unsharded unit.
        (p_shard, _), (g_shard, _) = fsdp_shards(lay, st)
        unit = largest_layer_params(s, lay, rank)
        gathered = 2 * unit * (st.param_bytes + st.fp8_weight_copy_bytes) if p_shard > 1 else 0.0
        unsharded_grads = unit * st.grad_bytes if g_shard > 1 and not st.lora_rank else 0.0
        return gathered + unsharded_grads + global_memory_buffer(s, lay, st, rank)
    out = global_memory_buffer(s, lay, st, rank)
    if st.dist_optimizer and lay.dp * lay.cp > 1:
        # overlap_param_gather keeps one bucket's all-gathered params (Megatron bucket_size 40M params)
        out += min(40e6, (params / st.param_bytes)) * st.param_bytes
    return out


def global_memory_buffer(s: Shape, lay: Layout, st: Settings, rank: int) -> float:
    """megatron-core's GlobalMemoryBuffer on the last stage under SP: the trainable output layer (a megatron-core,
    not TE, ColumnParallelLinear) all-gathers its sequence-parallel input into a buffer that lives for the rest
    of the job (tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication:
    get_global_memory_buffer().get_tensor(dim_size, input.dtype, "mpu"), full sequence x hidden, bf16); the
    deferred output-layer wgrad drain gathers into a second one ("mpu_0", utils.py drain_embedding_wgrad_compute).
    A frozen output layer (LoRA) gathers into a fresh tensor instead (layers.py linear_with_frozen_weight)."""
    if "global_memory_buffer" in st.without or not lay.sp or rank != lay.pp - 1 or st.lora_rank or not s.vocab:
        return 0.0
    full = BF16 * s.hidden * _tokens(lay)   # the gathered sequence: s x mbs / cp tokens x hidden
    return full * (2 if st.deferred_wgrad_microbatches else 1)


PHASES = ("steady 1F1B", "CUDA graph capture", "optimizer step", "eager warm-up")
# The phases every training iteration goes through (the headline peak); the others happen once, before training
# (GRAPH_WARMUP), and bound the activations' range (memory/ranges.py).
HEADLINE_PHASES = ("steady 1F1B", "optimizer step")
ONE_TIME_PHASES = ("eager warm-up", "CUDA graph capture")


def _graphed(st: Settings) -> bool:
    """Whether per-layer CUDA graphs are captured and replayed (as stage_activations models them)."""
    return bool(st.graph_scopes) and st.recompute != "full" and not st.cpu_offload_layers


def phase_breakdowns(s: Shape, lay: Layout, st: Settings, rank: int) -> dict[str, Breakdown]:
    """Pipeline rank ``rank`` in each phase (PHASES), every component on one GPU.

    Every iteration: the 1F1B steady state (the last stage's loss buffers included) and the optimizer step (only
    the allocations that outlive the backward, the graphs' static inputs, beside the fp32 gradient copies and the
    FP8 master casts). Once, before training, with CUDA graphs (GRAPH_WARMUP): the eager warm-up iterations (every
    activation allocated; the Adam moments only from the second iteration on) and the capture (the graphed scopes'
    activations for every in-flight microbatch, beside the last warm-up step's fp32 gradient copies, or before any
    step without the moments). Without graphs the one-time phases hold the model state only."""
    return _phases(s, lay, st, rank, one_time=True)


def _phases(s: Shape, lay: Layout, st: Settings, rank: int, one_time: bool) -> dict[str, Breakdown]:
    """phase_breakdowns; without ``one_time`` the eager warm-up is not re-planned (the headline needs only
    HEADLINE_PHASES, and the search plans thousands of layouts)."""
    first, last = rank == 0, rank == lay.pp - 1
    p, g, o = model_state(s, lay, st, first=first, last=last, rank=rank)
    acts = stage_activations(s, lay, st, rank)
    other = communication_buffers(s, lay, st, rank, p)
    step = optimizer_step_buffers(s, lay, st, first, last, rank)
    casts = fp8_master_cast_copies(s, lay, st, first, last, rank)
    detail = acts.detail + ((("fp32 gradient copies at the optimizer step", step),) if step else ())
    if casts:
        detail += (("FP8 master weights cast to the params dtype at the optimizer step", casts),)
    if st.fsdp is not None and other:
        detail += (("Megatron FSDP gathered parameters and unsharded gradients", other),)
    elif (gathered := global_memory_buffer(s, lay, st, rank)):
        detail += (("megatron-core global memory buffer (output layer SP gather)", gathered),)
    resident = p + g + o + other + acts.steady + acts.pool if acts.pool else 0.0
    o_no_moments = optimizer_before_first_step(o, st)
    values = {"steady 1F1B": (o, acts.steady, other), "optimizer step": (o, acts.persistent, other + step + casts),
              "CUDA graph capture": (o, 0.0, other), "eager warm-up": (o, 0.0, other)}
    warmup = st.graph_warmup_steps
    if _graphed(st) and "graph_capture_after_warmup" in st.without:
        values["CUDA graph capture"] = (o, acts.capture, other)
    elif _graphed(st):
        # captured before iteration W + 1's zero_grad: the W-th step's fp32 gradient copies are still allocated;
        # with W = 0 before the first step, when the moments do not exist yet
        values["CUDA graph capture"] = (o, acts.capture, other + step) if warmup else (o_no_moments, acts.capture,
                                                                                          other)
        if warmup and one_time:
            eager = stage_activations(s, lay, replace(st, graph_scopes=()), rank).steady
            values["eager warm-up"] = (o if warmup > 1 else o_no_moments, eager, other)
    return {phase: Breakdown(p, g, opt, a, x, detail, rank, phase, resident)
            for phase, (opt, a, x) in values.items()}


def stage_peak(s: Shape, lay: Layout, st: Settings, rank: int) -> Breakdown:
    """Pipeline rank ``rank`` at its peak in training: the HEADLINE_PHASES phase whose allocated total is largest
    (with graph_capture_after_warmup switched off, the capture counts too, as before that term)."""
    phases = _phases(s, lay, st, rank, one_time=False)
    names = HEADLINE_PHASES
    if "graph_capture_after_warmup" in st.without:
        names = ("steady 1F1B", "CUDA graph capture", "optimizer step")
    return max((phases[n] for n in names), key=lambda b: b.total)


def one_time_peak(s: Shape, lay: Layout, st: Settings) -> Breakdown | None:
    """The largest one-time phase before training (ONE_TIME_PHASES) over every pipeline rank; None without CUDA
    graphs (then there is none beyond the steady state)."""
    if not _graphed(st):
        return None
    return max((phase_breakdowns(s, lay, st, r)[n] for r in range(lay.pp) for n in ONE_TIME_PHASES),
               key=lambda b: b.total)


def stage_breakdowns(s: Shape, lay: Layout, st: Settings) -> tuple[Breakdown, ...]:
    """Every pipeline rank at its peak (index = pipeline rank): first, middle and last stages, each with its
    components, the phase it peaks in and, under CUDA graphs, what the allocator holds with the graphs' pool."""
    return tuple(stage_peak(s, lay, st, rank) for rank in range(lay.pp))


def reported_phases(s: Shape, lay: Layout, st: Settings, rank: int, iteration: int) -> dict[str, Breakdown]:
    """The phases pipeline rank ``rank`` has been through by the end of training iteration ``iteration`` (1-based):
    what a memory line printed then can show, since torch's max allocated only grows (nothing in Bridge 0.6.2 or
    megatron-core 0.19.2 calls reset_peak_memory_stats). Bridge prints its memory report after iterations 1 and 2
    only (training/utils/train_utils.py:1226-1239), so the lines a job log holds are usually these.

    With CUDA graphs, iterations 1 .. cuda_graph_warmup_steps (W) run eager and the capture comes before iteration
    W + 1 (training/train.py:429-438): up to W a line shows the eager forward/backward and the eager step (the model
    without graphs: no static inputs yet), after it every phase. Without graphs the phases are the headline ones.
    After iteration 1 the forward and backward ran before the Adam moments existed (created at the first step:
    TE v2.17.1 optimizers/fused_adam.py:615-616); the step itself already holds them."""
    if iteration < 1:
        raise ValueError(f"iteration must be >= 1, got {iteration}")
    eager_only = _graphed(st) and iteration <= st.graph_warmup_steps
    if eager_only:
        eager = _phases(s, lay, replace(st, graph_scopes=()), rank, one_time=False)
        out = {"eager warm-up": replace(eager["steady 1F1B"], phase="eager warm-up", resident=0.0),
               "optimizer step": replace(eager["optimizer step"], phase="eager optimizer step", resident=0.0)}
    elif _graphed(st):
        out = dict(phase_breakdowns(s, lay, st, rank))
    else:
        out = {name: b for name, b in _phases(s, lay, st, rank, one_time=False).items() if name in HEADLINE_PHASES}
    if iteration == 1:
        forward = "eager warm-up" if eager_only else "steady 1F1B"
        out[forward] = replace(out[forward], optimizer=optimizer_before_first_step(out[forward].optimizer, st))
    return out


# Bridge prints its memory report after these training iterations (training/utils/train_utils.py:1226-1239: the
# flag is cleared once an iteration after the first has been reported)
REPORTED_ITERATIONS = (1, 2)


def memory_lines(s: Shape, lay: Layout, st: Settings) -> tuple[tuple[int, tuple[float, ...]], ...]:
    """Plan.memory_lines: the max allocated each pipeline rank's line will show after each REPORTED_ITERATIONS."""
    return tuple((it, tuple(b.total for b in reported_breakdowns(s, lay, st, it))) for it in REPORTED_ITERATIONS)


def reported_breakdowns(s: Shape, lay: Layout, st: Settings, iteration: int) -> tuple[Breakdown, ...]:
    """Every pipeline rank as its memory line after training iteration ``iteration`` shows it (reported_phases):
    the largest allocated total of the phases it has been through (index = pipeline rank)."""
    return tuple(max(reported_phases(s, lay, st, rank, iteration).values(), key=lambda b: b.total)
                 for rank in range(lay.pp))


def _candidate_ranks(s: Shape, lay: Layout) -> list[int]:
    """The ranks that can be the most loaded: the first and last, and any middle rank whose layers differ
    from theirs (an even split of a uniform stack gives middle ranks fewer in-flight microbatches than the
    first and neither embedding nor output layer)."""
    ends = sorted({0, lay.pp - 1})
    seen = {_rank_layers(layer_kinds(s), lay.pp, lay.vpp, r) for r in ends}
    return ends + [r for r in range(1, lay.pp - 1) if _rank_layers(layer_kinds(s), lay.pp, lay.vpp, r) not in seen]


def estimate(s: Shape, lay: Layout, st: Settings) -> Breakdown:
    """The most-loaded GPU at its peak: over the pipeline ranks that can be the most loaded (_candidate_ranks),
    the larger of the steady 1F1B state and the optimizer step (each on top of parameters, gradients, optimizer;
    the one-time phases before training are one_time_peak's); judged on the footprint (with CUDA graphs,
    allocated tensors plus the pool)."""
    best: Breakdown | None = None
    for rank in _candidate_ranks(s, lay):
        b = stage_peak(s, lay, st, rank)
        if best is None or b.footprint > best.footprint:
            best = b
    return best


# ----------------------------------------------------------------------------- from a Bridge config
def cross_entropy_impl(m: Any) -> str:
    """Which cross entropy the last stage runs (language_module.py compute_language_model_loss)."""
    if not bool(getattr(m, "cross_entropy_loss_fusion", False)):
        return "unfused"
    return "te" if str(getattr(m, "cross_entropy_fusion_impl", "native")) == "te" else "native"


def loss_bytes(m: Any) -> int:
    """Bytes per logit element at the loss's peak.

    Unfused megatron-core cross entropy (tensor_parallel/cross_entropy.py): the bf16 logits plus their fp32 upcast,
    turned into the softmax in place. TE's kernel (cross_entropy_fusion_impl "te") writes the gradient into the
    bf16 logits themselves and saves that tensor (TE v2.17.1 pytorch/cross_entropy.py CrossEntropyFunction.forward
    :53-62, common/triton/cross_entropy.py cross_entropy_kernel :190 tl.store(X_ptr ...)): 2 bytes, plus fp32
    row statistics (3 per token). The torch.compile'd "native" fusion (fusions/fused_cross_entropy.py) keeps the
    fp32 softmax, and its compiled calculate_gradients allocates a fresh fp32 buffer and the bf16 result beside
    it: 4 + 4 + 2 bytes (inductor's generated code for it, checked with torch 2.14).
    """
    impl = cross_entropy_impl(m)
    if impl == "native":
        return FP32 + FP32 + BF16
    return BF16 if impl == "te" else BF16 + FP32


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


def _moe_weights_activation_separately(m: Any) -> bool:
    """Whether the experts multiply their activation output by the routing probabilities as a separate autograd op
    (experts.py bias_act_func): not with the fused weighted kernels (bias_activation_fusion without GLU
    interleaving, or the fused weighted squared ReLU), and not when the probabilities were applied to the input
    (they are then ones that need no gradient)."""
    if bool(getattr(m, "moe_apply_probs_on_input", False)):
        return False
    if bool(getattr(m, "bias_activation_fusion", True)) and getattr(m, "moe_mlp_glu_interleave_size", None) is None:
        return False
    act = getattr(getattr(m, "activation_func", None), "__name__", "")
    return not (act == "squared_relu" and bool(getattr(m, "use_fused_weighted_squared_relu", False)))


def _capacity_factor(m: Any) -> float | None:
    """moe_expert_capacity_factor when tokens beyond it are dropped (None: dropless routing)."""
    factor = getattr(m, "moe_expert_capacity_factor", None)
    return float(factor) if factor else None


def _dtype_bytes(dtype: Any, default: int) -> int:
    name = str(dtype)
    return {"torch.float32": FP32, "torch.bfloat16": BF16, "torch.float16": BF16, "torch.uint8": FP8}.get(name, default)


def fp8_cast_copy_bytes(cfg: Any, fp8_params: bool, decoupled_grads: bool, fsdp_on: bool, mp: Any) -> int:
    """Settings.fp8_cast_copy_bytes: the params dtype's bytes when the step quantizes fp32 masters into FP8
    primary weights through TE's quantize_master_weights (fp8_master_cast_copies), else 0. That is the
    distributed optimizer's regular path with ddp.fp8_param_gather (distrib_optimizer.py:2815); not Megatron
    FSDP (its own copy_main_weights_to_model_weights), not the precision-aware path that lets FusedAdam own the
    masters (:2812-2813 returns first), not MXFP8 weights gathered through the gradient buffer
    (reuse_grad_buf_for_mxfp8_param_ag: the masters go to the param buffer instead, optimizer.py:800-806).
    fp32 params cast to themselves (Tensor.to of the same dtype returns the tensor)."""
    from ..core.paths import read
    dist = bool(getattr(cfg.optimizer, "use_distributed_optimizer", False) or read(cfg, "ddp.use_distributed_optimizer",
                                                                                   False))
    reuse = any(bool(getattr(c, "reuse_grad_buf_for_mxfp8_param_ag", False))
                for c in (mp, cfg.optimizer, getattr(cfg, "ddp", None)) if c is not None)
    if not fp8_params or not dist or fsdp_on or decoupled_grads or reuse:
        return 0
    dtype = getattr(mp, "params_dtype", None) if mp is not None else None
    dtype = dtype or getattr(cfg.model, "params_dtype", None)
    return 0 if _dtype_bytes(dtype, BF16) == FP32 else BF16


def vocab_size(cfg: Any) -> int:
    """The model's unpadded vocabulary as Bridge sets it at setup (training/setup.py:293-299,
    _validate_and_set_vocab_size :702): the tokenizer's when ``tokenizer.use_tokenizer_vocab_size`` is set or
    ``model.vocab_size`` is unset, else ``model.vocab_size``. The tokenizer's is ``tokenizer.vocab_size`` (a
    NullTokenizer's whole vocabulary, megatron-core null_tokenizer.py), or for a Hugging Face tokenizer the
    model's shipped config.json vocab_size (bridge/hf_configs); 0 if we have neither (and the recipe sets none)."""
    return model_vocab(cfg)[0]


def model_vocab(cfg: Any) -> tuple[int, bool]:
    """(unpadded vocabulary, whether Bridge pads it): setup pads a vocabulary that came from the tokenizer and
    leaves a preset model.vocab_size as it is (setup.py:702-721 returns should_pad_vocab True / False, which the
    model provider obeys: gpt_provider.py:265-270)."""
    preset = getattr(cfg.model, "vocab_size", None)
    tok = getattr(cfg, "tokenizer", None)
    if preset and not getattr(tok, "use_tokenizer_vocab_size", False):
        return int(preset), False
    return (_tokenizer_vocab(tok) or int(preset or 0)), True


def _tokenizer_vocab(tok: Any) -> int:
    """The tokenizer's vocabulary size without building it, 0 when not readable here."""
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
    vocab, pad = model_vocab(cfg)
    div = int(getattr(m, "make_vocab_size_divisible_by", 128) or 128) * m.tensor_model_parallel_size
    vocab = int(math.ceil(vocab / div) * div) if vocab and pad else vocab   # calculate_padded_vocab_size
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
    # megatron-core's use_precision_aware_optimizer_no_fp8_or_ds_fp8 (optimizer_config.py:404-411), with the
    # fp8_recipe Bridge's mixed-precision setup copies into the optimizer config (PRECISION_AWARE_PATH)
    fp8_recipe = getattr(mp, "fp8_recipe", None) if mp is not None else getattr(opt, "fp8_recipe", None)
    decoupled_grads = precision_aware and (
        _dtype_bytes(getattr(opt, "main_params_dtype", None), FP32) != FP32 or fp8_recipe in (None, "delayed")
        or bool(getattr(opt, "optimizer_cpu_offload", False)))
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
        # TE's activation module (use_te_activation_func) keeps only its input, as the fused kernel does
        swiglu_fused=bool(getattr(m, "bias_activation_fusion", True) or getattr(m, "use_te_activation_func", False)),
        glu_clamped=getattr(m, "activation_func_clamp_value", None) is not None,
        moe_probs_mul=bool(experts) and _moe_weights_activation_separately(m),
        moe_capacity_factor=_capacity_factor(m),
        moe_load=_capacity_factor(m) if _capacity_factor(m) and getattr(m, "moe_pad_expert_input_to_capacity",
                                                                          False) else 1.0,
        graph_warmup_steps=int(getattr(m, "cuda_graph_warmup_steps", 0) or 0) if scopes else 0,
        graph_scopes=scopes,
        logits_bytes=loss_bytes(m),
        cross_entropy_impl=cross_entropy_impl(m),
        step_upcasts_grads=not decoupled_grads,
        fp8_cast_copy_bytes=fp8_cast_copy_bytes(cfg, fp8_params, decoupled_grads, fsdp_on, mp),
        deferred_wgrad_microbatches=(min(limit, lay.microbatches) if limit > 0 else lay.microbatches)
        if defer and lay.pp > 1 else 0,
        state_bytes=_dtype_bytes(getattr(opt, "exp_avg_dtype", None), FP32) if precision_aware else FP32,
        master_bytes=_dtype_bytes(getattr(opt, "main_params_dtype", None), FP32) if precision_aware else FP32,
        fp8=fp8,
        lora_rank=int(getattr(peft, "dim", 0) or 0) if type(peft).__name__ in ("LoRA", "DoRA") else 0,
        lora_targets=tuple(getattr(peft, "target_modules", ()) or ()),
        lora_regather=regather)
    return shape, lay, settings


def fit_verdict(fits: bool | None, ranges: tuple[Any, ...], limit: float | None) -> tuple[str, list[str]]:
    """The fit verdict and its clauses, over memory/ranges.py Ranges: "fits", "fits unless <clause>; or <clause>" (a range whose high end passes
    the fit limit; an open range says how large its unknown may grow), "does NOT fit" (with the low-end clause of
    a range that would make it fit), or "-" without a capacity."""
    if fits is None or limit is None:
        return "-", []
    if not fits:
        rescue = [f"{r.if_low}: {r.low / 2**30:.1f} GiB" for r in ranges if r.if_low and r.low <= limit]
        return "does NOT fit" + (f" ({'; '.join(rescue)})" if rescue else ""), []
    clauses = []
    for r in ranges:
        if r.high is None and r.per_unit > 0:
            clauses.append(f"{r.unless} than {math.floor((limit - r.low) / r.per_unit):,} {r.unit}s")
        elif r.high is not None and r.high > limit and r.unless:
            clauses.append(f"{r.unless} ({r.high / 2**30:.1f} GiB)")
    return ("fits unless " + "; or ".join(clauses) if clauses else "fits"), clauses


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
    ranges: tuple[Any, ...] = ()      # memory/ranges.py Range: where the last step's peak could move
    # What the job's memory lines will show: (iteration, max allocated per pipeline rank), for the iterations Bridge
    # reports after (REPORTED_ITERATIONS; reported_breakdowns), so a log can be held against the plan line by line
    memory_lines: tuple[tuple[int, tuple[float, ...]], ...] = ()

    @property
    def total(self) -> float:
        return self.steps[-1].breakdown.total

    @property
    def limit(self) -> float | None:
        return None if self.capacity is None else self.capacity * (1 - self.margin)

    def fits(self, step: Step) -> bool | None:
        return None if self.capacity is None else step.breakdown.footprint <= self.capacity * (1 - self.margin)

    def verdict(self) -> tuple[str, list[str]]:
        """The last step's fit verdict: "fits", "fits unless ...", "does NOT fit" or "-" (memory/ranges.py)."""
        return fit_verdict(self.fits(self.steps[-1]), self.ranges, self.limit)

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
                "fit_verdict": self.verdict()[0], "fits_unless": self.verdict()[1],
                "uncertainty": [r.as_dict() for r in self.ranges],
                "memory_lines": [{"iteration": it, "max_allocated_bytes": [int(v) for v in per_rank]}
                                 for it, per_rank in self.memory_lines],
                "steps": steps, "assumptions": list(self.assumptions)}


STEP_NOTES = {"expandable_segments": "no change in allocated memory; removes fragmentation (reserved-but-unallocated)"}
