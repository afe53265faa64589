"""``mbmem explain NAME``: what an overlay sets, its parameters, the rules that read those fields, sources."""

from __future__ import annotations


from ..core import rules
from ..core.catalog import USER_DIRS_ENV, OverlaySpec
from ..core.errors import OverlayError
from ..core.report import SCHEMA_VERSION, json_text
from ..core.text import quoted_word, shown
from ..core.values import hydra_text
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
        print(json_text(as_dict(spec), default=str))
        return 0
    # A user overlay's texts (summary, help, values, sources, file name) are shown escaped, each on its line.
    for line in describe(spec):
        print(shown(line, one_line=False))
    return 0


def describe(spec: OverlaySpec) -> list[str]:
    """The text of ``mbmem explain``, line by line; user text is made one line each (``shown``)."""
    one = shown
    lines = [f"{spec.name}: {one(spec.summary)}"]
    if spec.aliases:
        lines.append(f"aliases: {', '.join(spec.aliases)}")
    lines.append(f"file: {one(spec.path)}")
    # a user overlay is found by train.py through MBMEM_OVERLAY_DIRS (the folder that holds its mem/)
    where = "" if spec.builtin else f"{USER_DIRS_ENV}={quoted_word(str(spec.path.resolve().parent.parent))} "
    lines.append(f"use: {where}python train.py recipe=<recipe> +mem={spec.name}"
                 + "".join(" " + quoted_word(f"mem.{spec.name}.{p}={hydra_text(spec.params[p].default)}")
                           for p in spec.params))
    if spec.params:
        lines.append("parameters:")
        for p in spec.params.values():
            extra = f", choices {list(p.choices)}" if p.choices else ""
            extra += f", min {p.min}" if p.min is not None else ""
            extra += f", max {p.max}" if p.max is not None else ""
            lines.append(f"  {p.name} ({p.type}, default {p.default!r}{extra}): {one(p.help)}")
    if spec.set:
        lines.append("sets:")
        lines += [f"  {path} = {one(value)}" for path, value in spec.set.items()]
    if spec.env:
        lines.append("environment:")
        for var, value in spec.env.items():
            desc = ", ".join(f"{k}:{v}" for k, v in value.items()) + " (merged key-wise)" if isinstance(value, dict) else value
            lines.append(f"  {var}: {one(desc)}")
    if spec.name in rules.RESOLVERS:
        lines.append(f"logic: {rules.RESOLVERS[spec.name].doc}")
    related = related_checks(spec)
    if related:
        lines.append("rules (checked on every apply):")
        lines += [f"  {c.id} [enforced by {c.enforced_by}] — {c.source}" for c in related]
    lines.append("sources:")
    lines += [f"  {one(s)}" for s in spec.sources]
    if spec.effect:
        lines.append(f"documented effect: {one(spec.effect, one_line=False)}")
    return lines
