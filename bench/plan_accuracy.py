"""Measured peaks (NVIDIA's skill texts in shared/reference) vs our plan vs Bridge's estimator.

Usage: .venv/bin/python bench/plan_accuracy.py
Rows: Llama3-70B SFT FP8 (current scaling) on 32 H100, TP4 PP4 VPP5 DP2 and its PP8 / TP8 variants and
`mlp` recompute (memory-tuning and activation-recompute skills); Qwen3-8B LoRA TP2 seq 8192 without and
with input re-gather (memory-tuning skill). "GB" in the skills is read as 10^9 bytes.
Goal: every peak within +-10% and the re-gather saving within +-20%. Last line:
`worst peak error: X% (Bridge estimator: Y%)`.
"""

from mbmem_overlays import bridge
from mbmem_overlays import plan as P
from mbmem_overlays.engine import apply_overlay
from mbmem_overlays.planner import bridge_estimate

GB = 1e9
L70 = ["model.tensor_model_parallel_size=4", "model.pipeline_model_parallel_size=4",
       "model.virtual_pipeline_model_parallel_size=5", "model.sequence_parallel=true", "train.micro_batch_size=1",
       "train.global_batch_size=32", "model.seq_length=4096", "mixed_precision=bf16_with_fp8_current_scaling_mixed",
       "optimizer.use_distributed_optimizer=true", "ddp.use_distributed_optimizer=true"]
ROWS = [  # label, recipe, overrides, overlays, params, world, measured GB
    ("Llama3-70B SFT TP4 PP4 VPP5 DP2 (core_attn)", "llama3_70b_sft_config", L70, ["selective_recompute"],
     {"modules": ["core_attn"]}, 32, 58.8),
    ("  PP8 (DP1)", "llama3_70b_sft_config", L70 + ["model.pipeline_model_parallel_size=8"], ["selective_recompute"],
     {"modules": ["core_attn"]}, 32, 53.2),
    ("  TP8 (DP1)", "llama3_70b_sft_config", L70 + ["model.tensor_model_parallel_size=8"], ["selective_recompute"],
     {"modules": ["core_attn"]}, 32, 50.2),
    ("  mlp recompute", "llama3_70b_sft_config", L70, ["selective_recompute"], {"modules": ["mlp"]}, 32, 55.6),
]
# The skill's row does not state the LoRA targets; we assume Bridge's LoRA defaults (all four linears,
# dim 32), not the 0.6.2 qwen3_8b_peft recipe's [linear_qkv, linear_proj]. An assumption about the
# measured run, stated here, not a fitted constant.
QWEN = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true", "model.seq_length=8192",
        "dataset.seq_length=8192", "peft.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]",
        "peft.dim=32", "peft.alpha=32"]
REGATHER = [("Qwen3-8B LoRA TP2 seq 8192", [], 47.545), ("  + input re-gather", ["lora_sp_regather"], 42.814)]


def measure(recipe, overrides, overlays, params, world):
    cfg = bridge.build_recipe(recipe)
    bridge.apply_overrides(cfg, overrides)
    if overlays:
        apply_overlay(cfg, overlays, env={}, params=params, world_size=world)
    ours = P.estimate(*P.from_config(cfg, world)).total
    return ours, bridge_estimate(cfg, world)


def err(x, ref):
    return None if x is None else 100.0 * (x - ref * GB) / (ref * GB)


bridge.prepare()
print(f"{'configuration':<46}{'measured':>10}{'ours':>10}{'err':>8}{'Bridge':>10}{'err':>8}   (GB = 1e9 bytes)")
ours_err, bridge_err = [], []
results = {}
for label, recipe, overrides, overlays, params, world, measured in ROWS:
    ours, theirs = measure(recipe, overrides, overlays, params, world)
    e1, e2 = err(ours, measured), err(theirs, measured)
    ours_err.append(abs(e1))
    bridge_err.append(abs(e2) if e2 is not None else float("nan"))
    print(f"{label:<46}{measured:>10.1f}{ours / GB:>10.1f}{e1:>+7.1f}%{(theirs or 0) / GB:>10.1f}{e2:>+7.1f}%")
for label, overlays, measured in REGATHER:
    ours, theirs = measure("qwen3_8b_peft_config", QWEN, overlays, {"strict": False} if overlays else None, 2)
    results[label] = (ours, theirs, measured)
    e1, e2 = err(ours, measured), err(theirs, measured)
    ours_err.append(abs(e1))
    bridge_err.append(abs(e2) if e2 is not None else float("nan"))
    print(f"{label:<46}{measured:>10.3f}{ours / GB:>10.2f}{e1:>+7.1f}%{(theirs or 0) / GB:>10.2f}{e2:>+7.1f}%")
(o0, b0, m0), (o1, b1, m1) = results.values()
saving_measured, saving_ours, saving_bridge = m0 - m1, (o0 - o1) / GB, ((b0 or 0) - (b1 or 0)) / GB
print(f"re-gather saving: measured {saving_measured:.2f} GB, ours {saving_ours:.2f} GB "
      f"({100 * (saving_ours - saving_measured) / saving_measured:+.0f}%), Bridge {saving_bridge:.2f} GB "
      f"({100 * (saving_bridge - saving_measured) / saving_measured:+.0f}%)")
print(f"worst peak error: {max(ours_err):.1f}% (Bridge estimator: {max(bridge_err):.1f}%)")
