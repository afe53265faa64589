"""Activation and optimizer-state CPU offloading."""

from __future__ import annotations

from .facts import (EP_OVERLAP_READS, MEM_SKILL, NO_GRAPHS, OFFLOAD_SKILL, SELECTIVE_READS, SURFACE, effective_ep_overlap,
                    graph_modules, selective_modules)
from .registry import both_on, check


@check(enforced_by="megatron-core", oracle="no support for Pipeline parallelism with CPU offloading",
       source=f"{MEM_SKILL}, Compatibility and Constraints; {SURFACE} §1.5 (C:1714-1717)",
       reads=("model.cpu_offloading", "model.pipeline_model_parallel_size"))
def cpu_offload_pipeline(view, c):
    """Activation CPU offload needs PP=1."""
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
    """Activation CPU offload cannot be combined with activation recompute."""
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
    """Activation CPU offload works only without CUDA graphs or with full-iteration graphs."""
    impl = view.get("model.cuda_graph_impl")
    if view.get("model.cpu_offloading") and impl not in NO_GRAPHS and impl != "full_iteration":
        yield c.problem(view.parties("model.cpu_offloading", "model.cuda_graph_impl"), "model.cuda_graph_impl", impl,
                        "CUDA graphs not supported with CPU offloading (only full_iteration graphs are)",
                        "set model.cuda_graph_impl=none (or full_iteration), or use +mem=optimizer_offload")


@check(enforced_by="megatron-core", oracle="fine_grained_activation_offloading cannot be enabled with cpu_offloading",
       source=f"{OFFLOAD_SKILL}, Compatibility; {SURFACE} §1.5 (C:1849-1851)",
       reads=("model.cpu_offloading", "model.fine_grained_activation_offloading"))
def cpu_offload_fine_grained(view, c):
    """Activation CPU offload and fine-grained activation offloading exclude each other."""
    yield from both_on(view, c, "model.cpu_offloading", "model.fine_grained_activation_offloading",
                       "fine_grained_activation_offloading cannot be enabled with cpu_offloading",
                       "use one of them: set model.fine_grained_activation_offloading=false or drop +mem=cpu_offload")


@check(enforced_by="megatron-core", oracle="CPU offloading can be done only for layers less than",
       source=f"{OFFLOAD_SKILL}, Config Parameter Reference; {SURFACE} §1.5 (C:1707-1712)",
       reads=("model.cpu_offloading", "model.cpu_offloading_num_layers", "model.num_layers",
              "model.cpu_offloading_weights"))
def cpu_offload_num_layers(view, c):
    """The number of offloaded layers is in [0, num_layers); 0 offloads nothing (warned)."""
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
    """The optimizer offload fraction is in [0, 1]; 0 is a no-op (warned)."""
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
    """Optimizer CPU offload needs decoupled weight decay (AdamW)."""
    if view.get("optimizer.optimizer_cpu_offload") and view.get("optimizer.decoupled_weight_decay") is False:
        yield c.problem(view.parties("optimizer.optimizer_cpu_offload", "optimizer.decoupled_weight_decay"),
                        "optimizer.decoupled_weight_decay", False,
                        "CPU offloading only supported with decoupled_weight_decay enabled (AdamW mode); megatron-core "
                        "asserts this when it builds the optimizer, after launch",
                        "set optimizer.decoupled_weight_decay=true")


@check(enforced_by="docs", source=f"{OFFLOAD_SKILL}, Optimizer offloading constraints ({SURFACE} §8: not enforced)",
       reads=("optimizer.optimizer_cpu_offload", "optimizer.use_distributed_optimizer"))
def optimizer_offload_dist_opt(view, c):
    """Optimizer offload is documented with the distributed optimizer (warned)."""
    if view.get("optimizer.optimizer_cpu_offload") and not view.get("optimizer.use_distributed_optimizer"):
        yield ("optimizer_offload: NVIDIA's cpu-offloading skill says it requires the distributed optimizer; Bridge and "
               "megatron-core do not enforce it. Add +mem=dist_optimizer to stay on the documented path")


FINE_GRAINED_MODULES = frozenset({"core_attn", "attn_proj", "expert_fc1", "fused_group_mlp", "moe_act", "attn_norm",
                                  "mlp_norm", "qkv_linear"})  # C transformer_config.py:1853-1862
INSIDE_MOE = {"moe_act", "expert_fc1", "fused_group_mlp"}


def offload_modules(view) -> list[str]:
    """model.offload_modules as a list of labels (a lone text counts as one label, as Hydra's ``a`` for ``[a]``)."""
    mods = view.get("model.offload_modules") or []
    return [mods] if isinstance(mods, str) else [str(m) for m in mods]


@check(enforced_by="megatron-core",
       oracle=("Invalid choices for offload_modules", "attn_proj cannot be set to offload_modules alone",
               "while recomputing the entire MoE layer", "activation_offload_fraction must be in range",
               "fused_group_mlp requires use_transformer_engine_op_fuser",
               "fused_group_mlp offloads the whole fused grouped MLP"),
       source=f"{OFFLOAD_SKILL}, Fine-grained activation offloading; C transformer_config.py:1848-1902",
       reads=("model.fine_grained_activation_offloading", "model.offload_modules", *SELECTIVE_READS,
              "model.activation_offload_fraction",
              "model.use_transformer_engine_op_fuser"))
def fine_grained_offload_modules(view, c):
    """Fine-grained offload: valid, non-empty offload_modules and their pairings."""
    if not view.get("model.fine_grained_activation_offloading"):
        return
    mods = offload_modules(view)
    who = view.parties("model.fine_grained_activation_offloading", "model.offload_modules")
    if not mods:
        yield c.problem(who, "model.offload_modules", mods,
                        "fine_grained_activation_offloading needs a non-empty offload_modules (megatron-core asserts it)",
                        f"set model.offload_modules to some of {sorted(FINE_GRAINED_MODULES)}, e.g. [core_attn]")
    bad = sorted(set(mods) - FINE_GRAINED_MODULES)
    if bad:
        yield c.problem(who, "model.offload_modules", mods,
                        f"Invalid choices for offload_modules: {bad}. Allowed modules are: {sorted(FINE_GRAINED_MODULES)}",
                        "use labels from that list")
    if "attn_proj" in mods and "core_attn" not in mods:
        yield c.problem(who, "model.offload_modules", mods,
                        "attn_proj cannot be set to offload_modules alone without core_attn (its input is core_attn's "
                        "output, which core_attn's backward needs)", "add core_attn to model.offload_modules (e.g. mem.fine_grained_offload.modules=[core_attn,attn_proj])")
    recompute_moe = "moe" in selective_modules(view)  # moe_layer_recompute adds it first (C:1835-1846)
    if recompute_moe and INSIDE_MOE & set(mods):
        yield c.problem(view.parties("model.offload_modules", "model.recompute_modules"), "model.offload_modules", mods,
                        f"Cannot offload {sorted(INSIDE_MOE & set(mods))} while recomputing the entire MoE layer",
                        "remove 'moe' from model.recompute_modules or those labels from model.offload_modules")
    fraction = view.get("model.activation_offload_fraction")
    if fraction is not None and not 0 <= fraction <= 1:
        yield c.problem(view.parties("model.activation_offload_fraction"), "model.activation_offload_fraction",
                        fraction, "activation_offload_fraction must be in range [0, 1]",
                        "set model.activation_offload_fraction between 0 and 1")
    if "fused_group_mlp" in mods:
        if not view.get("model.use_transformer_engine_op_fuser"):
            yield c.problem(who, "model.use_transformer_engine_op_fuser", view.get("model.use_transformer_engine_op_fuser"),
                            "fused_group_mlp requires use_transformer_engine_op_fuser",
                            "set model.use_transformer_engine_op_fuser=true or drop fused_group_mlp")
        if {"expert_fc1", "moe_act"} & set(mods):
            yield c.problem(who, "model.offload_modules", mods,
                            "fused_group_mlp offloads the whole fused grouped MLP and cannot be combined with "
                            "expert_fc1 or moe_act", "keep fused_group_mlp alone, or drop it")


@check(enforced_by="megatron-core",
       oracle=("fine-grained activation offloading with cuda_graph_impl='local'",
               "fine-grained activation offloading is only supported with transformer_engine CUDA graph",
               "Token-drop MoE is temporarily not supported with activation offloading",
               "cuda_graph_warmup_steps must be greater than 0 when enabling fine-grained",
               "fine_grained_offloading_max_inflight_offloads must be a non-negative integer"),
       source=f"{OFFLOAD_SKILL}, Fine-grained activation offloading; C transformer_config.py:2596-2642",
       reads=("model.fine_grained_activation_offloading", "model.offload_modules", "model.cuda_graph_impl",
              "model.cuda_graph_modules", "model.cuda_graph_scope", "model.cuda_graph_warmup_steps",
              "model.fine_grained_offloading_max_inflight_offloads"))
def fine_grained_offload_cuda_graphs(view, c):
    """Fine-grained offload with CUDA graphs: implementation, scopes, warm-up, in-flight limit."""
    impl = view.get("model.cuda_graph_impl")
    if not view.get("model.fine_grained_activation_offloading") or impl in NO_GRAPHS:
        return
    who = view.parties("model.fine_grained_activation_offloading", "model.cuda_graph_impl")
    mods, scopes = set(offload_modules(view)), graph_modules(view)
    if impl == "local":  # C transformer_config.py:2598-2609, asserted before the general condition below
        if mods - INSIDE_MOE:
            yield c.problem(view.parties("model.offload_modules", "model.cuda_graph_impl"), "model.offload_modules",
                            sorted(mods), "fine-grained activation offloading with cuda_graph_impl='local' only supports "
                            f"offload_modules 'expert_fc1', 'moe_act', and 'fused_group_mlp' (not {sorted(mods - INSIDE_MOE)})",
                            "set model.cuda_graph_impl=transformer_engine, or offload only MoE sub-modules")
            return
        if not scopes:
            yield c.problem(who, "model.cuda_graph_modules", scopes,
                            "fine-grained activation offloading with cuda_graph_impl='local' is not supported with "
                            "whole-layer CUDA graph capture", "set model.cuda_graph_modules (e.g. [attn,moe_router]) or "
                                                              "model.cuda_graph_impl=transformer_engine")
            return
    partial_moe = impl == "local" and bool(mods) and mods <= INSIDE_MOE and "moe" not in scopes and bool(scopes)
    if impl not in ("transformer_engine", "full_iteration") and not partial_moe:
        yield c.problem(who, "model.cuda_graph_impl", impl,
                        "fine-grained activation offloading is only supported with transformer_engine CUDA graph "
                        "implementation (or local graphs of MoE sub-modules offloading only expert_fc1/moe_act)",
                        "set model.cuda_graph_impl=transformer_engine (or none)")
    if "moe" in scopes:
        yield c.problem(who, "model.cuda_graph_modules", scopes,
                        "Token-drop MoE is temporarily not supported with activation offloading (moe graph scope)",
                        "drop moe from model.cuda_graph_modules")
    if (view.get("model.cuda_graph_warmup_steps") or 0) <= 0:
        yield c.problem(who, "model.cuda_graph_warmup_steps", view.get("model.cuda_graph_warmup_steps"),
                        "cuda_graph_warmup_steps must be greater than 0 when enabling fine-grained activation offloading",
                        "set model.cuda_graph_warmup_steps=3")
    inflight = view.get("model.fine_grained_offloading_max_inflight_offloads")
    if impl == "full_iteration" and (inflight is None or inflight < 0):
        yield c.problem(who, "model.fine_grained_offloading_max_inflight_offloads", inflight,
                        "fine_grained_offloading_max_inflight_offloads must be a non-negative integer when using "
                        "fine-grained activation offloading with full-iteration CUDA graphs",
                        "set model.fine_grained_offloading_max_inflight_offloads (e.g. 2)")


@check(enforced_by="bridge", oracle="Fine-grained activation offloading is only supported with transformer_engine",
       source=f"{OFFLOAD_SKILL}, Fine-grained activation offloading; Bridge config.py "
              "_validate_fine_grained_activation_offloading",
       reads=("model.fine_grained_activation_offloading", "model.transformer_impl"))
def fine_grained_offload_needs_te(view, c):
    """Fine-grained offload needs the transformer_engine implementation."""
    impl = view.get("model.transformer_impl")
    if view.get("model.fine_grained_activation_offloading") and impl != "transformer_engine":
        yield c.problem(view.parties("model.fine_grained_activation_offloading", "model.transformer_impl"),
                        "model.transformer_impl", impl,
                        "Fine-grained activation offloading is only supported with transformer_engine implementation",
                        "set model.transformer_impl=transformer_engine, or use +mem=cpu_offload")


@check(enforced_by="runtime",
       source=f"{OFFLOAD_SKILL}, Fine-grained activation offloading; Bridge config.py "
              "_validate_fine_grained_activation_offloading (raised only where Transformer Engine >= 2.10 is installed, "
              "i.e. on the GPU nodes, not on this host)",
       reads=("model.fine_grained_activation_offloading", "$NVTE_CPU_OFFLOAD_V1"))
def fine_grained_offload_te_env(view, c):
    """Fine-grained offload needs NVTE_CPU_OFFLOAD_V1=1 with TE >= 2.10."""
    if view.get("model.fine_grained_activation_offloading") and view.env.get("NVTE_CPU_OFFLOAD_V1", "0") != "1":
        yield c.problem(view.parties("model.fine_grained_activation_offloading"), "$NVTE_CPU_OFFLOAD_V1",
                        view.env.get("NVTE_CPU_OFFLOAD_V1"),
                        "For fine-grained activation offloading with TE >= 2.10.0, NVTE_CPU_OFFLOAD_V1 environment "
                        "variable should be set to 1 to avoid offloading weights",
                        "export NVTE_CPU_OFFLOAD_V1=1 (or put it in cfg.env_vars)")


@check(enforced_by="megatron-core",
       oracle=("moe_paged_stash cannot be enabled with cpu_offloading",
               "moe_paged_stash requires moe_expert_rank_capacity_factor",
               "When moe_paged_stash is enabled, offload_modules must not include"),
       source=f"{OFFLOAD_SKILL}, Compatibility; C transformer_config.py:1904-1921",
       reads=("model.moe_paged_stash", "model.cpu_offloading", "model.moe_expert_rank_capacity_factor",
              "model.offload_modules"))
def moe_paged_stash_settings(view, c):
    """MoE paged stash: not with CPU offload, needs a rank capacity factor, no MoE offload modules."""
    if not view.get("model.moe_paged_stash"):
        return
    who = view.parties("model.moe_paged_stash")
    if view.get("model.cpu_offloading"):
        yield c.problem(view.parties("model.moe_paged_stash", "model.cpu_offloading"), "model.cpu_offloading", True,
                        "moe_paged_stash cannot be enabled with cpu_offloading",
                        "drop +mem=cpu_offload (or model.cpu_offloading=false), or set model.moe_paged_stash=false")
    if view.get("model.moe_expert_rank_capacity_factor") is None:
        yield c.problem(who, "model.moe_expert_rank_capacity_factor", None,
                        "moe_paged_stash requires moe_expert_rank_capacity_factor to be set",
                        "set model.moe_expert_rank_capacity_factor (e.g. 1.0) or model.moe_paged_stash=false")
    conflict = sorted(INSIDE_MOE & set(offload_modules(view)))
    if conflict:
        yield c.problem(who, "model.offload_modules", conflict,
                        f"When moe_paged_stash is enabled, offload_modules must not include {conflict}",
                        "remove them from model.offload_modules (paged stash covers those activations)")


@check(enforced_by="megatron-core",
       oracle=("min_offloaded_tensor_size must be non-negative", "delta_offload_bytes_across_pp_ranks must be non-negative"),
       source=f"{OFFLOAD_SKILL}, Fine-grained activation offloading; C transformer_config.py:1885-1893",
       reads=("model.fine_grained_activation_offloading", "model.min_offloaded_tensor_size",
              "model.delta_offload_bytes_across_pp_ranks"))
def fine_grained_offload_sizes(view, c):
    """Fine-grained offload: min_offloaded_tensor_size and delta_offload_bytes_across_pp_ranks are non-negative."""
    if not view.get("model.fine_grained_activation_offloading"):
        return
    for path, what in (("model.min_offloaded_tensor_size", "min_offloaded_tensor_size"),
                       ("model.delta_offload_bytes_across_pp_ranks", "delta_offload_bytes_across_pp_ranks")):
        value = view.get(path)
        if isinstance(value, (int, float)) and value < 0:
            yield c.problem(view.parties(path), path, value, f"{what} must be non-negative (got {value})",
                            f"set {path}=0 or a positive number of bytes")


@check(enforced_by="megatron-core",
       oracle="overlap_moe_expert_parallel_comm with ncclep does not support offloading",
       source=f"{OFFLOAD_SKILL}, Fine-grained activation offloading; C transformer_config.py:2715-2735 (the ncclep "
              "flex backend with EP overlap frees expert FC1's raw input early)",
       reads=("model.fine_grained_activation_offloading", "model.offload_modules", "model.moe_token_dispatcher_type",
              "model.moe_flex_dispatcher_backend", *EP_OVERLAP_READS))
def fine_grained_offload_ncclep_overlap(view, c):
    """Fine-grained offload of expert_fc1 is not supported with EP overlap on the ncclep flex dispatcher."""
    if (view.get("model.fine_grained_activation_offloading") and "expert_fc1" in offload_modules(view)
            and effective_ep_overlap(view) and view.get("model.moe_token_dispatcher_type") == "flex"
            and view.get("model.moe_flex_dispatcher_backend") == "ncclep"):
        yield c.problem(view.parties("model.offload_modules", "comm_overlap.overlap_moe_expert_parallel_comm"),
                        "model.offload_modules", offload_modules(view),
                        "overlap_moe_expert_parallel_comm with ncclep does not support offloading 'expert_fc1' (the "
                        "overlap path frees expert FC1's raw bf16 input early)",
                        "remove expert_fc1 from model.offload_modules (mem.fine_grained_offload.modules)")
