"""``mbmem explain NAME``: what an overlay sets, its parameters, the rules that read those fields, sources."""

from __future__ import annotations

import json

from ..core import rules
from ..core.catalog import OverlaySpec
from ..core.errors import OverlayError
from ..core.report import SCHEMA_VERSION
from .common import UsageError, catalog_for


def register(sub) -> None:
    p = sub.add_parser("explain", help="what an overlay sets, its parameters, rules and sources")
    p.add_argument("name")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(fn=run)


def touched(spec: OverlaySpec) -> set[str]:
    """Config paths and ``$VARS`` the overlay may set: its YAML ``set``/``env`` and its resolver's ``writes``."""
    resolver = rules.RESOLVERS.get(spec.name)
    return {*spec.set, *(f"${var}" for var in spec.env), *(resolver.writes if resolver else ())}


def related_checks(spec: OverlaySpec) -> list[rules.Check]:
    """The checks that read a field the overlay sets (each check declares what it reads)."""
    fields = touched(spec)
    return [c for c in rules.CHECKS if fields & set(c.reads)]


def as_dict(spec: OverlaySpec) -> dict:
    return {"schema_version": SCHEMA_VERSION, "ok": True, "exit_code": 0, "name": spec.name,
            "summary": spec.summary, "aliases": list(spec.aliases), "file": str(spec.path),
            "parameters": [{"name": p.name, "type": p.type, "default": p.default, "help": p.help,
                            "choices": p.choices, "min": p.min, "max": p.max} for p in spec.params.values()],
            "sets": dict(spec.set), "environment": dict(spec.env),
            "rules": [{"id": c.id, "enforced_by": c.enforced_by, "source": c.source} for c in related_checks(spec)],
            "sources": list(spec.sources), "effect": spec.effect}


def run(args) -> int:
    cat = catalog_for(args.overlay_dir)
    try:
        spec = cat.resolve(args.name)
    except OverlayError as exc:  # an unknown name is a usage error (exit 2), with the close matches
        raise UsageError(exc.problems) from None
    if getattr(args, "json", False):
        print(json.dumps(as_dict(spec), indent=2, default=str))
        return 0
    print(f"{spec.name}: {spec.summary}")
    if spec.aliases:
        print(f"aliases: {', '.join(spec.aliases)}")
    print(f"file: {spec.path}")
    print(f"use: python train.py recipe=<recipe> +mem={spec.name}"
          + "".join(f" mem.{spec.name}.{p}={json.dumps(spec.params[p].default, default=str)}" for p in spec.params))
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
