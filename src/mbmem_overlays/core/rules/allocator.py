"""The caching allocator's settings against NCCL buffer registration."""

from __future__ import annotations

from ..allocconf import expandable_segments_on
from .facts import MEM_SKILL, SURFACE
from .registry import check


@check(enforced_by="megatron-core", oracle="not supported with nccl_ub",
       source=f"{MEM_SKILL}, Compatibility and Constraints; {SURFACE} §1.1 "
              "(C distributed_data_parallel_config.py:256-261, torch<2.11 only)",
       reads=("ddp.nccl_ub", "$PYTORCH_CUDA_ALLOC_CONF"))
def expandable_segments_nccl_ub(view, c):
    """Expandable segments with NCCL user buffers (error on torch < 2.11, warning after)."""
    if not (view.get("ddp.nccl_ub") and expandable_segments_on(view.env)):
        return
    if view.torch_version < (2, 11):
        yield c.problem(view.parties("ddp.nccl_ub") + ("expandable_segments" if "expandable_segments" in view.selected else "config",),
                        "ddp.nccl_ub", True,
                        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is currently not supported with nccl_ub due to "
                        "compatibility issue with torch.cuda.MemPool API",
                        "drop expandable_segments (and remove it from cfg.env_vars/PYTORCH_CUDA_ALLOC_CONF) or set ddp.nccl_ub=false")
    else:
        # Decision: megatron-core lifted this check for torch>=2.11 (the MemPool issue is fixed there); the
        # skill text still calls the pair incompatible. Refusing would be a false "invalid" on the
        # installed torch, so we warn and name the escape hatch instead.
        yield ("expandable_segments + ddp.nccl_ub: NVIDIA's memory-tuning skill lists these as incompatible; "
               "megatron-core only refuses them on torch<2.11 and this torch is newer. If NCCL buffer registration "
               "fails at init, set ddp.nccl_ub=false or drop expandable_segments")
