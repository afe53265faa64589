"""The next command: the user's own launch command from the log, changed by one remedy, and checked.

The command keeps the launcher (torchrun/srun/python -m torch.distributed.run ...), the recipe, the
layout and every override seen in the log; only the remedy's tokens change. A train.py command gets
overlays (``+mem=...``) and parameters (``mem.<overlay>.<param>=v``), checked against the overlay
catalogue without Bridge (names, parameters and their types/ranges, no two overlays writing one field,
the rules that need only the layout the log shows); with Bridge (``--plan``) the engine validates the
whole set on the real recipe (plan.py). Megatron-LM scripts get megatron-core's own argument names and
are marked unverified. Environment remedies become a prefix (``VAR=value <command>``).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from ..core import allocconf
from ..core.catalog import (  # the engine's own parameter check
    Catalog,
    coerce_param,
    train_recipe_arg,
)
from ..core.errors import OverlayError
from ..core.text import first_command

MEM_LIST = re.compile(r"^\+{1,2}mem=\[?([^\]]*)\]?$")
MEM_PARAM = re.compile(r"^\+{0,2}mem\.(\w+)\.(\w+)=(.*)$")

# Megatron-LM's argument names for the overlays' settings (megatron/training/arguments.py; the same
# TransformerConfig / DDP / optimizer fields as bridge-config-surface.md §1).
MEGATRON_LM_FLAGS = {
    "selective_recompute": ["--recompute-activations"],
    "full_recompute": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"],
    "dist_optimizer": ["--use-distributed-optimizer"],
    "sequence_parallel": ["--sequence-parallel"],
    "optimizer_offload": ["--optimizer-cpu-offload", "--optimizer-offload-fraction", "1.0"],
}


@dataclass
class Remedy:
    """One change to the job. Exactly what the next command changes, and what the doctor knows of it."""
    name: str
    action: str                                   # what to do, in words
    overlay: str | None = None                    # catalogue overlay to add
    params: dict[str, Any] = field(default_factory=dict)        # that overlay's parameters
    remove_overlays: tuple[str, ...] = ()
    overrides: dict[str, Any] = field(default_factory=dict)     # config overrides (train.py KEY=VALUE)
    env: dict[str, str] = field(default_factory=dict)           # environment prefix
    cost: str = ""
    saves: float | None = None                    # bytes, from the memory model (--plan); None = not computed
    # the cost model's price of this change for the job (--plan; memory/cost/ Cost.as_dict: "text", "low",
    # "high", "rank_key", "flops", "bytes_per_link", "bubble", ...); None = not computed
    step_cost: dict | None = None
    command: str | None = None                    # a command that is not the training command (nvidia-smi, ...)
    command_note: str = ""                        # how that command was checked
    megatron: dict | None = None                  # a Megatron-LM job's flags for it (--plan: megatron_plan.py)


@dataclass
class Launch:
    env: dict[str, str]
    launcher: list[str]         # tokens up to and including the script
    args: list[str]
    kind: str                   # train.py | megatron-lm | other | template
    where: str = ""


def parse_launch(text: str | None, where: str = "", recipe: str | None = None) -> Launch:
    """The launch command seen in the log; without one, a train.py template for the recipe."""
    if text:
        try:
            tokens = shlex.split(text)
        except ValueError:  # unbalanced quotes in a logged line
            tokens = text.split()
        tokens = first_command(tokens)   # `... 2>&1 | tee run.log`: the rest is another command's
        script = next((i for i, t in enumerate(tokens) if t.endswith(".py")), None)
        if script is not None:
            name = tokens[script].rsplit("/", 1)[-1]
            args = tokens[script + 1:]
            kind = ("train.py" if name == "train.py" else
                    "megatron-lm" if name.startswith(("pretrain_", "finetune_")) or any(a.startswith("--") for a in args)
                    else "other")
            return Launch({}, tokens[:script + 1], args, kind, where)
    arg = train_recipe_arg(recipe) if recipe else "recipe=<recipe>"
    return Launch({}, ["python", "train.py"], [arg], "template")


def overlays_in(launch: Launch) -> list[str]:
    out: list[str] = []
    for a in launch.args:
        m = MEM_LIST.match(a)
        if m:
            out += [x.strip() for x in m.group(1).split(",") if x.strip()]
    return out


def overrides_in(launch: Launch) -> dict[str, str]:
    out: dict[str, str] = {}
    for a in launch.args:
        key, sep, value = a.partition("=")
        if sep and not key.lstrip("+").startswith("mem") and not a.startswith("-"):
            out[key] = value
    return out


def params_in(launch: Launch) -> dict[str, str]:
    return {f"{m.group(1)}.{m.group(2)}": m.group(3) for a in launch.args if (m := MEM_PARAM.match(a))}


def apply_remedy(launch: Launch, remedy: Remedy, catalog: Catalog | None) -> tuple[list[str], list[str]]:
    """(tokens of the new command, overlays it selects)."""
    env = dict(launch.env)
    env.update(remedy.env)
    if launch.kind in ("train.py", "template"):
        overlays = [o for o in overlays_in(launch) if _canonical(o, catalog) not in
                    {_canonical(r, catalog) for r in remedy.remove_overlays}]
        if remedy.overlay and _canonical(remedy.overlay, catalog) not in {_canonical(o, catalog) for o in overlays}:
            overlays.append(remedy.overlay)
        params = {k: v for k, v in params_in(launch).items()
                  if _canonical(k.split(".")[0], catalog) in {_canonical(o, catalog) for o in overlays}}
        params.update({f"{remedy.overlay}.{k}": _text(v) for k, v in remedy.params.items()})
        owned = set(remedy.overrides)
        if remedy.overlay and catalog is not None:
            try:  # the overlay now sets these fields: the user's own override of them would conflict
                owned |= set(catalog.resolve(remedy.overlay).set)
            except OverlayError:
                pass
        args = [a for a in launch.args if not MEM_LIST.match(a) and not MEM_PARAM.match(a)
                and a.partition("=")[0].lstrip("+") not in owned]
        if overlays:
            args.append(f"+mem={overlays[0]}" if len(overlays) == 1 else f"+mem=[{','.join(overlays)}]")
        args += [f"mem.{k}={v}" for k, v in params.items()]
        args += [f"{k}={_text(v)}" for k, v in remedy.overrides.items()]
        return _env_tokens(env) + launch.launcher + args, overlays
    args = list(launch.args)
    if launch.kind == "megatron-lm":
        for o in remedy.remove_overlays:
            args = [a for a in args if a not in MEGATRON_LM_FLAGS.get(_canonical(o, catalog), [])]
        if remedy.overlay:
            flags = MEGATRON_LM_FLAGS.get(_canonical(remedy.overlay, catalog), [])
            if flags and flags[0] not in args:
                args += flags
        for key, value in remedy.overrides.items():
            flag = "--" + key.rsplit(".", 1)[-1].replace("_", "-")
            if flag in args:
                i = args.index(flag)
                if i + 1 < len(args) and not args[i + 1].startswith("--"):
                    args[i + 1] = _text(value)
                elif value is False:
                    del args[i]
            elif value is not False:
                args += [flag, _text(value)]
    return _env_tokens(env) + launch.launcher + args, []


def _canonical(name: str, catalog: Catalog | None) -> str:
    return catalog.aliases.get(name, name) if catalog else name


def _text(value: Any) -> str:
    """A value as Hydra's override grammar (train.py) and Megatron-LM's flags read it."""
    return "true" if value is True else "false" if value is False else "null" if value is None else str(value)


def _env_tokens(env: dict[str, str]) -> list[str]:
    return [f"{k}={v}" for k, v in env.items()]


ASSIGNMENT = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)=(.*)", re.S)


def render_tokens(tokens: list[str]) -> str:
    """The command as a shell reads it back: every word quoted (issue 22 #2b: a value from a log or an option
    never becomes shell syntax); the leading ``VAR=value`` words quote the value only, so they stay
    assignments."""
    out, leading = [], True
    for t in tokens:
        m = ASSIGNMENT.fullmatch(t) if leading else None
        if m:
            out.append(f"{m.group(1)}={shlex.quote(m.group(2))}")
        else:
            leading = False
            out.append(shlex.quote(t))
    return " ".join(out)


def overlay_dirs_env(overlays: list[str], catalog: Catalog | None, dirs: list[str]) -> dict[str, str]:
    """``MBMEM_OVERLAY_DIRS`` for a printed train.py command that selects a user overlay (issue 22 #2a): the
    command must find the overlay where this process found it, from any folder and in a Slurm script."""
    if catalog is None or not dirs:
        return {}
    user = False
    for name in overlays:
        try:
            user = user or not catalog.resolve(name).builtin
        except OverlayError:
            continue
    if not user:
        return {}
    import os

    from ..core.catalog import USER_DIRS_ENV
    return {USER_DIRS_ENV: os.pathsep.join(dict.fromkeys(os.path.abspath(d) for d in dirs))}


def check_catalog(overlays: list[str], params: dict[str, Any], layout: dict[str, int],
                  catalog: Catalog | None) -> list[str]:
    """Problems the catalogue alone can find (no Bridge): unknown overlays or parameters, bad parameter
    values, two overlays writing one field, and the rules whose inputs the log shows (CPU offload with PP>1)."""
    if catalog is None:
        return ["the overlay catalogue could not be read"]
    problems: list[str] = []
    writers: dict[str, tuple[str, Any]] = {}
    specs = []
    for name in overlays:
        try:
            specs.append(catalog.resolve(name))
        except OverlayError as exc:
            problems += [p.message for p in exc.problems]
    by_name = {s.name: s for s in specs}
    for key, value in params.items():
        oname, _, pname = key.partition(".")
        spec = by_name.get(_canonical(oname, catalog))
        if spec is None:
            problems.append(f"parameter {key} for an overlay that is not selected")
        elif pname not in spec.params:
            problems.append(f"{spec.name} has no parameter {pname!r}")
        else:
            _, err = coerce_param(spec.params[pname], _typed(value))
            if err:
                problems.append(f"mem.{key}: {err}")
    for spec in specs:
        for path, value in spec.set.items():
            if isinstance(value, str) and value.startswith("@"):
                continue
            if path in writers and writers[path][1] != value:
                problems.append(f"{spec.name} and {writers[path][0]} both set {path} ({value!r} vs {writers[path][1]!r})")
            writers.setdefault(path, (spec.name, value))
    if "cpu_offload" in by_name and layout.get("pp", 1) > 1:  # core/rules offload.py, cpu_offload_pipeline
        problems.append(f"cpu_offload with PP={layout['pp']} > 1 (megatron-core refuses activation offloading with PP>1)")
    return problems


def _typed(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    from ..core.values import parse_value
    try:
        return parse_value(value)
    except Exception:  # noqa: BLE001 — an unparsable value is reported by the type check that follows
        return value


def load_catalog(overlay_dirs: list[str] | None = None) -> tuple[Catalog | None, str | None]:
    try:
        return Catalog(overlay_dirs), None
    except OverlayError as exc:
        return None, "; ".join(p.message for p in exc.problems)


def merged_alloc_env(current: str | None, key: str, value: str) -> dict[str, str]:
    """PYTORCH_CUDA_ALLOC_CONF with one key merged in, the user's other keys kept (core/allocconf.py)."""
    try:
        text, _ = allocconf.merged(allocconf.PRIMARY_VAR, current, {key: value})
    except allocconf.AllocConfError:
        text = f"{key}:{value}"
    return {allocconf.PRIMARY_VAR: text}


def alloc_env_without(current: str, key: str) -> dict[str, str]:
    try:
        settings = allocconf.parse(allocconf.PRIMARY_VAR, current)
    except allocconf.AllocConfError:
        settings = {}
    settings.pop(key, None)
    return {allocconf.PRIMARY_VAR: allocconf.render(settings)}
