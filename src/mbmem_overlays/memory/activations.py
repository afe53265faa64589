"""Activations one layer keeps for its backward, per token of a microbatch, block by block (attention, MLP, MoE,
Mamba, LoRA), and what selective recompute drops."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from . import variants
from .inputs import BF16, FP4_LAYOUT, FP8, FP32, Layout, Settings, Shape, _tokens, quantized_params
from .pipeline import blocks_of, runs_bf16

def attention_scores_bytes(st: Settings, lay: Layout) -> float:
    """Bytes a non-fused attention keeps per score element (per head, query and key position) for its backward.

    megatron-core's DotProductAttention (transformer/dot_product_attention.py:194-239, the ``local`` and, alike,
    TE's ``unfused`` backend): baddbmm scores -> scale_mask_softmax -> attention_dropout -> bmm with v. The fused
    scaled masked softmax kernel (fusions/fused_softmax.py is_kernel_available: bf16/fp16 input, 16 < s <= 4096)
    saves its output in the input dtype, which the bmm also keeps; torch's fallback (forward_torch_softmax)
    upcasts to fp32, saves the fp32 softmax and casts it back for the bmm (a second tensor in the compute dtype).
    With attention dropout the dropout keeps a bool mask and the bmm keeps the dropped probabilities instead."""
    if not st.attention_scores:
        return 0.0
    # torch's softmax upcasts only with attention_softmax_in_fp32 (fused_softmax.py forward_torch_softmax
    # :313-336: input.float() and the cast back both sit under softmax_in_fp32), else it runs in the compute dtype
    torch_softmax = FP32 if st.softmax_fp32 else st.dtype_bytes
    softmax = st.dtype_bytes if st.attention_scores == "fused_softmax" else torch_softmax
    if st.attention_dropout:
        return softmax + 1.0 + st.dtype_bytes
    return softmax + (st.dtype_bytes if softmax != st.dtype_bytes else 0.0)


def kernel_output_apart(lay: Layout, st: Settings) -> bool:
    """Whether the attention kernel saves its output as a tensor of its own, apart from the one the layer passes on
    (which linear_proj, or the output gate, keeps): with a fused kernel both are one tensor.

    - TE's all-to-all context parallelism (cp_comm_type a2a, and a2a+p2p; TE v2.17.1
      attention/dot_product_attention/context_parallel.py AttnFuncWithCPAndQKVOA2A.forward :4185-4283 saves
      ``out_part``, the kernel's output over the whole sequence and 1/CP of the heads, and returns the output of
      the all-to-all back, a new tensor; AttnFuncWithCPAndKVP2P with cp_size_a2a > 1 :2074-2193 alike). The p2p
      ring and all-gather save the output they return (:2122-2193, :3393-3441).
    - Gemma 2's FlexAttention path (gemma2_provider.py Gemma2FlexDotProductAttention.forward :382-401): flex
      attention saves its [b, heads, s, d] output, and the layer gets ``out.permute(...).contiguous()``."""
    a2a = lay.cp > 1 and st.cp_comm in ("a2a", "a2a+p2p") and not st.attention_scores
    return a2a or st.attn_softcap == "flex"


def latent_width(s: Shape) -> int:
    """The width of the tokens the MoE dispatcher moves and the routed experts read and write: moe_latent_size
    with latent MoE (Shape.moe_latent), else the hidden size."""
    return s.moe_latent or s.hidden


def flex_group(lay: Layout) -> int:
    """Ranks of the flex dispatcher's communication group: expert TP x EP (token_dispatcher.py:1764-1792 use
    tp_ep_group, pg_collection.tp_ep, and fold expert TP into the experts: num_experts = tp_size x experts)."""
    return max(1, lay.etp * lay.ep)


def hybridep_nodes(lay: Layout, st: Settings) -> int:
    """NVLink domains HybridEP's group spans: the group over the ranks per domain, NUM_OF_HYBRID_EP_RANKS_PER_
    NVLINK_DOMAIN when the job sets it, else what it detects (DeepEP hybrid-ep deep_ep/hybrid_ep_buffer.py
    HybridEPBuffer.__init__ detect_accessible_ranks), taken as the 8 GPUs of an NVLink node."""
    group = flex_group(lay)
    per_domain = st.flex_nvl_ranks or min(group, 8)
    return max(1, group // max(1, per_domain))


def dispatcher_terms(s: Shape, lay: Layout, st: Settings) -> dict[str, float]:
    """Bytes per token of a microbatch that the flex dispatcher keeps from one MoE layer's forward to its backward,
    beside what the experts keep (their saved tensors are sized as with alltoall: each token goes to the expert TP
    ranks of its experts' EP rank, token_dispatcher.py:1827-1854 _initialize_metadata).

    Both backends save only a handle for the backward (megatron-core fused_a2a.py: FusedDispatch / FusedCombine and
    HybridEPDispatch / HybridEPCombine keep ctx.handle, no token tensor), but the handle holds routing metadata per
    token the dispatcher saw (N: this rank's sequence-local tokens; R: the expert TP x EP group; L: local experts):

    - DeepEP (v1.2.1, the Buffer API fused_a2a.py calls): intranode (R <= 8) is_token_in_rank [N, R] bool and
      send_head [N, R] int32, recv_src_idx [received] int32 (csrc/deep_ep.cpp:268, :473, :476); internode
      is_token_in_rank, send_rdma_head [N, R / 8] int32, recv_src_meta [received, 8] bytes and send_nvl_head
      [received, 8] int32 (:851-855). torch.topk in setup_metadata (token_dispatcher.py:1291) saves its int64
      indices [N, topk x expert TP] for its backward, and _indices_to_multihot's index_put (:1354-1355) its two
      int64 index vectors, one entry per received (token, expert) pair. A token is received once per EP rank it
      picks (at most min(topk, EP) of them, on each expert TP rank).
    - HybridEP (DeepEP's hybrid-ep branch, commit 94a9f8f, dispatch_with_permute as token_dispatcher.py:1142
      calls it): csrc/hybrid_ep/executor/executor.cu metadata_preprocess_core :93-129: sparse_to_dense_map
      [N x nodes, ranks per domain] int32, local_expert_routing_map [N x R, L] bool, dense_to_expert_map
      [N x R, L] int32, rdma_to_attn_map [N, nodes] and attn_to_rdma_map [N, nodes - 1] bool.
    """
    if st.moe_dispatcher != "flex":
        return {}
    sp_div = lay.tp if lay.sp else 1
    group = flex_group(lay)
    local_experts = max(1, s.experts // max(1, lay.ep))
    if st.flex_backend == "deepep":
        received = min(s.topk, lay.ep) * lay.etp / sp_div * st.moe_load     # per token of the sequence
        pairs = s.topk * lay.etp / sp_div * st.moe_load
        if group <= 8:
            per_local = group * (1 + 4)                      # is_token_in_rank, send_head
            per_received = 4                                 # recv_src_idx
        else:
            per_local = group + 4 * (group // 8)             # is_token_in_rank, send_rdma_head
            per_received = 8 + 4 * 8                         # recv_src_meta, send_nvl_head
        topk_indices = 8 * s.topk * lay.etp                  # torch.topk's saved int64 indices
        return {"moe_dispatch_handle": (per_local + topk_indices) / sp_div + per_received * received + 16 * pairs}
    if st.flex_backend == "hybridep":
        nodes = hybridep_nodes(lay, st)
        per_local = 4 * group + 5 * group * local_experts + nodes + (nodes - 1)
        return {"moe_dispatch_handle": per_local / sp_div}
    return {}


# Bytes per element of a quantized tensor's columnwise layout, with its scales, per FP8 recipe (TE v2.17.1):
# MXFP8 one E8M0 scale per 32 elements (tensor/mxfp8_tensor.py, MXFP8_BLOCK_SCALING_SIZE), blockwise one fp32 per
# 1 x 128 block of an activation and per 128 x 128 block of a weight (tensor/float8_blockwise_tensor.py), per-tensor
# scaling (delayed, tensorwise) one scalar per tensor
_ACT_SCALES = {"mxfp8": 1 / 32, "blockwise": 4 / 128}
_WEIGHT_SCALES = {"mxfp8": 1 / 32, "blockwise": 4 / (128 * 128)}


def quantized_bytes(recipe: str, weight: bool = False) -> float:
    """Bytes per element of one FP8 layout (data and scales) of an activation or, ``weight``, a weight; NVFP4's
    (inputs.FP4_LAYOUT: a 16x16 weight block shares one scale, but TE stores it per 16 values of each row,
    nvfp4_tensor.py get_scale_shape :249-283, so a weight's layout is as large as an activation's)."""
    if recipe == "nvfp4":
        return FP4_LAYOUT
    return FP8 + (_WEIGHT_SCALES if weight else _ACT_SCALES).get(recipe, 0.0)


def local_expert_params(s: Shape, lay: Layout) -> float:
    """The routed experts' FC1 and FC2 weight elements one GPU holds for one MoE layer (weights._block_params)."""
    width = latent_width(s)
    return s.experts * ((2 if s.gated else 1) + 1) * s.moe_ffn * width / (max(1, lay.ep) * max(1, lay.etp))


def op_fuser_terms(s: Shape, lay: Layout, st: Settings, routed: float, width: int,
                   keeps_input: Any) -> dict[str, float]:
    """Bytes per token the routed experts' grouped MLP keeps when TE's operation fuser runs it
    (use_transformer_engine_op_fuser: megatron-core moe/experts.py :286-290; TEGroupedMLP._fused_forward :616-718
    calls a te.ops.Sequential of GroupedLinear, ScaledSwiGLU / ScaledClampedQGeGLU / ScaledSReLU and GroupedLinear
    built on the modules' own parameters, _make_fused_ops).

    - Basic ops (``st.moe_op_fuser == "ops"``; TE v2.17.1 ops/basic/grouped_linear.py fuser_forward
      :911-1016, _fuser_forward_split_quantize :1090-1150 and _fuser_forward_grouped_tensor :1250-1330;
      ops/basic/swiglu.py _ScaledGLU.fuser_forward :416-466; ops/basic/activation.py ScaledSReLU.fuser_forward
      :385-420): FC1 saves its input for the weight gradient, the scaled activation its input (FC1's output, in
      the compute dtype) and the router's probabilities, FC2 its input; under FP8 each GEMM input only in its
      columnwise layout (``rowwise_data = None``). The ops keep no FP8 weight cache across microbatches: with
      bf16 weights and FP8 compute each forward quantizes the local experts' weights and saves their columnwise
      copies for the data gradient (``saved.extend(ws)``, ``w.update_usage(rowwise_usage=False,
      columnwise_usage=True)``).
    - The fused grouped MLP (``"fused"``; ops/fused/grouped_mlp.py _GroupedMLP_CuTeGEMMBase.fuser_forward
      :863-1493): FC1's input as MXFP8 columnwise data and scales, the activation's input (the kernel's bf16
      ``c_tensor``), the probabilities, FC2's input as MXFP8 columnwise data and scales (none for the squared
      ReLU under ``moe_act`` recompute, recompute_srelu_fc2_x :1436-1443), and with bf16 weights their MXFP8
      copies in both layouts (quantized with rowwise and columnwise usage, saved in fc1_ctx.save_for_backward)."""
    # an FP8 job's bf16 layers run outside fp8_autocast, where TE fuses nothing (fuse_grouped_mlp_ops :704-705:
    # no MXFP8 / NVFP4 recipe): their ops run unfused
    fused = st.moe_op_fuser == "fused" and st.fp8
    quant = st.moe_op_quant if st.fp8 else ""
    D = st.dtype_bytes
    gemm_in = quantized_bytes(quant) if quant else D
    terms: dict[str, float] = {}
    if keeps_input("linear_fc1"):
        terms["moe_permuted_input"] = routed * lay.etp * gemm_in * width
    # the fused kernel writes the activation's input as bf16 (c_dtype); the basic op dequantizes to the compute dtype
    terms["moe_fc1_output"] = routed * (BF16 if fused else D) * (2 if s.gated else 1) * s.moe_ffn
    if keeps_input("linear_fc2"):
        terms["moe_act_output"] = routed * gemm_in * s.moe_ffn
    if quant and not quantized_params(st) and (keeps_input("linear_fc1") or keeps_input("linear_fc2")):
        layouts = 2 if fused else 1
        terms["moe_op_weight_copies"] = layouts * quantized_bytes(quant, weight=True) * local_expert_params(
            s, lay) / _tokens(lay)
    return terms


def paged_stash_active(st: Settings) -> bool:
    """Whether moe_paged_stash moves anything: its saved-tensor hook (moe/paged_stash.py
    PagedStashManager.on_save_for_backward :679-690) takes only tensors TE marks with grouped_tensor_scale_inv,
    which in TE v2.17.1 only the fused grouped MLP does (utils.py mark_grouped_tensor :307-327, called by
    ops/fused/grouped_mlp.py :1429); experts.py enters the stash context only in _fused_forward (:654-670)."""
    return bool(st.paged_stash_cuda) and st.moe_op_fuser == "fused" and st.fp8


# the fused grouped MLP's saved tensors the paged stash moves into its buffers (mark_grouped_tensor(grouped_fc1_x,
# activation_in, scales, grouped_fc2_x)); the weights' copies are not marked and stay
PAGED_STASH_TERMS = ("moe_permuted_input", "moe_fc1_output", "moe_act_output")


def mamba_activation_terms(s: Shape, lay: Layout, st: Settings, ln_out: float, gemm_in: float,
                           keeps_input: Any) -> dict[str, float]:
    """Bytes per token one Mamba mixer keeps for backward on one GPU, beside its layer's norm input and dropout
    mask (megatron-core 0.19.2 ssm/mamba_mixer.py MambaMixer.forward / _ssm_training, the training path with
    ``use_mamba_mem_eff_path``, its default).

    - in_proj is TELayerNormColumnParallelLinear (models/hybrid/hybrid_layer_specs.py hybrid_stack_spec): the
      fused norm's output is its GEMM input, kept sequence-local as for the other blocks.
    - ``rearrange(zxBCdt, "l b d -> b l d").contiguous()`` (mamba_mixer.py:739) copies in_proj's output; the copy
      is what mamba_split_conv1d_scan_combined saves (mamba_ssm ops/triton/ssd_combined.py
      MambaSplitConv1dScanCombinedFn.forward ``ctx.save_for_backward(zxbcdt, ..., out_x, ...)``), in_proj's own
      output is freed. Per token: z and x (d_inner), B and C (ngroups x d_state each), dt (nheads), over TP. With
      CP the all-to-all gives each rank the whole sequence and 1/CP of the channels; B and C are repeated when CP
      exceeds the local groups (mamba_context_parallel.py pre_conv_ssm: group_repeat_count), so per local token
      the B and C width is max(ngroups / TP, CP) x d_state each.
    - ``out_x``, the scan output before the z gate (with the D skip), d_inner in the compute dtype; the conv
      output, dt, dA_cumsum and the chunk states are recomputed in backward (ssd_combined.py backward:
      "Recompute x, B, C", _mamba_chunk_scan_combined_bwd), the gated output is returned and not kept.
    - The gated output is rearranged back to ``l b d`` with ``.contiguous()`` (mamba_mixer.py:775), a new tensor,
      and the group RMSNorm (ExtendedRMSNorm = mamba_ssm ops/triton/layernorm_gated.py RMSNorm; LayerNormFn
      ``ctx.save_for_backward(x, weight, bias, mean, rstd, z)``) keeps that input and one fp32 rstd per group.
    - out_proj (TERowParallelLinear) keeps the norm's output as its input for the weight gradient (a quantized
      copy under FP8, as FC2's input)."""
    t = lay.tp
    D = st.dtype_bytes
    inner = s.mamba_heads * s.mamba_head_dim / t
    bc = 2 * max(s.mamba_groups / t, lay.cp) * s.mamba_state
    terms: dict[str, float] = {}
    if keeps_input("in_proj"):
        terms["mamba_layernorm_output"] = ln_out * s.hidden / (t if lay.sp else 1)
    terms["mamba_in_proj_output"] = D * (2 * inner + bc + s.mamba_heads / t)
    terms["mamba_scan_output"] = D * inner
    terms["mamba_norm_input"] = D * inner + FP32 * s.mamba_groups / t
    if keeps_input("out_proj"):
        terms["mamba_out_proj_input"] = (D if st.lora_rank > 0 else gemm_in) * inner
    return terms


def layer_activation_terms(s: Shape, lay: Layout, st: Settings, kind: str = "attn+mlp") -> dict[str, float]:
    """Bytes kept per token of one microbatch for one layer of ``kind`` on one GPU (before recompute)."""
    if runs_bf16(kind) and st.fp8:
        # one of an FP8 job's first/last layers kept in bf16: it runs outside fp8_autocast
        # (transformer_block.py:651-652 / hybrid_block.py:364-365 get_fp8_context(config, layer_number - 1) returns a
        # nullcontext for it, fp8_utils.py:686, :792), so TE saves bf16 GEMM inputs and no quantized copies
        st = replace(st, fp8=False)
    t = lay.tp
    D = st.dtype_bytes   # the compute dtype: bf16 (2) or, training in fp32, 4
    sp_div = t if lay.sp else 1   # LayerNorm-region tensors are split across TP only with SP
    # one saved layout of a quantized GEMM input: FP8's byte, or NVFP4's packed nibbles with their E4M3 scales (TE
    # v2.17.1 module/linear.py :559-560 keeps only the columnwise layout; Settings.quant_bytes)
    gemm_in = st.quant_bytes if st.fp8 else D
    # frozen base weights: LoRA's, or a VL provider's freeze_language_model (model.freeze sets requires_grad False
    # on every language-model parameter, qwen_vl/modelling_qwen3_vl/model.py:479-490): the backward still runs
    # through the layers to what trains before them, but no GEMM keeps its input for a weight gradient
    frozen = st.lora_rank > 0 or st.frozen_lm
    # A LoRA adapter asks TE for the norm output, which turns off the quantized norm: it is then kept in bf16.
    ln_out = D if frozen else gemm_in

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
            terms[f"lora_a_gathered_input_{target}"] = D * s.hidden

    terms: dict[str, float] = {}
    blocks = blocks_of(kind)
    # Every block's norm input (the residual stream) is kept for the norm's backward; TE fuses the norm into
    # the block's first GEMM.
    for block in blocks:
        terms[f"{block}_layernorm_input"] = D * s.hidden / sp_div
    if "attn" in blocks or "mla" in blocks:
        # a hybrid stack's "+" layer is MLA whatever model.multi_latent_attention says of its "*" layers
        a = replace(s, mla=True) if "mla" in blocks else s
        # the norm output is the QKV GEMM input, kept sequence-local (TE re-gathers it in backward)
        if keeps_input("linear_qkv"):
            terms["attention_layernorm_output"] = ln_out * s.hidden / sp_div
        if a.mla:
            terms["attention_qkv"] = D * s.heads * (2 * (s.qk_head_dim + s.qk_pos_dim) + s.v_head_dim) / t
            terms["mla_up_proj_inputs"] = D * (s.kv_lora_rank + (s.q_lora_rank or 0)) / sp_div
        else:
            # The attention kernel keeps q, k, v: RoPE returns new q and k, and TE copies the strided v view out
            # of the QKV output (get_qkv_layout finds no layout for the mix and makes all three contiguous), so
            # the QKV output itself is freed: together the same size as that output.
            terms["attention_qkv"] = D * (s.heads + 2 * s.groups) * s.head_dim / t
            if s.qk_norm:
                # q/k LayerNorm (Qwen3): TE's norm saves a contiguous copy of its input (ops/basic/rmsnorm.py)
                terms["attention_qk_norm_inputs"] = D * (s.heads + s.groups) * s.head_dim / t
        if st.attention_scores:
            # non-fused attention keeps the s x s scores per head (attention_scores_bytes), not the fused
            # kernel's softmax statistics
            terms["attention_scores"] = attention_scores_bytes(st, lay) * s.heads / t * lay.seq / lay.cp
        else:
            terms["attention_softmax_stats"] = FP32 * s.heads / t
        # The fused attention kernel keeps its bf16 output for its own backward. linear_proj keeps that same
        # tensor as its input when it computes a bf16 weight gradient (its own, or an adapter's); under FP8 it
        # keeps a quantized copy instead. core_attn recompute checkpoints the kernel with only q, k, v saved
        # (attention.py _checkpointed_attention_forward -> random.py CheckpointFunction save_for_backward(*args)),
        # so the kernel's copy is then dropped unless linear_proj holds the same tensor.
        out = D * s.heads * (s.v_head_dim or s.head_dim) / t
        if (keeps_input("linear_proj") and (frozen or not st.fp8)) or "core_attn_output" in st.without:
            terms["attention_output"] = out
        elif not st.attention_scores or "unfused_attention_output" in st.without:
            terms["attention_kernel_output"] = out
        if s.attn_gate and not a.mla:
            # attention_output_gate (attention.py get_query_key_value_tensors :1835-1940, _apply_output_gate
            # :1624-1630, under torch.compile): the product x * sigmoid(gate) keeps the gate and its input, the
            # kernel's output, which core_attn recompute then cannot drop; linear_proj keeps the gated product,
            # a new tensor (its bf16 input above, or the quantized copy under FP8)
            terms.pop("attention_kernel_output", None)
            terms["attention_gate"] = D * s.heads * s.head_dim / t
            terms["attention_gate_input"] = out
        # A non-fused attention ends in bmm(probs, v), which saves its inputs, not its output (megatron-core
        # dot_product_attention.py:239; TE v2.17.1 attention/dot_product_attention/backends.py
        # UnfusedDotProductAttention.forward: torch.bmm(attention_probs, value_layer), then a permuted copy for
        # linear_proj): only linear_proj's own saved input (above, or its FP8 copy) stays
        if st.fp8 and not frozen:
            terms["attention_output_fp8"] = st.quant_bytes * s.heads * (s.v_head_dim or s.head_dim) / t
        if kernel_output_apart(lay, st):
            terms["attention_kernel_output"] = out
        if st.attn_softcap == "unfused":
            # Gemma 2's materialized scores (gemma2_provider.py Gemma2DotProductAttention.forward :242,
            # logit_softcapping :418-423): scale * tanh(scores / scale), whose tanh keeps its output for the
            # backward, one more score-sized tensor in the compute dtype beside the softmax's
            terms["attention_softcap"] = st.dtype_bytes * s.heads / t * lay.seq / lay.cp
        if s.rope_tables_bytes and not a.mla:
            # Qwen3VLSelfAttention's apply_rotary_pos_emb_absolute (qwen_vl/modelling_qwen3_vl/rope.py:455-496):
            # megatron-core's unfused _apply_rotary_pos_emb_bshd (rope_utils.py:133-136) makes cos_ and sin_ for q
            # and again for k, and each product with the rotated tensor saves its table (the tables need no
            # gradient): four [s, b, 1, head_dim] tensors per layer, not split over TP
            terms["attention_rope_tables"] = 4 * s.rope_tables_bytes * s.head_dim
        lora_gathered("linear_qkv")
    if "mlp" in blocks:
        if keeps_input("linear_fc1"):
            terms["mlp_layernorm_output"] = ln_out * s.hidden / sp_div
        terms["mlp_fc1_output"] = D * (2 if s.gated else 1) * s.ffn / t
        if s.gated and not st.swiglu_fused:
            # unfused SwiGLU is silu(a) * (b + glu_linear_offset) (mlp.py glu): autograd keeps silu(a) for the
            # product's backward, and b + offset too, a new tensor (b is a view of FC1's output, the offset a
            # Python float: the sum is materialized even at 0.0); a clamped a (activation_func_clamp_value) is
            # a new tensor that silu keeps as its input
            terms["mlp_silu_output"] = D * s.ffn / t
            if "glu_linear_copy" not in st.without:
                terms["mlp_glu_linear_input"] = D * s.ffn / t
                if st.glu_clamped:
                    terms["mlp_glu_clamped_input"] = D * s.ffn / t
        if keeps_input("linear_fc2"):
            terms["mlp_act_output"] = (D if frozen else gemm_in) * s.ffn / t
        lora_gathered("linear_fc1")
    if "moe" in blocks:
        # Each rank routes its own sequence-local tokens (megatron-core needs SP with TP for MoE) topk times.
        # Expert-TP all-gathers the dispatched tokens across its group and splits the FFN: the expert input
        # grows ETP-fold, the FFN activations per rank stay the same (token_dispatcher.py, alltoall).
        routed = s.topk / sp_div * st.moe_load
        # What is dispatched and what the routed experts read and write: the latent width with latent MoE
        # (moe_layer.py:482-483 fc1_latent_proj before dispatch_preprocess; experts.py:218, :240 and mlp.py:220-245
        # size the experts' FC1 input and FC2 output to moe_latent_size), else the hidden size
        width = latent_width(s)
        # MoE layers have a separate (unfused) pre-MLP norm; the router's gating function saves its output
        # whether or not the router trains (moe_utils.py RouterGatingLinearFunction)
        terms["moe_layernorm_output"] = D * s.hidden / sp_div
        terms["moe_router"] = FP32 * s.experts / sp_div
        if width != s.hidden:
            # The latent projections are TELinear with parallel_mode "duplicated" (moe_layer.py:273-296): each TP
            # rank runs them on its own sequence-local tokens. fc1_latent_proj saves its input for the weight
            # gradient: in bf16 the pre-MLP norm output the router keeps already (the same tensor), under FP8
            # its own quantized copy. fc2_latent_proj (moe_layer.py:584-585, after combine_postprocess) saves the
            # combined latent tokens, which nothing else keeps (the combine returns a new tensor; the unpermute
            # keeps only its row map).
            if st.fp8 and keeps_input("fc1_latent_proj"):
                terms["moe_latent_fc1_input_fp8"] = st.quant_bytes * s.hidden / sp_div
            if keeps_input("fc2_latent_proj"):
                terms["moe_latent_fc2_input"] = gemm_in * width / sp_div
        if keeps_input("linear_fc1"):  # grouped GEMMs keep inputs only for a weight gradient (grouped_linear.py)
            terms["moe_permuted_input"] = routed * lay.etp * D * width
        terms["moe_fc1_output"] = routed * D * (2 if s.gated else 1) * s.moe_ffn
        if s.gated and not st.swiglu_fused:
            terms["moe_silu_output"] = routed * D * s.moe_ffn
            if "glu_linear_copy" not in st.without:  # experts.py bias_act_func glu: as the dense MLP's
                terms["moe_glu_linear_input"] = routed * D * s.moe_ffn
                if st.glu_clamped:
                    terms["moe_glu_clamped_input"] = routed * D * s.moe_ffn
        if st.moe_probs_mul and "glu_linear_copy" not in st.without:
            # without the fused weighted activation the expert output of the activation is multiplied by the
            # routing probabilities afterwards (experts.py bias_act_func: intermediate * permuted_probs), and that
            # product keeps its bf16 input for the probabilities' gradient
            terms["moe_probs_mul_input"] = routed * D * s.moe_ffn
        if keeps_input("linear_fc2"):
            terms["moe_act_output"] = routed * (D if frozen else gemm_in) * s.moe_ffn
        if st.moe_op_fuser:
            # TE's operation fuser runs the grouped MLP instead of TEGroupedMLP's modules (op_fuser_terms): its
            # scaled activation keeps only its input, so no GLU copies nor probability-weighted input
            for name in ("moe_permuted_input", "moe_fc1_output", "moe_silu_output", "moe_glu_linear_input",
                         "moe_glu_clamped_input", "moe_probs_mul_input", "moe_act_output"):
                terms.pop(name, None)
            terms.update(op_fuser_terms(s, lay, st, routed, width, keeps_input))
            if paged_stash_active(st):
                # moe_paged_stash copies the marked tensors into its buffers once the next group starts and
                # frees them (paged_stash.py stash_paged_tensors :473, wait_for_stash_to_complete :499-509): they are
                # planned in buffers.paged_stash_buffer and stage_activations' reload working set instead
                for name in PAGED_STASH_TERMS:
                    terms.pop(name, None)
        # One bf16 hidden state per routed token, the experts' output. A build that applies the routing
        # probabilities at unpermute keeps it as that product's input; megatron-core 0.19.2 applies them inside the experts
        # (experts.py:850-879) and its unpermute keeps only a row map, yet the measured runs (bench/plan_corpus.py,
        # bench/plan_accuracy.py's Moonlight rows) hold a tensor of this size: kept, and open (docs/memory-model.md)
        terms["moe_unpermute_input"] = routed * D * width
        terms.update(dispatcher_terms(s, lay, st))
        if s.shared_ffn:
            terms["shared_expert"] = (D * (2 if s.gated else 1) + gemm_in) * s.shared_ffn / t
            lora_gathered("linear_fc1")  # the shared expert's adapter is an ordinary column-parallel one
            if s.shared_gate:
                # moe_shared_expert_gate: output * sigmoid(linear(x, gate_weight)) (moe/shared_experts.py forward
                # :196-202; with the overlap pre_forward_comm :238-240 and get_output :355-357) keeps the shared
                # expert's output (linear_fc2's, sequence-local under SP) and the gate (sigmoid saves its output,
                # the product the same tensor); linear's input is the pre-MLP norm's output, kept already
                terms["shared_expert_gate"] = D * (s.hidden + 1) / sp_div
    if "mamba" in blocks:
        terms.update(mamba_activation_terms(s, lay, st, ln_out, gemm_in, keeps_input))
        lora_gathered("in_proj")
    if variants.GDN in blocks:
        terms.update(variants.gdn_activation_terms(s, lay, st, ln_out, gemm_in, keeps_input))
        lora_gathered("in_proj")
    for block in (variants.DSA, variants.DSA_SHARED):
        if block in blocks:
            terms.update(variants.dsa_activation_terms(s, lay, st, ln_out, computes_topk=block == variants.DSA))
    if st.hidden_dropout:
        # every block ends in a bias-dropout-add (fusions/fused_bias_dropout.py _bias_dropout_add_func:
        # F.dropout(x, p) before the residual add, sequence-local under SP); torch keeps the bool mask for the
        # backward (aten native_dropout, 1 byte per element; p = 0 returns the input: Dropout.cpp _dropout), and
        # the torch.compile'd fusion (jit.py jit_fuser) saves the same mask since random ops are not recomputed
        for block in blocks:
            terms[f"{block}_dropout_mask"] = 1.0 * s.hidden / sp_div
    if st.lora_rank:
        terms["lora_intermediates"] = 2 * D * st.lora_rank * len(st.lora_targets)
    return terms


RECOMPUTE_DROPS = {  # selective label -> terms it discards (activation-recompute skill, Decision Table)
    "core_attn": ("attention_softmax_stats", "attention_kernel_output", "attention_scores", "attention_softcap",
                  *variants.RECOMPUTE_DROPS["core_attn"]),
    # the MLP checkpoint (TE: the pre-MLP norm is fused into FC1) keeps only its input
    "mlp": ("mlp_layernorm_output", "mlp_fc1_output", "mlp_silu_output", "mlp_glu_linear_input",
            "mlp_glu_clamped_input", "mlp_act_output", "lora_a_gathered_input_linear_fc1"),
    # "layernorm" checkpoints only norms that are separate modules: with TE's fused norm+GEMM the input norm is
    # an IdentityOp and is skipped (transformer_layer.py: recompute_input_layernorm); MoE's pre-MLP norm is separate
    "layernorm": ("moe_layernorm_output",),
    "moe_act": ("moe_silu_output", "moe_glu_linear_input", "moe_glu_clamped_input", "moe_probs_mul_input",
                "moe_act_output"),
    # The MoE checkpoint's saved input is the pre-MLP norm output (moe/moe_layer.py: tensor_parallel.checkpoint(
    # custom_forward, False, hidden_states, ...)): it stays unless "layernorm" drops it as well. custom_forward
    # runs preprocess (fc1_latent_proj), the dispatch and postprocess (fc2_latent_proj) too (moe_layer.py:651-692),
    # so the latent projections' inputs and the dispatcher's handle go with it.
    "moe": ("moe_permuted_input", "moe_fc1_output", "moe_silu_output", "moe_glu_linear_input",
            "moe_glu_clamped_input", "moe_probs_mul_input", "moe_act_output", "moe_router", "moe_unpermute_input",
            "shared_expert", "moe_latent_fc1_input_fp8", "moe_latent_fc2_input", "moe_dispatch_handle",
            "shared_expert_gate", "moe_op_weight_copies"),
    # the checkpoint wraps the whole SharedExpertMLP forward, gate included (moe_layer.py:510-522)
    "shared_experts": ("shared_expert", "shared_expert_gate"),
    "mla_up_proj": ("attention_qkv", *variants.RECOMPUTE_DROPS["mla_up_proj"]),
    "gdn_norm_out": variants.RECOMPUTE_DROPS["gdn_norm_out"],
}


def recompute_drops(label: str, st: Settings) -> tuple[str, ...]:
    """The terms selective recompute label ``label`` drops in this configuration. Under TE's operation fuser
    "moe_act" is no checkpoint: experts.py passes activation_recompute_in_mlp to the scaled activation
    (_make_fused_ops :484), which only the fused squared-ReLU kernel follows, by not saving FC2's input
    (TE v2.17.1 ops/fused/grouped_mlp.py :1433-1443); the fused GLU kernel saves it still, and the basic ops raise
    (coverage.py names that job as one that cannot run)."""
    if label == "moe_act" and st.moe_op_fuser:
        return ("moe_act_output",) if st.moe_op_fuser == "fused" and st.moe_op_srelu else ()
    return RECOMPUTE_DROPS.get(label, ())


def _selected_terms(s: Shape, lay: Layout, st: Settings, kind: str) -> dict[str, float]:
    terms = layer_activation_terms(s, lay, st, kind)
    if st.recompute == "selective":
        for label in st.modules:
            for name in recompute_drops(label, st):
                terms.pop(name, None)
        if "mla_up_proj" in st.modules and any(b in (variants.DSA, variants.DSA_SHARED) for b in blocks_of(kind)):
            terms["dsa_up_proj_checkpoint_inputs"] = variants.dsa_up_proj_checkpoint_inputs(s, lay, st)
    return terms


def paged_stash_layer_bytes(s: Shape, lay: Layout, st: Settings, kind: str, load: float) -> float:
    """Bytes one layer of ``kind`` hands the paged stash per microbatch (0 without a stash or MoE): the fused
    grouped MLP's marked tensors (PAGED_STASH_TERMS) that its forward saves under this recompute, with the routed
    tokens at ``load`` times the balanced count."""
    if not paged_stash_active(st) or "moe" not in blocks_of(kind):
        return 0.0
    terms = _selected_terms(s, lay, replace(st, paged_stash_cuda=0.0, moe_load=load), kind)
    if not paged_stash_active(replace(st, fp8=st.fp8 and not runs_bf16(kind))):
        return 0.0                       # an FP8 job's bf16 layer runs the basic ops: nothing is marked
    return sum(terms.get(name, 0.0) for name in PAGED_STASH_TERMS) * _tokens(lay)


def layer_activation(s: Shape, lay: Layout, st: Settings, kind: str = "attn+mlp") -> float:
    """Bytes one layer of ``kind`` keeps per microbatch in eager mode (after selective recompute)."""
    return sum(_selected_terms(s, lay, st, kind).values()) * _tokens(lay)


# --- EP communication overlap (overlap_moe_expert_parallel_comm) and delayed weight gradients (delay_wgrad_compute)
# The combined 1F1B schedule splits each layer into schedule nodes (models/gpt/fine_grained_callables.py
# build_transformer_layer_callables :20-50): pre_dispatch_computation (attention, the pre-MLP norm, the shared
# expert, the router and the dispatch preprocess, :64-140), moe_dispatch, mlp (the dense MLP, or the routed experts
# between dispatch and combine, :173-200) and moe_combine. The terms below are those the mlp / dispatch / combine
# nodes keep; every other term of a layer is its pre-dispatch part. A dense layer's mlp node runs its pre-MLP norm,
# MLP and bias-dropout-add (its node input is kept, models/common/utils.py should_free_input :64-67).
MLP_NODE_TERMS = frozenset({
    "mlp_layernorm_input", "mlp_layernorm_output", "mlp_fc1_output", "mlp_silu_output", "mlp_glu_linear_input",
    "mlp_glu_clamped_input", "mlp_act_output", "mlp_dropout_mask", "lora_a_gathered_input_linear_fc1",
    "moe_permuted_input", "moe_fc1_output", "moe_silu_output", "moe_glu_linear_input", "moe_glu_clamped_input",
    "moe_probs_mul_input", "moe_act_output", "moe_unpermute_input", "moe_latent_fc2_input", "moe_dispatch_handle",
    "moe_dropout_mask", "moe_op_weight_copies",
})
# The GEMM inputs TE keeps for a weight gradient (linear.py / layernorm_linear.py / grouped_linear.py save them only
# when the weight needs a gradient): with delay_wgrad_compute they stay past the node's backward, with the output
# gradient beside them, until its backward_dw (TE v2.17.1 module/linear.py:1202-1213 wgrad_store.put([inputmat_total,
# grad_output]), layernorm_linear.py:1033, grouped_linear.py:1118-1119 put([inputmats, grad_output, wgrad_list]);
# the undelayed path runs the wgrad GEMM and frees the inputs there, grouped_linear.py:1121-1128)
MLP_WGRAD_INPUTS = ("mlp_layernorm_output", "mlp_act_output", "moe_permuted_input", "moe_act_output")
PRE_DISPATCH_WGRAD_INPUTS = ("attention_layernorm_output", "attention_output", "attention_output_fp8",
                             "mla_up_proj_inputs", "moe_layernorm_output", "shared_expert")


@dataclass(frozen=True)
class OverlapLayer:
    """What one layer keeps per microbatch, split at the combined 1F1B schedule's nodes (bytes): ``pre`` its
    pre-dispatch part, ``mlp`` what its mlp / dispatch / combine nodes keep, ``dispatched`` the tokens the dispatch
    hands the experts (alive while the experts run, kept or not), and, with delay_wgrad_compute, what each node's
    backward leaves for its backward_dw: ``mlp_wgrad`` (the mlp node's GEMM inputs and their output gradients) and
    ``pre_wgrad`` (the pre-dispatch node's)."""
    pre: float
    mlp: float
    dispatched: float = 0.0
    mlp_wgrad: float = 0.0
    pre_wgrad: float = 0.0


def overlap_layer(s: Shape, lay: Layout, st: Settings, kind: str) -> OverlapLayer:
    """One layer of ``kind`` split at the combined schedule's nodes (after selective recompute), bytes per
    microbatch. The output gradients the delayed wgrad keeps are TE's grad_output of each GEMM: in bf16, or under
    FP8 its columnwise quantized copy (linear.py:1110 grad_output_quantizer.set_usage(rowwise=False,
    columnwise=True); grouped_linear.py:958-968 split_quantize), one byte; a column-parallel GEMM's is its local
    output shard over the whole sequence, a row-parallel one's the gathered hidden state (TE all-gathers grad_output
    under SP before both GEMMs)."""
    terms = _selected_terms(s, lay, st, kind)
    tokens = _tokens(lay)
    mlp = sum(v for k, v in terms.items() if k in MLP_NODE_TERMS)
    pre = sum(v for k, v in terms.items() if k not in MLP_NODE_TERMS)
    blocks = blocks_of(kind)
    fp8 = st.fp8 and not runs_bf16(kind)
    g = FP8 if fp8 else st.dtype_bytes          # per element of a kept output gradient
    t = lay.tp
    width = latent_width(s)
    routed = s.topk / (t if lay.sp else 1) * st.moe_load
    dispatched = routed * lay.etp * st.dtype_bytes * width if "moe" in blocks else 0.0
    mlp_grads = pre_grads = 0.0
    if st.delay_wgrad and not (st.lora_rank or st.frozen_lm):
        if "mlp" in blocks:     # linear_fc1 (column-parallel) and linear_fc2 (row-parallel)
            mlp_grads += (2 if s.gated else 1) * s.ffn / t + s.hidden
        if "moe" in blocks:     # the experts' grouped FC1 and FC2 (TEGroupedMLP), per routed token
            mlp_grads += routed * ((2 if s.gated else 1) * s.moe_ffn + lay.etp * width)
        if "attn" in blocks and not s.mla:   # linear_qkv (column-parallel) and linear_proj (row-parallel)
            pre_grads += (s.heads + 2 * s.groups) * s.head_dim / t + s.hidden
        if "mla" in blocks or ("attn" in blocks and s.mla):
            # MLA's down projections (duplicated over TP), up projections (column-parallel) and linear_proj
            pre_grads += (s.q_lora_rank or 0) + s.kv_lora_rank + s.qk_pos_dim + s.heads * (
                2 * s.qk_head_dim + s.qk_pos_dim + s.v_head_dim) / t + s.hidden
        if "moe" in blocks and s.shared_ffn:   # the shared expert runs in the pre-dispatch node (:129)
            pre_grads += (2 if s.gated else 1) * s.shared_ffn / t + s.hidden
    mlp_wgrad = sum(terms.get(k, 0.0) for k in MLP_WGRAD_INPUTS) + g * mlp_grads
    pre_wgrad = sum(terms.get(k, 0.0) for k in PRE_DISPATCH_WGRAD_INPUTS) + g * pre_grads
    if not st.delay_wgrad:
        mlp_wgrad = pre_wgrad = 0.0
    return OverlapLayer(pre * tokens, mlp * tokens, dispatched * tokens, mlp_wgrad * tokens, pre_wgrad * tokens)
