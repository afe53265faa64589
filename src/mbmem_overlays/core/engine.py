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
from collections.abc import Callable, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from . import allocconf, rules
from .catalog import Catalog, OverlaySpec
from .errors import OverlayError, Problem
from .paths import MISSING, path_problem, read, type_problem, write

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
def _coerce_param(spec_name: str, p, value: Any) -> tuple[Any, str | None]:
    t = p.type
    if t == "int" and not (isinstance(value, int) and not isinstance(value, bool)):
        return value, f"must be an integer, got {value!r}"
    if t == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return value, f"must be a number, got {value!r}"
        value = float(value)
    if t == "bool" and not isinstance(value, bool):
        return value, f"must be true or false, got {value!r}"
    if t == "str" and not isinstance(value, str):
        return value, f"must be a string, got {value!r}"
    if t == "labels":
        if isinstance(value, str) and value != "auto":
            value = [value]
        if not (value == "auto" or (isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value))):
            return value, f"must be 'auto' or a list of labels, got {value!r}"
        if isinstance(value, tuple):
            value = list(value)
    if p.choices is not None and value not in p.choices:
        return value, f"must be one of {list(p.choices)}, got {value!r}"
    if p.min is not None and isinstance(value, (int, float)) and value < p.min:
        return value, f"must be >= {p.min}, got {value!r}"
    if p.max is not None and isinstance(value, (int, float)) and value > p.max:
        return value, f"must be <= {p.max}, got {value!r}"
    return value, None


def _normalize_params(specs: list[OverlaySpec], params: Mapping[str, Any] | None,
                      catalog: Catalog) -> tuple[dict[str, dict[str, Any]], list[Problem]]:
    given: dict[str, dict[str, Any]] = {s.name: {} for s in specs}
    problems: list[Problem] = []
    for key, value in (params or {}).items():
        if "." in key:
            oname, pname = key.split(".", 1)
            value = {pname: value}
        elif isinstance(value, Mapping):
            oname = key
        elif len(specs) == 1:
            oname, value = specs[0].name, {key: value}
        else:
            problems.append(Problem((key,), key, value, "parameter given without its overlay",
                                    f"write it as {{'<overlay>.{key}': {value!r}}} or {{'<overlay>': {{'{key}': ...}}}}"))
            continue
        oname = catalog.aliases.get(oname, oname)
        if oname not in given:
            problems.append(Problem((oname,), key, value, f"parameters for {oname!r}, which is not selected",
                                    f"add {oname} to the overlays, or drop these parameters"))
            continue
        given[oname].update(value)
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
                    f"use mem.{spec.name}.{close[0]}={value}" if close else f"see `mbmem explain {spec.name}`",
                    check="param"))
                continue
            coerced, err = _coerce_param(spec.name, spec.params[pname], value)
            if err:  # reported; the default stays so the remaining checks still see a well-typed value
                problems.append(Problem((spec.name,), f"mem.{spec.name}.{pname}", value,
                                        f"parameter {pname} {err}", spec.params[pname].help or f"see `mbmem explain {spec.name}`",
                                        check="param"))
                continue
            values[pname] = coerced
        resolved[spec.name] = values
    return resolved, problems


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
        if path in locked and locked[path] != claim.value:
            problems.append(Problem((claim.overlay, "override"), path, locked[path],
                                    f"your override sets {path}={locked[path]!r} but {claim.overlay} sets {claim.value!r}",
                                    f"drop the override {path}=..., or drop +mem={claim.overlay}", check="claims"))
    return by_path, problems


def _env_plan(env_claims: list[EnvClaim], effective: dict[str, str]) -> tuple[dict[str, tuple[str, str | None, str]], list[Problem]]:
    """var -> (overlay, old, new) for every variable whose value changes or is required."""
    plan: dict[str, tuple[str, str | None, str]] = {}
    problems: list[Problem] = []
    for claim in env_claims:
        targets = [claim.var]
        if claim.merge is not None and claim.var == allocconf.PRIMARY_VAR:
            targets += [v for v in allocconf.SIBLING_VARS if effective.get(v)]
        for var in targets:
            current = plan[var][2] if var in plan else effective.get(var)
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
                        f"unset {var} or export {var}={new}", check="env"))
                    continue
                if var in plan and plan[var][2] != new:
                    problems.append(Problem((plan[var][0], claim.overlay), f"${var}", plan[var][2],
                                            f"{plan[var][0]} and {claim.overlay} need different {var} values ({plan[var][2]!r} vs {new!r})",
                                            f"choose one of +mem={plan[var][0]} or +mem={claim.overlay}", check="env"))
                    continue
            old = plan[var][1] if var in plan else effective.get(var)
            plan[var] = (claim.overlay, old, new)
    return plan, problems


def plan_overlays(cfg: Any, overlays: str | Iterable[str], *, env: Mapping[str, str] | None = None,
                  params: Mapping[str, Any] | None = None, world_size: int | None = None,
                  locked: Mapping[str, Any] | None = None, catalog: Catalog | None = None,
                  overlay_dirs: list[str] | None = None):
    """Everything ``apply_overlay`` does except mutating. Returns (report, field_claims, env_plan).

    Raises OverlayError with every problem found.
    """
    catalog = catalog or Catalog(overlay_dirs)
    names = [overlays] if isinstance(overlays, str) else list(overlays)
    problems: list[Problem] = []
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
    resolved_params, param_problems = _normalize_params(specs, params, catalog)
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
            more_fields, more_env = resolver(view, resolved_params[s.name])
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
    for path, claim in claims.items():
        err = type_problem(read(cfg, path, None), claim.value)
        if err:
            problems.append(Problem((claim.overlay,), path, claim.value, f"{path} {err}",
                                    f"fix the value in {catalog.specs[claim.overlay].path if claim.overlay in catalog.specs else claim.overlay}",
                                    check="field_type"))
    env_plan, env_problems = _env_plan(env_claims, effective)
    problems += env_problems

    # 3. every check runs on the final prospective state
    prospective_env = {**effective, **{var: new for var, (_, _, new) in env_plan.items()}}
    view = View(cfg, claims, prospective_env, world_size, selected, resolved_params, locked)
    report = Report(overlays=selected, params=resolved_params)
    for check in rules.CHECKS:
        report.checks.append(check.id)
        for finding in check(view):
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
                f"launch (Bridge applies env_vars with setdefault); export {var}={new} or pass env=os.environ")
        if isinstance(recipe_env, Mapping) and str(recipe_env.get(var)) != new:
            report.changes.append(Change(overlay, f"env_vars.{var}", recipe_env.get(var), new))
    changed_by = {c.overlay for c in report.changes}
    for name in selected:
        if name not in changed_by:
            report.notes.append(f"{name}: already in effect in this config; nothing to change")
    return report, claims, env_plan


def apply_overlay(cfg: Any, overlays: str | Iterable[str], *, env: MutableMapping[str, str] | None = None,
                  params: Mapping[str, Any] | None = None, world_size: int | None = None,
                  locked: Mapping[str, Any] | None = None, validator: Validator | None = None,
                  overlay_dirs: list[str] | None = None, catalog: Catalog | None = None) -> Report:
    """Apply overlays to ``cfg`` (and ``env``, when given) atomically; the arguments are documented on
    ``mbmem_overlays.apply_overlay``. ``validator`` is the stack's own validation, run on the applied
    config (that function passes Bridge's for ``validate=True``); its result is ``report.validation``.

    Raises ``OverlayError`` listing every problem; then cfg and env are unchanged.
    """
    report, claims, env_plan = plan_overlays(cfg, overlays, env=env, params=params, world_size=world_size,
                                             locked=locked, catalog=catalog, overlay_dirs=overlay_dirs)
    undo_fields: list[tuple[str, Any]] = []
    env_before = {var: env.get(var, MISSING) for var in env_plan} if env is not None else {}
    try:
        for change in report.changes:
            if change.target.startswith("$"):
                continue
            undo_fields.append((change.target, read(cfg, change.target, MISSING)))
            write(cfg, change.target, copy.deepcopy(change.new))
        if env is not None:
            for var, value in report.env_to_export.items():
                env[var] = value
        if validator is not None:
            report.validation = validator(cfg, world_size, env)
    except BaseException:
        for path, old in reversed(undo_fields):
            write(cfg, path, old)
        for var, old in env_before.items():
            if old is MISSING:
                env.pop(var, None)
            else:
                env[var] = old
        raise
    return report
