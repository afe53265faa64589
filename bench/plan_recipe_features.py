"""The shipped Bridge recipes that use the features the census named last (TE's op fuser on the experts, the paged
stash, kept stage outputs, a2a / all-gather context parallelism, Gemma 2's softcapping), each planned with its
feature's terms and with them switched off, side by side in one run, for docs/memory-model.md ("Recipe features
modelled from the census (issue 38)").

Usage: .venv/bin/python bench/plan_recipe_features.py [RECIPE[:WORLD[:ARCH]] ...]

Each recipe is planned at the world size its name gives (N gpu) and on its platform's GPU (compute capability 10 for
b200 / b300 / gb200 / gb300, 9 otherwise), from the shipped config.json (src/mbmem_overlays/bridge/hf_configs/).
"without" re-plans the same Shape, Layout and Settings with the feature's Settings reset to what the plan assumed
before (the experts' modules, no stash, outputs deallocated, the p2p ring, megatron-core's attention, plain logits).
GB = 10^9 bytes (as Bridge's memory lines print them).
"""

from __future__ import annotations

import re
import sys
from dataclasses import replace

RECIPES = (
    "megatron.bridge.perf_recipes.qwen.gb200.qwen3_moe.qwen3_30b_a3b_pretrain_8gpu_gb200_fp8mx_config",
    "megatron.bridge.perf_recipes.qwen.gb200.qwen3_moe.qwen3_235b_a22b_pretrain_64gpu_gb200_fp8mx_config",
    "megatron.bridge.perf_recipes.gpt_oss.gb200.gpt_oss.gpt_oss_120b_pretrain_64gpu_gb200_fp8mx_config",
    "megatron.bridge.perf_recipes.gpt_oss.b300.gpt_oss.gpt_oss_20b_pretrain_8gpu_b300_fp8mx_config",
    "megatron.bridge.perf_recipes.nemotronh.gb200.nemotronh.nemotron_3_nano_pretrain_8gpu_gb200_fp8mx_config",
    "megatron.bridge.perf_recipes.deepseek.h100.deepseek_v3.deepseek_v3_pretrain_1024gpu_h100_bf16_config",
    "moonlight_16b_sft_8gpu_h100_bf16_config",
    "qwen3_8b_sft_8gpu_h100_bf16_32k_config",
    "nemotron_3_nano_4b_sft_8gpu_h100_bf16_32k_config",
    "gemma2_2b_pretrain_2gpu_h100_bf16_config",
    "gemma2_9b_pretrain_8gpu_h100_bf16_config",
    "gemma2_27b_pretrain_16gpu_h100_bf16_config",
)
GB = 1e9
BLACKWELL = re.compile(r"_(b200|b300|gb200|gb300)_")


def without_features(st):
    """The Settings the plan had before these terms."""
    return replace(st, moe_op_fuser="", moe_op_quant="", moe_op_srelu=False, paged_stash_cuda=0.0,
                   keep_stage_outputs=False, cp_comm="p2p", attn_softcap="", logit_softcap=False)


def features(st, lay) -> str:
    out = []
    if st.moe_op_fuser:
        out.append(f"op fuser {st.moe_op_fuser}" + (f" {st.moe_op_quant}" if st.moe_op_quant else ""))
    if st.paged_stash_cuda:
        out.append(f"paged stash {st.paged_stash_cuda:g}x")
    if st.keep_stage_outputs:
        out.append("outputs kept")
    if lay.cp > 1 and st.cp_comm != "p2p":
        out.append(f"CP{lay.cp} {st.cp_comm}")
    if st.attn_softcap:
        out.append(f"Gemma 2 {st.attn_softcap}")
    if st.logit_softcap:
        out.append("softcapped logits")
    return ", ".join(out) or "-"


def main(argv: list[str]) -> int:
    from mbmem_overlays.bridge.stack import prepare
    prepare()
    from mbmem_overlays.bridge.recipes import build_recipe
    from mbmem_overlays.memory import model as P
    from mbmem_overlays.memory.coverage import not_modelled
    from mbmem_overlays.memory.ranges import uncertainty
    print(f"{'recipe':<48} {'GPUs':>5} {'cc':>3}  {'without':>8} {'with':>8} {'change':>7}  range high  features "
          "(GB = 1e9 bytes)")
    for spec in argv or RECIPES:
        name, *rest = spec.split(":")
        short = name.rpartition(".")[2]
        m = re.search(r"_(\d+)gpu_", short)
        world = int(rest[0]) if rest else int(m.group(1)) if m else 8
        arch = int(rest[1]) if len(rest) > 1 else 10 if BLACKWELL.search(short) else 9
        cfg = build_recipe(name)
        shape, lay, st = P.from_config(cfg, world, arch=arch)
        after = P.estimate(shape, lay, st)
        before = P.estimate(shape, lay, without_features(st))
        high = max((r.high for r in uncertainty(shape, lay, st, after) if r.high and "Gemma 2" in r.component),
                   default=None)
        blind = len(not_modelled(cfg))
        print(f"{short[:48]:<48} {world:>5} {arch:>3}  {before.footprint / GB:>8.2f} {after.footprint / GB:>8.2f} "
              f"{(after.footprint - before.footprint) / GB:>+7.2f}  {'' if high is None else f'{high / GB:.2f}':>10}  "
              f"{features(st, lay)}{f'; {blind} other not modelled' if blind else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
