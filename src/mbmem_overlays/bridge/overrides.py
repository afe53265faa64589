"""User overrides (``KEY=VALUE``) on a real config: Hydra's parser, existence and type checks, atomic."""

from __future__ import annotations

from typing import Any

from ..core.errors import OverlayError, Problem
from ..core.paths import MISSING, path_problem, read, type_problem, write
from ..core.values import plain


def parse_override(text: str) -> tuple[str, Any]:
    """``model.tensor_model_parallel_size=4`` -> (path, typed value) with Hydra's own parser."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException
    if "=" not in text:
        raise OverlayError([Problem(("override",), text, None, f"override {text!r} has no '='",
                                    "write overrides as KEY=VALUE, e.g. model.tensor_model_parallel_size=4")])
    try:
        ov = OverridesParser.create().parse_override(text)
    except OverrideParseException as exc:
        raise OverlayError([Problem(("override",), text, None, f"cannot parse override {text!r}: {exc}",
                                    "write overrides as KEY=VALUE with Hydra syntax, e.g. model.recompute_modules=[core_attn]")]) from None
    if ov.is_delete() or ov.is_add() and ov.key_or_group.startswith("~"):
        raise OverlayError([Problem(("override",), text, None, "deleting config fields is not supported",
                                    "set the field to null instead, e.g. model.recompute_granularity=null")])
    return ov.key_or_group, plain(ov.value())


def apply_overrides(cfg: Any, overrides: list[str] | dict[str, Any]) -> dict[str, Any]:
    """Apply user overrides with existence and type checks; all problems at once; atomic."""
    items = list(overrides.items()) if isinstance(overrides, dict) else [parse_override(o) for o in overrides]
    problems: list[Problem] = []
    for path, value in items:
        p = path_problem(cfg, path, "override")
        if p:
            problems.append(p)
            continue
        current = read(cfg, path, None)
        err = type_problem(current, value)
        if err and not (isinstance(current, float) and isinstance(value, int)):
            problems.append(Problem(("override",), path, value, f"{path} {err}",
                                    f"give {path} a {type(current).__name__}, e.g. {path}={current!r}"))
    if problems:
        raise OverlayError(problems)
    undo: list[tuple[str, Any]] = []
    try:
        for path, value in items:
            undo.append((path, read(cfg, path, MISSING)))
            write(cfg, path, float(value) if isinstance(read(cfg, path, None), float) and isinstance(value, int) else value)
    except BaseException:
        for path, old in reversed(undo):
            write(cfg, path, old)
        raise
    return dict(items)
