"""Make ``import megatron.bridge`` work on any host: the TE shim, offline HF configs, quiet logs.

Importing this module does not import Bridge; ``prepare()`` does (15-30 s), and says so on stderr
(issue 17, "Fast, quiet, visible": long imports show progress). ``progress()`` is the same spinner for
the other slow steps (building a recipe, Bridge's validation).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os
import sys
import time
import warnings

from . import hf_offline, te_compat

QUIET_ENV = "MBMEM_QUIET"  # set to 1 to silence the progress lines (stdout is never used for them)


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
    """Make ``import megatron.bridge`` work here: TE shim, offline HF configs, quiet logs."""
    if "megatron.bridge" in sys.modules:
        return
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
            importlib.import_module("megatron.bridge")
    except Exception:
        sys.stderr.write(captured.getvalue())
        raise
    finally:
        logging.disable(logging.NOTSET)
    for name in ("megatron", "megatron.bridge", "megatron.core", "root", "transformers", ""):
        logging.getLogger(name).setLevel(logging.ERROR)
