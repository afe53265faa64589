"""The vision encoder of a vision-language model: its parameters (patch embedding, ViT blocks, the merger or
projector), whether each part trains (freeze_vision_model, freeze_vision_projection, LoRA), where pipeline
parallelism puts it, and what it keeps for backward per microbatch, which depends on how many image patches the
microbatch carries (``VisionTower.image_tokens``: the configuration's bound, or the images a mock dataset states).

Three encoders Bridge 0.6.2's recipes build are modelled, each from its code:

- ``QWEN3_VL``: Bridge's Qwen3VLVisionModel (models/qwen_vl/modelling_qwen3_vl/vision_model.py), megatron-core
  TransformerLayers with Transformer Engine modules (megatron/core/models/vision/vit_layer_specs.py
  get_vit_layer_with_transformer_engine_spec) sharded over the language model's TP, no sequence parallelism
  (transformer_config.py get_vision_model_config :78-132). Qwen3-VL (with its deepstack mergers) and Qwen3.5-VL
  (without) build it (qwen3_vl_provider.py provide, qwen35_vl_provider.py provide -> modelling_qwen3_vl/model.py
  Qwen3VLModel :302-326).
- ``QWEN25_VL``: transformers' Qwen2_5_VisionTransformerPretrainedModel (Bridge modeling_qwen25_vl.py:106-109), torch
  modules whole on every TP rank (RMSNorm, SwiGLU MLP, window attention through SDPA).
- ``SIGLIP``: transformers' SiglipVisionModel and Bridge's Gemma3VLMultimodalProjector (Gemma 3 VL,
  models/gemma_vl/modeling_gemma3_vl.py:93-102, :300-360).

All three are built only where ``pre_process`` holds, on the first pipeline stage's first model chunk
(modelling_qwen3_vl/model.py:302 ``if self.pre_process and self.add_encoder``; modeling_qwen25_vl.py:106;
modeling_gemma3_vl.py:93), and Float16Module casts them with the language model to bf16
(bridge/models/model_provider.py:691-692, megatron/core/transformer/module.py Float16Module ``module.bfloat16()``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from .inputs import FP32, Layout, Settings, Shape

QWEN3_VL = "qwen3_vl"
QWEN25_VL = "qwen25_vl"
SIGLIP = "siglip"

# The Hugging Face vision configs the providers carry, by the encoder they build (the provider's class checked too,
# vision_tower_of): anything else is named as not modelled (memory/coverage.py NOT_MODELLED "model.vision_config")
VISION_CONFIGS = {"Qwen3VLVisionConfig": QWEN3_VL, "Qwen3VLMoeVisionConfig": QWEN3_VL,
                  "Qwen3_5VisionConfig": QWEN3_VL, "Qwen3_5MoeVisionConfig": QWEN3_VL,
                  "Qwen2_5_VLVisionConfig": QWEN25_VL, "SiglipVisionConfig": SIGLIP}
PROVIDERS = {"Qwen3VLModelProvider": QWEN3_VL, "Qwen3VLMoEModelProvider": QWEN3_VL,
             "Qwen35VLModelProvider": QWEN3_VL, "Qwen35VLMoEModelProvider": QWEN3_VL,
             "Qwen25VLModelProvider": QWEN25_VL, "Gemma3VLModelProvider": SIGLIP}


@dataclass(frozen=True)
class VisionTower:
    """One vision encoder and its projector, as the plan sizes them (per GPU: VisionTower.params / activations)."""
    family: str                  # QWEN3_VL, QWEN25_VL or SIGLIP
    layers: int                  # ViT blocks
    hidden: int
    ffn: int
    heads: int
    patch_dim: int               # the patch embedding's input per patch: channels x temporal patch x patch x patch
    out_hidden: int              # the projector's output width (the language model's hidden size)
    patches_per_token: int       # image patches per image token in the language model's sequence
    pos_rows: int = 0            # learned position embedding rows (Qwen3-VL's pos_embed, SigLIP's position_embedding)
    deepstack_layers: tuple[int, ...] = ()   # Qwen3-VL: the layers whose output a deepstack merger reads
    tokens_per_image: int = 0    # SigLIP: image tokens per image after the projector's pooling (mm_tokens_per_image)
    image_tokens: float = 0.0    # image tokens per microbatch the plan sizes (see image_tokens)
    image_tokens_low: float = 0.0    # the fewest the configuration allows (0: a microbatch may carry no image)
    image_tokens_high: float = 0.0   # the most the configuration allows
    images_from: str = ""        # where image_tokens comes from (the plan's assumption and range say it)
    encoder_trains: bool = True  # not freeze_vision_model
    projector_trains: bool = True   # not freeze_vision_projection
    lora: bool = False           # LoRA adapters on the encoder's GEMMs (Qwen3-VL's TE modules carry the LM's names)
    per_cp_rank: bool = False    # vision_dp_when_cp: each context-parallel rank encodes its share of the images

    @property
    def patches(self) -> float:
        """Image patches per microbatch the encoder runs on one GPU."""
        return self.image_tokens * self.patches_per_token

    @property
    def head_dim(self) -> int:
        return self.hidden // max(1, self.heads)

    @property
    def grad_path(self) -> bool:
        """Whether autograd records the encoder's blocks: something in or before them trains (their weights, or
        LoRA adapters on them); the pixel values need no gradient, so a frozen encoder without adapters keeps
        nothing for backward."""
        return self.encoder_trains or self.lora


# ----------------------------------------------------------------------------- parameters
def encoder_params(v: VisionTower, tp: int) -> float:
    """The encoder's parameters on one GPU: the patch embedding, position embeddings and ViT blocks.

    - QWEN3_VL (modelling_qwen3_vl/utils.py Qwen3VLVisionPatchEmbed: Conv3d with bias; vision_model.py:145
      nn.Embedding(num_position_embeddings, hidden); get_vision_model_config: add_bias_linear, add_qkv_bias,
      LayerNorm, no GQA, not gated): per layer TELayerNormColumnParallelLinear linear_qkv (norm weight and bias
      whole, 3h x h and its bias over TP), TERowParallelLinear linear_proj (h x h over TP, bias whole),
      TELayerNormColumnParallelLinear linear_fc1, TERowParallelLinear linear_fc2; no final norm
      (vision_model.py:161 post_layer_norm=False). The conv and the embedding are torch modules, whole on every
      rank.
    - QWEN25_VL (transformers modeling_qwen2_5_vl.py Qwen2_5_VisionPatchEmbed Conv3d bias=False,
      Qwen2_5_VLVisionBlock: two RMSNorms, qkv and proj with bias, Qwen2_5_VLMLP gate/up/down with bias): whole
      on every TP rank.
    - SIGLIP (transformers modeling_siglip.py SiglipVisionEmbeddings Conv2d with bias and
      position_embedding(num_patches, h), SiglipEncoderLayer: two LayerNorms, q/k/v/out projections and fc1/fc2
      with bias, post_layernorm): whole on every TP rank."""
    h, f, t = v.hidden, v.ffn, max(1, tp)
    if v.family == QWEN3_VL:
        layer = 4 * h + (3 * h * h + 3 * h + f * h + f) / t + (h * h + f * h) / t + 2 * h
        return h * v.patch_dim + h + v.pos_rows * h + v.layers * layer
    if v.family == QWEN25_VL:
        layer = 2 * h + 4 * h * h + 4 * h + 3 * h * f + 2 * f + h
        return h * v.patch_dim + v.layers * layer
    if v.family == SIGLIP:
        layer = 4 * h + 4 * h * h + 4 * h + 2 * h * f + f + h
        return h * v.patch_dim + h + v.pos_rows * h + v.layers * layer + 2 * h
    raise ValueError(f"unknown vision encoder {v.family!r}")


def projector_params(v: VisionTower, tp: int) -> float:
    """The projector's parameters on one GPU (what freeze_vision_projection freezes).

    - QWEN3_VL: the merger (utils.py Qwen3VLVisionPatchMerger: TENorm over h, TEColumnParallelLinear
      merged -> merged and TERowParallelLinear merged -> out_hidden with biases, merged = h x merge^2) and one such
      merger per deepstack layer with its norm over the merged width (use_postshuffle_norm; transformer_block.py
      :89-100); the Qwen3-VL freeze counts deepstack_merger_list as projection (model.py:485-497).
    - QWEN25_VL: Qwen2_5_VLPatchMerger (ln_q RMSNorm over h, Linear merged -> merged, GELU, Linear merged -> out).
    - SIGLIP: Gemma3VLMultimodalProjector's mm_soft_embed_norm (TENorm over h) and proj (ColumnParallelLinear
      h -> out_hidden, no bias), split over TP."""
    h, t = v.hidden, max(1, tp)
    merged = h * v.patches_per_token
    if v.family == QWEN3_VL:
        linears = (merged * merged + merged) / t + merged * v.out_hidden / t + v.out_hidden
        return 2 * h + linears + len(v.deepstack_layers) * (2 * merged + linears)
    if v.family == QWEN25_VL:
        return h + merged * merged + merged + merged * v.out_hidden + v.out_hidden
    if v.family == SIGLIP:
        return h + h * v.out_hidden / t
    raise ValueError(f"unknown vision encoder {v.family!r}")


def stage_vision_params(s: Shape, lay: Layout, rank: int) -> tuple[float, float]:
    """(every vision parameter, the trainable ones) on one GPU of pipeline rank ``rank``: the whole tower on rank 0
    (its first model chunk holds pre_process), none elsewhere. The trainable ones go into the DDP buffers and the
    optimizer like any dense parameter (distributed_data_parallel.py:114-116 and optimizer/__init__.py:330-331 skip
    parameters with requires_grad False; Bridge's HF towers are marked for the TP gradient all-reduce,
    utils/common_utils.py hook_hf_module_setattr_for_tp_grad_sync)."""
    v = s.vision
    if v is None or rank != 0:
        return 0.0, 0.0
    enc, proj = encoder_params(v, lay.tp), projector_params(v, lay.tp)
    return enc + proj, (enc if v.encoder_trains else 0.0) + (proj if v.projector_trains else 0.0)


def lora_params(v: VisionTower, lay: Layout, st: Settings) -> float:
    """LoRA adapters PEFT adds to Qwen3-VL's vision GEMMs (VisionTower.lora): rank x (in + out) per target module
    and layer over TP, as the language model's (weights.lora_params): linear_qkv, linear_proj, linear_fc1 and
    linear_fc2 of every ViT layer and linear_fc1 / linear_fc2 of the merger and each deepstack merger."""
    if not v.lora or not st.lora_rank:
        return 0.0
    h, f, merged = v.hidden, v.ffn, v.hidden * v.patches_per_token
    layer = {"linear_qkv": (h, 3 * h), "linear_proj": (h, h), "linear_fc1": (h, f), "linear_fc2": (f, h)}
    merger = {"linear_fc1": (merged, merged), "linear_fc2": (merged, v.out_hidden)}
    per = lambda dims: sum(st.lora_rank * (i + o) for name, (i, o) in dims.items()  # noqa: E731
                           if name in st.lora_targets)
    return (v.layers * per(layer) + (1 + len(v.deepstack_layers)) * per(merger)) / max(1, lay.tp)


# ----------------------------------------------------------------------------- activations
def _vit_shape(v: VisionTower) -> Shape:
    return Shape(layers=v.layers, hidden=v.hidden, ffn=v.ffn, heads=v.heads, groups=v.heads, head_dim=v.head_dim,
                 vocab=0, gated=False, norm_bias=True, linear_bias=True)


def _qwen3_layer_terms(v: VisionTower, lay: Layout, st: Settings) -> dict[str, float]:
    """Bytes per patch one Qwen3-VL ViT layer keeps: a megatron-core TE layer of the language model's kind
    (activations.layer_activation_terms) with the vision config's settings (get_vision_model_config: no SP, no
    CP, no dropout, not gated, bias_activation_fusion off: the GELU keeps fc1's biased output, fc2 its output;
    bf16 whatever the language model's FP8, since the config it builds carries no fp8 and the block wraps each
    layer in get_fp8_context(self.config): transformer_block.py:342-344), plus the rotary tables: with
    apply_rotary_pos_emb_in_fp32 (:95) Qwen3VLSelfAttention rotates q and k in fp32 and each ``t * cos_`` /
    ``rotate_half(t) * sin_`` saves its fp32 cos_ / sin_ (rope.py:484-489; megatron-core rope_utils.py
    _apply_rotary_pos_emb_bshd :133-136): four per layer. Frozen with LoRA adapters: the frozen GEMMs keep only
    what an adapter reads (the model's LoRA terms)."""
    from .activations import RECOMPUTE_DROPS, layer_activation_terms
    vlay = replace(lay, sp=False, cp=1, seq=max(1, int(v.patches)), mbs=1, chunk_layers=())
    vst = replace(st, fp8=False, fp8_weight_copy_bytes=0, hidden_dropout=False, attention_dropout=False,
                  attention_scores="", swiglu_fused=True, glu_clamped=False, moe_probs_mul=False,
                  frozen_lm=False, lora_rank=st.lora_rank if v.lora else 0,
                  lora_targets=st.lora_targets if v.lora else (), lora_regather=())
    terms = layer_activation_terms(_vit_shape(v), vlay, vst, "attn+mlp")
    if st.recompute == "selective":
        # the vision config copies recompute_granularity but not recompute_modules, so megatron-core's default
        # ["core_attn"] applies (get_vision_model_config :78-80; transformer_config.py recompute_modules)
        for name in RECOMPUTE_DROPS["core_attn"]:
            terms.pop(name, None)
    terms["vision_rope_tables"] = 4 * FP32 * v.head_dim
    return terms


def _qwen25_layer_terms(v: VisionTower, st: Settings) -> dict[str, float]:
    """Bytes per patch one Qwen2.5-VL vision block keeps (transformers modeling_qwen2_5_vl.py, autograd's saved
    tensors; SDPA, the default attention implementation of ``_from_config``):

    - each Qwen2_5_VLRMSNorm: the fp32 upcast (pow and the normalizing product save it) and rsqrt's fp32 output,
      the normalized bf16 tensor (the weight's product saves it) and its output (the next Linear's input);
    - attention: qkv's output (v is a view of it, which SDPA keeps), the rotated q and k (apply_rotary_pos_emb_vision
      casts them back to bf16: new tensors; the fp32 products save only the shared cos and sin), SDPA's output and
      log-sum-exp per head, and proj's input (torch.cat of the windows' outputs, a new tensor);
    - the SwiGLU MLP: gate_proj's output (SiLU's input), SiLU's output and up_proj's output (the product keeps
      both), and the product (down_proj's input)."""
    D, h, f = st.dtype_bytes, v.hidden, v.ffn
    norm = FP32 * h + FP32 + 2 * D * h       # x in fp32, rsqrt's output, the normalized tensor, the output
    return {"vision_norm1": norm, "vision_qkv_output": 3 * D * h, "vision_rotated_qk": 2 * D * h,
            "vision_attention_output": D * h, "vision_softmax_stats": FP32 * v.heads, "vision_proj_input": D * h,
            "vision_norm2": norm, "vision_mlp": 4 * D * f}


def _siglip_layer_terms(v: VisionTower, st: Settings) -> dict[str, float]:
    """Bytes per patch one SiglipEncoderLayer keeps (transformers modeling_siglip.py): each nn.LayerNorm its input
    and fp32 mean and rstd, and its output (the projections' input); q, k and v (separate Linear outputs SDPA
    keeps), SDPA's output (out_proj's input: transpose and contiguous of SDPA's own layout return the same
    tensor) and log-sum-exp; fc1's output (the tanh GELU's input) and the GELU's output (fc2's input)."""
    D, h, f = st.dtype_bytes, v.hidden, v.ffn
    norm = D * h + 2 * FP32 + D * h
    return {"vision_norm1": norm, "vision_qkv": 3 * D * h, "vision_attention_output": D * h,
            "vision_softmax_stats": FP32 * v.heads, "vision_norm2": norm, "vision_mlp": 2 * D * f}


def _projector_terms(v: VisionTower, lay: Layout, st: Settings) -> dict[str, float]:
    """Bytes per patch the projector keeps, where a gradient reaches it (it trains, or the encoder behind it does).

    - QWEN3_VL merger (utils.py Qwen3VLVisionPatchMerger.forward): TENorm keeps its input, linear_fc1 (column
      parallel, not sequence parallel) the norm's whole output for its weight gradient, F.gelu its input and
      linear_fc2 its input (each over TP); frozen, only the norm's and the GELU's inputs (dgrad needs neither GEMM's
      input: TE backward_needs_input = weight.requires_grad). Every merged token is merge^2 patches wide, so per
      patch the widths are h, h, h / TP, h / TP. Each deepstack merger the same, its norm reading the output of
      a ViT layer that the next layer's norm keeps already when the encoder has a gradient.
    - QWEN25_VL Qwen2_5_VLPatchMerger: ln_q as a block's RMSNorm (its fp32 upcast only when its input needs a
      gradient), the GELU's input and the second Linear's input.
    - SIGLIP: post_layernorm (input and statistics; part of the encoder), AvgPool2d keeps its input (a contiguous
      copy of the tower's output: avg_pool2d's backward reads it) where the encoder has a gradient, then per image
      token the TENorm's input and proj's input (mm_tokens_per_image tokens of an image's patches)."""
    D, h, t = st.dtype_bytes, v.hidden, max(1, lay.tp)
    upstream = v.grad_path                  # the projector's input needs a gradient
    # LoRA adapters on the mergers' linear_fc1 / linear_fc2 read those GEMMs' inputs, which are then kept
    trains = v.projector_trains or (v.lora and v.family == QWEN3_VL)
    if not (trains or upstream):
        return {}
    terms: dict[str, float] = {}
    if v.family == QWEN3_VL:
        merger = D * h + (D * h if trains else 0.0) + D * h / t + (D * h / t if trains else 0.0)
        terms["vision_merger"] = merger
        if v.deepstack_layers:
            shared = sum(1 for i in v.deepstack_layers if i < v.layers - 1) if upstream else 0
            terms["vision_deepstack_mergers"] = len(v.deepstack_layers) * merger - shared * D * h
    elif v.family == QWEN25_VL:
        # ln_q: the fp32 upcast where its input needs a gradient, the normalized tensor and its output (the first
        # Linear's input) where it trains; per merged token (merge^2 patches wide) the GELU's input and the second
        # Linear's input: per patch h wide each
        ln = (FP32 * (h + 1) if upstream else 0.0) + (2 * D * h if trains else 0.0)
        terms["vision_merger"] = ln + D * h + (D * h if trains else 0.0)
    elif v.family == SIGLIP:
        if upstream:
            terms["vision_post_layernorm"] = D * h + 2 * FP32
            terms["vision_pool_input"] = D * h
        # one image token per patches_per_token patches: the norm's input, and proj's input where proj trains
        terms["vision_projector"] = (D * h + (D * h if trains else 0.0)) / max(1, v.patches_per_token)
    return terms


def terms(v: VisionTower, lay: Layout, st: Settings) -> dict[str, float]:
    """Bytes one microbatch's vision encoder and projector keep for backward on one GPU of the first stage, by
    term (already times the patches). The encoder's blocks keep nothing without a gradient path (grad_path); its
    patch embedding keeps its pixel input only for its own weight gradient."""
    patches = v.patches
    out: dict[str, float] = {}
    if not patches:
        return out
    D = st.dtype_bytes
    if v.grad_path:
        if v.family == QWEN3_VL:
            layer = _qwen3_layer_terms(v, lay, st)
        elif v.family == QWEN25_VL:
            layer = _qwen25_layer_terms(v, st)
        else:
            layer = _siglip_layer_terms(v, st)
        per_layer = sum(layer.values())
        if st.recompute == "full" and v.family == QWEN3_VL:
            # the vision config copies the full-recompute method and group size (get_vision_model_config :78-80):
            # each checkpointed group keeps its input hidden state (transformer_block.py Qwen3VLVisionTransformerBlock
            # _checkpointed_forward; tensor_parallel/random.py CheckpointFunction saves the inputs)
            n = max(1, st.recompute_layers)
            if st.recompute_method == "block":
                ckpt = min(v.layers, n)
                kept = (v.layers - ckpt) * per_layer + ckpt * D * v.hidden
            else:
                kept = math.ceil(v.layers / n) * D * v.hidden
            out["vision_encoder_layers"] = kept * patches
        else:
            out["vision_encoder_layers"] = v.layers * per_layer * patches
        if v.family == QWEN25_VL:
            # apply_rotary_pos_emb_vision's ``cos.unsqueeze(-2).float()`` / ``sin...`` (modeling_qwen2_5_vl.py),
            # which the products save: Float16Module's bfloat16() casts the rotary inv_freq buffer too, so the tower's
            # cos and sin are bf16 and each block makes its own fp32 pair; in fp32 training one shared pair
            per = v.layers if D < FP32 else 1
            out["vision_rope_tables"] = per * 2 * FP32 * v.head_dim * patches
            # the window reorder and its inverse index the merged tokens (int64 indices the gathers save)
            out["vision_window_index"] = 2 * 8 * patches / v.patches_per_token
    if v.encoder_trains:
        # the patch embedding's conv saves its input (the pixels cast to the weight's dtype) for its weight gradient
        out["vision_patch_embed_input"] = D * v.patch_dim * patches
    proj = _projector_terms(v, lay, st)
    if proj:
        out["vision_projector"] = sum(proj.values()) * patches
    return out


def activations(s: Shape, lay: Layout, st: Settings) -> float:
    """Bytes one microbatch's vision encoder keeps on the first pipeline stage (0 without one)."""
    return sum(terms(s.vision, lay, st).values()) if s.vision is not None else 0.0


# ----------------------------------------------------------------------------- from a Bridge config
def family_of(m: Any) -> str | None:
    """The encoder a provider builds (QWEN3_VL, QWEN25_VL, SIGLIP), None where the plan does not model it."""
    vc = getattr(m, "vision_config", None)
    if vc is None:
        return None
    fam = PROVIDERS.get(type(m).__name__)
    return fam if fam is not None and VISION_CONFIGS.get(type(vc).__name__) == fam else None


def grid_rounded(height: int, width: int, factor: int) -> tuple[int, int]:
    """An image's sides as every Qwen-VL processor's smart_resize rounds them: to the nearest multiple of
    patch x merge, at least one (transformers models/qwen2_vl/image_processing_qwen2_vl.py smart_resize :62-89,
    ``h_bar = max(factor, round(height / factor) * factor)``); its scaling into the processor's [min_pixels,
    max_pixels] is left out, those living in the processor's preprocessor_config.json (not read offline)."""
    return max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)


def image_tokens(cfg: Any, fam: str, patch: int, merge: int, tokens_per_image: int
                 ) -> tuple[float, float, float, str]:
    """(image tokens per microbatch the plan sizes, the fewest and the most the configuration allows, where they
    come from).

    The bound: every image token is a position of the language model's sequence (Qwen: reorganize_inputs and the
    masked scatter place one merged token per image_token_id position, utils.py:315-398, model.py:714; Gemma 3 and
    Qwen2.5-VL: get_placeholder_mask / masked_scatter check the counts agree), so a microbatch carries at most
    seq_length x micro_batch_size of them, and each is merge^2 patches (Gemma 3: (image_size / patch)^2 patches per
    mm_tokens_per_image tokens). A mock dataset (data/builders/mock_vlm_sft.py MockVLMSFTDatasetConfig) states its
    images: num_images of image_size each, resized by the processor (smart_resize for the Qwen processors, whose
    min/max pixels live in the processor's preprocessor_config.json, not read offline: the image's own size,
    rounded to the grid, is planned; Gemma 3's processor resizes every image to image_size, mm_tokens_per_image
    tokens each). Other datasets (Hugging Face conversations, Energon) do not bound the images: the plan sizes the
    bound."""
    m = cfg.model
    mbs = int(getattr(getattr(cfg, "train", None), "micro_batch_size", 1) or 1)
    high = float(int(m.seq_length) * mbs)
    dataset = getattr(cfg, "dataset", None)
    if type(dataset).__name__ == "MockVLMSFTDatasetConfig":
        n = int(getattr(dataset, "num_images", 1) or 0)
        width, height = tuple(getattr(dataset, "image_size", (256, 256)))
        if fam == SIGLIP:
            per_image = tokens_per_image
            how = f"{n} mock image{'s' if n != 1 else ''} per sample, {per_image} tokens each"
        else:
            factor = patch * merge
            h_bar, w_bar = grid_rounded(int(height), int(width), factor)
            per_image = (h_bar // patch) * (w_bar // patch) // (merge * merge)
            how = (f"{n} mock image{'s' if n != 1 else ''} of {width}x{height} per sample, {per_image} tokens each "
                   f"at that size rounded to the {factor}-pixel grid (the processor's min/max pixels are not read)")
        planned = min(high, float(n * per_image * mbs))
        # Gemma 3's processor makes every image mm_tokens_per_image tokens: the count is the plan's both ways
        return planned, planned, (planned if fam == SIGLIP else high), how
    adapter = hf_schema_adapter(dataset)
    if adapter in ONE_IMAGE_ADAPTERS and not bool(getattr(dataset, "enable_offline_packing", False)):
        # Bridge's schema adapter makes one image per conversation (data/sources/hf_adapters.py _cord_v2_adapter,
        # _medpix_adapter, _rdr_adapter), and a microbatch holds micro_batch_size conversations, in-batch packing
        # too ("concatenates multiple sequences within a microbatch", training/config.py:1480-1485)
        if fam == SIGLIP:
            planned = min(high, float(tokens_per_image * mbs))
            how = f"the {adapter} dataset: one image per sample, {tokens_per_image} tokens each"
            return planned, planned, planned, how
        return high, 0.0, high, (f"the {adapter} dataset: one image per sample, its size decided by the processor's "
                                 f"min/max pixels (not read offline): at most seq_length x micro_batch_size = "
                                 f"{int(high):,} image tokens per microbatch")
    kind = type(dataset).__name__ if dataset is not None else "no dataset"
    return high, 0.0, high, (f"{kind} does not bound the images: at most seq_length x micro_batch_size = "
                             f"{int(high):,} image tokens per microbatch")


# Bridge's Hugging Face schema adapters that put exactly one image in a conversation (data/sources/hf_adapters.py
# _cord_v2_adapter :160-181, _medpix_adapter, _rdr_adapter: one {"type": "image"} entry each); the presets of the same
# names use them (data/sources/hf.py _HF_DATASET_PRESETS :144-200)
ONE_IMAGE_ADAPTERS = frozenset({"cord_v2", "medpix", "rdr"})


def hf_schema_adapter(dataset: Any) -> str | None:
    """The schema adapter a DirectHFSFTDatasetConfig's source runs: its own schema_adapter, else its preset's
    (dataset_name; the presets named here use the adapter of their name, data/sources/hf.py :144-200)."""
    source = getattr(dataset, "source", None)
    if source is None or type(dataset).__name__ != "DirectHFSFTDatasetConfig":
        return None
    adapter = getattr(source, "schema_adapter", None) or getattr(source, "dataset_name", None)
    return str(adapter) if adapter else None


def vision_tower_of(cfg: Any, lay: Layout) -> VisionTower | None:
    """The VisionTower a Bridge config builds, None without one or where the plan does not model it."""
    m = cfg.model
    fam = family_of(m)
    if fam is None:
        return None
    vc = m.vision_config
    peft = getattr(cfg, "peft", None)
    lora = type(peft).__name__ in ("LoRA", "DoRA") and int(getattr(peft, "dim", 0) or 0) > 0
    # PEFT freezes every parameter first (peft/base.py freeze_model), then adds adapters to the modules whose names
    # match (module_matcher.py match: ``name == pattern``): Qwen3-VL's ViT and mergers are TE modules named like
    # the language model's (linear_qkv, linear_proj, linear_fc1, linear_fc2); the HF towers' (qkv, proj,
    # gate_proj, q_proj, fc1 ...) and Gemma 3's projector (proj) are not the default targets
    targets = set(getattr(peft, "target_modules", ()) or ()) if lora else set()
    vit_names = {"linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"}
    vision_lora = fam == QWEN3_VL and bool(targets & vit_names)
    encoder_trains = not bool(getattr(m, "freeze_vision_model", False)) and not lora
    projector_trains = not bool(getattr(m, "freeze_vision_projection", False)) and not lora
    if fam == QWEN3_VL:
        merge = int(vc.spatial_merge_size)
        deep = tuple(int(i) for i in (getattr(vc, "deepstack_visual_indexes", None) or ()))
        patch = int(vc.patch_size)
        planned, low, high, how = image_tokens(cfg, fam, patch, merge, 0)
        cp_split = bool(getattr(m, "vision_dp_when_cp", False)) and lay.cp > 1
        if cp_split:
            # vision_dp_when_cp: each CP rank encodes its share of the images (model.py:617-634 qwen3vl_cp_split)
            planned, low, how = planned / lay.cp, low / lay.cp, how + f", split over {lay.cp} context-parallel ranks"
        return VisionTower(QWEN3_VL, int(vc.depth), int(vc.hidden_size), int(vc.intermediate_size),
                           int(vc.num_heads), int(vc.in_channels) * int(vc.temporal_patch_size) * patch * patch,
                           int(vc.out_hidden_size), merge * merge, pos_rows=int(vc.num_position_embeddings),
                           deepstack_layers=deep, image_tokens=planned, image_tokens_low=low, image_tokens_high=high,
                           images_from=how,
                           encoder_trains=encoder_trains, projector_trains=projector_trains, lora=vision_lora,
                           per_cp_rank=cp_split)
    if fam == QWEN25_VL:
        merge = int(vc.spatial_merge_size)
        patch = int(vc.patch_size)
        planned, low, high, how = image_tokens(cfg, fam, patch, merge, 0)
        return VisionTower(QWEN25_VL, int(vc.depth), int(vc.hidden_size), int(vc.intermediate_size),
                           int(vc.num_heads), int(vc.in_channels) * int(vc.temporal_patch_size) * patch * patch,
                           int(vc.out_hidden_size), merge * merge, image_tokens=planned, image_tokens_low=low,
                           image_tokens_high=high,
                           images_from=how, encoder_trains=encoder_trains, projector_trains=projector_trains)
    # SIGLIP: Gemma 3's processor resizes every image to image_size; the projector pools (image_size / patch)^2
    # patches to mm_tokens_per_image tokens (modeling_gemma3_vl.py Gemma3VLMultimodalProjector)
    patch = int(vc.patch_size)
    per_side = int(vc.image_size) // patch
    per_image = int(getattr(m, "mm_tokens_per_image", 256) or 256)
    planned, low, high, how = image_tokens(cfg, fam, patch, 1, per_image)
    # whole images only: the sequence holds at most floor(tokens / per_image) of them
    planned, low, high = (math.floor(x / per_image) * per_image for x in (planned, low, high))
    return VisionTower(SIGLIP, int(vc.num_hidden_layers), int(vc.hidden_size), int(vc.intermediate_size),
                       int(vc.num_attention_heads), int(vc.num_channels) * patch * patch,
                       int(getattr(m, "hidden_size")), per_side * per_side // per_image, pos_rows=per_side * per_side,
                       tokens_per_image=per_image, image_tokens=planned, image_tokens_low=low, image_tokens_high=high,
                       images_from=how,
                       encoder_trains=encoder_trains, projector_trains=projector_trains)
