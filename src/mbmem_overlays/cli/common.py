"""What several commands share: exit codes, argument types, list/``--set`` parsing, the checks that need
no Bridge (run before the 20-30 s import), and building the user's recipe."""

from __future__ import annotations

import argparse
import re
import shlex
from typing import Any

from ..core.errors import OverlayError, Problem, short_repr
from ..core.values import MAX_WORLD_SIZE, parse_count

# Exit codes of mbmem apply/slurm/plan/recommend and train.py (README, "Exit codes"); defined in core.report
# so that train.py's body (launch/) returns the same ones.
from ..core.report import EXIT_INCOMPLETE, EXIT_OK, EXIT_REJECTED, EXIT_UNKNOWN, EXIT_USAGE  # noqa: F401  (re-exported)


class UsageError(OverlayError):
    """The command line itself is wrong (found before anything was built): exit code 2."""


# Commands that read and write only the paths they are given: without a working directory they still work when each
# of those paths is absolute (issue 39: `mbmem list` and `mbmem doctor /abs/file.pickle` refused a deleted one).
# Every other command builds a Bridge config (whose default folders are relative) or renders a script of the
# folder it runs in.
CWD_FREE_COMMANDS = ("list", "explain", "doctor")
_PATH_OPTIONS = ("plot", "html", "against")


def needs_cwd(args: argparse.Namespace) -> bool:
    """Whether the parsed command needs the working directory: a command outside CWD_FREE_COMMANDS, ``doctor
    --plan`` (it builds the job's config), or a relative path among what it reads or writes (its inputs, --plot,
    --html, --against, the user overlay folders of --overlay-dir and MBMEM_OVERLAY_DIRS)."""
    import os

    from ..core.catalog import USER_DIRS_ENV
    if getattr(args, "command", None) not in CWD_FREE_COMMANDS or getattr(args, "plan", False):
        return True
    paths = list(getattr(args, "overlay_dir", None) or [])
    paths += [p for p in os.environ.get(USER_DIRS_ENV, "").split(os.pathsep) if p]
    paths += [p for p in getattr(args, "logs", None) or [] if p != "-"]
    paths += [getattr(args, name, None) for name in _PATH_OPTIONS]
    return any(isinstance(p, str) and p and not os.path.isabs(os.path.expanduser(p)) for p in paths)


def positive_int(text: str, maximum: int = MAX_WORLD_SIZE) -> int:
    """argparse type of --world-size (and, through ``count_arg``, of every count): a whole number from 1 to
    ``maximum``, read without ever calling int() on thousands of digits (issue 22 #3)."""
    number, why = parse_count(text, maximum=maximum)
    if number is None:
        raise argparse.ArgumentTypeError(f"must be a positive integer (e.g. 8) of at most {maximum}: "
                                         f"{why.rpartition(', ')[2]}")
    return number


def usage_problem(option: str, value: Any, message: str, fix: str) -> Problem:
    """A problem with a command-line option (exit 2, before anything is read or imported)."""
    return Problem(("argument",), option, value, message, fix, check="usage")


def count_option(option: str, text: Any, maximum: int = MAX_WORLD_SIZE) -> tuple[int | None, Problem | None]:
    """(number, None) or (None, problem) for a count given as text: --world-size, --top ... (bounded, never int()
    on thousands of digits)."""
    try:
        return positive_int(text, maximum), None
    except argparse.ArgumentTypeError as exc:
        return None, usage_problem(option, text, f"{option} {exc}", f"pass a positive integer, e.g. {option} 8")


def margin_option(text: Any) -> tuple[float | None, Problem | None]:
    """--margin: the headroom kept free, a fraction of the capacity in [0, 1)."""
    try:
        margin = float(text) if isinstance(text, str) and len(text) <= 64 else float("nan")
    except ValueError:
        margin = float("nan")
    if 0 <= margin < 1:
        return margin, None
    return None, usage_problem("--margin", text, f"--margin must be a fraction in [0, 1), got {short_repr(text)}",
                               "e.g. --margin 0.05 keeps 5% of the GPU free")


def capacity_option(text: str | None) -> tuple[float | None, Problem | None]:
    """--gpu-memory (None when not given): a size as people write it (core/sizes.py)."""
    if text is None:
        return None, None
    from ..core.sizes import parse_size
    try:
        return parse_size(text), None
    except ValueError as exc:
        return None, usage_problem("--gpu-memory", text, str(exc), "e.g. --gpu-memory 80GiB")


# --gpu-arch: the GPUs' compute capability major (what the plan and Megatron-LM's validate_args read of the GPU),
# or a data-center GPU's name; the default is Hopper (H100/H200), as every plan assumed before the option.
DEFAULT_GPU_ARCH = 9
GPU_ARCH_NAMES = {"v100": 7, "t4": 7, "a100": 8, "a800": 8, "a10": 8, "a30": 8, "a40": 8, "l4": 8, "l40": 8, "l40s": 8, "h100": 9,
                  "h200": 9, "h800": 9, "h20": 9, "gh200": 9, "b100": 10, "b200": 10, "gb200": 10, "b300": 10,
                  "gb300": 10}


def gpu_arch_option(text: str | None) -> tuple[int | None, Problem | None]:
    """--gpu-arch (None when not given): ``9``, ``9.0``, ``sm90``/``sm_90`` or a name (H100, GB200 ...) -> 9."""
    if text is None:
        return None, None
    t = str(text).strip().lower().replace("nvidia", "").strip(" -_") if len(str(text)) <= 32 else ""
    major = None
    if t in GPU_ARCH_NAMES:
        major = GPU_ARCH_NAMES[t]
    elif re.fullmatch(r"\d{1,2}(\.\d)?", t):
        major = int(t.split(".")[0])
    elif m := re.fullmatch(r"sm_?(\d{2,3})[a-z]?", t):
        major = int(m.group(1)[:-1])
    if major is not None and 7 <= major <= 12:
        return major, None
    return None, usage_problem("--gpu-arch", text, f"--gpu-arch {short_repr(text)} is not a compute capability or a "
                               "GPU name I know", "e.g. --gpu-arch 9 (H100/H200), 10 (B200/GB200), 8 (A100), or "
                               "--gpu-arch H100")


def count_arg(maximum: int):
    """An argparse type: ``positive_int`` with its own upper bound (named, so argparse's message names it)."""
    def count(text: str) -> int:
        return positive_int(text, maximum)
    count.__name__ = "positive integer"
    return count


def size_arg(text: str) -> float:
    """argparse type of --gpu-memory: core.sizes.parse_size (80GiB, 80GB, 80G, bytes)."""
    from ..core.sizes import parse_size
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def csv_list(values: list[str] | None) -> list[str]:
    """``["a,b", "c"]`` -> ``["a", "b", "c"]`` (repeated and comma-separated options)."""
    out: list[str] = []
    for v in values or []:
        out += [x.strip() for x in v.split(",") if x.strip()]
    return out


def split_sets(sets: list[str]) -> tuple[list[str], dict[str, object]]:
    """``--set`` values: ``mem.<overlay>.<param>=v`` are overlay parameters, the rest Bridge overrides."""
    from ..core.values import parse_value
    overrides, params = [], {}
    for s in sets:
        key, sep, raw = s.partition("=")
        if key.startswith("mem.") and sep and key.count(".") >= 2:
            params[key[4:]] = parse_value(raw)
        else:
            overrides.append(s)
    return overrides, params


def catalog_for(overlay_dirs: list[str] | None):
    """The overlay catalogue; a bad overlay directory is a usage error (exit 2), not a rejection."""
    from ..core.catalog import Catalog
    try:
        catalog = Catalog(overlay_dirs)
    except OverlayError as exc:
        raise UsageError(exc.problems) from None
    missing = catalog.folder_problems
    if missing:  # a directory the user named does not exist: nothing from it can be what they meant
        raise UsageError(missing)
    return catalog


def preflight(recipe: str | None, names: list[str], params: dict[str, Any], overrides: list[str],
              catalog) -> list[Problem]:
    """Every problem visible without Bridge, all at once: the recipe name, overlays, parameters, and
    the syntax of each override (issue 17: cheap errors before the import)."""
    from ..bridge.overrides import request_problems, syntax_problem
    from ..bridge.recipes import recipe_name_problem
    problems: list[Problem] = []
    if recipe is not None:  # train.py's recipe names (llama3_8b_pretrain) are plain names and pass too
        problems += [p for p in [recipe_name_problem(recipe)] if p]
    problems += request_problems(names, params, catalog)
    problems += [p for p in map(syntax_problem, overrides) if p]
    return problems


def read_request(args) -> tuple[Any, list[str], list[str], dict[str, object]]:
    """What apply-like commands (apply, args) read the same way: the catalogue, the overlay names, the Bridge
    overrides and the overlay parameters (``--set mem.*`` and ``--param``); every problem visible without Bridge
    is raised at once, before the import (exit 2)."""
    catalog = catalog_for(args.overlay_dir)
    names = csv_list(args.overlay)
    overrides, params = split_sets(args.set)
    params.update(split_sets([f"mem.{p}" for p in args.param])[1])
    problems = preflight(args.recipe, names, params, overrides, catalog)
    if problems:
        raise UsageError(problems)
    return catalog, names, overrides, params


def recipe_with_overrides(recipe: str, sets: list[str]) -> tuple[Any, dict[str, Any], dict[str, object]]:
    """(config, the fields the user set, overlay parameters) from ``--recipe`` and ``--set`` (imports Bridge)."""
    from ..bridge.overrides import apply_overrides
    from ..bridge.recipes import load_recipe
    overrides, params = split_sets(sets)
    cfg = load_recipe(recipe)
    locked = apply_overrides(cfg, overrides)
    return cfg, locked, params


def build_with_overrides(recipe: str, overrides: list[str]) -> tuple[Any, list[tuple[str, Any, Any]], list[Problem]]:
    """(config with the valid overrides written, [(path, old, new)], [override problems]).

    Unlike ``recipe_with_overrides`` a bad override does not stop here, so the caller can report it
    together with the overlays' problems (issue 15 #14: all violations at once). The config is our own
    fresh build, so writing the valid overrides changes nothing of the user's."""
    from ..bridge.overrides import check_overrides, write_all
    from ..bridge.recipes import load_recipe
    from ..bridge.stack import prepare, progress
    prepare()
    with progress(f"building recipe {recipe}"):
        cfg = load_recipe(recipe)
    changes, problems = check_overrides(cfg, overrides)
    write_all(cfg, changes)
    return cfg, changes, problems


def shown_changes(changes: list[tuple[str, Any, Any]]) -> list[tuple[str, Any, Any]]:
    """User overrides for display: a new dict key shows None as its old value."""
    from ..core.paths import MISSING
    return [(path, None if old is MISSING else old, new) for path, old, new in changes]


def train_command(recipe: str, overlays: list[str], sets: list[str], world_size: int | None,
                  overlay_dirs: list[str] | None = None) -> str:
    """The train.py command line equivalent to an ``mbmem`` invocation (the "next step" to paste): every word
    shell-quoted, and the user's overlay directories (``--overlay-dir`` and ``MBMEM_OVERLAY_DIRS``, absolute) in
    front as ``MBMEM_OVERLAY_DIRS=...``, so train.py finds a user overlay the command names (issue 22 #2a)."""
    from ..core.catalog import overlay_dirs_env, train_recipe_arg
    words = ["python", "train.py", train_recipe_arg(recipe)]
    if overlays:
        words.append(f"+mem=[{','.join(overlays)}]")
    words += sets
    if world_size:
        words.append(f"run.world_size={world_size}")
    prefix = [f"{k}={shlex.quote(v)}" for k, v in overlay_dirs_env(overlay_dirs).items()]
    return " ".join([*prefix, *(shlex.quote(w) for w in words)])


def add_recipe_options(p, *, world_size: str | None) -> None:
    """--recipe, --set and (``world_size``: "required", "optional" or None) --world-size, worded the same for
    every command that builds a config."""
    p.add_argument("--recipe", required=True,
                   help="recipes/ name (llama3_70b_pretrain) or Bridge recipe function (llama3_70b_pretrain_config)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="Bridge override (model.tensor_model_parallel_size=4) or overlay parameter "
                        "(mem.cpu_offload.num_layers=2)")
    if world_size:
        p.add_argument("--world-size", type=positive_int, required=world_size == "required", default=None,
                       help="number of GPUs to validate for (a positive integer)")
