"""Typed values from command-line strings, with Hydra's grammar but without Bridge; and the one rule every
user value obeys on every entry point (issue 22 #2c, #3, #9).

A value a user gives (an override, an overlay parameter, anything in an overlay file) is refused when it

- contains an interpolation ``${...}``: mbmem never resolves one. Hydra would resolve it under train.py and
  nothing would under ``mbmem``, so the two would disagree, and ``${oc.env:SECRET}`` would copy the
  environment into the config and its run records (``mbmem_report.json``, ``bridge_config.yaml``);
- is an integer outside a signed 64-bit integer (what torch and Megatron-Core hold; Python's own
  int-digit limit raised a traceback at 4,301 digits) or a float that is not finite (``nan``, ``inf``);
- contains a control or bidirectional-override character (``core.text``), which would reach terminals and
  scripts;
- could not be read at all (``Unreadable``), or is a sweep where one value is meant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .text import unsafe_character

MAX_INT = 2**63 - 1          # int64, what every integer field of Bridge/Megatron-Core holds
INTERPOLATION = "${"
INTERPOLATION_FIX = ("write the value itself; mbmem and train.py never resolve ${...} in your values (Hydra's own "
                     "hydra.* settings excepted)")
MAX_NESTING = 32


@dataclass(frozen=True)
class Unreadable:
    """A command-line value that has no Python value: ``why`` says what is wrong with ``raw``."""
    raw: str
    why: str


def parse_value(raw: str) -> Any:
    """``"4"`` -> 4, ``"[a,b]"`` -> ["a", "b"], ``"true"`` -> True, ``"null"`` -> None (Hydra rules).

    Text Hydra's grammar does not accept stays text; a value Python cannot hold (a 5,000-digit integer) or a
    sweep (``a,b``) is ``Unreadable``, which ``value_problem`` reports."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    why = text_problem(raw)
    if why:
        return Unreadable(raw[:200], why)
    try:
        override = OverridesParser.create().parse_override(f"x={raw}")
    except HydraException:  # OverrideParseException, and the lexer's plain HydraException ("token recognition error")
        return raw
    except ValueError as exc:  # int(): "Exceeds the limit (4300 digits) for integer string conversion"
        return Unreadable(raw, f"cannot be read: {' '.join(str(exc).split()[:12])}")
    if override.is_sweep_override():
        return Unreadable(raw, "is a sweep (several values, one per job: a,b or range(...)); give one value, "
                               "and a list as [a,b]")
    return plain(override.value())


def plain(value: Any) -> Any:
    """Hydra's parsed value as plain Python (lists and dicts, no Hydra types)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def scalar_problem(value: Any) -> str | None:
    """Why one scalar is not acceptable as a user value (see the module docstring), or None."""
    if isinstance(value, Unreadable):
        return value.why
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        if value.bit_length() > 63:  # never str() it: over 4,300 digits that raises
            return f"is an integer of {value.bit_length()} bits, out of range (at most {MAX_INT}, a 64-bit integer)"
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"is {value}, not a finite number"
    if isinstance(value, str):
        if INTERPOLATION in value:
            return f"contains an interpolation ${{...}} ({_excerpt(value)}), which is not resolved in user values"
        bad = unsafe_character(value)
        if bad is not None:
            return f"contains the control or bidirectional character {bad}, which would reach terminals and scripts"
    return None


def value_problem(value: Any, depth: int = 0) -> str | None:
    """``scalar_problem`` for a value and everything inside its lists and mappings (keys included)."""
    if depth > MAX_NESTING:
        return f"is nested deeper than {MAX_NESTING} levels"
    if isinstance(value, dict):
        for key, item in value.items():
            why = scalar_problem(key) or value_problem(item, depth + 1)
            if why:
                return why
        return None
    if isinstance(value, (list, tuple)):
        for item in value:
            why = value_problem(item, depth + 1)
            if why:
                return why
        return None
    return scalar_problem(value)


def _excerpt(text: str) -> str:
    start = text.find(INTERPOLATION)
    end = text.find("}", start)
    piece = text[start:end + 1] if 0 <= end - start <= 60 else text[start:start + 60] + "..."
    from .text import shown
    return shown(piece)


# ----------------------------------------------------------------------------- counts
# The largest world size any entry point takes: 2^20 = 1,048,576 GPUs, far beyond any cluster built so far; a
# larger number is a typo, and an absurd one (10^21) used to pass the cheap checks and fail after the Bridge
# import with a nonsense fix (issue 22 #3).
MAX_WORLD_SIZE = 1 << 20
# The memory plan's work grows with the layers (one entry per layer), the pipeline ranks (each planned) and the
# steps of the pipeline schedule it replays per rank (at most 2 x microbatch group x virtual stages, whatever the
# microbatches: memory/pipeline.py alive_chunk_microbatches). A job past these is refused with the limit rather than
# planned for minutes (issue 39 #6): the deepest models trained have a few hundred layers and a few dozen stages.
MAX_PLAN_LAYERS = 100_000
MAX_PLAN_PIPELINE = 4_096
MAX_PLAN_SCHEDULE = 1 << 20    # pipeline ranks x microbatch group x virtual stages (about a second of replay)
_MAX_COUNT_DIGITS = 19  # never int() more digits than an int64 holds (and never hit Python's 4,300-digit limit)


def ascii_int(text: Any, max_digits: int = _MAX_COUNT_DIGITS) -> int | None:
    """The whole number ``text`` spells in ASCII digits (at most ``max_digits`` of them, no sign, no spaces), else
    None: the one rule for every count read from a user's text (a world size, a launcher's --nproc-per-node, a log's
    value). ``str.isdigit()`` also takes superscripts (``"\u00b2"``, which ``int()`` then refuses) and ``int()`` takes
    other scripts' digits (``"\u0668"``), ``"1_0"`` and ``" 8 "``: none of them is a number a user typed here."""
    if not isinstance(text, str) or not text or len(text) > max_digits or not text.isascii() or not text.isdigit():
        return None
    return int(text)


def parse_count(value: Any, *, maximum: int, minimum: int = 1) -> tuple[int | None, str | None]:
    """A whole number in [minimum, maximum] from text (``"8"``) or an ``int``: (number, None) or (None, why).

    Only ASCII digits count (``int()`` also takes ``"٨"``, ``"1_0"`` and ``" 8 "``); bools are not numbers."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return None, f"must be a whole number from {minimum} to {maximum}, got {type(value).__name__}"
    if isinstance(value, int):
        number = value if value.bit_length() <= 63 else None
    else:
        text = value.strip()
        digits = text[1:] if text[:1] in "+-" else text
        number = None
        if digits.isascii() and digits.isdigit() and len(digits.lstrip("0")) <= _MAX_COUNT_DIGITS:
            number = int(text)
        elif not (digits.isascii() and digits.isdigit()):
            from .errors import short_repr
            return None, f"must be a whole number from {minimum} to {maximum}, got {short_repr(value)}"
    if number is None or not minimum <= number <= maximum:
        shown_number = str(number) if number is not None else "a number of more than 19 digits"
        return None, f"must be a whole number from {minimum} to {maximum}, got {shown_number}"
    return number, None


def hydra_text(value: Any) -> str:
    """``value`` as the text of a Hydra override that reads back as ``value`` (``null``, ``true``, ``[a,b]``; a
    string Hydra would read as something else, ``'1e-4'`` or ``'a b'``, single-quoted)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_text(v) for v in value) + "]"
    text = str(value) if not isinstance(value, int) or value.bit_length() <= 63 else "0"
    if isinstance(value, str) and parse_value(text) != value:
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return text


def value_fix(why: str, what: str) -> str:
    """What to type instead, for a ``value_problem`` answer about ``what`` (a key, ``mem.<o>.<p>``, an option)."""
    if "interpolation" in why:
        return INTERPOLATION_FIX
    if "finite" in why:
        return f"give {what} a finite number"
    if "characters long" in why:
        return f"give {what} a shorter value; put long lists or texts in a recipe or an overlay file"
    if "out of range" in why or "cannot be read" in why:
        return f"give {what} a number of at most {MAX_INT} (a 64-bit integer)"
    if "control or bidirectional" in why:
        return f"remove that character from {what}"
    if "sweep" in why:
        return "give one value (a list is written [a,b]); only `python train.py -m` runs sweeps"
    return f"give {what} a plain value (a number, text, true/false, null or a list)"


# ----------------------------------------------------------------------------- command-line text, before parsing
# Hydra's override parser (ANTLR) recurses per bracket, so a few hundred '[' raise RecursionError (a traceback),
# and it takes seconds per 10,000 characters; the text is measured before it ever sees it. A config value on the
# command line is a number, a name, a path or a short list: 4,096 characters is PATH_MAX on Linux.
MAX_OVERRIDE_CHARS = 4096


def text_problem(text: str) -> str | None:
    """Why ``text`` (one ``KEY=VALUE`` argument) is not given to Hydra's parser at all, or None."""
    if len(text) > MAX_OVERRIDE_CHARS:
        return f"is {len(text)} characters long, more than {MAX_OVERRIDE_CHARS}"
    depth = deepest = 0
    for ch in text:
        if ch in "[{(":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]})":
            depth -= 1
    if deepest > MAX_NESTING:
        return f"is nested deeper than {MAX_NESTING} levels"
    return None
