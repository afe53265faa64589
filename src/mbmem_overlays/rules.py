"""Resolvers (overlay logic YAML can't express) and checks (every documented rule).

A check is a function of the prospective ``View`` that yields ``Problem``s
(errors), plain strings (warnings) or ``"note: ..."`` strings. Checks look at the
final state, not at which overlay was named, so a rule holds whether an overlay,
the recipe or a user override set the field; problems name whoever set each
field (``view.parties``). ``enforced_by`` says who else enforces the rule:
``megatron-core``/``bridge`` (our verdict must agree with ``runtime_config_update``),
``runtime`` (the stack fails later, at model or optimizer build), or ``docs``
(only NVIDIA's skill texts state it; we are deliberately stricter — see
``DOC_ONLY_CHECKS``). Sources cite files under shared/reference/.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from .errors import Problem

MEM_SKILL = "nvidia-skills/nemo-mbridge-perf-memory-tuning.SKILL.md"
RECOMPUTE_SKILL = "nvidia-skills/nemo-mbridge-perf-activation-recompute.SKILL.md"
OFFLOAD_SKILL = "nvidia-skills/nemo-mbridge-perf-cpu-offloading.SKILL.md"
SURFACE = "bridge-config-surface.md"

NO_GRAPHS = (None, "none")


@dataclass(frozen=True)
class Check:
    id: str
    enforced_by: str
    source: str
    fn: Callable
    oracle: tuple[str, ...] = ()  # fragments of the error Bridge/megatron-core raise for this rule

    def __call__(self, view) -> Iterator:
        yield from self.fn(view, self)

    def problem(self, parties, field, value, message, fix) -> Problem:
        return Problem(tuple(parties), field, value, message, fix, self.source, self.id)


CHECKS: list[Check] = []
RESOLVERS: dict[str, Callable] = {}


def check(id: str, *, enforced_by: str, source: str, oracle: str | tuple[str, ...] = ()):
    if enforced_by in ("megatron-core", "bridge") and not oracle:
        raise ValueError(f"check {id}: a rule enforced by {enforced_by} needs the fragment of its error (oracle=)")
    def register(fn):
        CHECKS.append(Check(id, enforced_by, source, fn, (oracle,) if isinstance(oracle, str) else tuple(oracle)))
        return fn
    return register


def resolver(overlay: str):
    def register(fn):
        RESOLVERS[overlay] = fn
        return fn
    return register


def doc_only_checks() -> dict[str, str]:
    """Rules where we are stricter than Bridge's validation, with their sources."""
    return {c.id: c.source for c in CHECKS if c.enforced_by in ("docs", "runtime")}


# ----------------------------------------------------------------------------- shared facts
@lru_cache(maxsize=1)
def recompute_labels() -> frozenset[str]:
    """The labels the *installed* megatron-core accepts, read from its source without importing it."""
    fallback = frozenset({"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe",
                          "shared_experts", "gdn_norm_out"})  # C:1767-1782 (bridge-config-surface.md §2)
    try:
        spec = importlib.util.find_spec("megatron.core")
    except (ImportError, ValueError):
        return fallback
    if spec is None or not spec.submodule_search_locations:
        return fallback
    src = Path(list(spec.submodule_search_locations)[0]) / "transformer" / "transformer_config.py"
    try:
        text = src.read_text()
    except OSError:
        return fallback
    m = re.search(r"recompute_granularity == \"selective\":.*?allowed_modules = \{(.*?)\}", text, re.S)
    labels = frozenset(re.findall(r"\"(\w+)\"", m.group(1))) if m else frozenset()
    return labels or fallback


def effective_sequence_parallel(view) -> bool:
    # Bridge TransformerConfig.finalize() silently sets sequence_parallel=False when TP<=1 (§4).
    return bool(view.get("model.sequence_parallel")) and (view.get("model.tensor_model_parallel_size") or 1) > 1


def is_moe(view) -> bool:
    return bool(view.get("model.num_moe_experts"))


def all_layers_moe(view) -> bool:
    if not is_moe(view):
        return False
    freq = view.get("model.moe_layer_freq", 1)
    if isinstance(freq, int):
        return freq == 1
    return isinstance(freq, (list, tuple)) and all(int(x) == 1 for x in freq)


def selective_modules(view) -> list[str]:
    if view.get("model.recompute_granularity") != "selective":
        return []
    mods = view.get("model.recompute_modules")
    return ["core_attn"] if mods is None else list(mods)  # None becomes ["core_attn"] at finalize (C:1763)


def fp8_setting(view) -> tuple[bool, str | None]:
    # cfg.mixed_precision.setup() overwrites model.fp8/fp8_recipe (§2, FP8 row): read the recipe object first.
    mp = mixed_precision_config(view.get("mixed_precision"))
    if mp is not None and hasattr(mp, "fp8"):
        return bool(getattr(mp, "fp8", None)), getattr(mp, "fp8_recipe", None)
    return bool(view.get("model.fp8")), view.get("model.fp8_recipe")


def mixed_precision_config(mp):
    """cfg.mixed_precision as an object: a preset name such as 'bf16_with_fp8_delayed_scaling_mixed' becomes
    Bridge's preset (when Bridge is loaded; None otherwise). cfg.mixed_precision.setup() overwrites the model's
    precision fields from it, so it is the effective setting."""
    if not isinstance(mp, str):
        return mp
    import sys
    module = sys.modules.get("megatron.bridge.training.mixed_precision")
    try:
        return module.get_mixed_precision_config(mp) if module else None
    except Exception:
        return None


def ep_overlap(view) -> bool:
    return bool(view.get("comm_overlap.overlap_moe_expert_parallel_comm")) or bool(
        view.get("model.overlap_moe_expert_parallel_comm"))


def layers_per_pipeline_rank(view) -> int:
    return max(1, (view.get("model.num_layers") or 1) // max(1, view.get("model.pipeline_model_parallel_size") or 1))


# ----------------------------------------------------------------------------- resolvers
@resolver("selective_recompute")
def _selective_default(view, params):
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


@resolver("expandable_segments")
def _graph_register(view, params):
    """With CUDA graphs on, expandable segments need NCCL_GRAPH_REGISTER=0
    (memory-tuning skill, Compatibility and Constraints; C transformer/cuda_graphs.py:2102)."""
    if view.get("model.cuda_graph_impl") not in NO_GRAPHS:
        return {}, {"NCCL_GRAPH_REGISTER": "0"}
    return {}, {}


# ----------------------------------------------------------------------------- activation CPU offloading
@check("cpu_offload_pipeline", enforced_by="megatron-core", oracle='no support for Pipeline parallelism with CPU offloading',
       source=f"{MEM_SKILL}, Compatibility and Constraints; {SURFACE} §1.5 (C:1714-1717)")
def _(view, c):
    pp = view.get("model.pipeline_model_parallel_size") or 1
    if view.get("model.cpu_offloading") and pp > 1:
        yield c.problem(view.parties("model.cpu_offloading", "model.pipeline_model_parallel_size"),
                        "model.pipeline_model_parallel_size", pp,
                        "Currently there is no support for Pipeline parallelism with CPU offloading "
                        f"(activation offload needs PP=1, this config has PP={pp})",
                        "set model.pipeline_model_parallel_size=1, or use +mem=optimizer_offload "
                        "(optimizer-state offload works with any PP)")


@check("cpu_offload_recompute", enforced_by="megatron-core", oracle='CPU offloading does not work when activation recomputation is enabled', source=f"{OFFLOAD_SKILL}, Compatibility; {SURFACE} §1.5 (C:1719-1722)")
def _(view, c):
    g = view.get("model.recompute_granularity")
    if view.get("model.cpu_offloading") and g is not None:
        yield c.problem(view.parties("model.cpu_offloading", "model.recompute_granularity"),
                        "model.recompute_granularity", g,
                        "CPU offloading does not work when activation recomputation is enabled",
                        "use either activation offload or recompute: drop one of the two overlays, "
                        "or set model.recompute_granularity=null")


@check("cpu_offload_cuda_graphs", enforced_by="megatron-core", oracle='CUDA graphs not supported with CPU offloading', source=f"{OFFLOAD_SKILL}, Compatibility; {SURFACE} §1.5 (C:2467-2468)")
def _(view, c):
    impl = view.get("model.cuda_graph_impl")
    if view.get("model.cpu_offloading") and impl not in NO_GRAPHS and impl != "full_iteration":
        yield c.problem(view.parties("model.cpu_offloading", "model.cuda_graph_impl"), "model.cuda_graph_impl", impl,
                        "CUDA graphs not supported with CPU offloading (only full_iteration graphs are)",
                        "set model.cuda_graph_impl=none (or full_iteration), or use +mem=optimizer_offload")


def _mutually_exclusive(first: str, second: str, message: str, fix: str):
    """A rule of the form 'these two boolean fields cannot both be on'."""
    def fn(view, c):
        if view.get(first) and view.get(second):
            yield c.problem(view.parties(first, second), second, True, message, fix)
    return fn


check("cpu_offload_fine_grained", enforced_by="megatron-core", oracle='fine_grained_activation_offloading cannot be enabled with cpu_offloading', source=f"{OFFLOAD_SKILL}, Compatibility; {SURFACE} §1.5 (C:1849-1851)")(
    _mutually_exclusive("model.cpu_offloading", "model.fine_grained_activation_offloading",
                        "fine_grained_activation_offloading cannot be enabled with cpu_offloading",
                        "use one of them: set model.fine_grained_activation_offloading=false or drop +mem=cpu_offload"))


@check("cpu_offload_num_layers", enforced_by="megatron-core", oracle='CPU offloading can be done only for layers less than', source=f"{OFFLOAD_SKILL}, Config Parameter Reference; {SURFACE} §1.5 (C:1707-1712)")
def _(view, c):
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


# ----------------------------------------------------------------------------- recompute
@check("recompute_labels", enforced_by="megatron-core", oracle='Invalid choices for recompute_modules', source=f"{RECOMPUTE_SKILL}, Selective Module Decision Table; {SURFACE} §2 (C:1767-1782)")
def _(view, c):
    allowed = recompute_labels()
    bad = [m for m in selective_modules(view) if m not in allowed]
    if bad:
        yield c.problem(view.parties("model.recompute_modules"), "model.recompute_modules", selective_modules(view),
                        f"Invalid choices for recompute_modules: {bad}. The installed megatron-core allows {sorted(allowed)}",
                        f"use labels from that list, e.g. mem.selective_recompute.modules=[{sorted(allowed)[0]}]")


def _label_requirement(label: str, field: str, what: str):
    def fn(view, c):
        if label in selective_modules(view) and not view.get(field):
            yield c.problem(view.parties("model.recompute_modules", field), "model.recompute_modules", selective_modules(view),
                            f"{label} in recompute_modules is only supported with {what} ({field} is {view.get(field)!r})",
                            f"remove {label} (mem.selective_recompute.modules=auto picks a valid label for this model)")
    return fn


check("recompute_moe_act_needs_grouped_gemm", enforced_by="megatron-core", oracle='moe_act in recompute_modules is only supported with moe_grouped_gemm', source=f"{RECOMPUTE_SKILL}, MoE restrictions; {SURFACE} §2 (C:1784)")(
    _label_requirement("moe_act", "model.moe_grouped_gemm", "moe_grouped_gemm"))
check("recompute_mla_up_proj_needs_mla", enforced_by="megatron-core", oracle='mla_up_proj in recompute_modules is only supported', source=f"{RECOMPUTE_SKILL}, Decision Table; {SURFACE} §2 (C:1789)")(
    _label_requirement("mla_up_proj", "model.multi_latent_attention", "multi-latent attention"))


@check("recompute_gdn_norm_out_needs_gdn", enforced_by="megatron-core", oracle='gdn_norm_out in recompute_modules is only supported', source=f"{SURFACE} §2 (C:1795-1802)")
def _(view, c):
    if "gdn_norm_out" in selective_modules(view) and view.get("model.experimental_attention_variant") != "gated_delta_net":
        yield c.problem(view.parties("model.recompute_modules"), "model.recompute_modules", selective_modules(view),
                        "gdn_norm_out recompute needs experimental_attention_variant='gated_delta_net'",
                        "remove gdn_norm_out from mem.selective_recompute.modules")


@check("recompute_fp8_delayed", enforced_by="megatron-core", oracle=('Delayed scaling does not support moe_act and layernorm', 'moe_act and layernorm recompute for fp8 needs'), source=f"{RECOMPUTE_SKILL}, FP8 restrictions; {SURFACE} §2 (C:1821-1833)")
def _(view, c):
    fp8, recipe = fp8_setting(view)
    hit = [m for m in ("moe_act", "layernorm") if m in selective_modules(view)]
    if fp8 and recipe == "delayed" and hit:
        yield c.problem(view.parties("model.recompute_modules", "mixed_precision"), "model.recompute_modules", hit,
                        "Delayed scaling does not support moe_act and layernorm recompute for fp8",
                        "use a current/tensorwise FP8 recipe, or recompute other modules (e.g. core_attn)")


@check("recompute_moe_ep_overlap", enforced_by="bridge", oracle='when enabling overlap_moe_expert_parallel_comm', source=f"{RECOMPUTE_SKILL}, MoE restrictions; {SURFACE} §2 (C:2689-2699, comm_overlap.py:499-512)")
def _(view, c):
    if not ep_overlap(view):
        return
    g = view.get("model.recompute_granularity")
    if g == "full" or "moe" in selective_modules(view):
        yield c.problem(view.parties("model.recompute_granularity", "comm_overlap.overlap_moe_expert_parallel_comm"),
                        "model.recompute_granularity", g,
                        "disable full recomputation / moe in recompute_modules when enabling overlap_moe_expert_parallel_comm",
                        "keep EP overlap and recompute an inner boundary (moe_act), or disable the overlap")


@check("recompute_shared_experts_overlap", enforced_by="megatron-core", oracle='shared_experts recompute cannot work with', source=f"{RECOMPUTE_SKILL}, MoE restrictions; {SURFACE} §2 (C:1812-1819)")
def _(view, c):
    if ("shared_experts" in selective_modules(view) and view.get("model.moe_shared_expert_overlap")
            and view.get("model.moe_shared_expert_intermediate_size")):
        yield c.problem(view.parties("model.recompute_modules", "model.moe_shared_expert_overlap"), "model.recompute_modules",
                        selective_modules(view), "shared_experts recompute cannot work with --moe-shared-expert-overlap",
                        "remove shared_experts from the modules, or set model.moe_shared_expert_overlap=false")


@check("full_recompute_cuda_graphs", enforced_by="megatron-core", oracle='full recompute is only supported with full iteration CUDA graph', source=f"{RECOMPUTE_SKILL}, CUDA graphs; {SURFACE} §2 (C:2522-2525)")
def _(view, c):
    impl = view.get("model.cuda_graph_impl")
    if view.get("model.recompute_granularity") == "full" and impl not in NO_GRAPHS and impl != "full_iteration":
        yield c.problem(view.parties("model.recompute_granularity", "model.cuda_graph_impl"), "model.cuda_graph_impl", impl,
                        "full recompute is only supported with full iteration CUDA graph",
                        "set model.cuda_graph_impl=full_iteration or none, or use +mem=selective_recompute")


@check("full_recompute_settings", enforced_by="megatron-core", oracle=('recompute_method must be "block" or "uniform"', 'recompute_num_layers must be between'), source=f"{RECOMPUTE_SKILL}, Full-layer recompute; {SURFACE} §1.4 (C:1731-1747)")
def _(view, c):
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


@check("full_recompute_num_layers_range", enforced_by="docs", source=f"{SURFACE} §1.4 (C:1742-1747: the message states the range; only None is checked)")
def _(view, c):
    n = view.get("model.recompute_num_layers")
    if view.get("model.recompute_granularity") == "full" and isinstance(n, int):
        limit = layers_per_pipeline_rank(view)
        if not 1 <= n <= limit:
            yield c.problem(view.parties("model.recompute_num_layers"), "model.recompute_num_layers", n,
                            f"recompute_num_layers must be between 1 and num_layers_per_pipeline_rank: {limit} "
                            "(megatron-core states this range but does not enforce it)",
                            f"use mem.full_recompute.num_layers between 1 and {limit}")


check("distribute_saved_activations_sp", enforced_by="megatron-core", oracle='must be false when sequence parallel is enabled', source=f"{SURFACE} §1.4 (C:1757-1761)")(
    _mutually_exclusive("model.sequence_parallel", "model.distribute_saved_activations",
                        "distribute_saved_activations must be false when sequence parallel is enabled",
                        "set model.distribute_saved_activations=false"))


@check("recompute_mlp_on_moe_layers", enforced_by="docs", source=f"{RECOMPUTE_SKILL}, MoE restrictions ('mlp' is a no-op on MoE layers)")
def _(view, c):
    if "mlp" in selective_modules(view) and all_layers_moe(view):
        yield ("selective_recompute: 'mlp' has no effect on this model: every layer's MLP is MoE "
               "(activation-recompute skill). Use moe_act (grouped GEMM) or moe instead")


@check("recompute_core_attn_with_fused_attention", enforced_by="docs", source=f"{RECOMPUTE_SKILL}, Attention backend")
def _(view, c):
    if "core_attn" in selective_modules(view) and "selective_recompute" in view.selected:
        yield ("note: core_attn: with TE fused or flash attention the saving can be small; compare against "
               "mem.selective_recompute.modules=[] (activation-recompute skill)")


# ----------------------------------------------------------------------------- pipeline layout
@check("vpp_layer_divisibility", enforced_by="docs",
       source=f"{MEM_SKILL}, Code Anchors: VPP config and layer divisibility (megatron-core 0.19.2 runs this check "
              "only for uneven pipeline splits; for even PP it is the skill's rule, enforced by us)")
def _(view, c):
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


@check("world_size_divisible", enforced_by="bridge", oracle='is not divisible by total_model_size', source=f"{SURFACE} §4 (set_data_parallel_size in runtime_config_update)")
def _(view, c):
    if view.world_size is None:
        return
    tp, pp, cp = (view.get(f"model.{k}") or 1 for k in
                  ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"))
    if view.world_size % (tp * pp * cp):
        yield c.problem(("config",), "world_size", view.world_size,
                        f"world size {view.world_size} is not divisible by TP*PP*CP = {tp}*{pp}*{cp} = {tp * pp * cp}",
                        f"use a world size that is a multiple of {tp * pp * cp}, or change the parallel sizes")


@check("sequence_parallel_needs_tp", enforced_by="bridge", oracle='Cannot use sequence parallelism without tensor parallelism', source=f"{SURFACE} §4 (Bridge finalize silently sets sequence_parallel=False when TP<=1)")
def _(view, c):
    if view.get("model.sequence_parallel") and (view.get("model.tensor_model_parallel_size") or 1) <= 1:
        yield (f"sequence_parallel=True with TP=1 is silently turned off by Bridge (set by {view.setter('model.sequence_parallel')}); "
               "set model.tensor_model_parallel_size>=2 for it to take effect")


# ----------------------------------------------------------------------------- LoRA re-gather
REGATHER_SURFACES = ("linear_qkv", "linear_fc1")  # §1.2 fallback #12


def regather_fallbacks(view) -> dict[str, str | None]:
    """target module -> fallback reason (None = will re-gather), in Bridge's order (§1.2 table)."""
    peft = view.get("peft")
    targets = list(getattr(peft, "target_modules", None) or [])
    tp = view.get("model.tensor_model_parallel_size") or 1
    out: dict[str, str | None] = {}
    for target in targets:
        surface = target.split(".")[-1].split("*")[-1] or target
        if surface in ("linear_proj", "linear_fc2"):
            reason = "the adapter is row-parallel"
        elif not effective_sequence_parallel(view):
            reason = ("sequence-parallel communication is disabled" if tp > 1 else "tensor parallel size is one")
        elif tp <= 1:
            reason = "tensor parallel size is one"
        elif view.get("model.cpu_offloading") and view.get("model.cpu_offloading_activations", True):
            reason = "CPU activation offload is enabled"
        elif surface not in REGATHER_SURFACES:
            reason = f"{surface} is not an eligible column-parallel LoRA surface"
        elif view.get("model.cuda_graph_impl") not in NO_GRAPHS:
            reason = "CUDA graphs are enabled"
        elif view.get("model.recompute_granularity") == "full":
            reason = "full-layer activation recompute already covers the adapter"
        elif surface == "linear_fc1" and "mlp" in selective_modules(view):
            reason = "selective MLP recompute already covers linear_fc1"
        else:
            reason = None
        if reason is None and surface == "linear_fc1" and all_layers_moe(view) \
                and not view.get("model.moe_shared_expert_intermediate_size"):
            # shared experts are ordinary column-parallel adapters and do re-gather (utils.py: is_expert)
            reason = "expert adapters use a separate path"
        out[target] = reason
    return out


@check("lora_regather_requires_lora", enforced_by="runtime", source=f"{SURFACE} §1.2 and §4 (LoRA dataclass)")
def _(view, c):
    peft = view.get("peft")
    if view.get("peft.sequence_parallel_input_regather") and type(peft).__name__ != "LoRA":
        yield c.problem(view.parties("peft.sequence_parallel_input_regather"), "peft", type(peft).__name__,
                        "sequence_parallel_input_regather is a LoRA option; this recipe's PEFT is "
                        f"{type(peft).__name__}", "use a LoRA PEFT recipe (peft_scheme='lora')")


@check("lora_regather_eligibility", enforced_by="docs", source=f"{MEM_SKILL}, Compatibility and Constraints; {SURFACE} §1.2 (peft/utils.py:1082-1121)")
def _(view, c):
    if not view.get("peft.sequence_parallel_input_regather") or type(view.get("peft")).__name__ != "LoRA":
        return
    fallbacks = regather_fallbacks(view)
    eligible = [t for t, r in fallbacks.items() if r is None]
    detail = "; ".join(f"{t}: {'re-gathers' if r is None else 'falls back (' + r + ')'}" for t, r in fallbacks.items())
    yield f"note: LoRA input re-gather: {len(eligible)} of {len(fallbacks)} target modules will re-gather — {detail}"
    if not eligible:
        strict = view.params.get("lora_sp_regather", {}).get("strict", False)
        tp = view.get("model.tensor_model_parallel_size") or 1
        fix = ("set model.tensor_model_parallel_size=2 (or more) and model.sequence_parallel=true" if tp <= 1
               else "set model.sequence_parallel=true" if not effective_sequence_parallel(view)
               else "add linear_qkv or linear_fc1 to peft.target_modules, or remove the blocking feature")
        message = (f"no LoRA target module will re-gather, so the setting is a silent no-op in Bridge ({detail})")
        if strict:
            yield c.problem(view.parties("peft.sequence_parallel_input_regather", "model.tensor_model_parallel_size"),
                            "peft.sequence_parallel_input_regather", True, message,
                            f"{fix}; or accept the no-op with mem.lora_sp_regather.strict=false")
        else:
            yield f"lora_sp_regather: {message}; fix: {fix}"


# ----------------------------------------------------------------------------- allocator / NCCL
@check("expandable_segments_nccl_ub", enforced_by="megatron-core", oracle='not supported with nccl_ub',
       source=f"{MEM_SKILL}, Compatibility and Constraints; {SURFACE} §1.1 (C distributed_data_parallel_config.py:256-261, torch<2.11 only)")
def _(view, c):
    from .allocconf import expandable_segments_on
    if not (view.get("ddp.nccl_ub") and expandable_segments_on(view.env)):
        return
    if view.torch_version < (2, 11):
        yield c.problem(view.parties("ddp.nccl_ub") + ("expandable_segments" if "expandable_segments" in view.selected else "config",),
                        "ddp.nccl_ub", True,
                        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is currently not supported with nccl_ub due to "
                        "compatibility issue with torch.cuda.MemPool API",
                        "drop expandable_segments (and remove it from cfg.env_vars/PYTORCH_CUDA_ALLOC_CONF) or set ddp.nccl_ub=false")
    else:
        # Decision: megatron-core lifted this check for torch>=2.11 (the MemPool issue is fixed there); the
        # skill text still calls the pair incompatible. Refusing would be a false "invalid" on the
        # installed torch, so we warn and name the escape hatch instead.
        yield ("expandable_segments + ddp.nccl_ub: NVIDIA's memory-tuning skill lists these as incompatible; "
               "megatron-core only refuses them on torch<2.11 and this torch is newer. If NCCL buffer registration "
               "fails at init, set ddp.nccl_ub=false or drop expandable_segments")


@check("expandable_segments_cuda_graphs", enforced_by="runtime",
       source=f"{MEM_SKILL}, Compatibility and Constraints; {SURFACE} §1.1 (C transformer/cuda_graphs.py:2102-2108)")
def _(view, c):
    impl = view.get("model.cuda_graph_impl")
    on = "expandable_segments:True" in view.env.get("PYTORCH_CUDA_ALLOC_CONF", "")  # MCore: substring test
    if impl not in NO_GRAPHS and on and view.env.get("NCCL_GRAPH_REGISTER", "") != "0":
        yield c.problem(view.parties("model.cuda_graph_impl"), "$NCCL_GRAPH_REGISTER", view.env.get("NCCL_GRAPH_REGISTER"),
                        "Setting NCCL_GRAPH_REGISTER=0 to avoid illegal memory access when using CUDA Graph with "
                        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                        "export NCCL_GRAPH_REGISTER=0 (+mem=expandable_segments sets it when CUDA graphs are on)")


# ----------------------------------------------------------------------------- optimizer
@check("precision_aware_optimizer_needs_dist_opt", enforced_by="megatron-core", oracle='only supported with distributed optimizer', source=f"{SURFACE} §1.7 (C optimizer_config.py:434-436)")
def _(view, c):
    if view.get("optimizer.use_precision_aware_optimizer") and not view.get("optimizer.use_distributed_optimizer"):
        yield c.problem(view.parties("optimizer.use_distributed_optimizer", "optimizer.use_precision_aware_optimizer"),
                        "optimizer.use_distributed_optimizer", False,
                        "--use-precision-aware-optimizer only supported with distributed optimizer "
                        "(Bridge syncs ddp/optimizer flags only after this check)",
                        "add +mem=dist_optimizer (sets optimizer.use_distributed_optimizer=true and the ddp flag)")


@check("dist_optimizer_flags_in_sync", enforced_by="bridge", oracle='Distributed optimizer settings were not in sync', source=f"{SURFACE} §1.7 (config.py:1945-1981)")
def _(view, c):
    a, b = view.get("optimizer.use_distributed_optimizer"), view.get("ddp.use_distributed_optimizer")
    if bool(a) != bool(b):
        yield (f"optimizer.use_distributed_optimizer={a} but ddp.use_distributed_optimizer={b}: Bridge will enable "
               "both after finalize; use +mem=dist_optimizer to make it explicit")


@check("dist_optimizer_needs_dp", enforced_by="docs", source=f"{SURFACE} §5 (estimator: 6 + 12/(DP*CP) bytes per parameter)")
def _(view, c):
    if not view.get("optimizer.use_distributed_optimizer") or view.world_size is None:
        return
    tp, pp = view.get("model.tensor_model_parallel_size") or 1, view.get("model.pipeline_model_parallel_size") or 1
    cp = view.get("model.context_parallel_size") or 1
    dp = view.world_size // max(1, tp * pp * cp)
    if dp * cp <= 1 and "dist_optimizer" in view.selected:
        yield (f"dist_optimizer: data-parallel size is {dp} (world {view.world_size} / TP{tp}*PP{pp}*CP{cp}), so there is "
               "nothing to shard across; it saves no memory at this layout")


@check("optimizer_offload_fraction_range", enforced_by="docs", source=f"{OFFLOAD_SKILL}, Optimizer offloading constraints ({SURFACE} §1.6: not enforced in code)")
def _(view, c):
    if not view.get("optimizer.optimizer_cpu_offload"):
        return
    f = view.get("optimizer.optimizer_offload_fraction")
    if f is None or not 0.0 <= float(f) <= 1.0:
        yield c.problem(view.parties("optimizer.optimizer_offload_fraction"), "optimizer.optimizer_offload_fraction", f,
                        "optimizer_offload_fraction must be in [0.0, 1.0] (documented; megatron-core does not check it)",
                        "use mem.optimizer_offload.fraction between 0 and 1, e.g. 0.5")
    elif float(f) == 0.0:
        yield "optimizer_offload: optimizer_offload_fraction=0 keeps all optimizer state on the GPU (a no-op)"


@check("optimizer_offload_decoupled_weight_decay", enforced_by="runtime", source=f"{SURFACE} §1.6 (C optimizer/__init__.py:508-510, at optimizer build)")
def _(view, c):
    if view.get("optimizer.optimizer_cpu_offload") and view.get("optimizer.decoupled_weight_decay") is False:
        yield c.problem(view.parties("optimizer.optimizer_cpu_offload", "optimizer.decoupled_weight_decay"),
                        "optimizer.decoupled_weight_decay", False,
                        "CPU offloading only supported with decoupled_weight_decay enabled (AdamW mode); megatron-core "
                        "asserts this when it builds the optimizer, after launch",
                        "set optimizer.decoupled_weight_decay=true")


@check("optimizer_offload_dist_opt", enforced_by="docs", source=f"{OFFLOAD_SKILL}, Optimizer offloading constraints ({SURFACE} §8: not enforced)")
def _(view, c):
    if view.get("optimizer.optimizer_cpu_offload") and not view.get("optimizer.use_distributed_optimizer"):
        yield ("optimizer_offload: NVIDIA's cpu-offloading skill says it requires the distributed optimizer; Bridge and "
               "megatron-core do not enforce it. Add +mem=dist_optimizer to stay on the documented path")
