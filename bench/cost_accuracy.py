"""The cost model (memory/cost/) against every measured throughput effect in shared/reference/.

Usage: .venv/bin/python bench/cost_accuracy.py            (imports Megatron Bridge: ~30 s, then ~1 min of builds)

Each row is a table line of NVIDIA's skill texts (nvidia-skills/*.SKILL.md and *.card.yaml), written below as
data with its source line and the job's configuration as the table states it, rebuilt from Bridge's own recipe
for that job, the table's stated changes applied as overrides (nothing else changed). Its measured effect is the
step-time change against the table's own baseline row, in percent of the baseline's step time: from throughput
(TFLOP/s per GPU counts the same model FLOPs for every row of a table, Bridge's training/utils/flop_utils.py
counts no recompute, so step time is inversely proportional to it) or from the iteration times the table gives.
The model's prediction is memory/cost's price(baseline, row): a range (its overlap assumptions' best and worst,
the efficiency range of memory/cost/gpus.py EFFICIENCY, and the two parts a compute capability covers). Nothing
is fitted to a row: the model has no constant a row could tune; every one is in memory/cost/gpus.py with its
source.

It prints per row the measured change, the predicted range and its middle, the error (0 inside the range, else
the distance to its nearer end, in percentage points of step time) and the middle's error, beside the baseline's
step time as the table gives it and as the model has it; per table whether each pair of alternatives (the
baseline included, at 0) is ordered as measured by what the ladder, --search and the doctor rank by (memory/cost/
rank_key: the high end of the range, then its low end; pairs whose measured difference is within the table's own
resolution, such as two "~" figures, count as agreeing whatever the model says, and are marked); then the effects
the model's mechanisms do not hold, named; and a last line:
    cost: N rows, rank order K/M pairs, median |error| E pp, worst W pp (row)
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass

from mbmem_overlays.bridge.overrides import apply_overrides
from mbmem_overlays.bridge.recipes import build_recipe
from mbmem_overlays.bridge.stack import prepare
from mbmem_overlays.core.engine import apply_overlay
from mbmem_overlays.memory import cost as C

REF = "shared/reference/nvidia-skills/"
LLAMA70 = "megatron.bridge.perf_recipes.llama.h100.llama3.llama3_70b_sft_32gpu_h100_fp8cs_config"
MOON = "moonlight_16b_pretrain_8gpu_h100_bf16_config"
MOON_SET = ["model.tensor_model_parallel_size=2", "model.pipeline_model_parallel_size=1",
            "model.expert_model_parallel_size=8", "model.seq_length=4096", "dataset.seq_length=4096",
            "train.micro_batch_size=1", "train.global_batch_size=4"]
NANO = "megatron.bridge.perf_recipes.nemotronh.h100.nemotronh.nemotron_3_nano_pretrain_16gpu_h100_bf16_config"
QWEN30 = "qwen3_30b_a3b_pretrain_config"
QWEN30_SET = ["model.tensor_model_parallel_size=2", "model.pipeline_model_parallel_size=2",
              "model.expert_model_parallel_size=4", "model.sequence_parallel=true", "train.global_batch_size=8",
              "train.micro_batch_size=1"]
QWEN8 = "qwen3_8b_peft_config"
QWEN8_SET = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true", "model.seq_length=8192",
             "dataset.seq_length=8192", "peft.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]",
             "peft.dim=32", "peft.alpha=32"]


def modules(*names: str) -> list[str]:
    if not names:
        return ["model.recompute_granularity=selective", "model.recompute_modules=[]"]
    return ["model.recompute_granularity=selective", f"model.recompute_modules=[{','.join(names)}]"]


def offload(fraction: float, overlap: bool = False) -> list[str]:
    return ["optimizer.optimizer_cpu_offload=true", f"optimizer.optimizer_offload_fraction={fraction}",
            f"optimizer.overlap_cpu_optimizer_d2h_h2d={str(overlap).lower()}"]


def slower(base_tflops: float, tflops: float) -> float:
    """Step-time change in % from throughput at the same model FLOPs."""
    return 100.0 * (base_tflops / tflops - 1.0)


def longer(base_ms: float, ms: float) -> float:
    return 100.0 * (ms / base_ms - 1.0)


@dataclass(frozen=True)
class Job:
    recipe: str
    sets: tuple[str, ...] = ()
    overlays: tuple[str, ...] = ()
    params: tuple[tuple[str, tuple[tuple[str, object], ...]], ...] = ()
    world: int = 8


@dataclass(frozen=True)
class Row:
    table: str
    label: str
    job: Job
    measured: float           # step-time change, % of the table's baseline
    source: str               # file and the line it was read from
    resolution: float = 0.0   # the table's own precision for this row's figure (pp): "~" figures
    # what the model's mechanisms leave out where this row is outside its range (read from the code path; no
    # constant is moved to close it)
    missing: str = ""


@dataclass(frozen=True)
class Table:
    name: str
    source: str
    baseline: Job
    baseline_label: str
    rows: tuple[Row, ...]
    # what the table says of the baseline's own step: ("tflops", TFLOP/s per GPU) or ("ms", iteration time); the
    # bench prints the model's step time beside it (a check of the model's scale, not an input)
    measured_step: tuple[str, float] | None = None


LLAMA_BASE = Job(LLAMA70, tuple(modules("core_attn")), world=32)
LLAMA = "Llama3-70B SFT FP8-CS, 32 H100, TP4 PP4 VPP5 DP2, GBS32 MBS1 seq 4096"
TABLES = (
    Table("memory-tuning: parallelism changes", f"{REF}nemo-mbridge-perf-memory-tuning.SKILL.md, Measured Results, "
          "'Strategy comparison: parallelism changes for memory reduction'; card measured_results more_pp/more_tp",
          LLAMA_BASE, f"{LLAMA} (core_attn) ~704 TFLOP/s/GPU", (
              Row("parallelism", "More PP: TP4 PP8 VPP5 DP1 (668.0)",
                  Job(LLAMA70, tuple(modules("core_attn") + ["model.pipeline_model_parallel_size=8"]), world=32),
                  slower(704, 668.0), "memory-tuning SKILL.md table row 'More PP | 4 | 8 | 5 | 1 | 668.0 | -5.9%'",
                  resolution=0.5,
                  missing="the model's step grows with the last stage's output layer (a BF16 GEMM, models/gpt/"
                          "gpt_model.py, timed at half the FP8 layers' rate): 10 layers + the output layer at PP8 "
                          "against 20 at PP4. The measured run gives that imbalance less weight: FP8 GEMMs reaching "
                          "less than twice the BF16 rate would (one efficiency for both is the model's assumption)"),
              Row("parallelism", "More TP: TP8 PP4 VPP5 DP1 (508.7)",
                  Job(LLAMA70, tuple(modules("core_attn") + ["model.tensor_model_parallel_size=8"]), world=32),
                  slower(704, 508.7), "memory-tuning SKILL.md table row 'More TP | 8 | 4 | 5 | 1 | 508.7 | -28.4%'",
                  resolution=0.5,
                  missing="the TP collectives' bytes (165 GB/step more on NVLink) at the link's stated 450 GB/s "
                          "are +12% even fully exposed; missing: NCCL/userbuffer bandwidth below the stated peak, "
                          "GEMM efficiency at TP8's per-rank shapes and TE's comm-overlap GEMM splits "
                          "(tp_comm_overlap splits each AG/RS GEMM into tp chunks)"),
              Row("parallelism", "Baseline + expandable_segments (~704)",
                  Job(LLAMA70, tuple(modules("core_attn")), ("expandable_segments",), world=32), 0.0,
                  "memory-tuning SKILL.md table row 'Baseline + expandable_segments | 4 | 4 | 5 | 2 | ~704 | -0.8%'",
                  resolution=0.5),
          ), ("tflops", 704.0)),
    Table("activation recompute: Llama3-70B (PR #3107)", f"{REF}nemo-mbridge-perf-activation-recompute.SKILL.md, "
          "'Historical Measurement: Context, Not a Module Ranking'", LLAMA_BASE,
          f"{LLAMA}: `core_attn` baseline ~704", (
              Row("recompute-llama", "mlp (593.6)", Job(LLAMA70, tuple(modules("mlp")), world=32),
                  slower(704, 593.6), "activation-recompute SKILL.md '| `mlp` | 593.6 | 55.6 GB |'", resolution=0.3),
              Row("recompute-llama", "mlp + core_attn (586.8)", Job(LLAMA70, tuple(modules("mlp", "core_attn")),
                                                                     world=32),
                  slower(704, 586.8), "activation-recompute SKILL.md '| `mlp` + `core_attn` | 586.8 | 55.6 GB |'",
                  resolution=0.3),
              Row("recompute-llama", "core_attn + layernorm (~702)",
                  Job(LLAMA70, tuple(modules("core_attn", "layernorm")), world=32), slower(704, 702),
                  "activation-recompute SKILL.md '| `core_attn` + `layernorm` | ~702 | 59.6 GB (OOM on rank 0) |'",
                  resolution=0.5),
          ), ("tflops", 704.0)),
    Table("activation recompute: Moonlight-16B (matched, [] control)", f"{REF}nemo-mbridge-perf-activation-recompute"
          ".card.yaml, training_dimensions.speed.rationale", Job(MOON, tuple(MOON_SET + modules()), world=8),
          "Moonlight-16B BF16, 8 H100, TP2 EP8 PP1, seq 4096 MBS1 GBS4, recompute_modules=[]", (
              Row("recompute-moonlight", "moe_act (+1.99%)", Job(MOON, tuple(MOON_SET + modules("moe_act")), world=8),
                  1.99, "activation-recompute card.yaml 'The matched Moonlight run found 1.99% overhead for moe_act'",
                  missing="moe_act replays one elementwise kernel per layer (moe/experts.py:882-893): its bytes at "
                          "the stated HBM peak are 0.6%; missing: achieved HBM bandwidth and per-kernel launch time "
                          "in a one-microbatch step (GBS 4 on DP 4)"),
              Row("recompute-moonlight", "mla_up_proj (+5.19%)",
                  Job(MOON, tuple(MOON_SET + modules("mla_up_proj")), world=8), 5.19,
                  "activation-recompute card.yaml '5.19% for mla_up_proj'",
                  missing="the replayed q/kv up-projections are small GEMMs (kv_lora_rank 512 -> 16 heads x 256, "
                          "per TP rank): missing: GEMM efficiency at small shapes (one efficiency for all GEMMs), "
                          "and the RoPE/concatenation kernels' launch time"),
          )),
    Table("activation recompute: Nemotron 3 Nano (matched)", f"{REF}nemo-mbridge-perf-activation-recompute.card.yaml, "
          "training_dimensions.speed.rationale", Job(NANO, tuple(["train.global_batch_size=16"] + modules("moe")),
                                                     world=16),
          "Nemotron 3 Nano BF16 perf recipe, 16 H100, GBS16, recompute_modules=[moe]", (
              Row("recompute-nano", "moe, layernorm (+3.07%)",
                  Job(NANO, tuple(["train.global_batch_size=16"] + modules("moe", "layernorm")), world=16), 3.07,
                  "activation-recompute card.yaml 'adding layernorm cost 3.07% more step time'",
                  missing="only the MoE layers' pre-MLP norms are separate modules here (transformer_layer.py "
                          ":450-512; attention's is fused, Mamba's is in_proj's): one RMSNorm over 2688 per token "
                          "is 0.1%; nothing in the code path read explains 3% (the norm's recompute is a gradient "
                          "hook on the MoE output, :977-981; its effect on the hybridep dispatcher's overlap is not "
                          "modelled)"),
          )),
    Table("optimizer CPU offload: Qwen3-30B-A3B", f"{REF}nemo-mbridge-perf-cpu-offloading.card.yaml, measured_results",
          Job(QWEN30, tuple(QWEN30_SET), world=16),
          "Qwen3-30B-A3B pretrain, 16 H100 (2 nodes), TP2 PP2 EP4, GBS8 MBS1: 996 ms", tuple(
              Row("optimizer-offload", f"offload {int(f * 100)}%{' + D2H/H2D overlap' if ov else ''} ({ms} ms)",
                  Job(QWEN30, tuple(QWEN30_SET + offload(f, ov)), world=16), longer(996, ms),
                  f"cpu-offloading card.yaml measured_results config optimizer_offload_{int(f * 100)}pct"
                  f"{'_overlap' if ov else ''} iter_ms: {ms}")
              for f, ov, ms in ((0.25, False, 1871), (0.5, False, 2484), (0.75, False, 3187), (1.0, False, 4189),
                                (1.0, True, 3877))), ("ms", 996.0)),
    Table("LoRA + SP input re-gather: Qwen3-8B", f"{REF}nemo-mbridge-perf-memory-tuning.SKILL.md, 'LoRA + SP input "
          "re-gather' (card: lora_sequence_parallel_input_regather)", Job(QWEN8, tuple(QWEN8_SET), world=2),
          "Qwen3-8B LoRA (all four linears, dim 32: the measured saving shows both column-parallel surfaces), 2 H100, "
          "TP2 SP, seq 8192", (
              Row("lora-regather", "input re-gather (-6.74% throughput)",
                  Job(QWEN8, tuple(QWEN8_SET), ("lora_sp_regather",), (("lora_sp_regather", (("strict", False),)),),
                      world=2),
                  100.0 * (1 / (1 - 0.0674) - 1),
                  "memory-tuning SKILL.md '| Qwen3-8B, TP2, seq 8192 | 47.545 GB | 42.814 GB | 4.731 GB (10.0%) | "
                  "-6.74% |'",
                  missing="three collectives per eligible target (forward all-gather, backward all-gather and "
                          "reduce-scatter, tensor_parallel/layers.py:566-650) at NVLink's stated peak are +4%; "
                          "missing: NCCL bandwidth below the peak between two GPUs"),
          )),
)

# Measured throughput effects in the reference that the model's mechanisms do not hold, and what is missing.
NOT_MODELLED = (
    ("optimizer CPU offload: the step's scale", f"{REF}nemo-mbridge-perf-cpu-offloading.card.yaml measured_results",
     "the rows agree in percent while both times are about 4x short: the model's baseline step is 0.23-0.30 s "
     "against 996 ms (missing: host launch time; the CUDA-graph card shows the same TP2 PP2 EP4 layout launch-bound, "
     "eager 623 ms -> 484 ms graphed), and its CPU Adam at the host's DRAM bandwidth shared by 8 GPUs adds 0.2 s per "
     "25% against 0.875 s (missing: the CPU step's real rate; one candidate is that torch.distributed.run sets "
     "OMP_NUM_THREADS=1 for every rank, torch/distributed/run.py:980-992, so torch's fused CPU AdamW runs on one "
     "core, for which the model has no figure): the agreement in percent is not evidence for the CPU term"),
    ("CUDA graphs, Qwen3-30B-A3B TP2 PP2 EP4 (623 -> 484 ms, -22%)", f"{REF}nemo-mbridge-perf-cuda-graphs.card.yaml "
     "measured_results", "host launch time: the model has no CPU-side kernel-launch cost (the card: gains 'when the "
     "eager baseline is launch-bound'); CUDA graphs are not a memory saving any of our tools proposes"),
    ("CUDA graphs, GPT-OSS-20B TP2 PP4 EP4 (467-520 -> 391-399 ms)", f"{REF}nemo-mbridge-perf-cuda-graphs.card.yaml "
     "measured_results", "the same: host launch time"),
    ("CUDA graphs, Qwen3-30B-A3B H100 alltoall (41.36 s eager -> 42.00 s replay)", f"{REF}nemo-mbridge-perf-cuda-"
     "graphs.SKILL.md, Pitfalls 13", "the same: host launch time (and replay overhead)"),
    ("optimizer offload D2H/H2D overlap '~7%' at 100%", f"{REF}nemo-mbridge-perf-cpu-offloading.SKILL.md, Known "
     "Limitations", "priced: the row 'offload 100% + D2H/H2D overlap' above"),
    ("LoRA re-gather '0.34-6.74%' over workloads", f"{REF}nemo-mbridge-perf-memory-tuning.card.yaml "
     "training_dimensions.speed", "the other two (MoE) rows are withheld in this copy; the Qwen3-8B row is priced"),
)


def build(job: Job):
    """(the cost model's job, the step FLOPs Bridge's throughput figure counts) of a row's configuration."""
    from megatron.bridge.training.utils.flop_utils import num_floating_point_operations
    cfg = build_recipe(job.recipe)
    apply_overrides(cfg, list(job.sets))
    if job.overlays:
        params = {name: dict(p) for name, p in job.params}
        apply_overlay(cfg, list(job.overlays), env={}, params=params or None, world_size=job.world)
    try:
        flops = float(num_floating_point_operations(cfg, cfg.train.global_batch_size))
    except Exception:  # noqa: BLE001 — only for the scale check
        flops = None
    return C.job_of(cfg, job.world, arch=9), flops


def distance(measured: float, low: float, high: float) -> float:
    return 0.0 if low <= measured <= high else min(abs(measured - low), abs(measured - high))


def main() -> int:
    prepare()
    print(f"{'row':<46}{'measured':>9}{'predicted range':>19}{'middle':>8}{'err':>7}{'mid err':>8}  "
          "parts (FLOPs %, bytes per link per step, bubble)")
    errors: list[tuple[float, str]] = []
    mids: list[float] = []
    agree = pairs = 0
    cache: dict[Job, tuple] = {}
    for table in TABLES:
        print(f"\n{table.name}  [{table.source}]")
        print(f"  baseline: {table.baseline_label}")
        if table.baseline not in cache:
            cache[table.baseline] = build(table.baseline)
        base, base_flops = cache[table.baseline]
        modelled = C.times(base, 9)
        low_s, high_s = min(t.seconds for t in modelled), max(t.seconds for t in modelled)
        if table.measured_step:
            kind, value = table.measured_step
            step = value / 1e3 if kind == "ms" else (base_flops or 0.0) / (value * 1e12 * table.baseline.world)
            print(f"  baseline step: measured {step:.3f} s ({value:g} {'ms' if kind == 'ms' else 'TFLOP/s/GPU'}), "
                  f"the model {low_s:.3f}-{high_s:.3f} s")
        else:
            print(f"  baseline step: not measured in the table; the model {low_s:.3f}-{high_s:.3f} s")
        predicted = []
        for row in table.rows:
            if row.job not in cache:
                cache[row.job] = build(row.job)
            job = cache[row.job][0]
            cost = C.price(base, job, 9)
            lo, hi = 100 * cost.low, 100 * cost.high
            mid = (lo + hi) / 2
            err = distance(row.measured, lo, hi)
            errors.append((err, row.label))
            mids.append(abs(mid - row.measured))
            predicted.append((row.label, row.measured, cost.key, row.resolution))
            print(f"  {row.label:<44}{row.measured:>+8.2f}%{lo:>+9.2f} ..{hi:>+7.2f}%{mid:>+7.2f}%{err:>6.2f}{abs(mid - row.measured):>8.2f}"
                  f"  {cost.text}")
            print(f"    source: {row.source}")
            if err > 0.5 and row.missing:
                print(f"    missing: {row.missing}")
            added = ""
            if table.measured_step and table.measured_step[0] == "ms":
                base_ms = table.measured_step[1]
                ends = sorted(1e3 * (a - b) for a, b in zip(cost.seconds_after, cost.seconds_before))
                added = (f"; added time: measured {base_ms * row.measured / 100:.0f} ms, the model "
                         f"{ends[0]:.0f}-{ends[1]:.0f} ms")
            print(f"    step before {cost.seconds_before[0]:.3f}-{cost.seconds_before[1]:.3f} s, after "
                  f"{cost.seconds_after[0]:.3f}-{cost.seconds_after[1]:.3f} s{added}; by mechanism (s): "
                  + ", ".join(f"{k} {a:+.3f}..{b:+.3f}" for k, a, b in cost.parts))
        # every pair of alternatives in the table, the baseline included at 0, ordered by what the tools rank by
        # (memory/cost/ rank_key: the high end of the range, then the low end)
        items = [("baseline", 0.0, (0.0, 0.0), 0.0)] + predicted
        table_agree = table_pairs = 0
        notes = []
        for i in range(len(items)):
            for j in range(i + 1, len(items)):
                a, b = items[i], items[j]
                measured = b[1] - a[1]
                model = 100 * (b[2][0] - a[2][0]) if b[2][0] != a[2][0] else 100 * (b[2][1] - a[2][1])
                tie = abs(measured) <= max(a[3], b[3])
                ok = tie or (measured > 0) == (model > 0)
                table_pairs += 1
                table_agree += ok
                if not ok or tie:
                    notes.append(f"{a[0]} vs {b[0]}: measured {measured:+.2f}, model (high end) {model:+.2f}"
                                 + (" (within the table's resolution)" if tie else " DISAGREE"))
        agree += table_agree
        pairs += table_pairs
        print(f"  rank order: {table_agree}/{table_pairs} pairs as measured" + ("; " + "; ".join(notes) if notes else ""))
    print("\nmeasured effects the mechanisms do not hold (not priced, not counted above):")
    for label, source, missing in NOT_MODELLED:
        print(f"  - {label} [{source}]: {missing}")
    errs = [e for e, _ in errors]
    worst, worst_row = max(errors)
    print(f"middle of the range: median |error| {statistics.median(mids):.2f} pp, worst {max(mids):.2f} pp")
    print(f"cost: {len(errors)} rows, rank order {agree}/{pairs} pairs, median |error| {statistics.median(errs):.2f} pp, "
          f"worst {worst:.2f} pp ({worst_row})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
