"""``mbmem``: one thin module per command; ``list``, ``explain``, ``doctor`` and ``slurm --no-validate``
never import Megatron Bridge or torch (each command imports what it needs when it runs)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..core.errors import OverlayError
from . import apply, doctor, explain, list_overlays, plan, recommend, slurm
from .common import EXIT_REJECTED

COMMANDS = (list_overlays, explain, apply, doctor, slurm, plan, recommend)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mbmem", description="Validated memory overlays for Megatron Bridge.")
    p.add_argument("--overlay-dir", action="append", default=[],
                   help="extra directory of overlay YAML files (also MBMEM_OVERLAY_DIRS)")
    sub = p.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.register(sub)
    return p


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
