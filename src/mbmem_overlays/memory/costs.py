"""The memory ladder's order and each step's documented throughput cost, with its source: the words NVIDIA's skill
texts give (shown beside each step as "documented").

What the ladder, ``--search`` and ``doctor --plan`` rank by is the cost model (memory/cost/: each change priced
for the job). The numbers below are the texts' own figures, used only where no plan exists: the doctor without
``--plan`` (no Bridge, no configuration to price) orders its turn-off remedies by them (doctor/diagnose.py)."""

from __future__ import annotations

# The order steps are shown in: the memory-tuning skill's Quick Decision ladder.
LADDER = ("expandable_segments", "sequence_parallel", "lora_sp_regather", "selective_recompute", "dist_optimizer",
          "precision_aware_optimizer", "megatron_fsdp", "fine_grained_offload", "cpu_offload", "full_recompute",
          "optimizer_offload")

MEMORY = "memory-tuning skill"
RECOMPUTE = "activation-recompute skill"
OFFLOAD = "cpu-offloading skill"
FSDP = "megatron-fsdp skill"

# Documented throughput costs (fraction of step time), with their sources (shared/reference/nvidia-skills/).
COSTS = {
    "expandable_segments": (0.0, f"zero throughput cost ({MEMORY}, Quick Decision 1)"),
    "sequence_parallel": (0.0, "none expected: the TP all-reduce becomes a reduce-scatter plus all-gather of the same "
                               f"volume; precondition of LoRA input re-gather ({MEMORY}, PEFT + sequence-parallel "
                               "input re-gather)"),
    "lora_sp_regather": (0.04, f"0.3-7% ({MEMORY}, LoRA + SP input re-gather: -6.74% on Qwen3-8B)"),
    "selective_recompute": (0.02, f"small for the narrowest label (core_attn, moe_act, mla_up_proj; {RECOMPUTE}, "
                                  "Selective Module Decision Table)"),
    "selective_recompute_mlp": (0.16, f"~16% GPU utilization on Llama3-70B, saved ~3 GB ({MEMORY}, Quick Decision 6; "
                                      f"{RECOMPUTE}, Historical Measurement)"),
    "selective_recompute_moe": (0.16, "replays routing, dispatch/combine, experts and shared experts; not measured "
                                      f"({RECOMPUTE}, Selective Module Decision Table, `moe`)"),
    "dist_optimizer": (0.015, f"~1-2% ({MEMORY}, Parallelism resizing)"),
    "full_recompute": (0.33, f"replays every layer's forward (~+1/3 compute; {RECOMPUTE}, Full-layer recompute)"),
    "cpu_offload": (0.10, f"PCIe transfer per offloaded layer ({OFFLOAD}, Activation offloading; not measured there)"),
    "optimizer_offload": (0.9, f"~1.9x step time at 25%, ~4.2x at 100% ({OFFLOAD}, Known Limitations)"),
    # Issue 31's levers. NVIDIA's texts give no measured throughput for them; the number only ranks them in the
    # search, where the words say what each costs.
    "precision_aware_optimizer": (0.005, "no documented throughput cost: TE's FusedAdam reads and writes the bf16 "
                                         "moments in its own kernel; needs Adam, the distributed optimizer and TE "
                                         "FusedAdam (megatron-core optimizer_config.py); bf16 moments are a "
                                         "convergence choice to check on your model"),
    "megatron_fsdp": (0.04, f"'varies' ({MEMORY}, Parallelism resizing): all-gathers each layer's weights in forward "
                            f"and again in backward and reduce-scatters the gradients ({FSDP}, Enablement); ranked "
                            "between the distributed optimizer (~1-2%) and PP doubling (~6%)"),
    "fine_grained_offload": (0.05, f"PCIe (or C2C) copies of the offloaded modules' inputs, overlapped with compute "
                                   f"on their own streams; works with PP > 1, unlike layer offload ({OFFLOAD}, "
                                   "Known Limitations; not measured there)"),
}
TP_DOUBLING_COST = (0.28, f"doubling TP: -28% on Llama3-70B ({MEMORY}, Quick Decision 4)")
DP_HALVING_COST = (0.06, f"PP up at the cost of DP: ~6% per halving ({MEMORY}, Quick Decision 5)")


def full_recompute_cost(method: str, layers: int, per_stage: int) -> str:
    """uniform/1 replays every layer; block/n replays n of the stage's layers (activation-recompute skill,
    Full-layer recompute: 'block: checkpoint the first recompute_num_layers layers on each pipeline stage')."""
    if method == "block":
        return (f"replays {layers} of {per_stage} layers per stage (~+{layers / per_stage / 3:.0%} compute; "
                f"{RECOMPUTE}, Full-layer recompute)")
    return COSTS["full_recompute"][1]


def optimizer_offload_cost(fraction: float) -> str:
    """The cpu-offloading skill's two measured points (Known Limitations), and its advice for moderate pressure."""
    measured = {0.25: "~1.9x step time at 25%", 1.0: "~4.2x step time at 100%"}.get(fraction)
    text = measured or "between ~1.9x (25%) and ~4.2x (100%) step time, linear in the fraction"
    return (f"{text}; needs the distributed optimizer ({OFFLOAD}, Known Limitations and Compatibility; "
            "25-50% is its advice for moderate pressure)")
