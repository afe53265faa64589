"""The parallel layout: world size, pipeline split, sequence parallel."""

from __future__ import annotations

from .facts import EP_OVERLAP_READS, MEM_SKILL, SURFACE, data_parallel_size, effective_ep_overlap
from .registry import check, resolver

LAYOUT = ("model.tensor_model_parallel_size", "model.pipeline_model_parallel_size", "model.context_parallel_size")


PIPELINE_SPLIT = ("model.pipeline_model_parallel_size", "model.virtual_pipeline_model_parallel_size", "model.num_layers",
                  "model.num_layers_in_first_pipeline_stage", "model.num_layers_in_last_pipeline_stage",
                  "model.account_for_embedding_in_pipeline_split", "model.account_for_loss_in_pipeline_split",
                  "model.pipeline_model_parallel_layout", "model.hybrid_layer_pattern",
                  "model.hybrid_override_pattern")


HYBRID_READS = ("model.hybrid_layer_pattern", "model.hybrid_override_pattern")


def hybrid_pattern(view) -> str | None:
    """The hybrid (Mamba) layer pattern without its MTP part, or None for a GPT stack."""
    pattern = view.get("model.hybrid_layer_pattern") or view.get("model.hybrid_override_pattern")
    return pattern.split("/")[0] if isinstance(pattern, str) and pattern else None


def even_split_layers(view) -> int | None:
    """Layers split evenly over PP as transformer_block.get_num_layers_to_build counts them (the embedding and loss
    count as layers when accounted for); None when the split is uneven, a custom layout decides, or the model is
    a hybrid stack (hybrid_pipeline_split checks those)."""
    if view.get("model.pipeline_model_parallel_layout") is not None or hybrid_pattern(view) is not None:
        return None
    if view.get("model.num_layers_in_first_pipeline_stage") is not None \
            or view.get("model.num_layers_in_last_pipeline_stage") is not None:
        return None  # megatron-core checks uneven splits itself, at config time (transformer_config.py:1995-2062)
    return ((view.get("model.num_layers") or 0) + bool(view.get("model.account_for_embedding_in_pipeline_split"))
            + bool(view.get("model.account_for_loss_in_pipeline_split")))


@check(enforced_by="runtime",
       source=f"{MEM_SKILL}, Code Anchors: VPP config and layer divisibility. megatron-core asserts it when it builds "
              "the model (C transformer/transformer_block.py:148-152, get_num_layers_to_build), after launch",
       reads=PIPELINE_SPLIT)
def pipeline_layers_divisible(view, c):
    """An even pipeline split needs num_layers divisible by PP (model build)."""
    pp, layers = view.get("model.pipeline_model_parallel_size") or 1, even_split_layers(view)
    if pp > 1 and layers is not None and layers % pp:
        yield c.problem(view.parties("model.pipeline_model_parallel_size", "model.num_layers"),
                        "model.pipeline_model_parallel_size", pp,
                        f"num_layers={layers} should be divisible by pipeline_model_parallel_size={pp} (megatron-core "
                        "fails with this assertion when it builds the model on the GPUs)",
                        f"choose a PP that divides {layers}, or set model.num_layers_in_first/last_pipeline_stage")


@check(enforced_by="runtime",
       source=f"{MEM_SKILL}, Code Anchors: VPP config and layer divisibility. megatron-core asserts it when it builds "
              "the model (C transformer/transformer_block.py:154-172) for even splits; uneven splits are checked "
              "at config time (transformer_config.py:2050-2062)",
       reads=PIPELINE_SPLIT)
def vpp_layer_divisibility(view, c):
    """Layers per pipeline rank divide by the virtual pipeline size (model build)."""
    pp, vpp = view.get("model.pipeline_model_parallel_size") or 1, view.get("model.virtual_pipeline_model_parallel_size")
    layers = even_split_layers(view)
    if pp > 1 and vpp and layers is not None and layers % pp == 0 and (layers // pp) % vpp:
        yield c.problem(view.parties("model.virtual_pipeline_model_parallel_size", "model.pipeline_model_parallel_size"),
                        "model.virtual_pipeline_model_parallel_size", vpp,
                        f"num_layers_per_pipeline_rank {layers // pp} should be divisible by vp_size {vpp} (megatron-core "
                        "fails with this assertion when it builds the model on the GPUs)",
                        f"choose a VPP that divides {layers // pp}")


@check(enforced_by="runtime",
       source=f"{MEM_SKILL}, Code Anchors: layer divisibility. megatron-core splits a hybrid (Mamba) stack when it "
              "builds the model (C models/hybrid/hybrid_layer_allocation.py:384-465): without '|' separators the "
              "pattern's layers must divide by PP and VPP is not supported; with them, the segments must divide by PP",
       reads=PIPELINE_SPLIT)
def hybrid_pipeline_split(view, c):
    """A hybrid (Mamba) stack splits over PP by its pattern: layers or '|' segments divide by PP, no VPP without '|'."""
    pattern, pp = hybrid_pattern(view), view.get("model.pipeline_model_parallel_size") or 1
    if pattern is None or pp <= 1:
        return
    who = view.parties("model.pipeline_model_parallel_size")
    segments = pattern.split("|")
    if len(segments) > 1:
        if len(segments) % pp:
            yield c.problem(who, "model.pipeline_model_parallel_size", pp,
                            f"The number of pipe-delimited segments ({len(segments)}) in hybrid_layer_pattern must be "
                            f"evenly divisible by pipeline_model_parallel_size ({pp}) (fails at model build)",
                            f"choose a PP that divides {len(segments)}")
        return
    if view.get("model.virtual_pipeline_model_parallel_size") is not None:
        yield c.problem(view.parties("model.virtual_pipeline_model_parallel_size"),
                        "model.virtual_pipeline_model_parallel_size", view.get("model.virtual_pipeline_model_parallel_size"),
                        "Virtual pipeline parallelism is not supported when hybrid_layer_pattern has no pipe ('|') "
                        "separators (fails at model build)",
                        "set model.virtual_pipeline_model_parallel_size=null, or add '|' stage boundaries to the pattern")
    layers = len(pattern.replace("|", ""))
    if view.get("model.num_layers_in_first_pipeline_stage") is None \
            and view.get("model.num_layers_in_last_pipeline_stage") is None and layers % pp:
        yield c.problem(who, "model.pipeline_model_parallel_size", pp,
                        f"Number of layers ({layers}) must be evenly divisible by pipeline-model-parallel-size ({pp}) "
                        "when no pipe separators are specified in the pattern (fails at model build)",
                        f"choose a PP that divides {layers}")


@check(enforced_by="bridge", oracle="is not divisible by total_model_size",
       source=f"{SURFACE} §4 (set_data_parallel_size in runtime_config_update)", reads=LAYOUT)
def world_size_divisible(view, c):
    """The world size divides by TP*PP*CP."""
    if view.world_size is None:
        return
    tp, pp, cp = (view.get(k) or 1 for k in LAYOUT)
    if view.world_size % (tp * pp * cp):
        yield c.problem(("config",), "world_size", view.world_size,
                        f"world size {view.world_size} is not divisible by TP*PP*CP = {tp}*{pp}*{cp} = {tp * pp * cp}",
                        f"use a world size that is a multiple of {tp * pp * cp}, or change the parallel sizes")


@check(enforced_by="bridge", oracle="must be divisible by eval_micro_batch_size * eval_data_parallel_size",
       source="Bridge config.py validate() (eval_global_batch_size, which defaults to train.global_batch_size); "
              "megatron-core num_microbatches_calculator.py asserts the same for training when the job starts",
       reads=(*LAYOUT, "train.global_batch_size", "train.micro_batch_size", "validation.eval_global_batch_size",
              "validation.eval_micro_batch_size", "dist.eval_context_parallel_size"))
def global_batch_divisible(view, c):
    """The (eval) global batch divides by micro batch x DP."""
    dp = data_parallel_size(view)
    if dp is None or view.get("dist.eval_context_parallel_size") is not None:
        return
    for prefix, gbs_path, mbs_path in (("", "train.global_batch_size", "train.micro_batch_size"),
                                       ("eval_", "validation.eval_global_batch_size", "validation.eval_micro_batch_size")):
        gbs = view.get(gbs_path) or (view.get("train.global_batch_size") if prefix else None)
        mbs = view.get(mbs_path) or (view.get("train.micro_batch_size") if prefix else None)
        if gbs and mbs and gbs % (mbs * dp):
            yield c.problem(view.parties(gbs_path, "model.tensor_model_parallel_size"), gbs_path, gbs,
                            f"{prefix}global_batch_size ({gbs}) must be divisible by {prefix}micro_batch_size * "
                            f"{prefix}data_parallel_size ({mbs} * {dp} = {mbs * dp}); DP = world {view.world_size} / "
                            "(TP*PP*CP)", f"use a world size or {gbs_path} that makes it divide, e.g. "
                                          f"{gbs_path}={max(1, gbs // (mbs * dp)) * mbs * dp}")
            return


@check(enforced_by="silent",
       source=f"{SURFACE} §4 (Bridge's finalize silently sets sequence_parallel=False when TP<=1, "
              "models/transformer_config.py:179-180; nothing raises)",
       reads=("model.sequence_parallel", "model.tensor_model_parallel_size"))
def sequence_parallel_needs_tp(view, c):
    """Sequence parallel at TP=1 is silently turned off by Bridge (warned)."""
    if view.get("model.sequence_parallel") and (view.get("model.tensor_model_parallel_size") or 1) <= 1:
        yield (f"sequence_parallel=True with TP=1 is silently turned off by Bridge (set by {view.setter('model.sequence_parallel')}); "
               "set model.tensor_model_parallel_size>=2 for it to take effect")


FSDP_READS = ("ddp.use_megatron_fsdp", "dist.use_megatron_fsdp")


def megatron_fsdp(view) -> bool:
    return bool(view.get("ddp.use_megatron_fsdp") or view.get("dist.use_megatron_fsdp"))


@check(enforced_by="bridge",
       oracle=("use_megatron_fsdp and use_torch_fsdp2 are mutually exclusive",
               "FSDP requires CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset",
               "DDP.fsdp_manual_registration requires DDP.nccl_ub",
               "Megatron-FSDP requires the fsdp_dtensor checkpointing format",
               "use_tp_pp_dp_mapping is not supported with Megatron FSDP"),
       source="nvidia-skills/nemo-mbridge-perf-megatron-fsdp.SKILL.md; "
              f"{SURFACE} §1.8 (Bridge config.py _validate_and_apply_megatron_fsdp_configs)",
       reads=(*FSDP_READS, "dist.use_torch_fsdp2", "$CUDA_DEVICE_MAX_CONNECTIONS", "ddp.nccl_ub",
              "ddp.fsdp_manual_registration", "checkpoint.save", "checkpoint.load", "checkpoint.ckpt_format",
              "dist.use_tp_pp_dp_mapping"))
def megatron_fsdp_settings(view, c):
    """Megatron FSDP: not with torch FSDP2, CUDA_DEVICE_MAX_CONNECTIONS!=1, nccl_ub, checkpoint format."""
    if not megatron_fsdp(view):
        return
    who = view.parties("ddp.use_megatron_fsdp")
    if view.get("dist.use_megatron_fsdp") and view.get("dist.use_torch_fsdp2"):
        yield c.problem(view.parties("dist.use_megatron_fsdp", "dist.use_torch_fsdp2"), "dist.use_torch_fsdp2", True,
                        "use_megatron_fsdp and use_torch_fsdp2 are mutually exclusive", "set dist.use_torch_fsdp2=false")
    if view.env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
        yield c.problem(who, "$CUDA_DEVICE_MAX_CONNECTIONS", "1",
                        "FSDP requires CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset",
                        "unset CUDA_DEVICE_MAX_CONNECTIONS (or export it as 8) for Megatron FSDP; it is usually set to 1 "
                        "for TP communication overlap, which FSDP does not use the same way")
    if view.get("ddp.fsdp_manual_registration") and not view.get("ddp.nccl_ub"):
        yield c.problem(view.parties("ddp.fsdp_manual_registration", "ddp.nccl_ub"), "ddp.fsdp_manual_registration", True,
                        "DDP.fsdp_manual_registration requires DDP.nccl_ub", "set ddp.nccl_ub=true or drop the registration")
    if (view.get("checkpoint.save") is not None or view.get("checkpoint.load") is not None) \
            and view.get("checkpoint.ckpt_format") != "fsdp_dtensor":
        yield c.problem(view.parties("checkpoint.ckpt_format"), "checkpoint.ckpt_format", view.get("checkpoint.ckpt_format"),
                        "Megatron-FSDP requires the fsdp_dtensor checkpointing format (when saving or loading)",
                        "set checkpoint.ckpt_format=fsdp_dtensor")
    if view.get("dist.use_tp_pp_dp_mapping"):
        yield c.problem(view.parties("dist.use_tp_pp_dp_mapping"), "dist.use_tp_pp_dp_mapping", True,
                        "use_tp_pp_dp_mapping is not supported with Megatron FSDP", "set dist.use_tp_pp_dp_mapping=false")


@check(enforced_by="silent", source=f"{SURFACE} §1.8 (Bridge forces both distributed-optimizer flags on under Megatron "
                                    "FSDP: config.py _validate_and_apply_megatron_fsdp_configs)",
       reads=(*FSDP_READS, "optimizer.use_distributed_optimizer", "ddp.use_distributed_optimizer"))
def megatron_fsdp_forces_dist_opt(view, c):
    """Megatron FSDP turns both distributed-optimizer flags on (note)."""
    if megatron_fsdp(view) and not (view.get("optimizer.use_distributed_optimizer")
                                    and view.get("ddp.use_distributed_optimizer")):
        yield ("note: Megatron FSDP: Bridge turns on optimizer.use_distributed_optimizer and "
               "ddp.use_distributed_optimizer itself (FSDP always shards optimizer state)")


CHECKPOINT_IO = ("checkpoint.save", "checkpoint.load")


def checkpoint_io(view) -> bool:
    """Whether the job saves or loads a checkpoint (Bridge checks the format only then: config.py
    _validate_and_apply_megatron_fsdp_configs and validate())."""
    return any(view.get(p) is not None for p in CHECKPOINT_IO)


@resolver("megatron_fsdp", writes=("checkpoint.ckpt_format",))
def resolve_megatron_fsdp(view, params):
    """checkpoint.ckpt_format=fsdp_dtensor when the job saves or loads (checkpoint.save/load set): Bridge asserts that
    format under Megatron FSDP (config.py _validate_and_apply_megatron_fsdp_configs; skill, Pitfalls 1)."""
    if checkpoint_io(view) and view.get("checkpoint.ckpt_format") != "fsdp_dtensor":
        return {"checkpoint.ckpt_format": "fsdp_dtensor"}, {}
    return {}, {}


@check(enforced_by="bridge", oracle="fsdp_dtensor checkpoint format only supports Megatron FSDP",
       source=f"{SURFACE} §1.8 (Bridge config.py validate(), 1388-1394: checked only when saving or loading)",
       reads=(*FSDP_READS, "dist.use_torch_fsdp2", "checkpoint.ckpt_format", *CHECKPOINT_IO))
def fsdp_dtensor_needs_megatron_fsdp(view, c):
    """The fsdp_dtensor checkpoint format needs Megatron FSDP (and not torch FSDP2) when the job saves or loads."""
    if view.get("checkpoint.ckpt_format") != "fsdp_dtensor" or not checkpoint_io(view):
        return
    if not megatron_fsdp(view) or view.get("dist.use_torch_fsdp2"):
        yield c.problem(view.parties("checkpoint.ckpt_format", "ddp.use_megatron_fsdp"), "checkpoint.ckpt_format",
                        "fsdp_dtensor", "fsdp_dtensor checkpoint format only supports Megatron FSDP (this config "
                        + ("also sets dist.use_torch_fsdp2" if megatron_fsdp(view) else "does not use Megatron FSDP")
                        + ")", "add +mem=megatron_fsdp (without dist.use_torch_fsdp2), or set "
                               "checkpoint.ckpt_format=torch_dist")


@check(enforced_by="bridge",
       oracle="check_weight_hash_across_dp_replicas_interval is not supported with the Megatron-FSDP optim_grads_params",
       source=f"{SURFACE} §1.8 (Bridge config.py _validate_and_apply_megatron_fsdp_configs: sharded weights have no "
              "replicas to compare)",
       reads=(*FSDP_READS, "ddp.data_parallel_sharding_strategy", "train.check_weight_hash_across_dp_replicas_interval"))
def megatron_fsdp_weight_hash_check(view, c):
    """Megatron FSDP's optim_grads_params strategy cannot check weight hashes across DP replicas."""
    interval = view.get("train.check_weight_hash_across_dp_replicas_interval")
    if megatron_fsdp(view) and view.get("ddp.data_parallel_sharding_strategy") == "optim_grads_params" \
            and interval is not None:
        yield c.problem(view.parties("ddp.data_parallel_sharding_strategy",
                                     "train.check_weight_hash_across_dp_replicas_interval"),
                        "train.check_weight_hash_across_dp_replicas_interval", interval,
                        "TrainingConfig.check_weight_hash_across_dp_replicas_interval is not supported with the "
                        "Megatron-FSDP optim_grads_params sharding strategy (each rank holds a different weight shard)",
                        "set train.check_weight_hash_across_dp_replicas_interval=null, or mem.megatron_fsdp.strategy="
                        "optim_grads")


@check(enforced_by="silent",
       source=f"{SURFACE} §1.8 (Bridge config.py _validate_and_apply_megatron_fsdp_configs: average_in_collective is "
              "turned off unless ddp.disable_symmetric_registration, fsdp_manual_registration turned on with "
              "ddp.nccl_ub, reuse_grad_buf_for_mxfp8_param_ag turned off; nothing raises)",
       reads=(*FSDP_READS, "ddp.average_in_collective", "ddp.disable_symmetric_registration", "ddp.nccl_ub",
              "ddp.fsdp_manual_registration", "ddp.reuse_grad_buf_for_mxfp8_param_ag",
              "optimizer.reuse_grad_buf_for_mxfp8_param_ag"))
def megatron_fsdp_silent_changes(view, c):
    """What Bridge silently changes under Megatron FSDP: average_in_collective, manual NCCL registration, mxfp8 reuse (note)."""
    if not megatron_fsdp(view):
        return
    if view.get("ddp.average_in_collective") and not view.get("ddp.disable_symmetric_registration"):
        yield ("note: Megatron FSDP: Bridge turns ddp.average_in_collective off (not supported with NCCL symmetric "
               "registration); set ddp.average_in_collective=false (as +mem=megatron_fsdp does) or "
               "ddp.disable_symmetric_registration=true")
    if view.get("ddp.nccl_ub") and not view.get("ddp.fsdp_manual_registration"):
        yield ("note: Megatron FSDP with ddp.nccl_ub: Bridge turns ddp.fsdp_manual_registration on (NCCL user buffers "
               "are slow without it)")
    if view.get("ddp.reuse_grad_buf_for_mxfp8_param_ag") or view.get("optimizer.reuse_grad_buf_for_mxfp8_param_ag"):
        yield ("note: Megatron FSDP: Bridge turns reuse_grad_buf_for_mxfp8_param_ag off (not implemented for Megatron "
               "FSDP), so MXFP8 parameter all-gathers get their own buffer")


@check(enforced_by="silent",
       source="megatron-core optimizer/__init__.py (no_shard under Megatron FSDP replicates every state); "
              "nvidia-skills/nemo-mbridge-perf-megatron-fsdp.SKILL.md, Enablement (optim_grads_params)",
       reads=(*FSDP_READS, "ddp.data_parallel_sharding_strategy", "model.tensor_model_parallel_size",
              "model.pipeline_model_parallel_size", "model.context_parallel_size"))
def megatron_fsdp_sharding_strategy(view, c):
    """Megatron FSDP that shards nothing: strategy no_shard, or one data-parallel rank (warned)."""
    if not megatron_fsdp(view):
        return
    strategy = view.get("ddp.data_parallel_sharding_strategy")
    if strategy in (None, "no_shard"):
        yield (f"Megatron FSDP with ddp.data_parallel_sharding_strategy={strategy} shards nothing (every rank keeps "
               "full weights, gradients and optimizer state); use +mem=megatron_fsdp (strategy optim_grads_params) "
               "or mem.megatron_fsdp.strategy=optim_grads")
    dp, cp = data_parallel_size(view), view.get("model.context_parallel_size") or 1
    if dp is not None and dp * cp <= 1 and "megatron_fsdp" in view.selected:
        yield (f"megatron_fsdp: the data-parallel size is {dp} (CP {cp}), so there is nothing to shard across; it "
               "saves no memory at this layout")


@check(enforced_by="runtime",
       source="megatron-core distributed/fsdp/mcore_fsdp_adapter.py FullyShardedDataParallel.__init__ (asserted when "
              "the model is wrapped, after launch)",
       reads=(*FSDP_READS, *EP_OVERLAP_READS, "ddp.fsdp_double_buffer", "model.cuda_graph_impl"))
def megatron_fsdp_ep_overlap(view, c):
    """Megatron FSDP with MoE EP comm overlap: no FSDP double buffer, no per-layer CUDA graphs (model wrap)."""
    if not (megatron_fsdp(view) and effective_ep_overlap(view)):
        return
    who = view.parties("ddp.use_megatron_fsdp", "comm_overlap.overlap_moe_expert_parallel_comm")
    if view.get("ddp.fsdp_double_buffer"):
        yield c.problem(who, "ddp.fsdp_double_buffer", True,
                        "1F1B overlap with FSDP does not support double buffer (megatron-core asserts it when it wraps "
                        "the model on the GPUs)", "set ddp.fsdp_double_buffer=false")
    impl = view.get("model.cuda_graph_impl")
    if impl not in (None, "none", "full_iteration"):
        yield c.problem(who, "model.cuda_graph_impl", impl,
                        f"1F1B overlap with FSDP does not support per-layer CUDA graphs (cuda_graph_impl={impl!r}; "
                        "megatron-core asserts it when it wraps the model on the GPUs)",
                        "set model.cuda_graph_impl=full_iteration or none")
