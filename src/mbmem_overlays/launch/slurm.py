"""Render a complete sbatch script that carries the overlays (``mbmem slurm``).

The template is a file a user can read and adapt: ``recipes/slurm/sbatch.sh.tmpl``.
Rendering never imports Megatron Bridge; validation (on by default) runs the same
overlay engine and Bridge validation as train.py with world size = nodes x GPUs.

Quoting: values that end up in ``#SBATCH`` lines must match a conservative pattern
(sbatch parses those lines itself, so shell quoting cannot protect them); every other
user value is a single shell word made with ``shlex.quote``, and the training
arguments travel to each node as positional parameters, never re-parsed by a shell.
"""

from __future__ import annotations

import datetime as _dt
import re
import shlex
import sys
from pathlib import Path

from ..core import allocconf
from ..core.catalog import Catalog, data_dir, train_recipe_arg
from ..core.errors import OverlayError, Problem

TEMPLATE = data_dir("recipes") / "slurm" / "sbatch.sh.tmpl"
CHECKOUT = Path(__file__).resolve().parents[3]  # where train.py lives when running from a clone
SBATCH_SAFE = re.compile(r"^[A-Za-z0-9_.:,@%/+=\-]+$")

# The field's standard environment (nvidia-skills/nemo-mbridge-multi-node-slurm.templates.md,
# slurm-and-launch.md). Overlays add to it; a key the overlays also set keeps the overlay's value
# only where a rule says so (e.g. NCCL_GRAPH_REGISTER with expandable segments + CUDA graphs).
STANDARD_ENV = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1",
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
    "PYTHONUNBUFFERED": "1",
    "SLURM_UNBUFFEREDIO": "1",
}


def _bad(field: str, value: str, why: str, fix: str) -> Problem:
    return Problem(("slurm",), field, value, why, fix)


def sbatch_lines(opts: dict, cpu_smoke: bool) -> tuple[list[str], list[Problem]]:
    problems: list[Problem] = []
    lines: list[str] = []

    def add(flag: str, value) -> None:
        if value is None:
            return
        text = str(value)
        if not SBATCH_SAFE.match(text):
            problems.append(_bad(f"--{flag}", text, "contains characters sbatch would misread in an #SBATCH line "
                                 "(spaces, quotes, ';', '$', newlines, ...)",
                                 f"use only letters, digits and _ . : , @ % / + = - in --{flag}"))
            return
        lines.append(f"#SBATCH --{flag}={text}")

    add("job-name", opts.get("job_name") or "mbmem")
    add("nodes", opts["nodes"])
    add("ntasks-per-node", 1)
    if not cpu_smoke:
        add("gpus-per-node", opts["gpus_per_node"])
        lines.append("#SBATCH --exclusive")
    add("time", opts.get("time"))
    add("partition", opts.get("partition"))
    add("account", opts.get("account"))
    add("output", opts.get("output"))
    return lines, problems


def render(*, recipe: str, overlays: list[str], sets: list[str], nodes: int, gpus_per_node: int,
           env: dict[str, str], cpu_smoke: bool = False, python: str | None = None, workdir: str | None = None,
           container_image: str | None = None, container_mounts: str | None = None, **sbatch) -> str:
    problems: list[Problem] = []
    if nodes < 1 or gpus_per_node < 1:
        problems.append(_bad("--nodes/--gpus-per-node", f"{nodes}/{gpus_per_node}", "must be at least 1",
                             "e.g. --nodes 4 --gpus-per-node 8"))
    header, sb_problems = sbatch_lines({"nodes": nodes, "gpus_per_node": gpus_per_node, **sbatch}, cpu_smoke)
    problems += sb_problems
    for value in [recipe, *overlays, *sets, python or "", workdir or "", container_image or "", container_mounts or ""]:
        if "\n" in value or "\r" in value or "\0" in value:
            problems.append(_bad("argument", value, "contains a newline or NUL byte", "pass single-line values"))
    if problems:
        raise OverlayError(problems)

    world = nodes * gpus_per_node
    args = [train_recipe_arg(recipe)]
    if overlays:
        args.append(f"+mem=[{','.join(overlays)}]")
    args += sets
    if cpu_smoke:
        # Same script, CPU-only cluster: plan instead of train, for the full world size.
        args += ["run.dry_run=true", f"run.world_size={world}"]
    exports = {**STANDARD_ENV, **env}
    export_lines = [f"export {k}={shlex.quote(v)}" for k, v in exports.items()]
    srun_extra = ""
    if container_image:
        srun_extra += f" --container-image={shlex.quote(container_image)} --no-container-mount-home"
    if container_mounts:
        srun_extra += f" --container-mounts={shlex.quote(container_mounts)}"
    title = (f"{recipe} with overlays [{', '.join(overlays) or 'none'}] on {nodes} node(s) x {gpus_per_node} GPU(s)"
             + (" — CPU smoke mode (dry-run plan, no GPU directives)" if cpu_smoke else ""))
    fill = {
        "TITLE": title.replace("\n", " "),
        "DATE": _dt.date.today().isoformat(),
        "SBATCH": "\n".join(header),
        "EXPORTS": "\n".join(export_lines),
        "TRAIN_ARGS": "\n".join(f"  {shlex.quote(a)}" for a in args),
        "WORKDIR": shlex.quote(workdir or str(CHECKOUT if (CHECKOUT / "train.py").is_file() else Path.cwd())),
        "PYTHON": shlex.quote(python or ("python" if container_image else sys.executable)),
        "NPROC": str(1 if cpu_smoke else gpus_per_node),
        "SRUN_EXTRA": srun_extra,
    }
    text = TEMPLATE.read_text()
    for key, value in fill.items():
        text = text.replace("{{" + key + "}}", value)
    return text


def static_env(overlays: list[str], catalog: Catalog) -> dict[str, str]:
    """The overlays' environment without a config (used with --no-validate)."""
    env: dict[str, str] = {}
    for name in overlays:
        for var, value in catalog.resolve(name).env.items():
            if isinstance(value, dict):
                env[var], _ = allocconf.merged(var, env.get(var), {k: str(v) for k, v in value.items()})
            else:
                env[var] = str(value)
    return env
