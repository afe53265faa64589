"""What the step-time model reads beyond the memory model's Shape, Layout and Settings: which communication
overlaps the job asks for, as Bridge's setup turns them on for a layout (training/comm_overlap.py), and the
switches that change what a step moves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..inputs import Layout, Settings


@dataclass(frozen=True)
class CostInputs:
    # TP communication overlap asked for (model.tp_comm_overlap, or comm_overlap.tp_comm_overlap)
    tp_comm_overlap: bool = False
    # cfg.comm_overlap is set: Bridge's CommOverlapConfig.setup decides DP and P2P overlap per layout
    # (config.py:1883-1885 runtime_config_update); the user's own values in it win (_override_user_cfgs)
    comm_overlap_setup: bool = False
    user_overlap_grad_reduce: bool | None = None
    user_overlap_param_gather: bool | None = None
    user_overlap_p2p: bool | None = None
    # without comm_overlap: what the ddp / model config says
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    overlap_p2p_comm: bool = False
    ep_overlap: bool = False                  # overlap_moe_expert_parallel_comm
    optimizer_offload_overlap: bool = False   # optimizer.overlap_cpu_optimizer_d2h_h2d
    dispatcher: str = "alltoall"              # moe_token_dispatcher_type
    fp8_param_gather: bool = False            # FP8 weights are all-gathered in FP8 (1 byte)
    # a full-iteration CUDA graph (cuda_graph_impl "local" with the full_iteration scope: FullCudaGraphWrapper)
    # replays the whole forward-backward: no per-kernel host launches (per-layer scopes are Settings.graph_scopes)
    graph_full_iteration: bool = False


def tp_overlap(ci: CostInputs, lay: Layout) -> bool:
    """TP comm overlap takes effect only at TP >= 2 with sequence parallelism (comm_overlap.py:442-451)."""
    return ci.tp_comm_overlap and lay.tp > 1 and lay.sp


def p2p_overlap(ci: CostInputs, lay: Layout) -> bool:
    """Bridge overlaps pipeline send/receive with the interleaved schedule only (comm_overlap.py:454-463)."""
    if lay.pp <= 1:
        return False
    if ci.comm_overlap_setup:
        return ci.user_overlap_p2p if ci.user_overlap_p2p is not None else lay.vpp > 1
    return ci.overlap_p2p_comm


def dp_overlaps(ci: CostInputs, lay: Layout, st: Settings) -> tuple[bool, bool]:
    """(overlap_grad_reduce, overlap_param_gather): with comm_overlap and the distributed optimizer, Bridge turns
    both on at DP > 1 (comm_overlap.py:576-579, applied only with use_distributed_optimizer :671-678)."""
    if ci.comm_overlap_setup and st.dist_optimizer:
        on = lay.dp > 1
        grad = ci.user_overlap_grad_reduce if ci.user_overlap_grad_reduce is not None else on
        param = ci.user_overlap_param_gather if ci.user_overlap_param_gather is not None else on
        return bool(grad), bool(param) and st.dist_optimizer
    return ci.overlap_grad_reduce, ci.overlap_param_gather and st.dist_optimizer


def cost_inputs(cfg: Any) -> CostInputs:
    """The overlap switches of a Bridge ConfigContainer (or a config rebuilt from Megatron-LM arguments)."""
    m = cfg.model
    ddp = getattr(cfg, "ddp", None)
    opt = getattr(cfg, "optimizer", None)
    co = getattr(cfg, "comm_overlap", None)
    mp = getattr(cfg, "mixed_precision", None)
    if isinstance(mp, str):
        mp = None
    tp_req = bool(getattr(m, "tp_comm_overlap", False)) or bool(getattr(co, "tp_comm_overlap", False))
    fp8_gather = bool(getattr(ddp, "fp8_param_gather", False)) or bool(getattr(mp, "fp8_param_gather", False))
    ep = bool(getattr(m, "overlap_moe_expert_parallel_comm", False)) or bool(
        getattr(co, "overlap_moe_expert_parallel_comm", False))
    impl = str(getattr(m, "cuda_graph_impl", None) or "none")
    scopes = getattr(m, "cuda_graph_scope", None) or getattr(m, "cuda_graph_modules", None) or ()
    if isinstance(scopes, str):
        scopes = [scopes]
    full_iteration = impl == "local" and any("full_iteration" in str(x) for x in scopes)
    return CostInputs(
        tp_comm_overlap=tp_req, comm_overlap_setup=co is not None,
        user_overlap_grad_reduce=getattr(co, "overlap_grad_reduce", None),
        user_overlap_param_gather=getattr(co, "overlap_param_gather", None),
        user_overlap_p2p=getattr(co, "overlap_p2p_comm", None),
        overlap_grad_reduce=bool(getattr(ddp, "overlap_grad_reduce", False)),
        overlap_param_gather=bool(getattr(ddp, "overlap_param_gather", False)),
        overlap_p2p_comm=bool(getattr(m, "overlap_p2p_comm", False)), ep_overlap=ep,
        optimizer_offload_overlap=bool(getattr(opt, "overlap_cpu_optimizer_d2h_h2d", False)),
        dispatcher=str(getattr(m, "moe_token_dispatcher_type", "alltoall") or "alltoall"),
        fp8_param_gather=fp8_gather, graph_full_iteration=full_iteration)
