"""What the model reads and what it knowingly does not: no memory-relevant field is ignored silently.

``MODEL_READS`` declares the configuration fields ``from_config`` reads (tests/test_plan_terms.py checks that
every field from_config.py reads is declared here). ``NOT_MODELLED`` lists fields known to change GPU memory that
the model does not follow, each with the values at which it matters and why; ``not_modelled(cfg)`` names those
set in a configuration ("not modelled: field=value"), which the plan carries into its verdict and JSON
(memory/plan.py). Another part of the project that finds a memory-relevant field the model does not follow adds it
here (one ``Unmodelled`` each), not in its own list; a memory-relevant Megatron-LM flag with no configuration field
(a training script's own flag, outside megatron-core's parser) is one ``UnmodelledFlag`` in ``NOT_MODELLED_FLAGS``.

Each entry also says how following it would move the plan's figure (``moves``: ``UP``, it can only add memory, so
the modelled figure is a floor; ``DOWN``, it can only remove memory, a ceiling; ``EITHER``, both ends open, the
default) and, where the code bounds it, by how much at most (``bound``). ``gaps`` reads a plan's ``not_modelled``
texts back as :class:`Gap` records with that data, which the fit verdict (memory/plan.py ``judge``) turns into an
honest range: "unknown: ... not modelled" unless the bound alone decides the fit.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Paths into a Bridge ConfigContainer ("section.field"), as from_config reads them.
MODEL_READS = frozenset({
    "model.num_layers", "model.hidden_size", "model.ffn_hidden_size", "model.num_attention_heads",
    "model.num_query_groups", "model.kv_channels", "model.gated_linear_unit",
    "model.share_embeddings_and_output_weights", "model.num_moe_experts", "model.moe_layer_freq",
    "model.moe_ffn_hidden_size", "model.moe_router_topk", "model.moe_shared_expert_intermediate_size",
    "model.moe_grouped_gemm", "model.moe_use_legacy_grouped_gemm",
    "model.multi_latent_attention", "model.qk_head_dim", "model.qk_pos_emb_head_dim", "model.v_head_dim",
    "model.kv_lora_rank", "model.q_lora_rank", "model.qk_layernorm", "model.is_hybrid_model",
    "model.hybrid_override_pattern", "model.hybrid_layer_pattern", "model.mamba_num_heads", "model.mamba_head_dim",
    "model.mamba_num_groups", "model.mamba_state_dim", "model.linear_conv_kernel_dim", "model.vocab_size",
    "model.make_vocab_size_divisible_by", "model.tensor_model_parallel_size", "model.pipeline_model_parallel_size",
    "model.virtual_pipeline_model_parallel_size", "model.context_parallel_size", "model.expert_model_parallel_size",
    "model.expert_tensor_parallel_size", "model.sequence_parallel", "model.seq_length", "model.recompute_granularity",
    "model.recompute_modules", "model.recompute_method", "model.recompute_num_layers", "model.cpu_offloading",
    "model.cpu_offloading_activations", "model.cpu_offloading_num_layers", "model.cpu_offloading_double_buffering",
    "model.moe_shared_expert_overlap", "model.disable_parameter_transpose_cache", "model.bias_activation_fusion",
    "model.use_te_activation_func", "model.activation_func_clamp_value", "model.activation_func",
    "model.moe_apply_probs_on_input", "model.moe_mlp_glu_interleave_size", "model.use_fused_weighted_squared_relu",
    "model.moe_expert_capacity_factor", "model.moe_pad_expert_input_to_capacity", "model.cuda_graph_impl",
    "model.cuda_graph_modules", "model.cuda_graph_scope", "model.cuda_graph_warmup_steps",
    "model.cross_entropy_loss_fusion", "model.cross_entropy_fusion_impl", "model.moe_token_dispatcher_type",
    "model.moe_latent_size", "model.fp8", "model.fp8_param", "model.defer_embedding_wgrad_compute",
    "model.wgrad_deferral_limit", "model.params_dtype", "model.bf16", "model.fp16", "model.attention_backend",
    "model.hidden_dropout", "model.attention_dropout", "model.mtp_num_layers", "model.masked_softmax_fusion",
    "model.transformer_impl",
    "model.pipeline_model_parallel_layout", "model.num_layers_in_first_pipeline_stage",
    "model.num_layers_in_last_pipeline_stage", "model.account_for_embedding_in_pipeline_split",
    "model.account_for_loss_in_pipeline_split", "model.microbatch_group_size_per_vp_stage",
    "train.micro_batch_size", "train.global_batch_size",
    "optimizer.use_precision_aware_optimizer", "optimizer.main_params_dtype", "optimizer.exp_avg_dtype",
    "optimizer.fp8_recipe", "optimizer.optimizer_cpu_offload", "optimizer.optimizer_offload_fraction",
    "optimizer.use_distributed_optimizer", "optimizer.reuse_grad_buf_for_mxfp8_param_ag",
    "ddp.grad_reduce_in_fp32", "ddp.use_distributed_optimizer", "ddp.num_distributed_optimizer_instances",
    "ddp.use_megatron_fsdp", "ddp.data_parallel_sharding_strategy", "ddp.outer_dp_sharding_strategy",
    "dist.use_megatron_fsdp", "mixed_precision", "comm_overlap.defer_embedding_wgrad_compute",
    "comm_overlap.wgrad_deferral_limit", "peft", "tokenizer",
    # issue 31's levers (memory/levers.py apply_config / offload_from_config)
    "model.fine_grained_activation_offloading", "model.offload_modules", "model.activation_offload_fraction",
    "model.min_offloaded_tensor_size", "model.delta_offload_bytes_across_pp_ranks",
    "ddp.megatron_fsdp_main_grads_dtype", "ddp.megatron_fsdp_main_params_dtype", "optimizer.exp_avg_sq_dtype",
    # Muon and the layer-wise optimizer (memory/optimizers.py): what a per-tensor count reads
    "optimizer.optimizer", "optimizer.use_layer_wise_distributed_optimizer", "model.normalization",
    "model.add_bias_linear", "model.position_embedding_type",
    # hybrid stacks: the MTP depth's pattern and one shared MTP layer (from_config.hybrid_pattern)
    "model.mtp_hybrid_override_pattern", "model.mtp_use_repeated_layer",
    # the attention variants (memory/variants.py): gated delta net, DeepSeek sparse attention, the output gate,
    # q/k L2 norm
    "model.experimental_attention_variant", "model.linear_attention_freq", "model.linear_key_head_dim",
    "model.linear_value_head_dim", "model.linear_num_key_heads", "model.linear_num_value_heads",
    "model.dsa_indexer_n_heads", "model.dsa_indexer_head_dim", "model.dsa_indexer_topk",
    "model.dsa_indexer_topk_freq", "model.dsa_indexer_skip_topk_offset", "model.dsa_indexer_loss_coeff",
    "model.dsa_kernel_backend", "model.attention_output_gate", "model.qk_l2_norm",
    # which DSA indexer loss runs (variants.dsa_reference_loss): the sparse loss, and packed batches' varlen bounds
    # (from_config.packed_sequences); the shared expert's gate
    "model.dsa_indexer_use_sparse_loss", "dataset.enable_offline_packing", "dataset.offline_packing_specs",
    "dataset.enable_in_batch_packing", "model.moe_shared_expert_gate",
    # latent MoE, FP8's first/last bf16 layers, the flex dispatcher (from_config bf16_layer_span, moe_dispatcher)
    "model.first_last_layers_bf16", "model.num_layers_at_start_in_bf16", "model.num_layers_at_end_in_bf16",
    "model.moe_enable_deepep", "model.moe_flex_dispatcher_backend", "model.moe_flex_dispatcher_num_sms",
    "model.moe_deepep_num_sms", "model.moe_hybridep_num_sms", "model.moe_expert_rank_capacity_factor", "env_vars",
    # TE's op fuser on the experts and the paged stash (from_config.moe_op_fuser, buffers.paged_stash_buffer), the
    # kept stage outputs, context-parallel attention's communication, Gemma 2's softcapped attention and logits,
    # the non-fused softmax's dtype, an unscattered embedding output
    "model.use_transformer_engine_op_fuser", "model.fp8_recipe", "model.moe_paged_stash",
    "model.moe_paged_stash_buffer_size_factor_cuda", "model.moe_paged_stash_buffer_size_factor_cpu",
    "model.moe_paged_stash_page_size", "model.deallocate_pipeline_outputs", "model.cp_comm_type",
    "model.transformer_layer_spec", "model.attn_logit_softcapping", "dataset.skip_getting_attention_mask_from_dataset",
    "model.final_logit_softcapping", "model.attention_softmax_in_fp32", "model.apply_query_key_layer_scaling",
    "model.scatter_embedding_sequence_parallel",
    # vision-language models (memory/vision.py vision_tower_of, from_config vision_shape / frozen_lm): the vision
    # encoder's config, what is frozen, the images a mock dataset states, Gemma 3's image tokens, the LM's RoPE dtype
    "model.vision_config", "model.freeze_language_model", "model.freeze_vision_model",
    "model.freeze_vision_projection", "model.vision_dp_when_cp", "model.mm_tokens_per_image",
    "model.apply_rotary_pos_emb_in_fp32", "dataset.num_images", "dataset.image_size", "dataset.source",
    # the combined 1F1B schedule and TE's delayed weight gradients (from_config; stage_activations.ep_overlap_working)
    "model.overlap_moe_expert_parallel_comm", "model.delay_wgrad_compute",
    # NVFP4 GEMMs and primary weights, the MXFP8 output projection (from_config job_fp4, fp8_weight_copy_bytes,
    # output_proj_fp8; buffers.fp8_master_cast_copies)
    "model.fp4", "model.fp4_param", "model.fp4_recipe", "ddp.fp4_param_gather", "model.fp8_output_proj",
})


# How following an unmodelled feature would move the most-loaded GPU's figure (Unmodelled.moves).
UP = "up"            # it can only add memory: the modelled figure is a floor
DOWN = "down"        # it can only remove memory: the modelled figure is a ceiling
EITHER = "either"    # it can move it either way: both ends open
MOVES = (UP, DOWN, EITHER)


@dataclass(frozen=True)
class Unmodelled:
    """A configuration field that changes GPU memory and that the model does not follow at the values where
    ``applies(value)`` holds (default: any value other than None, False, 0 or empty).

    ``moves``: how following it would move the plan's figure (UP, DOWN or EITHER; EITHER unless the code it runs
    shows one direction). ``bound``: where the code bounds that move, the most it can be, in bytes, from the
    most-loaded GPU's modelled breakdown (memory/inputs.py Breakdown); None: the code gives no bound."""
    path: str
    reason: str
    applies: Callable[[Any], bool] = bool
    moves: str = EITHER
    bound: Callable[[Any], float] | None = None
    # where it matters only beside other fields: a test of the whole configuration (None: always)
    when: Callable[[Any], bool] | None = None


ENCODER_CONFIGS = ("vision_config", "audio_config")   # Hugging Face sub-configs an encoder is built from


def _vision_unmodelled(cfg: Any) -> bool:
    from .vision import family_of
    return family_of(getattr(cfg, "model", None)) is None


def _ep_overlap_refused(cfg: Any) -> bool:
    """Whether megatron-core's TransformerConfig refuses overlap_moe_expert_parallel_comm for this model."""
    pp = _int(_read(cfg, "model.pipeline_model_parallel_size")) or 1
    return ((pp > 1 and not _read(cfg, "model.virtual_pipeline_model_parallel_size"))
            or (_int(_read(cfg, "model.expert_model_parallel_size")) or 1) <= 1
            or str(_read(cfg, "model.moe_token_dispatcher_type")) not in ("alltoall", "flex")
            or _read(cfg, "model.recompute_granularity") == "full" or _read(cfg, "model.recompute_method") is not None)


def _enum_name(value: Any) -> str:
    return str(getattr(value, "name", value))


NOT_MODELLED: tuple[Unmodelled, ...] = (
    # overlap_moe_expert_parallel_comm and delay_wgrad_compute are modelled (stage_activations.ep_overlap_working,
    # activations.overlap_layer); what is left is what megatron-core refuses (transformer_config.py:2669-2699,
    # :2748-2752): the job cannot start
    Unmodelled("model.overlap_moe_expert_parallel_comm",
               "overlapping expert-parallel communication where megatron-core refuses it (transformer_config.py:"
               "2669-2699: pipeline parallelism without virtual stages, expert parallelism 1, a dispatcher other "
               "than alltoall/flex, full recompute or a recompute method): the job cannot start as planned",
               moves=UP, when=lambda cfg: _ep_overlap_refused(cfg)),
    Unmodelled("model.delay_wgrad_compute", "delayed weight gradients keep GEMM inputs and grad outputs longer; "
               "without overlap_moe_expert_parallel_comm megatron-core refuses it (transformer_config.py:2749-2752)",
               moves=UP, when=lambda cfg: not _read(cfg, "model.overlap_moe_expert_parallel_comm")),
    Unmodelled("model.cpu_offloading_weights", "weight CPU offload moves layer weights off the GPU",
               moves=DOWN, bound=lambda b: b.parameters),   # at most every weight leaves
    # NVFP4 is modelled (from_config.job_fp4); a custom FP4 recipe is a user's quantizer factory whose formats the
    # code does not say (fp4_utils.py get_fp4_recipe :233-234), and TE fuses NVFP4 experts into its CuTe DSL grouped
    # MLP too, whose saved tensors under NVFP4 were not read (the plan runs them as the basic ops)
    Unmodelled("model.fp4_recipe", "a custom FP4 recipe (fp4_quantizer_factory): its quantized formats are the "
               "factory's, not modelled", lambda v: _enum_name(v).lower() == "custom",
               when=lambda cfg: bool(_read(cfg, "model.fp4"))),
    Unmodelled("model.fp4", "NVFP4 experts with TE's fused grouped MLP (NVTE_CUTEDSL_FUSED_GROUPED_MLP on "
               "Blackwell): the fused kernel's saved NVFP4 tensors are not modelled (the plan counts the basic ops)",
               when=lambda cfg: _fp4_fused_experts(cfg)),
    # The flex dispatcher's DeepEP and HybridEP backends are modelled (activations.dispatcher_terms,
    # buffers.flex_dispatcher_state; their buffers outside torch's allocator are a range, ranges.py); NCCL EP is
    # not: megatron-core 0.19.2 requires it with the flex dispatcher (transformer_config.py:1609-1614)
    Unmodelled("model.moe_flex_dispatcher_backend",
               "the flex dispatcher's NCCL EP backend: each dispatch gets a receive buffer of a static per-rank "
               "capacity (tokens x topk x moe_expert_rank_capacity_factor) that the experts keep views of, plus, "
               "with zero copy, NCCL symmetric memory outside torch's allocator (token_dispatcher.py _NCCLEPManager; "
               "TE v2.17.1 transformer_engine/pytorch/ep.py EpBuffer); not modelled",
               lambda v: str(v) == "ncclep"),
    Unmodelled("model.heterogeneous_block_specs", "heterogeneous layers (per-layer shapes)"),
    # megatron-core 0.19.2 builds two variants (memory/variants.py models both); any other value (DeepSeek-V4's
    # "dsv4_hybrid") raises ValueError when the model is built (experimental_attention_variant_module_specs.py
    # get_experimental_attention_variant_module_spec :141-148)
    Unmodelled("model.experimental_attention_variant",
               "an attention variant megatron-core 0.19.2 does not build (it builds gated_delta_net and dsa: "
               "experimental_attention_variant_module_specs.py:141-148 raises ValueError for any other), so the "
               "job cannot run on this stack",
               lambda v: v not in ("gated_delta_net", "dsa")),
    Unmodelled("model.attention_backend", "a non-fused attention backend other than unfused/local (fused is planned)",
               lambda v: _enum_name(v) not in ("auto", "flash", "fused", "unfused", "local", "None")),
    # dist_muon is Muon under the layer-wise distributed optimizer (from_config.optimizer_name): modelled
    Unmodelled("optimizer.optimizer", "an optimizer other than Adam or Muon (dist_muon included): its state is "
               "planned as Adam's", lambda v: str(v) not in ("adam", "muon", "dist_muon")),
    Unmodelled("model.use_mamba_mem_eff_path", "the Mamba mixer's non-fused path (--disable-mamba-mem-eff-path: "
               "a separate conv1d and chunk scan) keeps more than the fused kernel", lambda v: v is False, moves=UP),
    # FSDP2 shards what the plan counts whole (parameters, gradients, optimizer state) over data parallelism and
    # gathers one module at a time: it can only lower those, never below nothing
    Unmodelled("ddp.use_torch_fsdp2", "PyTorch FSDP2 sharding", moves=DOWN, bound=lambda b: b.parameters
               + b.gradients + b.optimizer),
    Unmodelled("dist.use_torch_fsdp2", "PyTorch FSDP2 sharding", moves=DOWN, bound=lambda b: b.parameters
               + b.gradients + b.optimizer),
    # --- the attention variants (memory/variants.py models GDN and DSA): what stays outside the model
    Unmodelled("model.dsa_kernel_backend", "DSA's TileLang kernels (dsa_tilelang_kernels.py) keep tensors the plan "
               "does not model (it follows the cuDNN/FlashMLA and the unfused paths)", lambda v: v == "tilelang"),
    # DSA with context parallelism under a fused backend is modelled: the joint cuDNN kernel declines only the dense
    # indexer loss over CP's varlen bounds, and the split path that runs instead keeps the fused sparse attention
    # (memory/variants.py dsa_reference_loss); layouts FlashMLA cannot run take the unfused path (dsa_fused)
    Unmodelled("model.deterministic_mode", "the gated delta net's deterministic mode runs torch's reference chunk "
               "rule and conv1d (gated_delta_net/gdn.py :59-62, :197-209), which keep more than fla's kernels",
               lambda v: bool(v), moves=UP,
               when=lambda cfg: _read(cfg, "model.experimental_attention_variant") == "gated_delta_net"
               or any(c in str(_read(cfg, "model.hybrid_layer_pattern") or _read(cfg, "model.hybrid_override_pattern")
                              or "") for c in "G")),
    # DeepSeek-V4's recipes (recipes/deepseek/*/deepseek_v4.py, perf_recipes/deepseek/*) set fields of a newer
    # megatron-core: 0.19.2 has no hyper-connection module (nothing under megatron/core builds mHC, Sinkhorn
    # residual mixing or num_residual_streams), no such TransformerConfig fields (the provider's setattr is
    # ignored), and refuses "mhc" as a recompute module
    Unmodelled("model.enable_hyper_connections", "mHC hyper-connections: megatron-core 0.19.2 has no "
               "hyper-connection module nor this TransformerConfig field (it is ignored), so the job this recipe "
               "describes cannot run on this stack"),
    Unmodelled("model.use_fused_mhc", "fused mHC kernels: megatron-core 0.19.2 has no hyper-connection module nor "
               "this TransformerConfig field, so the job this recipe describes cannot run on this stack"),
    Unmodelled("model.recompute_modules", "recompute module 'mhc' is not one megatron-core 0.19.2 accepts "
               "(transformer_config.py:1768-1782 asserts on it under selective recompute): the job cannot start",
               lambda v: isinstance(v, (list, tuple)) and "mhc" in v,
               when=lambda cfg: _read(cfg, "model.recompute_granularity") == "selective"),
    # found by bench/recipe_census.py on Bridge 0.6.2's recipes (FIELD_CLASSES below says what the rest are)
    # memory/vision.py models the encoders of Qwen3-VL / Qwen3.5-VL (Bridge's megatron-core ViT), Qwen2.5-VL and
    # Gemma 3 (transformers' towers); the freeze_* flags are read (from_config frozen_lm, vision_tower_of)
    Unmodelled("model.vision_config", "a vision encoder the plan does not model (it models Qwen3-VL's and "
               "Qwen3.5-VL's megatron-core ViT, Qwen2.5-VL's and Gemma 3's SigLIP towers; this provider builds "
               "another: docs/memory-model.md names what differs): its weights, gradients, optimizer state and "
               "activations beside the language model are not planned", moves=UP,
               when=lambda cfg: _vision_unmodelled(cfg)),
    # TE's operation fuser on the experts is modelled (activations.op_fuser_terms, from_config.moe_op_fuser), and so
    # is moe_paged_stash (buffers.paged_stash_buffer); what is left is a job that cannot run, or a dense MLP
    Unmodelled("model.use_transformer_engine_op_fuser",
               "TE's operation fuser where the plan has no job to plan: megatron-core refuses it for these experts "
               "(TEGroupedMLP asserts _is_fused_impl_supported, moe/experts.py:286-290, :332-400: expert TP 1, TE's "
               "GroupedLinear, SwiGLU / quick-GeGLU or the fused weighted squared ReLU, and for a GLU "
               "NVTE_CUTEDSL_FUSED_GROUPED_MLP set), moe_act recompute where only TE's basic ops can run (their "
               "scaled activation raises for activation_recompute_in_mlp without the fused grouped MLP: TE v2.17.1 "
               "ops/basic/swiglu.py:426-430, activation.py:396-400), or a model without experts, whose dense MLP "
               "Bridge's layer spec makes TE fused ops (TEFusedMLP), not modelled",
               when=lambda cfg: op_fuser_blind(cfg)),
    Unmodelled("model.use_transformer_engine_full_layer_spec", "a whole Transformer Engine TransformerLayer per layer "
               "(te.pytorch.TransformerLayer through Bridge's gpt_full_te_layer_autocast_spec.py "
               "AutocastTransformerLayer): TE's own LayerNormMLP, MultiheadAttention and fused bias-dropout-add, "
               "whose saved tensors were not read (one recipe, GPT-3 175B)"),
    Unmodelled("model.quant_recipe", "a per-module quantization recipe (a RecipeConfig TE's quantizer factory reads "
               "from a file) changes the weight and activation dtypes of the modules it matches; its recipes are "
               "DeepSeek-V4's, which megatron-core 0.19.2 cannot build (mHC), and the NVFP4 perf recipes' (which "
               "modules it moves out of NVFP4 is not modelled)"),
    # a per-layer list of context-parallel communication types mixes layers the plan sizes alike
    Unmodelled("model.cp_comm_type", "a per-layer list of context-parallel communication types that differ between "
               "layers: the plan sizes every layer alike (a2a keeps one more attention output than p2p and "
               "all-gather, activations.kernel_output_apart)",
               lambda v: isinstance(v, (list, tuple)) and len({str(x) for x in v}) > 1, moves=UP,
               when=lambda cfg: _int(_read(cfg, "model.context_parallel_size")) > 1),
    # A provider that keeps its Hugging Face config and builds an encoder from it (Ministral 3's vision,
    # ministral3/modeling_ministral3.py; Qwen2-Audio's Whisper-style audio tower, qwen_audio/modeling_qwen2_audio.py:137
    # Qwen2AudioEncoder(config.hf_config.audio_config)) carries no model.vision_config: the encoder is not planned
    Unmodelled("model.hf_config", "an encoder the provider builds from its Hugging Face config (a vision_config or "
               "an audio_config): its weights, gradients, optimizer state and activations beside the language model "
               "are not planned", lambda v: any(getattr(v, k, None) is not None for k in ENCODER_CONFIGS), moves=UP,
               when=lambda cfg: getattr(getattr(cfg, "model", None), "vision_config", None) is None),
    # freeze_language_model is read only beside a planned vision encoder (from_config frozen_lm); elsewhere (an audio
    # model's) the plan counts the language model's gradients and optimizer state, which a frozen one does not keep
    Unmodelled("model.freeze_language_model", "a frozen language model beside an encoder the plan does not model "
               "keeps no gradients or optimizer state for its weights (the plan counts both)", moves=DOWN,
               bound=lambda b: b.gradients + b.optimizer,
               when=lambda cfg: getattr(getattr(cfg, "model", None), "vision_config", None) is None),
    Unmodelled("model.crossattn_emb_size", "cross-attention to conditioning embeddings (a diffusion transformer): "
               "the plan has no cross-attention block"),
    Unmodelled("model.csa_compress_ratios", "compressed sparse attention (DeepSeek-V4): per-layer KV compression and "
               "a sliding window instead of full attention"),
    Unmodelled("model.o_lora_rank", "a grouped low-rank attention output projection (DeepSeek-V4 o_groups x "
               "o_lora_rank) instead of the dense one planned"),
    Unmodelled("model.num_single_layers", "FLUX's single-stream and joint transformer blocks (a diffusion "
               "transformer): the plan has no such blocks"),
    # Gemma 4 dense (E2B/E4B/31B: bridge/models/gemma/gemma4_provider.py Gemma4DenseProvider.build :207-263)
    Unmodelled("model.per_layer_embed_dim", "Gemma 4's per-layer embeddings: a VocabParallelEmbedding of "
               "per_layer_embed_vocab_size x (num_layers x per_layer_embed_dim) and a hidden -> num_layers x "
               "per_layer_embed_dim projection on the first stage (modeling_gemma4.py _attach_ple_modules :884-915), a "
               "gate and projection per layer (:560-569), and the [b, s, layers, dim] per-layer inputs "
               "(_compute_per_layer_inputs :918-956): parameters, gradients, optimizer state and activations the "
               "plan does not count", lambda v: _int(v) > 0, moves=UP),
    Unmodelled("model.global_kv_channels", "Gemma 4 dense's full-attention layers have their own head size and "
               "query groups (global_kv_channels, num_global_query_groups: Gemma4DenseSelfAttention.__init__, "
               "modeling_gemma4.py:301-312): the plan sizes every layer like the sliding-window ones",
               when=lambda cfg: _int(_read(cfg, "model.global_kv_channels")) != _int(_read(cfg, "model.kv_channels"))
               or _read(cfg, "model.num_global_query_groups") not in (None, _read(cfg, "model.num_query_groups"))),
    Unmodelled("model.num_kv_shared_layers", "Gemma 4's last num_kv_shared_layers layers attend with K/V an earlier "
               "layer keeps on the module (_stored_kv, held until the next forward) while still computing and "
               "dropping their own (Gemma4DenseSelfAttention.get_query_key_value_tensors, modeling_gemma4.py:455-499), "
               "and its local layer spec runs megatron-core's DotProductAttention (get_gemma4_layer_spec :744-784, "
               "LocalSpecProvider.core_attention, backends.py:129-131): not the fused attention the plan sizes",
               lambda v: _int(v) > 0),
    Unmodelled("model.global_head_dim", "Gemma 4's full-attention layers have their own head size and KV heads "
               "(global_head_dim, num_global_key_value_heads, K reused as V): the plan sizes every layer like the "
               "sliding-window ones"),
)


@dataclass(frozen=True)
class UnmodelledFlag:
    """A Megatron-LM flag that changes GPU memory and has no configuration field to read it from: either not a flag
    of megatron-core 0.19.2's parser (a training script adds it), so a job that gives it lists it as unknown
    (bridge/megatron_args.py), or a flag of the parser that the mapping cannot carry into any field (``applies``:
    whether the job's validated arguments, a name -> value mapping, set it). ``with_coverage`` names it as not
    modelled, where it is set."""
    flag: str
    reason: str
    moves: str = EITHER        # as Unmodelled.moves / .bound
    bound: Callable[[Any], float] | None = None
    applies: Callable[[Any], bool] | None = None


# Megatron-LM's ModelOpt flags (megatron/post_training/arguments.py add_modelopt_args, which pretrain_gpt.py passes
# as extra_args_provider when nvidia-modelopt is installed). Knowledge distillation builds a second, frozen model
# beside the student (post_training/model_builder.py: the teacher's config is read from the checkpoint's
# model_config.yaml or --export-kd-teacher-model-config; checkpointing.py loads its weights) and runs its forward
# every microbatch for the distillation loss (post_training/loss_func.py): its weights, its forward's activations
# and its logits are on the GPU, and its shape is not in the job's arguments.
DISTILLATION = "knowledge distillation: a teacher model is loaded beside the student"
NOT_MODELLED_FLAGS: tuple[UnmodelledFlag, ...] = (
    UnmodelledFlag("--export-kd-teacher-load",
                   f"{DISTILLATION} from this checkpoint (its weights, its forward's activations and logits each "
                   "microbatch); its shape is in the checkpoint, not in the arguments", moves=UP),
    UnmodelledFlag("--export-kd-teacher-model-config",
                   f"{DISTILLATION}; this file gives the teacher's shape, which the plan does not read", moves=UP),
    UnmodelledFlag("--export-kd-cfg",
                   f"{DISTILLATION}; this file names the teacher's and student's outputs kept for the distillation "
                   "loss (logits, intermediate layers)", moves=UP),
)


# --use-checkpoint-args (with --load or --pretrained-checkpoint): Megatron-LM's parse_and_validate_args
# (megatron/training/arguments.py) calls load_args_from_checkpoint (training/checkpointing.py) before validate_args,
# which overwrites num_layers, hidden_size, ffn_hidden_size, seq_length, num_attention_heads, num_query_groups,
# kv_channels, num_experts, the vocabulary padding and more with the checkpoint's values: the arguments given are
# not the model that trains, and the checkpoint is not read here.
NOT_MODELLED_FLAGS += (
    UnmodelledFlag("--use-checkpoint-args",
                   "the checkpoint's arguments replace the model's (Megatron-LM's load_args_from_checkpoint sets "
                   "num_layers, hidden_size, ffn_hidden_size, seq_length, the attention heads, the experts and more "
                   "from the checkpoint before validation): the plan of the arguments given is not the job's plan",
                   applies=lambda args: bool(args.get("use_checkpoint_args"))
                   and bool(args.get("load") or args.get("pretrained_checkpoint"))),
    # --yaml-cfg: Megatron-LM's parse_args (arguments.py) replaces the whole namespace with load_yaml(args.yaml_cfg)
    # (training/yaml_arguments.py), and validates that one (validate_yaml): the flags given are not the job's
    UnmodelledFlag("--yaml-cfg",
                   "Megatron-LM's parse_args replaces every argument with the YAML file's (load_yaml, the experimental "
                   "YAML config): the plan of the arguments given is not the job's plan",
                   applies=lambda args: bool(args.get("yaml_cfg"))),
)


def _fp4_fused_experts(cfg: Any) -> bool:
    m = getattr(cfg, "model", None)
    if m is None or not getattr(m, "fp4", None) or not getattr(m, "use_transformer_engine_op_fuser", False):
        return False
    from .from_config import job_env_int
    return bool(getattr(m, "num_moe_experts", None)) and job_env_int(cfg, "NVTE_CUTEDSL_FUSED_GROUPED_MLP") >= 1


def op_fuser_blind(cfg: Any) -> bool:
    """Whether TE's operation fuser leaves the plan without a job to plan (the use_transformer_engine_op_fuser
    entry): megatron-core refuses it for the experts (from_config.op_fuser_unsupported), moe_act recompute where the
    config does not give the fused grouped MLP (from_config.fused_grouped_mlp_eligible; the GPU is taken as one it
    fuses on), or no experts (the dense MLP as TEFusedMLP through Bridge's TE layer spec, gpt_provider.py:54-55)."""
    m = getattr(cfg, "model", None)
    if m is None or not getattr(m, "use_transformer_engine_op_fuser", False):
        return False
    if str(getattr(m, "transformer_impl", "transformer_engine")) == "local":
        return False
    if not getattr(m, "num_moe_experts", None):
        return True
    from .from_config import fused_grouped_mlp_eligible, job_env_int, job_fp8_recipe, op_fuser_unsupported
    flag = job_env_int(cfg, "NVTE_CUTEDSL_FUSED_GROUPED_MLP")
    etp = _int(getattr(m, "expert_tensor_parallel_size", None) or getattr(m, "tensor_model_parallel_size", 1))
    if op_fuser_unsupported(m, etp, flag):
        return True
    moe_act = getattr(m, "recompute_granularity", None) == "selective" and "moe_act" in (
        getattr(m, "recompute_modules", None) or ())
    return moe_act and not fused_grouped_mlp_eligible(m, job_fp8_recipe(cfg), flag)


def _flag_name(word: str) -> str:
    """``--export-kd-cfg``, ``--export-kd-cfg=x`` and a dump's ``export_kd_cfg`` as one name."""
    return word.split("=", 1)[0].lstrip("-").replace("-", "_")


def _flag_set(value: str) -> bool:
    return value.strip() not in ("", "None", "False", "false", "null")


def _read(cfg: Any, path: str) -> Any:
    obj = cfg
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def _shown(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(str(v) for v in value) + "]"
    text = _enum_name(value)
    if "\n" in text or len(text) > 200:
        return f"<{type(value).__name__}>"   # a sub-config object (a vision config): its type, not its repr
    return text


def unmodelled_fields(cfg: Any, extra: tuple[Unmodelled, ...] = ()) -> tuple[tuple[str, str, str], ...]:
    """``(path, value, reason)`` for every NOT_MODELLED field (and ``extra``) set in ``cfg`` where it matters."""
    out = []
    for u in NOT_MODELLED + tuple(extra):
        value = _read(cfg, u.path)
        try:
            hit = value is not None and u.applies(value) and (u.when is None or bool(u.when(cfg)))
        except Exception:  # noqa: BLE001 — a value of an unexpected type is named rather than judged
            hit = True
        if hit:
            out.append((u.path, _shown(value), u.reason))
    return tuple(out)


def not_modelled(cfg: Any, extra: tuple[Unmodelled, ...] = ()) -> tuple[str, ...]:
    """``field=value: reason`` for every NOT_MODELLED field (and ``extra``) set in ``cfg`` where it matters, then
    every "conditional" FIELD_CLASSES entry whose condition holds (``conditional_unmodelled``): one list, which the
    plan's verdict reads."""
    return tuple(f"{path}={value}: {reason}" for path, value, reason in unmodelled_fields(cfg, extra)) \
        + conditional_unmodelled(cfg)


@dataclass(frozen=True)
class Gap:
    """One feature set in a job that changes memory and that the plan does not follow, as the fit verdict reads it
    (memory/plan.py ``judge``): its field or flag, the value set, why it matters, and how it can move the figure."""
    name: str                                   # the field ("model.moe_latent_size") or the flag ("--export-kd-cfg")
    value: str
    reason: str
    moves: str = EITHER                         # UP, DOWN or EITHER (Unmodelled.moves)
    bound: Callable[[Any], float] | None = None  # Unmodelled.bound

    @property
    def setting(self) -> str:
        """``field=value``; a Megatron-LM switch flag alone (``--delay-wgrad-compute``)."""
        if self.value == "" or (self.name.startswith("-") and self.value == "True"):
            return self.name
        return f"{self.name}={self.value}"

    def size(self, breakdown: Any = None) -> float | None:
        """The most following it can move the figure, bytes (None: the code gives no bound)."""
        if self.bound is None or breakdown is None:
            return None
        try:
            return max(0.0, float(self.bound(breakdown)))
        except Exception:  # noqa: BLE001 — a bound that cannot be computed is no bound
            return None

    def reach(self, breakdown: Any = None) -> tuple[float | None, float | None]:
        """(how far down, how far up) following it could move the most-loaded GPU's figure, bytes; None: open."""
        size = self.size(breakdown)
        return (0.0 if self.moves == UP else size), (0.0 if self.moves == DOWN else size)

    def how(self) -> str:
        return {UP: "it can only add memory", DOWN: "it can only lower memory"}.get(self.moves,
                                                                                   "it can move memory either way")

    def as_dict(self, breakdown: Any = None) -> dict[str, Any]:
        size = self.size(breakdown)
        return {"name": self.name, "value": self.value, "reason": self.reason, "moves": self.moves,
                "bound_bytes": None if size is None else int(size)}


def _entry(name: str) -> Unmodelled | UnmodelledFlag | None:
    """The entry of a field, or of a Megatron-LM flag: one of NOT_MODELLED_FLAGS, else the field it is named after
    (``--delay-wgrad-compute``: model.delay_wgrad_compute, as with_coverage names them)."""
    if name.startswith("-"):
        flag = _flag_name(name)
        return next((u for u in NOT_MODELLED_FLAGS if _flag_name(u.flag) == flag),
                    next((u for u in NOT_MODELLED if u.path.rsplit(".", 1)[-1] == flag), None))
    return next((u for u in NOT_MODELLED if u.path == name), None)


def gaps(texts: Any) -> tuple[Gap, ...]:
    """A plan's ``not_modelled`` texts (``field=value: reason``, or ``--flag=value: reason``) as :class:`Gap` records
    with their entry's ``moves`` and ``bound``; a text no entry names moves EITHER with no bound (a direction
    nobody stated is both ends open)."""
    out = []
    for text in texts or ():
        text = str(text)
        head, _, rest = text.partition(": ")
        name, _, value = head.partition("=")
        entry = _entry(name)
        reason = rest
        if entry is not None and text.endswith(": " + entry.reason) and text.startswith(name + "="):
            value, reason = text[len(name) + 1:len(text) - len(entry.reason) - 2], entry.reason
        out.append(Gap(name, value, reason, entry.moves if entry is not None else EITHER,
                       entry.bound if entry is not None else None))
    return tuple(out)


def flag_texts(job: Any) -> tuple[str, ...]:
    """A Megatron-LM job's not-modelled flags that are no configuration field (NOT_MODELLED_FLAGS, after
    ``with_coverage``) as ``--flag=value: reason``: added to its plan's ``not_modelled``, so the one verdict counts
    them too (the fields are in the plan's own list already)."""
    names = {_flag_name(u.flag) for u in NOT_MODELLED_FLAGS}
    return tuple(f"{n.flag}={n.value or 'True'}: {n.reason}" for n in getattr(job, "not_modelled", ())
                 if _flag_name(n.flag) in names)


def in_flags(job: Any, texts: Any) -> tuple[str, ...]:
    """A Megatron-LM job's plan's ``not_modelled`` in the job's own words: each of the job's not-modelled flags as
    ``--flag=value: reason`` (``with_coverage``: the fields by their flags, and the flags outside megatron-core's
    parser), then any field of ``texts`` (the plan's list, overlays applied) that no flag of the job names."""
    own = tuple(f"{n.flag}={n.value or 'True'}: {n.reason}" for n in getattr(job, "not_modelled", ()))
    named = {_flag_name(n.flag) for n in getattr(job, "not_modelled", ())}
    return own + tuple(t for t in texts or () if str(t).partition("=")[0].rsplit(".", 1)[-1] not in named)


def with_coverage(job: Any) -> Any:
    """A Megatron-LM job (bridge/megatron_args.MegatronJob) whose ``not_modelled`` names what this model does not
    follow in the job's config, by the Megatron-LM flag of each field (its name with dashes; megatron-core's
    arguments.py names its flags after the config fields), so the job's own list and the plan's are one list."""
    from dataclasses import replace

    from ..bridge.megatron_args import FlagNote
    notes: dict[str, FlagNote] = {}
    for path, value, reason in unmodelled_fields(job.config):
        flag = "--" + path.rsplit(".", 1)[-1].replace("_", "-")
        notes.setdefault(flag, FlagNote(flag, value, f"{reason} ({path}); the plan does not follow it"))
    # flags of megatron-core's parser that no field carries: named from the job's validated arguments
    for u in NOT_MODELLED_FLAGS:
        if u.applies is not None and u.applies(getattr(job, "args", None) or {}):
            notes.setdefault(u.flag, FlagNote(u.flag, "", f"{u.reason}; the plan does not follow it"))
    ignored = tuple(f for f in getattr(job, "ignored", ()) if f not in notes)
    # flags outside megatron-core's parser: named here (with the value the job gives) rather than as unknown
    by_name = {_flag_name(u.flag): u for u in NOT_MODELLED_FLAGS if u.applies is None}
    unknown = []
    for note in job.unknown:
        u = by_name.get(_flag_name(note.flag))
        value = note.value or (note.flag.split("=", 1)[1] if "=" in note.flag else "")
        if u is None or not _flag_set(value if value or "=" in note.flag else "True"):
            unknown.append(note)
            continue
        notes.setdefault(u.flag, FlagNote(u.flag, value, f"{u.reason} (a ModelOpt flag of Megatron-LM's "
                                                          "pretrain_gpt.py, not of megatron-core 0.19.2's parser); "
                                                          "the plan does not follow it"))
    return replace(job, not_modelled=tuple(notes.values()), unknown=tuple(unknown), ignored=ignored)



# ----------------------------------------------------------------------------- every other field a recipe sets
@dataclass(frozen=True)
class FieldClass:
    """What a model field the plan does not read (and NOT_MODELLED does not list) does to GPU memory.

    ``kind``: "neutral" (changes no GPU memory), "derived" (set from fields the plan reads), "covered" (its memory
    effect is the one ``covered_by`` names), "bounded" (it changes memory by a small amount the reason states, or in
    the direction the plan already over-counts), or "conditional" (it changes memory the plan does not follow where
    ``when(model, value)`` holds; named then by ``conditional_unmodelled``)."""
    kind: str
    reason: str
    covered_by: str = ""
    when: Callable[[Any, Any], bool] | None = None


def _neutral(reason: str) -> FieldClass:
    return FieldClass("neutral", reason)


def _covered(by: str, reason: str) -> FieldClass:
    return FieldClass("covered", reason, covered_by=by)


_ROPE = "rotary position embedding arithmetic: the cos/sin tables are computed per step, no kept state"
_META = "metadata: no module or tensor depends on it"
_DEAD = "not a field of megatron-core 0.19.2's TransformerConfig: nothing in the installed model code reads it"


def _fp8(m: Any) -> bool:
    return bool(getattr(m, "fp8", None))


def _int(v: Any) -> int:
    try:
        return int(v or 0)
    except (TypeError, ValueError):
        return 0


# One entry per field, found by bench/recipe_census.py over Bridge 0.6.2's recipes (model fields set away from their
# megatron-core / provider default, or that a recipe sets without the class declaring them).
FIELD_CLASSES: dict[str, FieldClass] = {
    # identity and bookkeeping
    "model.hf_model_id": _neutral(_META), "model.hf_model_revision": _neutral(_META),
    "model.hf_text_config": _neutral("the Hugging Face text config the provider's fields (which the plan reads) were "
                                     "copied from"),
    "model.bos_token_id": _neutral(_META), "model.eos_token_id": _neutral(_META),
    "model.audio_token_id": _neutral(_META), "model.image_token_id": _neutral(_META),
    "model.video_token_id": _neutral(_META), "model.vision_start_token_id": _neutral(_META),
    "model.vision_end_token_id": _neutral(_META), "model.vision_token_id": _neutral(_META),
    "model.pretrained_model_name": _neutral(_META),
    "model.pad_token_id": _neutral(_META),
    "model.no_rope_freq": _neutral("which layers skip rotary position embedding (NoPE layers); " + _ROPE),
    "model.async_tensor_model_parallel_allreduce": _neutral(_DEAD),
    "model.moe_z_loss_coeff": FieldClass(
        "bounded", "the router z-loss keeps one logsumexp and its square per token and MoE layer for backward "
                   "(megatron/core/transformer/moe/moe_utils.py:162-163 z_loss_func): 8 bytes per token, beside the "
                   "router logits the plan counts"),
    "model.return_dict": _neutral("how the forward returns its outputs"),
    "model.add_encoder": _neutral("whether this pipeline stage builds the encoder part (the vision path's stage)"),
    "model.add_decoder": _neutral("whether this pipeline stage builds the decoder part"),
    "model.interleaved_attn_pattern": _neutral("which layers use the sliding window (see model.window_size)"), "model.hetereogenous_dist_checkpoint": _neutral("a checkpoint format"),
    "model.init_method_std": _neutral("weight initialisation scale"),
    "model.use_cpu_initialization": _neutral("where weights are initialised before they move to the GPU"),
    "model.init_model_with_meta_device": _neutral("where weights are first created (meta device, with Megatron "
                                                  "FSDP); the trained weights are the same"),
    "model.calculate_per_token_loss": _neutral("how the loss is normalised"),
    "model.mtp_loss_scaling_factor": _neutral("a loss weight"), "model.moe_aux_loss_coeff": _neutral("a loss weight"),
    "model.mtp_eval_in_bf16": _neutral("evaluation only"),
    "model.moe_pad_experts_for_cuda_graph_inference": _neutral("inference only"),
    "model.use_te_rng_tracker": _neutral("which RNG tracker seeds dropout"),
    "model.high_priority_a2a_comm_stream": _neutral("stream priority of the expert all-to-all"),
    "model.batch_p2p_comm": _neutral("how pipeline sends and receives are batched"),
    "model.tp_only_amax_red": _neutral("which group reduces FP8 amax values"),
    "model.moe_a2a_overlap": _neutral(_DEAD), "model.cp_partition_mode": _neutral(_DEAD),
    "model.actual_vocab_size": _neutral(_DEAD + " (vocab_size, which the plan reads, sizes the embedding)"),
    "model.fp8_param_gather": _neutral(_DEAD + " on the model (it is a ddp / mixed_precision field there)"),
    # numerics that keep no extra state
    "model.rotary_base": _neutral(_ROPE), "model.rotary_percent": _neutral(_ROPE),
    "model.rotary_interleaved": _neutral(_ROPE), "model.rotary_scaling_factor": _neutral(_ROPE),
    "model.rope_scaling": _neutral(_ROPE), "model.rope_scaling_factor": _neutral(_ROPE),
    "model.mscale": _neutral(_ROPE), "model.mscale_all_dim": _neutral(_ROPE), "model.mrope_section": _neutral(_ROPE),
    "model.original_max_position_embeddings": _neutral(_ROPE),
    "model.yarn_rotary_scaling_factor": _neutral(_ROPE), "model.yarn_original_max_position_embeddings": _neutral(_ROPE),
    "model.yarn_beta_fast": _neutral(_ROPE), "model.yarn_beta_slow": _neutral(_ROPE),
    "model.yarn_correction_range_round_to_int": _neutral(_ROPE), "model.yarn_mscale": _neutral(_ROPE),
    "model.yarn_mscale_all_dim": _neutral(_ROPE), "model.csa_compress_rotary_base": _neutral(_ROPE),
    "model.rope_scaling_high_freq_factor": _neutral(_ROPE), "model.rope_scaling_low_freq_factor": _neutral(_ROPE),
    "model.rope_scaling_original_max_position_embeddings": _neutral(_ROPE),
    "model.layernorm_epsilon": _neutral("a norm's epsilon"),
    "model.layernorm_zero_centered_gamma": _neutral("a reparametrized norm weight (w + 1): the same weight and "
                                                    "saved input"),
    "model.softmax_scale": _neutral("a scale of the attention logits"),
    "model.query_pre_attn_scalar": _neutral("a scale of the attention logits"),
    "model.glu_linear_offset": _neutral("an offset inside the GLU activation"),
    "model.softmax_type": _neutral("attention sinks / off-by-one softmax add one learnable offset per head "
                                   "(attention.py:820-845); TE's fused kernel saves it with its softmax statistics "
                                   "(backends.py FusedAttnFunc.forward aux_ctx_tensors), the unfused path one extra "
                                   "score column (UnfusedDotProductAttention.forward :629-655): 1/s of the s x s term"),
    "model.norm_topk_prob": _neutral("routing arithmetic"),
    "model.moe_router_score_function": _neutral("routing arithmetic"),
    "model.moe_router_topk_scaling_factor": _neutral("routing arithmetic"),
    "model.moe_router_pre_softmax": _neutral("routing arithmetic"),
    "model.moe_router_num_groups": _neutral("group-limited routing: which experts are chosen, not how many"),
    "model.moe_router_group_topk": _neutral("group-limited routing: which experts are chosen, not how many"),
    "model.moe_router_enable_expert_bias": _neutral("one fp32 bias value per expert"),
    "model.moe_router_bias_update_rate": _neutral("how fast the expert bias moves: routing arithmetic"),
    "model.moe_router_force_load_balancing": _neutral("random router logits that balance the experts: the even "
                                                      "routing the plan assumes, made exact"),
    "model.moe_n_hash_layers": _neutral("hash routing in the first MoE layers: the same experts and token counts"),
    "model.window_size": _neutral("sliding-window attention changes only which scores the kernel computes: "
                                  "TEDotProductAttention gets the window as an argument (attention.py:1065-1074), and "
                                  "TE's fused and flash kernels save the same q, k, v, output and softmax statistics at "
                                  "any window (TE v2.17.1 attention/dot_product_attention/backends.py "
                                  "FusedAttnFunc.forward :1559-1569); the unfused backend masks the same s x s scores "
                                  "(UnfusedDotProductAttention.forward :567-684)"),
    "model.window_attn_skip_freq": _neutral("which layers use the window (attention.py:1065-1074); each keeps the "
                                            "same tensors as a full-attention layer (model.window_size)"),
    "model.cache_mla_latents": _neutral("an inference cache: megatron-core refuses it in training "
                                        "(multi_latent_attention.py:323-324 'cache_mla_latents conflicts with "
                                        "training'; absorbed MLA asserts it off, absorbed_mla.py:191)"),
    "model.mamba_chunk_size": _neutral("the chunked scan's chunk states are recomputed in backward "
                                       "(ssd_combined.py), so what is kept does not depend on the chunk size"),
    # kernel and fusion choices over the same saved tensors
    "model.apply_rope_fusion": _neutral("a fused rotary kernel; the unfused one saves only the shared cos/sin"),
    "model.bias_dropout_fusion": _neutral("a fused bias-dropout-add kernel over the tensors the plan counts"),
    "model.persist_layer_norm": _neutral("a persistent layer-norm kernel"),
    "model.moe_permute_fusion": _neutral("a fused token permutation over the permuted tokens the plan counts"),
    "model.moe_router_fusion": _neutral("a fused router top-k kernel"),
    "model.fused_single_qkv_rope": _neutral("a fused qkv-split and rotary kernel"),
    "model.mla_down_proj_fusion": _neutral("MLA's q and kv down projections as one GEMM of the same weights"),
    "model.gradient_accumulation_fusion": _neutral("weight gradients accumulated straight into main_grad, as "
                                                   "planned"),
    # set from fields the plan reads
    "model.pipeline_dtype": _neutral("dtype of the pipeline's send/receive buffers, set from params_dtype"),
    "model.autocast_dtype": _neutral("set from bf16 / fp16, which the plan reads"),
    "model.should_pad_vocab": _neutral("whether vocab_size is padded, which the plan follows (from_config.model_vocab)"),
    # named by another entry
    "model.moe_hybridep_num_sms_preprocessing": _neutral("how many SMs HybridEP's preprocessing kernel runs on: "
                                                         "the same buffers and routing maps (buffers.flex_* count them)"),
    "model.moe_permute_fusion_into_hybridep": _neutral("HybridEP allocates the permuted tokens once on both its paths "
                                                       "(the flex dispatcher's terms: activations.dispatcher_terms)"),
    "model.dsa_indexer_k_norm_epsilon": _neutral("a norm's epsilon"),
    "model.dsa_indexer_rope_interleaved": _neutral(_ROPE),
    "model.dsa_indexer_rotate_activation": _neutral("the Hadamard rotation (dsa.py rotate_activation :253-270) is "
                                                    "its own inverse and saves nothing for backward"),
    "model.csa_window_size": _covered("model.csa_compress_ratios", "compressed sparse attention's window"),
    "model.num_residual_streams": _covered("model.enable_hyper_connections", "how many residual streams mHC keeps"),
    "model.apply_dsa_kernel_fusion": _covered("model.enable_hyper_connections", "a DeepSeek-V4 attention setting "
                                              "megatron-core 0.19.2 does not have (only the V4 recipes set it)"),
    "model.mhc_sinkhorn_iterations": _covered("model.enable_hyper_connections", "mHC's Sinkhorn iterations"),
    "model.o_groups": _covered("model.o_lora_rank", "the groups of the low-rank output projection"),
    "model.vision_projector_config": _covered("model.vision_config", "the vision projector"),
    "model.is_vision_language": _covered("model.vision_config", "the vision path"),
    "model.guidance_embed": _covered("model.num_single_layers", "FLUX's guidance embedding"),
    **{f"model.{name}": _covered("model.num_single_layers", "a setting of FLUX's diffusion transformer") for name in (
        "axes_dims_rope", "context_dim", "guidance_scale", "model_channels", "num_joint_layers", "vec_in_dim")},
    **{f"model.{name}": _covered("model.crossattn_emb_size", "a setting of Wan's diffusion transformer") for name in (
        "in_channels", "freq_dim", "layernorm_across_heads", "out_channels", "patch_spatial", "patch_temporal",
        "qkv_format", "text_dim", "text_len")},
    **{f"model.{name}": _covered("model.vision_config", "a setting of the vision path") for name in (
        "patch_size", "spatial_merge_size", "temporal_patch_size", "deepstack_visual_indexes")},
    # the Qwen3-VL providers' vision settings that change what the encoder keeps (vision_model.py, model.py)
    "model.vision_cuda_graph_impl": FieldClass(
        "conditional", "TE CUDA graphs of the vision encoder pad every microbatch's patches to "
        "max_vision_cuda_graph_seq_length and keep the captured layers' tensors in the graphs' pool "
        "(vision_model.py:37-67, :297-344): not planned", when=lambda m, v: str(v or "none") != "none"),
    "model.dist_train": FieldClass(
        "conditional", "DistTrain puts the vision encoder on its own ranks with its own parallel layout "
        "(qwen3_vl_provider.py DistTrainConfig, model.py:287-298): the plan puts it on the first stage",
        when=lambda m, v: bool(getattr(v, "use_dist_train", False))),
    "model.num_global_key_value_heads": _covered("model.global_head_dim", "Gemma 4's full-attention KV heads"),
    "model.attention_k_eq_v": _covered("model.global_head_dim", "Gemma 4's full-attention layers reuse K as V"),
    "model.global_rotary_percent": _neutral(_ROPE),
    # YaRN in MLA (Kimi K2, DeepSeek): MLATransformerConfig fields (transformer_config.py:2942) passed to
    # YarnRotaryEmbedding (multi_latent_attention.py:195)
    "model.beta_fast": _neutral(_ROPE), "model.beta_slow": _neutral(_ROPE),
    # Gemma 4 dense's dual RoPE (gemma4_provider.py:224-246, Gemma4DenseRotaryEmbedding) and embedding scale
    "model.sliding_window_rope_base": _neutral(_ROPE), "model.full_attention_rope_base": _neutral(_ROPE),
    "model.full_attention_rope_partial_factor": _neutral(_ROPE),
    "model.num_global_query_groups": _covered("model.global_kv_channels", "Gemma 4 dense's full-attention query "
                                              "groups"),
    "model.per_layer_embed_vocab_size": _covered("model.per_layer_embed_dim", "the per-layer embedding's vocabulary"),
    "model.scale_embeddings_by_hidden_size": _neutral("the embedding output multiplied by sqrt(hidden) "
                                                      "(Gemma3LanguageModelEmbedding, gemma3_provider.py:272): a scalar product of the tensor "
                                                      "the plan counts"),
    # Kimi K2.5 VL provider (kimi_vl/kimi_k25_vl_provider.py:49-61): where its vision code is loaded from, and
    # token ids the image merge reads
    "model.hf_model_path": _neutral("where the provider loads the vision module's code from: " + _META),
    "model.trust_remote_code": _neutral("whether that code may be loaded: " + _META),
    "model.media_placeholder_token_id": _neutral(_META), "model.ignore_index": _neutral("the label value masked out "
                                                                                       "of the loss: " + _META),
    "model.text_config": _neutral("the Hugging Face text config the provider's fields (which the plan reads) were "
                                  "copied from"),
    **{f"model.{name}": _covered("model.vision_config", "a setting of the vision path") for name in (
        "num_position_embeddings", "out_hidden_size", "vision_soft_tokens_per_image")},
    "model.language_max_sequence_length": _covered("model.vision_config", "the language model's sequence in a "
                                                   "vision-language model, image tokens included"),
    # small, or where the plan already over-counts
    "model.moe_router_dtype": FieldClass(
        "conditional", "the router's scores over every expert are fp32 whatever the logits' dtype (moe/moe_utils.py "
        "topk_routing_with_score_function :836-857: softmax(..., dtype=torch.float32), sigmoid(logits.float())), "
        "which the plan counts (activations.py moe_router); fp64 logits (router.py:103-108) are kept only by the "
        "z-loss's logsumexp (moe_utils.py z_loss_func :162), 8 bytes per token and expert the plan does not count",
        when=lambda m, v: v == "fp64" and bool(getattr(m, "moe_z_loss_coeff", None))),
    "model.moe_router_load_balancing_type": FieldClass(
        "bounded", "the load-balancing loss's per-token expert scores: tokens x experts values, like the router's"),
    "model.moe_router_padding_for_quantization": FieldClass(
        "bounded", "pads each expert's tokens to a multiple of 16/32 (transformer_config.py:750): at most 31 more "
                   "tokens per local expert"),
    "model.moe_router_padding_for_fp8": FieldClass(
        "bounded", "pads each expert's tokens to a multiple of 16: at most 15 more tokens per local expert"),
    "model.add_qkv_bias": FieldClass("bounded", "(heads + 2 x groups) x head_dim bias values per layer"),
    "model.fine_grained_offloading_max_inflight_offloads": FieldClass(
        "bounded", "caps the offloaded copies still pending on the GPU per group (transformer_config.py:1286)"),
    "model.delay_offload_until_cuda_graph": FieldClass(
        "bounded", "offloads once the CUDA graph has run: the offloaded tensors stay until that layer's graph ends"),
    "model.overlap_p2p_comm": FieldClass("bounded", "one more receive buffer of one microbatch's stage input"),
    # changes memory only together with another setting
    "model.head_dim": FieldClass(
        "conditional", "an attention head size the plan does not read when it differs from kv_channels (which it "
        "reads)", when=lambda m, v: v is not None and v != getattr(m, "kv_channels", v)),
    # a Bridge provider field (hybrid_provider.py:165, set from the HF config by nemotron_h_bridge.py:306) that
    # nothing in Bridge 0.6.2 or megatron-core 0.19.2 reads: the MTP block takes the global FP8 context whatever it
    # says (multi_token_prediction.py :1179-1186, :1708, :1725), as the plan counts
    "model.keep_mtp_spec_in_bf16": _neutral("declared by Bridge's hybrid provider and read by nothing: megatron-core "
                                            "0.19.2's MTP layers run under the global FP8 context whatever it says "
                                            "(multi_token_prediction.py:1179-1186)"),
    "model.parallel_output": FieldClass(
        "conditional", "off, the output logits are gathered over the tensor-parallel group: every rank holds the whole "
        "vocabulary's logits, not its 1/TP shard", when=lambda m, v: v is False and _int(getattr(
            m, "tensor_model_parallel_size", 1)) > 1),
    "model.decoder_sparse_step": FieldClass(
        "conditional", "MoE on every n-th layer only, which the plan reads from moe_layer_freq", when=lambda m, v: _int(v) > 1),
    "model.external_cuda_graph": FieldClass(
        "conditional", "a deprecated alias: finalize turns it into cuda_graph_impl=transformer_engine "
        "(transformer_config.py:2365-2380), which the plan reads only once the config is finalized",
        when=lambda m, v: bool(v) and str(getattr(m, "cuda_graph_impl", "none")) == "none"),
}


def _declared_default(cls: type, name: str) -> tuple[bool, Any, str]:
    """(found?, default, module of the declaring class) of dataclass field ``name`` as its first declaring class
    declares it (the base-most class of ``cls``'s MRO whose dataclass fields hold it): a provider that changes a
    megatron-core default (Qwen3's ``qk_layernorm=True``) sets a feature as much as a recipe that changes it does."""
    import dataclasses
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        found = {f.name: f for f in dataclasses.fields(klass)}.get(name)
        if found is None:
            continue
        if found.default is not dataclasses.MISSING:
            return True, found.default, klass.__module__
        if found.default_factory is not dataclasses.MISSING:
            try:
                return True, found.default_factory(), klass.__module__
            except Exception:  # noqa: BLE001 — a factory that needs arguments: no default to compare with
                return False, None, klass.__module__
        return False, None, klass.__module__
    return False, None, ""


def _set(value: Any) -> bool:
    try:
        return value is not None and value is not False and not (isinstance(value, (int, float, str, list, tuple, dict))
                                                                   and not value)
    except Exception:  # noqa: BLE001
        return True


def _differs(value: Any, default: Any) -> bool:
    try:
        return bool(value != default)
    except Exception:  # noqa: BLE001 — a value whose comparison fails (a tensor): compared by identity
        return value is not default


def non_default_fields(section: Any) -> tuple[tuple[str, Any], ...]:
    """``(field, value)`` of a config dataclass (a model provider) for every field whose value differs from its
    first declared default, every field a model provider adds to megatron-core's config that is set at all (Gemma 4's
    ``global_kv_channels=512`` is its provider's default, and still an architecture the plan must know), and every
    public attribute it carries that its class does not declare (a recipe that sets ``use_fused_mhc`` on a provider
    without that field)."""
    import dataclasses
    if section is None or not dataclasses.is_dataclass(section):
        return ()
    declared = {f.name for f in dataclasses.fields(section)}
    out = []
    for name in sorted(declared):
        value = getattr(section, name, None)
        has_default, default, module = _declared_default(type(section), name)
        provider_field = not module.startswith("megatron.core")
        if (has_default and _differs(value, default)) or (not has_default and value is not None) \
                or (provider_field and _set(value)):
            out.append((name, value))
    out += [(name, value) for name, value in sorted(vars(section).items())
            if not name.startswith("_") and name not in declared]
    return tuple(out)


def _short(value: Any) -> str:
    shown = _shown(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def unclassified_fields(cfg: Any) -> tuple[tuple[str, str], ...]:
    """``(path, value)`` for every model field set away from its default that the plan does not read
    (MODEL_READS), NOT_MODELLED does not list and FIELD_CLASSES does not classify: nobody has yet decided whether
    it changes memory (bench/recipe_census.py reports them)."""
    known = MODEL_READS | {u.path for u in NOT_MODELLED} | set(FIELD_CLASSES)
    return tuple((f"model.{name}", _short(value)) for name, value in non_default_fields(getattr(cfg, "model", None))
                 if f"model.{name}" not in known)


def conditional_unmodelled(cfg: Any) -> tuple[str, ...]:
    """``field=value: reason`` for every "conditional" FIELD_CLASSES entry whose condition holds in ``cfg``: memory
    the plan does not follow, like ``not_modelled`` (whose entries take the field's value alone)."""
    model = getattr(cfg, "model", None)
    out = []
    for path, fc in FIELD_CLASSES.items():
        if fc.kind != "conditional" or fc.when is None or model is None:
            continue
        value = _read(cfg, path)
        try:
            hit = fc.when(model, value)
        except Exception:  # noqa: BLE001 — a value of an unexpected type is named rather than judged
            hit = True
        if hit:
            out.append(f"{path}={_short(value)}: {fc.reason}")
    return tuple(out)
