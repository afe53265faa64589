"""User overrides (``KEY=VALUE``) on a real config: Hydra's parser, Bridge's own value conversion,
existence and type checks, every problem at once, atomic.

Bridge's scripts (scripts/training/run_recipe.py) parse overrides with Hydra's ``OverridesParser`` and
write them with ``megatron.bridge.training.utils.omegaconf_utils.apply_overrides``, which turns
strings back into ``torch.dtype`` (``model.params_dtype=bfloat16``), activation functions
(``model.activation_func=silu``) and ``_target_`` dicts into objects (omegaconf_utils.py,
``_apply_overrides``). We use the same parser and the same function, on a scratch copy of the field's
parent, so a value means here what it means in Bridge's scripts; then our checks (the field exists,
the converted value has the field's type) run before anything is written.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import os
import re
from typing import Any

from ..core.errors import OverlayError, Problem, short_repr
from ..core.paths import MISSING, path_problem, read, split, type_problem, write
from ..core.values import plain, text_problem, value_fix, value_problem

EXAMPLE = "model.tensor_model_parallel_size=4"


def _problem(text: str, field: str, value: Any, message: str, fix: str) -> Problem:
    return Problem(("override",), field, value, message, fix, check="override")


def syntax_problem(text: str) -> Problem | None:
    """Why ``text`` is not a ``KEY=VALUE`` override (Hydra's grammar), or None. Needs no Bridge."""
    try:
        parse_override(text)
    except OverlayError as exc:
        return exc.problems[0]
    return None


def parse_override(text: str) -> tuple[str, Any]:
    """``model.tensor_model_parallel_size=4`` -> (path, typed value) with Hydra's own parser."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    if not isinstance(text, str) or "=" not in text:
        raise OverlayError([_problem(text, str(text), None, f"override {text!r} has no '='",
                                     f"write overrides as KEY=VALUE, e.g. {EXAMPLE}")])
    why = text_problem(text)
    if why:  # measured before Hydra's recursive parser sees it (a RecursionError traceback, or seconds)
        raise OverlayError([_problem(text, text.partition("=")[0][:100], text.partition("=")[2][:100],
                                     f"override {short_repr(text)} {why}", value_fix(why, text.partition("=")[0][:100]))])
    try:
        ov = OverridesParser.create().parse_override(text)
    except HydraException as exc:  # OverrideParseException and the lexer's own HydraException
        raise OverlayError([_problem(text, text.partition("=")[0], text.partition("=")[2],
                                     f"cannot parse override {short_repr(text)}: {' '.join(str(exc).split())}",
                                     "write KEY=VALUE with Hydra syntax: dotted names, lists as [a,b], "
                                     f"e.g. {EXAMPLE} or model.recompute_modules=[core_attn]")]) from None
    except ValueError as exc:  # Hydra's int(): "Exceeds the limit (4300 digits) for integer string conversion"
        raise OverlayError([_problem(text, text.partition("=")[0], text.partition("=")[2],
                                     f"the value of {short_repr(text.partition('=')[0])} cannot be read: "
                                     f"{' '.join(str(exc).split()[:12])}",
                                     value_fix("cannot be read", text.partition("=")[0]))]) from None
    if ov.is_delete():
        raise OverlayError([_problem(text, ov.key_or_group, None, "deleting config fields is not supported",
                                     "set the field to null instead, e.g. model.recompute_granularity=null")])
    key = ov.key_or_group
    problem = key_problem(key)
    if problem:
        raise OverlayError([problem])
    if ov.is_sweep_override():
        raise OverlayError([_problem(text, key, text.partition("=")[2], f"{short_repr(text)} is a sweep (several "
                                     "values, one per job: a,b or range(...))",
                                     "give one value (a list is written [a,b]); only `python train.py -m` sweeps")])
    value = plain(ov.value())
    problem = value_override_problem(key, value)
    if problem:
        raise OverlayError([problem])
    return key, value


def value_override_problem(key: str, value: Any) -> Problem | None:
    """The one rule for user values (core/values.py): no interpolation, numbers in range, no control characters."""
    why = value_problem(value)
    if why is None:
        return None
    return _problem(key, key, value, f"the value of {key} {why}", value_fix(why, key))


def key_problem(key: Any) -> Problem | None:
    """Only declared fields are settable: no empty segment (``model..x``), no dunder (``model.__class__``)."""
    bad = [part for part in split(key) if not part or part.startswith("__")] if isinstance(key, str) else [key]
    if not key or bad:
        return _problem(str(key), str(key), None,
                        f"{key!r} is not a config field path (empty or dunder name: {bad or [key]})",
                        f"name a declared field, e.g. {EXAMPLE}")
    return None


def request_problems(names: list[str], params: dict[str, Any], catalog) -> list[Problem]:
    """Unknown overlays and bad parameters, from the overlay YAML files alone (no config, no Bridge):
    the engine's own parameter check, so the messages are the ones apply would give."""
    from ..core import engine
    problems: list[Problem] = []
    specs = []
    for name in names:
        try:
            spec = catalog.resolve(name)
        except OverlayError as exc:
            problems += exc.problems
            continue
        if spec.name not in {s.name for s in specs}:
            specs.append(spec)
    problems += engine.normalize_params(specs, params, catalog)[1]
    return problems


def _bridge_value(cfg: Any, path: str, value: Any) -> Any:
    """``value`` as Bridge's override machinery would store it at ``path`` (a dtype for "bfloat16", ...).

    Bridge's ``apply_overrides`` runs on a shallow copy of the parent dataclass, so the real config is
    untouched; dict parents (``env_vars``) and non-dataclass parents keep the parsed value, as in Bridge."""
    *parents, leaf = split(path)
    parent = read(cfg, ".".join(parents), None) if parents else cfg
    if not dataclasses.is_dataclass(parent) or isinstance(parent, type):
        return value
    from megatron.bridge.training.utils.omegaconf_utils import (
        apply_overrides as bridge_apply_overrides,
    )
    scratch = copy.copy(parent)
    try:
        bridge_apply_overrides(scratch, {leaf: copy.deepcopy(value)}, {})
    except Exception:  # noqa: BLE001  Bridge logs and skips what it cannot set; our type check reports it
        return value
    return getattr(scratch, leaf, value)


def _kind_problem(current: Any, value: Any) -> str | None:
    """A text that Bridge could not convert into the field's kind (dtype, enum, function) stays text; a whole
    sub-config (model, optimizer, ...) is never replaced by a value (type_problem says so)."""
    if dataclasses.is_dataclass(current) and not isinstance(current, type):
        return type_problem(current, value)
    if current is None or value is None or isinstance(current, (bool, int, float, str, list, tuple, dict)):
        return type_problem(current, value)
    if isinstance(value, str) and not isinstance(current, (str, os.PathLike)):
        kind = type(current).__name__
        hint = (f"one of {[m.name for m in type(current)]}" if isinstance(current, enum.Enum)
                else f"a {kind} Bridge can convert from text (e.g. bfloat16 for a dtype)")
        return f"expects a {kind} (currently {current!r}); {value!r} is not {hint}"
    return None


def _declared_list(cfg: Any, path: str, value: Any) -> bool:
    """Whether ``value`` is a list and the field's declared type (its dataclass annotation) admits a list although
    its current value is not one."""
    if not isinstance(value, (list, tuple)):
        return False
    parent, _, leaf = path.rpartition(".")
    holder = read(cfg, parent, None) if parent else cfg
    if holder is None or not dataclasses.is_dataclass(holder):
        return False
    declared = {f.name: f.type for f in dataclasses.fields(holder)}.get(leaf)
    return declared is not None and re.search(r"\b(List|list|Sequence|Tuple|tuple)\b", str(declared)) is not None


def check_overrides(cfg: Any, overrides: list[str] | dict[str, Any]) -> tuple[list[tuple[str, Any, Any]], list[Problem]]:
    """Every override checked, nothing written: ([(path, old, new)] for the valid ones, [problems])."""
    items: list[tuple[str, Any]] = []
    problems: list[Problem] = []
    if isinstance(overrides, dict):
        for key, value in overrides.items():
            problem = key_problem(key) or (value_override_problem(key, value) if isinstance(key, str) else None)
            if problem:
                problems.append(problem)
            else:
                items.append((key, value))
    else:
        for text in overrides:
            try:
                items.append(parse_override(text))
            except OverlayError as exc:
                problems += exc.problems
    valid: list[tuple[str, Any, Any]] = []
    for path, value in items:
        p = path_problem(cfg, path, "override")
        if p:
            problems.append(p)
            continue
        current = read(cfg, path, None)
        new = _bridge_value(cfg, path, value)
        if isinstance(current, float) and isinstance(new, int) and not isinstance(new, bool):
            new = float(new)  # Hydra reads 1 as int; a float field keeps its kind
        err = _kind_problem(current, new)
        if err and _declared_list(cfg, path, new):
            err = None   # e.g. model.moe_layer_freq: Union[int, List[int]], an int by default, a list when set
        if err:
            err = err.replace("<path>", path)
            problems.append(_problem(path, path, value, f"{path} {err}",
                                     f"give {path} a {type(current).__name__}, e.g. {path}={current!r}"))
            continue
        valid.append((path, read(cfg, path, MISSING), new))
    return valid, problems


def write_all(cfg: Any, changes: list[tuple[str, Any, Any]]) -> None:
    """Write every change, or (when one write fails) none: the ones written are undone, and the failure
    becomes an OverlayError naming the field (a property setter can refuse a value)."""
    done: list[tuple[str, Any]] = []
    try:
        for path, old, new in changes:
            write(cfg, path, new)
            done.append((path, old))
    except Exception as exc:  # noqa: BLE001  any failing write is undone and reported
        for path, old in reversed(done):
            write(cfg, path, old)
        path, _, new = changes[len(done)]
        raise OverlayError([_problem(path, path, new, f"{path} cannot be set to {new!r}: {type(exc).__name__}: {exc}",
                                     f"give {path} a value of its declared type")]) from None


def apply_overrides(cfg: Any, overrides: list[str] | dict[str, Any]) -> dict[str, Any]:
    """Apply user overrides with existence and type checks; all problems at once; atomic.

    Returns {path: value written} (the fields the user set; overlays may not change them)."""
    valid, problems = check_overrides(cfg, overrides)
    if problems:
        raise OverlayError(problems)
    write_all(cfg, valid)
    return {path: new for path, _, new in valid}
