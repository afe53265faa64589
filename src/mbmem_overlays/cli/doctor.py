"""``mbmem doctor INPUT...``: read what a job left behind — its logs and its PyTorch memory snapshots.

- Logs (files, globs, ``-``): an OOM or configuration failure is diagnosed; a log with per-rank memory lines
  gets the run report (per-rank headroom, fragmentation, plan against measured, what can be turned off).
- Snapshots (``*.pickle``, ``*.pickle.gz``, detected by content): the state at the OOM (or the peak) per
  device, by allocation site, against the plan (``cli/doctor_snapshot.py``).
Logs and snapshots may be given together: each part is reported, and the exit code is the more serious one.

Never imports Bridge or torch, except with ``--plan`` (which builds the recipe to compute each remedy's
saving and to validate the next command with the engine). Exit codes: docs/exit-codes.md.
"""

from __future__ import annotations

import json

EPILOG = ("exit codes: 0 diagnosed or reported; 2 unreadable input (binary, missing, closed stdin, refused "
          "snapshot); 3 no OOM or known error found and no memory lines to report; 4 unsure (an OOM was found but "
          "the numbers needed for a verdict are not in the input)")


def register(sub) -> None:
    p = sub.add_parser("doctor", help="diagnose an OOM or report a run's memory from job logs and snapshots",
                       epilog=EPILOG)
    p.add_argument("logs", nargs="+", metavar="INPUT",
                   help="log files, memory snapshots (.pickle, .pickle.gz), globs, or - for stdin (plain or gzip, "
                        "detected by content)")
    p.add_argument("--recipe", help="recipe name for the suggested command (else taken from the log)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="with --plan: a Bridge override the log does not show (added to the log's own)")
    p.add_argument("--world-size", metavar="N", help="with --plan: the number of GPUs, when the log does not show it")
    p.add_argument("--plan", action="store_true",
                   help="also compute each remedy's saving and the planned per-rank peak with the memory model and "
                        "validate the next command on the recipe (imports Megatron Bridge; slow)")
    p.add_argument("--gpu-memory", metavar="SIZE",
                   help="capacity per GPU (e.g. 80GiB), when the input does not show it")
    p.add_argument("--margin", default="0.05", metavar="F",
                   help="headroom a healthy rank keeps free, a fraction of capacity in [0, 1) (default 0.05)")
    p.add_argument("--plot", metavar="FILE", help="run report: per-rank bars to FILE (.png, .pdf or .svg)")
    p.add_argument("--html", metavar="FILE", help="snapshot: an offline, self-contained HTML picture to FILE")
    p.add_argument("--against", metavar="SNAPSHOT", help="snapshot: compare with this one (what grew, by site)")
    p.add_argument("--top", default="10", metavar="N", help="snapshot: how many allocation sites to show (default 10)")
    p.add_argument("--force", action="store_true", help="replace an existing --plot/--html file")
    p.add_argument("--json", action="store_true", help="machine-readable output (has schema_version)")
    p.set_defaults(fn=run)


def run(args) -> int:
    from ..doctor.read import expand
    from ..doctor.snapshot import looks_like_snapshot
    paths = expand(args.logs)
    snapshots = [p for p in paths if p != "-" and looks_like_snapshot(p)]
    logs = [p for p in paths if p not in snapshots]
    if snapshots or args.against:
        from .doctor_snapshot import report as snapshot_report
        snap = snapshot_report(args, snapshots)
        if not logs:
            print(json.dumps(snap.payload, indent=2) if args.json else snap.text)
            return snap.exit_code
    else:
        snap = None
    code, text, payload = run_logs(args, logs)
    if snap is not None:  # logs and snapshots together: both reports; the more serious exit code
        payload["snapshot"] = snap.payload
        text = f"{text}\n\n{snap.text}"
        code = max(code, snap.exit_code, key=_seriousness)
    print(json.dumps(payload, indent=2, default=repr) if args.json else text)
    return code


def _seriousness(code: int) -> int:
    """2 (unreadable) > 4 (unsure) > 0 (diagnosed) > 3 (nothing found): a part that could not be read wins."""
    return {2: 3, 4: 2, 0: 1, 3: 0}.get(code, 4)


def run_logs(args, logs: list[str]) -> tuple[int, str, dict]:
    """(exit code, text, JSON object) for the log inputs."""
    from ..doctor.diagnose import diagnose
    from ..doctor.parse import scan
    from ..doctor.render import as_json, render
    findings = scan(logs)
    planner = None
    if args.plan:
        from ..doctor.plan import make_planner
        planner = make_planner(args.recipe)
    d = diagnose(findings, args.recipe, planner=planner)
    return d.exit_code, render(d, findings), as_json(d, findings)
