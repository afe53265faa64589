"""What ``train.py`` does with a composed Hydra config: validate, plan, and launch.

Hydra composes ``+mem=[a,b]`` last-wins and silently (ecosystem-notes.md), so
the selected overlays are taken from the keys under ``mem`` (each option file is
``# @package mem.<name>``) and applied through the same engine as
``apply_overlay``: order-independent, all violations at once.

Order of work, cheapest first (issue 17, "Fast, quiet, visible"): the process environment and
``run.*`` options, the recipe name, the overlays and their parameters are checked before Bridge is
imported; then the recipe is built and the overrides (with Bridge's own value conversion) are
checked together with every overlay rule; then Bridge validates a copy.

Under ``-m`` (multirun) every job starts from the environment the sweep started with (a dry run
never writes ``os.environ``; a launch exports only validated names), no job exits the process, and
``finish()`` reports each job's verdict and returns a non-zero code if any job failed.
"""

from __future__ import annotations

import copy
import difflib
import json
import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..bridge.stack import EXIT_STACK, StackError
from ..core import console
from ..core.catalog import RESERVED_KEY, Catalog, data_dir, recipe_file
from ..core.errors import OverlayError, Problem, ValidationRejected, short_repr
from ..core.paths import MISSING
from ..core.report import (
    EXIT_INCOMPLETE,
    EXIT_OK,
    EXIT_OUTPUT,
    EXIT_REJECTED,
    EXIT_USAGE,
    SCHEMA_VERSION,
)
from ..core.text import quoted_word, shown
from ..core.values import MAX_WORLD_SIZE, parse_count, text_problem, value_fix, value_problem
from .process import env_name_problems, export_environment, prepare_snapshot_folder

HYDRA_KEYS = ("recipe", "mem", "run", "hydra", "bridge")
RUNS_DIR_ENV = "MBMEM_RUNS_DIR"


class UsageError(OverlayError):
    """train.py was given something it cannot use (found before Bridge is imported): exit 2."""


@dataclass
class JobResult:
    number: int
    overrides: str
    code: int


SWEEP_START_ENV: dict[str, str] | None = None  # os.environ when train.py started (before any job)
JOBS: list[JobResult] = []


def _register_resolvers() -> None:
    """``${mbmem_pid:}`` in train.yaml's sweep folder: two sweeps started in the same microsecond by two
    processes still get different folders (issue 15 #7)."""
    from omegaconf import OmegaConf
    if not OmegaConf.has_resolver("mbmem_pid"):
        OmegaConf.register_new_resolver("mbmem_pid", lambda: str(os.getpid()))


_register_resolvers()


# ---------------------------------------------------------------- before Hydra: the command line


def hydra_argv(argv: list[str], catalog: Catalog | None = None) -> list[str]:
    """Rewrite a user's command line for Hydra.

    - ``model.x=4`` (any Bridge field) -> ``+bridge.model.x=4``: Bridge overrides live under ``bridge``.
    - overlay aliases (``+mem=lora_regather``, ``mem.lora_regather.strict=false``) -> canonical names.
    """
    catalog = catalog or Catalog()
    selected = set()
    for arg in argv[1:]:
        key, _, value = arg.partition("=")
        if not arg.startswith("-") and key.lstrip("+~") == "mem":
            selected |= {catalog.aliases.get(n.strip(), n.strip()) for n in value.strip("[]").split(",")}
    out = [argv[0]]
    for arg in argv[1:]:
        if arg.startswith("-") or "=" not in arg:
            out.append(arg)
            continue
        key, _, value = arg.partition("=")
        bare = key.lstrip("+~")
        head = bare.split(".")[0].split("@")[0].split("/")[0]   # hydra/job_logging=...: a group of Hydra's
        if head == "mem":
            if bare == "mem":
                names = [n.strip() for n in value.strip("[]").split(",") if n.strip()]
                names = [catalog.aliases.get(n, n) for n in names]
                value = f"[{','.join(names)}]" if value.startswith("[") else ",".join(names)
            else:
                parts = bare.split(".")
                if len(parts) > 1:
                    parts[1] = catalog.aliases.get(parts[1], parts[1])
                prefix = key[: len(key) - len(bare)]
                if prefix == "+" and len(parts) > 2 and parts[1] in selected:
                    prefix = ""  # the overlay's file holds the key already: '+' would be Hydra's "already there" error
                key = prefix + ".".join(parts)
            out.append(f"{key}={value}")
        elif head in HYDRA_KEYS:
            out.append(arg)
        else:
            out.append(f"+bridge.{bare}={value}")
    return out


def runs_dir_problem(environ: dict[str, str] | os._Environ = os.environ) -> Problem | None:
    """``MBMEM_RUNS_DIR`` must be a directory (or creatable): Hydra makes its run folders there before
    any of our code runs, and a file in the way gave a traceback (issue 15 #10)."""
    raw = environ.get(RUNS_DIR_ENV)
    if not raw:
        return None
    path = Path(raw)
    try:
        existing = next((p for p in (path, *path.parents) if p.exists()), None)
    except OSError as exc:  # a name too long for the filesystem, a path through an unreadable folder
        return Problem(("run",), RUNS_DIR_ENV, raw, f"cannot use it for run records: {exc.strerror}",
                       f"point {RUNS_DIR_ENV} at a directory (export {RUNS_DIR_ENV}=$HOME/mbmem-runs) or unset it",
                       check="runs_dir")
    if existing is not None and not existing.is_dir():
        return Problem(("run",), RUNS_DIR_ENV, raw, f"{existing} is not a directory, so run records cannot go under it",
                       f"point {RUNS_DIR_ENV} at a directory (export {RUNS_DIR_ENV}=$HOME/mbmem-runs) or unset it",
                       check="runs_dir")
    if existing is not None and not os.access(existing, os.W_OK):
        return Problem(("run",), RUNS_DIR_ENV, raw, f"{existing} is not writable",
                       f"point {RUNS_DIR_ENV} at a writable directory or unset it", check="runs_dir")
    return None


def rank_of(environ) -> tuple[int, Problem | None]:
    """This process's rank from ``RANK`` (torchrun sets it); a non-integer is a clear error, not a traceback."""
    raw = environ.get("RANK", "0")
    rank, why = parse_count(str(raw), minimum=0, maximum=MAX_WORLD_SIZE - 1)  # never int() 5,000 digits
    if why is None:
        return rank, None
    return 0, Problem(("run",), "RANK", raw, f"RANK={short_repr(raw)} in the environment is not a process rank",
                      "unset RANK (torchrun sets it for each process) or export RANK=0", check="rank")


def startup(argv: list[str]) -> list[str]:
    """train.py's first step, before Hydra: everything Hydra would otherwise answer in its own words (exit 1,
    nothing on stdout under run.json=true) or act on silently, answered as ``mbmem apply`` answers it, all at
    once, exit 2 (issue 22 #4): the run folder and RANK; each override's syntax and value (the one rule for user
    values, core/values.py: no ``${...}``, numbers in range, no control characters); the recipe; the overlays, read
    by the same bounded loader as everywhere (a broken or hostile user overlay file never reaches Hydra's loader,
    issue 22 #1, #7); their parameters, a parameter of an unselected overlay included; then a trial composition
    for whatever Hydra still refuses. Exits 2 with a message (never a traceback) when something is wrong."""
    global SWEEP_START_ENV
    SWEEP_START_ENV = dict(os.environ)
    gone = console.cwd_problem()
    if gone is not None:  # before Hydra, whose own message blames the config path (issue 33 #14)
        as_json = any(a.lstrip("+").replace(" ", "").lower() == "run.json=true" for a in argv[1:])
        print(f"train.py: {console.CWD_GONE}; {console.CWD_FIX}", file=sys.stderr)
        if as_json:
            from ..core.report import render_error_json
            print(render_error_json(UsageError([gone]), EXIT_USAGE))
        sys.exit(console.finish(EXIT_USAGE, "train.py"))
    _quiet_foreign_plugins()
    flags, rest, flag_problems = split_flags(argv[1:])
    argv = [argv[0], *flags, *rest]   # Hydra's argparse takes flags only before the overrides: any order works
    parsed = _parse_all(argv[1:])
    as_json = any(ov is not None and ov.key_or_group == "run.json" and _values(ov) == [True] for _, ov, _ in parsed)
    problems = [p for p in (runs_dir_problem(), rank_of(os.environ)[1]) if p]
    problems += flag_problems
    problems += [p for _, _, p in parsed if p]
    try:
        catalog = Catalog(_searchpath_overlay_dirs(parsed))
        problems += catalog.folder_problems
    except OverlayError as exc:
        problems += exc.problems
        catalog = None
    rewritten = hydra_argv(argv, catalog) if catalog is not None else list(argv)
    if catalog is not None:
        problems += command_line_problems(_parse_all(rewritten[1:]), catalog)
    if not problems and _composable(rewritten[1:]):
        problems += composition_problems(rewritten[1:])
    if problems:
        try:
            _print_error(UsageError(problems), as_json=as_json)
        except OSError as exc:
            if not console.is_output_error(exc):
                raise
            sys.exit(console.output_failed("train.py", exc))
        sys.exit(console.finish(EXIT_USAGE, "train.py"))
    return rewritten


# Hydra's command-line flags train.py passes on. The others are refused (issue 22 round 3): --experimental-rerun
# loads a pickle (code execution), --config-path/--config-name/--config-dir swap train.yaml for any file,
# --package/--shell-completion/--info answer with tracebacks or print instead of planning, and --hydra-help composes
# Hydra's own config with train.py's overrides (a traceback on recipe=).
HYDRA_FLAGS = ("-m", "--multirun", "-h", "--help", "--version", "--resolve")
HYDRA_CFG_FLAGS = ("-c", "--cfg")
HYDRA_CFG_CHOICES = ("job", "hydra", "all")
# Hydra settings a command line may change: where user overlays are found, and Hydra's logging. Run folders,
# output_subdir, job names (file names) and launchers are train.py's: run records go to MBMEM_RUNS_DIR.
HYDRA_SETTINGS = ("hydra.searchpath", "hydra.verbose")


def split_flags(args: list[str]) -> tuple[list[str], list[str], list[Problem]]:
    """(Hydra flags with their values, every other argument, problems): unknown flags, flags train.py refuses,
    ``--cfg`` without job/hydra/all, and ``~key`` deletions (Hydra's own error, exit 1, otherwise)."""
    flags, rest, problems = [], [], []
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, inline = arg.partition("=")
        if arg.startswith("~"):
            problems.append(Problem(("override",), arg.lstrip("~").partition("=")[0][:100], None,
                                    f"{short_repr(arg)}: deleting config fields is not supported",
                                    "leave the field out, or set it to the value you want (KEY=VALUE)",
                                    check="override"))
        elif not arg.startswith("-"):
            rest.append(arg)
        elif name in HYDRA_CFG_FLAGS:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
            if not eq:
                i += 1   # the value was the next argument
            if value not in HYDRA_CFG_CHOICES:
                problems.append(Problem(("flag",), name, value[:40] or None,
                                        f"{name} needs one of {', '.join(HYDRA_CFG_CHOICES)}, got {short_repr(value)}",
                                        f"e.g. {name} job", check="flag"))
            else:
                flags += [name, value]
        elif arg in HYDRA_FLAGS:
            flags.append(arg)
        else:
            problems.append(Problem(("flag",), name[:40], None,
                                    f"train.py does not take {short_repr(name)}",
                                    "train.py takes -m (sweeps), --cfg job|hydra|all, --resolve, --help "
                                    "and --version; give everything else as KEY=VALUE", check="flag"))
        i += 1
    return flags, rest, problems


def _quiet_foreign_plugins() -> None:
    """multistorageclient (installed with Bridge) registers a Hydra config source that logs a traceback whenever
    Hydra asks it whether it is available (with any hydra.searchpath); train.py never reads msc:// configs."""
    import logging
    import warnings
    logging.getLogger("multistorageclient.contrib.hydra").setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", message="provider=msc-universal")


def _parse_all(args: list[str]) -> list[tuple[str, Any, Problem | None]]:
    """(arg, Hydra's parsed override or None, its syntax problem or None) for every ``KEY=VALUE`` argument."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    parser, out = OverridesParser.create(), []
    for arg in args:
        if arg.startswith("-") or "=" not in arg:
            continue
        shown_arg = arg.removeprefix("+bridge.")
        key, _, raw = shown_arg.partition("=")
        why = text_problem(arg)
        if why:  # measured before Hydra's recursive parser sees it (core/values.py)
            out.append((arg, None, Problem(("override",), key[:100], raw[:100], f"{short_repr(shown_arg)} {why}",
                                           value_fix(why, key[:100]), check="override")))
            continue
        try:
            out.append((arg, parser.parse_override(arg), None))
        except HydraException as exc:
            out.append((arg, None, Problem(("override",), key, raw, f"cannot parse {short_repr(shown_arg)}: "
                                           f"{' '.join(str(exc).split())}",
                                           "write KEY=VALUE with Hydra syntax: dotted names, lists as [a,b], "
                                           "e.g. model.tensor_model_parallel_size=2", check="override")))
        except ValueError as exc:  # Hydra's int() on 4,301 digits: Python's int-digit limit
            why = f"cannot be read: {' '.join(str(exc).split()[:12])}"
            out.append((arg, None, Problem(("override",), key, raw, f"the value of {key} {why}",
                                           value_fix(why, key), check="override")))
    return out


def _values(override) -> list[Any]:
    """The value of an override, or each value of a choice sweep (``a,b`` under -m); range sweeps are numbers
    Hydra generates, so there is nothing of the user's to check."""
    from hydra.core.override_parser.types import ChoiceSweep

    from ..core.values import plain
    if override.is_delete():
        return []
    value = override.value()
    if isinstance(value, ChoiceSweep):
        return [plain(v) for v in value.list]
    return [] if override.is_sweep_override() else [plain(value)]


def _searchpath_overlay_dirs(parsed) -> list[str]:
    """``hydra.searchpath=[file://DIR,...]`` entries that hold ``mem/`` (user overlays given to Hydra)."""
    dirs = []
    for _, ov, _ in parsed:
        if ov is None or ov.key_or_group != "hydra.searchpath":
            continue
        for entry in (v for value in _values(ov) for v in (value if isinstance(value, list) else [value])):
            if isinstance(entry, str) and entry.startswith("file://") and Path(entry[7:], "mem").is_dir():
                dirs.append(entry[7:])
    return dirs


def command_line_problems(parsed, catalog: Catalog) -> list[Problem]:
    """What train.py's command line asks for, checked before Hydra composes it, with the words ``mbmem apply``
    uses (the same functions): every value, the recipe, the overlays, their parameters."""
    from ..bridge.overrides import request_problems
    problems: list[Problem] = []
    names: list[str] = []
    params: list[tuple[str, Any]] = []
    for _, ov, problem in parsed:
        if ov is None or problem is not None:
            continue
        key = ov.key_or_group
        shown_key = key.removeprefix("bridge.")
        parts = key.split(".")
        if key.split("/")[0].split(".")[0] == "hydra":
            if key not in HYDRA_SETTINGS:
                problems.append(Problem(("override",), key[:100], None,
                                        f"{key} is train.py's to set: run records (Hydra's .hydra/, the job log, "
                                        "mbmem_report.json) go to one folder per run, never over existing files",
                                        f"set {RUNS_DIR_ENV}=DIR to choose where run folders go; of Hydra's settings "
                                        f"only {', '.join(HYDRA_SETTINGS)} may be given", check="override"))
            continue  # hydra.searchpath (user overlays) and hydra.verbose keep Hydra's rules
        if len(parts) == 1 and key in ("run", "bridge") and ov.package is None:
            example = "run.dry_run=true" if key == "run" else "model.tensor_model_parallel_size=2"
            problems.append(Problem(("override",), key, None,
                                    f"{key} is a group of settings; it cannot be given one value",
                                    f"set its fields one by one, e.g. {example}", check="override"))
            continue
        if parts[0] == "run" and (len(parts) != 2 or parts[1] not in RUN_OPTION_KEYS):
            close = difflib.get_close_matches(parts[-1], RUN_OPTION_KEYS, n=1)
            problems.append(Problem(("override",), key, None, f"train.py has no setting {key}"
                                    + (f"; did you mean run.{close[0]}?" if close else ""),
                                    f"one of: {', '.join(f'run.{k}' for k in RUN_OPTION_KEYS)}", check="override"))
            continue
        if parts[0] == "mem" and len(parts) >= 3:  # mem.<overlay>.<param>: checked with the parameters below
            params += [(".".join(parts[1:]), v) for v in _values(ov)]
            continue
        if len(parts) == 2 and parts[0] == "run" and parts[1] in RUN_OPTION_KEYS:  # typed as the job types them
            for value in _values(ov):
                problems += [p for p in run_options({parts[1]: value})[1] if p not in problems]
            continue
        for value in _values(ov):
            why = value_problem(value)
            if why:
                problems.append(Problem(("override",), shown_key, value, f"the value of {shown_key} {why}",
                                        value_fix(why, shown_key), check="override"))
            elif key == "recipe" and ov.package is None:
                problems += recipe_choice_problems(value)
            elif key == "recipe.function" and value is not None:   # before Hydra makes a run folder for it
                from ..bridge.recipes import recipe_name_problem
                problems += [p for p in [recipe_name_problem(value)] if p and p not in problems]
            elif key == "mem" and ov.package is None and value is not None:
                for name in value if isinstance(value, list) else [value]:
                    try:
                        spec = catalog.resolve(name)
                    except OverlayError as exc:
                        problems += [p for p in exc.problems if p not in problems]
                        continue
                    names.append(spec.name)
    names = list(dict.fromkeys(names))
    for key, value in params:  # one at a time: a -m sweep gives one parameter several values
        problems += [p for p in request_problems(names, {key: value}, catalog) if p not in problems]
    return problems


def recipe_choice_problems(name: Any) -> list[Problem]:
    """``recipe=<name>`` names a file of recipes/recipe/ (Hydra's config group ``recipe``)."""
    from ..bridge.recipes import recipe_name_problem, shipped_recipes
    if name is None or (isinstance(name, str) and recipe_file(name) is not None):
        return []
    import difflib
    choices = shipped_recipes()
    close = difflib.get_close_matches(str(name), choices, n=1)
    hint = f"; did you mean recipe={close[0]}?" if close else ""
    as_function = (f", or run the Bridge recipe function itself: recipe.function={name}"
                   if isinstance(name, str) and recipe_name_problem(name) is None else "")
    return [Problem(("recipe",), "recipe", name, f"unknown recipe {short_repr(str(name))} (not in recipes/recipe/){hint}",
                    f"choose one of: {', '.join(choices)}{as_function}", check="recipe")]


def _composable(args: list[str]) -> bool:
    """A trial composition needs plain overrides: no -m (sweeps compose per job), no Hydra flags (--cfg, -c ...)."""
    return all("=" in a and not a.startswith("-") for a in args)


def composition_problems(overrides: list[str]) -> list[Problem]:
    """Hydra's Compose API on train.yaml with these overrides: whatever it still refuses (``run.nope=1``,
    ``mem=x`` without ``+``, ``+mem=a,b`` without -m) becomes our usage error in Hydra's words."""
    from hydra import compose, initialize_config_dir
    try:
        with initialize_config_dir(config_dir=str(data_dir("recipes")), version_base="1.3", job_name="train"):
            compose("train", overrides=overrides)
    except Exception as exc:  # noqa: BLE001  Hydra's MissingConfigException, ConfigCompositionException, ...
        return [Problem(("hydra",), "command line", None, f"Hydra cannot compose the config: "
                        f"{' '.join(str(exc).split())}",
                        "fix the override Hydra names; overlays are selected with +mem=name or '+mem=[a,b]', "
                        "parameters set with mem.<overlay>.<param>=value", check="hydra")]
    return []


# ---------------------------------------------------------------- one job


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of nested mappings by dotted key."""
    if isinstance(node, dict) and node:
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: node} if prefix else {}


def selected_overlays(mem: Any, catalog: Catalog) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """Overlay names and parameters from the composed ``mem`` node; every problem at once. An overlay is selected
    when its file was composed (its ``overlay:`` declaration is there), never by a parameter alone."""
    from ..core.engine import unselected_problem
    names, params, problems = [], {}, []
    if mem is not None and not isinstance(mem, dict):
        raise UsageError([Problem(("mem",), "mem", mem, "mem must hold the selected overlays",
                                  "select overlays with +mem=name or '+mem=[a,b]'")])
    for name, node in (mem or {}).items():
        try:
            spec = catalog.resolve(name)
        except OverlayError as exc:
            problems += exc.problems
            continue
        if node is not None and not isinstance(node, dict):  # +mem.cpu_offload=5
            problems.append(Problem((name,), f"mem.{name}", node,
                                    f"mem.{name} holds the overlay's parameters, not a value",
                                    f"select it with +mem={name} and set a parameter with mem.{name}.<param>=value "
                                    f"(`mbmem explain {quoted_word(name)}` lists them)"))
            continue
        node = dict(node or {})
        if RESERVED_KEY not in node:  # no file was loaded here: `+mem.<name>.<param>=` made the node, not +mem=
            problems.append(unselected_problem(spec.name, f"mem.{name}", node))
            continue
        declared = node.pop(RESERVED_KEY, None)
        if declared is not None and declared != spec.raw.get(RESERVED_KEY):
            problems.append(Problem((name,), f"mem.{name}.{RESERVED_KEY}", None,
                                    "the overlay's declaration cannot be overridden from the command line",
                                    f"override parameters only (mem.{name}.<param>=...), or write your own overlay file"))
        names.append(spec.name)
        params[spec.name] = node
    if problems:
        raise UsageError(problems)
    return names, params


def _search_path_dirs() -> list[str]:
    """User overlay directories given to Hydra (hydra.searchpath=[file://DIR]) count as overlay dirs."""
    from hydra.core.hydra_config import HydraConfig
    if not HydraConfig.initialized():
        return []
    dirs = []
    for entry in HydraConfig.get().searchpath or []:
        path = entry[len("file://"):] if entry.startswith("file://") else None
        if path and Path(path, "mem").is_dir():
            dirs.append(path)
    return dirs


def cuda_available() -> bool:
    try:
        import torch
        return torch.cuda.is_available()  # no CUDA context, so the allocator has not read its settings yet
    except Exception:  # noqa: BLE001  no torch, or a broken CUDA install: plan instead of launching
        return False


@dataclass
class RunOptions:
    dry_run: bool | str = "auto"
    world_size: int | None = None
    validate: bool = True
    json: bool = False
    plan: bool = False
    gpu_memory: float | None = None
    verbose: bool = False


RUN_OPTION_KEYS = ("dry_run", "world_size", "validate", "json", "plan", "gpu_memory", "verbose")


def run_options(node: Any) -> tuple[RunOptions, list[Problem]]:
    """``run.*`` checked and typed (issue 15 #10/#12: run.world_size=abc or 0, run.gpu_memory=abc)."""
    from ..bridge.recipes import world_size_problem
    from ..core.sizes import parse_size
    node = dict(node) if isinstance(node, dict) else {}
    opts, problems = RunOptions(), []

    def bad(key: str, value: Any, message: str, fix: str) -> None:
        problems.append(Problem(("run",), f"run.{key}", value, message, fix, check="run_option"))

    for key in RUN_OPTION_KEYS:  # ${...} and the like in text get the one message for user values, then no other
        why = value_problem(node.get(key)) if isinstance(node.get(key), str) else None
        if why:
            bad(key, node.pop(key), f"run.{key} {why}", value_fix(why, f"run.{key}"))

    for key in ("validate", "json", "plan", "verbose"):
        value = node.get(key, getattr(opts, key))
        if isinstance(value, bool):
            setattr(opts, key, value)
        else:
            bad(key, value, f"run.{key} must be true or false", f"run.{key}=true or run.{key}=false")
    dry = node.get("dry_run", "auto")
    if dry == "auto" or isinstance(dry, bool):
        opts.dry_run = dry
    else:
        bad("dry_run", dry, "run.dry_run must be auto, true or false", "run.dry_run=true (plan only)")
    if node.get("world_size") is not None:
        problem = world_size_problem(node["world_size"], "run.world_size")
        if problem:
            problems.append(problem)
        else:
            opts.world_size = int(node["world_size"])
    if node.get("gpu_memory") is not None:
        try:
            opts.gpu_memory = parse_size(str(node["gpu_memory"]))
        except ValueError as exc:
            bad("gpu_memory", node["gpu_memory"], str(exc), "run.gpu_memory=80GiB")
    return opts, problems


def run(cfg) -> int:
    """The body of train.py's Hydra main. Returns the exit code; never exits the process."""
    from omegaconf import OmegaConf
    # Never resolved: an interpolation in a user value is refused (core/values.py), so nothing read from the
    # environment reaches the config or the run records (issue 22 #2c).
    container = OmegaConf.to_container(cfg, resolve=False)
    run_node = container.get("run") if isinstance(container.get("run"), dict) else {}
    as_json = run_node.get("json") is True
    rank, rank_problem = rank_of(os.environ)
    say = print if rank == 0 else (lambda *a, **k: None)
    try:
        return _plan_and_launch(container, say, rank, [rank_problem] if rank_problem else [])
    except UsageError as exc:
        return _print_error(exc, as_json and rank == 0, EXIT_USAGE)
    except OverlayError as exc:
        return _print_error(exc, as_json and rank == 0, EXIT_REJECTED)
    except StackError as exc:  # Bridge missing or not importable: one line naming the versions (bridge/stack.py)
        return _print_error(exc, as_json and rank == 0, EXIT_STACK)


def _plan_and_launch(container: dict[str, Any], say, rank: int, problems: list[Problem]) -> int:
    from ..bridge.overrides import key_problem, request_problems
    from ..bridge.recipes import spec_problems
    opts, option_problems = run_options(container.get("run"))
    problems += option_problems
    bridge = container.get("bridge")
    if bridge is not None and not isinstance(bridge, dict):
        problems.append(Problem(("override",), "bridge", bridge, "bridge holds Bridge overrides, not a value",
                                "give overrides as KEY=VALUE, e.g. model.tensor_model_parallel_size=2"))
    else:  # model..x / model.__class__ are refused here, before the import (issue 15 #10)
        problems += [p for p in map(key_problem, _flatten(bridge or {})) if p]
    problems += user_value_problems(container)
    recipe = container.get("recipe")
    problems += spec_problems(recipe)
    try:
        catalog = Catalog(_search_path_dirs())
    except OverlayError as exc:
        raise UsageError(problems + exc.problems) from None
    try:
        names, params = selected_overlays(container.get("mem"), catalog)
    except OverlayError as exc:
        names, params = [], {}
        problems += exc.problems
    problems += request_problems(names, params, catalog)
    if problems:
        raise UsageError(problems)
    return _with_bridge(container, opts, recipe, names, params, catalog, say, rank)


def user_value_problems(container: dict[str, Any]) -> list[Problem]:
    """The one rule for user values (core/values.py) on the composed config: Bridge overrides, the recipe's
    kwargs and overrides, and ``run.*`` keys ``run_options`` does not type (overlay parameters are checked with
    the overlays, ``run.*`` options by ``run_options``, the recipe function by ``spec_problems``)."""
    def part(node: Any, *keep: str, drop: tuple[str, ...] = ()) -> dict[str, Any] | None:
        if not isinstance(node, dict):
            return None
        return {k: v for k, v in node.items() if (not keep or k in keep) and k not in drop}
    recipe = container.get("recipe")
    trees = {"bridge": container.get("bridge"), "recipe": part(recipe, "kwargs", "overrides"),
             "run": part(container.get("run"), drop=RUN_OPTION_KEYS)}
    problems = []
    for top, tree in trees.items():
        leaves = _flatten(tree, top) if isinstance(tree, dict) else {}
        for key, value in leaves.items():
            why = value_problem(value)
            if why:
                shown_key = key.removeprefix("bridge.")
                problems.append(Problem(("override",), shown_key, value, f"the value of {shown_key} {why}",
                                        value_fix(why, shown_key), check="override"))
    return problems


def _with_bridge(container, opts: RunOptions, recipe: dict[str, Any], names, params, catalog, say, rank) -> int:
    from hydra.core.hydra_config import HydraConfig

    from ..api import apply_overlay, plan_overlays
    from ..bridge.overrides import check_overrides, write_all
    from ..bridge.recipes import (
        build_from_spec,
        finetune_requirement,
        model_summary,
        training_mode,
        world_size_for,
    )
    from ..bridge.stack import prepare, progress
    from ..core.report import exit_code, render_json, render_text, to_dict
    function = recipe["function"]
    prepare()
    with progress(f"building recipe {function}"):
        bcfg = build_from_spec(recipe)
    changes, problems = check_overrides(bcfg, _flatten(container.get("bridge") or {}))  # checked: a dict
    write_all(bcfg, changes)
    locked = {path: new for path, _, new in changes}
    world_size, world_assumed = world_size_for(bcfg, opts.world_size)
    # The environment the sweep started with: a job never sees what an earlier job exported (issue 15 #7).
    env = dict(SWEEP_START_ENV if SWEEP_START_ENV is not None else os.environ)
    if problems:  # the overrides' problems together with the overlays' (issue 15 #14)
        try:
            plan_overlays(bcfg, names, env=env, params=params, world_size=world_size, locked=locked, catalog=catalog)
        except OverlayError as exc:
            problems += [p for p in exc.problems if p not in problems]
        raise OverlayError(problems)
    baseline = copy.deepcopy(bcfg) if opts.plan else None   # the plan starts before the overlays
    try:
        with progress("applying overlays" + ("; Bridge validates a copy" if opts.validate else "")):
            report = apply_overlay(bcfg, names, env=env, params=params, world_size=world_size, locked=locked,
                                   validate=opts.validate, catalog=catalog)
    except ValidationRejected as exc:  # rolled back; print what was tried and Bridge's verdict
        report = exc.report
    bad_names = env_name_problems(report, bcfg)
    if bad_names:
        raise OverlayError(bad_names)
    mode, why = training_mode(function, bcfg)
    needs = finetune_requirement(bcfg) if mode == "finetune" else None
    if needs and report.validation is not None and not any("pretrained_checkpoint" in n for n in report.validation.launch_requirements):
        report.validation.launch_requirements.append(needs)
    dry = (not cuda_available()) if opts.dry_run == "auto" else bool(opts.dry_run)
    code = exit_code(report)
    entry = f"megatron.bridge.training.{mode}.{mode}(cfg, forward_step)"
    summary = model_summary(bcfg)
    user = [(p, None if o is MISSING else o, n) for p, o, n in changes]  # a new dict key had no old value
    plan = None
    if baseline is not None and code in (EXIT_OK, EXIT_INCOMPLETE):
        from ..memory.steps import build_plan
        plan = build_plan(baseline, names, world=world_size, recipe=function, params=params, capacity=opts.gpu_memory,
                          locked=locked, catalog=catalog)
    if opts.json:
        extra = {"plan": plan.as_dict()} if plan else {}
        say(render_json(report, user_changes=user, recipe=function, model=summary,
                        mode="dry-run" if dry else mode, entry_point=entry, mode_reason=why, **extra))
    else:
        say(render_text(report, recipe=function, summary=summary, world_size=world_size, user_changes=user,
                        verbose=opts.verbose, next_step=_next_step(code, dry, opts, entry, why)))
        if plan:
            from ..memory.steps import render_plan
            say(render_plan(plan, verbose=opts.verbose))
        if world_assumed:
            say(f"(world size {world_size} = TP*PP*CP assumed; set run.world_size=N to plan for N GPUs)")
    output_dir = HydraConfig.get().runtime.output_dir if HydraConfig.initialized() else container["run"].get("record_dir")
    if output_dir:
        _save_record(output_dir, bcfg, to_dict(report, user_changes=user, recipe=function, model=summary,
                                                entry_point=entry), rank)
    if code != EXIT_OK or dry:
        return code
    if needs:
        raise UsageError([Problem(("recipe",), "checkpoint.pretrained_checkpoint", None,
                                  f"Bridge's finetune() cannot start without a checkpoint: {needs}",
                                  "add checkpoint.pretrained_checkpoint=/path/to/megatron/checkpoint")])
    export_environment(report, bcfg)
    prepare_snapshot_folder(bcfg)
    return _launch(bcfg, mode)


def _next_step(code: int, dry: bool, opts: RunOptions, entry: str, why: str) -> str:
    if code == EXIT_REJECTED:
        return "verdict: rejected; nothing was launched. Fix what Bridge reports above and run again"
    if code == EXIT_INCOMPLETE:
        return "nothing was launched; finish the validation on a host with Transformer Engine (exit code 3)"
    reason = "run.dry_run=true" if opts.dry_run is True else "no CUDA device"
    if dry:
        return f"dry run ({reason}); under torchrun on a GPU node train.py calls {entry} (chosen by {why})"
    return f"launching {entry} (chosen by {why})"


def _print_error(exc: OverlayError, as_json: bool, code: int = EXIT_USAGE) -> int:
    print(shown(f"train.py: {exc}", one_line=False), file=sys.stderr)
    if as_json:
        from ..core.report import render_error_json
        print(render_error_json(exc, code))
    return code


def _save_record(output_dir: str, bcfg: Any, report: dict[str, Any], rank: int) -> None:
    if rank != 0:
        return
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mbmem_report.json").write_text(json.dumps(report, indent=2, default=repr))
    try:
        bcfg.to_yaml(str(out / "bridge_config.yaml"))
    except Exception as exc:  # noqa: BLE001  to_yaml can fail on exotic recipes; the report is still saved
        (out / "bridge_config.yaml").write_text(f"# could not serialize: {exc}\n")


def _launch(bcfg: Any, mode: str) -> int:
    # The overlays' environment was exported by export_environment and CUDA has not allocated yet,
    # so the allocator reads the new settings.
    from megatron.bridge.training.gpt_step import forward_step
    callbacks = None
    if os.environ.get("MBMEM_METRICS_DIR"):  # GPU smoke tests record memory and step time (gpu_harness.py)
        from .gpu_harness import make_recorder
        callbacks = [make_recorder(os.environ["MBMEM_METRICS_DIR"])]
    if mode == "finetune":
        from megatron.bridge.training.finetune import finetune
        finetune(bcfg, forward_step, callbacks=callbacks)
    else:
        from megatron.bridge.training.pretrain import pretrain
        pretrain(bcfg, forward_step, callbacks=callbacks)
    return 0


# ---------------------------------------------------------------- a run or a sweep


def run_job(cfg) -> int:
    """One Hydra job: its exit code is recorded, never raised, so a ``-m`` sweep runs every job
    (issue 17: a sweep stopped at the first rejected job). A dry run that hits a bug reports it
    as an internal error for this job; a launch lets training errors propagate as they are."""
    from hydra.core.hydra_config import HydraConfig
    number, overrides = len(JOBS), ""
    if HydraConfig.initialized():
        hc = HydraConfig.get()
        number = hc.job.get("num", number) or number
        overrides = " ".join(hc.overrides.task)
    try:
        code = run(cfg)
    except Exception as exc:
        if console.is_output_error(exc):  # `| head -0`, `> /dev/full`: one line, exit 74, never a traceback
            code = console.output_failed("train.py", exc)
        elif not _planning_only(cfg):
            raise
        else:
            code = _internal_error(exc)
    JOBS.append(JobResult(number, overrides, code))
    return code


def _internal_error(exc: Exception) -> int:
    """A bug met while only planning: one line and exit 1 (the traceback with MBMEM_DEBUG=1)."""
    print(shown(f"train.py: internal error ({type(exc).__name__}: {exc}); please report it with the command line. "
                "Set MBMEM_DEBUG=1 for the traceback."), file=sys.stderr)
    if os.environ.get("MBMEM_DEBUG"):
        traceback.print_exc()
    return EXIT_REJECTED


def _planning_only(cfg) -> bool:
    try:
        dry = cfg.run.dry_run
    except Exception:  # noqa: BLE001  a config too broken to read: treat as planning
        return True
    return dry is True or (dry == "auto" and not cuda_available())


VERDICTS = {EXIT_OK: "passed", EXIT_REJECTED: "rejected", EXIT_USAGE: "usage error", EXIT_INCOMPLETE: "incomplete",
            EXIT_OUTPUT: "output failed"}


def finish() -> int:
    """train.py's exit code: the job's, or for a sweep the worst one, after listing every job's verdict."""
    if not JOBS:
        return EXIT_OK
    if len(JOBS) > 1:
        counts = {}
        for job in JOBS:
            counts[VERDICTS.get(job.code, f"exit {job.code}")] = counts.get(VERDICTS.get(job.code, f"exit {job.code}"), 0) + 1
        print(f"sweep: {len(JOBS)} jobs; " + ", ".join(f"{n} {v}" for v, n in counts.items()), file=sys.stderr)
        for job in JOBS:
            print(f"  #{job.number} {VERDICTS.get(job.code, 'exit ' + str(job.code))} (exit {job.code}): {job.overrides}",
                  file=sys.stderr)
    codes = {job.code for job in JOBS}
    for code in (EXIT_OUTPUT, EXIT_REJECTED, EXIT_USAGE, EXIT_INCOMPLETE):  # the most serious outcome decides
        if code in codes:
            return code
    return max(codes)


__all__ = ["SCHEMA_VERSION", "finish", "hydra_argv", "run", "run_job", "selected_overlays", "startup"]
