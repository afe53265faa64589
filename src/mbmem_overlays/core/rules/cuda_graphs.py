"""CUDA graphs with recompute and with expandable segments."""

from __future__ import annotations

from .facts import MEM_SKILL, NO_GRAPHS, RECOMPUTE_SKILL, SURFACE
from .registry import check, resolver


@resolver("expandable_segments", writes=("$NCCL_GRAPH_REGISTER",))
def expandable_segments(view, params):
    """With CUDA graphs on, expandable segments need NCCL_GRAPH_REGISTER=0
    (memory-tuning skill, Compatibility and Constraints; C transformer/cuda_graphs.py:2102)."""
    if view.get("model.cuda_graph_impl") not in NO_GRAPHS:
        return {}, {"NCCL_GRAPH_REGISTER": "0"}
    return {}, {}


@check(enforced_by="megatron-core", oracle="full recompute is only supported with full iteration CUDA graph",
       source=f"{RECOMPUTE_SKILL}, CUDA graphs; {SURFACE} §2 (C:2522-2525)",
       reads=("model.recompute_granularity", "model.cuda_graph_impl"))
def full_recompute_cuda_graphs(view, c):
    impl = view.get("model.cuda_graph_impl")
    if view.get("model.recompute_granularity") == "full" and impl not in NO_GRAPHS and impl != "full_iteration":
        yield c.problem(view.parties("model.recompute_granularity", "model.cuda_graph_impl"), "model.cuda_graph_impl", impl,
                        "full recompute is only supported with full iteration CUDA graph",
                        "set model.cuda_graph_impl=full_iteration or none, or use +mem=selective_recompute")


@check(enforced_by="runtime",
       source=f"{MEM_SKILL}, Compatibility and Constraints; {SURFACE} §1.1 (C transformer/cuda_graphs.py:2102-2108)",
       reads=("model.cuda_graph_impl", "$PYTORCH_CUDA_ALLOC_CONF", "$NCCL_GRAPH_REGISTER"))
def expandable_segments_cuda_graphs(view, c):
    impl = view.get("model.cuda_graph_impl")
    on = "expandable_segments:True" in view.env.get("PYTORCH_CUDA_ALLOC_CONF", "")  # MCore: substring test
    if impl not in NO_GRAPHS and on and view.env.get("NCCL_GRAPH_REGISTER", "") != "0":
        yield c.problem(view.parties("model.cuda_graph_impl"), "$NCCL_GRAPH_REGISTER", view.env.get("NCCL_GRAPH_REGISTER"),
                        "Setting NCCL_GRAPH_REGISTER=0 to avoid illegal memory access when using CUDA Graph with "
                        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                        "export NCCL_GRAPH_REGISTER=0 (+mem=expandable_segments sets it when CUDA graphs are on)")
