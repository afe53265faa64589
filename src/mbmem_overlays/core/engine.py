"""Collect every overlay's claims, check them all, then apply — or change nothing.

Shape borrowed from torchtitan's ``config/override.py``: claims first (so the
order overlays are named in never matters), conflicts named with both parties,
then one atomic apply that reports ``[name] field: old -> new``.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib.metadata
import os
import shlex
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from . import allocconf, rules
from .catalog import ENV_NAME, Catalog, OverlaySpec, coerce_param
from .errors import OverlayError, Problem, ValidationRejected, short_repr
from .paths import MISSING, parent_of, path_problem, put, read, type_problem
from .text import quoted_word
from .values import MAX_WORLD_SIZE, hydra_text, value_fix, value_problem

CONFIG = "config"  # the party for values that were in the config before any overlay

# Runs the stack's own validation on the applied config: (cfg, world_size, env) -> a result with ``ok``.
# The Bridge adapter provides one (bridge.validation.validate_config); the engine never imports Bridge.
Validator = Callable[[Any, "int | None", "MutableMapping[str, str] | None"], Any]


# ----------------------------------------------------------------------------- claims
@dataclass(frozen=True)
class FieldClaim:
    overlay: str
    path: str
    value: Any


@dataclass(frozen=True)
class EnvClaim:
    overlay: str
    var: str
    value: str | None = None                 # whole-value setting
    merge: Mapping[str, str] | None = None   # key-wise allocator setting


@dataclass(frozen=True)
class Change:
    overlay: str
    target: str   # config path, or "$VAR" for the process environment
    old: Any
    new: Any

    def render(self) -> str:
        return f"[{self.overlay}] {self.target}: {self.old!r} -> {self.new!r}"


@dataclass
class Report:
    overlays: tuple[str, ...]
    params: dict[str, dict[str, Any]]
    changes: list[Change] = field(default_factory=list)
    env_to_export: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checks: list[str] = field(default_factory=list)
    validation: Any = None  # the validator's result (bridge.validation.ValidationResult) when one ran

    @property
    def field_changes(self) -> list[Change]:
        return [c for c in self.changes if not c.target.startswith("$")]

    @property
    def env_changes(self) -> list[Change]:
        return [c for c in self.changes if c.target.startswith("$")]


# ----------------------------------------------------------------------------- the prospective view
class View:
    """The config and environment as they would be after the claims, without touching either."""

    def __init__(self, cfg: Any, claims: dict[str, FieldClaim], env: Mapping[str, str],
                 world_size: int | None, selected: tuple[str, ...], params: dict[str, dict[str, Any]],
                 locked: Mapping[str, Any] | None = None):
        self.cfg = cfg
        self.locked = locked or {}
        self.claims = claims
        self.env = env  # effective environment at launch (process env wins over cfg.env_vars)
        self.world_size = world_size
        self.selected = selected
        self.params = params

    def get(self, path: str, default: Any = None) -> Any:
        if path in self.claims:
            return self.claims[path].value
        value = read(self.cfg, path, MISSING)
        return default if value is MISSING else value

    def setter(self, path: str) -> str:
        if path in self.claims:
            return self.claims[path].overlay
        return "override" if path in self.locked else CONFIG

    def parties(self, *paths: str) -> tuple[str, ...]:
        seen: list[str] = []
        for p in paths:
            s = self.setter(p)
            if s not in seen:
                seen.append(s)
        return tuple(seen)

    @property
    def torch_version(self) -> tuple[int, int]:
        try:
            parts = importlib.metadata.version("torch").split(".")
            return int(parts[0]), int(parts[1])
        except Exception:  # torch absent: assume current
            return (99, 0)


# ----------------------------------------------------------------------------- parameters
def normalize_params(specs: list[OverlaySpec], params: Mapping[str, Any] | None,
                      catalog: Catalog) -> tuple[dict[str, dict[str, Any]], list[Problem]]:
    given: dict[str, dict[str, Any]] = {s.name: {} for s in specs}
    spelled: dict[tuple[str, str], str] = {}   # (overlay, param) -> how the caller wrote it, for conflicts
    problems: list[Problem] = []
    for key, value in (params or {}).items():
        given_value = value
        if "." in key:
            oname, pname = key.split(".", 1)
            value = {pname: value}
        elif isinstance(value, Mapping):
            oname = key
        elif len(specs) == 1:
            oname, value = specs[0].name, {key: value}
        else:
            problems.append(Problem((key,), key, value, "parameter given without its overlay",
                                    f"write it as {{'<overlay>.{key}': {short_repr(value)}}} or {{'<overlay>': {{'{key}': ...}}}}"))
            continue
        oname = catalog.aliases.get(oname, oname)
        if oname not in given:
            problems.append(unselected_problem(oname, f"mem.{key}" if "." in key else key, given_value))
            continue
        for pname, pvalue in value.items():
            if not isinstance(pname, str):
                problems.append(Problem((oname,), key, pname, f"parameter names must be text, got {short_repr(pname)}",
                                        f"see `mbmem explain {quoted_word(oname)}`", check="param"))
                continue
            why = value_problem(pvalue)
            if why:  # an interpolation, a number out of range, a control character (core/values.py)
                problems.append(Problem((oname,), f"mem.{oname}.{pname}", getattr(pvalue, "raw", pvalue),
                                        f"parameter {pname} {why}", value_fix(why, f"mem.{oname}.{pname}"),
                                        check="param"))
                continue
            written = key if "." in key or not isinstance(value, Mapping) or key == pname else f"{key}.{pname}"
            if pname in given[oname] and not _same_value(given[oname][pname], pvalue):
                # An alias and the canonical name (or two spellings) disagree: no silent "last one wins".
                problems.append(Problem(
                    (oname,), f"mem.{oname}.{pname}", pvalue,
                    f"parameter {pname} of {oname} is given twice with different values: "
                    f"{spelled[oname, pname]}={short_repr(given[oname][pname])} and {written}={short_repr(pvalue)}",
                    f"give {oname}.{pname} once (aliases name the same overlay)", check="param"))
                continue
            given[oname][pname] = pvalue
            spelled.setdefault((oname, pname), written)
    resolved: dict[str, dict[str, Any]] = {}
    for spec in specs:
        values = {k: copy.deepcopy(p.default) for k, p in spec.params.items()}
        for pname, value in given[spec.name].items():
            if pname not in spec.params:
                close = difflib.get_close_matches(pname, list(spec.params), n=1)
                known = ", ".join(spec.params) or "none"
                problems.append(Problem(
                    (spec.name,), f"mem.{spec.name}.{pname}", value,
                    f"{spec.name} has no parameter {pname!r}" + (f"; did you mean {close[0]!r}?" if close else "")
                    + f" (parameters: {known})",
                    f"use {quoted_word(f'mem.{spec.name}.{close[0]}={hydra_text(value)}')}" if close
                    else f"see `mbmem explain {quoted_word(spec.name)}`",
                    check="param"))
                continue
            coerced, err = coerce_param(spec.params[pname], value)
            if err:  # reported; the default stays so the remaining checks still see a well-typed value
                problems.append(Problem((spec.name,), f"mem.{spec.name}.{pname}", value,
                                        f"parameter {pname} {err}", spec.params[pname].help or f"see `mbmem explain {quoted_word(spec.name)}`",
                                        check="param"))
                continue
            values[pname] = coerced
        resolved[spec.name] = values
    return resolved, problems


def unselected_problem(overlay: str, key: str, value: Any) -> Problem:
    """A parameter for an overlay that is not selected: an error, never a silent selection (every entry point
    says this in these words: the API, ``mbmem``, and train.py for ``mem.<overlay>.<param>=`` without
    ``+mem=<overlay>``, where Hydra's own hint ``+mem.<overlay>.<param>=`` would have selected it)."""
    return Problem((overlay,), key, value, f"parameters for {overlay!r}, which is not selected",
                   f"add {quoted_word(overlay)} to the overlays ({quoted_word(f'+mem={overlay}')} / "
                   f"--overlay {quoted_word(overlay)}), or drop these parameters",
                   check="param")


def _same_value(a: Any, b: Any) -> bool:
    """Equal, and of the same kind: ``True`` and ``1`` are different parameter values."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def substitute(value: Any, params: dict[str, Any]) -> Any:
    """A YAML ``set`` value with ``"@param"`` replaced by the parameter's value."""
    if isinstance(value, str) and value.startswith("@"):
        return copy.deepcopy(params[value[1:]])
    return copy.deepcopy(value)


# ----------------------------------------------------------------------------- the engine
def _effective_env(cfg: Any, env: Mapping[str, str]) -> dict[str, str]:
    # Bridge applies cfg.env_vars with os.environ.setdefault inside pretrain()
    # (bridge-config-surface.md §3): whatever the process already has wins.
    recipe_env = read(cfg, "env_vars", None) or {}
    return {**{k: str(v) for k, v in recipe_env.items()}, **dict(env)}


def _field_conflicts(field_claims: list[FieldClaim], locked: Mapping[str, Any]) -> tuple[dict[str, FieldClaim], list[Problem]]:
    by_path: dict[str, FieldClaim] = {}
    clashes: dict[tuple[str, str], list[str]] = {}
    problems: list[Problem] = []
    for claim in field_claims:
        prev = by_path.get(claim.path)
        if prev is not None and prev.value != claim.value:
            pair = tuple(sorted((prev.overlay, claim.overlay)))
            clashes.setdefault(pair, []).append(f"{claim.path} ({prev.overlay}: {prev.value!r}, {claim.overlay}: {claim.value!r})")
            continue
        by_path.setdefault(claim.path, claim)
    for (a, b), what in clashes.items():
        problems.append(Problem((a, b), what[0].split(" ")[0], None,
                                f"{a} and {b} set the same field(s) to different values: {'; '.join(what)}",
                                f"choose one of +mem={a} or +mem={b}", check="claims"))
    for path, claim in by_path.items():
        inner = next((other for other in by_path if other.startswith(path + ".")), None)
        if inner is not None:  # writing a whole sub-config and one of its fields: the result depends on order
            problems.append(Problem(tuple(dict.fromkeys((claim.overlay, by_path[inner].overlay))), path, claim.value,
                                    f"{path} is set as a whole and {inner} inside it is set too",
                                    f"set only the fields, e.g. {inner}", check="claims"))
        if path in locked and locked[path] != claim.value:
            problems.append(Problem((claim.overlay, "override"), path, locked[path],
                                    f"your override sets {path}={locked[path]!r} but {claim.overlay} sets {claim.value!r}",
                                    f"drop the override {path}=..., or drop +mem={claim.overlay}", check="claims"))
    return by_path, problems


def _env_plan(env_claims: list[EnvClaim], effective: dict[str, str],
              process: dict[str, str] | None = None) -> tuple[dict[str, tuple[str, str | None, str]], list[Problem]]:
    """var -> (overlay, old, new) for every variable whose value changes or is required."""
    plan: dict[str, tuple[str, str | None, str]] = {}
    problems: list[Problem] = []
    for claim in env_claims:
        # the variable torch reads first, starting from the value it reads now (core/allocconf.py, issue 33 #9)
        targets = allocconf.merge_targets(claim.var, effective) if claim.merge is not None else [claim.var]
        for var in targets:
            current = plan[var][2] if var in plan else allocconf.base_value(var, effective, process)
            if claim.merge is not None:
                try:
                    new, conflicts = allocconf.merged(var, current, dict(claim.merge))
                except allocconf.AllocConfError as exc:
                    problems.append(Problem((claim.overlay,), f"${var}", current, str(exc),
                                            f"fix {var} in your environment (or cfg.env_vars), then retry",
                                            check="env"))
                    continue
                for key, (have, want) in conflicts.items():
                    problems.append(Problem(
                        (claim.overlay, CONFIG), f"${var}", current,
                        f"{var} already has {key}:{have}; {claim.overlay} needs {key}:{want}. "
                        "An explicit setting is not flipped silently",
                        f"remove {key}:{have} from {var} (export {var}=<other keys>) or drop +mem={claim.overlay}",
                        check="env"))
            else:
                new = str(claim.value)
                if current is not None and current != new and var not in plan:
                    problems.append(Problem(
                        (claim.overlay, CONFIG), f"${var}", current,
                        f"{claim.overlay} needs {var}={new} but it is set to {current!r}",
                        f"unset {var} or export {var}={shlex.quote(new)}", check="env"))
                    continue
                if var in plan and plan[var][2] != new:
                    problems.append(Problem((plan[var][0], claim.overlay), f"${var}", plan[var][2],
                                            f"{plan[var][0]} and {claim.overlay} need different {var} values ({plan[var][2]!r} vs {new!r})",
                                            f"choose one of +mem={plan[var][0]} or +mem={claim.overlay}", check="env"))
                    continue
            old = plan[var][1] if var in plan else effective.get(var)
            plan[var] = (claim.overlay, old, new)
    return plan, problems


def _crash_problem(party: str, what: str, exc: Exception) -> Problem:
    return Problem((party,), what, None, f"{what} failed on this config: {type(exc).__name__}: {short_repr(str(exc))}",
                   "check the values the overlays and overrides set; if they are valid, this is a bug in "
                   "mbmem-overlays: please report it with this message", check="internal")


# ----------------------------------------------------------------------------- arguments
ARGUMENT = "argument"  # the party for a wrong argument of the Python API


def argument_problem(name: str, value: Any, message: str, fix: str) -> Problem:
    return Problem((ARGUMENT,), name, value, message, fix, check="arguments")


def _overlay_names(overlays: Any) -> tuple[list[str], list[Problem]]:
    """The selection as a list of names, or problems (None, 5, [None], a dict) before anything runs."""
    fix = "pass a name or a list of names, e.g. overlays=['expandable_segments'] (or [] / () to select none)"
    if isinstance(overlays, str):
        return [overlays], []
    if overlays is None or isinstance(overlays, (Mapping, bytes, bytearray)) or not isinstance(overlays, Iterable):
        return [], [argument_problem("overlays", overlays, f"overlays must be a name or a list of names, got "
                                      f"{type(overlays).__name__}", fix)]
    names = list(overlays)
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        return [], [argument_problem("overlays", bad[0], f"every overlay name must be text, got "
                                      f"{', '.join(sorted({type(n).__name__ for n in bad}))}", fix)]
    return names, []


def _str_keys(name: str, value: Any, example: str) -> list[Problem]:
    if value is None:
        return []
    if not isinstance(value, Mapping):
        return [argument_problem(name, value, f"{name} must be a mapping, got {type(value).__name__}", example)]
    bad = [k for k in value if not isinstance(k, str)]
    return [argument_problem(name, bad[0], f"{name} keys must be text, got {type(bad[0]).__name__}", example)] if bad else []


def world_size_problem(world_size: Any) -> Problem | None:
    """None, or why ``world_size`` is not a number of GPUs (issue 15 #12: 0, negative, bool, "8")."""
    if world_size is None:
        return None
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        return argument_problem("world_size", world_size, f"world_size must be a whole number of GPUs, got "
                                 f"{type(world_size).__name__}", "pass an integer >= 1, e.g. world_size=8")
    if world_size < 1:
        return argument_problem("world_size", world_size, f"world_size must be at least 1 GPU, got {world_size}",
                                 "pass the number of GPUs the job runs on, e.g. world_size=8")
    if world_size > MAX_WORLD_SIZE:
        return argument_problem("world_size", world_size, f"world_size must be at most {MAX_WORLD_SIZE} GPUs (2^20), "
                                 f"got {short_repr(world_size)}", "pass the number of GPUs the job runs on, e.g. "
                                 "world_size=8")
    return None


def argument_problems(cfg: Any, overlays: Any, env: Any, params: Any, world_size: Any, locked: Any,
                      overlay_dirs: Any, catalog: Any) -> tuple[list[str], list[Problem]]:
    """The overlay names, and every wrong argument (type or value) of ``apply_overlay``/``plan_overlays``."""
    names, problems = _overlay_names(overlays)
    # A Bridge ConfigContainer is a dataclass; a plain dict is not one (issue 22 #8: it was mutated, while every
    # other non-config object was refused), and neither is a dataclass class.
    if not (dataclasses.is_dataclass(cfg) and not isinstance(cfg, type)):
        problems.append(argument_problem("cfg", cfg, f"cfg must be a config object (a Bridge ConfigContainer), "
                                          f"got {type(cfg).__name__}", "build one with a recipe, e.g. "
                                          "megatron.bridge.recipes...llama3_8b_pretrain_config()"))
    if env is not None:
        if not isinstance(env, Mapping):  # apply_overlay also needs it mutable (checked there)
            problems.append(argument_problem("env", env, f"env must be a mutable mapping (e.g. os.environ or a dict), "
                                              f"got {type(env).__name__}", "pass env=os.environ, env={} or env=None"))
        else:
            bad = next(((k, v) for k, v in env.items() if not isinstance(k, str) or not isinstance(v, str)), None)
            if bad is not None:
                problems.append(argument_problem("env", bad, f"env must map text to text, like the process environment; "
                                                  f"{short_repr(bad[0])} maps to {type(bad[1]).__name__}",
                                                  f"give {short_repr(bad[0])} a string value, e.g. '1'"))
    problems += _str_keys("params", params, "pass params={'cpu_offload.num_layers': 2} or {'cpu_offload': {'num_layers': 2}}")
    if isinstance(params, Mapping):
        for key, value in params.items():
            if isinstance(value, Mapping) and any(not isinstance(k, str) for k in value):
                problems.append(argument_problem("params", key, f"params[{key!r}] keys must be parameter names (text)",
                                                  f"e.g. {{{key!r}: {{'num_layers': 2}}}}"))
    problems += _str_keys("locked", locked, "pass locked={'model.recompute_granularity': 'full'}")
    if isinstance(locked, Mapping) and dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        # a locked key is a field the user's overrides set: it must name one (no dunders, no methods)
        problems += [p for key in locked if isinstance(key, str) and (p := path_problem(cfg, key, "locked"))]
    p = world_size_problem(world_size)
    if p:
        problems.append(p)
    if overlay_dirs is not None and (isinstance(overlay_dirs, (str, bytes, os.PathLike))
                                     or not isinstance(overlay_dirs, (list, tuple))
                                     or not all(isinstance(d, (str, os.PathLike)) for d in overlay_dirs)):
        problems.append(argument_problem("overlay_dirs", overlay_dirs, "overlay_dirs must be a list of directories",
                                          "pass overlay_dirs=['/path/to/overlays']"))
    if catalog is not None and not isinstance(catalog, Catalog):
        problems.append(argument_problem("catalog", catalog, f"catalog must be a Catalog, got {type(catalog).__name__}",
                                          "pass catalog=Catalog(...) or leave it out"))
    return names, problems


def env_name_problems(env_claims: list[EnvClaim]) -> list[Problem]:
    """Variable names and values every later step can export safely (issue 15 #2, #5).

    Catalogue files are checked when read; this also covers resolver output and names the overlay."""
    problems = []
    for claim in env_claims:
        if not isinstance(claim.var, str) or not ENV_NAME.fullmatch(claim.var):
            problems.append(Problem((claim.overlay,), f"${claim.var}", claim.value,
                                    f"{short_repr(claim.var)} is not a valid environment variable name "
                                    "(letters, digits and '_', not starting with a digit)",
                                    f"rename it in {claim.overlay}, e.g. MY_VAR", check="env"))
        elif claim.value is not None and "\0" in claim.value:
            problems.append(Problem((claim.overlay,), f"${claim.var}", claim.value,
                                    f"the value of {claim.var} contains a NUL character, which no environment holds",
                                    f"remove it in {claim.overlay}", check="env"))
    return problems


def plan_overlays(cfg: Any, overlays: str | Iterable[str] = (), *, env: Mapping[str, str] | None = None,
                  params: Mapping[str, Any] | None = None, world_size: int | None = None,
                  locked: Mapping[str, Any] | None = None, catalog: Catalog | None = None,
                  overlay_dirs: list[str] | None = None):
    """Everything ``apply_overlay`` does except mutating. Returns (report, field_claims, env_plan).

    Raises OverlayError with every problem found.
    """
    names, problems = argument_problems(cfg, overlays, env, params, world_size, locked, overlay_dirs, catalog)
    if problems:  # wrong argument types: nothing below could run meaningfully, and nothing was touched
        raise OverlayError(problems)
    if catalog is None:
        catalog = Catalog(overlay_dirs)
        # a folder the caller named that does not exist or is not a folder of overlays: as `mbmem` refuses it
        missing = catalog.folder_problems
        if missing:
            raise OverlayError(missing)
    specs: list[OverlaySpec] = []
    for name in names:
        try:
            spec = catalog.resolve(name)
        except OverlayError as exc:
            problems.extend(exc.problems)
            continue
        if spec.name not in {s.name for s in specs}:
            specs.append(spec)
    specs.sort(key=lambda s: s.name)  # order-independence: the order given never matters
    # Every problem is collected and raised once at the end ("all violations at once"); a bad
    # parameter keeps its default and a claim on a missing field is dropped so the checks still run.
    resolved_params, param_problems = normalize_params(specs, params, catalog)
    problems += param_problems

    selected = tuple(s.name for s in specs)
    process_env = dict(os.environ if env is None else env)
    effective = _effective_env(cfg, process_env)

    # 1. static claims from the YAML files
    field_claims: list[FieldClaim] = []
    for s in specs:
        for path, value in s.set.items():
            claim = FieldClaim(s.name, path, substitute(value, resolved_params[s.name]))
            p = path_problem(cfg, path, s.name)
            if p:
                problems.append(dataclasses.replace(p, value=claim.value))
            else:
                field_claims.append(claim)
    env_claims = [EnvClaim(s.name, var, merge=v) if isinstance(v, Mapping) else EnvClaim(s.name, var, value=str(v))
                  for s in specs for var, v in s.env.items()]
    claims, conflict_problems = _field_conflicts(field_claims, locked or {})
    problems += conflict_problems

    # 2. resolvers see the prospective config (all static claims), never the naming order
    view = View(cfg, claims, effective, world_size, selected, resolved_params, locked)
    extra_fields: list[FieldClaim] = []
    for s in specs:
        resolver = rules.RESOLVERS.get(s.name)
        if resolver:
            try:
                more_fields, more_env = resolver(view, resolved_params[s.name])
            except Exception as exc:  # a value no rule foresaw: report it, never a traceback
                problems.append(_crash_problem(s.name, f"resolver {s.name}", exc))
                continue
            extra_fields += [FieldClaim(s.name, p, v) for p, v in more_fields.items()]
            env_claims += [EnvClaim(s.name, var, value=str(v)) for var, v in more_env.items()]
    if extra_fields:
        for fc in list(extra_fields):
            p = path_problem(cfg, fc.path, fc.overlay)
            if p:
                problems.append(p)
                extra_fields.remove(fc)
        claims, conflict_problems = _field_conflicts(
            [c for c in field_claims if c.path not in {e.path for e in extra_fields}] + extra_fields, locked or {})
        problems += [p for p in conflict_problems if p not in problems]
    for path, claim in list(claims.items()):
        err = type_problem(read(cfg, path, None), claim.value)
        if err:
            problems.append(Problem((claim.overlay,), path, claim.value, f"{path} {err}",
                                    f"fix the value in {catalog.specs[claim.overlay].path if claim.overlay in catalog.specs else claim.overlay}",
                                    check="field_type"))
            del claims[path]  # reported; the checks below see the field's current, well-typed value
    name_problems = env_name_problems(env_claims)
    problems += name_problems
    bad_vars = {(p.overlays[0], p.field[1:]) for p in name_problems}
    env_plan, env_problems = _env_plan([c for c in env_claims if (c.overlay, c.var) not in bad_vars], effective,
                                       process_env)
    problems += env_problems

    # 3. every check runs on the final prospective state
    prospective_env = {**effective, **{var: new for var, (_, _, new) in env_plan.items()}}
    view = View(cfg, claims, prospective_env, world_size, selected, resolved_params, locked)
    report = Report(overlays=selected, params=resolved_params)
    for check in rules.CHECKS:
        report.checks.append(check.id)
        try:
            findings = list(check(view))
        except Exception as exc:  # a value no rule foresaw: report it, never a traceback
            findings = [_crash_problem(", ".join(selected) or CONFIG, f"check {check.id}", exc)]
        for finding in findings:
            if isinstance(finding, Problem):
                if finding not in problems:
                    problems.append(finding)
            elif finding.startswith("note: "):
                report.notes.append(finding[6:])
            else:
                report.warnings.append(finding)
    if problems:
        raise OverlayError(problems)

    for path, claim in sorted(claims.items()):
        old = read(cfg, path, None)
        if old != claim.value:
            report.changes.append(Change(claim.overlay, path, old, claim.value))
    recipe_env = read(cfg, "env_vars", None)
    for var, (overlay, old, new) in sorted(env_plan.items()):
        if old != new:
            report.changes.append(Change(overlay, f"${var}", old, new))
        report.env_to_export[var] = new
        if env is None and var in process_env and process_env[var] != new:
            report.warnings.append(
                f"{var}={process_env[var]!r} is set in this process's environment and wins over cfg.env_vars at "
                f"launch (Bridge applies env_vars with setdefault); export {var}={shlex.quote(new)} or pass env=os.environ")
        if isinstance(recipe_env, Mapping) and str(recipe_env.get(var)) != new:
            report.changes.append(Change(overlay, f"env_vars.{var}", recipe_env.get(var), new))
    changed_by = {c.overlay for c in report.changes}
    for name in selected:
        if name not in changed_by:
            report.notes.append(f"{name}: already in effect in this config; nothing to change")
    if not selected:
        report.notes.append("no overlays selected; nothing to change (the config was still checked)")
    # A broken user overlay that was not selected does not stop this apply; it is still reported.
    report.warnings += [f"user overlay skipped: {p.message} (fix: {p.fix})" for p in catalog.problems]
    return report, claims, env_plan


def _write_plan(root: Any, report: Report) -> list[tuple[Any, str, Any]]:
    """(object, key, new value) for every config write, resolved before the first one happens.

    ``env_vars.<VAR>`` entries are keys of cfg.env_vars, never re-split at dots (issue 15 #5)."""
    plan = []
    recipe_env = read(root, "env_vars", None)
    for change in report.changes:
        if change.target.startswith("$"):
            continue
        var = change.target[len("env_vars."):]
        if change.target.startswith("env_vars.") and var in report.env_to_export and isinstance(recipe_env, MutableMapping):
            plan.append((recipe_env, var, change.new))
        else:
            obj, key = parent_of(root, change.target)
            plan.append((obj, key, change.new))
    return plan


def _current(obj: Any, key: str) -> Any:
    return obj.get(key, MISSING) if isinstance(obj, Mapping) else getattr(obj, key, MISSING)


def _restore(obj: Any, key: str, old: Any) -> None:
    if old is MISSING and not isinstance(obj, MutableMapping):
        if key in getattr(obj, "__dict__", {}):
            delattr(obj, key)
    else:
        put(obj, key, old)


def _rejection(report: Report, world_size: int | None) -> ValidationRejected:
    v = report.validation
    return ValidationRejected(report, [Problem(
        ("bridge",), "runtime_config_update", world_size,
        f"Bridge's own validation rejected the config with {', '.join(report.overlays) or 'no overlays'} applied: "
        f"{getattr(v, 'error', None) or getattr(v, 'verdict', v)}",
        "nothing was changed (the config and environment are as before). Fix what Bridge names (a field, or "
        "the world size: the number of GPUs) or drop the overlay that sets it; report.changes lists what each "
        "overlay would change", source="megatron/bridge/training/config.py runtime_config_update", check="bridge")])


def apply_overlay(cfg: Any, overlays: str | Iterable[str] = (), *, env: MutableMapping[str, str] | None = None,
                  params: Mapping[str, Any] | None = None, world_size: int | None = None,
                  locked: Mapping[str, Any] | None = None, validator: Validator | None = None,
                  overlay_dirs: list[str] | None = None, catalog: Catalog | None = None) -> Report:
    """Apply overlays to ``cfg`` (and ``env``, when given) atomically; the arguments are documented on
    ``mbmem_overlays.apply_overlay``. ``validator`` is the stack's own validation, run on a copy of the
    config with the changes applied (that function passes Bridge's for ``validate=True``); its result is
    ``report.validation``.

    Raises ``OverlayError`` listing every problem, or ``ValidationRejected`` (an OverlayError carrying the
    report) when the validator's result has ``ok == False``; in both cases cfg and env are unchanged.

    Everything that can fail happens before the first write: planning, resolving each target object,
    and validation (on a copy). The writes themselves are plain attribute/key assignments to objects
    resolved beforehand, and each undo step is independent, so a failure cannot leave half a change.
    """
    early = []
    if validator is not None and not callable(validator):
        early.append(argument_problem("validator", validator, "validator must be callable", "leave it out"))
    if env is not None and isinstance(env, Mapping) and not isinstance(env, MutableMapping):
        early.append(argument_problem("env", env, f"env must be a mutable mapping (e.g. os.environ or a dict), "
                                       f"got read-only {type(env).__name__}", "pass env=os.environ, env={} or env=None"))
    if early:
        raise OverlayError(early)
    report, claims, env_plan = plan_overlays(cfg, overlays, env=env, params=params, world_size=world_size,
                                             locked=locked, catalog=catalog, overlay_dirs=overlay_dirs)
    if validator is not None:
        prospective = copy.deepcopy(cfg)
        for obj, key, new in _write_plan(prospective, report):
            put(obj, key, copy.deepcopy(new))
        prospective_env = None if env is None else {**env, **report.env_to_export}
        report.validation = validator(prospective, world_size, prospective_env)
        if getattr(report.validation, "ok", True) is False:
            raise _rejection(report, world_size)

    plan = _write_plan(cfg, report)
    undo = [(obj, key, _current(obj, key)) for obj, key, _ in plan]
    env_before = {var: env.get(var, MISSING) for var in report.env_to_export} if env is not None else {}
    try:
        for obj, key, new in plan:
            put(obj, key, copy.deepcopy(new))
        if env is not None:
            for var, value in report.env_to_export.items():
                env[var] = value
    except BaseException as exc:
        for obj, key, old in reversed(undo):
            try:
                _restore(obj, key, old)
            except Exception as undo_exc:  # keep undoing the rest; say what could not be restored
                exc.add_note(f"mbmem-overlays: could not restore {key}: {undo_exc!r}")
        for var, old in env_before.items():
            try:
                if old is MISSING:
                    env.pop(var, None)
                else:
                    env[var] = old
            except Exception as undo_exc:
                exc.add_note(f"mbmem-overlays: could not restore ${var}: {undo_exc!r}")
        raise
    return report
