"""The distributed and precision-aware optimizers."""

from __future__ import annotations

from .facts import SURFACE
from .registry import check


@check(enforced_by="megatron-core", oracle="only supported with distributed optimizer",
       source=f"{SURFACE} §1.7 (C optimizer_config.py:434-436)",
       reads=("optimizer.use_precision_aware_optimizer", "optimizer.use_distributed_optimizer"))
def precision_aware_optimizer_needs_dist_opt(view, c):
    if view.get("optimizer.use_precision_aware_optimizer") and not view.get("optimizer.use_distributed_optimizer"):
        yield c.problem(view.parties("optimizer.use_distributed_optimizer", "optimizer.use_precision_aware_optimizer"),
                        "optimizer.use_distributed_optimizer", False,
                        "--use-precision-aware-optimizer only supported with distributed optimizer "
                        "(Bridge syncs ddp/optimizer flags only after this check)",
                        "add +mem=dist_optimizer (sets optimizer.use_distributed_optimizer=true and the ddp flag)")


@check(enforced_by="bridge", oracle="Distributed optimizer settings were not in sync",
       source=f"{SURFACE} §1.7 (config.py:1945-1981)",
       reads=("optimizer.use_distributed_optimizer", "ddp.use_distributed_optimizer"))
def dist_optimizer_flags_in_sync(view, c):
    a, b = view.get("optimizer.use_distributed_optimizer"), view.get("ddp.use_distributed_optimizer")
    if bool(a) != bool(b):
        yield (f"optimizer.use_distributed_optimizer={a} but ddp.use_distributed_optimizer={b}: Bridge will enable "
               "both after finalize; use +mem=dist_optimizer to make it explicit")


@check(enforced_by="docs", source=f"{SURFACE} §5 (estimator: 6 + 12/(DP*CP) bytes per parameter)",
       reads=("optimizer.use_distributed_optimizer", "model.tensor_model_parallel_size",
              "model.pipeline_model_parallel_size", "model.context_parallel_size"))
def dist_optimizer_needs_dp(view, c):
    if not view.get("optimizer.use_distributed_optimizer") or view.world_size is None:
        return
    tp, pp = view.get("model.tensor_model_parallel_size") or 1, view.get("model.pipeline_model_parallel_size") or 1
    cp = view.get("model.context_parallel_size") or 1
    dp = view.world_size // max(1, tp * pp * cp)
    if dp * cp <= 1 and "dist_optimizer" in view.selected:
        yield (f"dist_optimizer: data-parallel size is {dp} (world {view.world_size} / TP{tp}*PP{pp}*CP{cp}), so there is "
               "nothing to shard across; it saves no memory at this layout")
