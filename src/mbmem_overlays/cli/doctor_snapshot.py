"""``mbmem doctor SNAPSHOT...``: the snapshot half of the doctor command (see cli/doctor.py).

Reads each snapshot safely (doctor/snapshot/load.py: no class is ever constructed, size-capped, gzip), reports
every device, the state at the OOM replayed from the trace (or the peak), the live memory by allocation site
and category, the verdict and a checked next command; ``--against B`` compares two runs; ``--html FILE``
writes an offline page; ``--plan --recipe R`` sets the memory model's plan beside the snapshot (the only
option that imports Megatron Bridge).

Exit codes (the doctor's): 0 diagnosed or reported; 2 unreadable or refused input, or a bad option; 4 unsure (an
OOM whose failed request is not in the snapshot). With several files the most serious code wins (2 > 4 > 0).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

MAX_TOP = 1000
SERIOUS = {2: 3, 4: 2, 0: 1}


@dataclass(frozen=True)
class Outcome:
    exit_code: int
    text: str
    payload: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Options:
    top: int
    capacity: float | None
    margin: float
    world: int | None
    overrides: tuple[str, ...]
    params: dict[str, Any]


def _usage(args, message: str) -> Outcome:
    from ..core.report import error_dict
    from ..core.text import shown
    text = f"mbmem doctor: {shown(message, one_line=False)}"
    return Outcome(2, text, error_dict(message, 2, kind="usage") if args.json else {})


def _options(args, paths: list[str]) -> Options | str:
    """Every option checked before any file is read; a message (exit 2) for the first bad one."""
    from ..core.outfile import output_problems
    from .common import capacity_option, count_option, margin_option
    (top, bad_top), (capacity, bad_capacity) = count_option("--top", str(args.top), MAX_TOP), \
        capacity_option(args.gpu_memory)
    margin, bad_margin = margin_option(args.margin)
    world, bad_world = count_option("--world-size", args.world_size) if args.world_size is not None else (None, None)
    for problem in (bad_top, bad_capacity, bad_margin, bad_world):
        if problem:
            return f"{problem.message}; {problem.fix}"
    if args.plan and not args.recipe:
        return "--plan needs --recipe R (a snapshot does not name its recipe), e.g. --plan --recipe llama3_8b_pretrain"
    if args.recipe is not None:
        from ..bridge.recipes import recipe_name_problem
        problem = recipe_name_problem(args.recipe)
        if problem:
            return f"--recipe: {problem.message}"
    overrides, params = [], {}
    for item in args.set or []:
        key, sep, raw = item.partition("=")
        if not sep:
            return f"--set {item!r} has no '=': write KEY=VALUE, e.g. --set model.tensor_model_parallel_size=4"
        if key.startswith("mem.") and key.count(".") >= 2:
            from ..core.values import parse_value
            params[key[4:]] = parse_value(raw)
            continue
        from ..bridge.overrides import syntax_problem
        problem = syntax_problem(item)
        if problem:
            return f"--set: {problem.message}"
        overrides.append(item)
    if args.html:
        problems = output_problems(args.html, "--html", force=args.force, suffixes=(".html", ".htm"))
        if problems:
            return f"--html {args.html}: {problems[0].message}; {problems[0].fix}"
    if args.plot:
        from ..doctor.read import expand
        if len(expand(args.logs)) == len(paths):
            return "--plot draws the run report of job logs; for a snapshot use --html FILE"
    if getattr(args, "what_if", None):
        from ..doctor.snapshot.whatif import check_values
        if args.against:
            return "--what-if replays one snapshot; run it without --against"
        problem = check_values(args.what_if)
        if problem:
            return problem
    if args.against and args.html:
        return "--html draws one snapshot; run it without --against"
    if args.against and len(paths) != 1:
        return (f"--against compares one snapshot with another: give exactly one snapshot beside it "
                f"(got {len(paths)})")
    return Options(top, capacity, margin, world, tuple(overrides), params)


@dataclass
class _Read:
    path: str
    error: str | None = None
    report: Any = None
    snap: Any = None
    what_if: Any = None


def _read(path: str, capacity: float | None, keep: bool) -> _Read:
    from ..doctor.snapshot.analyze import analyze
    from ..doctor.snapshot.load import SnapshotError, load
    from ..doctor.snapshot.model import MalformedSnapshot, normalize
    from ..core.text import shown
    try:
        loaded = load(path)
        snap = normalize(loaded.data, loaded.budget_left)
    except SnapshotError as exc:
        return _Read(path, str(exc))
    except MalformedSnapshot as exc:
        return _Read(path, f"{shown(path)} is not a memory snapshot: {exc}")
    report = analyze(snap, path, loaded.file_bytes, capacity)
    return _Read(path, None, report, snap if keep else None)


def _headroom(report, opts: Options) -> list[str]:
    m = report.moment
    if opts.capacity is None or m is None or report.kind != "none":
        return []
    from ..doctor.snapshot.analyze import gib
    free = opts.capacity - m.totals.reserved
    line = (f"headroom at the peak on device {m.device}: {gib(free)} of the {gib(opts.capacity)} GPU not reserved by "
            f"PyTorch ({free / opts.capacity:.0%}; the margin asked is {opts.margin:.0%})")
    if free < opts.margin * opts.capacity:
        line += ": below the margin, an OOM risk (the CUDA context and NCCL buffers need room too)"
    return [line]


def report(args, paths: list[str]) -> Outcome:
    """Read the snapshots in ``paths`` (and ``args.against``) and report them."""
    from ..core.errors import OverlayError
    from ..core.text import shown
    from ..doctor.snapshot import advice as A
    from ..doctor.snapshot import render as R
    if not paths:
        return _usage(args, f"--against {args.against!r} needs a snapshot to compare: give one before it"
                      if args.against else "no snapshot given")
    opts = _options(args, paths)
    if isinstance(opts, str):
        return _usage(args, opts)
    if args.against:
        return _compare(args, paths[0], opts)
    reads, best = [], None
    for path in paths:
        what_if = getattr(args, "what_if", None)
        r = _read(path, opts.capacity, keep=bool(args.html or what_if))
        if what_if and r.snap is not None:
            from ..doctor.snapshot.whatif import analyse
            r.what_if = analyse(r.snap, what_if, None if opts.capacity is None else int(opts.capacity),
                                keep_choices=bool(args.json))
            if not args.html:
                r.snap = None     # the replay is done; the file's objects are not needed any more
        reads.append(r)
        if r.report is not None and (best is None or _rank(r) > _rank(best)):
            if best is not None:
                best.snap = None
            best = r
        elif r.snap is not None and r is not best:
            r.snap = None
    plan = None
    if args.plan and best is not None:
        from ..doctor.snapshot.plan import compare_plan
        from .common import gpu_arch_option
        plan = compare_plan(args.recipe, list(opts.overrides), opts.params, opts.world, best.report.moment,
                            arch=gpu_arch_option(getattr(args, "gpu_arch", None))[0])
    texts, objects, codes = [], [], []
    for r in reads:
        if r.error:
            texts.append(f"snapshot: {shown(r.path)}\nunreadable (exit 2): {r.error}")
            from ..core.report import error_dict
            objects.append(error_dict(r.error, 2, file=r.path, kind="unreadable"))
            codes.append(2)
            continue
        validator = plan.validator if plan is not None and r is best else None
        adv = A.advise(r.report, args.recipe, validator)
        if r.what_if is not None:
            adv = A.with_replay(adv, r.report, r.what_if)
        plan_lines = list(plan.lines) if plan is not None and r is best else None
        text = R.render(r.report, adv, opts.top, plan_lines)
        extra = _headroom(r.report, opts)
        if r.what_if is not None:
            extra.append(R.render_what_if(r.what_if))
        texts.append(text + ("\n" + "\n".join(extra) if extra else ""))
        obj = R.as_json(r.report, adv, opts.top, plan.data if plan is not None and r is best else None)
        if r.what_if is not None:
            obj["what_if"] = R.json_safe(R.what_if_json(r.what_if))
        if extra and not extra[0].startswith("what if"):
            obj["headroom"] = extra[0]
        objects.append(obj)
        codes.append(R.exit_code(r.report))
    code = max(codes, key=SERIOUS.__getitem__)
    if len(reads) > 1:
        texts.insert(0, _summary(reads, best))
    if args.html and best is not None:
        from ..core.outfile import write_output
        from ..doctor.snapshot.html import page
        try:
            write_output(args.html, page(best.snap, best.report, texts[reads.index(best)], opts.top), "--html",
                         force=args.force, suffixes=(".html", ".htm"))
        except OverlayError as exc:
            return _usage(args, f"--html: {exc.problems[0].message}; {exc.problems[0].fix}")
        texts.append(f"html: {shown(args.html)} (device {best.report.lead} of {shown(best.path)}; offline, "
                     "self-contained)")
    lead = objects[reads.index(best)] if best is not None else objects[0]
    payload = dict(lead)
    if len(objects) > 1:
        payload["snapshots"] = objects
    payload["exit_code"] = code
    if args.html and best is not None:
        payload["html"] = args.html
    return Outcome(code, "\n\n".join(texts), payload)


def _summary(reads: list[_Read], best: _Read | None) -> str:
    """One line per file, the lead one marked: the several-ranks view before the details."""
    from ..core.text import shown
    from ..doctor.snapshot.analyze import gib
    rows = [f"{len(reads)} snapshots (* leads; details follow):",
            f"  {'rank':>5}  {'kind':<16} {'device':>6} {'allocated':>11} {'reserved':>11}  file"]
    for r in reads:
        mark = "*" if r is best else " "
        if r.error:
            rows.append(f"{mark} {'-':>5}  {'unreadable':<16} {'-':>6} {'-':>11} {'-':>11}  {shown(r.path)}")
            continue
        rep, m = r.report, r.report.moment
        rank = "-" if rep.rank is None else str(rep.rank)
        rows.append(f"{mark} {rank:>5}  {rep.kind:<16} {m.device if m else '-':>6} "
                    f"{gib(m.totals.allocated) if m else '-':>11} {gib(m.totals.reserved) if m else '-':>11}  "
                    f"{shown(r.path)}")
    return "\n".join(rows)


def _rank(r: _Read) -> tuple:
    """Which file leads the report (and gets the --html page): an OOM first, then the largest allocation."""
    rep = r.report
    m = rep.moment
    return (rep.oom is not None, rep.kind == "oom_unknown", m.totals.allocated if m else 0)


def _compare(args, path: str, opts: Options) -> Outcome:
    from ..core.report import error_dict
    from ..doctor.snapshot.analyze import compare
    from ..doctor.snapshot.render import comparison_json, render_comparison
    if not os.path.exists(args.against) and not os.path.islink(args.against):
        return _usage(args, f"--against {args.against}: no such file")
    a, b = _read(path, opts.capacity, False), _read(args.against, opts.capacity, False)
    bad = [r for r in (a, b) if r.error]
    if bad:
        text = "\n".join(f"unreadable (exit 2): {r.error}" for r in bad)
        return Outcome(2, text, error_dict("; ".join(r.error for r in bad), 2, kind="unreadable",
                                           files=[r.path for r in bad]) if args.json else {})
    c = compare(a.report, b.report)
    return Outcome(0, render_comparison(c, opts.top), comparison_json(c, opts.top) if args.json else {})
