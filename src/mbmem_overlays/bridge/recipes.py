"""Real Bridge ``ConfigContainer``s from recipe functions (offline), and facts read off them.

Only recipe functions run: a name is checked against the allowed modules *before* anything is imported
or called (issue 15 #3: ``os.system``, ``builtins.exit`` and ``os.getcwd`` were accepted), the object
found must be a plain function defined in an allowed module, and what it returns must be a
``ConfigContainer``. Allowed are ``megatron.bridge.recipes`` and the modules the user lists in
``MBMEM_RECIPE_MODULES`` (comma-separated), an explicit opt-in for one's own recipe functions.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

from ..core.catalog import data_dir, recipe_file, recipe_spec
from ..core.errors import OverlayError, Problem
from ..core.paths import read
from ..core.values import MAX_WORLD_SIZE, parse_count
from . import hf_offline
from .build_stand_ins import PLATFORM_GPUS, recipe_build_stand_ins
from .overrides import apply_overrides
from .stack import prepare

RECIPE_PACKAGE = "megatron.bridge.recipes"
# Bridge ships its performance-harness recipes (the configurations NVIDIA measured) in a sibling package.
BRIDGE_RECIPE_PACKAGES = (RECIPE_PACKAGE, "megatron.bridge.perf_recipes")
RECIPE_MODULES_ENV = "MBMEM_RECIPE_MODULES"
_DOTTED = re.compile(r"[A-Za-z][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def allowed_modules() -> list[str]:
    """Bridge's recipe packages plus the modules named in ``MBMEM_RECIPE_MODULES``."""
    extra = [m.strip() for m in os.environ.get(RECIPE_MODULES_ENV, "").split(",") if m.strip()]
    return [*BRIDGE_RECIPE_PACKAGES, *extra]


def _within(module: str, allowed: list[str]) -> bool:
    return any(module == a or module.startswith(a + ".") for a in allowed)


def shipped_recipes() -> list[str]:
    """train.py's recipe configs (recipes/recipe/*.yaml), without importing anything."""
    return sorted(p.stem for p in (data_dir("recipes") / "recipe").glob("*.yaml"))


def _recipe_problem(name: Any, message: str) -> Problem:
    return Problem(("recipe",), "recipe", name, message,
                   f"pass a Bridge recipe function such as llama3_8b_pretrain_config, a dotted path under "
                   f"{RECIPE_PACKAGE} (megatron.bridge.recipes.llama.llama3_8b_peft_config), or one of train.py's "
                   f"recipes ({', '.join(shipped_recipes())}); to allow your own module, add it to "
                   f"{RECIPE_MODULES_ENV}", check="recipe")


def recipe_name_problem(name: Any) -> Problem | None:
    """Why ``name`` may not be used as a recipe function, decided from the text alone (nothing imported): its
    form, the allowed modules, and, where Bridge's sources are installed, whether any Bridge recipe module
    defines a function of that name (so a typo fails here, not after the Bridge import or on the cluster)."""
    if not isinstance(name, str) or not _DOTTED.fullmatch(name) or "__" in name:
        return _recipe_problem(name, f"{name!r} is not a recipe function name")
    if name.rpartition(".")[2].startswith("_"):
        return _recipe_problem(name, f"{name!r} is private, not a recipe function")
    if "." in name and not _within(name.rpartition(".")[0], allowed_modules()):
        return _recipe_problem(name, f"{name!r} is outside the recipe modules ({', '.join(allowed_modules())}); "
                                     "only recipe functions are run")
    if "." in name and not _within(name.rpartition(".")[0], list(BRIDGE_RECIPE_PACKAGES)):
        return None   # the user's own module (MBMEM_RECIPE_MODULES): only importing it can tell
    defined = bridge_recipe_functions()
    leaf = name.rpartition(".")[2]
    if defined is None or name in shipped_recipes() or leaf in defined or ("." not in name and f"{leaf}_config" in defined):
        return None
    known = sorted({*(n for n in defined if n.endswith("_config")), *shipped_recipes()})
    close = difflib.get_close_matches(leaf, known, n=3) or difflib.get_close_matches(f"{leaf}_config", known, n=3)
    return _recipe_problem(name, f"no Bridge recipe function or train.py recipe named {name!r}"
                                 + (f"; did you mean {', '.join(close)}?" if close else ""))


# What a recipe module can make importable under a name: a def, an assignment, an "import x as name" re-export,
# an __all__ entry. A superset of the recipe functions is enough: the check only refuses names defined nowhere.
_DEF = re.compile(r"^(?:def ([A-Za-z]\w*)\(|([A-Za-z]\w*)\s*=)|\bas ([A-Za-z]\w*)|[\"']([A-Za-z]\w*)[\"']", re.M)
_recipe_defs: dict[tuple[str, ...], frozenset[str] | None] = {}


def bridge_recipe_functions() -> frozenset[str] | None:
    """Every public name Bridge's recipe packages could export (a superset of their recipe functions, _DEF), read
    from their installed source text (about 0.1 s, nothing imported: ``import megatron.bridge`` takes 20-30 s);
    None when the sources are not on sys.path or the reading misses a recipe train.py ships."""
    key = tuple(sys.path)
    if key not in _recipe_defs:
        roots = [Path(entry, *package.split(".")) for package in BRIDGE_RECIPE_PACKAGES for entry in sys.path if entry]
        found = [r for r in roots if r.is_dir()]
        names: set[str] = set()
        for root in found:
            for py in sorted(root.rglob("*.py"))[:5000]:
                try:
                    text = py.read_text(encoding="utf-8", errors="replace")[:2_000_000]
                    names.update(n for groups in _DEF.findall(text) for n in groups if n)
                except OSError:
                    continue
        defined = frozenset(n for n in names if not n.startswith("_"))
        # Self-check: a Bridge whose recipes this reading cannot see (made at import time, another layout) must
        # never refuse a real recipe, so the scan is trusted only when it finds every function train.py ships.
        shipped = {str(recipe_spec(recipe_file(r)).get("function", "")).rpartition(".")[2] for r in shipped_recipes()}
        _recipe_defs[key] = defined if found and shipped <= defined else None
    return _recipe_defs[key]


def _recipe_function(name: str):
    problem = recipe_name_problem(name)
    if problem:
        raise OverlayError([problem])
    prepare()
    fn = None
    if "." in name:
        module_name, _, attr = name.rpartition(".")
        try:
            fn = getattr(importlib.import_module(module_name), attr, None)
        except ImportError:
            fn = None
    else:
        recipes = importlib.import_module(RECIPE_PACKAGE)
        fn = next((getattr(recipes, c) for c in (name, f"{name}_config") if callable(getattr(recipes, c, None))), None)
    if fn is None:
        recipes = importlib.import_module(RECIPE_PACKAGE)
        known = sorted(n for n in dir(recipes) if n.endswith("_config"))
        leaf = name.rpartition(".")[2]
        close = difflib.get_close_matches(leaf if leaf.endswith("_config") else f"{leaf}_config", known, n=3)
        raise OverlayError([_recipe_problem(name, f"no Bridge recipe function named {name!r}"
                                            + (f"; did you mean {', '.join(close)}?" if close else ""))])
    # A re-exported helper (os.getcwd imported into a recipe module) is not a recipe: check where it is defined.
    if not inspect.isfunction(fn) or not _within(getattr(fn, "__module__", "") or "", allowed_modules()):
        raise OverlayError([_recipe_problem(name, f"{name!r} is {type(fn).__name__} "
                                            f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}, "
                                            "not a recipe function of the recipe modules")])
    return fn


def build_recipe(name: str, kwargs: dict[str, Any] | None = None):
    """Build a real ConfigContainer from a Bridge recipe function (offline)."""
    fn = _recipe_function(name)
    if kwargs is not None and not isinstance(kwargs, dict):
        raise OverlayError([_recipe_problem(name, f"recipe.kwargs must be a mapping, got {kwargs!r}")])
    try:
        with recipe_build_stand_ins(platform_of_recipe_function(fn)) as notes:
            cfg = fn(**(kwargs or {}))
    except OverlayError:
        raise
    except Exception as exc:  # noqa: BLE001  recipes fail offline with "Failed to load configuration from <id>"
        text = str(exc)
        hub_id = _hub_id_from_error(text)
        if hub_id:
            raise OverlayError([Problem(
                ("recipe",), "recipe", name,
                f"recipe {name} needs the Hugging Face config of {hub_id}, which is not available offline "
                f"({type(exc).__name__}: {text.splitlines()[0][:200] if text else ''})",
                f"provide its config.json (architecture numbers only) at {hf_offline.expected_path(hub_id)}, "
                f"or put <org>--<name>/config.json under a directory listed in {hf_offline.USER_DIRS_ENV}")]) from None
        raise OverlayError([Problem(("recipe",), "recipe", name,
                                    f"recipe {name} failed to build: {type(exc).__name__}: {text[:400]}",
                                    "check the recipe arguments (recipe.kwargs in train.py)")]) from None
    from megatron.bridge.training.config import ConfigContainer
    if not isinstance(cfg, ConfigContainer):
        raise OverlayError([_recipe_problem(name, f"{name} returned {type(cfg).__name__}, not a ConfigContainer")])
    if notes and getattr(cfg, "model", None) is not None:
        # kept on the model provider, not a dataclass field (Bridge's serialisation reads fields), which copy.deepcopy
        # carries (models/transformer_config.py:191-208 copies its __dict__; ConfigContainer's own __deepcopy__ copies
        # fields only, megatron/training/config/container.py:229-238), for the plan's assumptions (build_notes)
        object.__setattr__(cfg.model, BUILD_NOTES_ATTR, tuple(notes))
    return cfg


BUILD_NOTES_ATTR = "_mbmem_build_notes"


def build_notes(cfg: Any) -> tuple[str, ...]:
    """What answered for the host while the recipe built (bridge/build_stand_ins.py): one sentence each, for the
    plan's assumptions; () for a config that needed none."""
    notes = getattr(getattr(cfg, "model", None), BUILD_NOTES_ATTR, ())
    return tuple(n for n in notes if isinstance(n, str)) if isinstance(notes, tuple) else ()


def platform_of_recipe_function(fn: Any) -> str | None:
    """The platform a recipe function is named for (``named_platform`` on its name and defining module), or None."""
    found = named_platform(str(getattr(fn, "__name__", "")), str(getattr(fn, "__module__", "") or ""))
    return found[0] if found else None


def spec_problems(spec: Any) -> list[Problem]:
    """A recipes/recipe/*.yaml node ({function, kwargs, overrides}) checked without importing Bridge."""
    if not isinstance(spec, dict) or not spec.get("function"):
        shipped = ", ".join(f"recipe={n}" for n in shipped_recipes())
        return [Problem(("recipe",), "recipe", None, "no recipe selected (train.py has no default recipe)",
                        f"add one of: {shipped}; or recipe.function=<Bridge recipe function>; "
                        "for LoRA overlays (lora_sp_regather) pick a *_peft recipe", check="recipe")]
    problems = [p for p in [recipe_name_problem(spec["function"])] if p]
    for key in ("kwargs", "overrides"):
        if spec.get(key) is not None and not isinstance(spec.get(key), dict):
            problems.append(_recipe_problem(spec.get(key), f"recipe.{key} must be a mapping, got {spec.get(key)!r}"))
    return problems


def build_from_spec(spec: dict[str, Any]):
    """A recipe config as in recipes/recipe/*.yaml: {function, kwargs, overrides (reshaping the base recipe)}."""
    problems = spec_problems(spec)
    if problems:
        raise OverlayError(problems)
    cfg = build_recipe(spec["function"], spec.get("kwargs") or {})
    if spec.get("overrides"):
        apply_overrides(cfg, dict(spec["overrides"]))
    return cfg


def load_recipe(name: str):
    """A recipes/recipe/<name>.yaml config or a Bridge recipe function name."""
    path = recipe_file(name)
    return build_recipe(name) if path is None else build_from_spec(recipe_spec(path))


def recipe_function_name(name: str) -> str:
    """The Bridge function behind a train.py recipe name (its YAML's ``function``), else the name itself."""
    path = recipe_file(name) if isinstance(name, str) else None
    if path is None:
        return name
    return str(recipe_spec(path).get("function") or name)


def _hub_id_from_error(text: str) -> str | None:
    m = re.search(r"(?:from|for|load(?:ing)?)\s+['\"]?([\w.-]+/[\w.-]+)", text)
    if m and ("offline" in text.lower() or "Failed to load" in text or "not found" in text.lower()
              or "couldn't" in text.lower() or "cannot find" in text.lower()):
        return m.group(1).rstrip(".'\"")
    return None


def world_size_problem(value: Any, where: str) -> Problem | None:
    """A world size must be a whole number from 1 to MAX_WORLD_SIZE (issue 15 #12: 0 and negatives were planned
    as fitting; issue 22 #3: 10^21 failed after the Bridge import, and 4,301 digits raised a traceback)."""
    _, why = parse_count(value, maximum=MAX_WORLD_SIZE)
    if why is None:
        return None
    return Problem(("run",), where, value, f"world size must be a positive integer (number of GPUs) of at most "
                   f"{MAX_WORLD_SIZE} (2^20): {why.rpartition(', ')[2]}",
                   f"give the number of GPUs, e.g. {where}=8", check="world_size")


def world_size_for(cfg: Any, given: int | None) -> tuple[int, bool]:
    """(world size, assumed?): the given one, else WORLD_SIZE, else the smallest the layout allows (TP*PP*CP)."""
    if given is not None:
        problem = world_size_problem(given, "world_size")
        if problem:
            raise OverlayError([problem])
        return int(given), False
    if os.environ.get("WORLD_SIZE"):
        problem = world_size_problem(os.environ["WORLD_SIZE"], "WORLD_SIZE")
        if problem:
            raise OverlayError([problem])
        return int(os.environ["WORLD_SIZE"]), False
    m = cfg.model
    return (m.tensor_model_parallel_size or 1) * (m.pipeline_model_parallel_size or 1) * (m.context_parallel_size or 1), True


def training_mode(function: str | None, cfg: Any) -> tuple[str, str]:
    """('pretrain' | 'finetune', why) as Bridge chooses it.

    Bridge's generic launcher (scripts/training/run_recipe.py, ``infer_train_mode``) reads the recipe
    name: "pretrain" means pretrain(), "finetune"/"sft"/"peft" mean finetune(). Where the name says
    neither (or both), the config decides: a PEFT config or a pretrained checkpoint needs finetune(),
    which loads it (training/finetune.py:50)."""
    leaf = (function or "").rpartition(".")[2].lower()
    has_pretrain = "pretrain" in leaf
    has_finetune = any(word in leaf for word in ("finetune", "sft", "peft"))
    if has_pretrain != has_finetune:
        mode = "pretrain" if has_pretrain else "finetune"
        return mode, f"the recipe name {leaf!r}, as Bridge's scripts/training/run_recipe.py decides"
    if read(cfg, "peft", None) is not None:
        return "finetune", "the config has PEFT (the recipe name does not say)"
    if read(cfg, "checkpoint.pretrained_checkpoint", None):
        return "finetune", "the config loads a pretrained checkpoint (the recipe name does not say)"
    return "pretrain", "neither the recipe name nor the config asks for fine-tuning"


def recipe_kind(cfg: Any, function: str | None = None) -> str:
    """'finetune' or 'pretrain' (see ``training_mode``)."""
    return training_mode(function, cfg)[0]


def finetune_requirement(cfg: Any) -> str | None:
    """finetune() asserts a checkpoint to start from (training/finetune.py:50); None when one is set."""
    if read(cfg, "checkpoint.pretrained_checkpoint", None) or read(cfg, "checkpoint.load", None):
        return None
    return ("checkpoint.pretrained_checkpoint=<path to the base model's Megatron checkpoint> (Bridge's finetune() "
            "asserts a pretrained checkpoint or checkpoint.load, training/finetune.py:50)")


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


# The GPU a recipe is named for -> its compute capability major (NVIDIA's CUDA GPU table,
# developer.nvidia.com/cuda-gpus: A100 8.0, H100/H200/GH200 9.0, B200/GB200 10.0, B300/GB300 10.3). Bridge names
# its per-platform recipes by folder (recipes/qwen/gb200/, perf_recipes/llama/b300/) and in the function name
# (llama3_8b_pretrain_8gpu_gb200_bf16_config). Rubin (r100, vr200) is not in that table: such a recipe is named for a
# platform whose compute capability the plan does not know, and the default stays.
PLATFORM_GPU_ARCH: dict[str, int | None] = {**{p: gpu[1] for p, gpu in PLATFORM_GPUS.items()},
                                            "r100": None, "vr200": None}
_PLATFORM_WORD = re.compile(r"(?:^|_)(" + "|".join(sorted(PLATFORM_GPU_ARCH, key=len, reverse=True)) + r")(?=_|$)")


def recipe_platform(name: str | None) -> tuple[str, int | None, str] | None:
    """(platform, compute capability major or None when unknown, where it was read) of the GPU a recipe is named
    for, or None when its name and module say none. Read from the function's name (``_gb200_``), else from its module
    path (``recipes/qwen/gb200/...``; Bridge keeps its general recipes under ``<model>/h100/``), the module that
    defines the function. ``name`` is what --recipe takes: a train.py recipe (its YAML's function), a dotted path or
    a bare function name; when the name itself says no platform the function is looked up as building the recipe
    looks it up (``_recipe_function``: imports Bridge; a name it refuses is read as text). The one lookup for every
    command (plan, recommend, --search, doctor --plan) and bench/recipe_census.py."""
    if not isinstance(name, str) or not name:
        return None
    function = recipe_function_name(name)
    module, _, leaf = function.rpartition(".")
    if _PLATFORM_WORD.search(leaf.lower()) is None:
        try:   # the module that defines it (a package may re-export it): imports Bridge, as building the recipe does
            module = _recipe_function(function).__module__ or module
        except OverlayError:
            pass
    return named_platform(leaf, module)


def named_platform(leaf: str, module: str) -> tuple[str, int | None, str] | None:
    """(platform, compute capability or None, where it was read) from a recipe function's name (``_gb200_``), else
    from the module path that defines it (``recipes.qwen.gb200...``), or None."""
    found = _PLATFORM_WORD.search(leaf.lower())
    if found:
        return found.group(1), PLATFORM_GPU_ARCH[found.group(1)], "the recipe's name"
    for part in module.lower().split("."):
        if part in PLATFORM_GPU_ARCH:
            return part, PLATFORM_GPU_ARCH[part], "the recipe's module path"
    return None


def gpu_arch_for(recipe: str | None, given: int | None, default: int = 9) -> dict[str, Any]:
    """The GPUs a plan is made for: ``given`` (--gpu-arch) when not None, else the platform the recipe is named for
    (``recipe_platform``), else ``default`` (9: H100/H200, what every plan assumed before). Returns
    {"compute_capability", "from" ("--gpu-arch", where the platform was read, or "default"), "platform",
    "assumption" (the sentence the plan's assumptions carry; None when --gpu-arch was given)}."""
    if given is not None:
        return {"compute_capability": int(given), "from": "--gpu-arch", "platform": None, "assumption": None}
    found = recipe_platform(recipe)
    if found is not None and found[1] is not None:
        platform, arch, where = found
        return {"compute_capability": arch, "from": where, "platform": platform,
                "assumption": f"GPUs of compute capability {arch} ({platform.upper()}) assumed from {where}; "
                              "--gpu-arch to change"}
    lead = (f"the recipe is named for {found[0].upper()}, whose compute capability this plan does not know: "
            if found is not None else "--gpu-arch not given: ")
    return {"compute_capability": default, "from": "default", "platform": found[0] if found else None,
            "assumption": f"{lead}GPUs of compute capability {default}"
                          + {8: " (A100)", 9: " (H100/H200)", 10: " (B200/GB200)"}.get(default, "") + " assumed"
                          + ("; --gpu-arch to change" if found is not None else "")}


# ----------------------------------------------------------------------------- the world size a recipe is named for
GPU_COUNT = re.compile(r"_(\d+)gpu_")


def recipe_world_size(names: list[str], model: Any) -> tuple[int, str]:
    """(world size, where it came from): the ``Ngpu`` of a name when the layout can run on it (TP*PP*CP and
    EP*ETP*PP both divide it: parallel_state.initialize_model_parallel's two decompositions), else the smallest
    world both divide."""
    tp = model.tensor_model_parallel_size or 1
    pp = model.pipeline_model_parallel_size or 1
    cp = model.context_parallel_size or 1
    ep = getattr(model, "expert_model_parallel_size", 1) or 1
    etp = getattr(model, "expert_tensor_parallel_size", None) or tp
    dense, expert = tp * pp * cp, ep * etp * pp
    smallest = math.lcm(dense, expert)
    for name in names:
        m = GPU_COUNT.search(name.rpartition(".")[2])
        if m:
            n = int(m.group(1))
            if n % smallest == 0:
                return n, f"{m.group(1)}gpu in the name"
            return smallest, f"the layout (the name's {m.group(1)}gpu is not a multiple of TP*PP*CP={dense} and EP*ETP*PP={expert})"
    return smallest, f"the layout (TP*PP*CP={dense}, EP*ETP*PP={expert}; no Ngpu in the name)"


def recipe_names(name: str) -> list[str]:
    """The names a recipe goes by: the one given, and the function's own (``llama3_70b_sft`` is
    ``llama3_70b_sft_32gpu_h100_bf16_config``), where its GPU count is written."""
    fn = _recipe_function(name)
    return [name, f"{getattr(fn, '__module__', '')}.{getattr(fn, '__name__', '')}"]


def named_world_size(name: str, model: Any) -> tuple[int | None, str]:
    """(world size, why) for a plan of recipe ``name`` without --world-size: the ``Ngpu`` its names carry, where
    the recipe's layout can run on it (recipe_world_size); None, with what the layout needs, otherwise."""
    world, why = recipe_world_size(recipe_names(name), model)
    if why.endswith("gpu in the name") and world <= MAX_WORLD_SIZE:   # --world-size's own bound
        return world, why
    return None, f"the recipe's name gives no GPU count its layout runs on; {why.removeprefix('the layout ')}: " \
                  f"the smallest world it allows is {world}"
