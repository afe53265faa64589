"""CUDA graphs with recompute and with expandable segments."""

from __future__ import annotations

from .facts import (GRAPH_READS, MEM_SKILL, NO_GRAPHS, RECOMPUTE_SKILL, SELECTIVE_READS, SURFACE, graph_modules,
                    selective_modules)
from .registry import check, resolver

GRAPHS_SKILL = "nvidia-skills/nemo-mbridge-perf-cuda-graphs.SKILL.md"


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
    """Full recompute works only with full-iteration CUDA graphs."""
    impl = view.get("model.cuda_graph_impl")
    if view.get("model.recompute_granularity") == "full" and impl not in NO_GRAPHS and impl != "full_iteration":
        yield c.problem(view.parties("model.recompute_granularity", "model.cuda_graph_impl"), "model.cuda_graph_impl", impl,
                        "full recompute is only supported with full iteration CUDA graph",
                        "set model.cuda_graph_impl=full_iteration or none, or use +mem=selective_recompute")


@check(enforced_by="runtime",
       source=f"{MEM_SKILL}, Compatibility and Constraints; {GRAPHS_SKILL}, Constraints and Pitfall 8. megatron-core "
              "0.19.2 asserts it only for the transformer_engine implementation, at graph setup "
              "(C transformer/cuda_graphs.py:2102-2108); for local and full_iteration graphs it is the skill's rule "
              "(illegal memory access on GPUs before sm_100)",
       reads=("model.cuda_graph_impl", "$PYTORCH_CUDA_ALLOC_CONF", "$NCCL_GRAPH_REGISTER"))
def expandable_segments_cuda_graphs(view, c):
    """CUDA graphs with expandable segments need NCCL_GRAPH_REGISTER=0."""
    impl = view.get("model.cuda_graph_impl")
    on = "expandable_segments:True" in view.env.get("PYTORCH_CUDA_ALLOC_CONF", "")  # MCore: substring test
    if impl not in NO_GRAPHS and on and view.env.get("NCCL_GRAPH_REGISTER", "") != "0":
        yield c.problem(view.parties("model.cuda_graph_impl"), "$NCCL_GRAPH_REGISTER", view.env.get("NCCL_GRAPH_REGISTER"),
                        "Setting NCCL_GRAPH_REGISTER=0 to avoid illegal memory access when using CUDA Graph with "
                        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                        "export NCCL_GRAPH_REGISTER=0 (+mem=expandable_segments sets it when CUDA graphs are on)")


@check(enforced_by="megatron-core", oracle="moe recompute is not supported with moe_router CUDA graph",
       source=f"{RECOMPUTE_SKILL}, CUDA graphs; C transformer_config.py:2527-2535 (transformer_engine implementation)",
       reads=(*SELECTIVE_READS, *GRAPH_READS))
def recompute_moe_router_graph(view, c):
    """moe recompute is not supported with a TE moe_router CUDA graph."""
    if (view.get("model.cuda_graph_impl") == "transformer_engine" and "moe" in selective_modules(view)
            and "moe_router" in graph_modules(view)):
        yield c.problem(view.parties("model.recompute_modules", "model.cuda_graph_modules"), "model.recompute_modules",
                        selective_modules(view),
                        "moe recompute is not supported with moe_router CUDA graph with --cuda-graph-impl "
                        "transformer_engine (the recomputed region would cover the graphed router)",
                        "recompute moe_act instead of moe, or drop moe_router from model.cuda_graph_modules")


@check(enforced_by="megatron-core",
       oracle=("attention dropout is not supported with graphed attention recomputation",
               "hidden dropout is not supported with graphed MLP/MoE recomputation",
               "moe_input_jitter_eps is not supported with graphed moe recomputation"),
       source=f"{RECOMPUTE_SKILL}, CUDA graphs; C transformer_config.py:2537-2573 (a graphed recompute region cannot "
              "draw random numbers: whole-layer or full-iteration capture, or the module's own scope)",
       reads=(*SELECTIVE_READS, *GRAPH_READS, "model.attention_dropout", "model.hidden_dropout",
              "model.moe_input_jitter_eps"))
def recompute_graphed_randomness(view, c):
    """Graphed recompute regions cannot use attention/hidden dropout or MoE input jitter."""
    impl = view.get("model.cuda_graph_impl")
    mods = selective_modules(view)  # empty unless selective, the deprecated moe_layer_recompute included (C:1835)
    if impl in NO_GRAPHS or not mods:
        return
    scopes = graph_modules(view)
    whole = impl == "full_iteration" or not scopes

    def graphed(scope: str) -> bool:
        return whole or scope in scopes

    who = view.parties("model.recompute_modules", "model.cuda_graph_impl")
    fix_scope = "graph only other scopes (model.cuda_graph_modules=[...]), or drop the label from recompute_modules"
    if view.get("model.attention_dropout") and graphed("attn") and "core_attn" in mods:
        yield c.problem(who, "model.attention_dropout", view.get("model.attention_dropout"),
                        "attention dropout is not supported with graphed attention recomputation",
                        f"set model.attention_dropout=0.0, or {fix_scope}")
    if view.get("model.hidden_dropout") and ((graphed("mlp") and "mlp" in mods) or (graphed("moe") and "moe" in mods)):
        yield c.problem(who, "model.hidden_dropout", view.get("model.hidden_dropout"),
                        "hidden dropout is not supported with graphed MLP/MoE recomputation",
                        f"set model.hidden_dropout=0.0, or {fix_scope}")
    if view.get("model.moe_input_jitter_eps") is not None and graphed("moe") and "moe" in mods:
        yield c.problem(who, "model.moe_input_jitter_eps", view.get("model.moe_input_jitter_eps"),
                        "moe_input_jitter_eps is not supported with graphed moe recomputation",
                        f"set model.moe_input_jitter_eps=null, or {fix_scope}")


@check(enforced_by="bridge", oracle='supports model.cuda_graph_impl="local" only for',
       source=f"{GRAPHS_SKILL}, Constraints ('full_iteration scope only with cuda_graph_impl=local'); Bridge "
              "utils/cuda_graph.py validate_cuda_graph_configuration",
       reads=(*GRAPH_READS, "model.inference_cuda_graph_scope"))
def local_graphs_full_iteration_only(view, c):
    """Bridge supports the local CUDA-graph implementation only for full-iteration graphs."""
    raw = [view.get("model.cuda_graph_modules"), view.get("model.cuda_graph_scope")]
    names = {str(getattr(x, "name", x)) for value in raw for x in (value if isinstance(value, (list, tuple)) else [value])}
    inference = str(getattr(view.get("model.inference_cuda_graph_scope"), "name", view.get("model.inference_cuda_graph_scope")))
    if view.get("model.cuda_graph_impl") == "local" and "full_iteration" not in names \
            and not (not graph_modules(view) and inference in ("layer", "block")):
        yield c.problem(view.parties("model.cuda_graph_impl"), "model.cuda_graph_impl", "local",
                        'Megatron Bridge supports model.cuda_graph_impl="local" only for full-iteration CUDA graphs',
                        'use model.cuda_graph_impl=transformer_engine for per-layer graphs, or full_iteration')


@check(enforced_by="megatron-core", oracle="cuda_graph_scope and cuda_graph_modules cannot be set together",
       source=f"{GRAPHS_SKILL}; C transformer_config.py:2383-2388 (cuda_graph_scope is the deprecated name of "
              "cuda_graph_modules; some recipes still set it)",
       reads=("model.cuda_graph_scope", "model.cuda_graph_modules", "model.cuda_graph_impl"))
def cuda_graph_scope_and_modules(view, c):
    """The deprecated cuda_graph_scope and cuda_graph_modules are not set together."""
    modules = view.get("model.cuda_graph_modules")
    # With graphs off, Bridge clears cuda_graph_modules before megatron-core looks (utils/cuda_graph.py:136-139).
    if view.get("model.cuda_graph_impl") in NO_GRAPHS:
        return
    if view.get("model.cuda_graph_scope") is not None and modules not in ("full", None, []):
        yield c.problem(view.parties("model.cuda_graph_scope", "model.cuda_graph_modules"), "model.cuda_graph_modules",
                        modules, "cuda_graph_scope and cuda_graph_modules cannot be set together (the recipe sets the "
                        f"deprecated model.cuda_graph_scope={view.get('model.cuda_graph_scope')!r})",
                        "set model.cuda_graph_scope=null and keep model.cuda_graph_modules, or set only the scope")


@check(enforced_by="megatron-core", oracle='cuda_graph_modules must be empty when cuda_graph_impl="full_iteration"',
       source=f"{GRAPHS_SKILL}; C transformer_config.py:2461-2463 (after the deprecated cuda_graph_scope has been "
              "migrated into cuda_graph_modules)", reads=GRAPH_READS)
def full_iteration_graph_modules_empty(view, c):
    """Full-iteration CUDA graphs take no per-layer graph modules."""
    if view.get("model.cuda_graph_impl") == "full_iteration" and graph_modules(view):
        yield c.problem(view.parties("model.cuda_graph_impl", "model.cuda_graph_modules"), "model.cuda_graph_modules",
                        graph_modules(view), 'cuda_graph_modules must be empty when cuda_graph_impl="full_iteration" '
                        "(a full-iteration graph captures everything; the recipe's cuda_graph_scope counts too)",
                        "set model.cuda_graph_modules=[] and model.cuda_graph_scope=null")


@check(enforced_by="megatron-core",
       oracle=("cuda_graph_modules must not contain both moe and moe_router",
               "moe_preprocess cuda graph is only supported with moe_router cuda graph",
               "moe cuda graph is only supported for MoE", "mlp cuda graph is only supported for dense layers",
               "moe cuda graph is only supported with drop-padding MoE",
               "moe_preprocess cuda graph is not supported when there are DtoH copies"),
       source=f"{GRAPHS_SKILL}, Constraints ('Do not combine moe and moe_router', 'moe_preprocess requires "
              "moe_router', 'token-dropless routing limits graphable scope'); C transformer_config.py:2471-2511",
       reads=(*GRAPH_READS, "model.num_moe_experts", "model.moe_layer_freq", "model.moe_expert_capacity_factor",
              "model.moe_pad_expert_input_to_capacity", "model.moe_token_dispatcher_type",
              "model.moe_router_padding_for_fp8"))
def graph_modules_fit_the_model(view, c):
    """Per-layer graph scopes exist in the model: moe/moe_router apart, moe_preprocess with moe_router, MoE scopes on MoE."""
    if view.get("model.cuda_graph_impl") not in ("local", "transformer_engine"):
        return
    scopes = graph_modules(view)
    who, fix = view.parties("model.cuda_graph_modules"), "choose scopes the model has: see the cuda-graphs skill"
    if "moe" in scopes and "moe_router" in scopes:
        yield c.problem(who, "model.cuda_graph_modules", scopes,
                        "cuda_graph_modules must not contain both moe and moe_router", "keep one of them")
    if "moe_preprocess" in scopes and "moe_router" not in scopes:
        yield c.problem(who, "model.cuda_graph_modules", scopes,
                        "moe_preprocess cuda graph is only supported with moe_router cuda graph", "add moe_router")
    experts = view.get("model.num_moe_experts") or 0
    if experts <= 1:
        if {"moe", "moe_router"} & set(scopes):
            yield c.problem(who, "model.cuda_graph_modules", scopes, "moe cuda graph is only supported for MoE", fix)
        return
    freq = view.get("model.moe_layer_freq", 1)
    if (freq == 1 or (isinstance(freq, (list, tuple)) and 0 not in freq)) and "mlp" in scopes:
        yield c.problem(who, "model.cuda_graph_modules", scopes,
                        "mlp cuda graph is only supported for dense layers, but every layer of this model is MoE", fix)
    dropless = view.get("model.moe_expert_capacity_factor") is None or not view.get("model.moe_pad_expert_input_to_capacity")
    if dropless:
        if "moe" in scopes:
            yield c.problem(who, "model.cuda_graph_modules", scopes,
                            "moe cuda graph is only supported with drop-padding MoE (set moe_expert_capacity_factor and "
                            "moe_pad_expert_input_to_capacity)", "graph moe_router instead of moe")
        if view.get("model.moe_token_dispatcher_type") == "alltoall" and "moe_preprocess" in scopes and (
                view.get("model.moe_expert_capacity_factor") is not None or view.get("model.moe_router_padding_for_fp8")):
            yield c.problem(who, "model.cuda_graph_modules", scopes,
                            "moe_preprocess cuda graph is not supported when there are DtoH copies and synchronizations "
                            "in the preprocess step", "drop moe_preprocess")
