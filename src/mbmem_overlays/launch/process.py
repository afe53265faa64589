"""What a process that is about to train does before CUDA starts, the same for train.py and the GPU harness:
export the overlays' environment (PyTorch's allocator reads ``PYTORCH_CUDA_ALLOC_CONF`` once, at its first
allocation) and create the memory-snapshot folder (Bridge opens ``<base>_oom_rank-<R>.pickle`` without creating
it, so an OOM would lose its snapshot: runtime-outputs.md, Memory snapshots; rule ``memory_snapshot_folder``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..core.catalog import ENV_NAME
from ..core.errors import OverlayError, Problem


def env_name_problems(report, bcfg=None) -> list[Problem]:
    """Names that may not be exported: not ``[A-Za-z_][A-Za-z0-9_]*`` (issue 15 #2). Checked before
    anything is printed as an ``export`` line or written to ``os.environ``."""
    from ..core.paths import read
    env_vars = read(bcfg, "env_vars", None) if bcfg is not None else None
    names = list(report.env_to_export) + list(env_vars if isinstance(env_vars, dict) else {})
    return [Problem(("environment",), str(n), report.env_to_export.get(n),
                    f"{n!r} is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)",
                    "fix the variable name in the overlay file or the recipe's env_vars", check="env_name")
            for n in dict.fromkeys(names) if not (isinstance(n, str) and ENV_NAME.fullmatch(n))]


def export_environment(report, bcfg) -> None:
    """Export the overlays' environment into this process, before CUDA is initialized; nothing is
    exported unless every name is valid."""
    problems = env_name_problems(report, bcfg)
    if problems:
        raise OverlayError(problems)
    os.environ.update(report.env_to_export)


def prepare_snapshot_folder(bcfg: Any) -> Path | None:
    """With memory history on, create the folder of ``profiling.memory_snapshot_path`` (every rank may write
    there); returns it, or None when nothing is recorded."""
    profiling = getattr(bcfg, "profiling", None)
    if profiling is None or not getattr(profiling, "record_memory_history", False):
        return None
    folder = Path(profiling.memory_snapshot_path).parent
    folder.mkdir(parents=True, exist_ok=True)
    return folder
