"""The memory ladder's order and each step's documented throughput cost, with its source."""

from __future__ import annotations

# The order steps are shown in: the memory-tuning skill's Quick Decision ladder.
LADDER = ("expandable_segments", "lora_sp_regather", "selective_recompute", "dist_optimizer", "full_recompute",
          "cpu_offload", "optimizer_offload", "sequence_parallel")

# Documented throughput costs (fraction of step time), with their sources.
COSTS = {
    "expandable_segments": (0.0, "zero throughput cost (memory-tuning skill, Expandable segments)"),
    "lora_sp_regather": (0.04, "0.3-7% (memory-tuning skill, LoRA + SP input re-gather: -6.74% on Qwen3-8B)"),
    "selective_recompute": (0.02, "core_attn: small; mlp ~16% on Llama3-70B (activation-recompute skill)"),
    "dist_optimizer": (0.015, "~1-2% (memory-tuning skill, Parallelism resizing)"),
    "full_recompute": (0.33, "replays every layer's forward (~+1/3 compute; activation-recompute skill)"),
    "cpu_offload": (0.10, "PCIe transfer per offloaded layer (cpu-offloading skill; not measured there)"),
    "optimizer_offload": (0.9, "~1.9x step time at 25%, ~4.2x at 100% (cpu-offloading skill)"),
    "sequence_parallel": (0.0, "replaces all-reduce by reduce-scatter/all-gather of the same volume"),
}
TP_DOUBLING_COST = (0.28, "doubling TP: -28% on Llama3-70B (memory-tuning skill, Measured Results)")
DP_HALVING_COST = (0.06, "PP up at the cost of DP: ~6% per halving (memory-tuning skill)")
