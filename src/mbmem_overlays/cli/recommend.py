"""``mbmem recommend``: walk NVIDIA's memory ladder until the plan fits; every step validated."""

from __future__ import annotations

import sys

from ..core.errors import OverlayError
from .common import EXIT_REJECTED, EXIT_USAGE, UsageError
from ..core.text import shown
from .plan import (add_memory_options, arch_json, arch_note, breakdown_dict, build_start, checked_args, emit, fail,
                   gpu_arch_for, write_plot)


def register(sub) -> None:
    p = sub.add_parser("recommend", help="walk NVIDIA's memory ladder until the plan fits (each step validated)")
    add_memory_options(p, capacity_help="capacity per GPU (required), e.g. 80GiB, 80GB, 80G or bytes")
    p.set_defaults(fn=run)


def run(args) -> int:
    try:
        checked = checked_args(args, capacity_required="to know when the ladder may stop")
    except UsageError as exc:
        return fail(args, exc, EXIT_USAGE)
    try:
        cfg, start = build_start(args, checked)
        return recommend_and_print(args, cfg, start, checked)
    except UsageError as exc:  # the plot path, refused at the moment of writing
        return fail(args, exc, EXIT_USAGE)
    except OverlayError as exc:
        return fail(args, exc, EXIT_REJECTED)


def recommend_and_print(args, cfg, start, checked) -> int:
    from ..bridge.stack import progress
    from ..memory.ladder import recommend, render_recommendation
    from ..memory.steps import draw_bars
    world, capacity, margin = checked["world"], checked["capacity"], checked["margin"]
    gpu = gpu_arch_for(args.recipe, checked.get("arch"))
    with progress("walking the memory ladder, each step validated with Bridge"):
        rec = recommend(cfg, world, capacity, margin, start=start, catalog=checked["catalog"],
                        arch=gpu["compute_capability"])
    taken = [r for r in rec["steps"] if "breakdown" in r]
    if args.plot and taken:
        write_plot(args, lambda: draw_bars(
            [(r["step"], r["breakdown"]) for r in taken],
            title=f"{args.recipe}, world size {world}: the memory ladder, step by step",
            capacity=capacity, margin=margin))
    if args.json:
        steps = [{**r, "breakdown": breakdown_dict(r["breakdown"])} if "breakdown" in r else r for r in rec["steps"]]
        emit(args, {**rec, "ok": rec["fits"], "steps": steps, "world_size": world, "gpu_arch": arch_json(gpu),
                    "plot": args.plot if taken else None})
    elif rec.get("error"):
        print(shown(f"mbmem recommend: {rec['error']}", one_line=False), file=sys.stderr)
    else:
        print(render_recommendation(rec))
        if arch_note(gpu):
            print(arch_note(gpu))
        if args.plot and taken:
            print(f"plot: {args.plot}")
    return 0 if rec["fits"] else EXIT_REJECTED
