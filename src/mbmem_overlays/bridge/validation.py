"""Bridge's own validation (``runtime_config_update``) as the oracle, run on a copy of the config."""

from __future__ import annotations

import contextlib
import copy
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from ..core.paths import MISSING, read, write
from .stack import prepare


# Checks that need Transformer Engine fail on a host without it, and stop
# validation there (stack-on-cpu.md). For the ones below we know the one setting
# that asked for TE: turn it off *in the validation copy only*, record the check
# as "not checkable here", and let the rest of validation run.
def torch_float32():
    import torch
    return torch.float32


TE_ONLY_CHECKS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("apply_rope_fusion is not available", {"model.apply_rope_fusion": False}),
    # FusedAdam comes from TE; without the precision-aware optimizer, its low-precision state dtypes
    # must go back to fp32 too, or megatron-core raises an error that only the copy would have.
    ("requires FusedAdam from TransformerEngine", {
        "optimizer.use_precision_aware_optimizer": False, "optimizer.main_grads_dtype": torch_float32,
        "optimizer.main_params_dtype": torch_float32, "optimizer.exp_avg_dtype": torch_float32,
        "optimizer.exp_avg_sq_dtype": torch_float32}),
    ("fused permutation is not available", {"model.moe_permute_fusion": False}),
    # Bridge comm_overlap.py:526-530 (delay_wgrad_compute). Matched on TE's version message only: Bridge's ModelOpt
    # assertion "... Please set model.gradient_accumulation_fusion=False" (config.py:1379) is a real rejection.
    ("is required for gradient_accumulation_fusion when using", {"model.gradient_accumulation_fusion": False}),
    ("is required for overlap_grad_reduce when using", {"comm_overlap.delay_wgrad_compute": False}),
    # The flex MoE dispatcher is validated against the GPU's architecture (flex_dispatcher_backend.py:105),
    # the last step of validate(): on a host without a GPU everything else has been checked by then.
    ("Found no NVIDIA driver", {"model.moe_token_dispatcher_type": "alltoall", "model.moe_flex_dispatcher_backend": "deepep"}),
    # megatron-core utils.py:529-533 (_validate_dsa_kernel_backend_dependencies, from TransformerConfig's finalize):
    # a fused DSA kernel backend asks torch.cuda.is_available() first; its kernels' packages are the GPU nodes' own
    ("requires a CUDA device, but none is available", {"model.dsa_kernel_backend": "none"}),
)
# What only a missing or old Transformer Engine says. Not the bare name: "requires use_transformer_engine_op_fuser",
# "TransformerEngine only support gelu, ..." or "only supported with transformer_engine implementation" are
# rejections of the user's settings, which must stay rejections (transformer_config.py:1582/1704/2156,
# Bridge config.py:2049).
TE_MARKERS = ("install TE", "TE version", "TE >=", "TE <", "Transformer Engine >=", "FusedAdam from TransformerEngine",
              "update TE version", "transformer_engine is not installed", "No module named 'transformer_engine'",
              "transformer-engine>=")  # "Only transformer-engine>=1.7.0 supports MoE FP8 training" (C:2295-2299)

# runtime_config_update's steps in the order they run (config.py:1853-1887 and validate() at 1136-1480), each with
# the source file whose frame in a traceback says validation was inside it. When a TE-only check stops
# validation, the steps after the one it stopped in did not run.
VALIDATION_STEPS = (
    ("mixed-precision setup", "training/mixed_precision.py"),
    ("communication-overlap setup (EP-overlap and delayed-wgrad checks)", "training/comm_overlap.py"),
    ("DDP config finalize (nccl_ub / expandable segments)", "distributed/distributed_data_parallel_config.py"),
    ("optimizer config finalize (precision-aware optimizer, offload)", "optimizer/optimizer_config.py"),
    ("model finalize: megatron-core TransformerConfig checks (recompute, CPU offload, MoE, CUDA graphs, pipeline "
     "split)", "transformer/transformer_config.py"),
    ("the rest of Bridge's validate(): Megatron FSDP, distributed-optimizer sync, fine-grained offload, CUDA-graph "
     "and checkpoint checks, scheduler", "training/config.py"),
)


def stopped_in(exc: BaseException) -> int:
    """Index in VALIDATION_STEPS of the step whose code raised ``exc`` (the innermost matching frame)."""
    import traceback
    step = len(VALIDATION_STEPS) - 1
    for frame in traceback.extract_tb(exc.__traceback__):
        for i, (_, path) in enumerate(VALIDATION_STEPS):
            if frame.filename.replace("\\", "/").endswith(path):
                step = i
    return step


@dataclass
class ValidationResult:
    ok: bool
    world_size: int
    data_parallel_size: int | None = None
    error: str | None = None
    not_checkable: list[str] = field(default_factory=list)
    launch_requirements: list[str] = field(default_factory=list)
    complete: bool = True  # False: validation stopped at a check this host cannot run; later checks did not run
    not_run: list[str] = field(default_factory=list)  # upstream validation steps that did not run (complete=False)

    @property
    def verdict(self) -> str:
        if not self.ok:
            return f"REJECTED by Bridge validation: {self.error}"
        if not self.complete:
            return ("INCOMPLETE: Bridge validation stopped at a check that needs Transformer Engine, so these upstream "
                    f"checks did not run on this host: {'; '.join(self.not_run) or 'the rest of validate()'} "
                    "(our own rules above did run)")
        if self.not_checkable:
            return "PASSED (Bridge runtime_config_update), except checks not checkable on this host"
        return "PASSED (Bridge runtime_config_update)"


@contextlib.contextmanager
def _preserved_environ():
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def validate_config(cfg: Any, world_size: int | None = None, env: dict[str, str] | None = None) -> ValidationResult:
    """Run Bridge's ``runtime_config_update`` on a copy; os.environ is restored afterwards."""
    prepare()
    ws = int(world_size or os.environ.get("WORLD_SIZE") or 1)
    unchecked: list[str] = []
    work = copy.deepcopy(cfg)
    needs: list[str] = []
    if read(work, "peft", None) is not None and read(work, "checkpoint.pretrained_checkpoint", None) is None:
        # "PEFT requires a pretrained checkpoint path" (config.py:1488): a plan has no checkpoint yet.
        needs.append("checkpoint.pretrained_checkpoint=<path to the base model's Megatron checkpoint> "
                     "(PEFT requires a pretrained checkpoint path; validated here with a placeholder)")
        # Bridge only checks that the path exists (CheckpointConfig.finalize, config.py:591-595).
        placeholder = tempfile.mkdtemp(prefix="mbmem-placeholder-checkpoint-")
        write(work, "checkpoint.pretrained_checkpoint", placeholder)
    try:
        return _validate_loop(work, ws, env, unchecked, needs)
    finally:
        if needs:
            shutil.rmtree(read(work, "checkpoint.pretrained_checkpoint", ""), ignore_errors=True)


def _validate_loop(work, ws, env, unchecked, needs) -> ValidationResult:
    from megatron.bridge.training.config import runtime_config_update
    for _ in range(len(TE_ONLY_CHECKS) + 1):
        attempt = copy.deepcopy(work)
        with _preserved_environ():
            if env is not None and env is not os.environ:
                os.environ.update({k: str(v) for k, v in env.items()})
            os.environ["WORLD_SIZE"] = str(ws)
            try:
                # Bridge's notes (print_rank_0, e.g. Megatron FSDP turning the distributed optimizer on) go to
                # stderr: stdout carries our report, and --json must stay one object
                with contextlib.redirect_stdout(sys.stderr):
                    runtime_config_update(attempt)
            except Exception as exc:  # Bridge/megatron-core raise ValueError, AssertionError, ...
                message = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
                for marker, safe in TE_ONLY_CHECKS:
                    first = next(iter(safe))
                    if marker in str(exc) and read(work, first, None) != safe[first]:
                        needs_what = "a GPU" if "NVIDIA driver" in marker else "Transformer Engine"
                        unchecked.append(f"{first}={read(work, first, None)!r}: {str(exc).strip().splitlines()[0]} "
                                         f"(needs {needs_what}; not checkable on this host)")
                        for path, value in safe.items():
                            if read(work, path, MISSING) is not MISSING:
                                write(work, path, value() if callable(value) else value)
                        break
                else:
                    if any(m in str(exc) for m in TE_MARKERS):
                        step = stopped_in(exc)
                        not_run = [name for name, _ in VALIDATION_STEPS[step + 1:]]
                        unchecked.append(f"{str(exc).strip()} (needs Transformer Engine; validation stopped here, in "
                                         f"{VALIDATION_STEPS[step][0]})")
                        return ValidationResult(True, ws, None, None, unchecked, needs, complete=False, not_run=not_run)
                    return ValidationResult(False, ws, None, message, unchecked, needs)
                continue
        return ValidationResult(True, ws, getattr(attempt, "data_parallel_size", None), None, unchecked, needs)
    return ValidationResult(False, ws, None, "too many TE-only checks", unchecked)
