"""Facts several rules (and the memory model) derive from the prospective config, and the sources they cite."""

from __future__ import annotations

import importlib.util
import re
import sys
from functools import lru_cache
from pathlib import Path

MEM_SKILL = "nvidia-skills/nemo-mbridge-perf-memory-tuning.SKILL.md"
RECOMPUTE_SKILL = "nvidia-skills/nemo-mbridge-perf-activation-recompute.SKILL.md"
OFFLOAD_SKILL = "nvidia-skills/nemo-mbridge-perf-cpu-offloading.SKILL.md"
SURFACE = "bridge-config-surface.md"

NO_GRAPHS = (None, "none")


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
