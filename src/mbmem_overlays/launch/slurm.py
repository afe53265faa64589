"""Render a complete sbatch script that carries the overlays (``mbmem slurm``).

The template is a file a user can read and adapt: ``recipes/slurm/sbatch.sh.j2`` (Jinja2).
Rendering never imports Megatron Bridge; validation (on by default, in ``cli/slurm.py``) runs the
same overlay engine and Bridge validation as train.py with world size = nodes x GPUs.

Quoting (issue 15, item 1): Jinja2 inserts each value once and never scans inserted text again, so a
``{{...}}`` inside a user value stays text. Every ``{{ }}`` in the template must end in one of three
filters, and the environment's ``finalize`` refuses anything else:

- ``q``: one shell word made with ``shlex.quote``;
- ``sbatch``: a value of an ``#SBATCH`` line, which sbatch parses itself (shell quoting cannot protect
  it), so it must match a conservative pattern;
- ``envname``: an environment variable name, ``[A-Za-z_][A-Za-z0-9_]*`` (issue 15, item 2).

Every problem with the options is collected and raised together in one ``OverlayError``.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import shlex
import sys
from collections.abc import Iterable
from pathlib import Path

from ..core import allocconf
from ..core.catalog import ENV_NAME, USER_DIRS_ENV, Catalog, data_dir, recipe_file, recipe_spec, train_recipe_arg
from ..core.errors import OverlayError, Problem
from ..core.outfile import write_output
from ..core.text import unsafe_character
from ..core.values import MAX_WORLD_SIZE, parse_count

TEMPLATE = data_dir("recipes") / "slurm" / "sbatch.sh.j2"
CHECKOUT = Path(__file__).resolve().parents[3]  # where train.py lives when running from a clone
# What sbatch reads verbatim from an "#SBATCH --flag=value" line: no spaces, quotes, '$', ';', newlines.
SBATCH_SAFE = re.compile(r"[A-Za-z0-9_.:,@%/+=\-]+")
# A recipes/ name or a dotted Python function path (what train.py's recipe= / recipe.function= take).
RECIPE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
SCRIPT_MODE = 0o755

# The field's standard environment (nvidia-skills/nemo-mbridge-multi-node-slurm.templates.md,
# slurm-and-launch.md). Overlays add to it; a key the overlays also set keeps the overlay's value.
STANDARD_ENV = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
    "PYTHONUNBUFFERED": "1",
    "SLURM_UNBUFFEREDIO": "1",
}


FSDP_FIELDS = ("ddp.use_megatron_fsdp", "dist.use_megatron_fsdp")


def sets_true(text: object, fields: Iterable[str]) -> bool:
    """Whether the override ``text`` (``[+|++]field=value``) sets one of ``fields`` to true as train.py reads it:
    the value through Hydra's own override grammar (core/values.py parse_value), so ``TRUE``, ``True`` and
    ``true`` alike (a regex of two spellings missed the rest, issue 39 #14)."""
    if not isinstance(text, str) or "=" not in text:
        return False
    key, _, raw = text.strip().partition("=")
    if key.lstrip("+") not in fields:
        return False
    from ..core.values import parse_value
    return parse_value(raw) is True


def standard_env(cfg=None, *, overlays: Iterable[str] = (), sets: Iterable[str] = (),
                 catalog: Catalog | None = None) -> dict[str, str]:
    """STANDARD_ENV for this job: Megatron FSDP refuses CUDA_DEVICE_MAX_CONNECTIONS=1 (Bridge config.py
    _validate_and_apply_megatron_fsdp_configs, "FSDP requires CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset"), so
    an FSDP job leaves it unset. FSDP is read from the config when there is one, else (``--no-validate``) from the
    overlays named (``+mem=megatron_fsdp`` sets both flags) and the ``--set`` overrides."""
    from ..core.paths import read
    env = dict(STANDARD_ENV)
    if cfg is not None:
        fsdp = any(read(cfg, path, False) for path in FSDP_FIELDS)
    else:
        specs = []
        for name in overlays:
            try:
                specs.append((catalog or Catalog()).resolve(name))
            except OverlayError:
                continue  # an unknown name is reported by option_problems
        fsdp = any(spec.set.get(path) is True for spec in specs for path in FSDP_FIELDS) \
            or any(sets_true(s, FSDP_FIELDS) for s in sets)
    if fsdp:
        env.pop("CUDA_DEVICE_MAX_CONNECTIONS")
    return env


# Variables the script itself sets for the tasks; inside a container they must win over the image's.
SCRIPT_ENV = ("MBMEM_WORKDIR", "MBMEM_PYTHON", "MBMEM_NPROC_PER_NODE", "MASTER_ADDR", "MASTER_PORT")


# ----------------------------------------------------------------------------- template filters
class Word(str):
    """Text that is safe to insert into the script as it is (made only by the three filters below)."""


class UnsafeValue(ValueError):
    """A value reached the template that no filter accepts (render() reports problems before this)."""


def _single_line(text: str) -> str:
    if any(c in text for c in "\n\r\0"):
        raise UnsafeValue(f"{text!r} contains a newline or NUL byte")
    return text


def shell_word(value: object) -> Word:
    return Word(shlex.quote(_single_line(str(value))))


def sbatch_value(value: object) -> Word:
    text = str(value)
    if not SBATCH_SAFE.fullmatch(text):
        raise UnsafeValue(f"{text!r} cannot go into an #SBATCH line")
    return Word(text)


def env_name(value: object) -> Word:
    text = str(value)
    if not ENV_NAME.fullmatch(text):
        raise UnsafeValue(f"{text!r} is not an environment variable name")
    return Word(text)


def _only_filtered(value: object) -> object:
    # Jinja2 calls finalize on every {{ }} result: a bare {{ value }} in the template is an error.
    if not isinstance(value, Word):
        raise UnsafeValue(f"template variable {value!r} is neither quoted (| q) nor checked (| sbatch, | envname)")
    return value


def template_environment():
    import jinja2
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE.parent)), undefined=jinja2.StrictUndefined,
                             autoescape=False,  # a shell script, not HTML: quoting is the filters' job
                             finalize=_only_filtered, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.filters.update(q=shell_word, sbatch=sbatch_value, envname=env_name)
    return env


# ----------------------------------------------------------------------------- checking the options
def _bad(field: str, value: object, why: str, fix: str) -> Problem:
    return Problem(("slurm",), field, value, why, fix)


def sbatch_problems(values: dict[str, object]) -> list[Problem]:
    """Values of #SBATCH lines (``None``: not given) that sbatch would misread."""
    problems = []
    for flag, value in values.items():
        if value is not None and not SBATCH_SAFE.fullmatch(str(value)):
            problems.append(_bad(f"--{flag}", str(value), "contains characters sbatch would misread in an #SBATCH "
                                 "line (spaces, quotes, ';', '$', newlines, ...)",
                                 f"use only letters, digits and _ . : , @ % / + = - in --{flag}"))
    return problems


def env_problems(env: dict[str, object], who: tuple[str, ...] = ("slurm",), where: str = "") -> list[Problem]:
    """Names that cannot follow ``export``, and values that are not single-line text."""
    problems = []
    for name, value in env.items():
        if not isinstance(name, str) or not ENV_NAME.fullmatch(name):
            problems.append(Problem(who, "env", name, f"{name!r} is not a valid environment variable name; the "
                                    "script would put it into an `export` line",
                                    f"rename it{where} to letters, digits and _, not starting with a digit "
                                    "(e.g. MY_VAR)"))
        elif any(c in str(value) for c in "\n\r\0"):
            problems.append(Problem(who, name, value, "the value contains a newline or NUL byte",
                                    f"give {name} a single-line value{where}"))
    return problems


def overlay_env_problems(overlays: list[str], catalog: Catalog) -> list[Problem]:
    """The overlays' environment as declared in their files: checked before anything imports Bridge.

    The engine checks names too; this is the renderer's own check (issue 15, item 2: defense in depth)."""
    problems = []
    for name in overlays:
        spec = catalog.resolve(name)
        if not isinstance(spec.env, dict):
            problems.append(Problem((spec.name,), "env", spec.env, f"'env:' in {spec.path} is not a mapping",
                                    "write env: {VAR: value}"))
            continue
        problems += env_problems(spec.env, (spec.name,), f" in {spec.path}")
    return problems


def output_log_problems(output: str | None) -> list[Problem]:
    """#SBATCH --output: slurmd opens it before the script runs, so its folder must exist; it can only be created
    at render time when the folder part has no Slurm filename pattern (%j, %x, ...)."""
    if output is None:
        return []
    problems = sbatch_problems({"output": output})
    if "%" in os.path.dirname(output):
        problems.append(_bad("--output-log", output, "the folder part contains a Slurm filename pattern (%...); "
                             "slurmd does not create folders, so it must exist before the job starts",
                             "put patterns in the file name only, e.g. --output-log logs/%x_%j.log"))
    return problems


# Upper bounds of the counts (issue 22 #3): the world size (nodes x GPUs per node) is bounded by MAX_WORLD_SIZE too.
MAX_GPUS_PER_NODE = 1024
MAX_CPUS_PER_TASK = 1 << 16
COUNTS = (("nodes", "--nodes", MAX_WORLD_SIZE, "--nodes 4"), ("gpus_per_node", "--gpus-per-node", MAX_GPUS_PER_NODE,
                                                                 "--gpus-per-node 8"),
          ("cpus_per_task", "--cpus-per-task", MAX_CPUS_PER_TASK, "--cpus-per-task 32"))


def count_problems(counts: dict[str, object]) -> tuple[dict[str, int | None], list[Problem]]:
    """--nodes, --gpus-per-node and --cpus-per-task (text or int) as numbers, each in its bounds, and their
    product (the world size) at most MAX_WORLD_SIZE; every problem at once."""
    numbers: dict[str, int | None] = {}
    problems = []
    for key, flag, maximum, example in COUNTS:
        value = counts.get(key)
        if value is None:
            numbers[key] = None
            continue
        numbers[key], why = parse_count(value, maximum=maximum)
        if why:
            problems.append(_bad(flag, value, why, f"e.g. {example}"))
    if numbers.get("nodes") and numbers.get("gpus_per_node") and \
            numbers["nodes"] * numbers["gpus_per_node"] > MAX_WORLD_SIZE:
        problems.append(_bad("--nodes/--gpus-per-node", f"{numbers['nodes']}x{numbers['gpus_per_node']}",
                             f"makes a world size above {MAX_WORLD_SIZE} GPUs (2^20)", "e.g. --nodes 4 --gpus-per-node 8"))
    return numbers, problems


def option_problems(*, recipe: str, overlays: list[str], sets: list[str], nodes: int | str, gpus_per_node: int | str,
                    cpus_per_task: int | str | None = None, python: str | None = None, workdir: str | None = None,
                    container_image: str | None = None, container_mounts: str | None = None,
                    output: str | None = None, overlay_dirs: list[str] | None = None, **sbatch) -> list[Problem]:
    """Every problem with the options, without importing anything heavy."""
    problems = count_problems(dict(nodes=nodes, gpus_per_node=gpus_per_node, cpus_per_task=cpus_per_task))[1]
    problems += sbatch_problems({k.replace("_", "-"): v for k, v in sbatch.items()})
    problems += output_log_problems(output)
    if not RECIPE_NAME.fullmatch(recipe):
        problems.append(_bad("--recipe", recipe, "is neither a recipes/ name nor a dotted Python function path",
                             "e.g. --recipe llama3_8b_pretrain or --recipe llama3_8b_pretrain_config"))
    named = [("--overlay", o) for o in overlays] + [("--set", s) for s in sets] + [
        ("--recipe", recipe), ("--python", python), ("--workdir", workdir), ("--container-image", container_image),
        ("--container-mounts", container_mounts)] + [("--overlay-dir", d) for d in overlay_dirs or ()]
    for flag, value in named:
        if value is not None and any(c in value for c in "\n\r\0"):
            problems.append(_bad(flag, value, "contains a newline or NUL byte", "pass single-line values"))
        elif value is not None and unsafe_character(value):  # would reach the script and the terminal showing it
            problems.append(_bad(flag, value, f"contains the control or bidirectional character "
                                 f"{unsafe_character(value)}", "remove it"))
        elif value == "" and flag != "--set":
            problems.append(_bad(flag, value, "is empty", f"give {flag} a value or leave the option out"))
    if container_mounts and not container_image:
        problems.append(_bad("--container-mounts", container_mounts, "has no effect without --container-image",
                             "add --container-image IMAGE, or drop --container-mounts"))
    for flag, path in [("--workdir", workdir)] + [("--overlay-dir", d) for d in overlay_dirs or ()]:
        if container_image and path and any(c in path for c in ":,"):
            problems.append(_bad(flag, path, "contains ':' or ','; pyxis' --container-mounts cannot mount it",
                                 "use a path without ':' and ','"))
    return problems


PRETRAINED_CHECKPOINT = "checkpoint.pretrained_checkpoint"


def _recipe_function(recipe: str) -> tuple[str, dict]:
    """(Bridge function name, the recipe file's overrides) without importing Bridge."""
    path = recipe_file(recipe)
    if path is None:
        return recipe, {}
    data = recipe_spec(path)
    return str(data.get("function", recipe)), dict(data.get("overrides") or {})


def unvalidated_launch_problems(recipe: str, sets: list[str]) -> list[Problem]:
    """What ``--no-validate`` can still see: a PEFT recipe (Bridge names them ``*_peft_config``) launched without
    a pretrained checkpoint fails in the job ("PEFT requires a pretrained checkpoint path", Bridge
    training/config.py:1488). Refused like the validated render refuses it (validation's placeholder)."""
    function, file_overrides = _recipe_function(recipe)
    if not function.rsplit(".", 1)[-1].endswith("_peft_config"):
        return []
    given = {s.partition("=")[0].lstrip("+~") for s in sets} | set(file_overrides)
    if PRETRAINED_CHECKPOINT in given:
        return []
    return [Problem(("recipe",), PRETRAINED_CHECKPOINT, None,
                    f"{recipe} is a PEFT recipe and the job has no pretrained checkpoint (Bridge: \"PEFT requires a "
                    "pretrained checkpoint path\")",
                    f"add --set {PRETRAINED_CHECKPOINT}=/path/to/the/base/model/checkpoint")]


# ----------------------------------------------------------------------------- rendering
def default_workdir() -> str:
    return str(CHECKOUT if (CHECKOUT / "train.py").is_file() else Path.cwd())


def _mount_target(mount: str) -> str:
    # pyxis: SRC:DST[:FLAGS], or a single PATH mounted at the same path.
    parts = mount.split(":")
    return parts[1] if len(parts) > 1 else parts[0]


def _same_path_mount(mount: str) -> str | None:
    """The path a mount shows at the same place inside the container (``P`` or ``P:P``), else None."""
    parts = mount.split(":")
    return parts[0].rstrip("/") or "/" if len(parts) == 1 or parts[0] == parts[1] else None


def container_mounts_with_workdir(workdir: str, user_mounts: str | None, overlay_dirs: list[str] | None = None) -> str:
    """The user's mounts, plus the repository mounted at the same path unless a mount already targets it, plus each
    user overlay directory at its own path unless a same-path mount already holds it (train.py inside the
    container reads them through MBMEM_OVERLAY_DIRS, issue 22 #2a)."""
    mounts = [m for m in (user_mounts or "").split(",") if m]
    if not any(_mount_target(m).rstrip("/") == workdir.rstrip("/") for m in mounts):
        mounts.insert(0, f"{workdir}:{workdir}")
    for d in overlay_dirs or ():
        inside = [p for p in map(_same_path_mount, mounts) if p]
        if not any(d == p or d.startswith(p.rstrip("/") + "/") for p in inside):
            mounts.append(f"{d}:{d}")
    return ",".join(mounts)


def train_args(recipe: str, overlays: list[str], sets: list[str], *, cpu_smoke: bool, world_size: int) -> list[str]:
    args = [train_recipe_arg(recipe)]
    if overlays:
        args.append(f"+mem=[{','.join(overlays)}]")
    args += sets
    if cpu_smoke:  # same script, CPU-only cluster: plan instead of train, for the full world size
        args += ["run.dry_run=true", f"run.world_size={world_size}"]
    return args


def render(*, recipe: str, overlays: list[str], sets: list[str], nodes: int, gpus_per_node: int,
           env: dict[str, str], cpu_smoke: bool = False, python: str | None = None, workdir: str | None = None,
           container_image: str | None = None, container_mounts: str | None = None, cpus_per_task: int | None = None,
           output: str | None = None, verdict: str = "not validated", standard: dict[str, str] | None = None,
           overlay_dirs: list[str] | None = None, **sbatch) -> str:
    """The sbatch script text. Raises OverlayError listing every problem with the options.

    ``overlay_dirs`` (absolute): the user overlay directories; the script exports them as MBMEM_OVERLAY_DIRS
    (and mounts them in a container), so train.py in the job finds the user overlays it names."""
    overlay_dirs = [os.path.abspath(d) for d in overlay_dirs or ()]
    problems = option_problems(recipe=recipe, overlays=overlays, sets=sets, nodes=nodes, gpus_per_node=gpus_per_node,
                               cpus_per_task=cpus_per_task, python=python, workdir=workdir,
                               container_image=container_image, container_mounts=container_mounts, output=output,
                               overlay_dirs=overlay_dirs, **sbatch)
    dirs_env = {USER_DIRS_ENV: os.pathsep.join(overlay_dirs)} if overlay_dirs else {}
    exports = {**(STANDARD_ENV if standard is None else standard), **env, **dirs_env}
    problems += env_problems(exports)
    if problems:
        raise OverlayError(problems)
    counts = count_problems(dict(nodes=nodes, gpus_per_node=gpus_per_node, cpus_per_task=cpus_per_task))[0]
    nodes, gpus_per_node, cpus_per_task = counts["nodes"], counts["gpus_per_node"], counts["cpus_per_task"]
    world = nodes * gpus_per_node
    workdir = workdir or default_workdir()
    title = (f"{recipe} with overlays [{', '.join(overlays) or 'none'}] on "
             f"{nodes} node(s) x {gpus_per_node} GPU(s)"
             + (" - CPU smoke mode (dry-run plan, no GPU directives)" if cpu_smoke else ""))
    values = dict(
        title=title, date=_dt.date.today().isoformat(), verdict=verdict, cpu_smoke=cpu_smoke,
        nodes=nodes, gpus_per_node=gpus_per_node, world_size=world, nproc_per_node=1 if cpu_smoke else gpus_per_node,
        job_name=sbatch.get("job_name") or "mbmem", time=sbatch.get("time"), partition=sbatch.get("partition"),
        account=sbatch.get("account"), output=output, cpus_per_task=cpus_per_task,
        exports=list(exports.items()),
        train_args=train_args(recipe, overlays, sets, cpu_smoke=cpu_smoke, world_size=world),
        workdir=workdir, python=python or ("python" if container_image else sys.executable),
        container_image=container_image,
        container_mounts=container_mounts_with_workdir(workdir, container_mounts, overlay_dirs) if container_image else None,
        container_env=",".join([*exports, *SCRIPT_ENV]),
    )
    return template_environment().get_template(TEMPLATE.name).render(**values)


def static_env(overlays: list[str], catalog: Catalog, inherited: dict[str, str] | None = None) -> dict[str, str]:
    """The overlays' environment without a config (used with --no-validate); allocator keys are merged into the
    variable torch reads first, starting from what it reads in ``inherited`` (core/allocconf.py)."""
    env: dict[str, str] = {}
    inherited = dict(inherited or {})
    for name in overlays:
        for var, value in catalog.resolve(name).env.items():
            if isinstance(value, dict):
                for target in allocconf.merge_targets(var, inherited):
                    base = env[target] if target in env else allocconf.base_value(target, inherited, inherited)
                    try:
                        env[target], _ = allocconf.merged(target, base, {k: str(v) for k, v in value.items()})
                    except allocconf.AllocConfError as exc:  # the inherited value: torch would refuse it too
                        raise OverlayError([Problem((name,), f"${target}", base, str(exc),
                                                    f"fix {target} in your environment, or unset it")]) from None
            else:
                env[var] = str(value)
    return env


# ----------------------------------------------------------------------------- files
def absolute_log_path(output: str | None) -> str | None:
    """#SBATCH --output relative to the folder you render in (sbatch would read it relative to where you submit)."""
    return None if output is None else os.path.abspath(os.path.expanduser(output))


def log_folder_problem(output: str | None) -> Problem | None:
    """Why the job log's folder could not be created (checked before anything is written): the nearest folder
    that exists must be a writable folder."""
    if not output:
        return None
    folder = Path(output).parent
    try:
        while not folder.exists():
            folder = folder.parent
        ok = folder.is_dir() and os.access(folder, os.W_OK | os.X_OK)
    except OSError as exc:
        return _bad("--output-log", output, f"cannot inspect its folder: {exc.strerror}",
                    "choose a log path in a folder you can create")
    if not ok:
        return _bad("--output-log", output, f"its folder cannot be created under {str(folder)!r}",
                    "choose a log path in a folder you can create")
    return None


def make_log_folder(output: str | None) -> None:
    """slurmd opens #SBATCH --output before the script runs and does not create its folder: create it now
    (after the script is written, so a refused -o leaves nothing behind; log_folder_problem checked it first)."""
    if output:
        try:
            Path(output).parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise OverlayError([_bad("--output-log", output, f"cannot create its folder: {exc.strerror}",
                                     "choose a log path in a folder you can create")]) from None


def write_script(path: str, text: str, *, force: bool = False) -> None:
    """The script to ``path`` through the one writer of output files (core/outfile.py): a regular file, never
    through a link, device or fifo; an existing file only with ``force`` (``--force``); mode 0755; atomic."""
    write_output(path, text, "-o", force=force, mode=SCRIPT_MODE, who="slurm")


def collect(*groups: Iterable[Problem]) -> None:
    """Raise one OverlayError with every problem of every group, if any."""
    problems = [p for g in groups for p in g]
    if problems:
        raise OverlayError(problems)
