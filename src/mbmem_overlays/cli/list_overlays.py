"""``mbmem list``: every overlay, built-in and user, with its summary (never imports Bridge)."""

from __future__ import annotations

import sys

from ..core.report import SCHEMA_VERSION, json_text
from ..core.text import shown
from .common import catalog_for


def register(sub) -> None:
    p = sub.add_parser("list", help="list overlays")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(fn=run)


def run(args) -> int:
    cat = catalog_for(args.overlay_dir)
    if args.json:
        print(json_text({"schema_version": SCHEMA_VERSION, "ok": True, "exit_code": 0, "overlays": [
            {"name": name, "summary": cat.specs[name].summary, "aliases": list(cat.specs[name].aliases),
             "builtin": cat.specs[name].builtin, "path": str(cat.specs[name].path)} for name in cat.names()],
            "problems": [p.render() for p in cat.problems]}, default=str))
        return 0
    for problem in cat.problems:  # broken user overlay files: listed, never fatal for the others
        print(f"mbmem list: warning: {problem.render()}", file=sys.stderr)
    width = max(len(n) for n in cat.names())
    for name in cat.names():
        spec = cat.specs[name]
        alias = f" (alias: {', '.join(spec.aliases)})" if spec.aliases else ""
        origin = "" if spec.builtin else f"  [user: {shown(spec.path)}]"
        print(f"{name:<{width}}  {shown(spec.summary)}{alias}{origin}")  # a user's summary: one line, escaped
    return 0
