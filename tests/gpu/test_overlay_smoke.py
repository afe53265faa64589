"""Per-overlay GPU smoke runs: real Bridge training of the tiny recipe against one baseline of the same recipe; each
overlay must train with finite loss and move memory the way it claims (gpu_harness.EXPECTATIONS).

Each run is launch/gpu_harness.py's runner under torchrun: the recipe built as train.py builds it, every overlay
through apply_overlay with Bridge's validation, Bridge's pretrain() with the memory recorder, and Bridge's TE-free
layer spec where Transformer Engine is missing (train.py cannot select a layer spec from its command line). The
runs start together: memory peaks are per process, so sharing the GPU does not move them; step times are reported,
not judged. Skipped with the reason where CUDA, TE or GPUs are missing.

lora_sp_regather needs a pre-trained model: the fixture first pre-trains the tiny recipe for PRETRAIN_ITERS steps and
saves it, then fine-tunes it with Bridge's LoRA at TP=2 + SP with and without the re-gather, and judges the measured
difference against the plan's (each run writes the plan's figure for its own configuration beside its metrics).

Run on a GPU node:  python -m pytest -m gpu tests/gpu -v -rs   (scripts/gpu_check runs it; docs/gpu-check.md)
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mbmem_overlays.launch.gpu_harness import EXPECTATIONS, MetricsError, judge, load_run

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.gpu
RUN_TIMEOUT_S = 170  # inside scripts/gpu_check's 200 s for this step, so the JUnit XML is written

PRETRAINED = "{pretrained}"  # replaced by the folder the pre-training run saved the tiny model into
BASE_SETS = {  # Bridge overrides for the overlay's run and its baseline alike
    "dist_optimizer": ("optimizer.use_distributed_optimizer=false", "ddp.use_distributed_optimizer=false"),
    "sequence_parallel": ("model.tensor_model_parallel_size=2",),
    "lora_sp_regather": ("model.tensor_model_parallel_size=2", "model.sequence_parallel=true",
                         f"checkpoint.pretrained_checkpoint={PRETRAINED}"),
}
NOT_IN_SMOKE_SET: dict[str, str] = {}  # overlays that need more than the runner can give (none since issue 31)
PRETRAIN_ITERS = 4
PRETRAIN_TIMEOUT_S = 60


def pretrain_args(folder: Path) -> list[str]:
    """The runner's arguments that pre-train the tiny recipe for PRETRAIN_ITERS steps and save it into ``folder``
    (Bridge's torch_dist format, which a TP=2 fine-tuning run reshards on load)."""
    return ["train", "--set", f"train.train_iters={PRETRAIN_ITERS}", "--set", f"checkpoint.save={folder}",
            "--set", f"checkpoint.save_interval={PRETRAIN_ITERS}", "--set", "checkpoint.ckpt_format=torch_dist"]


def _gpus() -> int:
    if importlib.util.find_spec("torch") is None:
        return 0
    import torch
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _skip_reason(overlay: str) -> str | None:
    exp = EXPECTATIONS[overlay]
    n = _gpus()
    if n == 0:
        return "CUDA is not available on this host (GPU smoke tests need a GPU node)"
    if n < exp.min_gpus:
        return f"{overlay} needs >= {exp.min_gpus} GPUs ({exp.note}); this host has {n}"
    if exp.needs_te and importlib.util.find_spec("transformer_engine") is None:
        return f"{overlay} needs Transformer Engine ({exp.note})"
    if overlay in NOT_IN_SMOKE_SET:
        return f"{overlay} {NOT_IN_SMOKE_SET[overlay]}"
    try:
        found = importlib.util.find_spec("nvidia_resiliency_ext.inprocess") is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        return "Bridge's pretrain() imports nvidia_resiliency_ext.inprocess: install it (requirements/gpu.lock)"
    return None


def _args(overlay: str | None, base: tuple[str, ...], out: Path, pretrained: Path, lora: bool = False) -> list[str]:
    args = ["train", "--metrics", str(out / "metrics")]
    args += [w for s in base for w in ("--set", s.replace(PRETRAINED, str(pretrained)))]
    args += ["--lora"] if lora else []
    if overlay:
        args += ["--overlay", overlay]
        args += [w for k, v in EXPECTATIONS[overlay].params for w in ("--param", f"{overlay}.{k}={_hydra(v)}")]
        if overlay == "memory_snapshot":
            args += ["--param", f"memory_snapshot.path={out}/memory_snapshot.pickle"]
    return args


def _hydra(value) -> str:
    return "[" + ",".join(map(str, value)) + "]" if isinstance(value, list) else str(value)


def pretrained_folder(tmp: Path) -> Path:
    return tmp / "pretrained"


def planned_runs(tmp: Path, runnable: list[str]) -> dict[str, tuple[str | None, tuple[str, ...], int, list[str]]]:
    """name -> (overlay or None for a baseline, base sets, GPUs, the runner's arguments) for these overlays and the
    baselines they need (scripts/gpu_check --dry-run validates each one on CPU). A LoRA run needs the pre-training
    run first (``needs_pretraining``)."""
    plan = {}
    for overlay in runnable:
        exp = EXPECTATIONS[overlay]
        base, nproc = BASE_SETS.get(overlay, ()), exp.min_gpus
        for name, which in ((baseline_name(base, nproc, exp.lora), None), (overlay, overlay)):
            plan[name] = (which, base, nproc, _args(which, base, tmp / run_folder(name), pretrained_folder(tmp),
                                                    exp.lora))
    return plan


def needs_pretraining(runnable: list[str]) -> bool:
    return any(EXPECTATIONS[o].lora for o in runnable)


def run_folder(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)


def baseline_name(base: tuple[str, ...], nproc: int, lora: bool = False) -> str:
    sets = [s for s in base if PRETRAINED not in s]
    return f"baseline-{nproc}-{'lora-' if lora else ''}{'-'.join(sets) or 'recipe'}"


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every runnable overlay's run and each baseline it needs, started together; name -> RunMetrics or an error."""
    tmp = tmp_path_factory.mktemp("gpu_smoke")
    runnable = [o for o in sorted(EXPECTATIONS) if _skip_reason(o) is None]
    plan = planned_runs(tmp, runnable)
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_CUDA_ALLOC_CONF"}  # baselines: the allocator default
    results: dict[str, object] = {}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    if needs_pretraining(runnable):  # the base model the LoRA runs fine-tune, saved before they start
        out = tmp / "pretraining"
        out.mkdir(parents=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
               "-m", "mbmem_overlays.launch.gpu_harness", *pretrain_args(pretrained_folder(tmp))]
        with open(out / "job.log", "wb") as log:
            try:
                rc = subprocess.run(cmd, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=PRETRAIN_TIMEOUT_S).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        if rc != 0:
            why = f"pre-training failed (exit {rc}): {' '.join(cmd)}\n{(out / 'job.log').read_text(errors='replace')[-3000:]}"
            for name, (overlay, *_rest) in list(plan.items()):
                if EXPECTATIONS[overlay or _owner(plan, name)].lora:
                    results[name] = why
                    del plan[name]
    procs = {}
    for name, (overlay, base, nproc, args) in plan.items():
        out = tmp / run_folder(name)
        out.mkdir(parents=True)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "mbmem_overlays.launch.gpu_harness", *args]
        log = open(out / "job.log", "wb")
        procs[name] = (subprocess.Popen(cmd, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT), log, out, cmd)
    for name, (proc, log, out, cmd) in procs.items():
        try:
            rc = proc.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        log.close()
        text = (out / "job.log").read_text(errors="replace")
        try:
            results[name] = load_run(out / "metrics", name) if rc == 0 else \
                f"exit {rc}: {' '.join(cmd)}\n{text[-3000:]}"
        except MetricsError as exc:
            results[name] = f"{exc}\n{text[-3000:]}"
    return {"results": results, "plan": plan}


def _owner(plan: dict, baseline: str) -> str:
    """The overlay a baseline run was planned for (the first one that uses it)."""
    for name, (overlay, base, nproc, _) in plan.items():
        if overlay and baseline_name(base, nproc, EXPECTATIONS[overlay].lora) == baseline:
            return overlay
    return next(iter(EXPECTATIONS))


@pytest.mark.parametrize("overlay", sorted(EXPECTATIONS))
def test_overlay_moves_memory_as_claimed(overlay, request):
    reason = _skip_reason(overlay)
    if reason:
        pytest.skip(reason)
    got = request.getfixturevalue("launched")
    base, nproc, lora = BASE_SETS.get(overlay, ()), EXPECTATIONS[overlay].min_gpus, EXPECTATIONS[overlay].lora
    baseline = got["results"][baseline_name(base, nproc, lora)]
    candidate = got["results"][overlay]
    assert not isinstance(baseline, str), f"baseline run failed: {baseline}"
    assert not isinstance(candidate, str), f"{overlay} run failed: {candidate}"
    verdict = judge(overlay, baseline, candidate)
    print(f"{overlay}: {'PASS' if verdict.passed else 'FAIL'} — {'; '.join(verdict.reasons)}")
    assert verdict.passed, verdict.reasons
