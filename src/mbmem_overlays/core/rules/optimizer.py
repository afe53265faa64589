"""The distributed and precision-aware optimizers."""

from __future__ import annotations

from .facts import SURFACE, data_parallel_size
from .registry import check


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
