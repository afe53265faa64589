"""``mbmem doctor INPUT...``: read what a job left behind — its logs and its PyTorch memory snapshots.

- Logs (files, globs, ``-``): an OOM or configuration failure is diagnosed (with the per-rank table when the
  job printed memory lines); a log without one but with per-rank memory lines gets the run report (per-rank
  headroom, fragmentation, plan against measured with ``--plan``, what can be turned off); docs/doctor.md.
- Snapshots (``*.pickle``, ``*.pickle.gz``, detected by content): the state at the OOM (or the peak) per
  device, by allocation site, against the plan (``cli/doctor_snapshot.py``).
Logs and snapshots may be given together: each part is reported, and the exit code is the more serious one.

Never imports Bridge or torch, except with ``--plan`` (which builds the recipe to compute each remedy's
saving, the planned per-rank peaks, and to validate the next command with the engine). Every option is
checked before any input is read (exit 2); inputs that are not regular files are reported and skipped, never
opened for a blocking read; text from the inputs is escaped before it is printed (core.text.shown).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from ..core.errors import OverlayError, Problem
from .common import UsageError, capacity_option, count_option, gpu_arch_option, margin_option, usage_problem

EPILOG = ("exit codes: 0 diagnosed or reported (an OOM diagnosis, or a run report from the memory lines: healthy, "
          "at_risk, fragmenting, over_provisioned); 2 usage error or unreadable input (binary, damaged gzip, missing, a "
          "fifo/device/folder, closed stdin, refused snapshot or --plot path) when nothing was found in the rest; 3 "
          "no OOM, known error or memory line found; 4 unsure (something says out of memory, but the numbers needed "
          "for a verdict are not in the input)")


def register(sub) -> None:
    p = sub.add_parser("doctor", help="diagnose an OOM or report a run's memory from job logs and snapshots",
                       epilog=EPILOG)
    p.add_argument("logs", nargs="+", metavar="INPUT",
                   help="log files, memory snapshots (.pickle, .pickle.gz), globs, or - for stdin (plain or gzip, "
                        "detected by content)")
    p.add_argument("--recipe", help="recipe name for the suggested command (else taken from the log)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="with --plan: a Bridge override the log does not show (added to the log's own)")
    p.add_argument("--world-size", metavar="N", help="with --plan: the number of GPUs (wins over the one the log shows)")
    p.add_argument("--plan", action="store_true",
                   help="also compute each remedy's saving and the planned per-rank peak with the memory model and "
                        "validate the next command on the recipe (imports Megatron Bridge; slow)")
    p.add_argument("--gpu-memory", metavar="SIZE",
                   help="capacity per GPU (e.g. 80GiB), when the input does not show it")
    p.add_argument("--gpu-arch", metavar="ARCH",
                   help="with --plan: the GPUs' compute capability (9: H100/H200, 10: B200/GB200, 8: A100) or their "
                        "name (default: the GPU the recipe is named for, ..._gb200_..., else 9)")
    p.add_argument("--margin", default="0.05", metavar="F",
                   help="headroom a healthy rank keeps free, a fraction of capacity in [0, 1) (default 0.05)")
    p.add_argument("--plot", metavar="FILE", help="run report: per-rank bars to FILE (.png, .pdf or .svg)")
    p.add_argument("--html", metavar="FILE", help="snapshot: an offline, self-contained HTML picture to FILE")
    p.add_argument("--against", metavar="SNAPSHOT", help="snapshot: compare with this one (what grew, by site)")
    p.add_argument("--what-if", action="append", metavar="SETTINGS",
                   help="snapshot: replay the trace under these allocator settings (e.g. expandable_segments:True, "
                        "or all); repeat for several")
    p.add_argument("--top", default="10", metavar="N", help="snapshot: how many allocation sites to show (default 10)")
    p.add_argument("--force", action="store_true", help="replace an existing --plot/--html file")
    p.add_argument("--json", action="store_true", help="machine-readable output (has schema_version)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="log: the reference detail too (the evidence lines, what was not first, what else is in the "
                        "log); the default prints what to act on")
    p.set_defaults(fn=run)


_problem = usage_problem  # the name this module's checks use

def checked_options(args) -> dict[str, Any]:
    """Every problem with the log half's options at once, before any input is read (exit 2)."""
    from ..bridge.overrides import syntax_problem
    from ..bridge.recipes import recipe_name_problem
    from ..core.outfile import output_problems
    problems: list[Problem] = []
    out: dict[str, Any] = {"capacity": None, "world": None, "margin": 0.05, "arch": None}
    if args.recipe is not None and (p := recipe_name_problem(args.recipe)):
        problems.append(p)
    for s in args.set:
        if p := syntax_problem(s):
            problems.append(p)
    found = {"capacity": capacity_option(args.gpu_memory), "margin": margin_option(args.margin),
             "arch": gpu_arch_option(args.gpu_arch)}
    if args.world_size is not None:
        found["world"] = count_option("--world-size", args.world_size)
    out.update({key: value for key, (value, problem) in found.items() if not problem})
    problems += [problem for _, problem in found.values() if problem]
    if args.plot is not None:
        from ..doctor.plot import PLOT_SUFFIXES
        problems += output_problems(args.plot, "--plot", force=args.force, suffixes=PLOT_SUFFIXES)
        import importlib.util
        if importlib.util.find_spec("matplotlib") is None:
            problems.append(_problem("--plot", args.plot, "--plot needs matplotlib, which is not installed",
                                     "pip install 'mbmem-overlays[plot]' (or pip install matplotlib), or drop --plot"))
    if problems:
        raise UsageError(problems)
    return out


def run(args) -> int:
    from ..doctor.read import expand, non_regular
    from ..doctor.snapshot import looks_like_snapshot
    checked = checked_options(args)
    paths = expand(args.logs)
    # Only regular files are opened (issue 22 #6): a fifo or device never reaches a reader that would block.
    snapshots = [p for p in paths if p != "-" and not non_regular(p) and looks_like_snapshot(p)]
    logs = [p for p in paths if p not in snapshots]
    if snapshots or args.against:
        from .doctor_snapshot import report as snapshot_report
        snap = snapshot_report(args, snapshots)
        if not logs:
            _print(args, snap.payload, snap.text)
            return snap.exit_code
    else:
        snap = None
    code, text, payload = run_logs(args, logs, checked)
    if snap is not None:  # logs and snapshots together: both reports; the more serious exit code
        payload["snapshot"] = snap.payload
        text = f"{text}\n\n{snap.text}"
        code = max(code, snap.exit_code, key=_seriousness)
    _print(args, payload, text)
    return code


def _print(args, payload: dict, text: str) -> None:
    from ..core.text import shown
    # JSON escapes control characters itself; text from a log is escaped here (issue 22 #9).
    from ..doctor.snapshot.render import json_safe   # strict JSON: no NaN, no integer json.dumps cannot write
    print(json.dumps(json_safe(payload), indent=2, default=repr, allow_nan=False) if args.json
          else shown(text, one_line=False))


def _seriousness(code: int) -> int:
    """2 (unreadable) > 4 (unsure) > 0 (diagnosed) > 3 (nothing found): a part that could not be read wins."""
    return {2: 3, 4: 2, 0: 1, 3: 0}.get(code, 4)


def replan_command(args, checked: dict[str, Any]) -> str:
    """This doctor command with --plan, every word quoted (the next command of a report whose advice needs
    the memory model to be sized)."""
    from ..doctor.command import render_tokens
    words = ["mbmem", *(w for d in args.overlay_dir for w in ("--overlay-dir", d)), "doctor",
             *("<saved-log>" if p == "-" else p for p in args.logs), "--plan"]
    if args.recipe:
        words += ["--recipe", args.recipe]
    for s in args.set:
        words += ["--set", s]
    if checked["world"]:
        words += ["--world-size", str(checked["world"])]
    if args.gpu_memory:
        words += ["--gpu-memory", args.gpu_memory]
    if checked.get("arch"):
        words += ["--gpu-arch", args.gpu_arch]
    if args.margin != "0.05":
        words += ["--margin", args.margin]
    return render_tokens(words)


def run_logs(args, logs: list[str], checked: dict[str, Any] | None = None) -> tuple[int, str, dict]:
    """(exit code, text, JSON object) for the log inputs."""
    from ..doctor.diagnose import diagnose
    from ..doctor.parse import scan
    from ..doctor.render import as_json, render
    checked = checked if checked is not None else checked_options(args)
    findings = scan(logs)
    planner = run_planner = None
    if args.plan:
        from ..doctor.plan import make_planner
        from ..doctor.run_plan import make_run_planner
        megatron = megatron_job(args, logs, findings, checked)
        planner = make_planner(args.recipe, megatron=megatron, arch=checked.get("arch"),
                               overlay_dirs=list(args.overlay_dir))
        run_planner = make_run_planner(args.recipe, list(args.set), checked["world"], list(args.overlay_dir),
                                       checked["margin"], logs=list(logs), arch=checked.get("arch"), megatron=megatron)
    d = diagnose(findings, args.recipe, planner=planner, capacity=checked["capacity"], margin=checked["margin"],
                 run_planner=run_planner, overlay_dirs=list(args.overlay_dir),
                 replan=None if args.plan else replan_command(args, checked))
    text, payload = render(d, findings, verbose=getattr(args, "verbose", False)), as_json(d, findings)
    code = d.exit_code
    if args.plot:
        code, text, payload = _plot(args, d, code, text, payload)
    return code, text, payload


def megatron_job(args, logs: list[str], findings, checked: dict[str, Any]) -> tuple | None:
    """With --plan and no recipe: (the Megatron-LM job the logs' arguments give, or None; why not), its arguments
    added to the findings where the log does not print them (doctor/megatron_plan.py); None with a recipe."""
    if args.recipe or findings.recipe:
        return None
    try:
        from ..doctor.megatron_plan import enrich, find_job
        found, why = find_job(list(logs), findings, checked["world"], checked.get("arch"))
    except ImportError as exc:
        return None, f"Megatron Bridge is not importable ({exc})"
    except Exception as exc:  # noqa: BLE001 — any failure to read the job is reported, never raised
        return None, f"the job's Megatron-LM arguments could not be read ({type(exc).__name__}: {' '.join(str(exc).split())[:300]})"
    if found is not None:
        enrich(findings, found)
    return found, why


def _plot(args, d, code: int, text: str, payload: dict) -> tuple[int, str, dict]:
    from pathlib import Path

    from ..core.outfile import write_output
    from ..doctor.plot import PLOT_SUFFIXES, render
    if not d.run:
        payload["plot"] = None
        return code, text + "\nplot: not written (no readable per-rank memory lines in the input)", payload
    title = f"per-rank memory: {d.kind}" + (f", hot rank {d.run['hot_label']}" if d.run.get("hot_label") is not None else "")
    image = render(d.run, title, Path(args.plot).suffix)
    try:
        write_output(args.plot, image, "--plot", force=args.force, suffixes=PLOT_SUFFIXES)
    except OverlayError as exc:  # the path changed since it was checked (a link or a file appeared)
        print(f"mbmem doctor: {exc}", file=sys.stderr)
        payload["plot"] = None
        payload["plot_error"] = str(exc)
        return 2, text + f"\nplot: not written: {exc}", payload
    payload["plot"] = args.plot
    return code, text + f"\nplot: {args.plot}", payload
