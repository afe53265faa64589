"""The overlay catalogue: one YAML file per overlay, read without importing Bridge.

File format (``overlays/mem/<name>.yaml``; a Hydra option of config group ``mem``)::

    # @package mem.<name>
    <param>: <default>          # every top-level key except ``overlay`` is a parameter
    overlay:
      summary: one line
      aliases: [short names]
      params: {<param>: {type: int|float|bool|str|labels|ints, help: ..., min/max/choices: ...}}
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
import math
import os
import re
import shlex
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import allocconf, safeyaml
from .errors import OverlayError, Problem, short_repr
from .values import INTERPOLATION, INTERPOLATION_FIX, scalar_problem

RESERVED_KEY = "overlay"
USER_DIRS_ENV = "MBMEM_OVERLAY_DIRS"
# ints: a whole number or a list of them (rank numbers), or one of the ``choices`` words (e.g. auto).
PARAM_TYPES = ("int", "float", "bool", "str", "labels", "ints")
DECL_KEYS = ("summary", "aliases", "params", "set", "env", "sources", "effect")
PARAM_KEYS = ("type", "help", "choices", "min", "max")

# Names end up in shell `export` lines (launch/slurm.py), Hydra keys (`mem.<name>.<param>=`) and
# dotted config paths, so each has a grammar that is checked when a file is read (issue 15 #2, #10).
# Environment variable names: POSIX's portable set (IEEE Std 1003.1, 8.1 Environment Variable Definition).
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
OVERLAY_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")      # file stem and aliases: `+mem=<name>`
PARAM_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")         # `mem.<overlay>.<param>=`
FIELD_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")   # dataclass fields, dict keys
# An overlay is about a kilobyte (the largest built-in: 1.4 kB). PyYAML's pure-Python loader (the one that can
# count aliases, core/safeyaml.py) reads about 0.5 MB/s, so 64 KiB bounds the time to read a file too.
MAX_FILE_BYTES = 64 << 10
MAX_DEPTH = 16             # nesting of a `set` value
MAX_FILES = 1000           # overlay files read from one user directory (each is bounded; so is their number)


def data_dir(name: str) -> Path:
    """``overlays`` or ``recipes``: inside the installed wheel, else at the repository root (a checkout)."""
    package = Path(__file__).resolve().parents[1]           # .../mbmem_overlays
    packaged = package / name
    return packaged if packaged.is_dir() else package.parents[1] / name


def recipe_file(name: str) -> Path | None:
    """recipes/recipe/<name>.yaml, if the name is one of train.py's recipe configs."""
    path = data_dir("recipes") / "recipe" / f"{name}.yaml"
    return path if "/" not in name and path.is_file() else None


def recipe_spec(path: Path) -> dict[str, Any]:
    """A recipes/recipe/<name>.yaml file ({function, kwargs, overrides}), through the same bounded loader as
    every YAML file (core/safeyaml.py); {} for an empty file."""
    data = safeyaml.load(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


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


def coerce_param(p: ParamSpec, value: Any) -> tuple[Any, str | None]:
    """``value`` as parameter ``p`` takes it, or (value, why it is not acceptable)."""
    t = p.type
    if t == "int" and not (isinstance(value, int) and not isinstance(value, bool)):
        return value, f"must be an integer, got {short_repr(value)}"
    if t == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return value, f"must be a number, got {short_repr(value)}"
        value = float(value)
    if t == "bool" and not isinstance(value, bool):
        return value, f"must be true or false, got {short_repr(value)}"
    if t == "str" and not isinstance(value, str):
        return value, f"must be a string, got {short_repr(value)}"
    if t == "labels":
        if isinstance(value, str) and value != "auto":
            value = [value]
        if not (value == "auto" or (isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value))):
            return value, f"must be 'auto' or a list of labels, got {short_repr(value)}"
        if isinstance(value, tuple):
            value = list(value)
    if t == "ints":
        if isinstance(value, int) and not isinstance(value, bool):
            value = [value]
        if isinstance(value, (list, tuple)):
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
                return value, f"must be whole numbers, got {short_repr(value)}"
            value = list(value)
            low = [v for v in value if p.min is not None and v < p.min]
            high = [v for v in value if p.max is not None and v > p.max]
            if low or high:
                return value, (f"each must be >= {p.min}" if low else f"each must be <= {p.max}") + \
                    f", got {short_repr(value)}"
            return value, None
        if not (isinstance(value, str) and p.choices and value in p.choices):
            words = f"one of {list(p.choices)}, " if p.choices else ""
            return value, f"must be {words}a whole number or a list of them, got {short_repr(value)}"
    if p.choices is not None and not any(_same(value, c) for c in p.choices):
        return value, f"must be one of {list(p.choices)}, got {short_repr(value)}"
    if p.min is not None and isinstance(value, (int, float)) and value < p.min:
        return value, f"must be >= {p.min}, got {short_repr(value)}"
    if p.max is not None and isinstance(value, (int, float)) and value > p.max:
        return value, f"must be <= {p.max}, got {short_repr(value)}"
    return value, None


def _same(a: Any, b: Any) -> bool:
    """Equal and of the same kind (``True == 1`` in Python, but not as a parameter value)."""
    return type(a) is type(b) and a == b or (isinstance(a, list) and isinstance(b, list) and a == b)


# ----------------------------------------------------------------------------- reading one file
class _Checker:
    """Collects every problem of one overlay file (one Problem per thing wrong, all at once)."""

    def __init__(self, path: Path):
        self.path = path
        self.problems: list[Problem] = []

    def bad(self, where: str, value: Any, message: str, fix: str) -> None:
        self.problems.append(Problem(overlays=(self.path.stem,), field=f"{self.path}: {where}", value=value,
                                     message=message, fix=fix, check="overlay_file"))

    def text(self, where: str, value: Any) -> str:
        if value is None:
            return ""
        if not isinstance(value, str):
            self.bad(where, value, f"{where} must be text, got {type(value).__name__}", f"quote it: {where}: \"...\"")
            return ""
        return value

    def text_list(self, where: str, value: Any, pattern: re.Pattern | None = None, what: str = "") -> tuple[str, ...]:
        if value is None:
            return ()
        if not isinstance(value, list):
            # `aliases: abc` is a string, and tuple("abc") would be three one-letter aliases.
            self.bad(where, value, f"{where} must be a list, got {type(value).__name__}",
                     f"write it as a YAML list: {where}: [{value if isinstance(value, str) else '...'}]")
            return ()
        out: list[str] = []
        for item in value:
            if not isinstance(item, str):
                self.bad(where, item, f"every entry of {where} must be text, got {type(item).__name__}",
                         f"quote it: {where}: [\"{item}\"]")
            elif pattern is not None and not pattern.fullmatch(item):
                self.bad(where, item, f"{item!r} is not a valid {what}",
                         f"use letters, digits and '_' (starting with a letter or '_'), e.g. {where}: [my_{what.split()[0]}]")
            elif item not in out:
                out.append(item)
        return tuple(out)


def _plain_problem(value: Any, depth: int = 0) -> str | None:
    """Why ``value`` is not plain config data (None, bool, int, float, str, lists and str-keyed maps), or a
    scalar no user value may be (``core.values.scalar_problem``: out-of-range numbers, control characters).

    The loader (core/safeyaml.py) bounds the expanded size of what it returns and refuses self-reference, so
    this walk is bounded too."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return scalar_problem(value)
    if depth >= MAX_DEPTH:
        return f"nested deeper than {MAX_DEPTH} levels"
    if isinstance(value, list):
        for item in value:
            why = _plain_problem(item, depth + 1)
            if why:
                return why
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                return f"has a non-text key {short_repr(key)}"
            why = _plain_problem(item, depth + 1)
            if why:
                return why
        return None
    return f"holds a {type(value).__name__} ({short_repr(value)}), which no config field takes; quote it"


def package_header(text: str) -> str | None:
    """The ``# @package`` of a config file as Hydra reads it (hydra/plugins/config_source.py,
    ``ConfigSource._get_header_dict``): leading ``# @key value`` lines, blank lines skipped, up to the first other
    line; None when there is none. ValueError for a header line Hydra itself refuses."""
    package = None
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if not re.match(r"^\s*#\s*@", line):
            break
        words = line.lstrip("#").strip().split()
        if len(words) != 2:
            raise ValueError(f"Hydra expects '# @KEY VALUE' in the header, got {line!r}")
        if words[0] == "@package":
            package = words[1]
    return package


def _header_problem(c: _Checker, text: str) -> None:
    """Hydra places a file of group ``mem`` at its ``# @package``; without ``mem.<name>`` its keys land directly
    under ``mem`` (train.py then saw an overlay called 'overlay'), so every entry point refuses such a file."""
    want = f"mem.{c.path.stem}"
    try:
        package = package_header(text)
    except ValueError as exc:
        c.bad("header", None, f"{c.path}: {exc}", f"make the first line '# @package {want}'")
        return
    if package != want:
        said = "has no '# @package' header line" if package is None else f"says '# @package {package}'"
        c.bad("header", package, f"{c.path} {said}; train.py (Hydra) places an overlay file at its package, which "
              f"must be {want}", f"make the first line of the file '# @package {want}' (before any other comment)")


def _interpolations(value: Any, where: str, out: list[tuple[str, str]], depth: int = 0) -> None:
    """Every text (key or value) holding ``${``, with where it is; bounded like ``_plain_problem``."""
    if isinstance(value, str):
        if INTERPOLATION in value:
            out.append((where, value))
    elif isinstance(value, dict) and depth < safeyaml.MAX_DEPTH:
        for key, item in value.items():
            _interpolations(key, where, out, depth + 1)
            _interpolations(item, f"{where}.{key}" if where else str(key), out, depth + 1)
    elif isinstance(value, list) and depth < safeyaml.MAX_DEPTH:
        for i, item in enumerate(value):
            _interpolations(item, f"{where}[{i}]", out, depth + 1)


def _read_text(c: _Checker) -> str | None:
    """The file's text, read with a bound, never blocking: a fifo or device named *.yaml is refused, and a file
    swapped for one between the check and the read too (O_NONBLOCK, then fstat on what was opened)."""
    path = c.path
    fix = f"remove or rename {shlex.quote(str(path))}; overlay files are mem/<name>.yaml"
    if not path.is_file():
        c.bad("file", None, f"{path} is not a regular file (a directory, a fifo, a device or a broken link named "
              "*.yaml)", fix)
        return None
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            c.bad("file", None, f"{path} is not a regular file", fix)
            return None
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        c.bad("file", None, f"{path} is larger than {MAX_FILE_BYTES} bytes; an overlay is a short YAML file",
              "check that this is the overlay file you meant")
        return None
    return data.decode("utf-8")


_UNREADABLE = object()


def _read_yaml(c: _Checker) -> Any:
    """The file's data through the bounded loader (core/safeyaml.py), its header checked; ``_UNREADABLE`` (and
    problems) for a file whose content cannot be checked further. Every entry point reads user overlays here, so train.py refuses what
    mbmem refuses, with the same words (issue 22 #1, #7)."""
    path = c.path
    try:
        text = _read_text(c)
        if text is None:
            return _UNREADABLE
        _header_problem(c, text)
        data = safeyaml.load(text)
    except OSError as exc:
        c.bad("file", None, f"cannot read {path}: {exc.strerror or exc}", f"check the file's permissions, or remove {shlex.quote(str(path))}")
        return _UNREADABLE
    except UnicodeDecodeError:
        c.bad("file", None, f"{path} is not UTF-8 text", "save the file as UTF-8")
        return _UNREADABLE
    except safeyaml.YamlRefused as exc:
        c.bad("file", None, f"{path} is refused: it {exc}", "an overlay is a short YAML file: write the values out "
              "instead of through anchors and aliases (&name / *name)")
        return _UNREADABLE
    except Exception as exc:  # yaml.YAMLError, and the constructor's ValueError (int-digit limit) on hostile input
        detail = " ".join(str(exc).split())[:300]
        c.bad("file", None, f"{path} is not valid YAML: {detail}",
              "fix the YAML syntax (indentation, quotes, ':' after keys)")
        return _UNREADABLE
    found: list[tuple[str, str]] = []
    _interpolations(data, "", found)
    for where, text in found[:5]:
        c.bad(where or "file", text, f"{where or 'the file'} {scalar_problem(text)}; an overlay file is literal data",
              INTERPOLATION_FIX)
    return _UNREADABLE if found else data


def _check_params(c: _Checker, data: dict, meta: Any) -> dict[str, ParamSpec]:
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        c.bad("overlay.params", meta, f"overlay.params must be a mapping of parameter -> description, got {type(meta).__name__}",
              "write it as  params: {num_layers: {type: int, min: 1, help: ...}}")
        meta = {}
    params: dict[str, ParamSpec] = {}
    for pname, default in data.items():
        if pname == RESERVED_KEY:
            continue
        where = f"parameter {pname}"
        if not isinstance(pname, str) or not PARAM_NAME.fullmatch(pname):
            c.bad(where, pname, f"top-level key {short_repr(pname)} is not a valid parameter name",
                  "parameters are top-level keys made of letters, digits and '_' (e.g. num_layers: 1)")
            continue
        why = _plain_problem(default)
        if why:
            c.bad(f"parameter {pname}", default, f"the default of {pname} {why}", "use a number, text, true/false or a list")
            continue
        info = meta.get(pname)
        if info is None:
            info = {}
        if not isinstance(info, dict):
            c.bad(f"overlay.params.{pname}", info, f"the description of parameter {pname} must be a mapping, "
                  f"got {type(info).__name__}", f"write it as  {pname}: {{type: int, help: ...}}")
            continue
        for key in info:
            if key not in PARAM_KEYS:
                c.bad(f"overlay.params.{pname}", key, f"unknown key {short_repr(key)} in the description of {pname}",
                      f"allowed: {', '.join(PARAM_KEYS)}")
        ptype = info.get("type")
        if ptype is None:
            ptype = {bool: "bool", int: "int", float: "float", str: "str"}.get(type(default))
            if ptype is None:
                c.bad(f"overlay.params.{pname}.type", default, f"parameter {pname}'s type cannot be inferred from its "
                      f"default {short_repr(default)}", f"declare it: overlay.params.{pname}.type: one of {', '.join(PARAM_TYPES)}")
                continue
        if ptype not in PARAM_TYPES:
            c.bad(f"overlay.params.{pname}.type", ptype, f"parameter {pname!r} has type {short_repr(ptype)}",
                  f"use one of {', '.join(PARAM_TYPES)}")
            continue
        choices = info.get("choices")
        if choices is not None and (not isinstance(choices, list) or not choices
                                    or any(_plain_problem(x) or isinstance(x, (list, dict)) for x in choices)):
            c.bad(f"overlay.params.{pname}.choices", choices, f"choices of {pname} must be a non-empty list of values",
                  "write it as  choices: [a, b]")
            continue
        bounds = {}
        for key in ("min", "max"):
            bound = info.get(key)
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, (int, float))
                                      or not math.isfinite(bound)):
                c.bad(f"overlay.params.{pname}.{key}", bound, f"{key} of {pname} must be a finite number",
                      f"write it as  {key}: 1")
                bound = None
            bounds[key] = bound
        if bounds["min"] is not None and bounds["max"] is not None and bounds["min"] > bounds["max"]:
            c.bad(f"overlay.params.{pname}", info, f"min {bounds['min']} of {pname} is above its max {bounds['max']}",
                  "swap them or fix one")
            continue
        spec = ParamSpec(pname, default, ptype, c.text(f"overlay.params.{pname}.help", info.get("help")),
                         tuple(choices) if choices is not None else None, bounds["min"], bounds["max"])
        _, err = coerce_param(spec, default)
        if err:
            c.bad(f"parameter {pname}", default, f"the default of {pname} {err}",
                  f"make the top-level '{pname}: <default>' fit its type {ptype}" + (f" and choices {choices}" if choices else ""))
            continue
        params[pname] = spec
    for pname in meta:
        if pname not in data or pname == RESERVED_KEY:
            c.bad(f"overlay.params.{pname}", pname, f"parameter {short_repr(pname)} is described but has no default",
                  "add a top-level '<param>: <default>' line for each")
    return params


def _check_set(c: _Checker, decl_set: Any, params: dict[str, ParamSpec], declared: set[str]) -> dict[str, Any]:
    if decl_set is None:
        return {}
    if not isinstance(decl_set, dict):
        c.bad("overlay.set", decl_set, f"overlay.set must be a mapping of config path -> value, got {type(decl_set).__name__}",
              "write it as  set: {model.recompute_granularity: selective}")
        return {}
    out: dict[str, Any] = {}
    for fpath, value in decl_set.items():
        if not isinstance(fpath, str) or not FIELD_PATH.fullmatch(fpath):
            c.bad("overlay.set", fpath, f"{short_repr(fpath)} is not a dotted config path",
                  "write it as <section>.<field>, e.g. model.recompute_granularity")
            continue
        if any(part.startswith("__") for part in fpath.split(".")):
            c.bad("overlay.set", fpath, f"{fpath} names a Python internal, not a config field",
                  "set declared config fields only, e.g. model.recompute_granularity")
            continue
        why = _plain_problem(value)
        if why:
            c.bad(f"overlay.set.{fpath}", value, f"the value of {fpath} {why}", "use a number, text, true/false, null or a list")
            continue
        if isinstance(value, str) and value.startswith("@") and value[1:] not in params:
            if value[1:] not in declared:  # a declared but invalid parameter was reported already
                c.bad(f"overlay.set.{fpath}", value, f"{fpath} refers to unknown parameter {value}",
                      f"declare '{value[1:]}: <default>' at the top level")
            continue
        out[fpath] = value
    return out


def _env_scalar(value: Any) -> str | None:
    """A scalar environment value as text; None when it is not one (bool is ambiguous: 1, true or True?)."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None
    return value if isinstance(value, str) else str(value)


def _check_env(c: _Checker, decl_env: Any) -> dict[str, Any]:
    if decl_env is None:
        return {}
    if not isinstance(decl_env, dict):
        c.bad("overlay.env", decl_env, f"overlay.env must be a mapping of VARIABLE -> value, got {type(decl_env).__name__}",
              "write it as  env: {NCCL_GRAPH_REGISTER: \"0\"}  or  env: {PYTORCH_CUDA_ALLOC_CONF: {expandable_segments: \"True\"}}")
        return {}
    out: dict[str, Any] = {}
    for var, value in decl_env.items():
        if not isinstance(var, str) or not ENV_NAME.fullmatch(var):
            c.bad("overlay.env", var, f"{short_repr(var)} is not a valid environment variable name "
                  "(letters, digits and '_', not starting with a digit)",
                  "rename it, e.g. MY_VAR; a name like 'my.var' or 'X=1; cmd' cannot be exported")
            continue
        if isinstance(value, dict):
            merged = _check_allocator_merge(c, var, value)
            if merged is not None:
                out[var] = merged
            continue
        text = _env_scalar(value)
        if text is None:
            c.bad(f"overlay.env.{var}", value, f"the value of {var} must be text or a number, got {type(value).__name__}",
                  f"quote it: {var}: \"{'1' if value is True else '0' if value is False else '...'}\"")
        elif "\0" in text:
            c.bad(f"overlay.env.{var}", value, f"the value of {var} contains a NUL character", "remove it")
        elif scalar_problem(text):
            c.bad(f"overlay.env.{var}", value, f"the value of {var} {scalar_problem(text)}", "remove it")
        else:
            out[var] = text
    return out


def _check_allocator_merge(c: _Checker, var: str, merge: dict) -> dict[str, str] | None:
    if var not in allocconf.ALLOCATOR_VARS:
        c.bad(f"overlay.env.{var}", merge, f"a mapping merges allocator settings key-wise, and {var} is not an "
              f"allocator variable ({', '.join(allocconf.ALLOCATOR_VARS)})", f"give {var} one text value, e.g. {var}: \"1\"")
        return None
    out: dict[str, str] = {}
    for key, value in merge.items():
        # PyTorch spells booleans True/False (ConfigTokenizer::toBool, c10/core/AllocatorConfig.h);
        # YAML's true would otherwise become "True" here but compare unequal to it later.
        text = ("True" if value else "False") if isinstance(value, bool) else _env_scalar(value)
        if not isinstance(key, str) or text is None:
            c.bad(f"overlay.env.{var}", {key: value}, f"allocator setting {short_repr(key)} must map a key to a value",
                  f"write it as  {var}: {{expandable_segments: \"True\"}}")
            continue
        try:
            allocconf.parse(var, f"{key}:{text}")
        except allocconf.AllocConfError as exc:
            c.bad(f"overlay.env.{var}.{key}", text, str(exc), f"fix the setting under overlay.env.{var}")
            continue
        out[key] = text
    return out if out or not merge else None


def load_file(path: Path, builtin: bool) -> OverlaySpec:
    """Read and check one overlay file; OverlayError lists every problem in it."""
    spec, problems = check_file(path, builtin)
    if problems:
        raise OverlayError(problems)
    return spec


def check_file(path: Path, builtin: bool) -> tuple[OverlaySpec | None, list[Problem]]:
    """The file's overlay, or None and one Problem per thing wrong with it."""
    spec, problems, _ = _check_file(path, builtin)
    return spec, problems


def _check_file(path: Path, builtin: bool) -> tuple[OverlaySpec | None, list[Problem], tuple[str, ...]]:
    """check_file, plus every name the file claims (its stem and readable aliases, even when broken)."""
    c = _Checker(path)
    if not OVERLAY_NAME.fullmatch(path.stem):
        c.bad("file name", path.name, f"{path.name!r} does not make a valid overlay name",
              "name the file <letters, digits, _ or ->.yaml, e.g. my_overlay.yaml")
    data = _read_yaml(c)
    if data is _UNREADABLE:
        return None, c.problems, (path.stem,)
    if not isinstance(data, dict) or not isinstance(data.get(RESERVED_KEY), dict):
        c.bad(RESERVED_KEY, None, f"overlay file {path} has no '{RESERVED_KEY}:' mapping",
              f"start from a built-in overlay, e.g. {shlex.quote(str(builtin_overlay_dir() / 'mem' / 'expandable_segments.yaml'))}")
        return None, c.problems, (path.stem,)
    decl = data[RESERVED_KEY]
    for key in decl:
        if key not in DECL_KEYS:
            c.bad(f"{RESERVED_KEY}.{key}", key, f"unknown key {short_repr(key)} under '{RESERVED_KEY}'",
                  f"allowed: {', '.join(DECL_KEYS)}")
    params = _check_params(c, data, decl.get("params"))
    declared = {k for k in data if isinstance(k, str)}
    spec = OverlaySpec(
        name=path.stem, path=path, summary=c.text("overlay.summary", decl.get("summary")),
        aliases=tuple(a for a in c.text_list("overlay.aliases", decl.get("aliases"), OVERLAY_NAME, "overlay alias")
                      if a != path.stem),
        params=params, set=_check_set(c, decl.get("set"), params, declared), env=_check_env(c, decl.get("env")),
        sources=c.text_list("overlay.sources", decl.get("sources")),
        effect=c.text("overlay.effect", decl.get("effect")).strip(), builtin=builtin, raw=data)
    return (None if c.problems else spec), c.problems, (path.stem, *spec.aliases)


def user_dirs(extra: list[str | os.PathLike] | None = None) -> list[Path]:
    """The user overlay directories: ``extra`` (``--overlay-dir``, ``overlay_dirs=``), then ``MBMEM_OVERLAY_DIRS``;
    one directory named twice (``--overlay-dir D`` with ``MBMEM_OVERLAY_DIRS=D``) counts once."""
    if isinstance(extra, (str, os.PathLike)):  # one directory given as such, not its characters
        extra = [extra]
    dirs = [Path(p) for p in (extra or [])]
    dirs += [Path(p) for p in os.environ.get(USER_DIRS_ENV, "").split(os.pathsep) if p]
    out: list[Path] = []
    seen: set[str] = set()
    for d in dirs:
        key = os.path.abspath(d)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def overlay_folder(base: Path) -> Path | None:
    """Where a user directory's overlay files are, the one rule for ``mbmem`` and Hydra (train.py, any Hydra
    app): ``base/mem/<name>.yaml`` (``base`` is a Hydra search-path entry), or ``base`` itself when it is named
    ``mem`` (its parent is then the search-path entry). None: neither, so no entry point reads its files."""
    try:
        if (base / "mem").is_dir():
            return base / "mem"
        if base.name == "mem" and base.is_dir():
            return base
    except OSError:
        return None
    return None


def search_path_entry(base: Path) -> Path | None:
    """The folder Hydra's search path needs for user directory ``base`` (the parent of its ``mem/``)."""
    folder = overlay_folder(base)
    return None if folder is None else folder.parent


def all_user_dirs(extra: list[str | os.PathLike] | None = None) -> list[str]:
    """The user overlay directories as absolute paths, for a printed command or script to carry as
    ``MBMEM_OVERLAY_DIRS`` (train.py and the Hydra plugin read it; issue 22 #2a)."""
    return [os.path.abspath(d) for d in user_dirs(extra)]


def overlay_dirs_env(extra: list[str | os.PathLike] | None = None) -> dict[str, str]:
    """``{"MBMEM_OVERLAY_DIRS": "<absolute dirs>"}`` when there are user overlay directories, else ``{}``."""
    dirs = all_user_dirs(extra)
    return {USER_DIRS_ENV: os.pathsep.join(dirs)} if dirs else {}


def _dir_problem(base: Path) -> Problem | None:
    """Why nothing can be read from user directory ``base`` (check ``overlay_dir``: a usage error)."""
    fix = f"create it, or fix --overlay-dir / {USER_DIRS_ENV} (now {os.environ.get(USER_DIRS_ENV, '')!r})"
    try:
        if not base.is_dir():
            return Problem(("catalog",), str(base), None, f"overlay directory {base} does not exist"
                           if not base.exists() else f"{base} is not a directory", fix, check="overlay_dir")
        if os.pathsep in str(base) or any(ch in str(base) for ch in "\n\r\0"):
            return Problem(("catalog",), str(base), None, f"overlay directory {base!r} contains {os.pathsep!r} or a "
                           f"line break, so {USER_DIRS_ENV} cannot name it", "use a path without them",
                           check="overlay_dir")
    except OSError as exc:
        return Problem(("catalog",), str(base), None, f"cannot read overlay directory {base}: {exc.strerror}", fix,
                       check="overlay_dir")
    if overlay_folder(base) is None:
        loose = sorted(p.name for p in base.glob("*.yaml"))[:5]
        return Problem(("catalog",), str(base), None,
                       f"overlay directory {base} has no mem/ folder" + (f" (it holds {', '.join(loose)} directly)"
                                                                          if loose else "")
                       + "; overlay files are <directory>/mem/<name>.yaml, where train.py (Hydra) looks for them",
                       f"mkdir {shlex.quote(str(base / 'mem'))} and move the overlay files into it", check="overlay_dir")
    return None


class Catalog:
    """All overlays by name, built-ins first, then user directories.

    A broken user overlay file never breaks the catalogue: its problems go to ``problems``, and only
    naming that overlay (``resolve``) is an error. The same holds for a user overlay whose name or an
    alias is already taken (by a built-in or another user file): the contested name and the user
    file's own names are refused rather than silently resolving to one of them (issue 15 #8, #10).
    """

    def __init__(self, overlay_dirs: list[str | os.PathLike] | None = None):
        self.specs: dict[str, OverlaySpec] = {}
        self.aliases: dict[str, str] = {}
        self.problems: list[Problem] = []          # broken user files and directories, for `mbmem list`
        self.broken: dict[str, list[Problem]] = {}  # name or alias -> why naming it is an error
        self._refused: list[OverlaySpec] = []       # well-formed user overlays refused for a name clash
        for path in sorted((builtin_overlay_dir() / "mem").glob("*.yaml")):
            self._add(load_file(path, builtin=True))
        for base in user_dirs(overlay_dirs):
            problem = _dir_problem(base)
            if problem is not None:
                self.problems.append(problem)
                continue
            paths = sorted(overlay_folder(base).glob("*.yaml"))
            if len(paths) > MAX_FILES:
                self.problems.append(Problem(
                    ("catalog",), str(base), None, f"overlay directory {base} holds {len(paths)} *.yaml files, more "
                    f"than {MAX_FILES}; none was read", "point --overlay-dir / MBMEM_OVERLAY_DIRS at your overlays "
                    "only", check="overlay_dir"))
                continue
            for path in paths:
                self._add_user(path)

    def _owner(self, name: str) -> OverlaySpec | None:
        return self.specs.get(self.aliases.get(name, name))

    def _add(self, spec: OverlaySpec) -> None:
        self.specs[spec.name] = spec
        for alias in spec.aliases:
            self.aliases[alias] = spec.name

    def _refuse(self, names: tuple[str, ...], problems: list[Problem]) -> None:
        self.problems += problems
        for name in names:
            self.broken.setdefault(name, []).extend(problems)

    def _add_user(self, path: Path) -> None:
        spec, problems, names = _check_file(path, builtin=False)
        if spec is None:
            self._refuse(names, problems)
            return
        clashes = []
        for name in names:
            # Refused user overlays still hold their names: a third file claiming one of them clashes too.
            owner = self._owner(name) or next((s for s in self._refused if name in (s.name, *s.aliases)), None)
            if owner is not None:
                kind = "built-in" if owner.builtin else "user"
                as_what = "name" if name == spec.name else "alias"
                clashes.append(Problem(
                    (spec.name, owner.name), f"{path}: {'file name' if as_what == 'name' else 'overlay.aliases'}", name,
                    f"user overlay {path} claims the {as_what} {name!r}, which is already the {kind} overlay "
                    f"{owner.name} ({owner.path}); a name may mean only one overlay",
                    f"rename the file or the alias, e.g. my_{name}" + (".yaml" if as_what == "name" else ""),
                    check="overlay_name"))
        if clashes:
            self._refused.append(spec)
            self._refuse(names, clashes)
            return
        self._add(spec)

    def names(self) -> list[str]:
        return sorted(self.specs)

    @property
    def folder_problems(self) -> list[Problem]:
        """The user overlay folders that are missing or not folders of overlays (every entry point refuses them)."""
        return [p for p in self.problems if p.check == "overlay_dir"]

    def resolve(self, name: str) -> OverlaySpec:
        if not isinstance(name, str):
            raise OverlayError([Problem(("argument",), "overlays", name,
                                        f"an overlay name must be text, got {type(name).__name__}",
                                        "name overlays as strings, e.g. ['expandable_segments']")])
        if name in self.broken:
            raise OverlayError(self.broken[name])
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
                "`mbmem list` shows them all"),
            # a missing overlay directory is the likely reason a user overlay is unknown
            *self.folder_problems])
