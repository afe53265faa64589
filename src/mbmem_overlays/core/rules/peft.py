"""LoRA: sequence-parallel input re-gather and when Bridge silently falls back from it."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import SimpleNamespace

from .facts import (MEM_SKILL, NO_GRAPHS, SURFACE, all_layers_moe, effective_sequence_parallel, is_lora, is_moe,
                    selective_modules)
from .registry import check

REGATHER_SURFACES = ("linear_qkv", "linear_fc1")  # §1.2 fallback #12
ROW_PARALLEL = ("linear_proj", "linear_fc2", "out_proj")
# What regather_sites looks at (peft/utils.py ParallelLinearAdapter._sequence_parallel_input_regather_eligibility
# reads the same facts off the built adapter).
REGATHER_READS = ("peft", "peft.sequence_parallel_input_regather", "model.tensor_model_parallel_size",
                  "model.sequence_parallel", "model.cpu_offloading", "model.cpu_offloading_activations",
                  "model.cuda_graph_impl", "model.recompute_granularity", "model.recompute_modules",
                  "model.moe_layer_recompute", "model.num_moe_experts", "model.moe_layer_freq",
                  "model.moe_shared_expert_intermediate_size", "model.moe_shared_expert_overlap")


@dataclass(frozen=True)
class AdapterSite:
    """One place a LoRA target is applied, with the attributes Bridge's LoRA transform gives its adapter
    (lora.py LoRA.transform + peft/utils.py get_adapter_attributes_from_linear)."""
    target: str
    where: str                           # "attention", "dense MLP", "shared experts", "routed experts", "layer"
    input_is_parallel: bool              # row-parallel base layer
    is_expert: bool
    disable_sequence_parallel_comm: bool
    checkpointed_by: str | None          # the selective label whose checkpoint runs this module's forward


def adapter_sites(view) -> list[AdapterSite]:
    peft = view.get("peft")
    sp = effective_sequence_parallel(view)
    mods = selective_modules(view)
    moe = is_moe(view)
    dense_mlp = not all_layers_moe(view)
    shared = moe and bool(view.get("model.moe_shared_expert_intermediate_size"))
    shared_overlap = shared and bool(view.get("model.moe_shared_expert_overlap"))
    # MoELayer wraps its forward in tensor_parallel.checkpoint for 'moe' (not under local CUDA graphs, where the
    # layer does it) and the shared experts for 'shared_experts' unless they overlap (moe_layer.py:246-253, 508-521).
    moe_ckpt = "moe" if "moe" in mods and view.get("model.cuda_graph_impl") != "local" else None
    shared_ckpt = moe_ckpt or ("shared_experts" if "shared_experts" in mods and not shared_overlap else None)
    sites: list[AdapterSite] = []
    for target in list(getattr(peft, "target_modules", None) or []):
        surface = target.split(".")[-1].split("*")[-1] or target
        row = surface in ROW_PARALLEL
        if surface in ("linear_qkv", "linear_proj"):
            places = [("attention", False, not sp, None)]
        elif surface in ("linear_fc1", "linear_fc2"):
            places = [("dense MLP", False, not sp, "mlp" if "mlp" in mods else None)] if dense_mlp else []
            if shared:
                # shared_experts.py sets parallel_mode=None on the base linears under moe_shared_expert_overlap,
                # which makes Bridge disable the adapter's sequence-parallel communication (utils.py:557-564).
                places.append(("shared experts", False, not sp or shared_overlap, shared_ckpt))
            if moe:
                places.append(("routed experts", True, not sp, moe_ckpt))
        else:
            places = [("layer", False, not sp, None)]
        sites += [AdapterSite(target, where, row, expert, no_sp_comm, ckpt)
                  for where, expert, no_sp_comm, ckpt in places]
    return sites


def site_fallback(view, site: AdapterSite) -> str | None:
    """Why Bridge will not re-gather at this site (None: it will). Bridge's own eligibility function decides when
    Bridge is loaded (it always is when a real config is checked); the mirror below follows it line by line."""
    if site.input_is_parallel:
        return "the adapter is row-parallel"  # decided the same whichever check runs first; the clearest reason
    if site.checkpointed_by:
        # is_checkpointing() is True inside tensor_parallel.checkpoint: eligibility returns (False, None) with no log
        return (f"its forward runs inside the '{site.checkpointed_by}' recompute checkpoint, where Bridge skips "
                "re-gather without a log line")
    ok, reason = _bridge_eligibility(view, site) or mirror_eligibility(view, site)
    return None if ok else reason


def mirror_eligibility(view, site: AdapterSite) -> tuple[bool, str | None]:
    """The same decisions as Bridge's eligibility function, in its order, for hosts where Bridge is not loaded
    (tests/test_rules_oracle.py checks the two agree on every LoRA recipe)."""
    tp = view.get("model.tensor_model_parallel_size") or 1
    surface = site.target.split(".")[-1].split("*")[-1] or site.target
    if site.input_is_parallel:
        return False, "the adapter is row-parallel"
    if site.disable_sequence_parallel_comm:
        return False, "sequence-parallel communication is disabled"
    if tp <= 1:
        return False, "tensor parallel size is one"
    if site.is_expert:
        return False, "expert adapters use a separate path"
    if getattr(view.get("peft"), "a2a_experimental", False):
        return False, "all-to-all adapters use a separate path"
    if view.get("model.cpu_offloading") and view.get("model.cpu_offloading_activations", True):
        return False, "CPU activation offload is enabled"
    if surface not in REGATHER_SURFACES:
        return False, f"{surface} is not an eligible column-parallel LoRA surface"
    if view.get("model.cuda_graph_impl") not in NO_GRAPHS:
        return False, "CUDA graphs are enabled"
    if view.get("model.recompute_granularity") == "full":
        return False, "full-layer activation recompute already covers the adapter"
    if surface == "linear_fc1" and "mlp" in selective_modules(view):
        return False, "selective MLP recompute already covers linear_fc1"
    return True, None


def _bridge_eligibility(view, site: AdapterSite) -> tuple[bool, str | None] | None:
    """Bridge's ParallelLinearAdapter._sequence_parallel_input_regather_eligibility on an adapter carrying this
    site's attributes and the prospective config (None when Bridge is not loaded)."""
    utils, nn = sys.modules.get("megatron.bridge.peft.utils"), sys.modules.get("torch.nn")
    adapter_cls = getattr(utils, "ParallelLinearAdapter", None)
    if adapter_cls is None or nn is None:
        return None
    config = SimpleNamespace(
        tensor_model_parallel_size=view.get("model.tensor_model_parallel_size") or 1,
        cpu_offloading=view.get("model.cpu_offloading"), cpu_offloading_activations=view.get(
            "model.cpu_offloading_activations", True), cuda_graph_impl=view.get("model.cuda_graph_impl"),
        recompute_granularity=view.get("model.recompute_granularity"), recompute_modules=selective_modules(view))
    adapter = SimpleNamespace(
        sequence_parallel_input_regather=True, training=True,
        linear_in=SimpleNamespace(weight=SimpleNamespace(requires_grad=True)),
        input_is_parallel=site.input_is_parallel, disable_sequence_parallel_comm=site.disable_sequence_parallel_comm,
        tp_group=None, config=config, is_expert=site.is_expert,
        use_a2a=bool(getattr(view.get("peft"), "a2a_experimental", False)),
        activation=nn.Identity(), base_linear_name=site.target)  # LoRA always builds identity-activation adapters
    try:
        return adapter_cls._sequence_parallel_input_regather_eligibility(adapter, None)
    except Exception:  # noqa: BLE001 — an internal change in Bridge: fall back to the mirror
        return None


def regather_report(view) -> list[tuple[AdapterSite, str | None]]:
    return [(site, site_fallback(view, site)) for site in adapter_sites(view)]


def regather_fallbacks(view) -> dict[str, str | None]:
    """target module -> fallback reason (None: re-gathers at some non-expert site)."""
    out: dict[str, str | None] = {}
    for site, reason in regather_report(view):
        if site.target not in out or reason is None:
            out[site.target] = reason
    return out


def _describe(target: str, sites: list[tuple[AdapterSite, str | None]]) -> str:
    """``linear_fc1: re-gathers (shared experts); falls back on routed experts (expert adapters use ...)``."""
    reasons = {reason for _, reason in sites}
    if len(reasons) == 1:
        reason = reasons.pop()
        return f"{target}: re-gathers" if reason is None else f"{target}: falls back ({reason})"
    good = ", ".join(site.where for site, reason in sites if reason is None)
    bad = "; ".join(f"falls back on {site.where} ({reason})" for site, reason in sites if reason is not None)
    return f"{target}: re-gathers ({good}); {bad}" if good else f"{target}: {bad}"


@check(enforced_by="runtime", source=f"{SURFACE} §1.2 and §4 (LoRA dataclass)",
       reads=("peft", "peft.sequence_parallel_input_regather"))
def lora_regather_requires_lora(view, c):
    """LoRA input re-gather needs a LoRA PEFT config."""
    peft = view.get("peft")
    if view.get("peft.sequence_parallel_input_regather") and not is_lora(peft):
        yield c.problem(view.parties("peft.sequence_parallel_input_regather"), "peft", type(peft).__name__,
                        "sequence_parallel_input_regather is a LoRA option; this recipe's PEFT is "
                        f"{type(peft).__name__}", "use a LoRA PEFT recipe (peft_scheme='lora')")


@check(enforced_by="docs", source=f"{MEM_SKILL}, Compatibility and Constraints; {SURFACE} §1.2 (peft/utils.py:1082-1121)",
       reads=REGATHER_READS)
def lora_regather_eligibility(view, c):
    """Which LoRA adapters really re-gather; strict refuses a config where none does."""
    if not view.get("peft.sequence_parallel_input_regather") or not is_lora(view.get("peft")):
        return
    report = regather_report(view)
    fallbacks = regather_fallbacks(view)
    eligible = [t for t, reason in fallbacks.items() if reason is None]
    detail = "; ".join(_describe(target, [(site, reason) for site, reason in report if site.target == target])
                       for target in fallbacks)
    yield f"note: LoRA input re-gather: {len(eligible)} of {len(fallbacks)} target modules will re-gather — {detail}"
    if not eligible:
        strict = view.params.get("lora_sp_regather", {}).get("strict", False)
        tp = view.get("model.tensor_model_parallel_size") or 1
        fix = ("set model.tensor_model_parallel_size=2 (or more) and model.sequence_parallel=true" if tp <= 1
               else "set model.sequence_parallel=true" if not effective_sequence_parallel(view)
               else "add linear_qkv or linear_fc1 to peft.target_modules, or remove the blocking feature")
        message = f"no LoRA adapter will re-gather, so the setting is a silent no-op in Bridge ({detail})"
        if strict:
            yield c.problem(view.parties("peft.sequence_parallel_input_regather", "model.tensor_model_parallel_size"),
                            "peft.sequence_parallel_input_regather", True, message,
                            f"{fix}; or accept the no-op with mem.lora_sp_regather.strict=false")
        else:
            yield f"lora_sp_regather: {message}; fix: {fix}"
