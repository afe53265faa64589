"""``mbmem doctor SNAPSHOT...``: the snapshot half of the doctor command (see cli/doctor.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Outcome:
    exit_code: int
    text: str
    payload: dict[str, Any] = field(default_factory=dict)


def report(args, paths: list[str]) -> Outcome:
    """Read the snapshots in ``paths`` (and ``args.against``) and report them."""
    raise NotImplementedError("snapshot reader not built yet")
