"""Activation and optimizer-state CPU offloading."""

from __future__ import annotations

from .facts import MEM_SKILL, NO_GRAPHS, OFFLOAD_SKILL, SURFACE
from .registry import both_on, check


@check(enforced_by="megatron-core", oracle="no support for Pipeline parallelism with CPU offloading",
       source=f"{MEM_SKILL}, Compatibility and Constraints; {SURFACE} §1.5 (C:1714-1717)",
       reads=("model.cpu_offloading", "model.pipeline_model_parallel_size"))
def cpu_offload_pipeline(view, c):
    pp = view.get("model.pipeline_model_parallel_size") or 1
    if view.get("model.cpu_offloading") and pp > 1:
        yield c.problem(view.parties("model.cpu_offloading", "model.pipeline_model_parallel_size"),
                        "model.pipeline_model_parallel_size", pp,
                        "Currently there is no support for Pipeline parallelism with CPU offloading "
                        f"(activation offload needs PP=1, this config has PP={pp})",
                        "set model.pipeline_model_parallel_size=1, or use +mem=optimizer_offload "
                        "(optimizer-state offload works with any PP)")


@check(enforced_by="megatron-core", oracle="CPU offloading does not work when activation recomputation is enabled",
       source=f"{OFFLOAD_SKILL}, Compatibility; {SURFACE} §1.5 (C:1719-1722)",
       reads=("model.cpu_offloading", "model.recompute_granularity"))
def cpu_offload_recompute(view, c):
    g = view.get("model.recompute_granularity")
    if view.get("model.cpu_offloading") and g is not None:
        yield c.problem(view.parties("model.cpu_offloading", "model.recompute_granularity"),
                        "model.recompute_granularity", g,
                        "CPU offloading does not work when activation recomputation is enabled",
                        "use either activation offload or recompute: drop one of the two overlays, "
                        "or set model.recompute_granularity=null")


@check(enforced_by="megatron-core", oracle="CUDA graphs not supported with CPU offloading",
       source=f"{OFFLOAD_SKILL}, Compatibility; {SURFACE} §1.5 (C:2467-2468)",
       reads=("model.cpu_offloading", "model.cuda_graph_impl"))
def cpu_offload_cuda_graphs(view, c):
    impl = view.get("model.cuda_graph_impl")
    if view.get("model.cpu_offloading") and impl not in NO_GRAPHS and impl != "full_iteration":
        yield c.problem(view.parties("model.cpu_offloading", "model.cuda_graph_impl"), "model.cuda_graph_impl", impl,
                        "CUDA graphs not supported with CPU offloading (only full_iteration graphs are)",
                        "set model.cuda_graph_impl=none (or full_iteration), or use +mem=optimizer_offload")


@check(enforced_by="megatron-core", oracle="fine_grained_activation_offloading cannot be enabled with cpu_offloading",
       source=f"{OFFLOAD_SKILL}, Compatibility; {SURFACE} §1.5 (C:1849-1851)",
       reads=("model.cpu_offloading", "model.fine_grained_activation_offloading"))
def cpu_offload_fine_grained(view, c):
    yield from both_on(view, c, "model.cpu_offloading", "model.fine_grained_activation_offloading",
                       "fine_grained_activation_offloading cannot be enabled with cpu_offloading",
                       "use one of them: set model.fine_grained_activation_offloading=false or drop +mem=cpu_offload")


@check(enforced_by="megatron-core", oracle="CPU offloading can be done only for layers less than",
       source=f"{OFFLOAD_SKILL}, Config Parameter Reference; {SURFACE} §1.5 (C:1707-1712)",
       reads=("model.cpu_offloading", "model.cpu_offloading_num_layers", "model.num_layers",
              "model.cpu_offloading_weights"))
def cpu_offload_num_layers(view, c):
    if not view.get("model.cpu_offloading"):
        return
    n, total = view.get("model.cpu_offloading_num_layers") or 0, view.get("model.num_layers") or 0
    if n < 0 or n >= total:
        yield c.problem(view.parties("model.cpu_offloading_num_layers"), "model.cpu_offloading_num_layers", n,
                        f"CPU offloading can be done only for layers less than {total}",
                        f"use mem.cpu_offload.num_layers between 1 and {total - 1}")
    elif n == 0:
        yield "cpu_offload: model.cpu_offloading_num_layers=0 offloads nothing (a silent no-op in megatron-core); " \
              "set mem.cpu_offload.num_layers>=1"
    if view.get("model.cpu_offloading_weights"):
        yield "cpu_offload: cpu_offloading_weights=true also offloads weights (slower); the overlay keeps it false"


@check(enforced_by="docs", source=f"{OFFLOAD_SKILL}, Optimizer offloading constraints ({SURFACE} §1.6: not enforced in code)",
       reads=("optimizer.optimizer_cpu_offload", "optimizer.optimizer_offload_fraction"))
def optimizer_offload_fraction_range(view, c):
    if not view.get("optimizer.optimizer_cpu_offload"):
        return
    f = view.get("optimizer.optimizer_offload_fraction")
    if f is None or not 0.0 <= float(f) <= 1.0:
        yield c.problem(view.parties("optimizer.optimizer_offload_fraction"), "optimizer.optimizer_offload_fraction", f,
                        "optimizer_offload_fraction must be in [0.0, 1.0] (documented; megatron-core does not check it)",
                        "use mem.optimizer_offload.fraction between 0 and 1, e.g. 0.5")
    elif float(f) == 0.0:
        yield "optimizer_offload: optimizer_offload_fraction=0 keeps all optimizer state on the GPU (a no-op)"


@check(enforced_by="runtime", source=f"{SURFACE} §1.6 (C optimizer/__init__.py:508-510, at optimizer build)",
       reads=("optimizer.optimizer_cpu_offload", "optimizer.decoupled_weight_decay"))
def optimizer_offload_decoupled_weight_decay(view, c):
    if view.get("optimizer.optimizer_cpu_offload") and view.get("optimizer.decoupled_weight_decay") is False:
        yield c.problem(view.parties("optimizer.optimizer_cpu_offload", "optimizer.decoupled_weight_decay"),
                        "optimizer.decoupled_weight_decay", False,
                        "CPU offloading only supported with decoupled_weight_decay enabled (AdamW mode); megatron-core "
                        "asserts this when it builds the optimizer, after launch",
                        "set optimizer.decoupled_weight_decay=true")


@check(enforced_by="docs", source=f"{OFFLOAD_SKILL}, Optimizer offloading constraints ({SURFACE} §8: not enforced)",
       reads=("optimizer.optimizer_cpu_offload", "optimizer.use_distributed_optimizer"))
def optimizer_offload_dist_opt(view, c):
    if view.get("optimizer.optimizer_cpu_offload") and not view.get("optimizer.use_distributed_optimizer"):
        yield ("optimizer_offload: NVIDIA's cpu-offloading skill says it requires the distributed optimizer; Bridge and "
               "megatron-core do not enforce it. Add +mem=dist_optimizer to stay on the documented path")
