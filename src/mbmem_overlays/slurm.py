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

from .catalog import Catalog, data_dir, train_recipe_arg
from .errors import OverlayError, Problem

TEMPLATE = data_dir("recipes") / "slurm" / "sbatch.sh.tmpl"
CHECKOUT = Path(__file__).resolve().parents[2]  # where train.py lives when running from a clone
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
    from . import allocconf
    env: dict[str, str] = {}
    for name in overlays:
        for var, value in catalog.resolve(name).env.items():
            if isinstance(value, dict):
                env[var], _ = allocconf.merged(var, env.get(var), {k: str(v) for k, v in value.items()})
            else:
                env[var] = str(value)
    return env


def cmd_slurm(args) -> int:
    from .cli import _csv, split_sets
    catalog = Catalog(args.overlay_dir)
    overlays = [catalog.resolve(n).name for n in _csv(args.overlay)]
    overrides, params = split_sets(args.set)
    if args.no_validate:
        env = static_env(overlays, catalog)
        verdict = "not validated (--no-validate); train.py validates again inside the job"
    else:
        from . import bridge
        from .engine import apply_overlay
        cfg = bridge.load_recipe(args.recipe)
        locked = bridge.apply_overrides(cfg, overrides)
        world = args.nodes * args.gpus_per_node
        # env={}: the script must not depend on the rendering shell's environment
        report = apply_overlay(cfg, overlays, env={}, params=params, world_size=world, locked=locked, validate=True)
        if not report.validation.ok:
            print(f"mbmem slurm: not written: {report.validation.verdict}", file=sys.stderr)
            return 1
        env = report.env_to_export
        verdict = f"validated for world size {world}: {report.validation.verdict}"
    text = render(recipe=args.recipe, overlays=overlays, sets=args.set, nodes=args.nodes,
                  gpus_per_node=args.gpus_per_node, env=env, cpu_smoke=args.cpu_smoke, python=args.python,
                  workdir=args.workdir, container_image=args.container_image, container_mounts=args.container_mounts,
                  job_name=args.job_name, time=args.time, partition=args.partition, account=args.account,
                  output=args.output_log)
    if args.o:
        Path(args.o).write_text(text)
        Path(args.o).chmod(0o755)
        print(f"wrote {args.o} ({verdict})", file=sys.stderr)
    else:
        sys.stdout.write(text)
        print(f"# {verdict}", file=sys.stderr)
    return 0


def register(sub) -> None:
    p = sub.add_parser("slurm", help="render an sbatch script carrying the overlays (validated for nodes x GPUs)")
    p.add_argument("--recipe", required=True)
    p.add_argument("--overlay", "-O", action="append", default=[])
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--time")
    p.add_argument("--job-name")
    p.add_argument("--output-log", help="#SBATCH --output pattern, e.g. logs/%%x_%%j.log")
    p.add_argument("--container-image")
    p.add_argument("--container-mounts")
    p.add_argument("--python", help="python inside the job (default: this one, or 'python' in a container)")
    p.add_argument("--workdir", help="repository root inside the job (default: this checkout)")
    p.add_argument("--cpu-smoke", action="store_true", help="plan instead of train, no GPU directives (CPU clusters)")
    p.add_argument("--no-validate", action="store_true", help="render without importing Bridge")
    p.add_argument("-o", metavar="FILE", help="write the script here instead of stdout")
    p.set_defaults(fn=cmd_slurm)
