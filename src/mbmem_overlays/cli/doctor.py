"""``mbmem doctor LOG...``: diagnose an OOM or configuration failure from job logs (never imports Bridge)."""

from __future__ import annotations

import json
from dataclasses import asdict


def register(sub) -> None:
    p = sub.add_parser("doctor", help="diagnose an OOM or configuration failure from job logs")
    p.add_argument("logs", nargs="+", help="log files, globs, or - for stdin (gzip is detected)")
    p.add_argument("--recipe", help="recipe name for the suggested command (else taken from the log)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=run)


def run(args) -> int:
    from ..doctor.diagnose import diagnose
    from ..doctor.parse import scan
    from ..doctor.render import render
    findings = scan(args.logs)
    d = diagnose(findings, args.recipe)
    if args.json:
        print(json.dumps({**asdict(d), "files": findings.files, "problems": findings.problems,
                          "bytes_read": findings.bytes_read}, indent=2, default=repr))
    else:
        print(render(d, findings))
    return {"none": 3, "unreadable": 2}.get(d.kind, 0)
