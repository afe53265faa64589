"""GPU smoke runs: record per-rank memory and step time in training, then judge each overlay.

Two halves. The pure half (parsing recorded metrics, comparing, deciding) runs in CI on CPU with recorded
samples. The training half runs the tiny recipe for real, under torchrun on a GPU node:

    torchrun --standalone --nproc_per_node=1 -m mbmem_overlays.launch.gpu_harness train \
        --overlay memory_snapshot --param memory_snapshot.path=/tmp/snap/memory_snapshot.pickle --metrics /tmp/m

It builds the recipe the way train.py does (recipes/recipe/<name>.yaml, the overrides, ``apply_overlay`` with
Bridge's validation, the overlays' environment exported before CUDA starts) and calls Bridge's ``pretrain`` with
``gpt_step.forward_step``. Where Transformer Engine is not installed it also selects Bridge's own TE-free layer
spec (``gpt_provider.local_layer_spec``) and switches off the fusions that need TE or apex (``TE_FREE``): train.py
cannot select a layer spec from the command line (a function is not a KEY=VALUE value), which is why this
runner exists. ``--lora`` fine-tunes instead (Bridge's ``finetune()`` with Bridge's ``LoRA`` adapters at their
defaults, from ``--set checkpoint.pretrained_checkpoint=DIR``): the GPU check pre-trains the tiny model for a few
steps, saves it, and fine-tunes it with and without ``+mem=lora_sp_regather``. ``--oom-at N`` makes iteration N allocate past the GPU's free memory inside its forward pass, so
Bridge's OOM observer writes its snapshot (scripts/gpu_check, docs/gpu-check.md). ``train --dry-run`` builds and
validates the same job on a CPU host and launches nothing.

The recorder is a Bridge training callback (``make_recorder``) that writes ``rank<N>.json`` at the end of
training; train.py installs it too when ``MBMEM_METRICS_DIR`` is set. Beside it the runner writes ``plan.json``: the
memory plan's totals for the same configuration without and with the job's overlays (``memory/steps.build_plan``,
as ``mbmem plan`` computes them), so a smoke test can judge a measured difference against the planned one.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

METRICS_ENV = "MBMEM_METRICS_DIR"
WARMUP_STEPS = 2  # first iterations include allocator growth, kernel autotuning and NCCL setup
OOM_MARGIN = 1 << 30  # the provoked allocation asks for this much more than the GPU has free


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


def make_oom_provoker(iteration: int):
    """A Bridge ``Callback`` that, during the forward pass of ``iteration`` (1-based, as Bridge's log counts),
    asks the caching allocator for the GPU's free memory plus ``OOM_MARGIN``: a real CUDA OOM with the step's
    activations live, which makes Bridge's OOM observer (train_utils.py ``_oom_observer``, installed with
    ``profiling.record_memory_history``) write ``<base>_oom_rank-<R><ext>``. A plain device allocation, never
    managed memory (device README: managed memory past the card's free memory can hang the GPU)."""
    import torch
    from megatron.bridge.training.callbacks import Callback

    class OomProvoker(Callback):
        def on_train_start(self, context):
            state = context.state
            chunks = context.model if isinstance(context.model, list) else [context.model]

            def after_forward(module, args, output):
                if state.train_state.step + 1 == iteration:  # train_state.step counts finished iterations
                    free, _ = torch.cuda.mem_get_info()
                    print(f"[gpu_harness] iteration {iteration}: allocating {free + OOM_MARGIN} bytes "
                          f"({free} free + {OOM_MARGIN}) to provoke an OOM", flush=True)
                    torch.empty(free + OOM_MARGIN, dtype=torch.uint8, device="cuda")

            chunks[0].register_forward_hook(after_forward)

    return OomProvoker()


# ----------------------------------------------------------------------------- the training runner
# Recipe fields whose recipe value needs Transformer Engine or apex at run time. Set off only where TE is not
# installed; Bridge validates the result like any other override.
TE_FREE = {
    # Bridge config validation: "apply_rope_fusion is not available. Please install TE >= 1.4."
    "model.apply_rope_fusion": False,
    # megatron-core tensor_parallel/layers.py:1070: RuntimeError without apex's fused_weight_gradient_mlp_cuda
    "model.gradient_accumulation_fusion": False,
    # megatron-core fusions/fused_softmax.py: the causal bf16 path imports scaled_upper_triang_masked_softmax_cuda
    # (apex/TE) whenever is_kernel_available says the shapes fit; the unfused torch softmax is used otherwise
    "model.masked_softmax_fusion": False,
    # megatron-core transformer/torch_norm.py WrappedTorchNorm (the local spec's RMSNorm without apex) asserts
    # "persist_layer_norm not supported by torch LayerNorm"
    "model.persist_layer_norm": False,
    # the Llama recipes ask for TE's cross entropy (cross_entropy_fusion_impl "te"); megatron-core's own
    # vocab-parallel cross entropy instead (what the memory plan calls "unfused")
    "model.cross_entropy_loss_fusion": False,
}


def have_te() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


@dataclass(frozen=True)
class Job:
    """One training run of the runner: what train.py would be given, plus the recorder and the OOM."""
    recipe: str = "tiny_llama"
    overlays: tuple[str, ...] = ()
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    sets: tuple[str, ...] = ()
    metrics: str | None = None
    oom_at: int | None = None
    dry_run: bool = False
    lora: bool = False  # fine-tune with Bridge's LoRA from checkpoint.pretrained_checkpoint (Bridge's finetune())


def _typed(text: str) -> Any:
    """A parameter value as Hydra reads it on train.py's command line (mem.<overlay>.<param>=VALUE)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    return OverridesParser.create().parse_override(f"x={text}").value()


def parse_job(argv: list[str]) -> Job:
    """``train`` arguments -> Job; argparse exits 2 on a malformed line (no Bridge import)."""
    ap = argparse.ArgumentParser(prog="python -m mbmem_overlays.launch.gpu_harness train",
                                 description="Train a recipe with overlays for the GPU check (see module doc).")
    ap.add_argument("--recipe", default="tiny_llama", help="recipes/recipe/<name>.yaml (default tiny_llama)")
    ap.add_argument("--overlay", action="append", default=[], metavar="NAME", help="an overlay (repeatable)")
    ap.add_argument("--param", action="append", default=[], metavar="OVERLAY.PARAM=VALUE",
                    help="an overlay parameter, as mem.OVERLAY.PARAM=VALUE on train.py's command line")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a Bridge override")
    ap.add_argument("--metrics", metavar="DIR", help="write rank<N>.json (memory peaks, step times) here")
    ap.add_argument("--oom-at", type=int, metavar="N", help="provoke a CUDA OOM in iteration N's forward pass")
    ap.add_argument("--dry-run", action="store_true", help="build and validate only (CPU is enough)")
    ap.add_argument("--lora", action="store_true",
                    help="fine-tune with Bridge's LoRA adapters (Bridge's finetune()); give the base model with "
                         "--set checkpoint.pretrained_checkpoint=DIR")
    a = ap.parse_args(argv)
    params: dict[str, dict[str, Any]] = {}
    for item in a.param:
        key, eq, value = item.partition("=")
        overlay, dot, name = key.partition(".")
        if not (eq and dot and overlay and name):
            ap.error(f"--param {item!r}: write OVERLAY.PARAM=VALUE, e.g. memory_snapshot.dump_step=3")
        params.setdefault(overlay, {})[name] = _typed(value)
    for item in a.set:
        if "=" not in item:
            ap.error(f"--set {item!r}: write KEY=VALUE, e.g. train.train_iters=6")
    if a.oom_at is not None and a.oom_at < 1:
        ap.error("--oom-at: an iteration number from 1")
    if a.lora and not any(item.startswith("checkpoint.pretrained_checkpoint=") for item in a.set):
        ap.error("--lora: give the base model with --set checkpoint.pretrained_checkpoint=DIR (a saved pre-training run)")
    return Job(a.recipe, tuple(a.overlay), params, tuple(a.set), a.metrics, a.oom_at, a.dry_run, a.lora)


def job_config(job: Job) -> tuple[Any, dict[str, Any]]:
    """(Bridge config before the overlays, the fields set on it) for ``job``: the recipe, the TE-free settings
    where TE is missing, the ``--set`` overrides (locked: an overlay may not change them)."""
    from ..bridge.overrides import apply_overrides
    from ..bridge.recipes import load_recipe
    from ..bridge.stack import prepare
    prepare()
    cfg = load_recipe(job.recipe)
    if job.lora:  # before the overlays: lora_sp_regather sets a field of cfg.peft
        from megatron.bridge.peft.lora import LoRA
        cfg.peft = LoRA()  # Bridge's defaults: linear_qkv, linear_proj, linear_fc1, linear_fc2 at dim 32
    overrides: dict[str, Any] = {}
    if not have_te():
        from megatron.bridge.models.gpt_provider import local_layer_spec
        cfg.model.transformer_layer_spec = local_layer_spec  # Bridge's own TE-free spec; a function, not an override
        overrides.update(TE_FREE)
    for item in job.sets:
        key, _, value = item.partition("=")
        overrides[key] = _typed(value)
    return cfg, apply_overrides(cfg, overrides)


def build_job(job: Job, world_size: int):
    """(Bridge config, overlay report) for ``job``, validated by Bridge, nothing launched (CPU is enough)."""
    from ..api import apply_overlay
    cfg, locked = job_config(job)
    report = apply_overlay(cfg, list(job.overlays), params=job.params, world_size=world_size, locked=locked,
                           validate=True)
    return cfg, report


def planned_totals(job: Job, world_size: int) -> dict[str, Any]:
    """The memory plan's most-loaded-GPU totals for ``job``'s configuration: without overlays (``baseline``) and with
    them (``planned``), in bytes, as ``mbmem plan`` computes them; ``error`` instead when the plan cannot be made."""
    from ..memory.steps import build_plan
    try:
        cfg, locked = job_config(job)
        plan = build_plan(cfg, list(job.overlays), world=world_size, recipe=job.recipe, params=job.params,
                          locked=locked)
        return {"baseline": int(plan.steps[0].breakdown.total), "planned": int(plan.steps[-1].breakdown.total),
                "overlays": list(job.overlays), "world_size": world_size}
    except Exception as exc:  # noqa: BLE001 — the run still trains; the judge says the plan was missing
        return {"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"}


def launch(job: Job) -> int:
    """Train ``job`` with Bridge's pretrain (needs CUDA); returns 0 when training ended."""
    import logging

    from .process import export_environment, prepare_snapshot_folder
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg, report = build_job(job, world)
    export_environment(report, cfg)  # before CUDA allocates: the allocator reads PYTORCH_CUDA_ALLOC_CONF once
    prepare_snapshot_folder(cfg)
    # A job log as a job launched by Bridge's own scripts shows it: INFO lines (the OOM observer's "[OOM] rank R
    # saved memory snapshot" is logger.info), which prepare() had quietened for planning.
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    for name in ("megatron", "megatron.core", "megatron.bridge"):
        logging.getLogger(name).setLevel(logging.INFO)
    from megatron.bridge.training.finetune import finetune
    from megatron.bridge.training.gpt_step import forward_step
    from megatron.bridge.training.pretrain import pretrain
    callbacks = []
    if job.metrics:
        callbacks.append(make_recorder(job.metrics))
        if int(os.environ.get("RANK", "0")) == 0:
            Path(job.metrics).mkdir(parents=True, exist_ok=True)
            (Path(job.metrics) / "plan.json").write_text(json.dumps(planned_totals(job, world), indent=1))
    if job.oom_at:
        callbacks.append(make_oom_provoker(job.oom_at))
    print(f"[gpu_harness] {job.recipe}{' LoRA fine-tuning' if job.lora else ''} with "
          f"{list(job.overlays) or 'no overlays'}; transformer engine: "
          f"{'yes' if have_te() else 'no (local layer spec)'}; exported: {dict(report.env_to_export)}", flush=True)
    (finetune if job.lora else pretrain)(cfg, forward_step, callbacks=callbacks or None)
    return 0


def dry_run(job: Job) -> dict[str, Any]:
    """What ``launch`` would train: the changes and Bridge's verdict (CPU is enough)."""
    cfg, report = build_job(job, int(os.environ.get("WORLD_SIZE", "1")))
    profiling = getattr(cfg, "profiling", None)
    return {"recipe": job.recipe, "overlays": list(job.overlays), "te": have_te(), "lora": job.lora,
            "changes": [f"{c.target}: {c.old!r} -> {c.new!r}" for c in report.changes],
            "env": dict(report.env_to_export),
            "snapshot_path": getattr(profiling, "memory_snapshot_path", None)
            if getattr(profiling, "record_memory_history", False) else None,
            "train_iters": cfg.train.train_iters, "oom_at": job.oom_at,
            "validation": None if report.validation is None else str(report.validation.verdict)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "train":
        print("usage: python -m mbmem_overlays.launch.gpu_harness train [--help]", file=sys.stderr)
        return 2
    job = parse_job(argv[1:])
    if job.oom_at and "memory_snapshot" not in job.overlays:
        print("gpu_harness: --oom-at needs --overlay memory_snapshot (the OOM observer is what is being tested)",
              file=sys.stderr)
        return 2
    if job.dry_run:
        print(json.dumps(dry_run(job), indent=1, default=str))
        return 0
    return launch(job)


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
    plan: dict[str, Any] = field(default_factory=dict)  # plan.json: the plan's totals for this run's configuration

    @property
    def planned_saving(self) -> int | None:
        """What the plan says the run's overlays save against the same configuration without them, in bytes."""
        if not isinstance(self.plan.get("baseline"), int) or not isinstance(self.plan.get("planned"), int):
            return None
        return self.plan["baseline"] - self.plan["planned"]

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
    plan: dict[str, Any] = {}
    if (d / "plan.json").is_file():
        try:
            loaded = json.loads((d / "plan.json").read_text())
            plan = loaded if isinstance(loaded, dict) else {"error": "plan.json is not an object"}
        except ValueError as exc:
            plan = {"error": f"plan.json: {exc}"}
    return RunMetrics(name or d.name, ranks, plan)


@dataclass(frozen=True)
class Expectation:
    what: str            # "lower_allocated" | "allocator_setting" | "unchanged_allocated"
    min_gpus: int = 1
    needs_te: bool = False
    min_saving: float = 0.02  # a saving smaller than this fraction of the baseline peak is noise
    note: str = ""
    params: tuple[tuple[str, Any], ...] = ()  # overlay parameters that make it meaningful on the tiny model
    # The measured saving must match the plan's (gpu_harness.planned_totals) within this fraction of the planned
    # saving, plus PLAN_SLACK_BYTES for allocator rounding; None: not judged against the plan.
    plan_tolerance: float | None = None
    lora: bool = False   # the run and its baseline fine-tune a pre-trained tiny model with Bridge's LoRA


# What each overlay must show against the baseline (issue: GPU smoke tests). The overlays' own `effect` texts
# (overlays/mem/*.yaml) say why; bench/gpu_overlays.py measures the same overlays at the megatron-core level.
EXPECTATIONS = {
    "selective_recompute": Expectation("lower_allocated", note="modules=[core_attn,mlp] on the tiny model",
                                       params=(("modules", ["core_attn", "mlp"]),)),
    "full_recompute": Expectation("lower_allocated"),
    "cpu_offload": Expectation("lower_allocated", needs_te=True, note="megatron-core asserts TE for CPU offloading",
                               params=(("num_layers", 2),)),
    "optimizer_offload": Expectation("lower_allocated", note="Adam moments to the CPU (HybridDeviceOptimizer)"),
    "memory_snapshot": Expectation("unchanged_allocated", note="a diagnostic: allocations are recorded, not changed"),
    "lora_sp_regather": Expectation("lower_allocated", min_gpus=2, needs_te=True, min_saving=0.005,
                                    note="LoRA fine-tuning of the pre-trained tiny model at TP=2 with SP (TE's norm: "
                                         "see sequence_parallel), with and without the re-gather", plan_tolerance=0.5,
                                    lora=True),
    "dist_optimizer": Expectation("lower_allocated", min_gpus=2, note="DP=2: optimizer state is sharded"),
    "sequence_parallel": Expectation("lower_allocated", min_gpus=2, needs_te=True,
                                     note="TP=2: activations sharded along the sequence; without TE the local spec's "
                                          "torch norm asserts 'sequence parallel not supported by torch LayerNorm'"),
    "expandable_segments": Expectation("allocator_setting", note="visible to the process; smaller reserved-allocated gap"),
    "megatron_fsdp": Expectation("lower_allocated", min_gpus=2, plan_tolerance=0.5,
                                 note="DP=2, optim_grads_params: weights, gradients and optimizer state sharded"),
    "fine_grained_offload": Expectation("lower_allocated", needs_te=True, plan_tolerance=0.5,
                                        note="Bridge allows it only with the transformer_engine implementation; "
                                             "modules=[core_attn,attn_proj]",
                                        params=(("modules", ["core_attn", "attn_proj"]),)),
    "precision_aware_optimizer": Expectation("lower_allocated", needs_te=True, plan_tolerance=0.5,
                                             note="bf16 moments need Transformer Engine's FusedAdam"),
}
PLAN_SLACK_BYTES = 8 << 20  # allocator rounding and small buffers the plan does not count
UNCHANGED_TOLERANCE = 0.02  # "unchanged": within this fraction of the baseline peak


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
    elif exp.what == "unchanged_allocated":
        if ratio is None or abs(ratio - 1) > UNCHANGED_TOLERANCE:
            ok = False
            reasons.append(f"peak allocated {candidate.peak_allocated / 2**20:.0f} MiB vs baseline "
                           f"{baseline.peak_allocated / 2**20:.0f} MiB: not within {UNCHANGED_TOLERANCE:.0%}")
        else:
            reasons.append(f"peak allocated x{ratio:.3f} of baseline (unchanged, as claimed)")
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
    if exp.plan_tolerance is not None:
        planned = candidate.planned_saving
        measured = baseline.peak_allocated - candidate.peak_allocated
        if planned is None:
            ok = False
            reasons.append(f"no planned saving to judge against ({candidate.plan.get('error', 'plan.json missing')})")
        elif abs(measured - planned) > exp.plan_tolerance * abs(planned) + PLAN_SLACK_BYTES:
            ok = False
            reasons.append(f"measured saving {measured / 2**20:.0f} MiB vs planned {planned / 2**20:.0f} MiB: "
                           f"off by more than {exp.plan_tolerance:.0%} (+{PLAN_SLACK_BYTES >> 20} MiB)")
        else:
            reasons.append(f"measured saving {measured / 2**20:.0f} MiB, planned {planned / 2**20:.0f} MiB")
    if st is not None:
        reasons.append(f"step time x{st:.2f} of baseline")
    return Verdict(overlay, ok, tuple(reasons), ratio, st)


if __name__ == "__main__":
    sys.exit(main())
