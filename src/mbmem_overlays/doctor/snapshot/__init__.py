"""PyTorch memory snapshots (``torch.cuda.memory._snapshot()`` pickles): safe loading, the state at the OOM
replayed from the trace, attribution by allocation site, comparison of two runs, an offline HTML page.

Pure and standard-library only: never imports torch or Bridge (``plan.py``, used only by ``--plan``, does).
Modules: ``load`` (the no-class unpickler, size caps, gzip), ``model`` (every format, checked), ``replay``
(undoing the trace from the dump), ``sites`` (allocation site and category of a stack), ``analyze`` (figures
and verdicts), ``advice`` (the next command), ``render`` (text and JSON), ``html``.
"""

from __future__ import annotations

from .load import looks_like_snapshot

__all__ = ["looks_like_snapshot"]
