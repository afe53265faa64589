"""Activation recompute: selective labels, full-layer settings, and their MoE/FP8 restrictions."""

from __future__ import annotations

from .facts import (RECOMPUTE_SKILL, SURFACE, all_layers_moe, ep_overlap, fp8_setting, is_moe,
                    layers_per_pipeline_rank, selective_modules)
from .facts import recompute_labels as installed_recompute_labels
from .registry import both_on, check, resolver

SELECTIVE = ("model.recompute_granularity", "model.recompute_modules")


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
    yield from _label_requires(view, c, "moe_act", "model.moe_grouped_gemm", "moe_grouped_gemm")


@check(enforced_by="megatron-core", oracle="mla_up_proj in recompute_modules is only supported",
       source=f"{RECOMPUTE_SKILL}, Decision Table; {SURFACE} §2 (C:1789)",
       reads=(*SELECTIVE, "model.multi_latent_attention"))
def recompute_mla_up_proj_needs_mla(view, c):
    yield from _label_requires(view, c, "mla_up_proj", "model.multi_latent_attention", "multi-latent attention")


@check(enforced_by="megatron-core", oracle="gdn_norm_out in recompute_modules is only supported",
       source=f"{SURFACE} §2 (C:1795-1802)", reads=(*SELECTIVE, "model.experimental_attention_variant"))
def recompute_gdn_norm_out_needs_gdn(view, c):
    if "gdn_norm_out" in selective_modules(view) and view.get("model.experimental_attention_variant") != "gated_delta_net":
        yield c.problem(view.parties("model.recompute_modules"), "model.recompute_modules", selective_modules(view),
                        "gdn_norm_out recompute needs experimental_attention_variant='gated_delta_net'",
                        "remove gdn_norm_out from mem.selective_recompute.modules")


@check(enforced_by="megatron-core",
       oracle=("Delayed scaling does not support moe_act and layernorm", "moe_act and layernorm recompute for fp8 needs"),
       source=f"{RECOMPUTE_SKILL}, FP8 restrictions; {SURFACE} §2 (C:1821-1833)",
       reads=(*SELECTIVE, "mixed_precision", "model.fp8", "model.fp8_recipe"))
def recompute_fp8_delayed(view, c):
    fp8, recipe = fp8_setting(view)
    hit = [m for m in ("moe_act", "layernorm") if m in selective_modules(view)]
    if fp8 and recipe == "delayed" and hit:
        yield c.problem(view.parties("model.recompute_modules", "mixed_precision"), "model.recompute_modules", hit,
                        "Delayed scaling does not support moe_act and layernorm recompute for fp8",
                        "use a current/tensorwise FP8 recipe, or recompute other modules (e.g. core_attn)")


@check(enforced_by="bridge", oracle="when enabling overlap_moe_expert_parallel_comm",
       source=f"{RECOMPUTE_SKILL}, MoE restrictions; {SURFACE} §2 (C:2689-2699, comm_overlap.py:499-512)",
       reads=(*SELECTIVE, "comm_overlap.overlap_moe_expert_parallel_comm", "model.overlap_moe_expert_parallel_comm"))
def recompute_moe_ep_overlap(view, c):
    if not ep_overlap(view):
        return
    g = view.get("model.recompute_granularity")
    if g == "full" or "moe" in selective_modules(view):
        yield c.problem(view.parties("model.recompute_granularity", "comm_overlap.overlap_moe_expert_parallel_comm"),
                        "model.recompute_granularity", g,
                        "disable full recomputation / moe in recompute_modules when enabling overlap_moe_expert_parallel_comm",
                        "keep EP overlap and recompute an inner boundary (moe_act), or disable the overlap")


@check(enforced_by="megatron-core", oracle="shared_experts recompute cannot work with",
       source=f"{RECOMPUTE_SKILL}, MoE restrictions; {SURFACE} §2 (C:1812-1819)",
       reads=(*SELECTIVE, "model.moe_shared_expert_overlap", "model.moe_shared_expert_intermediate_size"))
def recompute_shared_experts_overlap(view, c):
    if ("shared_experts" in selective_modules(view) and view.get("model.moe_shared_expert_overlap")
            and view.get("model.moe_shared_expert_intermediate_size")):
        yield c.problem(view.parties("model.recompute_modules", "model.moe_shared_expert_overlap"), "model.recompute_modules",
                        selective_modules(view), "shared_experts recompute cannot work with --moe-shared-expert-overlap",
                        "remove shared_experts from the modules, or set model.moe_shared_expert_overlap=false")


@check(enforced_by="megatron-core",
       oracle=('recompute_method must be "block" or "uniform"', "recompute_num_layers must be between"),
       source=f"{RECOMPUTE_SKILL}, Full-layer recompute; {SURFACE} §1.4 (C:1731-1747)",
       reads=("model.recompute_granularity", "model.recompute_method", "model.recompute_num_layers"))
def full_recompute_settings(view, c):
    if view.get("model.recompute_granularity") != "full":
        return
    method, n = view.get("model.recompute_method"), view.get("model.recompute_num_layers")
    who = view.parties("model.recompute_granularity", "model.recompute_method")
    if method not in ("uniform", "block"):
        yield c.problem(who, "model.recompute_method", method,
                        'Using recompute_granularity: full so recompute_method must be "block" or "uniform"',
                        "use +mem=full_recompute (method defaults to uniform) or set model.recompute_method=uniform")
    if n is None:
        yield c.problem(who, "model.recompute_num_layers", n,
                        "recompute_num_layers must be set with full recompute", "set mem.full_recompute.num_layers=1")


@check(enforced_by="docs", source=f"{SURFACE} §1.4 (C:1742-1747: the message states the range; only None is checked)",
       reads=("model.recompute_granularity", "model.recompute_num_layers", "model.num_layers",
              "model.pipeline_model_parallel_size"))
def full_recompute_num_layers_range(view, c):
    n = view.get("model.recompute_num_layers")
    if view.get("model.recompute_granularity") == "full" and isinstance(n, int):
        limit = layers_per_pipeline_rank(view)
        if not 1 <= n <= limit:
            yield c.problem(view.parties("model.recompute_num_layers"), "model.recompute_num_layers", n,
                            f"recompute_num_layers must be between 1 and num_layers_per_pipeline_rank: {limit} "
                            "(megatron-core states this range but does not enforce it)",
                            f"use mem.full_recompute.num_layers between 1 and {limit}")


@check(enforced_by="megatron-core", oracle="must be false when sequence parallel is enabled",
       source=f"{SURFACE} §1.4 (C:1757-1761)",
       reads=("model.sequence_parallel", "model.distribute_saved_activations"))
def distribute_saved_activations_sp(view, c):
    yield from both_on(view, c, "model.sequence_parallel", "model.distribute_saved_activations",
                       "distribute_saved_activations must be false when sequence parallel is enabled",
                       "set model.distribute_saved_activations=false")


@check(enforced_by="docs", source=f"{RECOMPUTE_SKILL}, MoE restrictions ('mlp' is a no-op on MoE layers)",
       reads=(*SELECTIVE, "model.num_moe_experts", "model.moe_layer_freq"))
def recompute_mlp_on_moe_layers(view, c):
    if "mlp" in selective_modules(view) and all_layers_moe(view):
        yield ("selective_recompute: 'mlp' has no effect on this model: every layer's MLP is MoE "
               "(activation-recompute skill). Use moe_act (grouped GEMM) or moe instead")


@check(enforced_by="docs", source=f"{RECOMPUTE_SKILL}, Attention backend", reads=SELECTIVE)
def recompute_core_attn_with_fused_attention(view, c):
    if "core_attn" in selective_modules(view) and "selective_recompute" in view.selected:
        yield ("note: core_attn: with TE fused or flash attention the saving can be small; compare against "
               "mem.selective_recompute.modules=[] (activation-recompute skill)")
