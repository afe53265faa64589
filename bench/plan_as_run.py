"""Every recipe Bridge ships, planned as shipped and planned after Bridge's own setup: the two plans must be one.

Usage: .venv/bin/python bench/plan_as_run.py [--match SUBSTRING ...] [--limit N] [--quiet]

For each recipe function that Bridge 0.6.2 exports under ``megatron.bridge.recipes`` and
``megatron.bridge.perf_recipes`` (found by walking the packages: a public function of the module itself whose name
ends in ``_config`` and that takes no required argument), built offline with the shipped hf_configs at its own world
size (the ``<N>gpu`` of its name, else the smallest its layout allows): the plan of the recipe as shipped
(``memory/from_config.py``, which reads it through ``bridge/as_run.py as_run``) beside the plan of a copy that Bridge's
own ``runtime_config_update`` ran on (``as_run.bridge_runtime_update``: WORLD_SIZE set, os.environ restored, a
placeholder checkpoint for PEFT, as bridge/validation.py runs it). Identical means the same Shape, Layout and
Settings, so the same figure on every pipeline rank.

A check that needs what this host lacks (Transformer Engine's kernels, its gradient-accumulation fusion:
``as_run.host_checks``) stops ``runtime_config_update`` here: such a recipe is compared with that one setting off on
both sides, and the line names it (Transformer Engine's version is asked as on the GPU nodes, and the flex
dispatcher's GPU query is skipped). A recipe whose setup Bridge refuses for another reason has no oracle here: its
line says why. Each difference is named by field.

Last line: ``as run: N recipes, K identical, D differ, B not built offline, R without an oracle here``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import pkgutil
import re
import sys
import time
from dataclasses import fields
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

PACKAGES = ("megatron.bridge.recipes", "megatron.bridge.perf_recipes")


def recipe_functions() -> tuple[list[tuple[str, object]], list[str]]:
    """([(dotted name, function)], modules that do not import here)."""
    found, broken = {}, []
    for package in PACKAGES:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, prefix=package + "."):
            try:
                module = importlib.import_module(info.name)
            except Exception as exc:  # noqa: BLE001 — a module that needs what this host lacks
                broken.append(f"{info.name}: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
                continue
            for name, fn in vars(module).items():
                if (name.startswith("_") or not name.endswith("_config") or not inspect.isfunction(fn)
                        or fn.__module__ != module.__name__):
                    continue
                try:
                    params = inspect.signature(fn).parameters.values()
                except (TypeError, ValueError):
                    continue
                if all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
                    found.setdefault(f"{fn.__module__}.{name}", fn)
    return sorted(found.items()), broken


def own_world(name: str, cfg) -> int:
    """The recipe's own world size: the ``<N>gpu`` of its name, else the smallest its layout allows (TP x PP x CP,
    a multiple of the expert layout EP x ETP x PP)."""
    m = re.search(r"_(\d+)gpus?_", name.rpartition(".")[2])
    if m:
        return int(m.group(1))
    md = cfg.model
    tp, pp, cp = (md.tensor_model_parallel_size or 1), (md.pipeline_model_parallel_size or 1), (md.context_parallel_size or 1)
    ep = getattr(md, "expert_model_parallel_size", 1) or 1
    etp = getattr(md, "expert_tensor_parallel_size", None) or tp
    return math.lcm(tp * pp * cp, ep * etp * pp)


def differences(a, b) -> list[str]:
    out = []
    for part, x, y in zip(("shape", "layout", "settings"), a, b):
        for f in fields(x):
            u, v = getattr(x, f.name), getattr(y, f.name)
            if u != v:
                out.append(f"{part}.{f.name} {u!r} vs {v!r}"[:160])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--match", action="append", default=[], help="only recipes whose name contains this")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--quiet", action="store_true", help="print only differences, failures and the last line")
    args = ap.parse_args()
    from mbmem_overlays.bridge.stack import prepare
    prepare()
    from mbmem_overlays.bridge.as_run import bridge_runtime_update
    from mbmem_overlays.bridge.recipes import build_recipe
    from mbmem_overlays.core.paths import write
    from mbmem_overlays.memory import model as P
    t0 = time.perf_counter()
    functions, broken = recipe_functions()
    functions = [(n, f) for n, f in functions if not args.match or any(s in n for s in args.match)][:args.limit]
    same = differ = unbuilt = no_oracle = 0
    for name, _ in functions:
        short = name.rpartition(".")[2]
        try:
            cfg = build_recipe(name)
            world = own_world(name, cfg)
        except Exception as exc:  # noqa: BLE001 — OverlayError (no config.json offline) and anything else
            unbuilt += 1
            if not args.quiet:
                print(f"  not built   {short}: {' '.join(str(exc).split())[:160]}")
            continue
        oracle, aside, why = bridge_runtime_update(cfg, world)
        if oracle is None:
            no_oracle += 1
            print(f"  no oracle   {short} (world {world}): runtime_config_update refuses it here: {why[:200]}")
            continue
        for path, value in aside.items():
            write(cfg, path, value)
        note = (f" [compared with {', '.join(f'{p}={v!r}' for p, v in aside.items())} on both sides: this host cannot "
                "run its check]" if aside else "")
        try:
            shipped, finalized = P.from_config(cfg, world), P.from_config(oracle, world)
        except Exception as exc:  # noqa: BLE001
            differ += 1
            print(f"  DIFFER      {short} (world {world}): the plan fails: {type(exc).__name__}: {exc}"[:300])
            continue
        diff = differences(shipped, finalized)
        if not diff:
            same += 1
            if not args.quiet:
                print(f"  identical   {short} (world {world}){note}")
            continue
        differ += 1
        a, b = P.estimate(*shipped).total / 1e9, P.estimate(*finalized).total / 1e9
        print(f"  DIFFER      {short} (world {world}): {a:.1f} GB as shipped, {b:.1f} GB after Bridge's setup{note}: "
              + "; ".join(diff[:6]) + (f"; +{len(diff) - 6} more" if len(diff) > 6 else ""))
    for line in broken:
        print(f"  module not importable here: {line}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    print(f"as run: {len(functions)} recipes, {same} identical, {differ} differ, {unbuilt} not built offline, "
          f"{no_oracle} without an oracle here")
    return 0 if not differ else 1


if __name__ == "__main__":
    sys.exit(main())
