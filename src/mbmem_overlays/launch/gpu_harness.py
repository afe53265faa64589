"""GPU smoke runs: record per-rank memory and step time in training, then judge each overlay.

The recorder is a Bridge training callback (``make_recorder``) that train.py installs when
``MBMEM_METRICS_DIR`` is set; it writes ``rank<N>.json`` at the end of training. Everything
else here is pure (parsing, comparing, deciding) so CI checks it on CPU with recorded samples.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS_ENV = "MBMEM_METRICS_DIR"
WARMUP_STEPS = 2  # first iterations include allocator growth, kernel autotuning and NCCL setup


def make_recorder(out_dir: str | os.PathLike):
    """A Bridge ``Callback`` that records CUDA memory peaks, step times and losses (imports Bridge and torch)."""
    import torch
    from megatron.bridge.training.callbacks import Callback

    class MemoryRecorder(Callback):
        def __init__(self):
            self.steps: list[dict[str, Any]] = []
            self.t0 = 0.0

        def on_train_start(self, context):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

        def on_train_step_start(self, context):
            torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_train_step_end(self, context):
            torch.cuda.synchronize()
            losses = {k: float(v.mean()) if hasattr(v, "mean") else float(v) for k, v in (context.loss_dict or {}).items()}
            self.steps.append({"step_time_s": time.perf_counter() - self.t0, "losses": losses,
                               "max_allocated": torch.cuda.max_memory_allocated(),
                               "max_reserved": torch.cuda.max_memory_reserved(),
                               "allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()})

        def on_train_end(self, context):
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            record = {"rank": rank, "world_size": int(os.environ.get("WORLD_SIZE", "1")),
                      "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                      "peak_allocated": torch.cuda.max_memory_allocated(),
                      "peak_reserved": torch.cuda.max_memory_reserved(), "steps": self.steps}
            path = Path(out_dir)
            path.mkdir(parents=True, exist_ok=True)
            (path / f"rank{rank}.json").write_text(json.dumps(record, indent=1))

    return MemoryRecorder()


# ----------------------------------------------------------------------------- pure part
@dataclass(frozen=True)
class RankMetrics:
    rank: int
    peak_allocated: int
    peak_reserved: int
    step_times: tuple[float, ...]
    losses: tuple[float, ...]
    alloc_conf: str = ""

    @property
    def steady_step_time(self) -> float | None:
        steady = self.step_times[WARMUP_STEPS:] or self.step_times
        return statistics.median(steady) if steady else None

    @property
    def reserved_gap(self) -> int:
        return self.peak_reserved - self.peak_allocated


@dataclass(frozen=True)
class RunMetrics:
    name: str
    ranks: dict[int, RankMetrics] = field(default_factory=dict)

    @property
    def peak_allocated(self) -> int:
        return max(r.peak_allocated for r in self.ranks.values())

    @property
    def peak_reserved(self) -> int:
        return max(r.peak_reserved for r in self.ranks.values())

    @property
    def reserved_gap(self) -> int:
        return max(r.reserved_gap for r in self.ranks.values())

    @property
    def step_time(self) -> float | None:
        times = [r.steady_step_time for r in self.ranks.values() if r.steady_step_time is not None]
        return max(times) if times else None

    @property
    def finite_loss(self) -> bool:
        losses = [x for r in self.ranks.values() for x in r.losses]
        return bool(losses) and all(math.isfinite(x) for x in losses)


class MetricsError(ValueError):
    pass


def load_run(directory: str | os.PathLike, name: str | None = None) -> RunMetrics:
    d = Path(directory)
    files = sorted(d.glob("rank*.json"))
    if not files:
        raise MetricsError(f"{d}: no rank*.json metrics; did training reach its end with {METRICS_ENV} set?")
    ranks: dict[int, RankMetrics] = {}
    for f in files:
        try:
            data = json.loads(f.read_text())
            steps = data["steps"]
            losses = tuple(v for s in steps for v in s.get("losses", {}).values())
            ranks[int(data["rank"])] = RankMetrics(int(data["rank"]), int(data["peak_allocated"]),
                                                   int(data["peak_reserved"]),
                                                   tuple(float(s["step_time_s"]) for s in steps), losses,
                                                   data.get("alloc_conf", ""))
        except (KeyError, ValueError, TypeError) as exc:
            raise MetricsError(f"{f}: not a metrics record ({type(exc).__name__}: {exc})") from None
    expected = json.loads(files[0].read_text()).get("world_size", len(files))
    if len(ranks) != expected:
        raise MetricsError(f"{d}: {len(ranks)} of {expected} ranks wrote metrics; a rank died before the end")
    return RunMetrics(name or d.name, ranks)


@dataclass(frozen=True)
class Expectation:
    what: str            # "lower_allocated" | "allocator_setting"
    min_gpus: int = 1
    needs_te: bool = False
    min_saving: float = 0.02  # a saving smaller than this fraction of the baseline peak is noise
    note: str = ""


# What each overlay must show against the baseline (issue: GPU smoke tests).
EXPECTATIONS = {
    "selective_recompute": Expectation("lower_allocated", note="modules=[core_attn,mlp] on the tiny model"),
    "full_recompute": Expectation("lower_allocated"),
    "cpu_offload": Expectation("lower_allocated", needs_te=True, note="megatron-core asserts TE for CPU offloading"),
    "lora_sp_regather": Expectation("lower_allocated", min_gpus=2, min_saving=0.005, note="TP=2 with SP, LoRA recipe"),
    "dist_optimizer": Expectation("lower_allocated", min_gpus=2, note="DP=2: optimizer state is sharded"),
    "expandable_segments": Expectation("allocator_setting", note="visible to the process; smaller reserved-allocated gap"),
}


@dataclass(frozen=True)
class Verdict:
    overlay: str
    passed: bool
    reasons: tuple[str, ...]
    peak_allocated_ratio: float | None = None
    step_time_ratio: float | None = None


def judge(overlay: str, baseline: RunMetrics, candidate: RunMetrics) -> Verdict:
    exp = EXPECTATIONS[overlay]
    reasons: list[str] = []
    ok = True
    for run in (baseline, candidate):
        if not run.finite_loss:
            ok = False
            reasons.append(f"{run.name}: loss is missing or not finite")
    ratio = candidate.peak_allocated / baseline.peak_allocated if baseline.peak_allocated else None
    st = (candidate.step_time / baseline.step_time) if candidate.step_time and baseline.step_time else None
    if exp.what == "lower_allocated":
        if ratio is None or ratio > 1 - exp.min_saving:
            ok = False
            reasons.append(f"peak allocated {candidate.peak_allocated / 2**20:.0f} MiB vs baseline "
                           f"{baseline.peak_allocated / 2**20:.0f} MiB: not lower by >= {exp.min_saving:.1%}")
        else:
            reasons.append(f"peak allocated x{ratio:.3f} of baseline")
    elif exp.what == "allocator_setting":
        seen = all("expandable_segments:True" in r.alloc_conf.split(",") for r in candidate.ranks.values())
        if not seen:
            ok = False
            reasons.append("expandable_segments:True was not in the training process's PYTORCH_CUDA_ALLOC_CONF")
        if candidate.reserved_gap >= baseline.reserved_gap:
            ok = False
            reasons.append(f"reserved-allocated gap {candidate.reserved_gap / 2**20:.0f} MiB not below baseline "
                           f"{baseline.reserved_gap / 2**20:.0f} MiB")
        else:
            reasons.append(f"reserved-allocated gap {baseline.reserved_gap / 2**20:.0f} -> {candidate.reserved_gap / 2**20:.0f} MiB")
    if st is not None:
        reasons.append(f"step time x{st:.2f} of baseline")
    return Verdict(overlay, ok, tuple(reasons), ratio, st)
