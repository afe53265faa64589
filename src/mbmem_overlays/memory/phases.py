"""The phases a rank goes through (steady 1F1B, optimizer step; once: eager warm-up, CUDA graph capture), each
rank's peak, what a memory line after iteration N can show, and the most-loaded GPU."""

from __future__ import annotations

from dataclasses import replace

from .buffers import (communication_buffers, flex_dispatcher_state, fp8_master_cast_copies, global_memory_buffer,
                      optimizer_step_buffers, paged_stash_buffer)
from .inputs import Breakdown, Layout, Settings, Shape
from .pipeline import _candidate_ranks
from .stage_activations import stage_activations
from .weights import model_state, optimizer_before_first_step

PHASES = ("steady 1F1B", "CUDA graph capture", "optimizer step", "eager warm-up")
# The phases every training iteration goes through (the headline peak); the others happen once, before training
# (GRAPH_WARMUP), and bound the activations' range (memory/ranges.py).
HEADLINE_PHASES = ("steady 1F1B", "optimizer step")
ONE_TIME_PHASES = ("eager warm-up", "CUDA graph capture")


def _graphed(st: Settings) -> bool:
    """Whether per-layer CUDA graphs are captured and replayed (as stage_activations models them)."""
    return bool(st.graph_scopes) and st.recompute != "full" and not st.cpu_offload_layers


def phase_breakdowns(s: Shape, lay: Layout, st: Settings, rank: int) -> dict[str, Breakdown]:
    """Pipeline rank ``rank`` in each phase (PHASES), every component on one GPU.

    Every iteration: the 1F1B steady state (the last stage's loss buffers included) and the optimizer step (only
    the allocations that outlive the backward, the graphs' static inputs, beside the fp32 gradient copies and the
    FP8 master casts). Once, before training, with CUDA graphs (GRAPH_WARMUP): the eager warm-up iterations (every
    activation allocated; the Adam moments only from the second iteration on) and the capture (the graphed scopes'
    activations for every in-flight microbatch, beside the last warm-up step's fp32 gradient copies, or before any
    step without the moments). Without graphs the one-time phases hold the model state only."""
    return _phases(s, lay, st, rank, one_time=True)


def _phases(s: Shape, lay: Layout, st: Settings, rank: int, one_time: bool) -> dict[str, Breakdown]:
    """phase_breakdowns; without ``one_time`` the eager warm-up is not re-planned (the headline needs only
    HEADLINE_PHASES, and the search plans thousands of layouts)."""
    first, last = rank == 0, rank == lay.pp - 1
    p, g, o = model_state(s, lay, st, first=first, last=last, rank=rank)
    acts = stage_activations(s, lay, st, rank)
    comm = communication_buffers(s, lay, st, rank, p)
    workspaces = 0.0 if "gemm_workspaces" in st.without else st.gemm_workspace_bytes
    flex = flex_dispatcher_state(s, lay, st, rank)
    # moe_paged_stash's GPU pages: allocated once and kept through every phase (buffers.paged_stash_buffer)
    stash = paged_stash_buffer(s, lay, st, rank)
    other = comm + workspaces + flex + stash
    step = optimizer_step_buffers(s, lay, st, first, last, rank)
    casts = fp8_master_cast_copies(s, lay, st, first, last, rank)
    detail = acts.detail + ((("fp32 gradient copies at the optimizer step", step),) if step else ())
    if casts:
        detail += (("FP8 master weights cast to the params dtype at the optimizer step", casts),)
    if st.fsdp is not None and comm:
        detail += (("Megatron FSDP gathered parameters and unsharded gradients", comm),)
    elif (gathered := global_memory_buffer(s, lay, st, rank)):
        detail += (("megatron-core global memory buffer (output layer SP gather, local attention scores)", gathered),)
    if workspaces:
        detail += (("cuBLAS workspaces (torch's per thread, Transformer Engine's)", workspaces),)
    if flex:
        detail += (("flex dispatcher routing tensors kept per MoE layer", flex),)
    if stash:
        detail += (("MoE paged stash GPU buffer (the experts' saved tensors)", stash),)
    resident = p + g + o + other + acts.steady + acts.pool if acts.pool else 0.0
    o_no_moments = optimizer_before_first_step(o, st)
    values = {"steady 1F1B": (o, acts.steady, other), "optimizer step": (o, acts.persistent, other + step + casts),
              "CUDA graph capture": (o, 0.0, other), "eager warm-up": (o, 0.0, other)}
    warmup = st.graph_warmup_steps
    if _graphed(st) and "graph_capture_after_warmup" in st.without:
        values["CUDA graph capture"] = (o, acts.capture, other)
    elif _graphed(st):
        # captured before iteration W + 1's zero_grad: the W-th step's fp32 gradient copies are still allocated;
        # with W = 0 before the first step, when the moments do not exist yet
        values["CUDA graph capture"] = (o, acts.capture, other + step) if warmup else (o_no_moments, acts.capture,
                                                                                          other)
        if warmup and one_time:
            eager = stage_activations(s, lay, replace(st, graph_scopes=()), rank).steady
            values["eager warm-up"] = (o if warmup > 1 else o_no_moments, eager, other)
    return {phase: Breakdown(p, g, opt, a, x, detail, rank, phase, resident)
            for phase, (opt, a, x) in values.items()}


def stage_peak(s: Shape, lay: Layout, st: Settings, rank: int) -> Breakdown:
    """Pipeline rank ``rank`` at its peak in training: the HEADLINE_PHASES phase whose allocated total is largest
    (with graph_capture_after_warmup switched off, the capture counts too, as before that term)."""
    phases = _phases(s, lay, st, rank, one_time=False)
    names = HEADLINE_PHASES
    if "graph_capture_after_warmup" in st.without:
        names = ("steady 1F1B", "CUDA graph capture", "optimizer step")
    return max((phases[n] for n in names), key=lambda b: b.total)


def one_time_peak(s: Shape, lay: Layout, st: Settings) -> Breakdown | None:
    """The largest one-time phase before training (ONE_TIME_PHASES) over every pipeline rank; None without CUDA
    graphs (then there is none beyond the steady state)."""
    if not _graphed(st):
        return None
    return max((phase_breakdowns(s, lay, st, r)[n] for r in range(lay.pp) for n in ONE_TIME_PHASES),
               key=lambda b: b.total)


def stage_breakdowns(s: Shape, lay: Layout, st: Settings) -> tuple[Breakdown, ...]:
    """Every pipeline rank at its peak (index = pipeline rank): first, middle and last stages, each with its
    components, the phase it peaks in and, under CUDA graphs, what the allocator holds with the graphs' pool."""
    return tuple(stage_peak(s, lay, st, rank) for rank in range(lay.pp))


def reported_phases(s: Shape, lay: Layout, st: Settings, rank: int, iteration: int) -> dict[str, Breakdown]:
    """The phases pipeline rank ``rank`` has been through by the end of training iteration ``iteration`` (1-based):
    what a memory line printed then can show, since torch's max allocated only grows (nothing in Bridge 0.6.2 or
    megatron-core 0.19.2 calls reset_peak_memory_stats). Bridge prints its memory report after iterations 1 and 2
    only (training/utils/train_utils.py:1226-1239), so the lines a job log holds are usually these.

    With CUDA graphs, iterations 1 .. cuda_graph_warmup_steps (W) run eager and the capture comes before iteration
    W + 1 (training/train.py:429-438): up to W a line shows the eager forward/backward and the eager step (the model
    without graphs: no static inputs yet), after it every phase. Without graphs the phases are the headline ones.
    After iteration 1 the forward and backward ran before the Adam moments existed (created at the first step:
    TE v2.17.1 optimizers/fused_adam.py:615-616); the step itself already holds them."""
    if iteration < 1:
        raise ValueError(f"iteration must be >= 1, got {iteration}")
    eager_only = _graphed(st) and iteration <= st.graph_warmup_steps
    if eager_only:
        eager = _phases(s, lay, replace(st, graph_scopes=()), rank, one_time=False)
        out = {"eager warm-up": replace(eager["steady 1F1B"], phase="eager warm-up", resident=0.0),
               "optimizer step": replace(eager["optimizer step"], phase="eager optimizer step", resident=0.0)}
    elif _graphed(st):
        out = dict(phase_breakdowns(s, lay, st, rank))
    else:
        out = {name: b for name, b in _phases(s, lay, st, rank, one_time=False).items() if name in HEADLINE_PHASES}
    if iteration == 1:
        forward = "eager warm-up" if eager_only else "steady 1F1B"
        out[forward] = replace(out[forward], optimizer=optimizer_before_first_step(out[forward].optimizer, st))
    return out


# Bridge prints its memory report after these training iterations (training/utils/train_utils.py:1226-1239: the
# flag is cleared once an iteration after the first has been reported)
REPORTED_ITERATIONS = (1, 2)


def memory_lines(s: Shape, lay: Layout, st: Settings) -> tuple[tuple[int, tuple[float, ...]], ...]:
    """Plan.memory_lines: the max allocated each pipeline rank's line will show after each REPORTED_ITERATIONS."""
    return tuple((it, tuple(b.total for b in reported_breakdowns(s, lay, st, it))) for it in REPORTED_ITERATIONS)


def reported_breakdowns(s: Shape, lay: Layout, st: Settings, iteration: int) -> tuple[Breakdown, ...]:
    """Every pipeline rank as its memory line after training iteration ``iteration`` shows it (reported_phases):
    the largest allocated total of the phases it has been through (index = pipeline rank)."""
    return tuple(max(reported_phases(s, lay, st, rank, iteration).values(), key=lambda b: b.total)
                 for rank in range(lay.pp))

def estimate(s: Shape, lay: Layout, st: Settings) -> Breakdown:
    """The most-loaded GPU at its peak: over the pipeline ranks that can be the most loaded (_candidate_ranks),
    the larger of the steady 1F1B state and the optimizer step (each on top of parameters, gradients, optimizer;
    the one-time phases before training are one_time_peak's); judged on the footprint (with CUDA graphs,
    allocated tensors plus the pool)."""
    best: Breakdown | None = None
    for rank in _candidate_ranks(s, lay):
        b = stage_peak(s, lay, st, rank)
        if best is None or b.footprint > best.footprint:
            best = b
    return best
