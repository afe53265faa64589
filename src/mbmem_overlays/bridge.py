"""Everything that touches Megatron Bridge: loading recipes offline, overrides, and validation.

Importing this module imports Bridge (15-20 s); the CLI imports it only for the
commands that build a real config.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import importlib
import logging
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any

from . import _te_compat, hf_offline
from .engine import _MISSING, _type_problem, path_problem, read, write
from .errors import OverlayError, Problem
from .hydra_args import _plain


def prepare(offline: bool = True) -> None:
    """Make ``import megatron.bridge`` work here: TE shim, offline HF configs, quiet logs."""
    import sys
    if "megatron.bridge" in sys.modules:
        return
    _te_compat.install()
    if offline and not os.environ.get("MBMEM_USE_USER_HF"):
        hf_offline.activate()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    logging.disable(logging.INFO)  # Bridge logs optional-import tracebacks at INFO while importing
    import io
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            importlib.import_module("megatron.bridge")
    except Exception:
        sys.stderr.write(captured.getvalue())
        raise
    finally:
        logging.disable(logging.NOTSET)
    for name in ("megatron", "megatron.bridge", "megatron.core", "root", "transformers", ""):
        logging.getLogger(name).setLevel(logging.ERROR)


# ----------------------------------------------------------------------------- recipes
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
    from .catalog import recipe_file
    path = recipe_file(name)
    return build_recipe(name) if path is None else build_from_spec(yaml.safe_load(path.read_text()) or {})


def _hub_id_from_error(text: str) -> str | None:
    import re
    m = re.search(r"(?:from|for|load(?:ing)?)\s+['\"]?([\w.-]+/[\w.-]+)", text)
    if m and ("offline" in text.lower() or "Failed to load" in text or "not found" in text.lower()
              or "couldn't" in text.lower() or "cannot find" in text.lower()):
        return m.group(1).rstrip(".'\"")
    return None


# ----------------------------------------------------------------------------- overrides
def parse_override(text: str) -> tuple[str, Any]:
    """``model.tensor_model_parallel_size=4`` -> (path, typed value) with Hydra's own parser."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException
    if "=" not in text:
        raise OverlayError([Problem(("override",), text, None, f"override {text!r} has no '='",
                                    "write overrides as KEY=VALUE, e.g. model.tensor_model_parallel_size=4")])
    try:
        ov = OverridesParser.create().parse_override(text)
    except OverrideParseException as exc:
        raise OverlayError([Problem(("override",), text, None, f"cannot parse override {text!r}: {exc}",
                                    "write overrides as KEY=VALUE with Hydra syntax, e.g. model.recompute_modules=[core_attn]")]) from None
    if ov.is_delete() or ov.is_add() and ov.key_or_group.startswith("~"):
        raise OverlayError([Problem(("override",), text, None, "deleting config fields is not supported",
                                    "set the field to null instead, e.g. model.recompute_granularity=null")])
    return ov.key_or_group, _plain(ov.value())


def apply_overrides(cfg: Any, overrides: list[str] | dict[str, Any]) -> dict[str, Any]:
    """Apply user overrides with existence and type checks; all problems at once; atomic."""
    items = list(overrides.items()) if isinstance(overrides, dict) else [parse_override(o) for o in overrides]
    problems: list[Problem] = []
    for path, value in items:
        p = path_problem(cfg, path, "override")
        if p:
            problems.append(p)
            continue
        current = read(cfg, path, None)
        err = _type_problem(current, value)
        if err and not (isinstance(current, float) and isinstance(value, int)):
            problems.append(Problem(("override",), path, value, f"{path} {err}",
                                    f"give {path} a {type(current).__name__}, e.g. {path}={current!r}"))
    if problems:
        raise OverlayError(problems)
    undo: list[tuple[str, Any]] = []
    try:
        for path, value in items:
            undo.append((path, read(cfg, path, _MISSING)))
            write(cfg, path, float(value) if isinstance(read(cfg, path, None), float) and isinstance(value, int) else value)
    except BaseException:
        for path, old in reversed(undo):
            write(cfg, path, old)
        raise
    return dict(items)


# ----------------------------------------------------------------------------- validation
# Checks that need Transformer Engine fail on a host without it, and stop
# validation there (stack-on-cpu.md). For the ones below we know the one setting
# that asked for TE: turn it off *in the validation copy only*, record the check
# as "not checkable here", and let the rest of validation run.
def torch_float32():
    import torch
    return torch.float32


TE_ONLY_CHECKS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("apply_rope_fusion is not available", {"model.apply_rope_fusion": False}),
    # FusedAdam comes from TE; without the precision-aware optimizer, its low-precision state dtypes
    # must go back to fp32 too, or megatron-core raises an error that only the copy would have.
    ("requires FusedAdam from TransformerEngine", {
        "optimizer.use_precision_aware_optimizer": False, "optimizer.main_grads_dtype": torch_float32,
        "optimizer.main_params_dtype": torch_float32, "optimizer.exp_avg_dtype": torch_float32,
        "optimizer.exp_avg_sq_dtype": torch_float32}),
    ("fused permutation is not available", {"model.moe_permute_fusion": False}),
    ("gradient_accumulation_fusion", {"model.gradient_accumulation_fusion": False}),
    ("is required for overlap_grad_reduce when using", {"comm_overlap.delay_wgrad_compute": False}),
    # The flex MoE dispatcher is validated against the GPU's architecture (flex_dispatcher_backend.py:105),
    # the last step of validate(): on a host without a GPU everything else has been checked by then.
    ("Found no NVIDIA driver", {"model.moe_token_dispatcher_type": "alltoall"}),
)
TE_MARKERS = ("Transformer Engine", "TransformerEngine", "transformer_engine", "transformer-engine", "install TE",
              "TE >=", "TE version")


@dataclass
class ValidationResult:
    ok: bool
    world_size: int
    data_parallel_size: int | None = None
    error: str | None = None
    not_checkable: list[str] = field(default_factory=list)
    launch_requirements: list[str] = field(default_factory=list)
    complete: bool = True  # False: validation stopped at a check this host cannot run; later checks did not run

    @property
    def verdict(self) -> str:
        if not self.ok:
            return f"REJECTED by Bridge validation: {self.error}"
        if not self.complete:
            return ("INCOMPLETE: Bridge validation stopped at a check that needs Transformer Engine; the checks after "
                    "it did not run on this host (our own rules above did)")
        if self.not_checkable:
            return "PASSED (Bridge runtime_config_update), except checks not checkable on this host"
        return "PASSED (Bridge runtime_config_update)"


@contextlib.contextmanager
def _preserved_environ():
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def validate_config(cfg: Any, world_size: int | None = None, env: dict[str, str] | None = None) -> ValidationResult:
    """Run Bridge's ``runtime_config_update`` on a copy; os.environ is restored afterwards."""
    prepare()
    from megatron.bridge.training.config import runtime_config_update
    ws = int(world_size or os.environ.get("WORLD_SIZE") or 1)
    unchecked: list[str] = []
    work = copy.deepcopy(cfg)
    needs: list[str] = []
    if read(work, "peft", None) is not None and read(work, "checkpoint.pretrained_checkpoint", None) is None:
        # "PEFT requires a pretrained checkpoint path" (config.py:1488): a plan has no checkpoint yet.
        needs.append("checkpoint.pretrained_checkpoint=<path to the base model's Megatron checkpoint> "
                     "(PEFT requires a pretrained checkpoint path; validated here with a placeholder)")
        # Bridge only checks that the path exists (CheckpointConfig.finalize, config.py:591-595).
        placeholder = tempfile.mkdtemp(prefix="mbmem-placeholder-checkpoint-")
        write(work, "checkpoint.pretrained_checkpoint", placeholder)
    try:
        return _validate_loop(work, ws, env, unchecked, needs)
    finally:
        if needs:
            shutil.rmtree(read(work, "checkpoint.pretrained_checkpoint", ""), ignore_errors=True)


def _validate_loop(work, ws, env, unchecked, needs) -> ValidationResult:
    from megatron.bridge.training.config import runtime_config_update
    for _ in range(len(TE_ONLY_CHECKS) + 1):
        attempt = copy.deepcopy(work)
        with _preserved_environ():
            if env is not None and env is not os.environ:
                os.environ.update({k: str(v) for k, v in env.items()})
            os.environ["WORLD_SIZE"] = str(ws)
            try:
                runtime_config_update(attempt)
            except Exception as exc:  # Bridge/megatron-core raise ValueError, AssertionError, ...
                message = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
                for marker, safe in TE_ONLY_CHECKS:
                    first = next(iter(safe))
                    if marker in str(exc) and read(work, first, None) != safe[first]:
                        needs_what = "a GPU" if "NVIDIA driver" in marker else "Transformer Engine"
                        unchecked.append(f"{first}={read(work, first, None)!r}: {str(exc).strip().splitlines()[0]} "
                                         f"(needs {needs_what}; not checkable on this host)")
                        for path, value in safe.items():
                            if read(work, path, _MISSING) is not _MISSING:
                                write(work, path, value() if callable(value) else value)
                        break
                else:
                    if any(m in str(exc) for m in TE_MARKERS):
                        unchecked.append(f"{str(exc).strip()} (needs Transformer Engine; validation stopped here, "
                                         "later checks did not run)")
                        return ValidationResult(True, ws, None, None, unchecked, needs, complete=False)
                    return ValidationResult(False, ws, None, message, unchecked, needs)
                continue
        return ValidationResult(True, ws, getattr(attempt, "data_parallel_size", None), None, unchecked, needs)
    return ValidationResult(False, ws, None, "too many TE-only checks", unchecked)


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

