"""Memory sizes as people write them (80GiB, 80 GB, 85899345920) and as PyTorch prints them."""

from __future__ import annotations

import re

UNITS = {"bytes": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
SIZE = re.compile(r"^\s*([\d.]+)\s*([KMGT]i?B|B)?\s*$", re.I)


def parse_size(text: str) -> float:
    m = SIZE.match(text)
    if not m:
        raise ValueError(f"cannot read memory size {text!r}; write e.g. 80GiB, 80GB or 85899345920")
    return float(m.group(1)) * UNITS[(m.group(2) or "B").lower()]
