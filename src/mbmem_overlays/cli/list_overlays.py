"""``mbmem list``: every overlay, built-in and user, with its summary (never imports Bridge)."""

from __future__ import annotations

from ..core.catalog import Catalog


def register(sub) -> None:
    p = sub.add_parser("list", help="list overlays")
    p.set_defaults(fn=run)


def run(args) -> int:
    cat = Catalog(args.overlay_dir)
    width = max(len(n) for n in cat.names())
    for name in cat.names():
        spec = cat.specs[name]
        alias = f" (alias: {', '.join(spec.aliases)})" if spec.aliases else ""
        origin = "" if spec.builtin else f"  [user: {spec.path}]"
        print(f"{name:<{width}}  {spec.summary}{alias}{origin}")
    return 0
