"""``mbmem recommend``: walk NVIDIA's memory ladder until the plan fits; every step validated."""

from __future__ import annotations

import sys

from ..core.errors import OverlayError
from .common import EXIT_REJECTED, EXIT_USAGE, UsageError, usage_problem
from ..core.text import shown
from .plan import (add_memory_options, arch_json, arch_note, breakdown_dict, build_start, checked_args, emit, fail,
                   gpu_arch_for, world_for, write_plot)


def register(sub) -> None:
    p = sub.add_parser("recommend", help="walk NVIDIA's memory ladder until the plan fits (each step validated)")
    add_memory_options(p, capacity_help="capacity per GPU (required), e.g. 80GiB, 80GB, 80G or bytes", megatron=True)
    p.set_defaults(fn=run)


def run(args) -> int:
    if args.megatron_args is not None:
        return run_megatron(args)
    if args.recipe is None:
        return fail(args, UsageError([usage_problem("--recipe", None, "--recipe or --megatron-args is required",
                                                    "add --recipe NAME, or --megatron-args FILE for a Megatron-LM "
                                                    "job")]), EXIT_USAGE)
    if args.tokenizer_vocab is not None:   # a recipe's vocabulary is its tokenizer's, as Bridge builds it
        return fail(args, UsageError([usage_problem("--tokenizer-vocab", args.tokenizer_vocab, "--tokenizer-vocab "
                                                    "works with --megatron-args: a recipe's vocabulary is its own",
                                                    "drop --tokenizer-vocab, or give the job with --megatron-args")]),
                    EXIT_USAGE)
    try:
        checked = checked_args(args, capacity_required="to know when the ladder may stop")
    except UsageError as exc:
        return fail(args, exc, EXIT_USAGE)
    try:
        cfg, start = build_start(args, checked)
        return recommend_and_print(args, cfg, start, world_for(args, cfg, checked))
    except UsageError as exc:  # the plot path, refused at the moment of writing
        return fail(args, exc, EXIT_USAGE)
    except OverlayError as exc:
        return fail(args, exc, EXIT_REJECTED)


def recommend_and_print(args, cfg, start, checked) -> int:
    from ..bridge.stack import progress
    from ..memory.ladder import recommend, render_recommendation
    world, capacity, margin = checked["world"], checked["capacity"], checked["margin"]
    gpu = gpu_arch_for(args.recipe, checked.get("arch"))
    with progress("walking the memory ladder, each step validated with Bridge"):
        rec = recommend(cfg, world, capacity, margin, start=start, catalog=checked["catalog"],
                        arch=gpu["compute_capability"])
    return print_recommendation(args, rec, world=world, render=render_recommendation,
                                title=f"{args.recipe}, world size {world}: the memory ladder, step by step",
                                extra={"gpu_arch": arch_json(gpu)},
                                lines=[n for n in [arch_note(gpu), _assumed(checked.get("world_note"))] if n])


def _assumed(note: str | None) -> str | None:
    return f"assumed: {note}" if note else None


def print_recommendation(args, rec: dict, *, world: int, render, title: str, extra: dict | None = None,
                         lines: list[str] | tuple[str, ...] = ()) -> int:
    """The ladder's answer as asked: the plot of its steps (``title``), then its JSON (with ``extra``) or its text
    (``render``, then ``lines``); the exit code is the verdict's: 0 a step fits, 1 nothing on the ladder fits, 4 the
    fit is unknown (a feature that changes memory is not modelled; memory/plan.py Verdict.exit_code,
    docs/exit-codes.md)."""
    from ..memory.steps import draw_bars
    taken = [r for r in rec["steps"] if "breakdown" in r]
    if args.plot and taken:
        write_plot(args, lambda: draw_bars([(r["step"], r["breakdown"]) for r in taken], title=title,
                                           capacity=rec["capacity_bytes"], margin=rec["margin"]))
    if args.json:
        steps = [{**r, "breakdown": breakdown_dict(r["breakdown"])} if "breakdown" in r else r for r in rec["steps"]]
        emit(args, {**rec, "ok": rec["fits"] is True, "steps": steps, "world_size": world, **(extra or {}),
                    "plot": args.plot if taken else None})
    elif rec.get("error"):
        print(shown(f"mbmem recommend: {rec['error']}", one_line=False), file=sys.stderr)
    else:
        print(shown(render(rec, verbose=args.verbose), one_line=False))
        for line in lines:
            print(line)
        if args.plot and taken:
            print(f"plot: {args.plot}")
    return rec.get("exit_code", 0 if rec["fits"] else EXIT_REJECTED)


def run_megatron(args) -> int:
    """``mbmem recommend --megatron-args FILE``: the ladder on the job's own configuration, each step's flags parsed
    and validated by megatron-core (memory/megatron.py), the answer in the job's flags."""
    from ..bridge.stack import progress
    from ..memory.megatron import MegatronTarget, recommend_job, render_recommendation
    from .plan import load_megatron_job, megatron_checks, megatron_job_lines
    try:
        checked = megatron_checks(args, capacity_required="to know when the ladder may stop")
    except UsageError as exc:
        return fail(args, exc, EXIT_USAGE)
    job = load_megatron_job(args, checked)
    if isinstance(job, int):
        return job
    capacity, margin = checked["capacity"], checked["margin"]
    target = MegatronTarget(job, arch=checked["arch"], vocab=checked["vocab"])
    try:
        with progress("walking the memory ladder, each step's Megatron-LM flags validated by megatron-core"):
            rec = recommend_job(target, capacity, margin, catalog=checked["catalog"], overlays=checked["overlays"])
        return print_recommendation(args, rec, world=job.world_size, render=render_recommendation,
                                    title=f"Megatron-LM {job.form}, world size {job.world_size}: the memory ladder, "
                                          "step by step",
                                    extra={"megatron_args": job.as_dict()}, lines=megatron_job_lines(job))
    except UsageError as exc:
        return fail(args, exc, EXIT_USAGE)
    except OverlayError as exc:
        return fail(args, exc, EXIT_REJECTED)
