"""Typed values from command-line strings, with Hydra's grammar but without Bridge."""

from __future__ import annotations

from typing import Any


def parse_value(raw: str) -> Any:
    """``"4"`` -> 4, ``"[a,b]"`` -> ["a", "b"], ``"true"`` -> True, ``"null"`` -> None (Hydra rules)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException
    try:
        value = OverridesParser.create().parse_override(f"x={raw}").value()
    except OverrideParseException:
        return raw
    return _plain(value)


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
