"""The shipped Bridge recipes that use the attention variants (gated delta net, DSA), planned as they stand: the
most-loaded GPU's footprint and its parts, per recipe, for docs/memory-model.md ("Attention variants").

Usage: .venv/bin/python bench/plan_variant_recipes.py [--set KEY=VALUE ...] [RECIPE ...]
(--set: Bridge overrides applied to every recipe, as `mbmem plan --set` takes them.)
The recipes need their model's config.json offline. Where the package ships none (src/mbmem_overlays/bridge/
hf_configs/), this writes transformers' config-class defaults for the model type into a temporary directory given
by MBMEM_HF_CONFIGS, as tests/test_plan_variants.py does: the numbers are the recipe's provider read as
megatron-core builds it, not the checkpoint's own, and the script says which it used. Each recipe is planned at the
world size its name gives (N gpu) and on its platform's GPU (compute capability 10 for gb200, 9 otherwise). The
figures are GB (10^9 bytes, as Bridge's memory lines and docs/memory-model.md's tables print them). Run it on two checkouts to put a change's before and after side by side.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

RECIPES = ("qwen3_next_80b_a3b_pretrain_32gpu_h100_bf16_config", "qwen3_next_80b_a3b_sft_16gpu_h100_bf16_config",
           "qwen35_text_9b_pretrain_8gpu_gb200_bf16_config", "qwen35_text_35b_a3b_pretrain_8gpu_gb200_bf16_config",
           "glm52_pretrain_416gpu_h100_bf16_config", "glm52_sft_416gpu_h100_bf16_config",
           "glm52_peft_208gpu_h100_bf16_config", "glm52_pretrain_192gpu_gb200_bf16_config")
# hub id -> (transformers model type, architecture, extra config keys) for the defaults written where none ships
DEFAULTS = {"Qwen/Qwen3-Next-80B-A3B-Instruct": ("qwen3_next", "Qwen3NextForCausalLM", {}),
            "zai-org/GLM-5.2": ("glm_moe_dsa", "GlmMoeDsaForCausalLM", {"indexer_rope_interleave": False}),
            "Qwen/Qwen3.5-9B-Base": ("qwen3_5", "Qwen3_5ForConditionalGeneration", {}),
            "Qwen/Qwen3.5-35B-A3B-Base": ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", {})}
PINS = {"zai-org--GLM-5.2": "4d67f66cc64d3219133b767c253b2ad1425c6c88"}   # recipes/glm/h100/glm5.py
GB = 1e9


def write_defaults(root: Path, shipped: set[str]) -> list[str]:
    """transformers' config-class defaults for each model of DEFAULTS the package does not ship; the hub ids."""
    from transformers import AutoConfig
    written = []
    for hub, (model_type, architecture, extra) in DEFAULTS.items():
        key = hub.replace("/", "--", 1)
        if key in shipped:
            continue
        d = AutoConfig.for_model(model_type).to_dict()
        d.update(architectures=[architecture], **extra)
        (root / key).mkdir(parents=True, exist_ok=True)
        (root / key / "config.json").write_text(json.dumps(d, default=str))
        written.append(hub)
    (root / "pinned_revisions.json").write_text(json.dumps({k: v for k, v in PINS.items() if k not in shipped}))
    return written


def main(argv: list[str]) -> int:
    from mbmem_overlays.bridge import hf_offline
    from mbmem_overlays.bridge.stack import prepare
    shipped = {p.name for p in hf_offline.FIXTURE_DIR.iterdir() if (p / "config.json").is_file()}
    sets = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--set"]
    names = tuple(a for i, a in enumerate(argv) if a != "--set" and (i == 0 or argv[i - 1] != "--set")) or RECIPES
    with tempfile.TemporaryDirectory() as tmp:
        written = write_defaults(Path(tmp), shipped)
        os.environ[hf_offline.USER_DIRS_ENV] = os.pathsep.join([tmp, str(hf_offline.FIXTURE_DIR)])
        prepare()
        hf_offline.activate()
        from mbmem_overlays.bridge.overrides import apply_overrides
        from mbmem_overlays.bridge.recipes import build_recipe
        from mbmem_overlays.memory import model as P
        print("config.json: " + (", ".join(f"{h} (transformers defaults)" for h in written) or "all shipped"))
        if sets:
            print("--set " + " ".join(sets))
        print(f"{'recipe (world)':<62}{'total':>8}{'params':>8}{'activ':>8}{'graphs':>8}  GB")
        for name in names:
            world = int(re.search(r"_(\d+)gpu_", name).group(1)) if re.search(r"_(\d+)gpu_", name) else 8
            arch = 10 if "_gb200_" in name or "_b200_" in name else 9
            try:
                cfg = build_recipe(name)
                if sets:
                    apply_overrides(cfg, sets)
                b = P.estimate(*P.from_config(cfg, world, arch=arch))
            except Exception as exc:  # noqa: BLE001 — a recipe that cannot be planned here is named, not fatal
                print(f"{name + f' ({world})':<62}  not planned: {type(exc).__name__}: {" ".join(str(exc).split())[-300:]}")
                continue
            pool = f"{b.resident / GB:8.2f}" if b.resident > b.total else f"{'-':>8}"
            print(f"{name + f' ({world})':<62}{b.total / GB:8.2f}{b.parameters / GB:8.2f}"
                  f"{b.activations / GB:8.2f}{pool}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
