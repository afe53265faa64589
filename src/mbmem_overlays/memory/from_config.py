"""What the model reads from a Bridge ConfigContainer: Shape, Layout and Settings as Bridge would run them."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from .buffers import gemm_workspaces
from .graphs import WHOLE_LAYER
from .inputs import BF16, FP4, FP4_LAYOUT, FP4_SCALES, FP8, FP32, Layout, Settings, Shape
from .pipeline import HYBRID_SYMBOLS
from .variants import DSA, DSA_SHARED, GDN, dsa_reuses_topk, linear_attention_pattern

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
    # membership is all megatron-core asks of the list (transformer_layer.py `"core_attn" in recompute_modules`)
    modules = tuple(dict.fromkeys(m.recompute_modules if m.recompute_modules is not None else ["core_attn"]))
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


def fp8_weight_copy_bytes(fp8: bool, fp8_params: bool, transpose_cache_disabled: bool, fp4: bool = False) -> float:
    """Bytes per layer GEMM weight kept beside the parameter itself for FP8 GEMMs.

    FP8 parameters (fp8_param_gather) keep a second, transposed FP8 layout after each all-gather, because
    Hopper's FP8 GEMM takes only the TN layout (TE tensor/utils.py post_all_gather_processing:
    _create_transpose when non-TN FP8 GEMM is unsupported). bf16 parameters with FP8 compute keep a cached FP8
    copy in both layouts across microbatches unless disable_parameter_transpose_cache is set (megatron-core
    passes is_first_microbatch=None then, so TE quantizes the weight afresh each time).
    """
    if not fp8:
        return 0
    if fp4:
        # NVFP4 (``fp8`` is then "quantized GEMMs", Settings.fp8): an NVFP4 primary weight keeps only its packed
        # rowwise data in the param buffer (param_bytes); beside it its rowwise E4M3 scales and the columnwise
        # layout (data and scales) post_all_gather_processing builds on every GPU generation (TE v2.17.1
        # tensor/utils.py :936-971, _nvfp4_2d_multi_tensor_transpose :974-1044 allocates _columnwise_data and
        # _columnwise_scale_inv once and keeps them). A bf16 weight under NVFP4 compute caches its NVFP4 workspace
        # in both layouts as FP8 does (module/linear.py :406-431), unless the transpose cache is disabled
        if fp8_params:
            return FP4_SCALES + FP4_LAYOUT
        return 0 if transpose_cache_disabled else 2 * FP4_LAYOUT
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


def master_bytes(opt: Any, m: Any, decoupled_grads: bool, quantized_params: bool, fsdp_on: bool) -> int:
    """Settings.master_bytes: bytes per parameter of the optimizer's master copy. The precision-aware path that lets
    TE's FusedAdam own the masters (use_precision_aware_optimizer_no_fp8_or_ds_fp8: the optimizer's params are the
    bf16 shards themselves, distrib_optimizer.py:452-454, :491-494) passes ``store_param_remainders`` (True by
    default, optimizer_config.py:192; kept from TE 2.1 on, :438-439; megatron/core/optimizer/__init__.py:583-584)
    with master_weights and an fp32 master dtype (:574-581): FusedAdam then keeps only the 16 bits of each fp32
    master that its bf16 parameter does not hold, as int16 (TE FusedAdam ``store_param_remainders``: bf16
    params and fp32 masters only; ``_initialize_state`` allocates ``zeros_like(param, dtype=torch.int16)``).
    Not for FP8/FP4 primary weights, fp16 parameters, the CPU optimizer (HybridDeviceOptimizer) or Megatron FSDP,
    whose masters are its own buffers (memory/levers.py). Otherwise the master is main_params_dtype on the
    precision-aware path and fp32 on the others."""
    if not bool(getattr(opt, "use_precision_aware_optimizer", False)):
        return FP32
    main = _dtype_bytes(getattr(opt, "main_params_dtype", None), FP32)
    if (decoupled_grads and main == FP32 and bool(getattr(opt, "store_param_remainders", True))
            and not quantized_params and not fsdp_on and not bool(getattr(opt, "optimizer_cpu_offload", False))
            and str(getattr(m, "params_dtype", None)) == "torch.bfloat16"):
        return BF16
    return main


def fp8_cast_copy_bytes(cfg: Any, fp8_params: bool, decoupled_grads: bool, fsdp_on: bool) -> int:
    """Settings.fp8_cast_copy_bytes: the params dtype's bytes when the step quantizes fp32 masters into FP8
    primary weights through TE's quantize_master_weights (fp8_master_cast_copies), else 0. That is the
    distributed optimizer's regular path with ddp.fp8_param_gather (distrib_optimizer.py:2815); not Megatron
    FSDP (its own copy_main_weights_to_model_weights), not the precision-aware path that lets FusedAdam own the
    masters (:2812-2813 returns first), not MXFP8 weights gathered through the gradient buffer
    (reuse_grad_buf_for_mxfp8_param_ag: the masters go to the param buffer instead, optimizer.py:800-806).
    fp32 params cast to themselves (Tensor.to of the same dtype returns the tensor). ``cfg`` is set up as Bridge
    runs it (bridge/as_run.py): the mixed-precision preset's params_dtype and reuse flag are in the model,
    optimizer and DDP configs."""
    from ..core.paths import read
    dist = bool(getattr(cfg.optimizer, "use_distributed_optimizer", False) or read(cfg, "ddp.use_distributed_optimizer",
                                                                                   False))
    reuse = any(bool(getattr(c, "reuse_grad_buf_for_mxfp8_param_ag", False))
                for c in (cfg.optimizer, getattr(cfg, "ddp", None)) if c is not None)
    if not fp8_params or not dist or fsdp_on or decoupled_grads or reuse:
        return 0
    return 0 if _dtype_bytes(getattr(cfg.model, "params_dtype", None), BF16) == FP32 else BF16


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


def optimizer_name(opt: Any) -> tuple[str, bool]:
    """(the optimizer megatron-core builds, whether it is the layer-wise distributed optimizer). A ``dist_``
    name (Bridge's Kimi K2 recipes: optimizer_utils.py:79 ``optimizer="dist_muon"``) is the bare optimizer wrapped
    in LayerWiseDistributedOptimizer: Bridge's setup_optimizer passes ``layer_wise_distributed_optimizer="dist" in
    optimizer`` (bridge/training/optim.py:104-110), and megatron-core strips the prefix and sets use_layer_wise
    (core/optimizer/__init__.py:744-754), so its state is Muon's, sharded by whole parameters (memory/optimizers.py)."""
    name = str(getattr(opt, "optimizer", "adam") or "adam")
    layer_wise = bool(getattr(opt, "use_layer_wise_distributed_optimizer", False))
    if name.startswith("dist_"):
        return name[len("dist_"):], True
    return name, layer_wise


def compute_dtype_bytes(m: Any) -> int:
    """Bytes of the model's params_dtype: 4 for fp32 training (Megatron-LM without --bf16/--fp16: params_dtype
    torch.float32, arguments.py validate_args), else 2."""
    dtype = getattr(m, "params_dtype", None)
    if dtype is None:
        return BF16 if (getattr(m, "bf16", True) or getattr(m, "fp16", False)) else FP32
    return _dtype_bytes(dtype, BF16)


def attention_scores(m: Any, seq: int, mbs: int, tp: int, materialized: bool = False) -> str:
    """"" for a fused/flash attention kernel, else how the non-fused attention's softmax runs: megatron-core's
    DotProductAttention serves attention_backend local (and TE's UnfusedDotProductAttention unfused, the same
    tensors) and every layer of the local transformer_impl (gpt_layer_specs.py core_attention); its
    scale_mask_softmax uses the fused kernel when masked_softmax_fusion is on for bf16/fp16 input with
    16 < s <= 4096 and batch x heads divisible by 4 (fusions/fused_softmax.py is_kernel_available).
    ``materialized``: a core attention of the model's own that runs the same softmax (Gemma 2's unfused path)."""
    backend = str(getattr(getattr(m, "attention_backend", None), "name", getattr(m, "attention_backend", "")))
    local_impl = str(getattr(m, "transformer_impl", "transformer_engine")) == "local"
    if backend not in ("unfused", "local") and not local_impl and not materialized:
        return ""
    half = compute_dtype_bytes(m) == BF16
    heads = max(1, int(m.num_attention_heads) // max(1, tp))
    kernel = (bool(getattr(m, "masked_softmax_fusion", False)) and half and 16 < seq <= 4096 and seq % 4 == 0
              and (mbs * heads) % 4 == 0)
    return "fused_softmax" if kernel else "torch_softmax"


def mcore_attention(m: Any) -> bool:
    """Whether megatron-core's DotProductAttention is the core attention: every layer of the local
    transformer_impl (models/backends.py LocalSpecProvider.core_attention), and attention_backend local, for which
    Bridge's and Megatron-LM's model builders swap it into the layer spec (megatron/bridge/models/gpt_provider.py
    :277-279, megatron/training/models/gpt.py:296-298)."""
    backend = str(getattr(getattr(m, "attention_backend", None), "name", getattr(m, "attention_backend", "")))
    return backend == "local" or str(getattr(m, "transformer_impl", "transformer_engine")) == "local"


def dsa_backend(m: Any) -> str:
    """The DSA kernel backend DSAttention tries: dsa_kernel_backend, or "none" under the unfused attention
    backend (transformer/experimental_attention_variant/dsa_kernels.py use_fused_dsa_kernels :92-97)."""
    backend = str(getattr(getattr(m, "attention_backend", None), "name", getattr(m, "attention_backend", "")))
    return "none" if backend == "unfused" else str(getattr(m, "dsa_kernel_backend", "none") or "none")


def packed_sequences(cfg: Any) -> bool:
    """Whether the job's batches carry packed-sequence metadata, so the model gets packed_seq_params (THD): Bridge's
    own test (training/gpt_step.py _uses_packed_sequence_metadata :109-117): offline packing with a positive (or
    unset) packed_sequence_size, or in-batch packing."""
    dataset = getattr(cfg, "dataset", None)
    if getattr(dataset, "enable_offline_packing", False):
        size = getattr(getattr(dataset, "offline_packing_specs", None), "packed_sequence_size", None)
        return size is None or size > 0
    return bool(getattr(dataset, "enable_in_batch_packing", False))


def chunk_layers(m: Any, layers: int) -> tuple[int, ...]:
    """Decoder layers of each model chunk in chunk order (chunk c = virtual stage c // pp on pipeline rank c % pp),
    when megatron-core does not split them evenly; () for the even split.

    transformer_block.py get_num_layers_to_build: a pipeline_model_parallel_layout counts its decoder ("t") layers
    per stage (pipeline_parallel_layer_layout.py get_num_layers_to_build; the 1-D list is in chunk order, :40-51);
    num_layers_in_first/last_pipeline_stage fix the end stages and split the rest evenly, each stage's layers
    divided across its virtual stages; account_for_embedding/loss_in_pipeline_split count the embedding and the
    loss as one layer each, taken from the first and last chunk."""
    pp = int(m.pipeline_model_parallel_size or 1)
    layout = getattr(m, "pipeline_model_parallel_layout", None)
    if layout is not None:
        from megatron.core.transformer.enums import LayerType
        from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
        if isinstance(layout, (str, list)):
            layout = PipelineParallelLayerLayout(layout, pp)
        grid = layout.layout   # [pp rank][virtual stage]
        vpp = len(grid[0])
        return tuple(grid[c % pp][c // pp].count(LayerType.decoder) for c in range(pp * vpp))
    first = getattr(m, "num_layers_in_first_pipeline_stage", None)
    last = getattr(m, "num_layers_in_last_pipeline_stage", None)
    emb = bool(getattr(m, "account_for_embedding_in_pipeline_split", False))
    loss = bool(getattr(m, "account_for_loss_in_pipeline_split", False))
    vpp = int(getattr(m, "virtual_pipeline_model_parallel_size", None) or 1)
    if pp == 1 or not (first is not None or last is not None or emb or loss):
        return ()
    if first is not None or last is not None:
        rest, stages = layers, pp
        for n in (first, last):
            if n is not None:
                rest, stages = rest - n, stages - 1
        middle = rest // stages if stages > 0 else 0
        per_rank = [middle] * pp
        if first is not None:
            per_rank[0] = first
        if last is not None:
            per_rank[-1] = last
        return tuple(per_rank[c % pp] // vpp for c in range(pp * vpp))
    per_chunk = (layers + emb + loss) // pp // vpp
    sizes = [per_chunk] * (pp * vpp)
    sizes[0] -= emb
    sizes[-1] -= loss
    return tuple(sizes)


def hybrid_pattern(pattern: str, mtp_pattern: str | None = None
                   ) -> tuple[tuple[str, ...], tuple[str, ...], tuple[int, ...]]:
    """(layer kinds, the blocks of one MTP depth, layers per pipe-delimited segment) of a hybrid layer pattern.

    megatron-core's models/hybrid/hybrid_layer_allocation.py: parse_hybrid_pattern splits the main pattern from
    the MTP depths at "/" (every depth the same pattern; Bridge's hybrid provider appends its
    ``mtp_hybrid_override_pattern`` the same way); select_pipeline_segment gives pipeline rank r's virtual stage
    v the segment ``v * pp + r`` of the "|"-delimited main pattern (chunk order), and splits a pattern without
    "|" evenly or by num_layers_in_first/last_pipeline_stage (chunk_layers). G, D and + are the gated-delta-net,
    DSA and MLA blocks (pipeline.HYBRID_SYMBOLS)."""
    main, *mtp = pattern.split("/")
    if not any(mtp) and mtp_pattern:
        mtp = [mtp_pattern]
    blocks = lambda text: tuple(HYBRID_SYMBOLS[c] for c in text if c in HYBRID_SYMBOLS)  # noqa: E731
    parts = main.split("|")
    return blocks(main), blocks(next((p for p in mtp if p), "")), tuple(len(blocks(p)) for p in parts)


def attention_blocks(m: Any, layers: int) -> tuple[str, ...]:
    """The attention block of each GPT layer: "attn" (softmax attention, MLA with multi_latent_attention), or
    with an experimental attention variant the block megatron-core's experimental spec builds per layer
    (models/gpt/experimental_attention_variant_module_specs.py
    get_transformer_layer_with_experimental_attention_variant_spec :156-270): "gdn" where
    get_linear_attention_pattern (:402-436) puts a gated delta net, "dsa" on every layer with DSA. A variant
    megatron-core 0.19.2 does not build is planned as "attn" and named by coverage.py."""
    variant = getattr(m, "experimental_attention_variant", None)
    if variant == "gated_delta_net":
        pattern = linear_attention_pattern(getattr(m, "linear_attention_freq", None), layers)
        return tuple(GDN if la else "attn" for la in pattern)
    if variant == "dsa":
        return (DSA,) * layers
    return ("attn",) * layers


def share_dsa_topk(kinds: tuple[str, ...], m: Any) -> tuple[str, ...]:
    """``kinds`` with each DSA layer that reuses an earlier layer's top-k (dsa_indexer_topk_freq > 1; the layer
    numbers are the stack's, 1-indexed: transformer_block.py / hybrid_block.py layer_number = i + 1 + offset)
    made "dsa_shared": it builds no indexer (variants.dsa_reuses_topk)."""
    freq = int(getattr(m, "dsa_indexer_topk_freq", 1) or 1)
    offset = int(getattr(m, "dsa_indexer_skip_topk_offset", 0) or 0)
    if freq <= 1:
        return kinds
    return tuple("+".join(DSA_SHARED if b == DSA and dsa_reuses_topk(i + 1, offset, freq) else b
                          for b in kind.split("+")) for i, kind in enumerate(kinds))


def mamba_heads(m: Any) -> int:
    """The Mamba mixer's SSM heads: ``mamba_num_heads``, or, unset (megatron-core's default), the inner width
    ``expand * hidden_size`` over ``mamba_head_dim`` with MambaMixer's ``expand=2``, which the hybrid stack never
    overrides (megatron/core/ssm/mamba_mixer.py:179, :216, :243-249: nheads = d_inner // headdim;
    transformer_config.py ``mamba_num_heads``: "If None, ... hidden_size * expand // mamba_head_dim")."""
    heads = getattr(m, "mamba_num_heads", None)
    if heads:
        return int(heads)
    head_dim = getattr(m, "mamba_head_dim", 0) or 0
    return 2 * m.hidden_size // head_dim if head_dim else 0


def bf16_layer_span(m: Any, fp8: bool) -> tuple[int, int]:
    """Shape.bf16_layers: (first, last) main-decoder layers an FP8 job builds and runs outside FP8, (0, 0) without
    FP8, where first_last_layers_bf16 changes nothing (get_fp8_context returns a nullcontext for every layer then,
    fp8_utils.py:792). transformer_config.py:628-637: num_layers_at_start/end_in_bf16 (default 1 each) count
    only with first_last_layers_bf16. ``m`` is the model as Bridge's setup runs it (bridge/as_run.py), so a
    mixed-precision preset's own three fields are already on it (mixed_precision.py:127,
    update_config_with_precision_overrides :138-156)."""
    if not fp8:
        return 0, 0
    if not bool(getattr(m, "first_last_layers_bf16", False)):
        return 0, 0
    return (max(0, int(getattr(m, "num_layers_at_start_in_bf16", 1) or 0)),
            max(0, int(getattr(m, "num_layers_at_end_in_bf16", 1) or 0)))


def moe_dispatcher(m: Any) -> tuple[str, str]:
    """(moe_token_dispatcher_type, flex backend or ""): transformer_config.py:862-873 (default "allgather";
    the flex backend defaults to "deepep"), the deprecated moe_enable_deepep selecting DeepEP (:1589-1598)."""
    kind = str(getattr(m, "moe_token_dispatcher_type", None) or "allgather")
    if kind != "flex":
        return kind, ""
    backend = "deepep" if bool(getattr(m, "moe_enable_deepep", False)) else str(
        getattr(m, "moe_flex_dispatcher_backend", None) or "deepep")
    return kind, backend


def _activation_name(m: Any) -> str:
    return str(getattr(getattr(m, "activation_func", None), "__name__", ""))


def op_fuser_unsupported(m: Any, etp: int, env_flag: int) -> str:
    """Why megatron-core refuses TE's operation fuser for this MoE config ("" when it accepts it): TEGroupedMLP
    asserts _is_fused_impl_supported() when use_transformer_engine_op_fuser is set (moe/experts.py :286-290,
    _is_fused_impl_supported :332-400), so such a job stops while the model is built. What the config decides of
    it: expert TP of 1, no expert_fc1 / moe_act activation offload, no moe_apply_probs_on_input, TE's GroupedLinear
    (the grouped GEMM, not the legacy one), SwiGLU / quick-GeGLU with a GLU or the fused weighted squared ReLU
    without one, and for a GLU NVTE_CUTEDSL_FUSED_GROUPED_MLP > 0 in the job's environment."""
    if etp > 1:
        return f"expert tensor parallelism {etp} (the fused grouped MLP needs 1)"
    offload = set(getattr(m, "offload_modules", None) or ()) if getattr(
        m, "fine_grained_activation_offloading", False) else set()
    if offload & {"expert_fc1", "moe_act"}:
        return "expert_fc1 / moe_act activation offloading (only the unfused experts support it)"
    if getattr(m, "moe_apply_probs_on_input", False):
        return "moe_apply_probs_on_input"
    if not getattr(m, "moe_grouped_gemm", False) or getattr(m, "moe_use_legacy_grouped_gemm", False):
        return "experts without TE's GroupedLinear (moe_grouped_gemm off or the legacy grouped GEMM)"
    act, gated = _activation_name(m), bool(getattr(m, "gated_linear_unit", False))
    glu = gated and act in ("silu", "quick_gelu")
    srelu = act == "squared_relu" and bool(getattr(m, "use_fused_weighted_squared_relu", False)) and not gated
    if not (glu or srelu):
        return f"activation {act or '?'} (it fuses SwiGLU, quick-GeGLU or the weighted squared ReLU)"
    if glu and env_flag <= 0:
        return "NVTE_CUTEDSL_FUSED_GROUPED_MLP unset in the job's environment (a GLU needs it)"
    return ""


def fused_grouped_mlp_eligible(m: Any, fp8_recipe: str, env_flag: int) -> bool:
    """What TE v2.17.1 needs of the config to fuse the experts' ops into its CuTe DSL grouped MLP, the GPU aside
    (ops/fused/grouped_mlp.py fuse_grouped_mlp_ops :681-760, _GroupedMLP_CuTeGEMMBase.is_supported :804-819,
    validate_grouped_mlp_dims :648-678): NVTE_CUTEDSL_FUSED_GROUPED_MLP >= 1, an MXFP8 recipe (NVFP4 too, which is
    FP4 and named by coverage.py), every FC1 / FC2 size a multiple of 64, and a GLU interleaved by 32
    (moe_mlp_glu_interleave_size)."""
    width = int(getattr(m, "moe_latent_size", None) or m.hidden_size)
    ffn = int(getattr(m, "moe_ffn_hidden_size", None) or 0)
    gated = bool(getattr(m, "gated_linear_unit", False))
    dims = ffn > 0 and all(d % 64 == 0 for d in (width, (2 if gated else 1) * ffn, ffn))
    interleave = not gated or getattr(m, "moe_mlp_glu_interleave_size", None) == 32
    return env_flag >= 1 and fp8_recipe == "mxfp8" and dims and interleave


def job_fp8_recipe(cfg: Any) -> str:
    """The FP8 recipe the job's GEMMs run ("" without FP8). ``cfg`` is read as Bridge's setup runs it
    (bridge/as_run.py), so a mixed-precision preset's fp8 and fp8_recipe are on the model already
    (mixed_precision.py:127)."""
    m = cfg.model
    if not getattr(m, "fp8", None):
        return ""
    recipe = getattr(m, "fp8_recipe", None)
    return str(getattr(recipe, "value", recipe) or "")


def job_fp4(cfg: Any) -> tuple[bool, bool]:
    """(NVFP4 GEMMs, NVFP4 primary weights) as Bridge's setup runs the job (bridge/as_run.py: the preset's fp4,
    fp4_param and fp4_param_gather are on the model and DDP configs, mixed_precision.py:62-66, :404-417).
    transformer_config.py:652-667 (fp4 'e2m1', fp4_recipe 'nvfp4', fp4_param), :1451-1455 (fp4_param needs fp4,
    fp4 excludes fp8). A custom fp4_recipe (a user's quantizer factory) is not NVFP4: coverage.py names it."""
    m = cfg.model
    fp4 = bool(getattr(m, "fp4", None)) and not bool(getattr(m, "fp8", None))
    return fp4, fp4 and bool(getattr(m, "fp4_param", False))


def output_proj_fp8(m: Any, fp8_recipe: str) -> bool:
    """fp8_output_proj takes effect: megatron-core builds the output layer as TE's TELMHeadColumnParallelLinear
    (gpt_model.py:264-268) only where is_mxfp8_output_proj_active holds (fp8_utils.py:692-707: fp8 with the MXFP8
    recipe; transformer_config.py:1442-1448 refuses it otherwise)."""
    return bool(getattr(m, "fp8_output_proj", False)) and fp8_recipe == "mxfp8"


def output_proj_copy_bytes(active: bool, transpose_cache_disabled: bool) -> float:
    """Settings.output_proj_copy_bytes: bytes per output-layer weight element TE keeps beside the bf16 weight when
    the output projection runs in MXFP8. GPTModel builds the output layer outside the decoder's fp8_model_init
    (gpt_model.py:264-280), so its weight is a params-dtype tensor even with fp8_param; TELMHeadColumnParallelLinear
    .forward runs TELinear.forward under get_fp8_context (extensions/transformer_engine.py :1514, :1626-1631),
    which caches the MXFP8 weight workspace in both layouts across microbatches (TE module/linear.py :406-431) unless
    disable_parameter_transpose_cache passes is_first_microbatch=None."""
    from .activations import quantized_bytes
    if not active or transpose_cache_disabled:
        return 0.0
    return 2 * quantized_bytes("mxfp8", weight=True)


def job_env_int(cfg: Any, name: str, env: dict[str, str] | None = None) -> int:
    """An integer the job's environment sets (``env``, else the recipe's cfg.env_vars), 0 when unset or bad."""
    return _env_int(env, cfg, name)


def moe_op_fuser(m: Any, s: Shape, lay: Layout, fp8_recipe: str, arch: int, env_flag: int) -> str:
    """Settings.moe_op_fuser: "" without TE's operation fuser on the experts (or where megatron-core refuses it:
    op_fuser_unsupported), "fused" where TE v2.17.1 fuses GroupedLinear + scaled activation + GroupedLinear into its
    CuTe DSL grouped MLP, else "ops" (its basic ops): on compute capability 10 (is_supported :808-809) where the
    config allows it (fused_grouped_mlp_eligible); its cuDNN front-end kernels are a runtime condition (ranges.py
    gives the basic ops as the other end)."""
    if not (s.experts and getattr(m, "use_transformer_engine_op_fuser", False)):
        return ""
    if str(getattr(m, "transformer_impl", "transformer_engine")) == "local" or op_fuser_unsupported(
            m, lay.etp, env_flag):
        return ""
    return "fused" if arch == 10 and fused_grouped_mlp_eligible(m, fp8_recipe, env_flag) else "ops"


CP_COMM_TYPES = ("p2p", "a2a", "allgather", "a2a+p2p")


def cp_comm_type(m: Any) -> str:
    """Settings.cp_comm: the context-parallel attention's communication (model.cp_comm_type; a list gives one per
    layer, megatron-core transformer_config.py cp_comm_type; a list whose layers differ is named by coverage.py)."""
    value = getattr(m, "cp_comm_type", None)
    if isinstance(value, (list, tuple)):
        kinds = {str(v) for v in value}
        value = kinds.pop() if len(kinds) == 1 else "p2p"
    value = str(value or "p2p")
    return value if value in CP_COMM_TYPES else "p2p"


def gemma2_attention(cfg: Any) -> str:
    """Settings.attn_softcap: which core attention a Gemma 2 layer runs ("" for any other model). Bridge's
    gemma2_layer_spec (models/gemma/gemma2_provider.py :436-460) makes it Gemma2FlexDotProductAttention, which runs
    torch's FlexAttention with the softcap as its score_mod when FlexAttention imports (:57-67) and the batch
    carries no attention mask and no dropout (:381-403), else Gemma2DotProductAttention's materialized scores
    (:94-314). Bridge passes a mask only where the dataset config turns skip_getting_attention_mask_from_dataset
    off (training/gpt_step.py :123, :322-323); FlexAttention is in torch since 2.5 (2.14 here)."""
    m = cfg.model
    spec = getattr(m, "transformer_layer_spec", None)
    if getattr(spec, "__name__", "") != "gemma2_layer_spec" or not getattr(m, "attn_logit_softcapping", None):
        return ""
    masked = not bool(getattr(getattr(cfg, "dataset", None), "skip_getting_attention_mask_from_dataset", True))
    dropout = float(getattr(m, "attention_dropout", 0.0) or 0.0) > 0
    return "unfused" if masked or dropout else "flex"


def vision_shape(cfg: Any, shape: Shape, lay: Layout) -> Shape:
    """``shape`` with a VL model's vision encoder (memory/vision.py vision_tower_of) and, where its language model
    rotates q and k outside TE's fused RoPE, the bytes of the cos/sin tables each attention layer saves
    (Shape.rope_tables_bytes): Qwen3VLSelfAttention never fuses (qwen_vl/modelling_qwen3_vl/rope.py:467-483), and
    Bridge's GPT provider turns the fusion off for mrope (gpt_provider.py:229-230, utils/fusions.py:80-92), which
    Qwen2.5-VL uses; the tables are in q's dtype, fp32 with apply_rotary_pos_emb_in_fp32 (rope.py:484-486)."""
    from .vision import QWEN3_VL, QWEN25_VL, family_of, vision_tower_of
    m = cfg.model
    fam = family_of(m)
    if fam is None:
        return shape
    rope = 0
    if fam == QWEN3_VL or (fam == QWEN25_VL and str(getattr(m, "position_embedding_type", "")) == "mrope"):
        rope = FP32 if bool(getattr(m, "apply_rotary_pos_emb_in_fp32", False)) else compute_dtype_bytes(m)
    return replace(shape, vision=vision_tower_of(cfg, lay), rope_tables_bytes=rope)


def _env_int(env: dict[str, str] | None, cfg: Any, name: str) -> int:
    """An integer the job's environment sets (the user's, else the recipe's cfg.env_vars), 0 when unset or bad."""
    value = (env or {}).get(name)
    if value is None:
        value = (getattr(cfg, "env_vars", None) or {}).get(name) if isinstance(getattr(cfg, "env_vars", None),
                                                                                dict) else None
    try:
        return max(0, int(value)) if value is not None else 0
    except (TypeError, ValueError):
        return 0


def _refuse(path: str, value: Any, why: str, fix: str):
    from ..core.errors import OverlayError, Problem
    from ..core.text import bounded
    return OverlayError([Problem(("plan",), path, bounded(value, 60), why, fix)])


def plan_limits(m: Any) -> None:
    """The model's layers within what the plan computes (core/values.py MAX_PLAN_LAYERS), checked before one entry
    per layer is built: 10^8 layers were minutes and gigabytes (issue 39 #6)."""
    from ..core.values import MAX_PLAN_LAYERS
    layers = m.num_layers
    pattern = getattr(m, "hybrid_override_pattern", None) or getattr(m, "hybrid_layer_pattern", None)
    freq = getattr(m, "moe_layer_freq", 1)
    for path, n in (("model.num_layers", layers), ("model.hybrid_layer_pattern", len(pattern) if isinstance(
            pattern, str) else 0), ("model.moe_layer_freq", len(freq) if isinstance(freq, (list, tuple)) else 0)):
        if isinstance(n, int) and not isinstance(n, bool) and n > MAX_PLAN_LAYERS:
            raise _refuse(path, n, f"{path} gives {n:,} layers, past the plan's limit of {MAX_PLAN_LAYERS:,} (it "
                          "plans each layer)", "plan a model within the limit")
    if not isinstance(layers, int) or isinstance(layers, bool) or layers < 1:
        raise _refuse("model.num_layers", layers, f"model.num_layers is {layers!r}: a model has at least one layer",
                      "give model.num_layers a whole number of at least 1")


def layout_limits(shape: Shape, lay: Layout) -> None:
    """Every size the plan multiplies or divides by at least 1 (a negative size was planned as a job that fits,
    issue 39 #9), and the pipeline within what the plan replays (core/values.py)."""
    from ..core.values import MAX_PLAN_PIPELINE, MAX_PLAN_SCHEDULE
    sizes = {"model.hidden_size": shape.hidden, "model.ffn_hidden_size": shape.ffn,
             "model.num_attention_heads": shape.heads, "model.num_query_groups": shape.groups,
             "model.kv_channels": shape.head_dim, "model.vocab_size": shape.vocab, "model.seq_length": lay.seq,
             "train.micro_batch_size": lay.mbs, "train.global_batch_size": lay.gbs,
             "model.tensor_model_parallel_size": lay.tp, "model.pipeline_model_parallel_size": lay.pp,
             "model.virtual_pipeline_model_parallel_size": lay.vpp, "model.context_parallel_size": lay.cp,
             "model.expert_model_parallel_size": lay.ep, "model.expert_tensor_parallel_size": lay.etp}
    may_be_zero = ("model.vocab_size", "model.kv_channels")   # 0: not known here (vocab_size says so)
    for path, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if path in may_be_zero else 1):
            raise _refuse(path, value, f"{path} is {value!r}: the plan needs a whole number of at least 1",
                          f"give {path} a whole number of at least 1")
    if lay.pp > MAX_PLAN_PIPELINE:
        raise _refuse("model.pipeline_model_parallel_size", lay.pp, f"{lay.pp:,} pipeline stages are past the "
                      f"plan's limit of {MAX_PLAN_PIPELINE:,} (it plans each stage)", "plan a job within the limit")
    from .pipeline import vp_group
    work = lay.pp * vp_group(lay) * lay.vpp if lay.pp > 1 and lay.vpp > 1 else 0
    if work > MAX_PLAN_SCHEDULE:
        raise _refuse("model.microbatch_group_size_per_vp_stage", vp_group(lay),
                      f"the interleaved schedule the plan replays per stage (pipeline {lay.pp} x microbatch group "
                      f"{vp_group(lay)} x virtual stages {lay.vpp} = {work:,} steps) is past its limit of "
                      f"{MAX_PLAN_SCHEDULE:,}", "plan a job with fewer stages or a smaller group")
def _vp_group(value: Any, pp: int) -> int:
    """Layout.vp_group: the microbatches of one virtual-pipeline group, 0 where it is the pipeline size (unset, or
    what megatron-core's finalize wrote for unset)."""
    return 0 if not value or int(value) == int(pp or 1) else int(value)


def from_config(cfg: Any, world: int, *, arch: int = 9, env: dict[str, str] | None = None
                ) -> tuple[Shape, Layout, Settings]:
    """The plan's inputs read from a Bridge ConfigContainer for ``world`` GPUs of compute capability ``arch``
    (9: H100/H200, 10: B200/GB200, 8: A100) in a job environment ``env`` (what it reads: CUBLAS_WORKSPACE_CONFIG;
    None: nothing known beyond the recipe's env_vars).

    What is read is the config as Bridge's setup will run it (bridge/as_run.py ``as_run``: the mixed-precision
    preset applied, the communication-overlap setup, the model, optimizer and DDP configs finalized, the recipe's
    env_vars under ``env``), never the fields as the recipe left them: a copy already set up (``as_run``'s own) is
    read as it is, anything else is set up first."""
    from ..bridge.as_run import as_run
    from ..core.engine import View
    from ..core.paths import read
    from ..core.rules import regather_fallbacks
    run = as_run(cfg, world, env)
    cfg, env = run.config, run.env
    m = cfg.model
    layers = m.num_layers
    plan_limits(m)
    freq = getattr(m, "moe_layer_freq", 1)
    experts = getattr(m, "num_moe_experts", None) or 0
    pattern = getattr(m, "hybrid_override_pattern", None) or getattr(m, "hybrid_layer_pattern", None)
    mtp_blocks: tuple[str, ...] = ()
    segments: tuple[int, ...] = ()
    if getattr(m, "is_hybrid_model", False) and isinstance(pattern, str) and pattern:
        # hybrid stacks (Nemotron-H): one block per symbol, the MTP depth's blocks after "/"
        kinds, mtp_blocks, segments = hybrid_pattern(pattern, getattr(m, "mtp_hybrid_override_pattern", None))
        layers = len(kinds)
    else:
        if not experts:
            is_moe = [False] * layers
        elif isinstance(freq, int):
            is_moe = [i % freq == 0 for i in range(layers)]
        else:
            is_moe = [bool(int(x)) for x in freq]
        kinds = tuple(f"{a}+{'moe' if x else 'mlp'}" for a, x in zip(attention_blocks(m, layers), is_moe))
    kinds = share_dsa_topk(kinds, m)
    hybrid = bool(getattr(m, "is_hybrid_model", False) and isinstance(pattern, str) and pattern)
    blocks = {b for kind in kinds + mtp_blocks for b in kind.split("+")}
    moe_layers = sum(1 for k in kinds if "moe" in k)
    fp8 = bool(getattr(m, "fp8", None))
    fp4, fp4_params = job_fp4(cfg)
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
        # a hybrid stack's "*" is softmax attention, its "+" (and "D") MLA, whatever multi_latent_attention says
        mla=bool(getattr(m, "multi_latent_attention", False)) and not hybrid, qk_head_dim=getattr(m, "qk_head_dim", 0) or 0,
        qk_pos_dim=getattr(m, "qk_pos_emb_head_dim", 0) or 0, v_head_dim=getattr(m, "v_head_dim", 0) or 0,
        kv_lora_rank=getattr(m, "kv_lora_rank", 0) or 0, q_lora_rank=getattr(m, "q_lora_rank", 0) or 0,
        # qk_l2_norm saves q and k for its backward as the q/k LayerNorm does (transformer/torch_norm.py L2Norm
        # :90-102 under torch.compile; attention.py :1697-1700 builds it in place of the q/k norm)
        qk_norm=bool(getattr(m, "qk_layernorm", False) or getattr(m, "qk_l2_norm", False)), layer_kinds=kinds,
        mamba_heads=mamba_heads(m) if "mamba" in kinds + mtp_blocks else 0,
        mamba_head_dim=getattr(m, "mamba_head_dim", 0) or 0,
        mamba_groups=getattr(m, "mamba_num_groups", 0) or 0, mamba_state=getattr(m, "mamba_state_dim", 0) or 0,
        mamba_conv=getattr(m, "linear_conv_kernel_dim", 4) or 4, mtp_layers=int(getattr(m, "mtp_num_layers", 0) or 0),
        norm_bias=str(getattr(m, "normalization", "LayerNorm")) == "LayerNorm",
        linear_bias=bool(getattr(m, "add_bias_linear", False)),
        # GPTModel builds learned absolute position embeddings of max_sequence_length = seq_length rows
        # (Bridge gpt_provider.py:297, :301)
        position_embeddings=int(m.seq_length) if str(getattr(m, "position_embedding_type", "")) == "learned_absolute"
        else 0,
        mtp_blocks=mtp_blocks, mtp_shared=bool(getattr(m, "mtp_use_repeated_layer", False)),
        attn_gate=bool(getattr(m, "attention_output_gate", False)),
        **(dict(gdn_key_heads=int(getattr(m, "linear_num_key_heads", 0) or 0),
                gdn_value_heads=int(getattr(m, "linear_num_value_heads", 0) or 0),
                gdn_key_dim=int(getattr(m, "linear_key_head_dim", 0) or 0),
                gdn_value_dim=int(getattr(m, "linear_value_head_dim", 0) or 0),
                gdn_conv=int(getattr(m, "linear_conv_kernel_dim", 4) or 4)) if GDN in blocks else {}),
        **(dict(dsa_heads=int(getattr(m, "dsa_indexer_n_heads", 0) or 0),
                dsa_head_dim=int(getattr(m, "dsa_indexer_head_dim", 0) or 0),
                dsa_topk=int(getattr(m, "dsa_indexer_topk", 0) or 0),
                dsa_topk_freq=int(getattr(m, "dsa_indexer_topk_freq", 1) or 1),
                # a hybrid "D" builds no q / kv norm whatever qk_layernorm says (Shape.dsa_qkv_norms)
                dsa_qkv_norms=bool(getattr(m, "qk_layernorm", False)) and not hybrid)
           if blocks & {DSA, DSA_SHARED} else {}),
        # moe/moe_layer.py:338-342 passes moe_shared_expert_gate to the shared experts (only with a shared expert)
        shared_gate=bool(getattr(m, "moe_shared_expert_gate", False)) and bool(
            getattr(m, "moe_shared_expert_intermediate_size", 0)) and bool(experts),
        moe_latent=int(getattr(m, "moe_latent_size", 0) or 0) if experts else 0,
        # get_fp4_context keeps the same first/last layers out of NVFP4 (fp4_utils.py:249-263)
        bf16_layers=bf16_layer_span(m, fp8 or fp4))
    chunks = segments if len(segments) > 1 else chunk_layers(m, layers)
    pp = m.pipeline_model_parallel_size
    lay = Layout(world=world, tp=m.tensor_model_parallel_size, pp=pp,
                 vpp=len(chunks) // pp if chunks else (m.virtual_pipeline_model_parallel_size or 1), cp=m.context_parallel_size,
                 ep=getattr(m, "expert_model_parallel_size", 1) or 1,
                 etp=getattr(m, "expert_tensor_parallel_size", None) or m.tensor_model_parallel_size,  # mcore default
                 sp=bool(m.sequence_parallel) and m.tensor_model_parallel_size > 1,
                 seq=m.seq_length, mbs=cfg.train.micro_batch_size, gbs=cfg.train.global_batch_size,
                 chunk_layers=chunks,
                 # model_parallel_config.py:431-445 (None: the pipeline size, which finalize writes in __post_init__
                 # :567-568). 0 is Layout's "the pipeline size": a layout search that varies PP then varies it too
                 vp_group=_vp_group(getattr(m, "microbatch_group_size_per_vp_stage", None), pp))
    layout_limits(shape, lay)
    shape = vision_shape(cfg, shape, lay)
    # The mixed-precision preset and the communication-overlap config are in the model, optimizer and DDP fields
    # now (as_run: MixedPrecisionConfig.setup, CommOverlapConfig.setup), so those fields alone say the precision
    grad_fp32 = bool(read(cfg, "ddp.grad_reduce_in_fp32", True))
    opt = cfg.optimizer
    precision_aware = bool(getattr(opt, "use_precision_aware_optimizer", False))
    # megatron-core's use_precision_aware_optimizer_no_fp8_or_ds_fp8 (optimizer_config.py:404-411), with the
    # fp8_recipe Bridge's mixed-precision setup copies into the optimizer config (PRECISION_AWARE_PATH)
    fp8_recipe = getattr(opt, "fp8_recipe", None)
    decoupled_grads = precision_aware and (
        _dtype_bytes(getattr(opt, "main_params_dtype", None), FP32) != FP32 or fp8_recipe in (None, "delayed")
        or bool(getattr(opt, "optimizer_cpu_offload", False)))
    peft = getattr(cfg, "peft", None)
    fp8_params = bool(getattr(m, "fp8_param", False))
    defer = bool(getattr(m, "defer_embedding_wgrad_compute", False))
    limit = int(getattr(m, "wgrad_deferral_limit", 0) or 0)
    fsdp_on = bool(read(cfg, "ddp.use_megatron_fsdp", False) or getattr(getattr(cfg, "dist", None),
                                                                       "use_megatron_fsdp", False))
    scopes = graph_scopes(m)
    te = str(getattr(m, "transformer_impl", "transformer_engine")) != "local"
    regather: tuple[str, ...] = ()
    if peft is not None and getattr(peft, "sequence_parallel_input_regather", False):
        view = View(cfg, {}, {}, world, (), {})
        regather = tuple(t for t, r in regather_fallbacks(view).items() if r is None)
    dispatcher, backend = moe_dispatcher(m) if experts else ("alltoall", "")
    # HybridEP with moe_expert_rank_capacity_factor sizes its dispatched tokens to a static budget of tokens x
    # topk x factor per rank and drops the rest (token_dispatcher.py:1090-1102 num_permuted_tokens; hybrid-ep
    # csrc/hybrid_ep/hybrid_ep.cu dispatch_with_permute allocates [num_permuted_tokens, hidden]): the experts run on
    # that budget whatever the routing
    rank_capacity = getattr(m, "moe_expert_rank_capacity_factor", None) if backend == "hybridep" else None
    rank_capacity = float(rank_capacity) if rank_capacity else None
    moe_load = _capacity_factor(m) if _capacity_factor(m) and getattr(m, "moe_pad_expert_input_to_capacity",
                                                                      False) else (rank_capacity or 1.0)
    recipe = job_fp8_recipe(cfg)
    no_weight_cache = bool(getattr(m, "disable_parameter_transpose_cache", False))
    # the distributed optimizer quantizes fp32 masters into NVFP4 weights only with ddp.fp4_param_gather
    # (distrib_optimizer.py:2843-2847), as it does into FP8 ones with fp8_param_gather
    fp4_gathered = fp4_params and bool(read(cfg, "ddp.fp4_param_gather", False))
    op_fuser = moe_op_fuser(m, shape, lay, recipe, arch, _env_int(env, cfg, "NVTE_CUTEDSL_FUSED_GROUPED_MLP"))
    gemma2 = gemma2_attention(cfg)
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
        # the combined 1F1B schedule (schedules.py:751, :1458) and TE's delayed wgrad, which megatron-core allows
        # only with it (transformer_config.py:2749-2752; coverage.py names the refused combinations)
        ep_overlap=bool(getattr(m, "overlap_moe_expert_parallel_comm", False)),
        delay_wgrad=bool(getattr(m, "delay_wgrad_compute", False))
        and bool(getattr(m, "overlap_moe_expert_parallel_comm", False)),
        optimizer_offload=float(opt.optimizer_offload_fraction or 0.0) if opt.optimizer_cpu_offload else 0.0,
        grad_bytes=FP32 if grad_fp32 else BF16,
        param_bytes=FP8 if fp8_params else FP4 if fp4_params else BF16,
        fp8_weight_copy_bytes=fp8_weight_copy_bytes(fp8 or fp4, fp8_params or fp4_params, no_weight_cache, fp4=fp4),
        output_proj_fp8=output_proj_fp8(m, recipe),
        output_proj_copy_bytes=output_proj_copy_bytes(output_proj_fp8(m, recipe), no_weight_cache),
        # TE's activation module (use_te_activation_func) keeps only its input, as the fused kernel does
        swiglu_fused=bool(getattr(m, "bias_activation_fusion", True) or getattr(m, "use_te_activation_func", False)),
        glu_clamped=getattr(m, "activation_func_clamp_value", None) is not None,
        moe_probs_mul=bool(experts) and _moe_weights_activation_separately(m),
        moe_capacity_factor=_capacity_factor(m),
        moe_load=moe_load, moe_rank_capacity=rank_capacity,
        moe_dispatcher=dispatcher, flex_backend=backend,
        flex_num_sms=int(getattr(m, "moe_flex_dispatcher_num_sms", None) or getattr(m, "moe_deepep_num_sms", None)
                         or getattr(m, "moe_hybridep_num_sms", None) or 0) if backend else 0,
        flex_nvl_ranks=_env_int(env, cfg, "NUM_OF_HYBRID_EP_RANKS_PER_NVLINK_DOMAIN") if backend == "hybridep" else 0,
        moe_op_fuser=op_fuser, moe_op_quant=("nvfp4" if fp4 else recipe) if op_fuser else "",
        moe_op_srelu=bool(op_fuser) and _activation_name(m) == "squared_relu",
        # moe/paged_stash.py paged_stash_reset :899, :910-915 reads the two factors and the page size from the config
        paged_stash_cuda=float(getattr(m, "moe_paged_stash_buffer_size_factor_cuda", 1.1) or 0.0)
        if getattr(m, "moe_paged_stash", False) and experts else 0.0,
        paged_stash_cpu=float(getattr(m, "moe_paged_stash_buffer_size_factor_cpu", 0.0) or 0.0)
        if getattr(m, "moe_paged_stash", False) and experts else 0.0,
        paged_stash_page=int(getattr(m, "moe_paged_stash_page_size", 64) or 64),
        # schedules.py deallocate_output_tensor :166-190 frees a sent output's data only with the flag set
        keep_stage_outputs=not bool(getattr(m, "deallocate_pipeline_outputs", True)) and lay.pp > 1,
        cp_comm=cp_comm_type(m) if lay.cp > 1 else "p2p",
        attn_softcap=gemma2,
        attn_softcap_scores=attention_scores(m, lay.seq, lay.mbs, lay.tp, materialized=True) if gemma2 else "",
        logit_softcap=bool(getattr(m, "final_logit_softcapping", None)),
        # apply_query_key_layer_scaling forces it on (transformer_config.py :1465-1466)
        softmax_fp32=bool(getattr(m, "attention_softmax_in_fp32", True) or getattr(
            m, "apply_query_key_layer_scaling", False)),
        embedding_whole=not bool(getattr(m, "scatter_embedding_sequence_parallel", True)) and lay.sp,
        graph_warmup_steps=int(getattr(m, "cuda_graph_warmup_steps", 0) or 0) if scopes else 0,
        graph_scopes=scopes,
        logits_bytes=loss_bytes(m),
        cross_entropy_impl=cross_entropy_impl(m),
        step_upcasts_grads=not decoupled_grads,
        fp8_cast_copy_bytes=fp8_cast_copy_bytes(cfg, fp8_params or fp4_gathered, decoupled_grads, fsdp_on),
        deferred_wgrad_microbatches=(min(limit, lay.microbatches) if limit > 0 else lay.microbatches)
        if defer and lay.pp > 1 else 0,
        state_bytes=_dtype_bytes(getattr(opt, "exp_avg_dtype", None), FP32) if precision_aware else FP32,
        master_bytes=master_bytes(opt, m, decoupled_grads, fp8_params or fp4_params, fsdp_on),
        fp8=fp8 or fp4, fp4=fp4, quant_bytes=FP4_LAYOUT if fp4 else FP8,
        lora_rank=int(getattr(peft, "dim", 0) or 0) if type(peft).__name__ in ("LoRA", "DoRA") else 0,
        lora_targets=tuple(getattr(peft, "target_modules", ()) or ()),
        lora_regather=regather,
        # a VL provider's freeze (qwen3_vl_provider.py provide -> Qwen3VLModel.freeze; Qwen2.5-VL, Gemma 3 VL alike)
        frozen_lm=bool(getattr(m, "freeze_language_model", False)) and getattr(m, "vision_config", None) is not None,
        dtype_bytes=compute_dtype_bytes(m),
        optimizer=optimizer_name(opt)[0],
        layer_wise_optimizer=optimizer_name(opt)[1],
        # Gemma 2's unfused path runs megatron-core's softmax over scores in the global memory buffer
        # (gemma2_provider.py :227-231, :270), as DotProductAttention does
        attention_scores=attention_scores(m, lay.seq, lay.mbs, lay.tp, materialized=gemma2 == "unfused"),
        dsa_backend=dsa_backend(m),
        dsa_loss=float(getattr(m, "dsa_indexer_loss_coeff", 0.0) or 0.0) > 0,
        dsa_sparse_loss=bool(getattr(m, "dsa_indexer_use_sparse_loss", False)),
        packed_sequences=packed_sequences(cfg),
        gpu_arch=arch,
        mcore_attention=mcore_attention(m) or gemma2 == "unfused",
        hidden_dropout=float(getattr(m, "hidden_dropout", 0.0) or 0.0) > 0,
        attention_dropout=float(getattr(m, "attention_dropout", 0.0) or 0.0) > 0,
        gemm_workspace_bytes=gemm_workspaces(arch, env, te=te, te_grouped_gemm=te and bool(experts) and bool(
            getattr(m, "moe_grouped_gemm", False)) and not getattr(m, "moe_use_legacy_grouped_gemm", False)))
    if settings.dtype_bytes == FP32:
        # fp32 training: fp32 parameters are their own masters (DistributedOptimizer shard_fp32_groups /
        # FP32Optimizer: no main copy), gradients are fp32, and the loss reads fp32 logits (.float() is a no-op;
        # tensor_parallel/cross_entropy.py works in place on them)
        settings = replace(settings, param_bytes=FP32 if not (fp8_params or fp4_params) else settings.param_bytes, grad_bytes=FP32,
                           master_bytes=0, logits_bytes=FP32 if settings.cross_entropy_impl == "unfused"
                           else settings.logits_bytes)
    from .levers import apply_config   # issue 31's levers (memory/levers.py)
    return shape, lay, apply_config(cfg, settings)
