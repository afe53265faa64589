"""python train.py recipe=<name> '+mem=[a,b]' [mem.<overlay>.<param>=v] [KEY=VALUE ...] [run.dry_run=true]

Plans (CPU, or run.dry_run=true) or launches (GPU node, under torchrun) a Megatron Bridge
recipe with validated memory overlays. There is no default recipe: pick one. See README.md.
Exit codes: 0 passed, 1 rejected, 2 usage, 3 validation incomplete, 74 stdout closed or full (README "Exit
codes"); under -m, the worst job's code after every job has run.
"""

import sys

import hydra

from mbmem_overlays.core import console
from mbmem_overlays.launch.hydra_entry import finish, run_job, startup


@hydra.main(version_base="1.3", config_path="recipes", config_name="train")
def main(cfg) -> None:
    run_job(cfg)  # records the job's exit code; never exits, so a -m sweep runs every job


if __name__ == "__main__":
    console.guard_stdout()
    sys.argv = startup(sys.argv)
    sys.exit(console.run_entry(lambda: (main(), finish())[1], "train.py"))  # --help to a closed stdout: 74
