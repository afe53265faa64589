"""Run a recipe with memory overlays through NeMo-Run (``pip install mbmem-overlays[run]``).

    # local executor, CPU dry run: the job rebuilds the recipe with the overlays' overrides through Bridge's
    # own override machinery and runs Bridge's validation (no training)
    python examples/nemo_run_launch.py --recipe tiny_llama --overlay expandable_segments,selective_recompute

    # Slurm through a local tunnel (run on a login node: sbatch runs here)
    NEMORUN_HOME=/shared/nemo_run python examples/nemo_run_launch.py --executor slurm --account ACCOUNT --recipe tiny_llama \\
        --overlay expandable_segments --plan-only

The task is a ``run.Script`` shaped like Bridge's ``scripts/training/run_recipe.py`` (``--recipe NAME`` then
``KEY=VALUE`` overrides); ``examples/run_recipe_dry.py`` stands in for it on CPU. Point ``--script`` at Bridge's
``run_recipe.py`` (and drop ``--plan-only``) to train. The ``MemoryOverlays`` plugin validates the overlays with
Bridge for the executor's world size before anything is submitted, appends the overrides to the script's
arguments and puts PYTORCH_CUDA_ALLOC_CONF (and any variable the overlays name) on the executor, so it is set
before the process starts. A refusal exits 1 with ``mbmem apply``'s message; nothing is submitted.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# isort: off
# Before nemo_run: nemo_run imports huggingface_hub, which must first see the offline HF configs.
from mbmem_overlays.launch.nemo_run import MemoryOverlays
import nemo_run as run
# isort: on

from mbmem_overlays.core.errors import OverlayError
from mbmem_overlays.core.values import parse_value

HERE = Path(__file__).resolve().parent


def executor_for(args) -> run.Executor:
    if args.executor == "local":
        return run.LocalExecutor(ntasks_per_node=args.tasks)
    return run.SlurmExecutor(account=args.account, partition=args.partition, nodes=args.nodes,
                             ntasks_per_node=args.tasks, time=args.time,
                             # a LocalTunnel copies nothing (nemo_run run/experiment.py rsyncs only for SSHTunnel):
                             # its job_dir must be the experiments folder NeMo-Run writes the sbatch script into
                             tunnel=run.LocalTunnel(job_dir=str(Path(run.config.get_nemorun_home()) / "experiments")),
                             packager=run.Packager())  # the script runs from this checkout, not a git archive


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", required=True)
    p.add_argument("--overlay", "-O", default="", help="comma-separated overlay names")
    p.add_argument("--param", action="append", default=[], metavar="OVERLAY.PARAM=VALUE")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="your own Bridge override")
    p.add_argument("--executor", choices=("local", "slurm"), default="local")
    p.add_argument("--script", default=str(HERE / "run_recipe_dry.py"), help="run_recipe.py-like script")
    p.add_argument("--plan-only", action="store_true", help="the job only prints the plan it received")
    p.add_argument("--dryrun", action="store_true", help="NeMo-Run's dry run: print what would be launched")
    p.add_argument("--world-size", type=int, help="GPUs to validate for (default: nodes x tasks per node)")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--tasks", type=int, default=1, help="tasks (processes) per node")
    p.add_argument("--account")
    p.add_argument("--partition")
    p.add_argument("--time", default="00:10:00")
    args = p.parse_args(argv)
    if args.executor == "slurm" and not args.account:
        p.error("--executor slurm needs --account (NeMo-Run names the job and its log files after it)")
    params = {}
    for item in args.param:  # typed as train.py and mbmem read them (Hydra's value grammar)
        key, _, value = item.partition("=")
        params[key] = parse_value(value)
    task = run.Script(path=args.script, entrypoint=sys.executable,
                      args=["--recipe", args.recipe, *(["--plan-only"] if args.plan_only else []), *args.set])
    plugin = MemoryOverlays(overlays=[n for n in args.overlay.split(",") if n], params=params,
                            world_size=args.world_size, recipe=args.recipe)
    try:
        with run.Experiment("mbmem-overlays", executor=executor_for(args), log_level="WARN") as exp:
            exp.add(task, name="recipe", plugins=[plugin])  # the plugin validates here, before submission
            if args.dryrun:
                exp.dryrun()
            else:
                exp.run(sequential=True, detach=False, tail_logs=True)
    except OverlayError as exc:
        print(f"nemo_run_launch: not launched: {exc}", file=sys.stderr)
        return 1
    report = plugin.report
    print(f"overlays: {', '.join(report.overlays) or '(none)'}; validation: {report.validation.verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
