"""Activation recompute: selective labels, full-layer settings, and their MoE/FP8 restrictions."""

from __future__ import annotations

from .facts import (EP_OVERLAP_READS, GRAPH_READS, RECOMPUTE_SKILL, SELECTIVE_READS, SURFACE, all_layers_moe, effective_ep_overlap,
                    effective_sequence_parallel, fp8_setting, graph_modules, is_moe, layers_per_pipeline_rank, selective_modules)
from .facts import recompute_labels as installed_recompute_labels
from .registry import check, resolver

SELECTIVE = SELECTIVE_READS


@resolver("selective_recompute", writes=("model.recompute_modules",))
def selective_recompute(view, params):
    """``modules: auto``: the architecture's narrowest boundary (activation-recompute skill,
    Quick Decision Guide step 3): MLA -> mla_up_proj, grouped-GEMM MoE -> moe_act, else core_attn."""
    modules = params["modules"]
    if modules == "auto":
        if view.get("model.multi_latent_attention"):
            modules = ["mla_up_proj"]
        elif is_moe(view) and view.get("model.moe_grouped_gemm"):
            modules = ["moe_act"]
        else:
            modules = ["core_attn"]
        params["modules"] = modules
    return {"model.recompute_modules": list(modules)}, {}


@check(enforced_by="megatron-core", oracle="Invalid choices for recompute_modules",
       source=f"{RECOMPUTE_SKILL}, Selective Module Decision Table; {SURFACE} §2 (C:1767-1782)", reads=SELECTIVE)
def recompute_labels(view, c):
    """Selective recompute labels exist in the installed megatron-core."""
    allowed = installed_recompute_labels()
    bad = [m for m in selective_modules(view) if m not in allowed]
    if bad:
        yield c.problem(view.parties("model.recompute_modules"), "model.recompute_modules", selective_modules(view),
                        f"Invalid choices for recompute_modules: {bad}. The installed megatron-core allows {sorted(allowed)}",
                        f"use labels from that list, e.g. mem.selective_recompute.modules=[{sorted(allowed)[0]}]")


def _label_requires(view, c, label: str, field: str, what: str):
    if label in selective_modules(view) and not view.get(field):
        yield c.problem(view.parties("model.recompute_modules", field), "model.recompute_modules", selective_modules(view),
                        f"{label} in recompute_modules is only supported with {what} ({field} is {view.get(field)!r})",
                        f"remove {label} (mem.selective_recompute.modules=auto picks a valid label for this model)")


@check(enforced_by="megatron-core", oracle="moe_act in recompute_modules is only supported with moe_grouped_gemm",
       source=f"{RECOMPUTE_SKILL}, MoE restrictions; {SURFACE} §2 (C:1784)", reads=(*SELECTIVE, "model.moe_grouped_gemm"))
def recompute_moe_act_needs_grouped_gemm(view, c):
    """moe_act recompute needs grouped-GEMM MoE."""
    yield from _label_requires(view, c, "moe_act", "model.moe_grouped_gemm", "moe_grouped_gemm")


@check(enforced_by="megatron-core", oracle="mla_up_proj in recompute_modules is only supported",
       source=f"{RECOMPUTE_SKILL}, Decision Table; {SURFACE} §2 (C:1789)",
       reads=(*SELECTIVE, "model.multi_latent_attention"))
def recompute_mla_up_proj_needs_mla(view, c):
    """mla_up_proj recompute needs multi-latent attention."""
    yield from _label_requires(view, c, "mla_up_proj", "model.multi_latent_attention", "multi-latent attention")


@check(enforced_by="megatron-core", oracle="gdn_norm_out in recompute_modules is only supported",
       source=f"{SURFACE} §2 (C:1795-1802)", reads=(*SELECTIVE, "model.experimental_attention_variant"))
def recompute_gdn_norm_out_needs_gdn(view, c):
    """gdn_norm_out recompute needs gated delta-net attention."""
    if "gdn_norm_out" in selective_modules(view) and view.get("model.experimental_attention_variant") != "gated_delta_net":
        yield c.problem(view.parties("model.recompute_modules"), "model.recompute_modules", selective_modules(view),
                        "gdn_norm_out recompute needs experimental_attention_variant='gated_delta_net'",
                        "remove gdn_norm_out from mem.selective_recompute.modules")


@check(enforced_by="megatron-core",
       oracle=("Delayed scaling does not support moe_act and layernorm", "moe_act and layernorm recompute for fp8 needs"),
       source=f"{RECOMPUTE_SKILL}, FP8 restrictions; {SURFACE} §2 (C:1821-1833)",
       reads=(*SELECTIVE, "mixed_precision", "model.fp8", "model.fp8_recipe"))
def recompute_fp8_delayed(view, c):
    """moe_act/layernorm recompute is not supported with delayed-scaling FP8."""
    fp8, recipe = fp8_setting(view)
    hit = [m for m in ("moe_act", "layernorm") if m in selective_modules(view)]
    if fp8 and recipe == "delayed" and hit:
        yield c.problem(view.parties("model.recompute_modules", "mixed_precision"), "model.recompute_modules", hit,
                        "Delayed scaling does not support moe_act and layernorm recompute for fp8",
                        "use a current/tensorwise FP8 recipe, or recompute other modules (e.g. core_attn)")


@check(enforced_by="bridge",
       oracle=("disable full recomputation when enabling overlap_moe_expert_parallel_comm",
               "disable recomputation method when enabling overlap_moe_expert_parallel_comm",
               "recompute_num_layers must be None when enabling overlap_moe_expert_parallel_comm",
               "disable moe in recompute_modules when enabling overlap_moe_expert_parallel_comm"),
       source=f"{RECOMPUTE_SKILL}, MoE restrictions; {SURFACE} §2 (Bridge comm_overlap.py:499-512 runs first; "
              "C transformer_config.py:2689-2699 repeats it)",
       reads=(*SELECTIVE, *EP_OVERLAP_READS, "model.recompute_method", "model.recompute_num_layers"))
def recompute_moe_ep_overlap(view, c):
    """EP comm overlap: no full recompute, no recompute method/num_layers, no moe recompute."""
    if not effective_ep_overlap(view):
        return
    who = view.parties("model.recompute_granularity", "comm_overlap.overlap_moe_expert_parallel_comm"
                       if view.get("comm_overlap") is not None else "model.overlap_moe_expert_parallel_comm")
    fix = "keep EP overlap and recompute an inner boundary (selective moe_act), or disable the overlap"
    g = view.get("model.recompute_granularity")
    if g == "full":
        yield c.problem(who, "model.recompute_granularity", g,
                        "disable full recomputation when enabling overlap_moe_expert_parallel_comm", fix)
    if view.get("model.recompute_method") is not None:
        yield c.problem(who, "model.recompute_method", view.get("model.recompute_method"),
                        "disable recomputation method when enabling overlap_moe_expert_parallel_comm",
                        "set model.recompute_method=null (selective recompute needs none)")
    if view.get("model.recompute_num_layers") is not None:
        yield c.problem(who, "model.recompute_num_layers", view.get("model.recompute_num_layers"),
                        "recompute_num_layers must be None when enabling overlap_moe_expert_parallel_comm",
                        "set model.recompute_num_layers=null")
    if "moe" in selective_modules(view):
        yield c.problem(who, "model.recompute_modules", selective_modules(view),
                        "disable moe in recompute_modules when enabling overlap_moe_expert_parallel_comm", fix)


@check(enforced_by="megatron-core", oracle="shared_experts recompute cannot work with",
       source=f"{RECOMPUTE_SKILL}, MoE restrictions; {SURFACE} §2 (C:1812-1819)",
       reads=(*SELECTIVE, "model.moe_shared_expert_overlap", "model.moe_shared_expert_intermediate_size"))
def recompute_shared_experts_overlap(view, c):
    """shared_experts recompute cannot run with shared-expert overlap."""
    if ("shared_experts" in selective_modules(view) and view.get("model.moe_shared_expert_overlap")
            and view.get("model.moe_shared_expert_intermediate_size")):
        yield c.problem(view.parties("model.recompute_modules", "model.moe_shared_expert_overlap"), "model.recompute_modules",
                        selective_modules(view), "shared_experts recompute cannot work with --moe-shared-expert-overlap",
                        "remove shared_experts from the modules, or set model.moe_shared_expert_overlap=false")


@check(enforced_by="megatron-core",
       oracle=('recompute_method must be "block" or "uniform"', 'must be "block" or "uniform".',
               "recompute_num_layers must be between", "recompute_num_layers must be None."),
       source=f"{RECOMPUTE_SKILL}, Full-layer and selective recompute; {SURFACE} §1.4 (C transformer_config.py:1724-1755)",
       reads=("model.recompute_granularity", "model.recompute_method", "model.recompute_num_layers"))
def recompute_settings(view, c):
    """Full recompute needs method uniform/block and num_layers; selective takes no num_layers; a method is uniform/block."""
    g = view.get("model.recompute_granularity")
    if g not in ("full", "selective"):
        return
    method, n = view.get("model.recompute_method"), view.get("model.recompute_num_layers")
    who = view.parties("model.recompute_granularity", "model.recompute_method")
    if method is not None and method not in ("uniform", "block"):
        yield c.problem(who, "model.recompute_method", method, f'recompute_method: {method} must be "block" or "uniform".',
                        "set model.recompute_method=uniform" + (" (or null for selective recompute)" if g == "selective" else ""))
    elif method is None and g == "full":
        yield c.problem(who, "model.recompute_method", method,
                        'Using recompute_granularity: full so recompute_method must be "block" or "uniform"',
                        "use +mem=full_recompute (method defaults to uniform) or set model.recompute_method=uniform")
    if g == "full" and n is None:
        yield c.problem(who, "model.recompute_num_layers", n,
                        "recompute_num_layers must be set with full recompute", "set mem.full_recompute.num_layers=1")
    if g == "selective" and n is not None:
        yield c.problem(who, "model.recompute_num_layers", n,
                        "When using recompute_granularity: selective recompute_num_layers must be None.",
                        "set model.recompute_num_layers=null (it only applies to full recompute)")


@check(enforced_by="docs", source=f"{SURFACE} §1.4 (C:1742-1747: the message states the range; only None is checked)",
       reads=("model.recompute_granularity", "model.recompute_num_layers", "model.num_layers",
              "model.pipeline_model_parallel_size"))
def full_recompute_num_layers_range(view, c):
    """Full recompute layer count is within 1..layers per pipeline rank."""
    n = view.get("model.recompute_num_layers")
    if view.get("model.recompute_granularity") == "full" and isinstance(n, int):
        limit = layers_per_pipeline_rank(view)
        if not 1 <= n <= limit:
            yield c.problem(view.parties("model.recompute_num_layers"), "model.recompute_num_layers", n,
                            f"recompute_num_layers must be between 1 and num_layers_per_pipeline_rank: {limit} "
                            "(megatron-core states this range but does not enforce it)",
                            f"use mem.full_recompute.num_layers between 1 and {limit}")


@check(enforced_by="megatron-core", oracle="must be false when sequence parallel is enabled",
       source=f"{SURFACE} §1.4 (C:1757-1761, inside the recompute block; Bridge's finalize first turns SP off at TP<=1, "
              "models/transformer_config.py:179-180)",
       reads=("model.recompute_granularity", "model.sequence_parallel", "model.tensor_model_parallel_size",
              "model.distribute_saved_activations"))
def distribute_saved_activations_sp(view, c):
    """distribute_saved_activations is off under recompute with effective SP."""
    if (view.get("model.recompute_granularity") is not None and view.get("model.distribute_saved_activations")
            and effective_sequence_parallel(view)):
        yield c.problem(view.parties("model.sequence_parallel", "model.distribute_saved_activations"),
                        "model.distribute_saved_activations", True,
                        "distribute_saved_activations must be false when sequence parallel is enabled",
                        "set model.distribute_saved_activations=false (SP already splits the saved activations)")


@check(enforced_by="megatron-core", oracle="Do not set --moe-layer-recompute with full recompute granularity",
       source=f"{RECOMPUTE_SKILL}, MoE restrictions; C transformer_config.py:1835-1846 (moe_layer_recompute is "
              "deprecated: it means selective recompute of 'moe')",
       reads=("model.moe_layer_recompute", "model.recompute_granularity"))
def moe_layer_recompute_full(view, c):
    """The deprecated moe_layer_recompute cannot be combined with full recompute."""
    if view.get("model.moe_layer_recompute") and view.get("model.recompute_granularity") == "full":
        yield c.problem(view.parties("model.moe_layer_recompute", "model.recompute_granularity"),
                        "model.moe_layer_recompute", True,
                        "Do not set --moe-layer-recompute with full recompute granularity",
                        "set model.moe_layer_recompute=false (full recompute already covers the MoE layer)")


@check(enforced_by="docs", source=f"{RECOMPUTE_SKILL}, MoE restrictions ('mlp' is a no-op on MoE layers)",
       reads=(*SELECTIVE, "model.num_moe_experts", "model.moe_layer_freq"))
def recompute_mlp_on_moe_layers(view, c):
    """'mlp' recompute does nothing when every layer's MLP is MoE (warned)."""
    if "mlp" in selective_modules(view) and all_layers_moe(view):
        yield ("selective_recompute: 'mlp' has no effect on this model: every layer's MLP is MoE "
               "(activation-recompute skill). Use moe_act (grouped GEMM) or moe instead")


@check(enforced_by="docs", source=f"{RECOMPUTE_SKILL}, Attention backend", reads=SELECTIVE)
def recompute_core_attn_with_fused_attention(view, c):
    """core_attn recompute saves little with fused attention (note)."""
    if "core_attn" in selective_modules(view) and "selective_recompute" in view.selected:
        yield ("note: core_attn: with TE fused or flash attention the saving can be small; compare against "
               "mem.selective_recompute.modules=[] (activation-recompute skill)")


@check(enforced_by="docs", source=f"{RECOMPUTE_SKILL}, Selective Module Decision Table (labels that match no "
       "module of this architecture recompute nothing)",
       reads=(*SELECTIVE, "model.num_moe_experts", "model.moe_shared_expert_intermediate_size"))
def recompute_label_without_module(view, c):
    """moe/shared_experts/moe_act labels on models without those modules (warned)."""
    mods = selective_modules(view)
    if not is_moe(view):
        for label in ("moe", "shared_experts", "moe_act"):
            if label in mods:
                yield (f"selective_recompute: '{label}' recomputes nothing on this dense model (no MoE layers); "
                       "drop it or use mlp")
    elif "shared_experts" in mods and not view.get("model.moe_shared_expert_intermediate_size"):
        yield ("selective_recompute: 'shared_experts' recomputes nothing: this MoE model has no shared experts "
               "(moe_shared_expert_intermediate_size is unset)")


@check(enforced_by="docs",
       source=f"{RECOMPUTE_SKILL}, Selective Module Decision Table ('layernorm'); C transformer_layer.py:450-507: the "
              "label recomputes input_layernorm / pre_mlp_layernorm only where they are separate modules (with "
              "Transformer Engine, a norm fused into the next GEMM is IdentityOp), and megatron-core switches the "
              "pre-MLP one off under moe_router CUDA graphs unless moe_preprocess is captured with the alltoall "
              "dispatcher, or always with shared-expert overlap",
       reads=(*SELECTIVE, *GRAPH_READS, "model.transformer_impl", "model.num_moe_experts",
              "model.multi_latent_attention", "model.moe_shared_expert_intermediate_size",
              "model.moe_shared_expert_overlap", "model.moe_token_dispatcher_type", "model.moe_latent_size"))
def recompute_layernorm_without_norm(view, c):
    """layernorm recompute where the norms are fused or switched off (note/warned)."""
    if "layernorm" not in selective_modules(view) or view.get("model.transformer_impl") == "local":
        return
    if not is_moe(view):
        if not view.get("model.multi_latent_attention"):
            yield ("note: layernorm recompute does nothing on this model: with Transformer Engine both norms are "
                   "fused into the following GEMM (IdentityOp in the layer spec); recompute core_attn or mlp instead")
        return
    modules = graph_modules(view)
    router_graphed = (view.get("model.cuda_graph_impl") == "transformer_engine" and "moe_router" in modules)
    if router_graphed:
        shared_overlap = (view.get("model.moe_shared_expert_intermediate_size") is not None
                          and view.get("model.moe_shared_expert_overlap"))
        preprocess_ok = "moe_preprocess" in modules and (view.get("model.moe_token_dispatcher_type") == "alltoall"
                                                         or view.get("model.moe_latent_size"))
        if shared_overlap or not preprocess_ok:
            yield ("layernorm recompute: megatron-core switches the MoE layers' pre-MLP norm recompute off under a "
                   "moe_router CUDA graph " + ("with shared-expert overlap" if shared_overlap else
                                               "unless moe_preprocess is also captured with the alltoall dispatcher")
                   + ", and the attention norm is fused, so 'layernorm' saves nothing here")


@check(enforced_by="bridge",
       oracle=("overlap_moe_expert_parallel_comm is only supported when", "If enabling EP A2A overlap",
               "disable moe_shared_expert_overlap when enabling overlap_moe_expert_parallel_comm",
               "MTP supports at most one layer when enabling overlap_moe_expert_parallel_comm"),
       source="Bridge comm_overlap.py:478-518 (mirrors C transformer_config.py:2660-2715): what MoE expert-parallel "
              "communication overlap itself needs",
       reads=(*EP_OVERLAP_READS, "model.expert_model_parallel_size", "model.num_moe_experts",
              "model.moe_token_dispatcher_type", "model.bf16", "model.fp16", "mixed_precision",
              "model.pipeline_model_parallel_size", "model.virtual_pipeline_model_parallel_size",
              "model.moe_shared_expert_overlap", "model.mtp_num_layers"))
def moe_ep_overlap_prerequisites(view, c):
    """EP comm overlap needs EP>1, MoE, alltoall/flex, VPP with PP>1, no shared-expert overlap, MTP<=1."""
    if not effective_ep_overlap(view):
        return
    who = view.parties("comm_overlap.overlap_moe_expert_parallel_comm" if view.get("comm_overlap") is not None
                       else "model.overlap_moe_expert_parallel_comm")
    if (view.get("model.expert_model_parallel_size") or 1) <= 1:
        yield c.problem(who, "model.expert_model_parallel_size", view.get("model.expert_model_parallel_size"),
                        "overlap_moe_expert_parallel_comm is only supported when expert_model_parallel_size > 1",
                        "set model.expert_model_parallel_size>=2 or turn the overlap off")
    if (view.get("model.num_moe_experts") or 0) <= 1:
        yield c.problem(who, "model.num_moe_experts", view.get("model.num_moe_experts"),
                        "overlap_moe_expert_parallel_comm is only supported when num_moe_experts > 1",
                        "turn the overlap off (this is not a MoE model)")
    if view.get("model.moe_token_dispatcher_type") not in ("alltoall", "flex"):
        yield c.problem(who, "model.moe_token_dispatcher_type", view.get("model.moe_token_dispatcher_type"),
                        "overlap_moe_expert_parallel_comm is only supported when moe_token_dispatcher_type == "
                        "'alltoall' or 'flex'", "set model.moe_token_dispatcher_type=alltoall")
    if (view.get("model.pipeline_model_parallel_size") or 1) > 1 and view.get("model.virtual_pipeline_model_parallel_size") is None:
        yield c.problem(who, "model.virtual_pipeline_model_parallel_size", None,
                        "If enabling EP A2A overlap, virtual_pipeline_model_parallel_size must be specified when "
                        "pipeline_model_parallel_size > 1", "set model.virtual_pipeline_model_parallel_size (e.g. 2)")
    if view.get("model.moe_shared_expert_overlap"):
        yield c.problem(view.parties("model.moe_shared_expert_overlap"), "model.moe_shared_expert_overlap", True,
                        "disable moe_shared_expert_overlap when enabling overlap_moe_expert_parallel_comm",
                        "set model.moe_shared_expert_overlap=false")
    if view.get("model.mtp_num_layers") not in (None, 0, 1):
        yield c.problem(who, "model.mtp_num_layers", view.get("model.mtp_num_layers"),
                        "MTP supports at most one layer when enabling overlap_moe_expert_parallel_comm",
                        "set model.mtp_num_layers to 1 or less")
