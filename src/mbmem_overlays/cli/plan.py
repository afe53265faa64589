"""``mbmem plan``: per-GPU memory before and after each overlay, or ``--search`` for layouts that fit.

Also what ``plan`` and ``recommend`` share: their options, the argument checks that run before the
20-30 s Bridge import (sizes, counts, the plot path, overlays, parameters, override syntax), the JSON
envelope (``schema_version``, and an ``error`` object instead of an empty stdout), and the user's
:class:`~mbmem_overlays.memory.steps.Start`, which every printed command keeps.
"""

from __future__ import annotations

import sys
from typing import Any

from ..core.errors import OverlayError, Problem
from ..core.text import shown
from .common import (DEFAULT_GPU_ARCH, EXIT_REJECTED, EXIT_UNKNOWN, EXIT_USAGE, UsageError, add_recipe_options, capacity_option,
                     catalog_for, count_option, csv_list, gpu_arch_option, margin_option, preflight, split_sets,
                     usage_problem)


def register(sub) -> None:
    p = sub.add_parser("plan", help="per-GPU memory before and after each overlay (and --search for layouts)")
    add_memory_options(p, capacity_help="capacity per GPU for a fit verdict, e.g. 80GiB, 80GB, 80G or bytes",
                       megatron=True)
    p.add_argument("--search", action="store_true",
                   help="enumerate layouts and overlay sets that fit; each result is validated and has its command")
    p.add_argument("--top", default="5", metavar="N",
                   help=f"how many validated layouts --search prints (default 5, at most {MAX_TOP})")
    p.set_defaults(fn=run)


def add_memory_options(p, *, capacity_help: str, megatron: bool = False) -> None:
    """Options of plan and recommend. Counts and sizes are read as text and checked in ``checked_args``,
    so that a bad value is a usage error that --json reports as a JSON object too.

    ``megatron``: plan a Megatron-LM job from its own arguments too (--megatron-args), which then stands in
    for --recipe, and whose launcher or log may give the world size."""
    add_recipe_options(p, world_size=None)
    p.add_argument("--world-size", required=not megatron, metavar="N",
                   help="number of GPUs (a positive integer)" + (
                       "; with --megatron-args, default: the launcher's (torchrun) or the log's" if megatron else ""))
    if megatron:
        next(a for a in p._actions if a.dest == "recipe").required = False   # --recipe or --megatron-args
        p.add_argument("--megatron-args", metavar="FILE",
                       help="plan a Megatron-LM job from its arguments: a command line, a MODEL_ARGS YAML block or a "
                            "log with its 'arguments' dump (- reads standard input)")
        p.add_argument("--tokenizer-vocab", metavar="N",
                       help="with --megatron-args: the tokenizer's vocabulary when its files cannot be read here "
                            "(SentencePiece, Hugging Face)")
    p.add_argument("--gpu-arch", metavar="ARCH",
                   help="the GPUs' compute capability (9: H100/H200, 10: B200/GB200, 8: A100) or their name; the "
                        "workspace sizes (and with --megatron-args validate_args) read it. Default: the GPU a recipe "
                        "is named for (..._gb200_... in its name, or its module's <model>.b200), else 9")
    p.add_argument("--overlay", "-O", action="append", default=[],
                   help="overlays you already use (comma-separated or repeated); every step and command keeps them")
    p.add_argument("--gpu-memory", metavar="SIZE", help=capacity_help)
    p.add_argument("--margin", default="0.05", metavar="F", help="headroom kept free, a fraction of capacity in [0, 1)")
    p.add_argument("--plot", metavar="FILE", help="draw the bars to FILE (.png, .pdf or .svg; a new file)")
    p.add_argument("--force", action="store_true", help="with --plot: replace an existing regular file")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout (schema_version 1), errors included")
    p.add_argument("-v", "--verbose", "--assumptions", dest="verbose", action="store_true",
                   help="the reference detail too: every assumption in full with its sources (the default names only "
                        "those that change this job's figure), Bridge's own estimate, every step's settings")


MAX_TOP = 100  # --top: results are each validated with Bridge (seconds apiece); more is a typo

# ----------------------------------------------------------------------------- checks before Bridge
_problem = usage_problem  # the name this module's checks use


def plot_problems(args) -> list[Problem]:
    """A plot file that cannot be written is found now, not after the Bridge import and the plan: the one check
    of every output path (core/outfile.py: a new regular file, or an existing one with --force)."""
    from ..core.outfile import output_problems
    from ..memory.steps import PLOT_SUFFIXES
    return output_problems(args.plot, "--plot", force=args.force, suffixes=PLOT_SUFFIXES)


def write_plot(args, figure) -> None:
    """Render ``figure()`` (a matplotlib figure) in memory, in the format the file name says, then write the bytes
    through core/outfile.py: never through a link, a device or a fifo (issue 22 #5: savefig(path) followed a
    link and overwrote its target). A path refused at the moment of writing is a usage error."""
    from ..core.outfile import figure_bytes, write_output
    from ..memory.steps import PLOT_SUFFIXES
    data = figure_bytes(figure(), args.plot)
    try:
        write_output(args.plot, data, "--plot", force=args.force, suffixes=PLOT_SUFFIXES)
    except OverlayError as exc:
        raise UsageError(exc.problems) from None


def checked_args(args, *, capacity_required: str | None) -> dict[str, Any]:
    """Every argument problem at once, before anything imports Bridge; raises UsageError (exit 2).

    ``capacity_required``: why --gpu-memory is needed here (None: it is optional)."""
    out: dict[str, Any] = {}
    # no --world-size: the GPU count the recipe is named for, read once it is built (world_for)
    world = count_option("--world-size", args.world_size) if args.world_size is not None else (None, None)
    found = {"world": world, "capacity": capacity_option(args.gpu_memory),
             "margin": margin_option(args.margin)}
    if getattr(args, "top", None) is not None:
        found["top"] = count_option("--top", args.top, MAX_TOP)
    if getattr(args, "gpu_arch", None) is not None:
        found["arch"] = gpu_arch_option(args.gpu_arch)
    out.update({key: value for key, (value, _) in found.items()})
    problems: list[Problem] = [p for _, p in found.values() if p]
    if args.gpu_memory is None and capacity_required:
        problems.append(_problem("--gpu-memory", None, f"--gpu-memory is required {capacity_required}",
                                 "add the memory of one GPU, e.g. --gpu-memory 80GiB (or 80GB, 80G, bytes)"))
    problems += plot_problems(args)
    overrides, flat_params = split_sets(args.set)
    try:
        catalog = catalog_for(args.overlay_dir)
    except OverlayError as exc:
        raise UsageError(problems + exc.problems) from None
    names = csv_list(args.overlay)
    problems += preflight(args.recipe, names, flat_params, overrides, catalog)
    if problems:
        raise UsageError(problems)
    overlays = tuple(dict.fromkeys(catalog.resolve(n).name for n in names))
    params: dict[str, dict[str, Any]] = {}
    for key, value in flat_params.items():
        overlay, _, param = key.partition(".")
        params.setdefault(catalog.resolve(overlay).name, {})[param] = value
    return {**out, "overrides": overrides, "overlays": overlays, "params": params, "catalog": catalog}


# ----------------------------------------------------------------------------- output
def emit(args, payload: dict[str, Any]) -> None:
    """The JSON object (with schema_version) on stdout."""
    from ..core.report import SCHEMA_VERSION, json_text
    print(json_text({"schema_version": SCHEMA_VERSION, "subcommand": args.command, **payload}))


def fail(args, exc: BaseException, code: int) -> int:
    """A usage error or a rejection: the error object under --json (never an empty stdout), else stderr."""
    if args.json:
        from ..core.report import error_dict, json_text
        problems = getattr(exc, "problems", [])
        print(json_text({**error_dict(str(exc), code, problems=problems), "subcommand": args.command}))
    else:
        print(shown(f"mbmem {args.command}: {exc}", one_line=False), file=sys.stderr)
    return code


def build_start(args, checked: dict[str, Any]):
    """(recipe config with the user's overrides written, Start) — imports Bridge."""
    from ..core.catalog import all_user_dirs
    from ..memory.steps import Start
    from .common import build_with_overrides
    cfg, changes, problems = build_with_overrides(args.recipe, checked["overrides"])
    if problems:
        raise OverlayError(problems)
    # Every user overlay directory (--overlay-dir and MBMEM_OVERLAY_DIRS, absolute): the printed commands carry
    # them all, so a pasted command finds the overlays it names (issue 22 #2a).
    start = Start(args.recipe, tuple(args.set), checked["overlays"], checked["params"],
                  {path: new for path, _, new in changes}, tuple(all_user_dirs(args.overlay_dir)))
    return cfg, start


def world_for(args, cfg, checked: dict[str, Any]) -> dict[str, Any]:
    """``checked`` with the world size: --world-size, else the ``Ngpu`` the recipe is named for where its layout
    runs on it (bridge/recipes.py named_world_size), said in ``world_note``; raises UsageError (exit 2) where the
    name gives none."""
    if checked["world"] is not None:
        return checked
    from ..bridge.recipes import named_world_size
    world, why = named_world_size(args.recipe, cfg.model)
    if world is None:
        raise UsageError([_problem("--world-size", None, f"--world-size is required for {args.recipe}: {why}",
                                   "add the job's GPU count, e.g. --world-size 8")])
    return {**checked, "world": world, "world_note": f"world size {world}: the {why} (--world-size not given)"}


def breakdown_dict(b) -> dict[str, int]:
    return {k: int(v) for k, v in b.as_dict().items()}


# ----------------------------------------------------------------------------- the command
def run(args) -> int:
    if getattr(args, "megatron_args", None) is not None:
        return run_megatron(args)
    if getattr(args, "recipe", None) is None:
        return fail(args, UsageError([_problem("--recipe", None, "--recipe or --megatron-args is required",
                                               "add --recipe NAME, or --megatron-args FILE for a Megatron-LM job")]),
                    EXIT_USAGE)
    try:
        checked = checked_args(args, capacity_required="with --search" if args.search else None)
    except UsageError as exc:
        return fail(args, exc, EXIT_USAGE)
    try:
        cfg, start = build_start(args, checked)
        checked = world_for(args, cfg, checked)
        return run_search(args, cfg, start, checked) if args.search else run_plan(args, cfg, start, checked)
    except UsageError as exc:  # the plot path, refused at the moment of writing
        return fail(args, exc, EXIT_USAGE)
    except OverlayError as exc:
        return fail(args, exc, EXIT_REJECTED)


def gpu_arch_for(recipe: str | None, given: int | None) -> dict[str, Any]:
    """The GPUs a plan is made for (bridge/recipes.py ``gpu_arch_for``: --gpu-arch, else the platform the recipe is
    named for, else DEFAULT_GPU_ARCH)."""
    from ..bridge.recipes import gpu_arch_for as lookup
    return lookup(recipe, given, DEFAULT_GPU_ARCH)


def arch_json(gpu: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in gpu.items() if k != "assumption"}


def arch_note(gpu: dict[str, Any]) -> str | None:
    """The line recommend and --search print of the GPUs, where the recipe's platform says other than H100 (the
    JSON's ``gpu_arch`` always says it)."""
    named = gpu["platform"] and gpu["from"] != "--gpu-arch"
    if named and (gpu["compute_capability"] != DEFAULT_GPU_ARCH or gpu["from"] == "default"):
        return f"assumed: {gpu['assumption']}"
    return None


def run_plan(args, cfg, start, checked) -> int:
    import dataclasses

    from ..memory.steps import build_plan, plan_figure, render_plan
    gpu = gpu_arch_for(args.recipe, checked.get("arch"))
    plan = build_plan(cfg, list(start.overlays), world=checked["world"], recipe=args.recipe, params=start.params,
                      capacity=checked["capacity"], margin=checked["margin"], locked=start.locked,
                      catalog=checked["catalog"], arch=gpu["compute_capability"])
    said = tuple(n for n in (gpu["assumption"], checked.get("world_note")) if n)
    if said:
        plan = dataclasses.replace(plan, assumptions=plan.assumptions + said)
    if args.plot:
        write_plot(args, lambda: plan_figure(plan))
    if args.json:
        emit(args, {**plan.as_dict(), "gpu_arch": arch_json(gpu), "plot": args.plot})
    else:
        print(render_plan(plan, verbose=args.verbose))
        if args.plot:
            print(f"plot: {args.plot}")
    return plan.judge().exit_code   # 0 fits (or no capacity), 1 does not fit, 4 unknown: docs/exit-codes.md


def run_search(args, cfg, start, checked) -> int:
    from ..bridge.stack import progress
    from ..memory.search import layout_name, render_search, search_validated
    from ..memory.steps import Rejected, draw_bars
    world, capacity, margin = checked["world"], checked["capacity"], checked["margin"]
    gpu = gpu_arch_for(args.recipe, checked.get("arch"))
    try:
        with progress("searching layouts and validating the cheapest with Bridge"):
            found = search_validated(cfg, start, world, capacity, margin, checked["top"], catalog=checked["catalog"],
                                     arch=gpu["compute_capability"])
    except Rejected as exc:
        return fail(args, OverlayError([Problem(("overlay",), "--overlay", list(start.overlays), exc.reason,
                                                "drop or change the overlay named above")]), EXIT_REJECTED)
    results = found["results"]
    if args.plot and results:
        write_plot(args, lambda: draw_bars(
            [(layout_name(r), r["breakdown"]) for r in results],
            title=f"{args.recipe}, world size {world}: the {len(results)} cheapest validated layouts",
            capacity=capacity, margin=margin))
    if args.json:
        emit(args, {**{k: v for k, v in found.items() if k != "results"}, "capacity_bytes": int(capacity),
                    "margin": margin, "world_size": world, "world_size_from": checked.get("world_note"),
                    "gpu_arch": arch_json(gpu), "plot": args.plot if results else None,
                    "results": [{**{k: v for k, v in r.items() if k != "breakdown"},
                                 "breakdown": breakdown_dict(r["breakdown"])} for r in results]})
        return search_exit(found)
    print(render_search(found, capacity, margin))
    if arch_note(gpu):
        print(arch_note(gpu))
    if checked.get("world_note"):
        print(f"assumed: {checked['world_note']}")
    if args.plot and results:
        print(f"plot: {args.plot}")
    return search_exit(found)


def search_exit(found: dict[str, Any]) -> int:
    """0 every result fits; 4 a result's fit, or whether none fits, is unknown (a feature that changes memory is
    not modelled); 1 no validated layout fits (docs/exit-codes.md)."""
    from ..memory.plan import UNKNOWN
    results = found["results"]
    if any(r.get("fit") == UNKNOWN for r in results) or found.get("fit") == UNKNOWN:
        return EXIT_UNKNOWN
    return 0 if results else EXIT_REJECTED


# ----------------------------------------------------------------------------- a Megatron-LM job's own arguments
def megatron_checks(args, *, capacity_required: str | None = None) -> dict[str, Any]:
    """Every argument problem of ``plan``/``recommend --megatron-args`` at once, before Bridge; raises UsageError.

    ``capacity_required``: why --gpu-memory is needed here (None: it is optional)."""
    problems: list[Problem] = []
    if args.recipe is not None:
        problems.append(_problem("--recipe", args.recipe, "--recipe and --megatron-args both name the job",
                                 "give one of them"))
    if args.gpu_memory is None and capacity_required:
        problems.append(_problem("--gpu-memory", None, f"--gpu-memory is required {capacity_required}",
                                 "add the memory of one GPU, e.g. --gpu-memory 80GiB (or 80GB, 80G, bytes)"))
    top = (None, None)
    if getattr(args, "search", False):
        top = count_option("--top", args.top, MAX_TOP)
    if args.set:
        problems.append(_problem("--set", args.set, "--set changes a recipe's fields",
                                 "change the job's Megatron-LM flags in the file instead"))
    world, capacity, margin, vocab = (None, None), capacity_option(args.gpu_memory), margin_option(args.margin), \
        (None, None)
    if args.world_size is not None:
        world = count_option("--world-size", args.world_size)
    if args.tokenizer_vocab is not None:
        vocab = count_option("--tokenizer-vocab", args.tokenizer_vocab, 1 << 24)
    arch = gpu_arch_option(args.gpu_arch)
    problems += [p for _, p in (world, capacity, margin, vocab, arch, top) if p]
    problems += plot_problems(args)
    try:
        catalog = catalog_for(args.overlay_dir)
    except OverlayError as exc:
        raise UsageError(problems + exc.problems) from None
    names = csv_list(args.overlay)
    problems += preflight(None, names, {}, [], catalog)
    text = None
    if not problems:
        from ..bridge.megatron_args import MegatronArgsError, read_source
        try:
            text = read_source(args.megatron_args)
        except MegatronArgsError as exc:
            problems.append(_problem("--megatron-args", args.megatron_args, exc.message, exc.fix))
    if problems:
        raise UsageError(problems)
    return {"world": world[0], "capacity": capacity[0], "margin": margin[0], "vocab": vocab[0], "text": text,
            "arch": arch[0], "top": top[0],
            "catalog": catalog, "overlays": tuple(dict.fromkeys(catalog.resolve(n).name for n in names))}


def run_megatron(args) -> int:
    """``mbmem plan --megatron-args FILE``: the job parsed and validated by megatron-core's own parser, planned
    like a recipe, with the flags the plan does not follow and the flags each overlay adds."""
    import dataclasses

    try:
        checked = megatron_checks(args, capacity_required="with --search" if args.search else None)
    except UsageError as exc:
        return fail(args, exc, EXIT_USAGE)
    job = load_megatron_job(args, checked)
    if isinstance(job, int):
        return job
    if args.search:
        return run_megatron_search(args, job, checked)
    from ..memory.coverage import in_flags
    try:
        from ..memory.steps import build_plan, plan_figure, render_plan
        overlays = list(checked["overlays"])
        arch = checked["arch"] or DEFAULT_GPU_ARCH
        plan = build_plan(job.config, overlays, world=job.world_size, recipe=f"Megatron-LM {job.form}",
                          capacity=checked["capacity"], margin=checked["margin"], catalog=checked["catalog"],
                          arch=arch, env=dict(job.env))
        # what is not modelled in the job's own flags (those outside megatron-core's parser too): one verdict
        plan = dataclasses.replace(plan, assumptions=plan.assumptions + job.assumptions
                                   + gpu_arch_assumptions(checked["arch"]),
                                   not_modelled=in_flags(job, plan.not_modelled))
        flags = megatron_overlay_flags(job, overlays, checked["catalog"])
        flags_check = megatron_flags_check(job, overlays, checked) if flags is not None else None
    except OverlayError as exc:
        return fail(args, exc, EXIT_REJECTED)
    except Exception as exc:  # noqa: BLE001 - a job megatron-core accepted that the memory model cannot plan
        from ..core.text import bounded
        return fail(args, OverlayError([_problem("--megatron-args", args.megatron_args, "the memory model cannot "
                                                 f"plan this job: {type(exc).__name__}: {bounded(exc, 300)}",
                                                 "plan it with fewer unusual settings, or report the arguments")]),
                    EXIT_REJECTED)
    try:
        if args.plot:
            write_plot(args, lambda: plan_figure(plan))
    except UsageError as exc:
        return fail(args, exc, EXIT_USAGE)
    verdict = megatron_verdict(plan, job)
    if args.json:
        emit(args, {**plan.as_dict(), "gpu_arch": arch_json(gpu_arch_for(None, checked["arch"])), "plot": args.plot,
                    "megatron_args": {**job.as_dict(), "verdict": verdict},
                    "megatron_flags": flags.as_dict() if flags else None,
                    "megatron_flags_check": flags_check.as_dict() if flags_check is not None else None})
    else:
        print(render_plan(plan, verbose=args.verbose))
        print(render_megatron(job, flags, verdict))
        if flags_check is not None:
            print(shown(f"  checked: {flags_check.check}" if flags_check.ok else
                        f"  NOT VALID for this job: {flags_check.reason}"))
        if args.plot:
            print(f"plot: {args.plot}")
    return plan.judge().exit_code


def load_megatron_job(args, checked: dict[str, Any]):
    """The job of ``--megatron-args`` parsed and validated by megatron-core (memory/coverage.py fills what the plan
    does not follow), or the exit code of the error printed: 2 for arguments that cannot be read, 1 for a job
    megatron-core refuses."""
    from ..bridge.megatron_args import MegatronArgsError, load_job
    from ..memory.coverage import with_coverage
    try:
        return with_coverage(load_job(checked["text"], world_size=checked["world"], vocab=checked["vocab"],
                                      arch=checked["arch"] or DEFAULT_GPU_ARCH))
    except MegatronArgsError as exc:
        code = EXIT_REJECTED if exc.rejected else EXIT_USAGE
        return fail(args, UsageError([_problem(exc.flag, args.megatron_args, exc.message, exc.fix)]), code)


def run_megatron_search(args, job, checked: dict[str, Any]) -> int:
    """``mbmem plan --search --megatron-args FILE``: the layout search on the job's own configuration, each result
    the job's flags, validated by megatron-core (memory/megatron.py)."""
    from ..bridge.stack import progress
    from ..memory.megatron import MegatronTarget, render_search, search_job
    from ..memory.steps import Rejected, draw_bars
    capacity, margin = checked["capacity"], checked["margin"]
    target = MegatronTarget(job, arch=checked["arch"], vocab=checked["vocab"])
    try:
        with progress("searching layouts and validating the cheapest as the job's Megatron-LM flags"):
            found = search_job(target, capacity, margin, checked["top"], catalog=checked["catalog"],
                               overlays=checked["overlays"])
    except Rejected as exc:
        return fail(args, OverlayError([Problem(("overlay",), "--overlay", list(checked["overlays"]), exc.reason,
                                                "drop or change the overlay named above")]), EXIT_REJECTED)
    results = found["results"]
    try:
        if args.plot and results:
            from ..memory.search import layout_name
            write_plot(args, lambda: draw_bars(
                [(layout_name(r), r["breakdown"]) for r in results],
                title=f"Megatron-LM {job.form}, world size {job.world_size}: the {len(results)} cheapest validated "
                      "layouts", capacity=capacity, margin=margin))
    except UsageError as exc:
        return fail(args, exc, EXIT_USAGE)
    if args.json:
        emit(args, {**{k: v for k, v in found.items() if k != "results"}, "capacity_bytes": int(capacity),
                    "margin": margin, "world_size": job.world_size,
                    "gpu_arch": arch_json(gpu_arch_for(None, checked["arch"])), "plot": args.plot if results else None,
                    "megatron_args": job.as_dict(),
                    "results": [{**{k: v for k, v in r.items() if k != "breakdown"},
                                 "breakdown": breakdown_dict(r["breakdown"])} for r in results]})
        return search_exit(found)
    print(shown(render_search(found, capacity, margin), one_line=False))
    print("\n".join(megatron_job_lines(job)))
    if args.plot and results:
        print(f"plot: {args.plot}")
    return search_exit(found)


def gpu_arch_assumptions(given: int | None) -> tuple[str, ...]:
    """What the plan of a Megatron-LM job (no recipe name to read a platform from) says of the GPU when --gpu-arch
    was not given."""
    text = gpu_arch_for(None, given)["assumption"]
    return (text,) if text else ()


def megatron_overlay_flags(job, overlays: list[str], catalog):
    """The Megatron-LM flags the overlays amount to on this job (None without overlays): the engine's changes,
    written back as the parser's own flags (bridge/megatron_args.py overlay_flags)."""
    if not overlays:
        return None
    import copy

    from ..bridge.megatron_args import overlay_flags
    from ..core.engine import apply_overlay
    report = apply_overlay(copy.deepcopy(job.config), overlays, env=dict(job.env), world_size=job.world_size,
                           catalog=catalog)
    return overlay_flags([(c.target, c.new) for c in report.changes], job.args)


def megatron_flags_check(job, overlays: list[str], checked: dict[str, Any]):
    """The overlays' flags on the job's own arguments, parsed and validated by megatron-core (bridge/megatron_args.py
    change_job): a JobChange whose ``ok`` says whether Megatron-LM accepts them and makes the change."""
    from ..memory.megatron import MegatronTarget
    from ..memory.steps import Candidate, Rejected
    target = MegatronTarget(job, arch=checked["arch"], vocab=checked["vocab"])
    try:
        _, report = target.realize(job.config, target.start(), Candidate(tuple(overlays)), job.world_size,
                                   catalog=checked["catalog"])
    except Rejected as exc:
        from ..bridge.megatron_args import JobChange
        return JobChange(ok=False, reason=exc.reason)
    return report.megatron


def megatron_verdict(plan, job) -> str:
    """The plan's one fit verdict (memory/plan.py ``judge``: "unknown: ... not modelled" when the job sets flags
    that change memory and that the plan does not follow; run_megatron puts the job's flags outside megatron-core's
    parser into the plan's list); without a capacity, what is not modelled is still named."""
    if plan.capacity:
        return plan.judge().text
    if job.not_modelled:
        return ("no capacity given; not modelled: " + "; ".join(n.flag for n in job.not_modelled)
                + " change memory and the plan does not follow them")
    return "no capacity given"


MAX_NOTES_SHOWN = 40   # flags listed per section in the text (a job of thousands of unknown words is not a screenful)


def megatron_job_lines(job) -> list[str]:
    """What the job is and which of its flags the plan does not follow (not modelled, unknown, unsupported)."""
    lines = [f"Megatron-LM job: {job.form}, {job.family}, world size {job.world_size} ({job.world_from}), "
             f"parsed and validated by megatron-core 0.19.2's own arguments.py"]
    sections = (("an older Megatron-LM's names, read as that release ran them (megatron-core 0.19.2's words)",
                 getattr(job, "translated", ())),
                ("not modelled (change memory; the plan does not follow them)", job.not_modelled),
                ("unknown (not flags of megatron-core 0.19.2's parser; not planned)", job.unknown),
                ("unsupported (recognised, not carried into the plan)", job.unsupported))
    for title, notes in sections:
        if notes:
            lines.append(f"{title}:")
            lines += [f"  - {shown(n.text())}" for n in notes[:MAX_NOTES_SHOWN]]
            if len(notes) > MAX_NOTES_SHOWN:
                lines.append(f"  ... and {len(notes) - MAX_NOTES_SHOWN:,} more (--json lists them all)")
    if job.ignored:
        lines.append(f"ignored (no effect on memory): {len(job.ignored)} flags ({', '.join(job.ignored[:6])}"
                     + (", ..." if len(job.ignored) > 6 else "") + ")")
    return lines


def render_megatron(job, flags, verdict: str) -> str:
    head, *notes = megatron_job_lines(job)
    lines = [head, f"verdict: {verdict}", *notes]
    if flags is not None:
        lines.append("Megatron-LM flags for the overlays: " + (shown(flags.command_text()) or "none (already set)"))
        if flags.remove:
            lines.append("  and remove: " + " ".join(flags.remove))
        for target, value in flags.no_flag:
            lines.append(f"  no Megatron-LM flag for {target}={shown(value)}")
    return "\n".join(lines)
