"""One GPU, about two minutes: each single-GPU overlay's measured peak allocated / reserved memory and step time,
beside the baseline and beside the memory plan's prediction for the same tiny configuration (one table, text and
JSON).

Usage: python bench/gpu_overlays.py [--json FILE] [--text FILE] [--steps 8] [--dry-run]
  --dry-run: build, apply and validate every case and compute the predictions on a CPU host; measure nothing.

How (no Transformer Engine needed): the parent builds the tiny recipe (recipes/recipe/tiny_llama.yaml, reshaped by
BENCH_SETS) the way the GPU runner does (launch/gpu_harness.build_job: Bridge's TE-free layer spec, TE_FREE, every
overlay through apply_overlay with Bridge's validation), finalizes a copy with Bridge's runtime_config_update (mixed
precision, derived fields) and predicts each case with the memory plan (memory/steps.build_plan, as `mbmem plan`).
Each case then trains in its own process (the allocator reads PYTORCH_CUDA_ALLOC_CONF once) at the megatron-core
level: a GPTModel with the *local* layer spec, built from the finalized TransformerConfig fields, wrapped as Bridge
wraps it (Float16Module, megatron-core DistributedDataParallel), stepped by megatron-core's own optimizer
(get_megatron_optimizer: the distributed optimizer with fp32 master weights; torch AdamW underneath without TE or
apex) and forward_backward_no_pipelining. Every row says which path produced it ("mcore-local").

What this path cannot show (docs/gpu-check.md): TE's fused/flash attention (the local spec keeps the s x s
attention scores, so core_attn recompute saves far more here than with TE), cpu_offload (megatron-core asserts TE),
and the multi-GPU overlays (dist_optimizer, sequence_parallel, lora_sp_regather need >= 2 GPUs).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import enum
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

PATH = "mcore-local"
WARMUP = 2
CHILD_TIMEOUT_S = 150
# The tiny recipe reshaped so a step is long enough to time and activations dominate the peak (H200: ~10 GiB).
BENCH_SETS = (
    "model.num_layers=4", "model.hidden_size=1024", "model.ffn_hidden_size=3584", "model.num_attention_heads=16",
    "model.num_query_groups=4", "model.kv_channels=64", "model.seq_length=2048", "dataset.seq_length=2048",
    "model.vocab_size=32000",          # the NullTokenizer's: Bridge uses it (use_tokenizer_vocab_size), so must the plan
    "train.micro_batch_size=2", "train.global_batch_size=4",   # two microbatches: gradient accumulation is exercised
    "ddp.overlap_grad_reduce=false", "ddp.overlap_param_gather=false",  # one GPU: nothing to overlap; same buffers
)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str                               # row label
    overlays: tuple[str, ...] = ()
    params: tuple[tuple[str, str, object], ...] = ()   # (overlay, param, value)
    skip: str | None = None                 # why this overlay is not measured on one GPU without TE

    def params_dict(self) -> dict:
        out: dict = {}
        for overlay, param, value in self.params:
            out.setdefault(overlay, {})[param] = value
        return out


def cases(snapshot_dir: str) -> list[Case]:
    """Baseline, then every catalogue overlay with a memory claim (gpu_harness.EXPECTATIONS): measured when one GPU
    without TE can show it, else listed with the reason."""
    from mbmem_overlays.launch.gpu_harness import EXPECTATIONS
    out = [Case("baseline"),
           Case("selective_recompute[core_attn]", ("selective_recompute",),
                (("selective_recompute", "modules", ["core_attn"]),)),
           Case("selective_recompute[mlp]", ("selective_recompute",), (("selective_recompute", "modules", ["mlp"]),))]
    for name, exp in EXPECTATIONS.items():
        if name == "selective_recompute":
            continue
        skip = (f"needs >= {exp.min_gpus} GPUs ({exp.note})" if exp.min_gpus > 1 else
                f"needs Transformer Engine ({exp.note})" if exp.needs_te else None)
        params = tuple((name, k, v) for k, v in exp.params)
        if name == "memory_snapshot":
            params += ((name, "path", os.path.join(snapshot_dir, "bench_snapshot.pickle")),)
        out.append(Case(name, (name,), params, skip))
    return out


# ----------------------------------------------------------------------------- the parent (imports Bridge)
def _encode(value):
    """A config value as JSON for the child, or KeyError when it cannot travel (then the child keeps the default)."""
    import torch
    if value is None:
        raise KeyError("None")  # unset in Bridge; megatron-core's own default stands
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, enum.Enum):
        return {"__enum__": [type(value).__module__, type(value).__qualname__, value.name]}
    if isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float, str)) for v in value):
        return list(value)
    if callable(value) and "<" not in getattr(value, "__qualname__", "<"):
        return {"__callable__": [value.__module__, value.__qualname__]}
    raise KeyError(type(value).__name__)


def mcore_fields(obj, cls) -> tuple[dict, list[str]]:
    """The fields of megatron-core dataclass ``cls`` that ``obj`` (Bridge's subclass instance) sets away from
    ``cls``'s defaults, encoded; and the names that could not travel."""
    out, dropped = {}, []
    for f in dataclasses.fields(cls):
        if not f.init or not hasattr(obj, f.name):
            continue
        value = getattr(obj, f.name)
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        try:
            if default is not dataclasses.MISSING and value == default:
                continue
        except Exception:  # noqa: BLE001 — tensors and the like do not compare to a bool
            pass
        try:
            out[f.name] = _encode(value)
        except KeyError as why:
            if str(why).strip("'") != "None":
                dropped.append(f"{f.name} ({str(why).strip(chr(39))})")
    return out, dropped


def child_spec(cfg, report, steps: int) -> dict:
    """What a child needs to train ``cfg`` at the megatron-core level: the finalized config's megatron-core fields."""
    from megatron.bridge.training.config import runtime_config_update
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig
    work = copy.deepcopy(cfg)
    saved = dict(os.environ)
    try:
        runtime_config_update(work)  # mixed precision, derived fields; it also writes cfg.env_vars into os.environ
    finally:
        os.environ.clear()
        os.environ.update(saved)
    m = work.model
    model, dropped_m = mcore_fields(m, TransformerConfig)
    optimizer, dropped_o = mcore_fields(work.optimizer, OptimizerConfig)
    ddp, dropped_d = mcore_fields(work.ddp, DistributedDataParallelConfig)
    div = int(m.make_vocab_size_divisible_by) * int(m.tensor_model_parallel_size)
    vocab = -(-int(m.vocab_size) // div) * div
    profiling = getattr(work, "profiling", None)
    return {"model": model, "optimizer": optimizer, "ddp": ddp,
            "gpt": {"vocab": vocab, "seq": int(m.seq_length), "share": bool(m.share_embeddings_and_output_weights),
                    "position_embedding_type": m.position_embedding_type, "rotary_base": float(m.rotary_base),
                    "rotary_percent": float(m.rotary_percent), "parallel_output": bool(m.parallel_output),
                    "rope_scaling": bool(getattr(m, "rope_scaling", False)),
                    "rope_scaling_factor": float(getattr(m, "rope_scaling_factor", 8.0)),
                    "fp16_lm_cross_entropy": bool(m.fp16_lm_cross_entropy),
                    "seq_len_interpolation_factor": m.seq_len_interpolation_factor},
            "train": {"mbs": int(work.train.micro_batch_size), "gbs": int(work.train.global_batch_size),
                      "steps": steps, "seed": int(work.rng.seed)},
            "record_memory_history": bool(getattr(profiling, "record_memory_history", False)),
            "env": dict(report.env_to_export), "not_carried": dropped_m + dropped_o + dropped_d}


def plan_cases(steps: int, snapshot_dir: str) -> list[dict]:
    """Every case built, applied, validated and predicted (CPU is enough)."""
    from mbmem_overlays.launch.gpu_harness import Job, build_job, job_config
    from mbmem_overlays.memory.steps import build_plan
    base_cfg, locked = job_config(Job(sets=BENCH_SETS))  # the plan starts here, as `mbmem plan` does
    rows = []
    for case in cases(snapshot_dir):
        row = {"name": case.name, "overlays": list(case.overlays), "params": case.params_dict(), "path": PATH}
        if case.skip:
            rows.append(row | {"skipped": case.skip})
            continue
        try:
            cfg, report = build_job(Job(overlays=case.overlays, params=case.params_dict(), sets=BENCH_SETS), 1)
            plan = build_plan(base_cfg, list(case.overlays), world=1, recipe="tiny_llama", params=case.params_dict(),
                              locked=locked)
            predicted = plan.steps[-1].breakdown
            row |= {"spec": child_spec(cfg, report, steps),
                    "changes": [f"{c.target}: {c.old!r} -> {c.new!r}" for c in report.changes],
                    "predicted_bytes": int(predicted.total),
                    "predicted": {k: int(v) for k, v in predicted.as_dict().items()},
                    "predicted_baseline_bytes": int(plan.steps[0].breakdown.total)}
        except Exception as exc:  # noqa: BLE001 — one case's failure is that row's result, not the bench's end
            row |= {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"}
        rows.append(row)
    return rows


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(row: dict, work: Path) -> dict:
    """Train one case in a fresh process; the row gains the measurement or the child's error."""
    spec_file = work / f"{row['name'].replace('[', '_').replace(']', '')}.json"
    spec_file.write_text(json.dumps(row["spec"]))
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}  # the allocator's default...
    env |= row["spec"]["env"]                                                       # ...unless the case sets it
    env |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
            "LOCAL_RANK": "0", "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", str(spec_file)], env=env, capture_output=True,
                              text=True, timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return row | {"error": f"timed out after {CHILD_TIMEOUT_S} s"}
    (work / f"{spec_file.stem}.log").write_text(proc.stdout + proc.stderr)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("BENCH_RESULT ")]
    if proc.returncode or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return row | {"error": f"exit {proc.returncode}: {' | '.join(tail)[:600]}"}
    return row | {"measured": json.loads(lines[-1].removeprefix("BENCH_RESULT ")),
                  "wall_s": round(time.monotonic() - start, 1)}


def table(rows: list[dict]) -> str:
    base = next((r.get("measured") for r in rows if r["name"] == "baseline"), None) or {}
    base_pred = next((r.get("predicted_bytes") for r in rows if r["name"] == "baseline"), None)
    gi = 2 ** 30
    head = (f"{'case':<31}{'peak alloc':>11}{'x base':>7}{'reserved':>10}{'step s':>8}{'x base':>7}"
            f"{'plan':>9}{'x base':>7}  path")
    out = [head]
    for r in rows:
        if "skipped" in r:
            out.append(f"{r['name']:<31} skipped: {r['skipped']}")
            continue
        if "error" in r:
            out.append(f"{r['name']:<31} failed: {r['error']}")
            continue
        m, p = r.get("measured"), r.get("predicted_bytes")
        px = f"{p / base_pred:>7.2f}" if p and base_pred else f"{'-':>7}"
        if not m:
            out.append(f"{r['name']:<31}{'-':>11}{'-':>7}{'-':>10}{'-':>8}{'-':>7}{p / gi:>7.2f}Gi{px}  (not measured)")
            continue
        ax = m["peak_allocated"] / base["peak_allocated"] if base.get("peak_allocated") else float("nan")
        tx = m["step_time_s"] / base["step_time_s"] if base.get("step_time_s") else float("nan")
        out.append(f"{r['name']:<31}{m['peak_allocated'] / gi:>9.2f}Gi{ax:>7.2f}{m['peak_reserved'] / gi:>8.2f}Gi"
                   f"{m['step_time_s']:>8.3f}{tx:>7.2f}{p / gi:>7.2f}Gi{px}  {r['path']}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="write the rows (configuration, prediction, measurement) here")
    ap.add_argument("--text", help="write the table here too")
    ap.add_argument("--steps", type=int, default=8, help="training steps per case (median after 2 warm-ups)")
    ap.add_argument("--dry-run", action="store_true", help="build, validate and predict only (no GPU)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(json.loads(Path(args.child).read_text()))
    if args.steps < WARMUP + 1:
        ap.error(f"--steps must be at least {WARMUP + 1} (the first {WARMUP} are warm-ups)")
    if not args.dry_run:
        try:
            import torch
            if not torch.cuda.is_available():
                raise RuntimeError("torch sees no CUDA device")
        except Exception as exc:  # noqa: BLE001
            print(f"bench/gpu_overlays.py needs one CUDA GPU ({exc}); nothing measured (--dry-run plans only).")
            return 2
    os.environ.setdefault("MBMEM_QUIET", "1")
    with tempfile.TemporaryDirectory(prefix="mbmem-bench-") as tmp:
        work = Path(tmp)
        rows = plan_cases(args.steps, str(work))
        if args.dry_run:
            rows = construct_on_cpu(rows)
        else:
            rows = [measure(r, work) if "spec" in r else r for r in rows]
        text = table(rows)
        print(text)
        device = next((r["measured"]["device"] for r in rows if r.get("measured")), None)
        result = {"bench": "gpu_overlays", "path": PATH, "dry_run": args.dry_run, "steps": args.steps,
                  "warmup": WARMUP, "bench_sets": list(BENCH_SETS), "device": device,
                  "attention": "megatron-core DotProductAttention (local spec: unfused, keeps the s x s scores)",
                  "rows": rows}
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        if args.text:
            Path(args.text).write_text(text + "\n")
    failed = [r["name"] for r in rows if "error" in r]
    return 1 if failed else 0


def construct_on_cpu(rows: list[dict]) -> list[dict]:
    """The dry run's check that each case's megatron-core model builds from its fields (TransformerConfig's own
    checks, the local spec's modules: the torch norm's, the linear layers' and the softmax's assertions), on CPU:
    one layer, CPU initialization, a one-process gloo group. What needs CUDA (DDP buffers, the step) is not built."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.models.gpt import GPTModel
    started = not torch.distributed.is_initialized()
    if started:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
    try:
        out = []
        for row in rows:
            if "spec" not in row:
                out.append(row)
                continue
            fields = {k: _decode(v) for k, v in row["spec"]["model"].items()} | {"num_layers": 1,
                                                                                  "use_cpu_initialization": True}
            g = row["spec"]["gpt"]
            try:
                config = TransformerConfig(**fields)
                layer_spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, qk_layernorm=config.qk_layernorm,
                                                      moe_grouped_gemm=config.moe_grouped_gemm,
                                                      normalization=config.normalization)
                GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=g["vocab"],
                         max_sequence_length=g["seq"], position_embedding_type=g["position_embedding_type"],
                         rotary_base=g["rotary_base"], share_embeddings_and_output_weights=g["share"])
                out.append(row | {"built_on_cpu": True})
            except Exception as exc:  # noqa: BLE001 — the case's own failure, reported in its row
                out.append(row | {"error": f"model does not build: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"})
        return out
    finally:
        if started:
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()


# ----------------------------------------------------------------------------- the child (one case, one GPU)
def _decode(value):
    import importlib

    import torch
    if isinstance(value, dict) and "__dtype__" in value:
        return getattr(torch, value["__dtype__"])
    if isinstance(value, dict) and "__enum__" in value:
        module, qualname, name = value["__enum__"]
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        return cls[name]
    if isinstance(value, dict) and "__callable__" in value:
        module, qualname = value["__callable__"]
        obj = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj
    return value


def child(spec: dict) -> int:
    import torch
    if spec["record_memory_history"]:  # as Bridge's setup does before the model is built (train_utils.py:211)
        torch.cuda.memory._record_memory_history(True, trace_alloc_max_entries=100_000, trace_alloc_record_context=True)
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    torch.cuda.set_device(0)
    torch.distributed.init_process_group("nccl", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(spec["train"]["seed"])
    config = TransformerConfig(**{k: _decode(v) for k, v in spec["model"].items()})
    g, t = spec["gpt"], spec["train"]
    layer_spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm,
                                          qk_layernorm=config.qk_layernorm, normalization=config.normalization)
    gpt = GPTModel(config=config, transformer_layer_spec=layer_spec, vocab_size=g["vocab"], max_sequence_length=g["seq"],
                   pre_process=True, post_process=True, fp16_lm_cross_entropy=g["fp16_lm_cross_entropy"],
                   parallel_output=g["parallel_output"], share_embeddings_and_output_weights=g["share"],
                   position_embedding_type=g["position_embedding_type"], rotary_percent=g["rotary_percent"],
                   rotary_base=g["rotary_base"], rope_scaling=g["rope_scaling"],
                   rope_scaling_factor=g["rope_scaling_factor"], seq_len_interpolation_factor=g["seq_len_interpolation_factor"])
    gpt.cuda(torch.cuda.current_device())
    module = Float16Module(config, gpt) if (config.bf16 or config.fp16) else gpt
    ddp_config = DistributedDataParallelConfig(**{k: _decode(v) for k, v in spec["ddp"].items()})
    model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=module)
    optimizer = get_megatron_optimizer(OptimizerConfig(**{k: _decode(v) for k, v in spec["optimizer"].items()}), [model])
    # What Bridge's setup wires for the schedule (training/setup.py): grad accumulation, the grad reduction, loss scale
    config.no_sync_func = model.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    mbs, seq = t["mbs"], g["seq"]
    microbatches = max(1, t["gbs"] // mbs)
    gen = torch.Generator(device="cuda").manual_seed(t["seed"])
    tokens = torch.randint(0, g["vocab"], (mbs, seq + 1), device="cuda", generator=gen)
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(seq, device="cuda").unsqueeze(0).expand(mbs, seq).contiguous()

    def forward_step(data_iterator, model_chunk):
        output = model_chunk(inputs, positions, None, labels=labels)  # per-token losses [b, s]

        def loss_func(per_token):
            loss = per_token.float().mean()
            return loss, {"lm loss": loss.detach()}
        return output, loss_func

    fwd_bwd = get_forward_backward_func()
    torch.cuda.synchronize()
    after_setup = torch.cuda.memory_allocated()
    peaks, reserved_peaks, times, losses = [], [], [], []
    for _ in range(t["steps"]):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        out = fwd_bwd(forward_step_func=forward_step, data_iterator=None, model=[model], num_microbatches=microbatches,
                      seq_length=seq, micro_batch_size=mbs, forward_only=False)
        optimizer.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        peaks.append(torch.cuda.max_memory_allocated())
        reserved_peaks.append(torch.cuda.max_memory_reserved())
        losses.append(float(sum(float(x["lm loss"]) for x in out) / max(1, len(out))))
    steady = times[WARMUP:]
    stats = torch.cuda.memory_stats()
    print("BENCH_RESULT " + json.dumps({
        "peak_allocated": max(peaks), "peak_reserved": max(reserved_peaks),
        "steady_peak_allocated": max(peaks[WARMUP:]), "allocated_after_setup": after_setup,
        "allocated_between_steps": torch.cuda.memory_allocated(), "step_time_s": statistics.median(steady),
        "step_times_s": times, "losses": losses, "alloc_retries": int(stats.get("num_alloc_retries", 0)),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "microbatches": microbatches}), flush=True)
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
