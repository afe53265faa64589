"""``mbmem``: list, explain, apply (and plan, doctor, slurm, recommend).

``list``, ``explain``, ``doctor`` and ``slurm`` rendering never import Megatron Bridge.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from .catalog import Catalog
from .errors import OverlayError, Problem

EXIT_REJECTED = 1
EXIT_USAGE = 2


def _csv(values: list[str] | None) -> list[str]:
    out: list[str] = []
    for v in values or []:
        out += [x.strip() for x in v.split(",") if x.strip()]
    return out


def split_sets(sets: list[str]) -> tuple[list[str], dict[str, object]]:
    """``--set`` values: ``mem.<overlay>.<param>=v`` are overlay parameters, the rest Bridge overrides."""
    from .hydra_args import parse_value
    overrides, params = [], {}
    for s in sets:
        key, sep, raw = s.partition("=")
        if key.startswith("mem.") and sep and key.count(".") >= 2:
            params[key[4:]] = parse_value(raw)
        else:
            overrides.append(s)
    return overrides, params


def cmd_list(args) -> int:
    cat = Catalog(args.overlay_dir)
    width = max(len(n) for n in cat.names())
    for name in cat.names():
        spec = cat.specs[name]
        alias = f" (alias: {', '.join(spec.aliases)})" if spec.aliases else ""
        origin = "" if spec.builtin else f"  [user: {spec.path}]"
        print(f"{name:<{width}}  {spec.summary}{alias}{origin}")
    return 0


def cmd_explain(args) -> int:
    from . import rules
    cat = Catalog(args.overlay_dir)
    spec = cat.resolve(args.name)
    print(f"{spec.name}: {spec.summary}")
    if spec.aliases:
        print(f"aliases: {', '.join(spec.aliases)}")
    print(f"file: {spec.path}")
    print(f"use: python train.py recipe=<recipe> +mem={spec.name}"
          + "".join(f" mem.{spec.name}.{p}={json.dumps(spec.params[p].default)}" for p in spec.params))
    if spec.params:
        print("parameters:")
        for p in spec.params.values():
            extra = f", choices {list(p.choices)}" if p.choices else ""
            extra += f", min {p.min}" if p.min is not None else ""
            extra += f", max {p.max}" if p.max is not None else ""
            print(f"  {p.name} ({p.type}, default {p.default!r}{extra}): {p.help}")
    if spec.set:
        print("sets:")
        for path, value in spec.set.items():
            print(f"  {path} = {value}")
    if spec.env:
        print("environment:")
        for var, value in spec.env.items():
            desc = ", ".join(f"{k}:{v}" for k, v in value.items()) + " (merged key-wise)" if isinstance(value, dict) else value
            print(f"  {var}: {desc}")
    if spec.name in rules.RESOLVERS:
        print(f"logic: {(rules.RESOLVERS[spec.name].__doc__ or '').strip()}")
    related = [c for c in rules.CHECKS if any(f.split('.')[-1] in c.fn.__code__.co_consts.__repr__()
                                                for f in list(spec.set) + list(spec.env))]
    if related:
        print("rules (checked on every apply):")
        for c in related:
            print(f"  {c.id} [enforced by {c.enforced_by}] — {c.source}")
    print("sources:")
    for s in spec.sources:
        print(f"  {s}")
    if spec.effect:
        print(f"documented effect: {spec.effect}")
    return 0


def cmd_apply(args) -> int:
    from . import bridge
    from .engine import apply_overlay
    from .report import render_json, render_text
    overrides, params = split_sets(args.set)
    params.update({k: v for k, v in split_sets([f"mem.{p}" for p in args.param])[1].items()})
    cfg = bridge.load_recipe(args.recipe)
    locked = bridge.apply_overrides(cfg, overrides)
    world, assumed = bridge.world_size_for(cfg, args.world_size)
    report = apply_overlay(cfg, _csv(args.overlay), params=params, world_size=world, locked=locked,
                           validate=not args.no_validate, overlay_dirs=args.overlay_dir)
    if assumed:
        report.notes.append(f"world size {world} = TP*PP*CP assumed; pass --world-size N to validate for N GPUs")
    summary = bridge.model_summary(cfg)
    if args.json:
        print(render_json(report, recipe=args.recipe, model=summary))
    else:
        print(render_text(report, recipe=args.recipe, summary=summary, world_size=world))
    return 0 if report.validation is None or report.validation.ok else EXIT_REJECTED


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mbmem", description="Validated memory overlays for Megatron Bridge.")
    p.add_argument("--overlay-dir", action="append", default=[],
                   help="extra directory of overlay YAML files (also MBMEM_OVERLAY_DIRS)")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("list", help="list overlays")
    s.set_defaults(fn=cmd_list)
    s = sub.add_parser("explain", help="what an overlay sets, its parameters, rules and sources")
    s.add_argument("name")
    s.set_defaults(fn=cmd_explain)
    s = sub.add_parser("apply", help="build a real recipe, apply overlays, validate with Bridge")
    s.add_argument("--recipe", required=True, help="recipes/ name (llama3_70b_pretrain) or Bridge recipe function (llama3_70b_pretrain_config)")
    s.add_argument("--overlay", "-O", action="append", default=[], help="overlay names, comma-separated or repeated")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="Bridge override (model.tensor_model_parallel_size=4) or overlay parameter (mem.cpu_offload.num_layers=2)")
    s.add_argument("--param", action="append", default=[], metavar="OVERLAY.PARAM=VALUE")
    s.add_argument("--world-size", type=int, default=None)
    s.add_argument("--no-validate", action="store_true", help="skip Bridge's own validation")
    s.add_argument("--json", action="store_true")
    s.set_defaults(fn=cmd_apply)
    for extra in _extra_commands():
        extra(sub)
    return p


def _extra_commands():
    # Commands living in their own modules register here (each a function taking the subparsers).
    from . import extra_commands
    return extra_commands.REGISTER


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except OverlayError as exc:
        print(f"mbmem {args.command}: {exc}", file=sys.stderr)
        return EXIT_REJECTED
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
