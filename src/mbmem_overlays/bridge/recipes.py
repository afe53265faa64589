"""Real Bridge ``ConfigContainer``s from recipe functions (offline), and facts read off them."""

from __future__ import annotations

import difflib
import importlib
import os
import re
from typing import Any

from ..core.catalog import recipe_file
from ..core.errors import OverlayError, Problem
from ..core.paths import read
from . import hf_offline
from .overrides import apply_overrides
from .stack import prepare

RECIPE_PACKAGE = "megatron.bridge.recipes"


def _recipe_function(name: str):
    prepare()
    if "." in name:
        module_name, _, attr = name.rpartition(".")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError):
            pass
    recipes = importlib.import_module(RECIPE_PACKAGE)
    for candidate in (name, f"{name}_config"):
        fn = getattr(recipes, candidate, None)
        if callable(fn):
            return fn
    known = sorted(n for n in dir(recipes) if n.endswith("_config"))
    close = difflib.get_close_matches(name if name.endswith("_config") else f"{name}_config", known, n=3)
    raise OverlayError([Problem(
        ("recipe",), "recipe", name, f"no Bridge recipe function named {name!r} in {RECIPE_PACKAGE}"
        + (f"; did you mean {', '.join(close)}?" if close else ""),
        "pass a recipe function such as llama3_8b_pretrain_config or a dotted path "
        "(megatron.bridge.recipes.llama.llama3_8b_peft_config); `mbmem recipes` lists them")])


def build_recipe(name: str, kwargs: dict[str, Any] | None = None):
    """Build a real ConfigContainer from a Bridge recipe function (offline)."""
    fn = _recipe_function(name)
    try:
        return fn(**(kwargs or {}))
    except OverlayError:
        raise
    except Exception as exc:  # recipes fail offline with "Failed to load configuration from <id>"
        text = str(exc)
        hub_id = _hub_id_from_error(text)
        if hub_id:
            raise OverlayError([Problem(
                ("recipe",), "recipe", name,
                f"recipe {name} needs the Hugging Face config of {hub_id}, which is not available offline "
                f"({type(exc).__name__}: {text.splitlines()[0][:200]})",
                f"provide its config.json (architecture numbers only) at {hf_offline.expected_path(hub_id)}, "
                f"or put <org>--<name>/config.json under a directory listed in {hf_offline.USER_DIRS_ENV}")]) from None
        raise OverlayError([Problem(("recipe",), "recipe", name,
                                    f"recipe {name} failed to build: {type(exc).__name__}: {text[:400]}",
                                    "check the recipe arguments (recipe.kwargs / --recipe-arg)")]) from None


def build_from_spec(spec: dict[str, Any]):
    """A recipe config as in recipes/recipe/*.yaml: {function, kwargs, overrides (reshaping the base recipe)}."""
    if not spec.get("function"):
        raise OverlayError([Problem(("recipe",), "recipe.function", None, "no recipe selected",
                                    "add recipe=<name> (see recipes/recipe/) or recipe.function=<Bridge recipe function>")])
    cfg = build_recipe(spec["function"], spec.get("kwargs") or {})
    if spec.get("overrides"):
        apply_overrides(cfg, dict(spec["overrides"]))
    return cfg


def load_recipe(name: str):
    """A recipes/recipe/<name>.yaml config or a Bridge recipe function name."""
    import yaml
    path = recipe_file(name)
    return build_recipe(name) if path is None else build_from_spec(yaml.safe_load(path.read_text()) or {})


def _hub_id_from_error(text: str) -> str | None:
    m = re.search(r"(?:from|for|load(?:ing)?)\s+['\"]?([\w.-]+/[\w.-]+)", text)
    if m and ("offline" in text.lower() or "Failed to load" in text or "not found" in text.lower()
              or "couldn't" in text.lower() or "cannot find" in text.lower()):
        return m.group(1).rstrip(".'\"")
    return None


def world_size_for(cfg: Any, given: int | None) -> tuple[int, bool]:
    """(world size, assumed?): the given one, else WORLD_SIZE, else the smallest the layout allows (TP*PP*CP)."""
    if given:
        return int(given), False
    if os.environ.get("WORLD_SIZE"):
        return int(os.environ["WORLD_SIZE"]), False
    m = cfg.model
    return (m.tensor_model_parallel_size or 1) * (m.pipeline_model_parallel_size or 1) * (m.context_parallel_size or 1), True


def recipe_kind(cfg: Any) -> str:
    """'finetune' when the recipe fine-tunes (PEFT or a pretrained checkpoint), else 'pretrain'."""
    if read(cfg, "peft", None) is not None or read(cfg, "checkpoint.pretrained_checkpoint", None):
        return "finetune"
    return "pretrain"


def model_summary(cfg: Any) -> dict[str, Any]:
    m = cfg.model
    keys = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "seq_length",
            "tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
            "context_parallel_size", "expert_model_parallel_size", "sequence_parallel", "num_moe_experts",
            "recompute_granularity", "recompute_modules", "cpu_offloading", "cuda_graph_impl")
    out = {k: getattr(m, k, None) for k in keys}
    out.update(micro_batch_size=cfg.train.micro_batch_size, global_batch_size=cfg.train.global_batch_size,
               use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
               peft=type(cfg.peft).__name__ if cfg.peft is not None else None)
    return out
