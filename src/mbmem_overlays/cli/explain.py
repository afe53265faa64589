"""``mbmem explain NAME``: what an overlay sets, its parameters, the rules that read those fields, sources."""

from __future__ import annotations

import json

from ..core import rules
from ..core.catalog import Catalog, OverlaySpec


def register(sub) -> None:
    p = sub.add_parser("explain", help="what an overlay sets, its parameters, rules and sources")
    p.add_argument("name")
    p.set_defaults(fn=run)


def touched(spec: OverlaySpec) -> set[str]:
    """Config paths and ``$VARS`` the overlay may set: its YAML ``set``/``env`` and its resolver's ``writes``."""
    resolver = rules.RESOLVERS.get(spec.name)
    return {*spec.set, *(f"${var}" for var in spec.env), *(resolver.writes if resolver else ())}


def related_checks(spec: OverlaySpec) -> list[rules.Check]:
    """The checks that read a field the overlay sets (each check declares what it reads)."""
    fields = touched(spec)
    return [c for c in rules.CHECKS if fields & set(c.reads)]


def run(args) -> int:
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
        print(f"logic: {rules.RESOLVERS[spec.name].doc}")
    related = related_checks(spec)
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
