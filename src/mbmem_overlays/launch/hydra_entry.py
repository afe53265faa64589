"""What ``train.py`` does with a composed Hydra config: validate, plan, and launch.

Hydra composes ``+mem=[a,b]`` last-wins and silently (ecosystem-notes.md), so
the selected overlays are taken from the keys under ``mem`` (each option file is
``# @package mem.<name>``) and applied through the same engine as
``apply_overlay``: order-independent, all violations at once.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

from ..core.catalog import RESERVED_KEY, Catalog
from ..core.errors import OverlayError, Problem

HYDRA_KEYS = ("recipe", "mem", "run", "hydra", "bridge")


def hydra_argv(argv: list[str], catalog: Catalog | None = None) -> list[str]:
    """Rewrite a user's command line for Hydra.

    - ``model.x=4`` (any Bridge field) -> ``+bridge.model.x=4``: Bridge overrides live under ``bridge``.
    - overlay aliases (``+mem=lora_regather``, ``mem.lora_regather.strict=false``) -> canonical names.
    """
    catalog = catalog or Catalog()
    out = [argv[0]]
    for arg in argv[1:]:
        if arg.startswith("-") or "=" not in arg:
            out.append(arg)
            continue
        key, _, value = arg.partition("=")
        bare = key.lstrip("+~")
        head = bare.split(".")[0].split("@")[0]
        if head == "mem":
            if bare == "mem":
                names = [n.strip() for n in value.strip("[]").split(",") if n.strip()]
                names = [catalog.aliases.get(n, n) for n in names]
                value = f"[{','.join(names)}]" if value.startswith("[") else ",".join(names)
            else:
                parts = bare.split(".")
                if len(parts) > 1:
                    parts[1] = catalog.aliases.get(parts[1], parts[1])
                key = key[: len(key) - len(bare)] + ".".join(parts)
            out.append(f"{key}={value}")
        elif head in HYDRA_KEYS:
            out.append(arg)
        else:
            out.append(f"+bridge.{bare}={value}")
    return out


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: node} if prefix else {}


def selected_overlays(mem: dict[str, Any] | None, catalog: Catalog) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Overlay names and parameters from the composed ``mem`` node."""
    names, params, problems = [], {}, []
    for name, node in (mem or {}).items():
        spec = catalog.resolve(name)
        node = dict(node or {})
        declared = node.pop(RESERVED_KEY, None)
        if declared is not None and declared != spec.raw.get(RESERVED_KEY):
            problems.append(Problem((name,), f"mem.{name}.{RESERVED_KEY}", None,
                                    "the overlay's declaration cannot be overridden from the command line",
                                    f"override parameters only (mem.{name}.<param>=...), or write your own overlay file"))
        names.append(spec.name)
        params[spec.name] = node
    if problems:
        raise OverlayError(problems)
    return names, params


def _search_path_dirs() -> list[str]:
    """User overlay directories given to Hydra (hydra.searchpath=[file://DIR]) count as overlay dirs."""
    from hydra.core.hydra_config import HydraConfig
    if not HydraConfig.initialized():
        return []
    dirs = []
    for entry in HydraConfig.get().searchpath or []:
        path = entry[len("file://"):] if entry.startswith("file://") else None
        if path and Path(path, "mem").is_dir():
            dirs.append(path)
    return dirs


def cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()  # no CUDA context, so the allocator has not read its settings yet
    except Exception:
        return False


def run(cfg) -> int:
    """The body of train.py's Hydra main. Returns the exit code."""
    from omegaconf import OmegaConf
    from hydra.core.hydra_config import HydraConfig

    from ..api import apply_overlay
    from ..bridge.overrides import apply_overrides
    from ..bridge.recipes import build_from_spec, model_summary, recipe_kind, world_size_for
    from ..core.report import render_json, render_text, to_dict

    rank = int(os.environ.get("RANK", "0"))
    say = print if rank == 0 else (lambda *a, **k: None)
    container = OmegaConf.to_container(cfg, resolve=True)
    run_cfg = container.get("run") or {}
    recipe = container.get("recipe") or {}
    try:
        catalog = Catalog(_search_path_dirs())
        names, params = selected_overlays(container.get("mem"), catalog)
        dry = run_cfg.get("dry_run", "auto")
        dry = (not cuda_available()) if dry == "auto" else bool(dry)
        function = recipe.get("function")
        bcfg = build_from_spec(recipe)
        locked = apply_overrides(bcfg, _flatten(container.get("bridge") or {}))
        world_size, world_assumed = world_size_for(bcfg, run_cfg.get("world_size"))
        baseline = copy.deepcopy(bcfg) if run_cfg.get("plan") else None   # the plan starts before the overlays
        report = apply_overlay(bcfg, names, env=os.environ, params=params, world_size=world_size, locked=locked,
                               validate=bool(run_cfg.get("validate", True)), catalog=catalog)
    except OverlayError as exc:
        print(f"train.py: {exc}", file=sys.stderr)
        return 1
    summary = model_summary(bcfg)
    kind = recipe_kind(bcfg)
    plan = None
    if baseline is not None and (report.validation is None or report.validation.ok):
        from ..core.sizes import parse_size
        from ..memory.steps import build_plan
        capacity = parse_size(str(run_cfg["gpu_memory"])) if run_cfg.get("gpu_memory") else None
        plan = build_plan(baseline, names, world=world_size, recipe=function, params=params, capacity=capacity,
                          locked=locked, catalog=catalog)
    if run_cfg.get("json"):
        extra = {"plan": plan.as_dict()} if plan else {}
        say(render_json(report, recipe=function, model=summary, mode="dry-run" if dry else kind, **extra))
    else:
        say(render_text(report, recipe=function, summary=summary, world_size=world_size))
        if plan:
            from ..memory.steps import render_plan
            say(render_plan(plan))
        if world_assumed:
            say(f"(world size {world_size} = TP*PP*CP assumed; set run.world_size=N to plan for N GPUs)")
    output_dir = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else run_cfg.get("record_dir")
    if output_dir:
        _save_record(output_dir, bcfg, to_dict(report, recipe=function, model=summary), rank)
    ok = report.validation is None or report.validation.ok
    if dry or not ok:
        if run_cfg.get("json"):  # the JSON object already carries the mode and the verdict; keep stdout one object
            return 0 if ok else 1
        say(f"mode: dry run ({'no CUDA device' if run_cfg.get('dry_run') == 'auto' else 'run.dry_run=true'}); "
            f"a GPU node would run Bridge {kind}()" if ok else "verdict: rejected; nothing was launched")
        return 0 if ok else 1
    return _launch(bcfg, kind)


def _save_record(output_dir: str, bcfg: Any, report: dict[str, Any], rank: int) -> None:
    if rank != 0:
        return
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mbmem_report.json").write_text(json.dumps(report, indent=2, default=repr))
    try:
        bcfg.to_yaml(str(out / "bridge_config.yaml"))
    except Exception as exc:  # to_yaml can fail on exotic recipes; the report is still saved
        (out / "bridge_config.yaml").write_text(f"# could not serialize: {exc}\n")


def _launch(bcfg: Any, kind: str) -> int:
    # The overlays' environment is already in os.environ (apply_overlay(env=os.environ)) and
    # CUDA has not allocated yet, so the allocator reads the new settings.
    from megatron.bridge.training.gpt_step import forward_step
    callbacks = None
    if os.environ.get("MBMEM_METRICS_DIR"):  # GPU smoke tests record memory and step time (gpu_harness.py)
        from .gpu_harness import make_recorder
        callbacks = [make_recorder(os.environ["MBMEM_METRICS_DIR"])]
    if kind == "finetune":
        from megatron.bridge.training.finetune import finetune
        finetune(bcfg, forward_step, callbacks=callbacks)
    else:
        from megatron.bridge.training.pretrain import pretrain
        pretrain(bcfg, forward_step, callbacks=callbacks)
    return 0
