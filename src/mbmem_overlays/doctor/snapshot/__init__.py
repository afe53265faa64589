"""PyTorch memory snapshots (torch.cuda.memory._snapshot pickles): safe loading, replay, attribution.

Pure and standard-library only: never imports torch or Bridge."""

from __future__ import annotations


def looks_like_snapshot(path: str) -> bool:
    """True when ``path`` is (by content) a pickle or a gzipped pickle; placeholder until the reader lands."""
    return False
