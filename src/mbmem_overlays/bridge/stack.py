"""Make ``import megatron.bridge`` work on any host: the TE shim, offline HF configs, quiet logs.

Importing this module does not import Bridge; ``prepare()`` does (15-20 s).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import warnings

from . import hf_offline, te_compat


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
    import io
    captured = io.StringIO()
    try:
        with contextlib.redirect_stdout(captured), contextlib.redirect_stderr(captured):
            importlib.import_module("megatron.bridge")
    except Exception:
        sys.stderr.write(captured.getvalue())
        raise
    finally:
        logging.disable(logging.NOTSET)
    for name in ("megatron", "megatron.bridge", "megatron.core", "root", "transformers", ""):
        logging.getLogger(name).setLevel(logging.ERROR)
