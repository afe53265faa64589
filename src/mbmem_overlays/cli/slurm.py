"""``mbmem slurm``: an sbatch script carrying the overlays, validated for nodes x GPUs unless --no-validate.

Order of work: every cheap check of the options first (all problems in one error, before the 20-50 s Bridge
import), then validation, then the log folder and the script file. Nothing is written when anything fails.
"""

from __future__ import annotations

import os
import shlex
import sys

from ..core import allocconf

from ..core.text import shown
from .common import (EXIT_INCOMPLETE, EXIT_OK, EXIT_REJECTED, EXIT_USAGE, add_recipe_options, build_with_overrides,
                     catalog_for, csv_list, preflight, split_sets)


def register(sub) -> None:
    p = sub.add_parser("slurm", help="render an sbatch script carrying the overlays (validated for nodes x GPUs)")
    add_recipe_options(p, world_size=None)
    p.add_argument("--overlay", "-O", action="append", default=[])
    # Counts are read as text and checked with the other options (all problems at once, bounds included).
    p.add_argument("--nodes", required=True, metavar="N")
    p.add_argument("--gpus-per-node", required=True, metavar="N",
                   help="GPUs per node = torchrun processes per node; world size = nodes x this")
    p.add_argument("--cpus-per-task", metavar="N",
                   help="#SBATCH --cpus-per-task for the one task per node (default: Slurm's; the task always gets "
                        "every CPU the job holds on its node)")
    p.add_argument("--partition")
    p.add_argument("--account")
    p.add_argument("--time")
    p.add_argument("--job-name")
    p.add_argument("--output-log", help="#SBATCH --output, e.g. logs/%%x_%%j.log: made absolute and its folder "
                                        "created now (default: Slurm's slurm-%%j.out in the folder you submit from)")
    p.add_argument("--container-image", help="pyxis/enroot image; the tasks run inside it")
    p.add_argument("--container-mounts", help="extra pyxis mounts SRC:DST[,...]; the repository (--workdir) is "
                                              "always mounted at the same path unless a mount targets it")
    p.add_argument("--python", help="python inside the job (default: this one, or 'python' in a container)")
    p.add_argument("--workdir", help="repository root as the tasks see it; also the container's workdir "
                                     "(default: this checkout)")
    p.add_argument("--cpu-smoke", action="store_true", help="plan instead of train, no GPU directives (CPU clusters)")
    p.add_argument("--no-validate", action="store_true", help="render without importing Bridge")
    p.add_argument("-o", metavar="FILE", help="write the script here instead of stdout (a new regular file; "
                                              "an existing one only with --force)")
    p.add_argument("--force", action="store_true", help="with -o: replace an existing regular file")
    p.add_argument("--json", action="store_true",
                   help="one JSON object on stdout: the verdict and the script (or its path with -o), errors included")
    p.set_defaults(fn=run)


def _launch_requirement_fix(requirement: str) -> str:
    # "checkpoint.pretrained_checkpoint=<path ...> (why)" -> "--set checkpoint.pretrained_checkpoint=<path ...>"
    setting = requirement.split(" (", 1)[0]
    return f"--set {shlex.quote(setting)}"


def _refuse(args, message: str, code: int, problems=()) -> int:
    """Say why nothing was written: on stderr, and as the JSON object under --json."""
    print(shown(f"mbmem slurm: not written: {message}", one_line=False), file=sys.stderr)
    if args.json:
        from ..core.report import error_dict, json_text
        print(json_text(error_dict(message, code, problems=problems)))
    return code


def run(args) -> int:
    from ..core.catalog import all_user_dirs
    from ..core.errors import OverlayError, ValidationRejected
    from ..core.outfile import output_problems
    from ..launch import slurm
    sets = list(args.set)
    overrides, params = split_sets(sets)
    output_log = slurm.absolute_log_path(args.output_log)
    sbatch = dict(job_name=args.job_name, time=args.time, partition=args.partition, account=args.account)
    # The job's train.py must find the user overlays the script names: --overlay-dir and MBMEM_OVERLAY_DIRS, as
    # absolute paths, go into the script (issue 22 #2a).
    options = dict(recipe=args.recipe, sets=sets, nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                   cpus_per_task=args.cpus_per_task, python=args.python, workdir=args.workdir,
                   container_image=args.container_image, container_mounts=args.container_mounts, output=output_log,
                   overlay_dirs=all_user_dirs(args.overlay_dir), **sbatch)
    try:  # every cheap check, all problems in one error, before anything imports Bridge (issue 15 #14)
        catalog = catalog_for(args.overlay_dir)
        names = csv_list(args.overlay)
        mine = slurm.option_problems(overlays=names, **options)
        recipe_ok = not any(p.field == "--recipe" for p in mine)
        shared = preflight(args.recipe if recipe_ok else None, names, params, overrides, catalog)
        overlays = [catalog.resolve(n).name for n in names if n in catalog.specs or n in catalog.aliases]
        unvalidated = slurm.unvalidated_launch_problems(args.recipe, sets) \
            if args.no_validate and recipe_ok else []
        slurm.collect(shared, mine, slurm.overlay_env_problems(overlays, catalog),
                      output_problems(args.o, "-o", force=args.force, who="slurm"), unvalidated)
    except OverlayError as exc:
        return _refuse(args, str(exc), EXIT_USAGE, exc.problems)
    counts = slurm.count_problems(dict(nodes=args.nodes, gpus_per_node=args.gpus_per_node))[0]
    code = EXIT_OK
    standard = slurm.standard_env(overlays=overlays, sets=overrides, catalog=catalog)
    if args.no_validate:
        env = slurm.static_env(overlays, catalog, allocconf.allocator_env(os.environ))
        verdict = "not validated (--no-validate); train.py validates again inside the job"
    else:
        from ..api import apply_overlay
        cfg, changes, problems = build_with_overrides(args.recipe, overrides)
        if problems:
            raise OverlayError(problems)
        world = counts["nodes"] * counts["gpus_per_node"]
        try:
            # The job's environment is the script's own exports, not the rendering shell's: validate with exactly
            # those (e.g. Megatron FSDP refuses the standard CUDA_DEVICE_MAX_CONNECTIONS=1).
            standard = slurm.standard_env(cfg)
            # ... and the allocator variables the job inherits (sbatch exports the submitting shell's environment):
            # their keys stay in the variable torch reads (core/allocconf.py, issue 33 #9)
            report = apply_overlay(cfg, overlays, env={**standard, **allocconf.allocator_env(os.environ)},
                                   params=params, world_size=world,
                                   locked={path: new for path, _, new in changes}, validate=True, catalog=catalog)
        except ValidationRejected as exc:
            report = exc.report
        v = report.validation
        if not v.ok:
            return _refuse(args, v.verdict, EXIT_REJECTED)
        if v.launch_requirements:
            # Validation stood in a placeholder (e.g. PEFT's pretrained checkpoint): "PASSED" would be untrue for
            # the job, which has no such placeholder (bridge/validation.py, "PEFT requires a pretrained checkpoint").
            lines = [f"the job needs what validation only had a placeholder for (world size {world}):"]
            lines += [f"  - {r}\n    fix: add {_launch_requirement_fix(r)}" for r in v.launch_requirements]
            return _refuse(args, "\n".join(lines), EXIT_USAGE)
        env = report.env_to_export
        verdict = f"validated for world size {world}: {v.verdict}"
        if not v.complete:
            code = EXIT_INCOMPLETE
    try:
        text = slurm.render(overlays=overlays, env=env, cpu_smoke=args.cpu_smoke, verdict=verdict, standard=standard,
                            **options)
        if (problem := slurm.log_folder_problem(output_log)) is not None:
            raise OverlayError([problem])
        if args.o:
            slurm.write_script(args.o, text, force=args.force)
        slurm.make_log_folder(output_log)
    except OverlayError as exc:
        return _refuse(args, str(exc), EXIT_USAGE, exc.problems)
    if args.json:
        from ..core.report import SCHEMA_VERSION, json_text
        print(json_text({"schema_version": SCHEMA_VERSION, "ok": True, "exit_code": code, "verdict": verdict,
                         "path": args.o, "script": None if args.o else text, "job_log": output_log,
                         "environment": env}))
        return code
    if args.o:
        print(f"wrote {shown(args.o)} ({verdict})", file=sys.stderr)
    else:
        sys.stdout.write(text)
        print(f"# {verdict}", file=sys.stderr)
    if output_log:
        print(f"# job log: {output_log} (folder created)", file=sys.stderr)
    return code
