"""``mbmem plan``: per-GPU memory before and after each overlay, or ``--search`` for layouts that fit."""

from __future__ import annotations

import json
import sys

from .common import EXIT_USAGE, add_recipe_options, csv_list, recipe_with_overrides


def register(sub) -> None:
    p = sub.add_parser("plan", help="per-GPU memory before and after each overlay (and --search for layouts)")
    add_recipe_options(p, world_size="required")
    p.add_argument("--overlay", "-O", action="append", default=[])
    p.add_argument("--gpu-memory", help="capacity per GPU, e.g. 80GiB")
    p.add_argument("--margin", type=float, default=0.05, help="headroom kept free (fraction of capacity)")
    p.add_argument("--plot", metavar="PNG")
    p.add_argument("--json", action="store_true")
    p.add_argument("--search", action="store_true", help="enumerate layouts and overlay sets that fit")
    p.add_argument("--top", type=int, default=5)
    p.set_defaults(fn=run)


def run(args) -> int:
    from ..core.sizes import parse_size
    from ..memory.search import command_for, search
    from ..memory.steps import build_plan, plot_plan, render_plan
    cfg, locked, params = recipe_with_overrides(args.recipe, args.set)
    capacity = parse_size(args.gpu_memory) if args.gpu_memory else None
    if args.search:
        if capacity is None:
            print("mbmem plan --search needs --gpu-memory (e.g. 80GiB)", file=sys.stderr)
            return EXIT_USAGE
        rows, n, secs = search(cfg, args.world_size, capacity, args.margin, args.top)
        if args.json:
            print(json.dumps({"evaluated": n, "seconds": secs, "results": rows}, indent=2))
            return 0 if rows else 1
        print(f"searched {n} layouts x overlay sets in {secs:.2f} s; {len(rows)} best that fit "
              f"{capacity / 2**30:.0f} GiB with a {args.margin:.0%} margin, cheapest first:")
        for r in rows:
            print(f"  {r['total_bytes'] / 2**30:6.1f} GiB  cost ~{r['cost']:.0%}  TP{r['tp']} PP{r['pp']} VPP{r['vpp']} "
                  f"CP{r['cp']} DP{r['dp']}  [{', '.join(r['overlays'])}]\n    {command_for(args.recipe, r, args.world_size)}")
        return 0 if rows else 1
    plan = build_plan(cfg, csv_list(args.overlay), world=args.world_size, recipe=args.recipe, params=params,
                      capacity=capacity, margin=args.margin, locked=locked)
    if args.plot:
        plot_plan(plan, args.plot)
    if args.json:
        print(json.dumps(plan.as_dict(), indent=2))
    else:
        print(render_plan(plan))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0 if plan.fits(plan.steps[-1]) is not False else 1
