"""``mbmem apply``: build a real recipe, apply overlays, validate with Bridge, print the changes and the verdict.

Order of work (issue 17, "Fast, quiet, visible"; issue 15 #14, "all violations at once"):
1. without Bridge: the recipe name, overlays, parameters and override syntax, all reported together
   (exit 2);
2. with Bridge: override fields and types together with every overlay rule (exit 1);
3. Bridge's validation: rejected (exit 1, the report still printed), incomplete (exit 3), passed (0).
"""

from __future__ import annotations

import sys

from ..core.errors import OverlayError, ValidationRejected
from .common import (
    EXIT_REJECTED,
    add_recipe_options,
    build_with_overrides,
    read_request,
    shown_changes,
    train_command,
)


def register(sub) -> None:
    p = sub.add_parser("apply", help="build a real recipe, apply overlays, validate with Bridge")
    add_recipe_options(p, world_size="optional")
    p.add_argument("--overlay", "-O", action="append", default=[], help="overlay names, comma-separated or repeated")
    p.add_argument("--param", action="append", default=[], metavar="OVERLAY.PARAM=VALUE")
    p.add_argument("--no-validate", action="store_true", help="skip Bridge's own validation")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout (errors included)")
    p.add_argument("-v", "--verbose", action="store_true", help="also list the parameters and every rule checked")
    p.set_defaults(fn=run)


def run(args) -> int:
    from ..api import apply_overlay, plan_overlays
    from ..bridge.recipes import model_summary, world_size_for
    from ..bridge.stack import progress
    from ..core.report import exit_code, render_json, render_text
    catalog, names, overrides, params = read_request(args)
    cfg, changes, problems = build_with_overrides(args.recipe, overrides)
    locked = {path: new for path, _, new in changes}
    world, assumed = world_size_for(cfg, args.world_size)
    if problems:  # the overlays' problems too, from the same planning the apply would do
        try:
            plan_overlays(cfg, names, params=params, world_size=world, locked=locked, catalog=catalog)
        except OverlayError as exc:
            problems += [p for p in exc.problems if p not in problems]
        raise OverlayError(problems)
    try:
        with progress("applying overlays" + ("" if args.no_validate else "; Bridge validates a copy")):
            report = apply_overlay(cfg, names, params=params, world_size=world, locked=locked,
                                   validate=not args.no_validate, catalog=catalog)
    except ValidationRejected as exc:  # rolled back; the report says what was tried and why Bridge refused
        report = exc.report
    if assumed:
        report.notes.append(f"world size {world} = TP*PP*CP assumed; pass --world-size N to validate for N GPUs")
    summary = model_summary(cfg)
    user = shown_changes(changes)
    code = exit_code(report)
    if args.json:
        print(render_json(report, user_changes=user, recipe=args.recipe, model=summary))
    else:
        print(render_text(report, recipe=args.recipe, summary=summary, world_size=world, user_changes=user,
                          verbose=args.verbose, next_step=_next_step(args, names, world, code)))
    if code == EXIT_REJECTED:
        print(f"mbmem apply: {report.validation.verdict.rstrip('.')}; nothing was changed", file=sys.stderr)
    return code


def _next_step(args, names: list[str], world: int, code: int) -> str:
    if code == EXIT_REJECTED:
        return "fix what Bridge reports above (an override with --set, or a different overlay), then run again"
    # --overlay-dir and MBMEM_OVERLAY_DIRS go in front, so the pasted command finds the user's overlays (issue 22 #2a)
    command = train_command(args.recipe, names, [*args.set, *(f"mem.{p}" for p in args.param)], world,
                            args.overlay_dir)
    return f"{command}\n  (the same with run.dry_run=true only plans; under torchrun on GPU nodes it trains)"
