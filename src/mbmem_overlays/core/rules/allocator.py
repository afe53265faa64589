"""The caching allocator's settings against NCCL buffer registration."""

from __future__ import annotations

import shlex

from ..allocconf import (
    ALLOCATOR_VARS,
    NATIVE_ONLY_KEYS,
    AllocConfError,
    async_backend,
    expandable_segments_on,
    in_effect_note,
    parse,
    render,
    var_in_effect,
)
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


_TORCH = ("torch 2.14.1 c10/cuda/CUDAAllocatorConfig.h CUDAAllocatorConfig::instance (which variable is read); "
          "c10/core/AllocatorConfig.cpp AcceleratorAllocatorConfig::parseArgs and c10/cuda/CUDAAllocatorConfig.cpp "
          "CUDAAllocatorConfig::parseArgs (keys and values; checked against torch._C._accelerator_setAllocatorSettings)")
_ALLOCATOR_READS = tuple(f"${v}" for v in ALLOCATOR_VARS)


@check(enforced_by="runtime", source=_TORCH, reads=_ALLOCATOR_READS)
def allocator_settings_torch_accepts(view, c):
    """The allocator settings torch will read are ones it accepts (else the job dies at its first CUDA allocation)."""
    var = var_in_effect(view.env)
    if var is None:
        return
    try:
        settings = parse(var, view.env[var])
    except AllocConfError as exc:
        yield c.problem(view.parties() or ("config",), f"${var}", view.env[var], str(exc),
                        f"fix {var} in your environment (or cfg.env_vars), or unset it")
        return
    yield "note: " + in_effect_note(view.env)
    for other in (v for v in ALLOCATOR_VARS if v != var and v in view.env and v != "PYTORCH_HIP_ALLOC_CONF"):
        try:
            theirs = parse(other, view.env[other])
        except AllocConfError:
            continue  # an ignored variable torch never parses
        lost = {k: v for k, v in theirs.items() if settings.get(k) != v}
        if lost:  # e.g. the recipe's env_vars create PYTORCH_CUDA_ALLOC_CONF and shadow the user's PYTORCH_ALLOC_CONF
            keep = render({**lost, **settings})
            yield (f"{other} has {render(lost)}, which torch ignores: it reads {var} first (set here, or by the "
                   f"recipe's env_vars). To keep them: export {var}={shlex.quote(keep)}")
    if async_backend(settings):
        ignored = [k for k in settings if k in NATIVE_ONLY_KEYS and k != "expandable_segments"]
        if ignored:
            yield (f"{var} has backend:cudaMallocAsync, which ignores {', '.join(ignored)} (torch warns "
                   "\"backend:cudaMallocAsync ignores ...\"): remove them, or use backend:native")


@check(enforced_by="silent", source=_TORCH + "; the cudaMallocAsync backend never uses the native caching allocator "
       "that expandable_segments configures", reads=_ALLOCATOR_READS)
def expandable_segments_async_backend(view, c):
    """expandable_segments does nothing under backend:cudaMallocAsync: refused when an overlay asks for it."""
    var = var_in_effect(view.env)
    try:
        settings = parse(var, view.env[var]) if var else {}
    except AllocConfError:
        return  # allocator_settings_torch_accepts reports it
    if not (async_backend(settings) and settings.get("expandable_segments") == "True"):
        return
    if "expandable_segments" in view.selected:
        yield c.problem(("expandable_segments", "config"), f"${var}", view.env[var],
                        f"{var} selects backend:cudaMallocAsync, where expandable_segments does nothing (the native "
                        "caching allocator it configures is not used), so +mem=expandable_segments would not apply",
                        f"drop +mem=expandable_segments, or remove backend:cudaMallocAsync from {var} to use the "
                        "native allocator with expandable segments")
    else:
        yield (f"{var} has backend:cudaMallocAsync and expandable_segments:True; expandable_segments does nothing "
               "under that backend")
