"""Dotted config paths on a Bridge ``ConfigContainer`` (or any dataclass/dict tree): read, write, check.

Used by the engine, the Bridge adapter's overrides and the memory model alike, so it is public here.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, MutableMapping
from dataclasses import fields, is_dataclass
from typing import Any

from .errors import Problem, short_repr

MISSING = object()  # "no such field" (distinct from a field whose value is None)


def split(path: str) -> list[str]:
    return path.split(".")


def child(obj: Any, key: str) -> Any:
    """``obj.key`` (or ``obj[key]``), or MISSING when that is not a declared field.

    Only declared dataclass fields and mapping keys count: methods, properties, class attributes
    and dunders (``model.finalize``, ``model.__class__``, ``model.__dataclass_fields__``) are not
    config fields, and writing one would replace a method or corrupt the object (issue 15 #13).
    Bridge dataclasses also accept misspelled attributes silently (stack-on-cpu.md, "Unknown
    attributes are accepted silently"), so existence is decided by the declaration, never hasattr.
    """
    if isinstance(obj, Mapping):
        return obj.get(key, MISSING)
    if is_dataclass(obj) and not isinstance(obj, type):
        if key in declared_fields(obj):
            return getattr(obj, key, MISSING)
        return MISSING
    # A plain object inside the config: its public instance attributes only (never methods or dunders).
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict) and not key.startswith("_") and key in attrs and not callable(attrs[key]):
        return attrs[key]
    return MISSING


def declared_fields(obj: Any) -> set[str]:
    """The names a dataclass instance declares (``fields()``: no ClassVar, no InitVar)."""
    return {f.name for f in fields(obj)}


def field_names(obj: Any) -> list[str]:
    if isinstance(obj, Mapping):
        return [str(k) for k in obj]
    if is_dataclass(obj) and not isinstance(obj, type):
        return [f.name for f in fields(obj)]
    attrs = getattr(obj, "__dict__", None)
    return [k for k, v in attrs.items() if not k.startswith("_") and not callable(v)] if isinstance(attrs, dict) else []


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
    elif is_dataclass(current) and not isinstance(current, type):
        # A whole sub-config (model, optimizer, peft, ...) replaced by a scalar or a dict would corrupt
        # the ConfigContainer; set its fields instead. None stays allowed (optional sub-configs).
        if isinstance(value, type(current)):
            return None
        return (f"is a {type(current).__name__} config object; a {type(value).__name__} cannot replace it "
                "(set its fields one by one instead, e.g. <path>.<field>=...)")
    elif isinstance(current, Mapping):
        ok = isinstance(value, Mapping)
    else:
        ok = True
    return None if ok else (f"expects {type(current).__name__} (currently {short_repr(current)}), "
                            f"got {type(value).__name__} {short_repr(value)}")


def parent_of(cfg: Any, path: str) -> tuple[Any, str]:
    """The object holding the last key of ``path``, and that key; KeyError if a parent is not a field.

    The engine resolves every target before it writes anything, so a bad path fails while nothing
    has changed yet, and its undo writes to the same objects without walking paths again."""
    *parents, last = split(path)
    obj = cfg
    for key in parents:
        obj = child(obj, key)
        if obj is MISSING or obj is None:
            raise KeyError(f"{path}: {key!r} is not a field holding a config object")
    return obj, last


def put(obj: Any, key: str, value: Any) -> None:
    """``obj.key = value`` (or ``obj[key] = value``); MISSING removes a mapping key (undo of an added key)."""
    if isinstance(obj, MutableMapping):
        if value is MISSING:
            obj.pop(key, None)
        else:
            obj[key] = value
    else:
        setattr(obj, key, value)


def write(cfg: Any, path: str, value: Any) -> None:
    """Set ``path`` to ``value``; writing MISSING removes a dict key (undo of an added key)."""
    obj, last = parent_of(cfg, path)
    put(obj, last, value)
