"""LoRA: sequence-parallel input re-gather and when Bridge silently falls back from it."""

from __future__ import annotations

from .facts import MEM_SKILL, NO_GRAPHS, SURFACE, all_layers_moe, effective_sequence_parallel, selective_modules
from .registry import check

REGATHER_SURFACES = ("linear_qkv", "linear_fc1")  # §1.2 fallback #12
# What regather_fallbacks looks at (peft/utils.py:1082-1121 reads the same facts).
REGATHER_READS = ("peft", "peft.sequence_parallel_input_regather", "model.tensor_model_parallel_size",
                  "model.sequence_parallel", "model.cpu_offloading", "model.cpu_offloading_activations",
                  "model.cuda_graph_impl", "model.recompute_granularity", "model.recompute_modules",
                  "model.num_moe_experts", "model.moe_layer_freq", "model.moe_shared_expert_intermediate_size")


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


@check(enforced_by="runtime", source=f"{SURFACE} §1.2 and §4 (LoRA dataclass)",
       reads=("peft", "peft.sequence_parallel_input_regather"))
def lora_regather_requires_lora(view, c):
    peft = view.get("peft")
    if view.get("peft.sequence_parallel_input_regather") and type(peft).__name__ != "LoRA":
        yield c.problem(view.parties("peft.sequence_parallel_input_regather"), "peft", type(peft).__name__,
                        "sequence_parallel_input_regather is a LoRA option; this recipe's PEFT is "
                        f"{type(peft).__name__}", "use a LoRA PEFT recipe (peft_scheme='lora')")


@check(enforced_by="docs", source=f"{MEM_SKILL}, Compatibility and Constraints; {SURFACE} §1.2 (peft/utils.py:1082-1121)",
       reads=REGATHER_READS)
def lora_regather_eligibility(view, c):
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
