"""Dotted config paths on a Bridge ``ConfigContainer`` (or any dataclass/dict tree): read, write, check.

Used by the engine, the Bridge adapter's overrides and the memory model alike, so it is public here.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, MutableMapping
from dataclasses import fields, is_dataclass
from typing import Any

from .errors import Problem

MISSING = object()  # "no such field" (distinct from a field whose value is None)


def split(path: str) -> list[str]:
    return path.split(".")


def child(obj: Any, key: str) -> Any:
    """``obj.key`` (or ``obj[key]``), or MISSING when that is not a declared field."""
    if isinstance(obj, Mapping):
        return obj.get(key, MISSING)
    if is_dataclass(obj) and not isinstance(obj, type):
        names = {f.name for f in fields(obj)}
        if key in names or hasattr(type(obj), key):
            return getattr(obj, key, MISSING)
        # Bridge dataclasses accept misspelled attributes silently (stack-on-cpu.md,
        # "Unknown attributes are accepted silently"): only declared fields count.
        return MISSING
    return getattr(obj, key, MISSING)


def field_names(obj: Any) -> list[str]:
    if isinstance(obj, Mapping):
        return [str(k) for k in obj]
    if is_dataclass(obj) and not isinstance(obj, type):
        return [f.name for f in fields(obj)]
    return [k for k in vars(obj) if not k.startswith("_")] if hasattr(obj, "__dict__") else []


def read(cfg: Any, path: str, default: Any = MISSING) -> Any:
    obj = cfg
    for key in split(path):
        if obj is None:
            return default
        obj = child(obj, key)
        if obj is MISSING:
            return default
    return obj


def path_problem(cfg: Any, path: str, overlay: str) -> Problem | None:
    """None if ``path`` names an existing field (dict keys under env_vars may be new)."""
    obj, walked = cfg, []
    parts = split(path)
    for i, key in enumerate(parts):
        if isinstance(obj, Mapping) and i == len(parts) - 1:
            return None
        if obj is None:
            parent = ".".join(walked)
            return Problem((overlay,), path, None,
                           f"{parent} is None in this config, so {path} cannot be set",
                           _none_parent_fix(parent), check="field_exists")
        nxt = child(obj, key)
        if nxt is MISSING:
            names = field_names(obj)
            close = difflib.get_close_matches(key, names, n=1)
            where = ".".join(walked) or "the config"
            hint = f" Did you mean {'.'.join([*walked, close[0]])}?" if close else ""
            return Problem((overlay,), path, None,
                           f"{where} has no field {key!r}.{hint} (Bridge would accept the misspelling silently.)",
                           f"use an existing field of {type(obj).__name__}"
                           + (f", e.g. {'.'.join([*walked, close[0]])}" if close else ""),
                           check="field_exists")
        obj, walked = nxt, [*walked, key]
    return None


def _none_parent_fix(parent: str) -> str:
    if parent == "peft":
        return "use a PEFT (LoRA) recipe, e.g. recipe=llama3_8b_peft / --recipe llama3_8b_peft_config"
    return f"set {parent} first (it is None in this recipe)"


def type_problem(current: Any, value: Any) -> str | None:
    """Why ``value`` cannot replace ``current`` (a different kind of value), or None."""
    if current is None or value is None:
        return None
    if isinstance(current, bool):
        ok = isinstance(value, bool)
    elif isinstance(current, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(current, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif isinstance(current, str):
        ok = isinstance(value, str)
    elif isinstance(current, (list, tuple)):
        ok = isinstance(value, (list, tuple))
    else:
        ok = True
    return None if ok else f"expects {type(current).__name__} (currently {current!r}), got {type(value).__name__} {value!r}"


def write(cfg: Any, path: str, value: Any) -> None:
    """Set ``path`` to ``value``; writing MISSING removes a dict key (undo of an added key)."""
    *parents, last = split(path)
    obj = cfg
    for key in parents:
        obj = obj[key] if isinstance(obj, Mapping) else getattr(obj, key)
    if isinstance(obj, MutableMapping):
        if value is MISSING:
            obj.pop(last, None)
        else:
            obj[last] = value
    else:
        setattr(obj, last, value)
