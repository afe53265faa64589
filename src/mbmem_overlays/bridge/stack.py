"""Make ``import megatron.bridge`` work on any host: the TE shim, offline HF configs, quiet logs.

Importing this module does not import Bridge; ``prepare()`` does (15-30 s), and says so on stderr
(issue 17, "Fast, quiet, visible": long imports show progress). ``progress()`` is the same spinner for
the other slow steps (building a recipe, Bridge's validation).

Before the import, ``prepare()`` reads the installed versions (importlib.metadata, no import) and compares them
with the versions the rules were checked against (core/rules/versions.py, docs/install.md): a stack that is
missing, or a Bridge / megatron-core pairing that does not import, is one ``StackError`` line (exit code
``EXIT_STACK``, docs/exit-codes.md); a stack outside the matrix gets one note on stderr and Bridge's own
validation runs on it as always.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import io
import logging
import os
import sys
import time
import warnings
from dataclasses import dataclass

from . import hf_offline, te_compat

QUIET_ENV = "MBMEM_QUIET"  # set to 1 to silence the progress lines (stdout is never used for them)
EXIT_STACK = 69  # EX_UNAVAILABLE of sysexits.h: the stack a command needs is not installed or does not import
STACK_PACKAGES = (("torch", "torch"), ("megatron-core", "megatron.core"), ("megatron-bridge", "megatron.bridge"))
INSTALL_DOC = "docs/install.md"
# What prepare() imports: Bridge itself, and the config module every command needs (ConfigContainer,
# runtime_config_update). A Bridge next to a megatron-core it does not pair with imports its top level and fails
# here (Bridge 0.6.0 + megatron-core 0.18.2: No module named 'megatron.training.models.gpt').
BRIDGE_MODULES = ("megatron.bridge", "megatron.bridge.training.config")


class StackError(Exception):
    """torch / megatron-core / Megatron Bridge are missing or do not import: one line, exit ``EXIT_STACK``."""


@dataclass(frozen=True)
class Installed:
    """The installed versions (None: no package metadata; a git checkout on PYTHONPATH has none)."""
    bridge: str | None
    core: str | None
    torch: str | None
    missing: tuple[str, ...] = ()  # distributions whose module cannot be found at all

    @property
    def supported(self) -> bool:
        from ..core.rules.versions import SUPPORTED
        return self.bridge in SUPPORTED and SUPPORTED[self.bridge] == self.core

    def describe(self) -> str:
        return f"megatron-bridge {self.bridge or '(version unknown)'} + megatron-core {self.core or '(version unknown)'}"


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def installed() -> Installed:
    """What is installed, read without importing it (``find_spec`` of ``megatron.core`` imports only the
    ``megatron`` namespace package)."""
    missing = []
    for dist, module in STACK_PACKAGES:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken parent package
            found = False
        if not found:
            missing.append(dist)
    return Installed(_version("megatron-bridge"), _version("megatron-core"), _version("torch"), tuple(missing))


def version_note(stack: Installed) -> str | None:
    """The one line printed when the installed stack is outside the matrix the rules were checked against."""
    if stack.supported:
        return None
    from ..core.rules.versions import checked_against
    return (f"note: {stack.describe()} is installed; the rules were checked against {checked_against()} "
            f"({INSTALL_DOC}); Bridge's own validation runs on the installed code, and `mbmem check-stack` "
            f"measures how the rules agree with it")


def missing_message(stack: Installed) -> str:
    from ..core.rules.versions import checked_against
    names = ", ".join(stack.missing)
    return (f"needs Megatron Bridge, and {names} {'is' if len(stack.missing) == 1 else 'are'} not installed for "
            f"{sys.executable}: install the stack into this environment (supported: {checked_against()}; "
            f"{INSTALL_DOC}) or run where it is installed; list, explain and doctor work without it")


@contextlib.contextmanager
def progress(message: str):
    """A spinner on a terminal, one plain line otherwise; always on stderr, never on stdout (--json).

    The console keeps the real stderr, so the spinner still shows while ``prepare`` captures Bridge's
    own import chatter."""
    if os.environ.get(QUIET_ENV):
        yield
        return
    from rich.console import Console
    console = Console(file=sys.stderr, highlight=False)
    start = time.monotonic()
    if console.is_terminal:
        with console.status(f"{message} ...", spinner="dots"):
            yield
        console.print(f"[dim]{message}: {time.monotonic() - start:.1f} s[/dim]")
    else:
        print(f"{message} ...", file=sys.stderr, flush=True)
        yield


def prepare(offline: bool = True) -> None:
    """Make ``import megatron.bridge`` work here: TE shim, offline HF configs, quiet logs.

    Raises ``StackError`` (one line naming the versions) when the stack is missing or does not import; prints
    ``version_note`` once (stderr) when it imports but is outside the supported matrix."""
    if "megatron.bridge" in sys.modules:
        return
    stack = installed()
    if stack.missing:
        raise StackError(missing_message(stack))
    te_compat.install()
    if offline and not os.environ.get("MBMEM_USE_USER_HF"):
        hf_offline.activate()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    logging.disable(logging.INFO)  # Bridge logs optional-import tracebacks at INFO while importing
    captured = io.StringIO()
    try:
        with progress("importing Megatron Bridge (about 30 s)"), \
                contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            for module in BRIDGE_MODULES:
                importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001  any failure to import is the stack's: one line, never a traceback
        from ..core.rules.versions import checked_against
        why = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        absent = exc.name if isinstance(exc, ModuleNotFoundError) and exc.name else ""
        if absent and not absent.startswith("megatron"):  # a package beside the pair, e.g. transformer_engine
            fix = f"this Bridge needs {absent.split('.')[0]}, which is not installed here"
        elif stack.supported:
            fix = "the pair is a supported one, so a package beside it is broken or missing"
        else:
            fix = f"the supported pairs are {checked_against()}: install the megatron-core this Bridge release pairs with"
        raise StackError(f"{stack.describe()} does not import ({why}); {fix} ({INSTALL_DOC})") from None
    finally:
        logging.disable(logging.NOTSET)
    for name in ("megatron", "megatron.bridge", "megatron.core", "root", "transformers", ""):
        logging.getLogger(name).setLevel(logging.ERROR)
    note = version_note(stack)  # after the import: a pair that does not import is the error alone
    if note:
        print(note, file=sys.stderr, flush=True)
