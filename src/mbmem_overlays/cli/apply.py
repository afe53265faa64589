"""``mbmem apply``: build a real recipe, apply overlays, validate with Bridge, print the changes and the verdict."""

from __future__ import annotations

from .common import EXIT_REJECTED, add_recipe_options, csv_list, recipe_with_overrides, split_sets


def register(sub) -> None:
    p = sub.add_parser("apply", help="build a real recipe, apply overlays, validate with Bridge")
    add_recipe_options(p, world_size="optional")
    p.add_argument("--overlay", "-O", action="append", default=[], help="overlay names, comma-separated or repeated")
    p.add_argument("--param", action="append", default=[], metavar="OVERLAY.PARAM=VALUE")
    p.add_argument("--no-validate", action="store_true", help="skip Bridge's own validation")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=run)


def run(args) -> int:
    from ..api import apply_overlay
    from ..bridge.recipes import model_summary, world_size_for
    from ..core.report import render_json, render_text
    cfg, locked, params = recipe_with_overrides(args.recipe, args.set)
    params.update(split_sets([f"mem.{p}" for p in args.param])[1])
    world, assumed = world_size_for(cfg, args.world_size)
    report = apply_overlay(cfg, csv_list(args.overlay), params=params, world_size=world, locked=locked,
                           validate=not args.no_validate, overlay_dirs=args.overlay_dir)
    if assumed:
        report.notes.append(f"world size {world} = TP*PP*CP assumed; pass --world-size N to validate for N GPUs")
    summary = model_summary(cfg)
    if args.json:
        print(render_json(report, recipe=args.recipe, model=summary))
    else:
        print(render_text(report, recipe=args.recipe, summary=summary, world_size=world))
    return 0 if report.validation is None or report.validation.ok else EXIT_REJECTED
