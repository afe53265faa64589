"""``mbmem doctor LOG...``: diagnose an OOM or configuration failure from job logs.

Never imports Bridge or torch, except with ``--plan`` (which builds the recipe to compute each remedy's
saving and to validate the next command with the engine). Exit codes, one per verdict (README, "OOM doctor"):
0 diagnosed, 2 unreadable input, 3 no OOM found, 4 unsure (an OOM whose numbers the log does not show).
"""

from __future__ import annotations

import json

EPILOG = ("exit codes: 0 diagnosed; 2 unreadable input (binary, missing, closed stdin); 3 no OOM or known error "
          "found; 4 unsure (an OOM was found but the numbers needed for a verdict are not in the log)")


def register(sub) -> None:
    p = sub.add_parser("doctor", help="diagnose an OOM or configuration failure from job logs", epilog=EPILOG)
    p.add_argument("logs", nargs="+", help="log files, globs, or - for stdin (plain or gzip, detected by content)")
    p.add_argument("--recipe", help="recipe name for the suggested command (else taken from the log)")
    p.add_argument("--plan", action="store_true",
                   help="also compute each remedy's saving with the memory model and validate the next command on "
                        "the recipe (imports Megatron Bridge; slow)")
    p.add_argument("--json", action="store_true", help="machine-readable output (has schema_version)")
    p.set_defaults(fn=run)


def run(args) -> int:
    from ..doctor.diagnose import diagnose
    from ..doctor.parse import scan
    from ..doctor.render import as_json, render
    findings = scan(args.logs)
    planner = None
    if args.plan:
        from ..doctor.plan import make_planner
        planner = make_planner(args.recipe)
    d = diagnose(findings, args.recipe, planner=planner)
    if args.json:
        print(json.dumps(as_json(d, findings), indent=2, default=repr))
    else:
        print(render(d, findings))
    return d.exit_code
