"""The parallel layout: world size, pipeline split, sequence parallel."""

from __future__ import annotations

from .facts import MEM_SKILL, SURFACE
from .registry import check

LAYOUT = ("model.tensor_model_parallel_size", "model.pipeline_model_parallel_size", "model.context_parallel_size")


@check(enforced_by="docs",
       source=f"{MEM_SKILL}, Code Anchors: VPP config and layer divisibility (megatron-core 0.19.2 runs this check "
              "only for uneven pipeline splits; for even PP it is the skill's rule, enforced by us)",
       reads=("model.pipeline_model_parallel_size", "model.virtual_pipeline_model_parallel_size", "model.num_layers",
              "model.num_layers_in_first_pipeline_stage", "model.num_layers_in_last_pipeline_stage"))
def vpp_layer_divisibility(view, c):
    pp, vpp = view.get("model.pipeline_model_parallel_size") or 1, view.get("model.virtual_pipeline_model_parallel_size")
    if pp > 1 and vpp and view.get("model.num_layers_in_first_pipeline_stage") is None \
            and view.get("model.num_layers_in_last_pipeline_stage") is None:
        per_rank = (view.get("model.num_layers") or 0) // pp
        if per_rank % vpp:
            yield c.problem(view.parties("model.virtual_pipeline_model_parallel_size", "model.pipeline_model_parallel_size"),
                            "model.virtual_pipeline_model_parallel_size", vpp,
                            f"number of layers on each middle pipeline rank:{per_rank} must be divisible by virtual "
                            f"pipeline parallel degree {vpp}",
                            f"choose a VPP that divides {per_rank}")


@check(enforced_by="bridge", oracle="is not divisible by total_model_size",
       source=f"{SURFACE} §4 (set_data_parallel_size in runtime_config_update)", reads=LAYOUT)
def world_size_divisible(view, c):
    if view.world_size is None:
        return
    tp, pp, cp = (view.get(k) or 1 for k in LAYOUT)
    if view.world_size % (tp * pp * cp):
        yield c.problem(("config",), "world_size", view.world_size,
                        f"world size {view.world_size} is not divisible by TP*PP*CP = {tp}*{pp}*{cp} = {tp * pp * cp}",
                        f"use a world size that is a multiple of {tp * pp * cp}, or change the parallel sizes")


@check(enforced_by="bridge", oracle="Cannot use sequence parallelism without tensor parallelism",
       source=f"{SURFACE} §4 (Bridge finalize silently sets sequence_parallel=False when TP<=1)",
       reads=("model.sequence_parallel", "model.tensor_model_parallel_size"))
def sequence_parallel_needs_tp(view, c):
    if view.get("model.sequence_parallel") and (view.get("model.tensor_model_parallel_size") or 1) <= 1:
        yield (f"sequence_parallel=True with TP=1 is silently turned off by Bridge (set by {view.setter('model.sequence_parallel')}); "
               "set model.tensor_model_parallel_size>=2 for it to take effect")
