"""The distributed and precision-aware optimizers."""

from __future__ import annotations

import sys

from .facts import SURFACE, data_parallel_size, mixed_precision_config
from .registry import check, resolver

OPTIMIZER_CONFIG = "megatron-core optimizer/optimizer_config.py OptimizerConfig.__post_init__"
# megatron/training/arguments.py: the dtype words of --exp-avg-dtype and friends and the torch dtypes they mean
# (validate_args' dtype_map; fp8 moments are stored as uint8 by TE's FusedAdam).
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "uint8"}
PRECISION_AWARE_DTYPES = ("exp_avg_dtype", "exp_avg_sq_dtype", "main_grads_dtype", "main_params_dtype")


@check(enforced_by="megatron-core", oracle="only supported with distributed optimizer",
       source=f"{SURFACE} §1.7 (C optimizer_config.py:434-436)",
       reads=("optimizer.use_precision_aware_optimizer", "optimizer.use_distributed_optimizer"))
def precision_aware_optimizer_needs_dist_opt(view, c):
    """The precision-aware optimizer needs the distributed optimizer."""
    if view.get("optimizer.use_precision_aware_optimizer") and not view.get("optimizer.use_distributed_optimizer"):
        yield c.problem(view.parties("optimizer.use_distributed_optimizer", "optimizer.use_precision_aware_optimizer"),
                        "optimizer.use_distributed_optimizer", False,
                        "--use-precision-aware-optimizer only supported with distributed optimizer "
                        "(Bridge syncs ddp/optimizer flags only after this check)",
                        "add +mem=dist_optimizer (sets optimizer.use_distributed_optimizer=true and the ddp flag)")


@check(enforced_by="silent",
       source=f"{SURFACE} §1.7 (Bridge config.py _validate_and_sync_distributed_optimizer_settings warns "
              "'Distributed optimizer settings were not in sync' and turns both on; nothing raises)",
       reads=("optimizer.use_distributed_optimizer", "ddp.use_distributed_optimizer"))
def dist_optimizer_flags_in_sync(view, c):
    """optimizer/ddp distributed-optimizer flags that differ are both turned on by Bridge (warned)."""
    a, b = view.get("optimizer.use_distributed_optimizer"), view.get("ddp.use_distributed_optimizer")
    if bool(a) != bool(b):
        yield (f"optimizer.use_distributed_optimizer={a} but ddp.use_distributed_optimizer={b}: Bridge will enable "
               "both after finalize; use +mem=dist_optimizer to make it explicit")


@check(enforced_by="docs", source=f"{SURFACE} §5 (estimator: 6 + 12/(DP*CP) bytes per parameter)",
       reads=("optimizer.use_distributed_optimizer", "model.tensor_model_parallel_size",
              "model.pipeline_model_parallel_size", "model.context_parallel_size"))
def dist_optimizer_needs_dp(view, c):
    """The distributed optimizer saves nothing at DP*CP=1 (warned)."""
    if not view.get("optimizer.use_distributed_optimizer") or view.world_size is None:
        return
    tp, pp = view.get("model.tensor_model_parallel_size") or 1, view.get("model.pipeline_model_parallel_size") or 1
    cp = view.get("model.context_parallel_size") or 1
    dp = view.world_size // max(1, tp * pp * cp)
    if dp * cp <= 1 and "dist_optimizer" in view.selected:
        why = (f"dist_optimizer: data-parallel size is {dp} (world {view.world_size} / TP{tp}*PP{pp}*CP{cp}), so there is "
               "nothing to shard across; it saves no memory at this layout")
        # optimizer_offload needs the distributed optimizer (offload.py optimizer_offload_dist_opt), so there it is a prerequisite, not a waste.
        yield (f"note: {why}, but optimizer_offload needs it" if "optimizer_offload" in view.selected else why)


@check(enforced_by="runtime",
       source=f"{SURFACE} §1.7; C parallel_state.py:922-926 and 1447-1449 (initialize_model_parallel asserts it when the "
              "job starts): the distributed optimizer's shards are split into num_distributed_optimizer_instances "
              "groups of the (expert) data-parallel ranks",
       reads=("ddp.num_distributed_optimizer_instances", "model.tensor_model_parallel_size",
              "model.pipeline_model_parallel_size", "model.context_parallel_size", "model.expert_model_parallel_size",
              "model.expert_tensor_parallel_size", "model.num_moe_experts"))
def dist_optimizer_instances_divide_dp(view, c):
    """Distributed-optimizer instances divide DP*CP and the expert DP."""
    instances = view.get("ddp.num_distributed_optimizer_instances") or 1
    dp = data_parallel_size(view)
    if instances <= 1 or dp is None:
        return
    cp = view.get("model.context_parallel_size") or 1
    who = view.parties("ddp.num_distributed_optimizer_instances")
    if (dp * cp) % instances:
        yield c.problem(who, "ddp.num_distributed_optimizer_instances", instances,
                        f"Data parallel size should be divisible by partial DistOpt shard factor: DP*CP = {dp}*{cp} "
                        f"is not divisible by {instances} (megatron-core asserts this when the job starts)",
                        f"use mem.dist_optimizer.instances dividing {dp * cp}")
    if view.get("model.num_moe_experts"):
        tp, pp = view.get("model.tensor_model_parallel_size") or 1, view.get("model.pipeline_model_parallel_size") or 1
        etp = view.get("model.expert_tensor_parallel_size") or tp
        ep = view.get("model.expert_model_parallel_size") or 1
        expert_dp = view.world_size // (etp * ep * pp) if view.world_size % (etp * ep * pp) == 0 else None
        if expert_dp is not None and expert_dp % instances:
            yield c.problem(who, "ddp.num_distributed_optimizer_instances", instances,
                            f"Expert data parallel size should be divisible by partial DistOpt shard factor: expert DP = "
                            f"world {view.world_size} / (ETP{etp}*EP{ep}*PP{pp}) = {expert_dp} is not divisible by "
                            f"{instances}", f"use mem.dist_optimizer.instances dividing {expert_dp}")


def dtype_name(value) -> str | None:
    """A dtype as its torch name ('bfloat16'): a torch.dtype, its text ('torch.bfloat16', 'bfloat16') or a word
    of megatron-core's arguments ('bf16'); None when unset."""
    if value is None:
        return None
    text = str(value).removeprefix("torch.")
    return DTYPE_NAMES.get(text, text)


def as_config_dtype(word: str, current):
    """The dtype ``word`` (bf16, ...) the way the config holds dtypes: a torch.dtype when the field holds one (torch is
    then already loaded, by Bridge), else its torch name, which Bridge's override machinery turns into one."""
    name = DTYPE_NAMES[word]
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(current, getattr(torch, "dtype", ())):
        return getattr(torch, name)
    return name


@resolver("precision_aware_optimizer", writes=tuple(f"optimizer.{f}" for f in PRECISION_AWARE_DTYPES))
def resolve_precision_aware_optimizer(view, params):
    """Writes optimizer.exp_avg_dtype, exp_avg_sq_dtype, main_grads_dtype and main_params_dtype from the parameters
    (bf16 -> torch.bfloat16, fp8 -> torch.uint8 as megatron-core's arguments.py maps them), as torch dtypes like the
    fields Bridge's OptimizerConfig holds."""
    fields = {}
    for name in PRECISION_AWARE_DTYPES:
        path = f"optimizer.{name}"
        value = as_config_dtype(params[name], view.get(path))
        if dtype_name(view.get(path)) != dtype_name(value):
            fields[path] = value
    return fields, {}


@check(enforced_by="megatron-core", oracle="--use-precision-aware-optimizer only supported with adam",
       source=f"{SURFACE} §1.7; {OPTIMIZER_CONFIG} (optimizer_config.py:430-433)",
       reads=("optimizer.use_precision_aware_optimizer", "optimizer.optimizer"))
def precision_aware_optimizer_needs_adam(view, c):
    """The precision-aware optimizer needs Adam."""
    name = view.get("optimizer.optimizer")
    if view.get("optimizer.use_precision_aware_optimizer") and name not in (None, "adam"):
        yield c.problem(view.parties("optimizer.use_precision_aware_optimizer", "optimizer.optimizer"),
                        "optimizer.optimizer", name,
                        f"--use-precision-aware-optimizer only supported with adam (optimizer.optimizer={name!r}; "
                        "only Transformer Engine's FusedAdam keeps low-precision state)",
                        "set optimizer.optimizer=adam, or drop +mem=precision_aware_optimizer")


@check(enforced_by="megatron-core", oracle="can only be fp32 when not using precision-aware optimizer",
       source=f"{SURFACE} §1.7; {OPTIMIZER_CONFIG} (optimizer_config.py:469-481)",
       reads=("optimizer.use_precision_aware_optimizer",
              *(f"optimizer.{f}" for f in PRECISION_AWARE_DTYPES)))
def optimizer_dtypes_need_precision_aware(view, c):
    """Low-precision optimizer dtypes (moments, master weights, main gradients) need the precision-aware optimizer."""
    if view.get("optimizer.use_precision_aware_optimizer"):
        return
    for name in PRECISION_AWARE_DTYPES:
        path = f"optimizer.{name}"
        if dtype_name(view.get(path)) not in (None, "float32"):
            yield c.problem(view.parties(path, "optimizer.use_precision_aware_optimizer"), path, view.get(path),
                            f"{name} can only be fp32 when not using precision-aware optimizer",
                            "add +mem=precision_aware_optimizer (it sets optimizer.use_precision_aware_optimizer=true), "
                            f"or set {path} back to float32")
            return  # megatron-core stops at the first one


@check(enforced_by="bridge",
       oracle=("must be set when model.bf16=True and use_precision_aware_optimizer=True",
               "must be set when model.fp16=True and use_precision_aware_optimizer=True",
               "must both be False when model is using fp32 precision"),
       source=f"{SURFACE} §1.7; Bridge config.py _validate_mixed_precision_consistency (after mixed_precision.setup(), "
              "which copies one precision onto the model and the optimizer)",
       reads=("optimizer.use_precision_aware_optimizer", "mixed_precision", "model.bf16", "model.fp16",
              "optimizer.bf16", "optimizer.fp16"))
def precision_aware_optimizer_precision_match(view, c):
    """With the precision-aware optimizer, optimizer.bf16/fp16 match the model's precision."""
    if not view.get("optimizer.use_precision_aware_optimizer"):
        return
    mp = view.get("mixed_precision")
    if mp is not None:
        mp = mixed_precision_config(mp)
        if mp is None or hasattr(mp, "bf16"):
            return  # setup() writes the same bf16/fp16 onto both (an unknown preset name: Bridge refuses it elsewhere)
    mb, mf, ob, of = (bool(view.get(p)) for p in ("model.bf16", "model.fp16", "optimizer.bf16", "optimizer.fp16"))
    bad = ("optimizer.bf16", "optimizer.bf16=True must be set when model.bf16=True") if mb and not ob else \
        ("optimizer.fp16", "optimizer.fp16=True must be set when model.fp16=True") if mf and not of else \
        ("optimizer.bf16" if ob else "optimizer.fp16", "optimizer.bf16 and optimizer.fp16 must both be False when "
         "model is using fp32 precision") if not mb and not mf and (ob or of) else None
    if bad:
        path, message = bad
        yield c.problem(view.parties(path, "optimizer.use_precision_aware_optimizer"), path, view.get(path),
                        f"{message} and use_precision_aware_optimizer=True (no mixed_precision config aligns them)",
                        "set mixed_precision=bf16_mixed, or make optimizer.bf16/fp16 equal model.bf16/fp16")


@check(enforced_by="silent",
       source=f"{SURFACE} §1.8 (Bridge config.py _validate_and_apply_megatron_fsdp_configs sets "
              "ddp.megatron_fsdp_use_decoupled_grad under Megatron FSDP with the precision-aware optimizer)",
       reads=("optimizer.use_precision_aware_optimizer", "ddp.use_megatron_fsdp", "dist.use_megatron_fsdp"))
def precision_aware_optimizer_under_fsdp(view, c):
    """Precision-aware optimizer under Megatron FSDP: Bridge switches FSDP to decoupled gradients (note)."""
    if view.get("optimizer.use_precision_aware_optimizer") and (view.get("ddp.use_megatron_fsdp")
                                                                or view.get("dist.use_megatron_fsdp")):
        yield ("note: precision-aware optimizer with Megatron FSDP: Bridge sets ddp.megatron_fsdp_use_decoupled_grad "
               "(gradients go to param.decoupled_grad for TE's FusedAdam)")


@check(enforced_by="runtime",
       source=f"{SURFACE} §1.7; {OPTIMIZER_CONFIG} (optimizer_config.py:438-467: Transformer Engine's FusedAdam with "
              "master_weight_dtype/exp_avg_dtype/use_decoupled_grad; not checkable on a host without TE)",
       reads=("optimizer.use_precision_aware_optimizer", "optimizer.optimizer_cpu_offload"))
def precision_aware_optimizer_needs_te(view, c):
    """The precision-aware optimizer needs Transformer Engine's FusedAdam on the GPU nodes (note)."""
    if view.get("optimizer.use_precision_aware_optimizer") and not view.get("optimizer.optimizer_cpu_offload"):
        yield ("note: precision-aware optimizer: megatron-core needs Transformer Engine's FusedAdam with "
               "exp_avg_dtype/master_weight_dtype (TE >= 2.1) on the GPU nodes; a host without TE cannot check it")
