"""python train.py recipe=<name> '+mem=[a,b]' [mem.<overlay>.<param>=v] [KEY=VALUE ...] [run.dry_run=true]

Plans (CPU, or run.dry_run=true) or launches (GPU node, under torchrun) a Megatron Bridge
recipe with validated memory overlays. See README.md.
"""

import sys

import hydra

from mbmem_overlays.launch.hydra_entry import hydra_argv, run


@hydra.main(version_base="1.3", config_path="recipes", config_name="train")
def main(cfg) -> None:
    code = run(cfg)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    sys.argv = hydra_argv(sys.argv)
    main()
