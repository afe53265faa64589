"""``mbmem slurm``: an sbatch script carrying the overlays, validated for nodes x GPUs unless --no-validate."""

from __future__ import annotations

import sys
from pathlib import Path

from .common import EXIT_REJECTED, add_recipe_options, csv_list, recipe_with_overrides


def register(sub) -> None:
    p = sub.add_parser("slurm", help="render an sbatch script carrying the overlays (validated for nodes x GPUs)")
    add_recipe_options(p, world_size=None)
    p.add_argument("--overlay", "-O", action="append", default=[])
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
    p.set_defaults(fn=run)


def run(args) -> int:
    from ..core.catalog import Catalog
    from ..launch.slurm import render, static_env
    catalog = Catalog(args.overlay_dir)
    overlays = [catalog.resolve(n).name for n in csv_list(args.overlay)]
    if args.no_validate:
        env = static_env(overlays, catalog)
        verdict = "not validated (--no-validate); train.py validates again inside the job"
    else:
        from ..api import apply_overlay
        cfg, locked, params = recipe_with_overrides(args.recipe, args.set)
        world = args.nodes * args.gpus_per_node
        # env={}: the script must not depend on the rendering shell's environment
        report = apply_overlay(cfg, overlays, env={}, params=params, world_size=world, locked=locked, validate=True)
        if not report.validation.ok:
            print(f"mbmem slurm: not written: {report.validation.verdict}", file=sys.stderr)
            return EXIT_REJECTED
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
