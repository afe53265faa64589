"""A CPU stand-in for Megatron Bridge's scripts/training/run_recipe.py: the same command line
(``--recipe NAME`` then trailing ``KEY=VALUE`` overrides) and the same override machinery
(``omegaconf_utils.process_config_with_overrides``), then Bridge's own validation instead of training.

``--plan-only`` skips Bridge: it prints what the job received (the overrides, the allocator environment, the
package version), which is what the NeMo-Run Slurm test checks inside a real job.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import mbmem_overlays


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", required=True)
    p.add_argument("--plan-only", action="store_true", help="print the plan the job received; no Bridge")
    args, rest = p.parse_known_args(argv)
    # run_recipe.py's _collect_overrides: every trailing word must be KEY=VALUE (bridge-config-surface.md §4)
    bad = [w for w in rest if w.startswith("-") or "=" not in w]
    if bad:
        print(f"run_recipe_dry: not KEY=VALUE: {bad}", file=sys.stderr)
        return 2
    plan = {"package": mbmem_overlays.__version__, "recipe": args.recipe, "overrides": rest,
            "PYTORCH_CUDA_ALLOC_CONF": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "<unset>")}
    print("MBMEM_PLAN " + json.dumps(plan, sort_keys=True), flush=True)
    if args.plan_only:
        return 0
    from mbmem_overlays.bridge.stack import prepare
    prepare()  # Bridge on a CPU host: the Transformer Engine shim and the offline HF configs
    from megatron.bridge.training.utils.omegaconf_utils import (
        process_config_with_overrides,
    )

    from mbmem_overlays.bridge.recipes import load_recipe, world_size_for
    from mbmem_overlays.bridge.validation import validate_config
    cfg = process_config_with_overrides(load_recipe(args.recipe), cli_overrides=rest)
    world, _ = world_size_for(cfg, None)
    result = validate_config(cfg, world_size=world, env=dict(os.environ))
    print(f"validation (world size {world}): {result.verdict}", flush=True)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
