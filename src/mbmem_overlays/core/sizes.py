"""Memory sizes as people write them (80GiB, 80 GB, 80G, 85899345920) and as PyTorch prints them.

Parsing is humanfriendly's (``humanfriendly.parse_size``, pinned humanfriendly==10.0): ``KiB/MiB/GiB/TiB``
are binary, ``KB/MB/GB/TB`` and bare ``K/M/G/T`` are decimal (its documented convention), and a bare
number is bytes. Every command reads sizes through :func:`parse_size`.
"""

from __future__ import annotations

import math

# PyTorch's OOM messages print binary units with "iB"; the doctor reads them with this table.
UNITS = {"bytes": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
MAX_BYTES = 1 << 50  # 1 PiB per GPU: anything larger is a typo, and float() of it may overflow
EXAMPLES = "write e.g. 80GiB (binary), 80GB or 80G (decimal), or a number of bytes such as 85899345920"


class SizeError(ValueError):
    """A memory size that cannot be read; a ValueError, so callers may catch either. ``mbmem`` turns it
    into a usage error (exit 2) whichever command read the size."""


def parse_size(text: str) -> float:
    """Bytes in ``text``; ValueError (naming the input and the accepted spellings) for anything else.

    Sizes must be positive and finite: a zero or absurd capacity would make every plan "fit" or none.
    """
    if not isinstance(text, str):
        raise SizeError(f"cannot read memory size {text!r} (not text); {EXAMPLES}")
    import humanfriendly  # here, not at module level: `mbmem list` and `doctor` never pay its ~40 ms import
    shown = text if len(text) <= 60 else text[:57] + "..."  # a 400-digit input must not flood the terminal
    if len(text) > 64:  # humanfriendly int()s the digits: 4,301 of them raised Python's digit-limit ValueError
        raise SizeError(f"cannot read memory size {shown!r} (longer than 64 characters); {EXAMPLES}")
    if not text.isascii():  # float() reads Arabic-Indic and other Unicode digits; a printed command must not
        raise SizeError(f"cannot read memory size {shown!r} (write it with ASCII digits and units); {EXAMPLES}")
    try:
        value = humanfriendly.parse_size(text.strip())
    except (humanfriendly.InvalidSize, ValueError):
        raise SizeError(f"cannot read memory size {shown!r}; {EXAMPLES}") from None
    if not (isinstance(value, (int, float)) and 0 < value < MAX_BYTES and math.isfinite(float(value))):
        raise SizeError(f"memory size {shown!r} must be a positive amount of memory below 1 PiB; {EXAMPLES}")
    return float(value)
