"""``mbmem recommend``: walk NVIDIA's memory ladder until the plan fits."""

from __future__ import annotations

import json

from .common import add_recipe_options, recipe_with_overrides


def register(sub) -> None:
    p = sub.add_parser("recommend", help="walk NVIDIA's memory ladder until the plan fits")
    add_recipe_options(p, world_size="required")
    p.add_argument("--gpu-memory", required=True, help="e.g. 80GiB")
    p.add_argument("--margin", type=float, default=0.05)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=run)


def run(args) -> int:
    from ..core.sizes import parse_size
    from ..memory.ladder import recommend, render_recommendation
    cfg, locked, _ = recipe_with_overrides(args.recipe, args.set)
    rec = recommend(cfg, args.world_size, parse_size(args.gpu_memory), args.margin, locked, args.recipe)
    print(json.dumps(rec, indent=2) if args.json else render_recommendation(rec))
    return 0 if rec["fits"] else 1
