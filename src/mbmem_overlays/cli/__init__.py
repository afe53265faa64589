"""``mbmem``: one thin module per command; ``list``, ``explain``, ``doctor`` and ``slurm --no-validate``
never import Megatron Bridge or torch (each command imports what it needs when it runs).

Every failure is a message and an exit code (README "Exit codes"), never a traceback; under
``--json`` the failure is also a JSON object on stdout, so stdout is never empty. Messages carry user text and
are escaped (core/text.py); a closed or full stdout is one line on stderr and exit code 74 (core/console.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..bridge.stack import EXIT_STACK, StackError
from ..core import console
from ..core.errors import OverlayError
from ..core.sizes import SizeError
from ..core.text import shown
from . import apply, args, check_stack, doctor, explain, list_overlays, plan, recommend, slurm
from .common import EXIT_REJECTED, EXIT_USAGE, UsageError, needs_cwd

COMMANDS = (list_overlays, explain, apply, args, doctor, slurm, plan, recommend, check_stack)


class CommandLineError(Exception):
    def __init__(self, parser: argparse.ArgumentParser, message: str):
        self.parser, self.message = parser, message
        super().__init__(message)


class Parser(argparse.ArgumentParser):
    """argparse, but a bad command line raises instead of exiting, so ``main`` can answer in JSON too."""

    def error(self, message: str):
        raise CommandLineError(self, message)

    def _print_message(self, message: str, file=None) -> None:
        """argparse's, without its ``except OSError: pass``: ``--help`` to a closed or full stdout is exit 74
        like any other output (issue 33 #15), not 0 with nothing printed."""
        if message:
            (file or sys.stdout).write(message)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="mbmem", description="Validated memory overlays for Megatron Bridge.")
    p.add_argument("--overlay-dir", action="append", default=[],
                   help="extra directory of overlay YAML files (also MBMEM_OVERLAY_DIRS)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.register(sub)
    return p


def _fail(exc: BaseException, code: int, prefix: str, as_json: bool, one_line: str | None = None) -> int:
    print(one_line or shown(f"{prefix}: {exc}", one_line=False), file=sys.stderr)  # argparse echoes arguments raw
    if as_json:
        from ..core.report import render_error_json
        print(render_error_json(exc, code))
    return code


def main(argv: Sequence[str] | None = None) -> int:
    console.guard_stdout()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return console.finish(_main(argv), "mbmem")
    except OSError as exc:
        if not console.is_output_error(exc):
            raise
        return console.output_failed("mbmem", exc)
    except KeyboardInterrupt:
        return 130


def _main(argv: list[str]) -> int:
    parser = build_parser()
    as_json = "--json" in argv
    try:
        args = parser.parse_args(argv)
    except CommandLineError as exc:
        exc.parser.print_usage(sys.stderr)
        return _fail(exc, EXIT_USAGE, f"{exc.parser.prog}: error", as_json)
    except SystemExit as exc:  # --help: printed; main's flush decides between 0 and 74
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    as_json = bool(getattr(args, "json", False))
    gone = console.cwd_problem()
    if gone is not None and needs_cwd(args):
        # every relative path would fail somewhere else, as a traceback or a "bug" (issue 33 #14); a command of
        # absolute paths only still works (issue 39: mbmem list, mbmem doctor /abs/file)
        return _fail(UsageError([gone]), EXIT_USAGE, "mbmem", as_json, one_line=f"mbmem: {console.CWD_GONE}; "
                     f"{console.CWD_FIX}")
    prefix = f"mbmem {args.command}"
    try:
        return args.fn(args)
    except (UsageError, SizeError) as exc:  # SizeError: --gpu-memory read by any command
        return _fail(exc, EXIT_USAGE, prefix, as_json)
    except OverlayError as exc:
        return _fail(exc, EXIT_REJECTED, prefix, as_json)
    except StackError as exc:  # Bridge missing or not importable: one line naming the versions (bridge/stack.py)
        return _fail(exc, EXIT_STACK, prefix, as_json)
