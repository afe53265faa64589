"""What the model reads and what it knowingly does not: no memory-relevant field is ignored silently.

``MODEL_READS`` declares the configuration fields ``from_config`` reads (tests/test_plan_terms.py checks that
every field from_config.py reads is declared here). ``NOT_MODELLED`` lists fields known to change GPU memory that
the model does not follow, each with the values at which it matters and why; ``not_modelled(cfg)`` names those
set in a configuration ("not modelled: field=value"), which the plan carries into its verdict and JSON
(memory/plan.py). Another part of the project that finds a memory-relevant field the model does not follow adds it
here (one ``Unmodelled`` each), not in its own list; a memory-relevant Megatron-LM flag with no configuration field
(a training script's own flag, outside megatron-core's parser) is one ``UnmodelledFlag`` in ``NOT_MODELLED_FLAGS``.
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
})


@dataclass(frozen=True)
class Unmodelled:
    """A configuration field that changes GPU memory and that the model does not follow at the values where
    ``applies(value)`` holds (default: any value other than None, False, 0 or empty)."""
    path: str
    reason: str
    applies: Callable[[Any], bool] = bool


def _enum_name(value: Any) -> str:
    return str(getattr(value, "name", value))


NOT_MODELLED: tuple[Unmodelled, ...] = (
    Unmodelled("model.overlap_moe_expert_parallel_comm",
               "overlapping expert-parallel communication runs two microbatches' layers interleaved"),
    Unmodelled("model.delay_wgrad_compute", "delayed weight gradients keep GEMM inputs and grad outputs longer"),
    Unmodelled("model.cpu_offloading_weights", "weight CPU offload moves layer weights off the GPU"),
    Unmodelled("model.fp4", "FP4 weights and GEMM inputs"),
    Unmodelled("model.first_last_layers_bf16", "with FP8 the first and last layers stay bf16",
               lambda v: bool(v)),
    Unmodelled("model.moe_latent_size", "latent MoE projects tokens to a smaller size before the experts"),
    Unmodelled("model.moe_token_dispatcher_type", "the flex (DeepEP / HybridEP) dispatcher's buffers",
               lambda v: v == "flex"),
    Unmodelled("model.heterogeneous_block_specs", "heterogeneous layers (per-layer shapes)"),
    Unmodelled("model.experimental_attention_variant", "an experimental attention variant"),
    Unmodelled("model.attention_backend", "a non-fused attention backend other than unfused/local (fused is planned)",
               lambda v: _enum_name(v) not in ("auto", "flash", "fused", "unfused", "local", "None")),
    Unmodelled("optimizer.optimizer", "an optimizer other than Adam or Muon: its state is planned as Adam's",
               lambda v: str(v) not in ("adam", "muon")),
    Unmodelled("model.hybrid_layer_pattern", "hybrid layers the plan has no block for (G: gated delta net, "
               "D: DeepSeek sparse attention, +: MLA) are left out",
               lambda v: isinstance(v, str) and any(c in v for c in "GD+")),
    Unmodelled("model.hybrid_override_pattern", "hybrid layers the plan has no block for (G, D, +) are left out",
               lambda v: isinstance(v, str) and any(c in v for c in "GD+")),
    Unmodelled("model.use_mamba_mem_eff_path", "the Mamba mixer's non-fused path (--disable-mamba-mem-eff-path: "
               "a separate conv1d and chunk scan) keeps more than the fused kernel", lambda v: v is False),
    Unmodelled("ddp.use_torch_fsdp2", "PyTorch FSDP2 sharding"),
    Unmodelled("dist.use_torch_fsdp2", "PyTorch FSDP2 sharding"),
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
                   "microbatch); its shape is in the checkpoint, not in the arguments"),
    UnmodelledFlag("--export-kd-teacher-model-config",
                   f"{DISTILLATION}; this file gives the teacher's shape, which the plan does not read"),
    UnmodelledFlag("--export-kd-cfg",
                   f"{DISTILLATION}; this file names the teacher's and student's outputs kept for the distillation "
                   "loss (logits, intermediate layers)"),
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
                   lambda args: bool(args.get("use_checkpoint_args"))
                   and bool(args.get("load") or args.get("pretrained_checkpoint"))),
    # --yaml-cfg: Megatron-LM's parse_args (arguments.py) replaces the whole namespace with load_yaml(args.yaml_cfg)
    # (training/yaml_arguments.py), and validates that one (validate_yaml): the flags given are not the job's
    UnmodelledFlag("--yaml-cfg",
                   "Megatron-LM's parse_args replaces every argument with the YAML file's (load_yaml, the experimental "
                   "YAML config): the plan of the arguments given is not the job's plan",
                   lambda args: bool(args.get("yaml_cfg"))),
)


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
    return _enum_name(value)


def unmodelled_fields(cfg: Any, extra: tuple[Unmodelled, ...] = ()) -> tuple[tuple[str, str, str], ...]:
    """``(path, value, reason)`` for every NOT_MODELLED field (and ``extra``) set in ``cfg`` where it matters."""
    out = []
    for u in NOT_MODELLED + tuple(extra):
        value = _read(cfg, u.path)
        try:
            hit = value is not None and u.applies(value)
        except Exception:  # noqa: BLE001 — a value of an unexpected type is named rather than judged
            hit = True
        if hit:
            out.append((u.path, _shown(value), u.reason))
    return tuple(out)


def not_modelled(cfg: Any, extra: tuple[Unmodelled, ...] = ()) -> tuple[str, ...]:
    """``field=value: reason`` for every NOT_MODELLED field (and ``extra``) set in ``cfg`` where it matters."""
    return tuple(f"{path}={value}: {reason}" for path, value, reason in unmodelled_fields(cfg, extra))


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
