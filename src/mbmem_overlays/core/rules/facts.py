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
    """The selective recompute labels after megatron-core's finalize: None becomes ["core_attn"] (C:1763),
    and the deprecated ``moe_layer_recompute`` turns selective recompute on and adds "moe" (C:1835-1846)."""
    granularity = view.get("model.recompute_granularity")
    legacy_moe = bool(view.get("model.moe_layer_recompute")) and granularity != "full"
    if granularity != "selective" and not legacy_moe:
        return []
    mods = view.get("model.recompute_modules")
    mods = ["core_attn"] if mods is None else list(mods)
    return mods + ["moe"] if legacy_moe and "moe" not in mods else mods


SELECTIVE_READS = ("model.recompute_granularity", "model.recompute_modules", "model.moe_layer_recompute")


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


def effective_ep_overlap(view) -> bool:
    """Whether MoE expert-parallel comm overlap is on after Bridge's comm-overlap setup.

    With a ``cfg.comm_overlap`` config, Bridge overwrites ``model.overlap_moe_expert_parallel_comm`` with the
    comm-overlap value (None counts as False: comm_overlap.py ``_get_model_comm_overlap_cfgs`` defaults it to
    False, ``_override_user_cfgs`` keeps a user's non-None value, ``setup`` copies both onto the model);
    without one, the model field stands (runtime_config_update, config.py:1883-1885)."""
    if view.get("comm_overlap") is not None:
        return view.get("comm_overlap.overlap_moe_expert_parallel_comm") is True
    return bool(view.get("model.overlap_moe_expert_parallel_comm"))


EP_OVERLAP_READS = ("comm_overlap", "comm_overlap.overlap_moe_expert_parallel_comm",
                    "model.overlap_moe_expert_parallel_comm")


def graph_modules(view) -> list[str]:
    """The per-layer CUDA graph capture scopes megatron-core will use, by name ([] = the whole layer).

    Mirrors TransformerConfig.__post_init__ (transformer_config.py:2383-2440) and
    cuda_graph_config.normalize_cuda_graph_modules: the deprecated ``cuda_graph_scope`` wins when set;
    "full" (the default) and an empty value mean whole-layer capture; a comma string is split; enum members
    count by name; the local implementation adds moe_preprocess with moe_router and vice versa (:2473-2480)."""
    scopes = view.get("model.cuda_graph_scope")
    raw = scopes if scopes is not None else view.get("model.cuda_graph_modules")
    if raw is None:
        items: list = []
    elif isinstance(raw, (list, tuple)):
        items = list(raw)
    elif isinstance(raw, str):
        items = raw.split(",") if raw else []
    else:
        items = [raw]
    names = [str(getattr(item, "name", item)) for item in items]
    if names == ["full"]:
        return []
    names = [n for n in names if n in GRAPH_MODULE_NAMES]
    if view.get("model.cuda_graph_impl") == "local" and {"moe_router", "moe_preprocess"} & set(names):
        names += [n for n in ("moe_router", "moe_preprocess") if n not in names]
    return names


GRAPH_MODULE_NAMES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba")  # enums.py CudaGraphModule
GRAPH_READS = ("model.cuda_graph_impl", "model.cuda_graph_scope", "model.cuda_graph_modules")


def per_layer_graphs(view) -> bool:
    return view.get("model.cuda_graph_impl") in ("local", "transformer_engine")


def is_lora(peft) -> bool:
    """``isinstance(peft, megatron.bridge.peft.lora.LoRA)`` without importing Bridge (subclasses such as
    VLMLoRA count)."""
    return any(k.__name__ == "LoRA" and k.__module__.startswith("megatron.bridge.peft") for k in type(peft).__mro__)


def data_parallel_size(view) -> int | None:
    """world / (TP*PP*CP), as Bridge's set_data_parallel_size computes it; None without a world size."""
    if view.world_size is None:
        return None
    tp, pp, cp = (view.get(f"model.{k}") or 1 for k in
                  ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"))
    return view.world_size // (tp * pp * cp) if view.world_size % (tp * pp * cp) == 0 else None
