"""Typed values from command-line strings, with Hydra's grammar but without Bridge."""

from __future__ import annotations

from typing import Any


def parse_value(raw: str) -> Any:
    """``"4"`` -> 4, ``"[a,b]"`` -> ["a", "b"], ``"true"`` -> True, ``"null"`` -> None (Hydra rules)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    try:
        value = OverridesParser.create().parse_override(f"x={raw}").value()
    except HydraException:  # OverrideParseException, and the lexer's plain HydraException ("token recognition error")
        return raw
    return plain(value)


def plain(value: Any) -> Any:
    """Hydra's parsed value as plain Python (lists and dicts, no Hydra types)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value
