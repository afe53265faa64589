"""The plan's inputs and its result: the model's shape, the parallel layout, the settings read from a
configuration (memory/from_config.py), and one GPU's breakdown. Frozen dataclasses, bytes per element."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BF16 = 2            # bytes per bf16/fp16 element
FP32 = 4
FP8 = 1
# NVFP4 (TE v2.17.1): 4-bit E2M1 data packed two per byte (tensor/nvfp4_tensor.py convert_shape_for_fp4 :312-317;
# megatron-core fp4_utils.py get_nvfp4_rowwise_packed_shape :70-77) and one FP8 E4M3 scale (a uint8) per 16 values
# along the layout's inner dimension (get_scale_shape :249-283, constants.py:177 NVFP4_BLOCK_SCALING_SIZE = 16); the per-tensor
# FP32 amax is a few bytes per tensor. FP4: the packed data alone (the param buffer's bytes, param_and_grad_buffer.py
# :1176 nvfp4_packed_numel); FP4_LAYOUT: one layout with its scales (a GEMM input TE saves, or a weight's copy)
FP4 = 0.5
FP4_SCALES = 1 / 16
FP4_LAYOUT = FP4 + FP4_SCALES
ADAM_MOMENTS = 2    # exp_avg and exp_avg_sq


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
    mtp_layers: int = 0           # mtp_num_layers: multi-token prediction layers on the last pipeline stage
    # What only a per-tensor count needs (memory/optimizers.py): LayerNorm's bias beside each norm weight, the
    # linear layers' biases (add_bias_linear), learned absolute position embeddings (rows; 0: none)
    norm_bias: bool = False
    linear_bias: bool = False
    position_embeddings: int = 0
    # The blocks of one MTP depth's layer: a hybrid pattern's part after "/" ("*E": attn, moe); empty: the
    # model's last layer kind. mtp_shared (mtp_use_repeated_layer): one MTP layer's parameters run at every depth.
    mtp_blocks: tuple[str, ...] = ()
    mtp_shared: bool = False
    # attention_output_gate: softmax attention's QKV projection also yields a per-head gate (Qwen3-Next, Qwen3.5)
    attn_gate: bool = False
    # gated delta net layers ("gdn", memory/variants.py): linear_num_key_heads / linear_num_value_heads,
    # linear_key_head_dim / linear_value_head_dim, linear_conv_kernel_dim
    gdn_key_heads: int = 0
    gdn_value_heads: int = 0
    gdn_key_dim: int = 0
    gdn_value_dim: int = 0
    gdn_conv: int = 4
    # DeepSeek sparse attention layers ("dsa" / "dsa_shared"): the indexer's heads, head dim and top-k, and
    # dsa_indexer_topk_freq (layers that reuse a top-k are "dsa_shared")
    dsa_heads: int = 0
    dsa_head_dim: int = 0
    dsa_topk: int = 0
    dsa_topk_freq: int = 1
    # whether DSA's absorbed MLA builds its q and kv norms: in a GPT model with qk_layernorm
    # (experimental_attention_variant_module_specs.py get_dsa_module_spec_for_backend :109-111); a hybrid stack's
    # "D" builds IdentityOp for both (hybrid_layer_specs.py dsa_layer :165-166)
    dsa_qkv_norms: bool = False
    # moe_shared_expert_gate: one sigmoid gate per token scales the shared expert's output (moe/shared_experts.py)
    shared_gate: bool = False
    # moe_latent_size: the routed experts work in this width, between a hidden -> latent and a latent -> hidden
    # projection (transformer/moe/moe_layer.py fc1/fc2_latent_proj); 0: none, the experts work in the hidden size
    moe_latent: int = 0
    # With FP8: how many of the first and of the last main-decoder layers are built and run outside FP8
    # (first_last_layers_bf16, num_layers_at_start/end_in_bf16: fp8_utils.py is_first_last_bf16_layer); (0, 0)
    # without FP8, where they change nothing. pipeline.layer_kinds marks those layers (BF16_LAYER).
    bf16_layers: tuple[int, int] = (0, 0)
    # A vision-language model's vision encoder and projector on the first pipeline stage (memory/vision.py
    # VisionTower); None: a language model alone
    vision: Any = None
    # Qwen3VLSelfAttention (Qwen3-VL, Qwen3.5-VL) rotates q and k with per-token absolute frequencies outside TE's
    # fused RoPE, saving four cos/sin tables per attention layer in this many bytes per element (0: fused RoPE)
    rope_tables_bytes: int = 0


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
    # Decoder layers of each model chunk in chunk order (chunk c on pipeline rank c % pp), when they are not split
    # evenly: pipeline_model_parallel_layout, num_layers_in_first/last_pipeline_stage, or the embedding / loss
    # counted as a layer (from_config.chunk_layers); empty: the even split
    chunk_layers: tuple[int, ...] = ()
    # microbatch_group_size_per_vp_stage: the microbatches each virtual stage runs in a row in the interleaved
    # schedule; 0: megatron-core's default, the pipeline size (model_parallel_config.py:567-568)
    vp_group: int = 0

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
    param_bytes: float = BF16                 # FP4 with NVFP4 primary weights (fp4_param): the packed data
    state_bytes: int = FP32                   # exp_avg / exp_avg_sq (bf16 with the precision-aware optimizer)
    master_bytes: int = FP32
    # fp8: the GEMMs run under TE's quantized autocast, FP8 or NVFP4 alike: megatron-core gives both the same
    # per-layer context (transformer_block.py:340-350, :603-617, :648-660; fp4_utils.py get_fp4_context :247-292
    # enters fp8_autocast with the NVFP4BlockScaling recipe), first/last bf16 layers included. fp4: that recipe is
    # NVFP4 (model.fp4): quant_bytes is then FP4_LAYOUT, else FP8 (bytes per element of one saved GEMM input)
    fp8: bool = False
    fp4: bool = False
    quant_bytes: float = FP8
    lora_rank: int = 0                        # 0: full training
    lora_targets: tuple[str, ...] = ()
    lora_regather: tuple[str, ...] = ()       # targets that really re-gather (see rules.regather_fallbacks)
    # freeze_language_model: the language model's parameters have requires_grad False (a VL provider's freeze),
    # so they keep no gradient, main-grad buffer or optimizer state, and its GEMMs no input for a weight gradient
    frozen_lm: bool = False
    # Extra bytes per transformer-layer GEMM weight for a second FP8 layout kept between steps (see weight_copy_bytes)
    fp8_weight_copy_bytes: float = 0
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
    # fp8_output_proj under MXFP8 (fp8_utils.py is_mxfp8_output_proj_active :692-707): the output layer is TE's
    # TELMHeadColumnParallelLinear run under the MXFP8 autocast (extensions/transformer_engine.py :1512-1640)
    output_proj_fp8: bool = False
    output_proj_copy_bytes: float = 0.0       # its weight's MXFP8 workspace (from_config.output_proj_copy_bytes)
    precision_aware: bool = False             # optimizer.use_precision_aware_optimizer (see optimizer_gpu_bytes)
    optimizer_instances: int = 1              # ddp.num_distributed_optimizer_instances (see data_parallel_shards)
    fsdp: str | None = None                   # Megatron FSDP on: ddp.data_parallel_sharding_strategy
    fsdp_outer_optim: bool = False            # ddp.outer_dp_sharding_strategy == "optim" (HSDP across instances)
    shared_expert_overlap: bool = False       # moe_shared_expert_overlap: the shared expert is outside router graphs
    glu_clamped: bool = False                 # activation_func_clamp_value set: the unfused GLU clamps x_glu first
    moe_load: float = 1.0                     # tokens on this rank's experts / a balanced load (see moe_load_range)
    moe_capacity_factor: float | None = None  # moe_expert_capacity_factor (None: dropless)
    # moe_expert_rank_capacity_factor with HybridEP: a static per-rank budget of topk x factor x tokens the experts
    # run on, tokens beyond it dropped (None: none; Settings.moe_load is then that factor)
    moe_rank_capacity: float | None = None
    moe_probs_mul: bool = False               # experts weight their activation output by the probs separately
    graph_warmup_steps: int = 0               # cuda_graph_warmup_steps: eager iterations before TE graph capture
    fine_grained_offload: Any = None          # levers.FineGrainedOffload (model.fine_grained_activation_offloading)
    # Bytes of the model's compute dtype (params_dtype): 2 for bf16/fp16, 4 for fp32 training (neither --bf16 nor
    # --fp16): activations, embeddings and non-FP8 weights are kept in it
    dtype_bytes: int = BF16
    # Non-fused attention (attention_backend unfused or local): "" for a fused/flash kernel; "fused_softmax" when
    # megatron-core's scaled masked softmax kernel runs (bf16/fp16, 16 < s <= 4096), "torch_softmax" otherwise
    # (activations.attention_scores_bytes)
    attention_scores: str = ""
    # megatron-core's own DotProductAttention runs (transformer_impl local, or attention_backend local: Bridge's
    # gpt_provider.py and Megatron-LM's model builder swap it in); it takes its raw scores' buffer from the global
    # memory buffer (buffers.global_memory_buffer)
    mcore_attention: bool = False
    hidden_dropout: bool = False              # hidden_dropout > 0: each bias-dropout-add keeps a bool mask
    attention_dropout: bool = False           # attention_dropout > 0: only non-fused attention keeps a mask
    # cuBLAS workspaces torch's allocator holds for the whole job (buffers.gemm_workspaces): torch's per thread and
    # stream, Transformer Engine's, and TE's grouped-GEMM streams'; 0 where the plan was not given them
    gemm_workspace_bytes: float = 0.0
    # Megatron FSDP with FP8 parameters and megatron_fsdp_main_grads_dtype unset: the FP8 weights' gradients are
    # bf16 (grad_bytes), every other parameter's (embeddings, output layer) in its own dtype, these bytes
    # (levers.apply_config); 0: grad_bytes for all
    embed_grad_bytes: int = 0
    # The optimizer the job runs (optimizer: "adam", "muon", ...) and, for the emerging optimizers, megatron-core's
    # layer-wise distributed optimizer (use_layer_wise_distributed_optimizer); see weights.muon_state
    optimizer: str = "adam"
    layer_wise_optimizer: bool = False
    # Which data-parallel rank a breakdown is for where ranks of one pipeline stage differ (the layer-wise
    # optimizer's whole-parameter shards): None, the most loaded; -1, the last (Megatron-LM logs memory from the
    # last rank, global_vars.py); else that rank
    dp_rank: int | None = None
    # DeepSeek sparse attention (memory/variants.py): the kernel backend DSAttention tries (dsa_kernel_backend;
    # "none" also under the unfused attention backend), whether the indexer loss trains (dsa_indexer_loss_coeff
    # > 0), and the GPU's compute capability (FlashMLA pads the heads per generation)
    dsa_backend: str = "none"
    dsa_loss: bool = False
    gpu_arch: int = 9
    # DSA's joint fused kernel declines a dense indexer loss over varlen bounds, which context parallelism and
    # packed sequences give (variants.dsa_reference_loss): dsa_indexer_use_sparse_loss, and whether the job's
    # batches carry packed-sequence metadata (Bridge training/gpt_step.py _uses_packed_sequence_metadata)
    dsa_sparse_loss: bool = False
    packed_sequences: bool = False
    # The MoE token dispatcher (moe_token_dispatcher_type: "alltoall", "allgather" or "flex") and, for flex, its
    # backend ("deepep", "hybridep", "ncclep"); what each keeps for the backward (activations.dispatcher_terms),
    # beside the experts' own tensors, and what it allocates outside torch's allocator (buffers.flex_buffers)
    moe_dispatcher: str = "alltoall"
    flex_backend: str = ""
    flex_num_sms: int = 0                     # moe_flex_dispatcher_num_sms (0: unset, the backend's default)
    # NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN from the job's environment (0: unset, HybridEP detects it)
    flex_nvl_ranks: int = 0
    # use_transformer_engine_op_fuser: how the routed experts' grouped MLP runs (activations.op_fuser_terms): ""
    # TEGroupedMLP's own modules, "ops" TE's fusible basic ops (GroupedLinear, ScaledSwiGLU / ScaledSReLU,
    # GroupedLinear), "fused" TE's CuTe DSL fused grouped MLP (Blackwell, MXFP8, NVTE_CUTEDSL_FUSED_GROUPED_MLP);
    # moe_op_quant: the FP8 recipe its quantized GEMM inputs follow ("" without FP8); moe_op_srelu: the activation
    # is the weighted squared ReLU (else a GLU)
    moe_op_fuser: str = ""
    moe_op_quant: str = ""
    moe_op_srelu: bool = False
    # moe_paged_stash with the fused grouped MLP: moe_paged_stash_buffer_size_factor_cuda (0: no stash) and _cpu
    # (the pinned host buffer), and moe_paged_stash_page_size (buffers.paged_stash_buffer)
    paged_stash_cuda: float = 0.0
    paged_stash_cpu: float = 0.0
    paged_stash_page: int = 64
    # deallocate_pipeline_outputs=False with PP > 1: every in-flight microbatch's stage output keeps its data after
    # the send (pipeline_parallel/schedules.py deallocate_output_tensor; stage_activations.kept_stage_outputs)
    keep_stage_outputs: bool = False
    # cp_comm_type of TE's context-parallel attention with CP > 1: "p2p", "a2a", "allgather", "a2a+p2p"
    cp_comm: str = "p2p"
    # Gemma 2's core attention (attn_logit_softcapping): "flex" (FlexAttention with a softcap score_mod), "unfused"
    # (materialized, softcapped scores); "" for megatron-core's attention
    attn_softcap: str = ""
    attn_softcap_scores: str = ""             # the materialized path's softmax (as attention_scores), for the range
    logit_softcap: bool = False               # final_logit_softcapping: tanh on the logits keeps its output
    # attention_softmax_in_fp32: torch's non-fused softmax runs in fp32 (attention_scores_bytes)
    softmax_fp32: bool = True
    # scatter_embedding_sequence_parallel=False under SP: the embedding output stays whole on every TP rank
    embedding_whole: bool = False
    # overlap_moe_expert_parallel_comm: megatron-core's combined 1F1B schedule runs one microbatch's layer forward
    # beside another's layer backward (pipeline_parallel/combined_1f1b.py; stage_activations.ep_overlap_working);
    # delay_wgrad_compute with it: TE keeps each GEMM's input and output gradient until the node's backward_dw
    ep_overlap: bool = False
    delay_wgrad: bool = False
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


def quantized_params(st: Settings) -> bool:
    """Whether the layers' GEMM weights are quantized primary weights (fp8_param / fp4_param), not params-dtype."""
    return st.param_bytes in (FP8, FP4)


def _tokens(lay: Layout) -> float:
    return lay.seq * lay.mbs / lay.cp
