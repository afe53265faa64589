"""The attention variants megatron-core 0.19.2 builds beside softmax attention: the gated delta net (linear
attention, ``experimental_attention_variant="gated_delta_net"``, hybrid symbol G) and DeepSeek sparse attention
(``"dsa"``: absorbed MLA with a top-k indexer, hybrid symbol D), with their parameters, what one layer keeps for
backward and which selective-recompute labels drop it; and the per-layer patterns that decide which layers they
are. Pure functions over the model's frozen dataclasses (memory/inputs.py); memory/weights.py, optimizers.py and
activations.py call them for the blocks "gdn", "dsa" (a layer that computes its top-k) and "dsa_shared" (a layer
that reuses an earlier layer's top-k: dsa_indexer_topk_freq > 1).

Sources: megatron-core 0.19.2 as installed in .venv (megatron/core/ssm/gated_delta_net/, transformer/
experimental_attention_variant/, models/gpt/experimental_attention_variant_module_specs.py) and the
flash-linear-attention kernels GatedDeltaNet calls, fla-core v0.4.2 (tag commit ca910f88, the version Megatron
Bridge 0.6.x's uv.lock pins; public repository fla-org/flash-linear-attention, read with the fetch tool).
"""

from __future__ import annotations

from typing import Any

from .inputs import BF16, FP32, Layout, Settings, Shape, _tokens

INT32 = 4
INT64 = 8

# the blocks of this file; each is a TransformerLayer's self_attention (a CUDA graph "attn" scope captures it:
# transformer/cuda_graphs.py _layer_is_graphable :2066-2072)
GDN, DSA, DSA_SHARED = "gdn", "dsa", "dsa_shared"
VARIANT_BLOCKS = (GDN, DSA, DSA_SHARED)

# fla-core v0.4.2 ops/gated_delta_rule/chunk.py chunk_gated_delta_rule_fwd: chunk_local_cumsum(g, chunk_size=64)
# and solve_tril's A of shape [B, T, H, 64]
GDN_CHUNK = 64


# ----------------------------------------------------------------------------- which layers are which
def linear_attention_pattern(freq: Any, layers: int) -> tuple[bool, ...]:
    """Per layer, whether it is a gated-delta-net layer (True) or softmax attention (False):
    experimental_attention_variant_module_specs.py get_linear_attention_pattern (:402-436): an int N makes every
    N-th layer (1-indexed) softmax attention, a list is the pattern itself (1 = linear attention)."""
    if isinstance(freq, int) and freq > 0:
        return tuple((i + 1) % freq != 0 for i in range(layers))
    if isinstance(freq, (list, tuple)) and len(freq) == layers:
        return tuple(bool(int(x)) for x in freq)
    return (True,) * layers


def dsa_reuses_topk(layer_number: int, offset: int, freq: int) -> bool:
    """Whether the 1-indexed layer ``layer_number`` reuses an earlier layer's top-k (no indexer of its own):
    transformer/experimental_attention_variant/dsa.py is_dsa_skip_topk_layer (:37-47), which DSAttention.__init__
    reads to build no indexer (:1571-1591)."""
    if freq <= 1:
        return False
    offset = max(offset, 1)
    return (max(layer_number - offset, 0) % freq) != 0


# ----------------------------------------------------------------------------- parameters
def _norm(s: Shape, size: int, bias: bool | None = None) -> list[tuple[int, bool]]:
    return [(size, False)] * (2 if (s.norm_bias if bias is None else bias) else 1)


def gdn_tensors(s: Shape, lay: Layout) -> list[tuple[int, bool]]:
    """One gated-delta-net block's parameter tensors on one GPU, (numel, a matrix Muon steps), in model order
    (ssm/gated_delta_net/common.py _GDNBase.__init__ :180-290, gdn.py _setup_variant_attrs :32-57): in_proj
    (TELayerNormColumnParallelLinear, the layer's input norm fused: hidden -> q, k, v, z, beta, alpha, no bias),
    the depthwise conv1d over q, k and v (conv_dim x 1 x kernel, conv_bias False), dt_bias and A_log (one per
    value head), out_norm (over one value head, not split across TP) and out_proj (v_dim -> hidden)."""
    h, t = s.hidden, lay.tp
    qk, v = s.gdn_key_heads * s.gdn_key_dim, s.gdn_value_heads * s.gdn_value_dim
    in_proj = (2 * qk + 2 * v + 2 * s.gdn_value_heads) // t
    conv = (2 * qk + v) // t
    return (_norm(s, h) + [(in_proj * h, True), (conv * s.gdn_conv, False)]
            + [(s.gdn_value_heads // t, False)] * 2 + _norm(s, s.gdn_value_dim) + [(h * v // t, True)])


def mla_tensors(s: Shape, lay: Layout) -> list[tuple[int, bool]]:
    """Absorbed MLA's parameter tensors on one GPU (MLA's weights: experimental_attention_variant/absorbed_mla.py
    :140-388): the separate input norm, q down/up (or one q projection), kv down/up, linear_proj, and the q and kv
    norms where the spec builds them (Shape.dsa_qkv_norms: build_module of an IdentityOp makes no weight,
    :375-388)."""
    h, t = s.hidden, lay.tp
    dense = _norm(s, h)
    qk = s.qk_head_dim + s.qk_pos_dim
    if s.q_lora_rank:
        dense += [(s.q_lora_rank * h, True), (s.heads * qk // t * s.q_lora_rank, True)]
        dense += _norm(s, s.q_lora_rank) if s.dsa_qkv_norms else []
    else:
        dense += [(s.heads * qk // t * h, True)]
    dense += [((s.kv_lora_rank + s.qk_pos_dim) * h, True),
              (s.heads * (s.qk_head_dim + s.v_head_dim) // t * s.kv_lora_rank, True)]
    dense += _norm(s, s.kv_lora_rank) if s.dsa_qkv_norms else []
    dense += [(h * s.heads * s.v_head_dim // t, True)]
    return dense


def dsa_indexer_tensors(s: Shape) -> list[tuple[int, bool]]:
    """The DSA indexer's parameters (dsa.py DSAIndexer.__init__ :1101-1208), on every TP rank whole
    (parallel_mode "duplicated"): linear_wq_b (q_lora_rank, or hidden without one, -> heads x head_dim),
    linear_wk (hidden -> head_dim), k_norm (a LayerNorm whatever the model's normalization: weight and bias) and
    linear_weights_proj (hidden -> heads)."""
    q_in = s.q_lora_rank or s.hidden
    return [(q_in * s.dsa_heads * s.dsa_head_dim, True), (s.hidden * s.dsa_head_dim, True),
            *_norm(s, s.dsa_head_dim, bias=True), (s.hidden * s.dsa_heads, True)]


def block_tensors(s: Shape, lay: Layout, block: str) -> list[tuple[int, bool]]:
    """The parameter tensors of one block of this file on one GPU (dense; none are experts)."""
    if block == GDN:
        return gdn_tensors(s, lay)
    if block == DSA:
        return mla_tensors(s, lay) + dsa_indexer_tensors(s)
    if block == DSA_SHARED:
        return mla_tensors(s, lay)
    raise ValueError(f"unknown attention-variant block {block!r}")


def block_params(s: Shape, lay: Layout, block: str) -> float:
    return float(sum(n for n, _ in block_tensors(s, lay, block)))


# ----------------------------------------------------------------------------- activations
def gdn_activation_terms(s: Shape, lay: Layout, st: Settings, ln_out: float, gemm_in: float,
                         keeps_input: Any) -> dict[str, float]:
    """Bytes per token one gated delta net keeps for backward on one GPU, beside its layer's norm input and dropout
    mask (ssm/gated_delta_net/gdn.py GatedDeltaNet.forward :64-278, common.py; fla-core v0.4.2).

    With CP the all-to-all gives each rank the whole sequence and 1/CP of the heads (common.py tensor_a2a_cp2hp),
    so per local token every width below is the TP-local one.
    - in_proj (TELayerNormColumnParallelLinear, the layer's input norm fused): its GEMM input, the norm output,
      sequence-local as for the other blocks.
    - in_proj's output q, k, v, z, beta, alpha stays whole: fla's causal_conv1d saves its input without making it
      contiguous (fla modules/conv/triton/ops.py CausalConv1dFunction.forward: input_guard(no_guard_contiguous=
      ["x"]), ctx.save_for_backward(x, ...)), and that input is a split view of the transposed projection
      (gdn.py :166-171, :212-220).
    - the q/k L2 norm (common.py _prepare_input_for_gated_delta_rule :382-431, use_qk_l2norm True) saves its output
      and one fp32 rstd per head row (fla modules/l2norm.py L2NormFunction: save_for_backward(y, rstd)).
    - chunk_gated_delta_rule saves q and k repeated to the value heads (repeat_interleave, :420-424), v, g's chunk
      cumsum in fp32 (ops/utils/cumsum.py chunk_local_cumsum output_dtype float), beta and A ([.., value heads,
      64] in k's dtype: solve_tril) (ops/gated_delta_rule/chunk.py ChunkGatedDeltaRuleFunction.forward
      save_for_backward(q, q_rstd, k, k_rstd, v, g, beta, A, ...)); alpha's contiguous copy is what the softplus
      of _compute_g_and_beta (:433-446) differentiates.
    - the gated output norm (common.py _apply_gated_norm :370-380): the norm saves its input (the kernel's output)
      and one fp32 rstd per head row, the product y * silu(gate) its y and the gate (z's contiguous copy).
    - out_proj (TERowParallelLinear) keeps its input, the transposed norm output (a quantized copy under FP8).
    ``gdn_norm_out`` recompute (common.py :262-265, gdn.py :253-277: CheckpointWithoutOutput) runs the norm under
    no_grad keeping only the kernel output and the gate, and frees its output (out_proj's bf16 input) until
    backward (tensor_parallel/random.py :684-705, :830-851)."""
    t = lay.tp
    D = st.dtype_bytes
    hk, hv = s.gdn_key_heads / t, s.gdn_value_heads / t
    qk, v = hk * s.gdn_key_dim, hv * s.gdn_value_dim
    terms: dict[str, float] = {}
    if keeps_input("in_proj"):
        terms["gdn_layernorm_output"] = ln_out * s.hidden / (t if lay.sp else 1)
    terms["gdn_in_proj_output"] = D * (2 * qk + 2 * v + 2 * hv)
    terms["gdn_qk_l2norm"] = D * 2 * qk + FP32 * 2 * hk
    terms["gdn_kernel_qkv"] = D * (2 * hv * s.gdn_key_dim + v)
    terms["gdn_kernel_gates"] = FP32 * hv + D * hv + D * hv * GDN_CHUNK + D * hv   # g cumsum, beta, A, alpha
    terms["gdn_core_attn_output"] = D * v
    terms["gdn_gate"] = D * v
    terms["gdn_norm_stats"] = FP32 * hv
    terms["gdn_norm_output"] = D * v
    if keeps_input("out_proj"):
        if gemm_in == D or st.lora_rank > 0:
            terms["gdn_out_proj_input"] = D * v
        else:
            terms["gdn_out_proj_input_fp8"] = gemm_in * v
    return terms


def flash_mla_heads(heads: int, arch: int) -> int | None:
    """The query heads FlashMLA's sparse kernel runs for ``heads`` local heads, None where it cannot
    (dsa_cudnn_kernels.py _flash_mla_head_padding :348-371): on Hopper a multiple of 64 (or 64 when heads divide
    it), on Blackwell 64 or 128 when heads divide them, else a multiple of 128; nothing before SM90."""
    if arch >= 10:
        for padded in (64, 128):
            if heads == padded or (heads < padded and padded % heads == 0):
                return padded
        align = 128
    elif arch >= 9:
        align = 64
    else:
        return None
    if heads % align == 0:
        return heads
    if heads < align and align % heads == 0:
        return align
    return None


def dsa_padded_heads(heads: int, arch: int) -> int:
    """The heads the fused path's output and log-sum-exp keep storage for (_dsa_fwd_flash_mla :871-924 returns
    slices of the padded tensors): flash_mla_heads, or ``heads`` where FlashMLA declines (then the fused path does
    not run: dsa_fused)."""
    return flash_mla_heads(heads, arch) or heads


# dsa_cudnn_kernels.py _FLASH_MLA_REQUIRED_VALUE_DIM (:138): FlashMLA's sparse prefill takes a 512-wide latent value
FLASH_MLA_VALUE_DIM = 512


def dsa_fused(s: Shape, lay: Layout, st: Settings) -> bool:
    """Whether DSAttention's sparse attention runs fused: a fused backend is configured (dsa_kernels.py
    use_fused_dsa_kernels :92-97: not dsa_kernel_backend "none", megatron-core's default, which from_config also
    sets for the unfused attention backend) and FlashMLA takes the layout. Every cuDNN hook declines otherwise
    (returns None): on a GPU before SM90, a latent value width (kv_lora_rank) other than 512
    (_supports_flash_mla_value_layout :151-153) or a local head count FlashMLA cannot pad
    (_flash_mla_head_padding :348-371) decline the joint kernel (run_fused_dsa_attention :251-259), the top-k with
    the sparse loss (run_fused_qk_topk_with_loss :1424-1428) and the split path's sparse attention
    (run_fused_absorbed_sparse_attention :2601-2604), and DSAttention runs the unfused path
    (dsa.py _run_sparse_attention :148-171) with the reference indexer loss."""
    if st.dsa_backend in ("none", ""):
        return False
    heads = max(1, s.heads // max(1, lay.tp))
    return (s.kv_lora_rank == FLASH_MLA_VALUE_DIM and s.kv_lora_rank + s.qk_pos_dim >= FLASH_MLA_VALUE_DIM
            and flash_mla_heads(heads, st.gpu_arch) is not None)


def dsa_reference_loss(s: Shape, lay: Layout, st: Settings) -> bool:
    """Whether a layer that computes its top-k trains the indexer through megatron-core's reference loss
    (FusedDSAIndexerLoss: dsa.py :944 saves the indexer's q, weights, k and the int64 top-k) instead of a fused
    kernel's precomputed gradients. Always on the unfused path. On the fused path (dsa.py :2037-2219): the joint
    kernel (indexer, sparse attention and loss in one, FusedIndexerSparseAttnFunc) is tried only without index
    sharing (:2037 ``not self.index_share``), and declines the dense loss over varlen bounds
    (run_fused_dsa_attention :240-245), which context parallelism and packed sequences give
    (dsa_masking.py build_dsattention_forward_mask :465-512; only plain unpacked causal bounds are normalized
    away, dsa_cudnn_kernels.py :237-239); the split path that then runs keeps a fused top-k with the sparse loss
    (run_fused_qk_topk_with_loss, FusedQKTopKWithSparseLossFunc.forward :2468-2470: the same precomputed
    gradients) and otherwise falls back to the reference loss (dsa.py :2124-2156), beside the fused sparse
    attention (FusedSparseAttentionFunc)."""
    if not st.dsa_loss:
        return False
    if not dsa_fused(s, lay, st):
        return True
    joint = s.dsa_topk_freq <= 1 and (st.dsa_sparse_loss or not (lay.cp > 1 or st.packed_sequences))
    return not joint and not st.dsa_sparse_loss


def dsa_activation_terms(s: Shape, lay: Layout, st: Settings, ln_out: float, computes_topk: bool,
                         tokens: float | None = None) -> dict[str, float]:
    """Bytes per token one DSA attention keeps for backward on one GPU, beside its layer's norm input
    (AbsorbedMLASelfAttention with DSAttention: models/gpt/experimental_attention_variant_module_specs.py
    get_dsa_module_spec_for_backend :81-130; transformer/experimental_attention_variant/absorbed_mla.py
    get_query_key_value_tensors :390-674, forward :791-904; dsa.py DSAttention.forward :1627-2244).

    Query rows are the whole sequence of this CP rank (q_up is column-parallel: under SP it gathers), key rows the
    whole sequence (gathered over TP under SP, dsa.py :1780-1795, and over CP, :1838-1860).
    - the separate input norm's output, read by q_down and kv_down (TELinear, duplicated: sequence-local); the q
      and kv norms (qk_layernorm: unfused, the indexer reads the normalized q) save their inputs and rstd, q_up
      its input (the normalized q_compressed, ``qr``).
    - q, q_up's output, stays whole: the einsum that absorbs k_up into its non-RoPE part saves that view
      (absorbed_mla.py :565).
    - query (latent + RoPE per head) and key (one latent + RoPE row per token) are what the sparse kernel saves
      (dsa_cudnn_kernels.py FusedIndexerSparseAttnFunc.forward :2264-2274: q_flat, kv_flat, global_idxs,
      out_flat, lse; the index-sharing path FusedSparseAttentionFunc :2547 the same); the top-k indices as int32
      (_local_to_global_flat, clamp_min(0).contiguous() for backward), the latent output and fp32 log-sum-exp over
      FlashMLA's padded heads (dsa_padded_heads).
    - the V up-projection einsum (dsa_cudnn_kernels.py :303, dsa.py :173) saves the latent output (the same
      storage) and up_v_weight, a contiguous copy of the kv_up weight's V half per layer and microbatch
      (dsa.py :1665: .to(...).contiguous() of a strided slice): heads x v_head_dim x kv_lora_rank, not per token.
    - with the indexer loss (dsa_indexer_loss_coeff > 0, computing layers) the indexer runs with grad
      (dsa.py :1979): k_norm saves linear_wk's output and LayerNorm's fp32 mean and rstd, linear_wq_b and
      linear_wk/linear_weights_proj save their detached inputs (under SP gathered copies, dsa.py :1273-1275), and
      the fused kernel saves the precomputed indexer gradients (q: bf16, k: fp32, weights: bf16;
      _compute_sparse_indexer_loss_and_grads :1757-1867).
    - with index sharing (dsa_indexer_topk_freq > 1) a computing layer's top-k also waits in the per-forward
      holder for the layers that reuse it (dsa.py :2214-2218).
    - linear_proj keeps its input, the projected output (bf16: absorbed MLA saves linear_proj's original input
      under FP8, absorbed_mla.py :252-263).
    The unfused path (dsa_kernel_backend "none", the default, or attention_backend unfused:
    dsa.py _unfused_absorbed_dsa_fn :59-112) materializes the scores over every key: fp32 copies of query and key
    for the matmul, and per head, query and key 13 bytes: masked_softmax's (dsa_masking.py :356-373) three
    ``~valid_mask`` bool masks, the fp32 exp output and the fp32 masked probabilities the division saves, and the
    bf16 probabilities the matmul with the latent value saves; its indexer loss (FusedDSAIndexerLoss,
    dsa.py :944) saves the indexer's q, weights, k and the int64 top-k."""
    t, cp = lay.tp, lay.cp
    D = st.dtype_bytes
    sp_div = t if lay.sp else 1
    n = s.heads / t
    latent = s.kv_lora_rank + s.qk_pos_dim
    topk = min(s.dsa_topk, lay.seq) if s.dsa_topk else lay.seq
    fused = dsa_fused(s, lay, st)
    loss = st.dsa_loss and computes_topk
    reference = loss and dsa_reference_loss(s, lay, st)
    tokens = _tokens(lay) if tokens is None else tokens
    terms: dict[str, float] = {}
    terms["attention_layernorm_output"] = ln_out * s.hidden / sp_div
    if s.q_lora_rank:
        if s.dsa_qkv_norms:
            terms["dsa_q_norm_input"] = D * s.q_lora_rank / sp_div + FP32 / sp_div
        terms["mla_up_proj_inputs"] = D * s.q_lora_rank / sp_div
    if s.dsa_qkv_norms:
        terms["dsa_kv_norm_input"] = D * s.kv_lora_rank / sp_div + FP32 / sp_div
    terms["dsa_q_up_output"] = D * n * (s.qk_head_dim + s.qk_pos_dim)
    terms["dsa_query"] = D * n * latent
    terms["dsa_key"] = D * latent * cp
    if fused:
        padded = dsa_padded_heads(int(n) or 1, st.gpu_arch)
        terms["dsa_topk_indices"] = INT32 * topk
        terms["dsa_latent_output"] = D * padded * s.kv_lora_rank
        terms["dsa_softmax_stats"] = FP32 * padded
    else:
        terms["dsa_fp32_query_key"] = FP32 * n * latent + FP32 * latent * cp
        terms["dsa_scores"] = 13.0 * n * lay.seq
        terms["dsa_latent_output"] = D * n * s.kv_lora_rank
        if loss:
            terms["dsa_topk_indices"] = INT64 * topk
    if fused and reference:
        terms["dsa_loss_topk_indices"] = INT64 * topk     # the reference loss's, beside the kernel's int32 copy
    if s.dsa_topk_freq > 1 and computes_topk:
        # the holder keeps the top-k as made: int32 from the fused indexer, int64 from torch.topk (the reference
        # loss, fused_qk_topk_naive)
        terms["dsa_shared_topk"] = (INT64 if reference or not fused else INT32) * topk
    terms["dsa_up_v_weight"] = D * n * s.v_head_dim * s.kv_lora_rank / max(tokens, 1.0)
    if loss:
        gathered = lay.sp and t > 1
        indexer = D * s.dsa_head_dim + 2 * FP32                               # k_norm: input, mean, rstd
        if gathered:
            indexer += D * (s.q_lora_rank or s.hidden) + D * s.hidden         # gathered qr and x
        if not reference:   # the fused kernels' precomputed gradients: q and weights bf16, k fp32 (whole sequence)
            indexer += D * s.dsa_heads * s.dsa_head_dim + FP32 * s.dsa_head_dim * cp + D * s.dsa_heads
        else:               # the reference loss's q, weights and k (gathered over CP)
            indexer += D * s.dsa_heads * s.dsa_head_dim + D * s.dsa_heads + D * s.dsa_head_dim * cp
        terms["dsa_indexer"] = indexer
    terms["attention_output"] = D * n * s.v_head_dim
    return terms


# selective recompute label -> the terms above it drops (activations.RECOMPUTE_DROPS merges them)
RECOMPUTE_DROPS = {
    # the checkpointed core attention keeps its inputs (query, key, x, qr: absorbed_mla.py
    # _checkpointed_attention_forward :737-789); the indexer runs inside it
    "core_attn": ("dsa_topk_indices", "dsa_latent_output", "dsa_softmax_stats", "dsa_fp32_query_key", "dsa_scores",
                  "dsa_up_v_weight", "dsa_indexer", "dsa_shared_topk", "dsa_loss_topk_indices"),
    # qkv_up_proj_and_rope_apply under CheckpointWithoutOutput: q is recomputed, query and key are freed after the
    # core attention (absorbed_mla.py :661-673, :894-897) and come back in backward
    "mla_up_proj": ("dsa_q_up_output", "dsa_query", "dsa_key"),
    "gdn_norm_out": ("gdn_norm_stats", "gdn_norm_output", "gdn_out_proj_input"),
}


def dsa_up_proj_checkpoint_inputs(s: Shape, lay: Layout, st: Settings) -> float:
    """Bytes per token ``mla_up_proj``'s checkpoint keeps that nothing else does: the normalized kv_compressed
    (gathered under SP) and k_pos_emb, a view of kv_down's output, or a gathered copy under SP
    (absorbed_mla.py :495-527, :665-667; random.py :704 save_for_backward(*args)). Without a kv norm (a hybrid
    "D", Shape.dsa_qkv_norms) and without SP, kv_compressed too is a view of kv_down's output: one storage."""
    D = st.dtype_bytes
    if lay.sp and lay.tp > 1:
        return D * s.kv_lora_rank + D * s.qk_pos_dim
    return (D * s.kv_lora_rank if s.dsa_qkv_norms else 0.0) + D * (s.kv_lora_rank + s.qk_pos_dim)


GRAPH_TERMS = ("gdn_layernorm_input", "gdn_dropout_mask", "gdn_layernorm_output", "gdn_in_proj_output",
               "gdn_qk_l2norm", "gdn_kernel_qkv", "gdn_kernel_gates", "gdn_core_attn_output", "gdn_gate",
               "gdn_norm_stats", "gdn_norm_output", "gdn_out_proj_input", "gdn_out_proj_input_fp8",
               "dsa_layernorm_input", "dsa_dropout_mask", "dsa_shared_layernorm_input", "dsa_shared_dropout_mask",
               "dsa_q_norm_input", "dsa_kv_norm_input", "dsa_q_up_output", "dsa_query", "dsa_key",
               "dsa_topk_indices", "dsa_latent_output", "dsa_softmax_stats", "dsa_fp32_query_key", "dsa_scores",
               "dsa_shared_topk", "dsa_up_v_weight", "dsa_indexer", "dsa_up_proj_checkpoint_inputs", "dsa_loss_topk_indices",
               "mla_layernorm_input", "mla_dropout_mask")
