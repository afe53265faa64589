"""The overlay catalogue: one YAML file per overlay, read without importing Bridge.

File format (``overlays/mem/<name>.yaml``; a Hydra option of config group ``mem``)::

    # @package mem.<name>
    <param>: <default>          # every top-level key except ``overlay`` is a parameter
    overlay:
      summary: one line
      aliases: [short names]
      params: {<param>: {type: int|float|bool|str|labels, help: ..., min/max/choices: ...}}
      set: {<dotted ConfigContainer path>: <value or "@param">}
      env: {<VAR>: <value> | {<allocator key>: <value>}}   # mapping = key-wise merge
      sources: [shared/reference file, section]
      effect: what it saves and costs, as documented

``"@param"`` stands for the parameter's value. Overlays that need logic (an
architecture-dependent default, a conditional setting) have a resolver registered under the
overlay's name in ``core/rules/<topic>.py``; the checks there run for every apply.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import OverlayError, Problem

RESERVED_KEY = "overlay"
USER_DIRS_ENV = "MBMEM_OVERLAY_DIRS"
PARAM_TYPES = ("int", "float", "bool", "str", "labels")


def data_dir(name: str) -> Path:
    """``overlays`` or ``recipes``: inside the installed wheel, else at the repository root (a checkout)."""
    package = Path(__file__).resolve().parents[1]           # .../mbmem_overlays
    packaged = package / name
    return packaged if packaged.is_dir() else package.parents[1] / name


def recipe_file(name: str) -> Path | None:
    """recipes/recipe/<name>.yaml, if the name is one of train.py's recipe configs."""
    path = data_dir("recipes") / "recipe" / f"{name}.yaml"
    return path if "/" not in name and path.is_file() else None


def train_recipe_arg(name: str) -> str:
    """How train.py is told about a recipe: recipe=<config name>, else recipe.function=<Bridge function>."""
    return f"recipe={name}" if recipe_file(name) else f"recipe.function={name}"


def builtin_overlay_dir() -> Path:
    """``overlays/`` at the repository root; the wheel carries the same files inside the package."""
    return data_dir("overlays")


@dataclass(frozen=True)
class ParamSpec:
    name: str
    default: Any
    type: str
    help: str
    choices: tuple[Any, ...] | None = None
    min: float | None = None
    max: float | None = None


@dataclass(frozen=True)
class OverlaySpec:
    name: str
    path: Path
    summary: str
    aliases: tuple[str, ...]
    params: dict[str, ParamSpec]
    set: dict[str, Any]
    env: dict[str, Any]
    sources: tuple[str, ...]
    effect: str
    builtin: bool = True
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


def _problem(path: Path, message: str, fix: str) -> OverlayError:
    return OverlayError([Problem(overlays=(path.stem,), field=str(path), value=None, message=message, fix=fix)])


def load_file(path: Path, builtin: bool) -> OverlaySpec:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        detail = str(exc).replace("\n", " ")
        raise _problem(path, f"overlay file {path} is not valid YAML: {detail}",
                       "fix the YAML syntax (indentation, quotes, ':' after keys)") from None
    if not isinstance(data, dict) or not isinstance(data.get(RESERVED_KEY), dict):
        raise _problem(path, f"overlay file {path} has no '{RESERVED_KEY}:' mapping",
                       f"start from a built-in overlay, e.g. {builtin_overlay_dir() / 'mem' / 'expandable_segments.yaml'}")
    decl = data[RESERVED_KEY]
    unknown = set(decl) - {"summary", "aliases", "params", "set", "env", "sources", "effect"}
    if unknown:
        raise _problem(path, f"overlay file {path}: unknown key(s) under '{RESERVED_KEY}': {sorted(unknown)}",
                       "allowed: summary, aliases, params, set, env, sources, effect")
    meta = decl.get("params") or {}
    params: dict[str, ParamSpec] = {}
    for pname, default in data.items():
        if pname == RESERVED_KEY:
            continue
        info = meta.get(pname) or {}
        ptype = info.get("type") or type(default).__name__
        if ptype not in PARAM_TYPES:
            raise _problem(path, f"overlay file {path}: parameter {pname!r} has type {ptype!r}",
                           f"use one of {', '.join(PARAM_TYPES)}")
        params[pname] = ParamSpec(pname, default, ptype, info.get("help", ""),
                                  tuple(info["choices"]) if "choices" in info else None,
                                  info.get("min"), info.get("max"))
    undeclared = set(meta) - set(params)
    if undeclared:
        raise _problem(path, f"overlay file {path}: params {sorted(undeclared)} are described but have no default",
                       "add a top-level '<param>: <default>' line for each")
    for fpath, value in (decl.get("set") or {}).items():
        if isinstance(value, str) and value.startswith("@") and value[1:] not in params:
            raise _problem(path, f"overlay file {path}: {fpath} refers to unknown parameter {value}",
                           f"declare '{value[1:]}: <default>' at the top level")
    return OverlaySpec(
        name=path.stem, path=path, summary=str(decl.get("summary", "")),
        aliases=tuple(decl.get("aliases") or ()), params=params,
        set=dict(decl.get("set") or {}), env=dict(decl.get("env") or {}),
        sources=tuple(decl.get("sources") or ()), effect=str(decl.get("effect", "")).strip(),
        builtin=builtin, raw=data)


def user_dirs(extra: list[str | os.PathLike] | None = None) -> list[Path]:
    dirs = [Path(p) for p in (extra or [])]
    dirs += [Path(p) for p in os.environ.get(USER_DIRS_ENV, "").split(os.pathsep) if p]
    return dirs


def _mem_dir(base: Path) -> Path:
    # A user may point at a folder holding mem/ (like a Hydra search-path entry) or at mem/ itself.
    return base / "mem" if (base / "mem").is_dir() else base


class Catalog:
    """All overlays by name, built-ins first, then user directories."""

    def __init__(self, overlay_dirs: list[str | os.PathLike] | None = None):
        self.specs: dict[str, OverlaySpec] = {}
        self.aliases: dict[str, str] = {}
        for path in sorted((builtin_overlay_dir() / "mem").glob("*.yaml")):
            self._add(load_file(path, builtin=True))
        for base in user_dirs(overlay_dirs):
            if not base.is_dir():
                raise _problem(base, f"overlay directory {base} does not exist",
                               f"create it or fix --overlay-dir / {USER_DIRS_ENV}")
            for path in sorted(_mem_dir(base).glob("*.yaml")):
                spec = load_file(path, builtin=False)
                clash = self.specs.get(spec.name) or self.specs.get(self.aliases.get(spec.name, ""))
                if clash is not None:
                    raise _problem(path, f"user overlay {path} is named {spec.name!r}, which is already "
                                   f"the {'built-in' if clash.builtin else 'user'} overlay {clash.path}",
                                   f"rename the file, e.g. to my_{spec.name}.yaml")
                self._add(spec)

    def _add(self, spec: OverlaySpec) -> None:
        self.specs[spec.name] = spec
        for alias in spec.aliases:
            self.aliases[alias] = spec.name

    def names(self) -> list[str]:
        return sorted(self.specs)

    def resolve(self, name: str) -> OverlaySpec:
        canonical = self.aliases.get(name, name)
        if canonical in self.specs:
            return self.specs[canonical]
        choices = sorted(set(self.specs) | set(self.aliases))
        close = difflib.get_close_matches(name, choices, n=1)
        hint = f"Did you mean '{close[0]}'? Use +mem={close[0]}." if close else ""
        raise OverlayError([Problem(
            overlays=(name,), field="overlay", value=name,
            message=f"unknown overlay {name!r}. {hint}".strip(),
            fix=f"choose one of: {', '.join(self.names())} (aliases: {', '.join(sorted(self.aliases))}); "
                "`mbmem list` shows them all")])
