"""What one layer of a microbatch asks of one GPU, region by region: its GEMMs (shape, FLOPs and the bytes they
read and write), the bytes of its memory-bound kernels, the collectives it runs (bytes and how many), the kernels
the host launches for it, forward and backward, and what recompute replays.

Units: per microbatch on one GPU. FLOPs count a multiply-add as two. Every GEMM's FLOPs are the layer's over the
tensor-parallel group divided by TP (each rank multiplies its shard of the weight by the gathered sequence), for
MoE experts too: a microbatch's routed tokens (topk per token) spread over the expert-parallel ranks, which are
the same GPUs (Layout: every GPU of a stage runs its share of every expert GEMM on average).

Sources (megatron-core 0.19.2 as installed, Transformer Engine v2.17.1):
- GEMM shapes: the parameters of memory/weights.py (_attention_params, _mlp_params, _mamba_params), which cite
  the modules. A GEMM of M x K x N (M tokens, a K x N weight shard) does 2MKN FLOPs and reads M x K and K x N and
  writes M x N; its backward a data gradient of the same shape and a weight gradient that reads the input and the
  output gradient and accumulates K x N into the fp32 main_grad (gradient_accumulation_fusion: read and write);
  a frozen weight (LoRA's base) has no weight gradient (TE linear.py / layernorm_linear.py backward computes wgrad
  only when weight.requires_grad). Under FP8 a TE GEMM's operands are 1 byte, its output the compute dtype. The
  step model (step.py) times each GEMM by the roofline: the larger of its FLOPs at the tensor-core rate and its
  bytes at HBM bandwidth.
- Attention core: QK^T and PV, 2 x s_kv x (q and v head dims) x heads per token; the fused/flash kernels skip the
  blocks a causal mask hides, so a token attends to (s + 1) / 2 keys on average; backward runs five matrix
  products to forward's two, 2.5x (FlashAttention-2, Dao 2023, arXiv:2307.08691 section 3.1 and its FLOP count,
  "the backward pass ... 2.5 times the forward"; "causal: divide by 2"). megatron-core's own (unfused)
  DotProductAttention computes all s x s scores and masks them (dot_product_attention.py:194-239): s keys, and
  backward twice forward (two products each). The fused kernel reads q, k, v and writes the output and its
  softmax statistics (fp32 per head and token).
- Mamba: in_proj and out_proj GEMMs, the scan's 7 x d_inner x d_state per token and the depthwise conv
  (Megatron Bridge training/utils/flop_utils.py mamba_layer_flops :607-628, which states the scan term).
- Memory-bound kernels, the bytes each reads and writes once: norms, residual adds (bias-dropout-add), RoPE (and
  q/k norms), the activation (SwiGLU reads 2f and writes f), MoE permute/unpermute and the router's scores, the
  softmax of a non-fused attention, the loss over the logits; under FP8 the quantization of every TE GEMM input
  that no fused norm produced (TE quantizes the attention output and the activation before the row-parallel
  GEMMs, and each output gradient before its backward GEMMs: read the compute dtype, write the FP8 data and its
  transpose for the weight gradient, TE cast_transpose); backward reads the saved input and the incoming
  gradient and writes one gradient: 1.5x forward.
- Tensor-parallel collectives under sequence parallelism (tensor_parallel/layers.py, TE layernorm_linear.py and
  linear.py with sequence_parallel): forward all-gathers each column-parallel GEMM's input and reduce-scatters each
  row-parallel GEMM's output; backward reduce-scatters the gathered input's gradient, all-gathers the row-parallel
  output's gradient, and all-gathers the input again for the weight gradient (only its sequence shard was kept:
  activations.py "TE re-gathers it in backward"). Without SP (tensor_parallel/mappings.py): the row-parallel
  output is all-reduced in forward (_ReduceFromModelParallelRegion :230-237), the column-parallel input's
  gradient in backward (_CopyToModelParallelRegion :210-218): one all-reduce each way per block. A ring
  collective moves (n - 1) / n of the gathered tensor per GPU, an all-reduce twice that (NCCL's bus bandwidth,
  src/graph/tuning.cc nsteps :289).
- Expert parallelism: the alltoall/flex dispatchers send each routed token's hidden state to its expert and back
  (token_dispatcher.py: dispatch and combine), forward and again in backward.
- Context parallelism (TE's p2p ring, attention.py / TE context_parallel.py): each rank passes its K and V on
  cp - 1 times in forward; backward passes K, V and their gradients.
- Kernels the host launches (KERNELS, forward and backward per region): counted roughly from the code path as
  data, for the host-launch term of step.py; a region inside a captured CUDA graph scope (Settings.graph_scopes,
  memory/graphs.py graphed_blocks: attn, mlp, moe_router, moe_preprocess, moe, mamba) is replayed by one graph
  launch instead.
"""

from __future__ import annotations

import operator
from typing import NamedTuple
from dataclasses import dataclass, field, fields, replace

from ..activations import layer_activation
from ..inputs import FP8, FP32, Layout, Settings, Shape, _tokens
from ..pipeline import blocks_of, runs_bf16

# The fields of one region's forward demand, and of a layer's totals.
GEMM8, GEMM16, ATTN, HBM, TP, EP, CP = range(7)

# A GEMM is compute-bound on every GPU of gpus.GPUS at every efficiency when its FLOPs per byte exceed the
# steepest ridge point there (dense FP8 peak x the highest efficiency / the lowest HBM bandwidth: GB200 5 PFLOP/s x
# 0.48 / 8 TB/s = 300; H100 FP8 1979 x 0.48 / 3350 = 284): such GEMMs are timed linearly (a closed form), the rest
# by the roofline per GPU. step.py checks the bound against the table (test_cost_model).
COMPUTE_BOUND_INTENSITY = 320.0


@dataclass(frozen=True, slots=True)
class Region:
    """One region of one block, forward, absolute per microbatch on one GPU."""
    name: str
    block: str
    gemms: tuple[tuple[float, float, float, bool], ...] = ()   # (FLOPs, forward bytes, wgrad bytes, FP8)
    attn: float = 0.0          # attention / scan tensor-core FLOPs (BF16 rate)
    attn_bytes: float = 0.0
    hbm: float = 0.0           # memory-bound kernels' bytes
    tp: tuple[tuple[str, float, int], ...] = ()      # forward TP collectives: (kind, bytes moved, count)
    tp_b: tuple[tuple[str, float, int], ...] = ()    # backward TP collectives
    ep: tuple[tuple[str, float, int], ...] = ()      # expert all-to-alls, forward (backward the same)
    cp: tuple[tuple[str, float, int], ...] = ()      # context-parallel ring, forward (backward twice the bytes)
    kernels: tuple[int, int] = (0, 0)                # host launches forward, backward
    graphed: bool = False      # inside a captured CUDA graph scope
    recomputed: bool = False   # replayed in backward by selective recompute
    wgrad: bool = True         # its GEMMs' weights train (a weight gradient runs)
    attn_bwd: float = 2.5      # backward / forward attention FLOPs
    wgrad_share: float = 1.0   # the share of microbatches whose weight gradient runs here (deferred wgrad)
    hbm_bwd: float = 1.5       # backward / forward memory-bound bytes

    @property
    def flops8(self) -> float:
        return sum(f for f, _, _, e in self.gemms if e)

    @property
    def flops16(self) -> float:
        return sum(f for f, _, _, e in self.gemms if not e)


# One phase (forward, backward or recompute) of a layer, before any GPU's speed, as a plain tuple (a cache of
# them then costs the garbage collector nothing): (FLOPs of the GEMMs compute-bound on every GPU
# (COMPUTE_BOUND_INTENSITY) at FP8, the same at BF16, memory-bound bytes, the other GEMMs as (FLOPs, bytes, FP8) for
# the roofline)
Phase = tuple
PH_F8, PH_F16, PH_HBM, PH_SMALL = range(4)


def _phase(gemms, hbm: float, attn: tuple[float, float] = (0.0, 0.0)) -> Phase:
    f8 = f16 = 0.0
    small = []
    for f, b, e in gemms:
        if f <= 0:
            continue
        if b <= 0 or f >= COMPUTE_BOUND_INTENSITY * b:
            if e:
                f8 += f
            else:
                f16 += f
        else:
            small.append((f, b, e))
    af, ab = attn
    if af > 0:
        if ab <= 0 or af >= COMPUTE_BOUND_INTENSITY * ab:
            f16 += af
        else:
            small.append((af, ab, False))
    return (f8, f16, hbm, tuple(small))


class Summary(NamedTuple):
    """What step.py times of one LayerWork, before any GPU's speed (memoized on it, see _summary)."""
    fwd: Phase
    bwd: Phase
    rec: Phase
    attn_f: Phase                 # the attention kernels' forward (what the context-parallel ring hides behind)
    attn_b: Phase
    # per region with TP collectives: (forward GEMMs, backward GEMMs, forward colls, backward colls, recomputed)
    tp_regions: tuple[tuple[Phase, Phase, tuple, tuple, bool], ...]
    ep_f: tuple                   # expert all-to-alls (kind, bytes, count) forward (backward the same)
    ep_r: tuple                   # ... replayed by recompute
    cp_f: tuple                   # context-parallel ring forward (backward twice the bytes)
    cp_r: tuple
    rg_f: tuple                   # LoRA re-gather forward / backward
    rg_b: tuple
    launches: tuple[float, float, float]   # host launches: forward, backward, recompute (eager regions)
    graphs: tuple[float, float, float]     # CUDA graph replays: forward, backward, recompute


def summarize(regions, regather_f=(), regather_b=()) -> Summary:
    """A layer's regions as step.py times them: per phase the compute-bound FLOPs, memory-bound bytes and the
    GEMMs the roofline decides, the TP regions with their paired GEMMs, the collectives, the host launches."""
    fwd, bwd, rec = [], [], []
    fh = bh = rh = 0.0
    attn_f = [0.0, 0.0]
    attn_b = [0.0, 0.0]
    tp_regions = []
    ep_f, ep_r, cp_f, cp_r = [], [], [], []
    lf = lb = lr = 0.0
    scopes_f: set = set()
    scopes_r: set = set()
    for r in regions:
        gf = [(f, fb, e) for f, fb, _, e in r.gemms]
        k = r.wgrad_share
        gb = gf + ([(f * k, wb * k, e) for f, _, wb, e in r.gemms] if r.wgrad and k > 0 else [])
        fwd += gf
        bwd += gb
        fh += r.hbm
        bh += r.hbm_bwd * r.hbm
        if r.attn:
            attn_f[0] += r.attn
            attn_f[1] += r.attn_bytes
            attn_b[0] += r.attn_bwd * r.attn
            attn_b[1] += 2.0 * r.attn_bytes
        if r.recomputed:
            rec += gf
            rh += r.hbm
        if r.tp or r.tp_b:
            tp_regions.append((_phase(gf, 0.0), _phase(gb, 0.0), r.tp, r.tp_b, r.recomputed))
        ep_f += r.ep
        cp_f += r.cp
        if r.recomputed:
            ep_r += r.ep
            cp_r += r.cp
        if r.graphed:
            scopes_f.add(r.block)
            if r.recomputed:
                scopes_r.add(r.block)
        else:
            lf += r.kernels[0]
            lb += r.kernels[1]
            if r.recomputed:
                lr += r.kernels[0]
    ra = [sum(r.attn for r in regions if r.recomputed), sum(r.attn_bytes for r in regions if r.recomputed)]
    return Summary(_phase(fwd, fh, tuple(attn_f)), _phase(bwd, bh, tuple(attn_b)), _phase(rec, rh, tuple(ra)),
                   _phase((), 0.0, tuple(attn_f)), _phase((), 0.0, (attn_b[0] + ra[0], attn_b[1] + ra[1])),
                   tuple(tp_regions), tuple(ep_f), tuple(ep_r), tuple(cp_f), tuple(cp_r), regather_f,
                   regather_b, (lf + len(regather_f), lb + len(regather_b), lr),
                   (len(scopes_f), len(scopes_f), len(scopes_r)))



@dataclass(frozen=True)
class LayerWork:
    """One layer, one microbatch, one GPU (see the module docstring for units)."""
    f8: float = 0.0        # forward tensor-core FLOPs at the FP8 rate (TE GEMMs under FP8)
    f16: float = 0.0       # forward tensor-core FLOPs at the BF16 rate (other GEMMs, attention, scan)
    fm: float = 0.0        # forward HBM bytes of the memory-bound kernels
    b8: float = 0.0
    b16: float = 0.0
    bm: float = 0.0
    attn: float = 0.0      # forward attention-core FLOPs (part of f16): what context-parallel exchange hides behind
    tp_f: float = 0.0      # tensor-parallel collective bytes, forward / backward
    tp_b: float = 0.0
    ep_f: float = 0.0      # expert-parallel all-to-all bytes
    ep_b: float = 0.0
    cp_f: float = 0.0      # context-parallel ring bytes
    cp_b: float = 0.0
    regather: float = 0.0  # LoRA input re-gather: all-gather / reduce-scatter bytes (TP link)
    d2h: float = 0.0       # activation offload: device -> host in forward, host -> device in backward
    h2d: float = 0.0
    # what selective recompute replays in backward (forward demand of the recomputed regions)
    r8: float = 0.0
    r16: float = 0.0
    rm: float = 0.0
    r_tp: float = 0.0
    r_ep: float = 0.0
    r_cp: float = 0.0
    # the whole layer's forward, for full recompute (replays it all)
    full: tuple[float, ...] = (0.0,) * 7
    # what step.py times (summarize: the regions' roofline GEMMs, collectives with their count, host launches),
    # built with the LayerWork; the regions themselves are rebuilt on request (``regions``) from ``source``, the
    # arguments of layer_work, or kept (``kept``: the output layer's), so that a cache of LayerWorks holds few objects
    summary: "Summary | None" = field(default=None, compare=False, repr=False)
    source: tuple = field(default=(), compare=False, repr=False)
    kept: tuple = field(default=(), compare=False, repr=False)
    # LoRA re-gather collectives: forward and backward (kind, bytes, count) on the TP group
    regather_f: tuple[tuple[str, float, int], ...] = ()
    regather_b: tuple[tuple[str, float, int], ...] = ()
    host_syncs: int = 0    # host waits for the device per forward (the alltoall dispatcher's token counts)

    @property
    def regions(self) -> tuple[Region, ...]:
        """The layer's regions (work.Region), in order."""
        if self.source:
            return tuple(_layer_build(*self.source)[1])
        return self.kept


ZERO = LayerWork()


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def gemm(m: float, k: float, n: float, fp8: bool, out_bytes: float, grad_bytes: float,
         count: float = 1.0) -> tuple[float, float, float, bool]:
    """(FLOPs, forward bytes, weight-gradient bytes, FP8) of ``count`` GEMMs of M x K x N: 2MKN FLOPs; forward
    reads M x K and K x N (1 byte each under FP8) and writes M x N; the weight gradient reads the input and the
    output gradient and accumulates the K x N gradient (read and write ``grad_bytes``)."""
    inb = FP8 if fp8 else out_bytes
    return (count * 2.0 * m * k * n, count * ((m * k + k * n) * inb + m * n * out_bytes),
            count * ((m * k + m * n) * inb + 2.0 * k * n * grad_bytes), fp8)


# Host launches per region, (forward, backward), counted roughly from the code path (TE 2.17.1 modules as
# megatron-core 0.19.2's TE layer specs use them, gpt_layer_specs.py); collectives count as launches too. Per TE
# GEMM under FP8 FP8_LAUNCHES more each way (the input's and output gradient's quantization and amax/scale
# updates, TE quantizers).
KERNELS = {
    "norm": (1, 2),        # the norm kernel; backward its dgrad and the weight-gradient reduction
    "qkv": (1, 2),         # the GEMM; dgrad and wgrad GEMMs (+ SP collectives, counted with them)
    "rope": (2, 2),        # TE fused RoPE on q and on k (apply_rotary_pos_emb); + 2 q/k norms each way (Qwen3)
    "mla_up": (10, 12),    # multi_latent_attention.py qkv_up_proj_and_rope_apply: up-projections, splits, RoPE, cats
    "core_attn": (2, 3),   # TE DotProductAttention: the fused kernel and its layout copy; backward + dq conversion
    "proj": (1, 2),
    "bda": (1, 1),         # megatron's fused bias-dropout-add; backward the residual gradient add
    "fc1": (1, 2),
    "act": (1, 1),         # bias_swiglu (fused)
    "fc2": (1, 2),
    "router": (16, 10),    # router GEMM, score function, top-k, the aux/z-loss terms (moe/router.py, moe_utils.py)
    "preprocess": (8, 0),  # the dispatcher's token counts and permutation metadata (token_dispatcher.py preprocess)
    "permute": (8, 8),     # permute / unpermute (moe_utils.py permute, unpermute) and the token-count exchange
    "experts": (0, 0),     # grouped GEMMs: per local expert (EXPERT_LAUNCHES), below
    "moe_act": (1, 1),
    "shared": (5, 7),      # shared-expert MLP: fc1, act, fc2 (+ its gate)
    "in_proj": (1, 2),
    "conv": (2, 2),
    "scan": (5, 10),       # mamba_chunk_scan_combined's Triton kernels
    "gate_norm": (2, 3),
    "out_proj": (1, 2),
}
FP8_LAUNCHES = 2
# TE GroupedLinear (general_grouped_gemm) launches one GEMM per local expert: forward fc1 and fc2, backward their
# dgrad and wgrad
EXPERT_LAUNCHES = (2, 4)
# graph scope of each MoE region (transformer_layer.py _te_cuda_graph_capture / _get_submodules_under_cudagraphs):
# moe_router covers the pre-MLP norm and the router (and the shared experts unless they overlap), moe_preprocess
# the dispatcher's preprocess, moe the whole MoE layer
MOE_SCOPES = {"norm": ("moe_router", "moe"), "router": ("moe_router", "moe"), "shared": ("moe_router", "moe"),
              "preprocess": ("moe_preprocess", "moe")}


def _blocks_regions(s: Shape, lay: Layout, st: Settings, block: str, dispatcher: str,
                    fp8: bool) -> list[Region]:
    """The forward regions of one block, absolute per microbatch on this GPU (tokens = seq x MBS / CP), GEMMs
    already per TP rank."""
    t = lay.tp
    T = _tokens(lay)
    D = st.dtype_bytes
    G = st.grad_bytes
    sp = t if lay.sp else 1
    gi = FP8 if fp8 else D     # bytes of an all-gathered GEMM input (TE gathers the quantized norm output)
    q8 = 3 * D if fp8 else 0.0  # quantizing one element: read the compute dtype, write FP8 data and its transpose
    h = s.hidden
    ring = _ring(t)
    col_f = (("ag", T * h * gi * ring, 1),) if lay.sp and t > 1 else ()
    row_f = (("rs", T * h * D * ring, 1),) if lay.sp and t > 1 else (("ar", 2 * T * h * D * ring, 1),) if t > 1 else ()
    # backward: column-parallel: reduce-scatter of the input gradient (+ the input re-gathered for the weight
    # gradient); row-parallel: the output gradient gathered. Without SP: the column-parallel input gradient
    # all-reduced (row-parallel: none).
    frozen = st.lora_rank > 0
    if lay.sp and t > 1:
        col_b = (("rs", T * h * D * ring, 1),) + ((("ag", T * h * gi * ring, 1),) if not frozen else ())
        row_b = (("ag", T * h * D * ring, 1),)
    else:
        col_b = (("ar", 2 * T * h * D * ring, 1),) if t > 1 else ()
        row_b = ()

    def lin(name, k, n, col: bool, extra_hbm=0.0, launches=None):
        kk = KERNELS[name] if launches is None else launches
        if fp8:
            kk = (kk[0] + FP8_LAUNCHES, kk[1] + FP8_LAUNCHES)
        return Region(name, block, (gemm(T, k, n, fp8, D, G),), hbm=extra_hbm, tp=col_f if col else row_f,
                      tp_b=col_b if col else row_b, kernels=kk, wgrad=not frozen)

    out: list[Region] = []
    norm = 2 * T * h * D / sp
    if block == "attn":
        out.append(Region("norm", block, hbm=norm, kernels=KERNELS["norm"]))
        causal = 1.0 if st.attention_scores else 0.5   # a non-fused attention computes every score and masks them
        keys = lay.seq * causal
        if s.mla:
            nq = s.heads
            dq = s.qk_head_dim + s.qk_pos_dim
            qr = s.q_lora_rank or 0
            down_n = qr + s.kv_lora_rank + s.qk_pos_dim
            # the down-projections (linear_q_down_proj, linear_kv_down_proj): column-parallel with the gathered input
            out.append(Region("qkv", block, (gemm(T, h, down_n / t, fp8, D, G),), tp=col_f, tp_b=col_b,
                              kernels=(KERNELS["qkv"][0] + (FP8_LAUNCHES if fp8 else 0),
                                       KERNELS["qkv"][1] + (FP8_LAUNCHES if fp8 else 0)), wgrad=not frozen))
            # multi_latent_attention.py qkv_up_proj_and_rope_apply (:846-940): the up-projections, RoPE on the
            # positional parts and the contiguous query, key and value it returns
            copies = 2 * T * nq * (2 * dq + s.v_head_dim) * D / t + 2 * T * (s.kv_lora_rank + qr) * D / sp
            out.append(Region("mla_up", block, (gemm(T, qr or h, nq * dq / t, fp8, D, G),
                                                gemm(T, s.kv_lora_rank, nq * (s.qk_head_dim + s.v_head_dim) / t,
                                                     fp8, D, G)),
                              hbm=copies, kernels=KERNELS["mla_up"], wgrad=not frozen))
            attn = 2 * T * nq * (dq + s.v_head_dim) * keys / t
            kv_bytes = T * nq * (dq + s.v_head_dim) * D / t
            qkvo = T * nq * (2 * dq + 2 * s.v_head_dim) * D / t
            proj_k = nq * s.v_head_dim
        else:
            qkv_n = (s.heads + 2 * s.groups) * s.head_dim
            out.append(lin("qkv", h, qkv_n / t, True))
            rope = 2 * T * (s.heads + s.groups) * s.head_dim * D / t * (2 if s.qk_norm else 1)
            out.append(Region("rope", block, hbm=rope,
                              kernels=(KERNELS["rope"][0] + (2 if s.qk_norm else 0),
                                       KERNELS["rope"][1] + (4 if s.qk_norm else 0))))
            attn = 2 * T * s.heads * 2 * s.head_dim * keys / t
            kv_bytes = 2 * T * s.groups * s.head_dim * D / t
            qkvo = T * (2 * s.heads + 2 * s.groups) * s.head_dim * D / t
            proj_k = s.heads * s.head_dim
        stats = T * s.heads / t * FP32
        softmax = 2 * T * s.heads / t * lay.seq * D if st.attention_scores else 0.0
        cp = (("p2p", (lay.cp - 1) * kv_bytes, lay.cp - 1),) if lay.cp > 1 else ()
        out.append(Region("core_attn", block, attn=attn, attn_bytes=qkvo + stats,
                          hbm=softmax + (q8 * T * proj_k / t if fp8 else 0.0), cp=cp,
                          kernels=KERNELS["core_attn"], attn_bwd=2.0 if st.attention_scores else 2.5))
        out.append(lin("proj", proj_k / t, h, False, extra_hbm=q8 * T * h / sp))
        out.append(Region("bda", block, hbm=3 * T * h * D / sp, kernels=KERNELS["bda"]))
    elif block == "mlp":
        up = (2 if s.gated else 1) * s.ffn
        out.append(Region("norm", block, hbm=norm, kernels=KERNELS["norm"]))
        out.append(lin("fc1", h, up / t, True, extra_hbm=q8 * T * up / t))
        out.append(Region("act", block, hbm=(3 if s.gated else 2) * T * s.ffn * D / t + q8 * T * s.ffn / t,
                          kernels=KERNELS["act"]))
        out.append(lin("fc2", s.ffn / t, h, False, extra_hbm=q8 * T * h / sp))
        out.append(Region("bda", block, hbm=3 * T * h * D / sp, kernels=KERNELS["bda"]))
    elif block == "moe":
        rows = T * s.topk * st.moe_load / t   # routed (token, expert) pairs on this GPU (see the module docstring)
        g = 2 if s.gated else 1
        local = max(1, s.experts // max(1, lay.ep))
        per_expert = rows * lay.etp / local
        out.append(Region("norm", block, hbm=norm, kernels=KERNELS["norm"]))
        # the router: a BF16 GEMM over the experts (fp32 logits), the score function and top-k over them
        router_hbm = 6 * T / sp * s.experts * FP32
        out.append(Region("router", block, (gemm(T / sp, h, s.experts, False, FP32, G),), hbm=router_hbm,
                          kernels=KERNELS["router"], wgrad=not frozen))
        if dispatcher == "alltoall":
            out.append(Region("preprocess", block, kernels=KERNELS["preprocess"]))
        # dispatch and combine: each routed token's hidden state to its expert and back (all-to-all over EP)
        a2a = rows * h * D * _ring(lay.ep)
        ep = (("a2a", 2 * a2a, 2),) if lay.ep > 1 else ()
        out.append(Region("permute", block, hbm=(1 + s.topk) * T * h * D / sp * st.moe_load * 2, ep=ep,
                          kernels=KERNELS["permute"]))
        eg = EXPERT_LAUNCHES
        out.append(Region("experts", block,
                          (gemm(per_expert, h, g * s.moe_ffn / lay.etp, fp8, D, G, local),
                           gemm(per_expert, s.moe_ffn / lay.etp, h, fp8, D, G, local)),
                          hbm=q8 * rows * (g * s.moe_ffn + h) if fp8 else 0.0,
                          kernels=(eg[0] * local + (FP8_LAUNCHES if fp8 else 0),
                                   eg[1] * local + (FP8_LAUNCHES if fp8 else 0)), wgrad=not frozen))
        out.append(Region("moe_act", block, hbm=rows * (3 if s.gated else 2) * s.moe_ffn * D,
                          kernels=KERNELS["moe_act"]))
        if s.shared_ffn:
            out.append(Region("shared", block, (gemm(T, h, g * s.shared_ffn / t, fp8, D, G),
                                                gemm(T, s.shared_ffn / t, h, fp8, D, G)),
                              hbm=(3 if s.gated else 2) * T * s.shared_ffn * D / t, tp=col_f + row_f,
                              tp_b=col_b + row_b, kernels=KERNELS["shared"], wgrad=not frozen))
        out.append(Region("bda", block, hbm=3 * T * h * D / sp, kernels=KERNELS["bda"]))
    elif block == "mamba":
        inner = s.mamba_heads * s.mamba_head_dim
        bc = 2 * s.mamba_groups * s.mamba_state
        out.append(Region("norm", block, hbm=norm, kernels=KERNELS["norm"]))
        out.append(lin("in_proj", h, (2 * inner + bc + s.mamba_heads) / t, True))
        out.append(Region("conv", block, attn=2 * T * s.mamba_conv * (inner + bc) / t,
                          attn_bytes=2 * T * (inner + bc) * D / t, hbm=2 * T * (inner + bc) * D / t,
                          kernels=KERNELS["conv"], attn_bwd=2.0))
        out.append(Region("scan", block, attn=7 * T * inner * s.mamba_state / t, kernels=KERNELS["scan"],
                          attn_bwd=2.0))
        out.append(Region("gate_norm", block, hbm=5 * T * inner * D / t, kernels=KERNELS["gate_norm"]))
        out.append(lin("out_proj", inner / t, h, False))
        out.append(Region("bda", block, hbm=3 * T * h * D / sp, kernels=KERNELS["bda"]))
    else:
        raise ValueError(f"unknown layer block {block!r}")
    return out


LORA_BLOCK_TARGETS = {"attn": ("linear_qkv", "linear_proj"), "mlp": ("linear_fc1", "linear_fc2"),
                      "moe": ("linear_fc1", "linear_fc2"), "mamba": ("in_proj", "out_proj")}
# the LoRA targets whose column-parallel A reads a gathered norm output (core/rules REGATHER_SURFACES) per block
REGATHER_BLOCK = {"attn": "linear_qkv", "mlp": "linear_fc1", "moe": "linear_fc1"}


def _lora_dims(s: Shape, block: str) -> dict[str, tuple[int, int]]:
    inner = s.mamba_heads * s.mamba_head_dim
    ffn = s.moe_ffn if block == "moe" else s.ffn
    return {"linear_qkv": (s.hidden, (s.heads + 2 * s.groups) * s.head_dim),
            "linear_proj": (s.heads * s.head_dim, s.hidden),
            "linear_fc1": (s.hidden, (2 if s.gated else 1) * ffn),
            "linear_fc2": (ffn, s.hidden),
            "in_proj": (s.hidden, 2 * inner + 2 * s.mamba_groups * s.mamba_state + s.mamba_heads),
            "out_proj": (inner, s.hidden)}


def _lora_flops(s: Shape, lay: Layout, st: Settings, block: str) -> float:
    """Forward FLOPs of the LoRA adapters on one block (A: in -> r, B: r -> out), per token per GPU."""
    if not st.lora_rank:
        return 0.0
    dims = _lora_dims(s, block)
    per = s.topk if block == "moe" else 1
    return sum(2 * st.lora_rank * (dims[t][0] + dims[t][1]) * per / lay.tp
               for t in LORA_BLOCK_TARGETS[block] if t in st.lora_targets)


def _lora_region(s: Shape, lay: Layout, st: Settings, block: str) -> Region | None:
    """The LoRA adapters of one block as their own region: per target the rank-r GEMMs A (in -> r) and B (r -> out,
    sharded over TP), the input they read and the output B adds to the base layer's (Bridge peft/lora.py,
    peft/utils.py ParallelLinearAdapter); trainable (a weight gradient each); FLOPs as _lora_flops."""
    if not st.lora_rank:
        return None
    targets = [t for t in LORA_BLOCK_TARGETS[block] if t in st.lora_targets]
    if not targets:
        return None
    T = _tokens(lay) * (s.topk if block == "moe" else 1)
    r, t, D, G = st.lora_rank, lay.tp, st.dtype_bytes, st.grad_bytes
    dims = _lora_dims(s, block)
    gemms = []
    add = 0.0
    for name in targets:
        din, dout = dims[name]
        a = gemm(T, din / t, r, False, D, G)
        b = gemm(T, r / t, dout, False, D, G)
        gemms += [a, b]
        add += 3 * T * dout / t * D         # the adapter's output added to the base layer's
    return Region("lora", block, tuple(gemms), hbm=add, kernels=(4 * len(targets), 8 * len(targets)))


# Regions each selective-recompute label replays (megatron-core 0.19.2's labels, transformer_config.py:546-561,
# :1766-1782), per block. "layernorm" replays only norms that are modules of their own (transformer_layer.py
# :450-512: an IdentityOp input norm is skipped; TE fuses the dense input and pre-MLP norms into the next GEMM;
# MLA's input norm and MoE's pre-MLP norm are separate, gpt_layer_specs.py:244-300).
RECOMPUTE_REGIONS = {
    "core_attn": {"attn": ("core_attn",)},                     # attention.py _checkpointed_attention_forward :445
    "mla_up_proj": {"attn": ("mla_up",)},                      # multi_latent_attention.py :972-977
    "layernorm": {"moe": ("norm",)},                           # + MLA's input norm, below
    "moe_act": {"moe": ("moe_act",)},                          # moe/experts.py :882-893
    "mlp": {"mlp": ("norm", "fc1", "act", "fc2")},             # transformer_layer.py :882-900, dense layers only
    "moe": {"moe": ("router", "preprocess", "permute", "experts", "moe_act", "shared")},   # moe/moe_layer.py :694-712
    "shared_experts": {"moe": ("shared",)},                    # moe/moe_layer.py :510-525
}
NOT_PRICED_LABELS = {"gdn_norm_out": "GatedDeltaNet layers are not in the memory model's Shape"}


def recompute_regions(s: Shape, label: str, block: str) -> tuple[str, ...]:
    regions = RECOMPUTE_REGIONS.get(label, {}).get(block, ())
    if label == "layernorm" and block == "attn" and s.mla:
        regions = ("norm",)
    return regions


def _graphed(block: str, region: str, scopes: tuple[str, ...]) -> bool:
    """Whether a TE-scoped CUDA graph replays this region (memory/graphs.py graphed_blocks, MOE_SCOPES)."""
    if not scopes:
        return False
    if block == "moe":
        return any(x in scopes for x in MOE_SCOPES.get(region, ("moe",)))
    return block in scopes


# Settings fields a layer's work does not read (the optimizer's and the data-parallel sharding's): layer_work is
# cached on the others, so candidates that differ only in these share one LayerWork (and its timing, step.py)
OPTIMIZER_ONLY = frozenset({"dist_optimizer", "optimizer_offload", "state_bytes", "master_bytes", "precision_aware",
                            "optimizer_instances", "fsdp", "fsdp_outer_optim", "step_upcasts_grads",
                            "fp8_cast_copy_bytes", "optimizer", "layer_wise_optimizer", "dp_rank",
                            "gemm_workspace_bytes", "embed_grad_bytes", "without"})
_LAYER_FIELDS = tuple(f.name for f in fields(Settings) if f.name not in OPTIMIZER_ONLY)
_layer_key = operator.attrgetter(*_LAYER_FIELDS)
_WORK: dict = {}
# Entries each of the cost model's caches holds before it starts afresh: a search or a ladder prices many
# candidates of one layout in a row (the optimizer variants share their layers), so a small cache keeps the hits
# and holds few objects for the garbage collector to walk
CACHE_SIZE = 256


def layer_work(s: Shape, lay: Layout, st: Settings, kind: str, dispatcher: str = "alltoall",
               offloaded: bool = False) -> LayerWork:
    """One layer of ``kind`` ("attn+mlp", "attn+moe", or a hybrid block), one microbatch, one GPU: forward and
    backward demand, what selective recompute replays, and the whole forward (for full recompute).
    ``offloaded``: this layer's activations go to the host (layer-level CPU offload). Cached per (shape, layout,
    the settings a layer reads, kind)."""
    key = (s, lay, _layer_key(st), kind, dispatcher, offloaded)
    got = _WORK.get(key)
    if got is None:
        if len(_WORK) >= CACHE_SIZE:
            _WORK.clear()
        got = _WORK[key] = _layer_work(s, lay, st, kind, dispatcher, offloaded)
    return got


# what layer_work.cache_clear() empties: this cache and those built on its LayerWorks (step.py registers its own)
CACHES: list[dict] = [_WORK]


def _clear() -> None:
    for cache in CACHES:
        cache.clear()


layer_work.cache_clear = _clear   # type: ignore[attr-defined]


def _layer_work(s: Shape, lay: Layout, st: Settings, kind: str, dispatcher: str, offloaded: bool) -> LayerWork:
    kw, regions = _layer_build(s, lay, st, kind, dispatcher, offloaded)
    return LayerWork(**kw, summary=summarize(regions, kw["regather_f"], kw["regather_b"]),
                     source=(s, lay, st, kind, dispatcher, offloaded))


def _layer_build(s: Shape, lay: Layout, st: Settings, kind: str, dispatcher: str,
                 offloaded: bool) -> tuple[dict, list[Region]]:
    """(LayerWork's fields, the regions) of one layer (see layer_work)."""
    tokens = _tokens(lay)
    frozen = st.lora_rank > 0
    sp = lay.sp and lay.tp > 1
    D = st.dtype_bytes
    fp8 = st.fp8 and not runs_bf16(kind)
    ring = _ring(lay.tp)
    total = [0.0] * 7
    out = dict(f8=0.0, f16=0.0, fm=0.0, b8=0.0, b16=0.0, bm=0.0, attn=0.0, tp_f=0.0, tp_b=0.0, ep_f=0.0,
               ep_b=0.0, cp_f=0.0, cp_b=0.0, regather=0.0, r8=0.0, r16=0.0, rm=0.0, r_tp=0.0, r_ep=0.0, r_cp=0.0)
    labels = st.modules if st.recompute == "selective" else ()
    regions: list[Region] = []
    regather_f: tuple = ()
    regather_b: tuple = ()
    syncs = 0
    for block in blocks_of(kind):
        replayed = {name for label in labels for name in recompute_regions(s, label, block)}
        block_regions = _blocks_regions(s, lay, st, block, dispatcher, fp8)
        lora = _lora_region(s, lay, st, block)
        if lora is not None:
            block_regions.insert(2 if len(block_regions) > 2 else len(block_regions), lora)
        for r in block_regions:
            rec = r.name in replayed
            graphed = _graphed(block, r.name, st.graph_scopes)
            if rec or graphed:
                r = replace(r, graphed=graphed, recomputed=rec)
            regions.append(r)
            g8, g16 = r.flops8, r.flops16
            tp_f = sum(b for _, b, _ in r.tp)
            tp_b = sum(b for _, b, _ in r.tp_b)
            ep = sum(b for _, b, _ in r.ep)
            cp = sum(b for _, b, _ in r.cp)
            for i, v in enumerate((g8, g16, r.attn, r.hbm, tp_f, ep, cp)):
                total[i] += v
            kg = 2.0 if r.wgrad else 1.0       # data and weight gradient, or the data gradient alone (frozen)
            out["f8"] += g8
            out["f16"] += g16 + r.attn
            out["attn"] += r.attn if r.name == "core_attn" else 0.0
            out["fm"] += r.hbm
            out["b8"] += kg * g8
            out["b16"] += kg * g16 + r.attn_bwd * r.attn
            out["bm"] += 1.5 * r.hbm
            out["tp_f"] += tp_f
            out["tp_b"] += tp_b
            out["ep_f"] += ep
            out["ep_b"] += ep
            out["cp_f"] += cp
            out["cp_b"] += 2 * cp
            if rec:
                out["r8"] += g8
                out["r16"] += g16 + r.attn
                out["rm"] += r.hbm
                out["r_tp"] += tp_f
                out["r_ep"] += ep
                out["r_cp"] += cp
        if block == "moe" and dispatcher == "alltoall" and lay.ep > 1:
            # MoEAlltoAllTokenDispatcher copies the token counts to the host and waits for them once per forward
            # (token_dispatcher.py _maybe_dtoh_and_synchronize :913-950, at cuda_sync_point)
            syncs += 1
        target = REGATHER_BLOCK.get(block)
        if sp and frozen and target and target in st.lora_targets and target in st.lora_regather:
            # LoRA input re-gather: the base layer no longer hands the adapter its gathered norm output
            # (Bridge peft/utils.py:600-624 return_layernorm_output_gathered = not regather), the adapter's
            # own sequence-parallel ColumnParallelLinear gathers it (peft/utils.py:1202-1210), which is
            # megatron-core's LinearWithGradAccumulationAndAsyncCommunication: an all-gather in forward
            # (tensor_parallel/layers.py:566-571), one again in backward for the weight gradient (:610-620,
            # async, waited before the wgrad) and a reduce-scatter of its input gradient (:643-650). The
            # backward gather overlaps only LoRA-A's own rank-r data gradient: all three are on the path.
            one = tokens * s.hidden * D * ring
            out["regather"] += 3 * one
            regather_f += (("ag", one, 1),)
            regather_b += (("ag", one, 1), ("rs", one, 1))
    d2h = h2d = 0.0
    if offloaded:
        # layer-level CPU offload (cpu_offloading): the layer's saved activations leave in forward and come back in
        # backward (transformer/cpu_offload.py via TE's CPU offload context, one copy each way)
        d2h = h2d = layer_activation(s, lay, st, kind)
    elif st.fine_grained_offload is not None and st.recompute != "full":
        from ..levers import layer_offload
        host = sum(layer_offload(s, lay, st, kind).host.values()) * tokens * st.fine_grained_offload.fraction
        d2h = h2d = host
    return dict(**out, d2h=d2h, h2d=h2d, full=tuple(total), regather_f=regather_f, regather_b=regather_b,
                host_syncs=syncs), regions


# The output layer's and loss's host launches (forward, backward): the SP gather, the GEMM, and megatron-core's
# vocab-parallel cross entropy (tensor_parallel/cross_entropy.py: max, its all-reduce, exp/sum, its all-reduce,
# the target logit and its all-reduce, the loss) and their gradients
OUTPUT_KERNELS = (12, 8)


def output_layer_work(s: Shape, lay: Layout, st: Settings, mtp: int = 0, wgrad_share: float = 1.0) -> LayerWork:
    """The last stage's output layer (a bf16 ColumnParallelLinear, models/gpt/gpt_model.py) and its loss, once per
    MTP depth too, per microbatch per GPU; the loss reads the logits and writes their gradient (st.logits_bytes).
    ``wgrad_share``: the share of microbatches whose output-layer weight gradient runs in the steady state (the
    rest deferred to the flush: defer_embedding_wgrad_compute)."""
    tokens = _tokens(lay)
    frozen = st.lora_rank > 0
    depths = 1 + mtp
    D = st.dtype_bytes
    out = 2 * s.hidden * s.vocab / lay.tp * depths
    fm = (st.logits_bytes + D) * s.vocab / lay.tp * depths
    f16 = out + mtp_eh(s, lay, mtp)
    b16 = f16 if frozen else 2.0 * f16 - (1.0 - wgrad_share) * out
    T = tokens
    g = gemm(T, s.hidden, s.vocab / lay.tp, False, D, st.grad_bytes, depths)
    ring = _ring(lay.tp)
    ag = (("ag", T * s.hidden * D * ring, depths),) if lay.sp and lay.tp > 1 else ()
    rs = (("rs", T * s.hidden * D * ring, depths),) if lay.sp and lay.tp > 1 else \
        (("ar", 2 * T * s.hidden * D * ring, depths),) if lay.tp > 1 else ()
    # the vocab-parallel loss's three all-reduces of one fp32 value per token (tensor_parallel/cross_entropy.py)
    loss = (("ar", 3 * 2 * T * FP32 * ring, 3 * depths),) if lay.tp > 1 else ()
    regions = (Region("output", "output", (g,), hbm=fm * tokens, tp=ag + loss, tp_b=rs,
                      kernels=(OUTPUT_KERNELS[0] * depths, OUTPUT_KERNELS[1] * depths),
                      wgrad=not frozen, wgrad_share=wgrad_share, hbm_bwd=0.5),)
    if mtp:
        regions += (Region("mtp_eh", "output", (gemm(T, 2 * s.hidden, s.hidden / lay.tp, False, D, st.grad_bytes,
                                                     mtp),), kernels=(mtp, 2 * mtp), wgrad=not frozen),)
    return LayerWork(f16=f16 * tokens, fm=fm * tokens, b16=b16 * tokens,
                     bm=0.5 * fm * tokens, full=(0.0, f16 * tokens, 0.0, fm * tokens, 0.0, 0.0, 0.0),
                     summary=summarize(regions), kept=regions)


def mtp_eh(s: Shape, lay: Layout, mtp: int | None = None) -> float:
    """MTP's eh_proj (2h -> h) per depth (transformer/multi_token_prediction.py), per token per GPU."""
    return (s.mtp_layers if mtp is None else mtp) * 2 * 2 * s.hidden * s.hidden / lay.tp


def step_flops(w: LayerWork) -> float:
    return w.f8 + w.f16 + w.b8 + w.b16


def recompute_flops(w: LayerWork) -> float:
    return w.r8 + w.r16


def optimizer_bytes_per_param(st: Settings) -> float:
    """HBM bytes the GPU optimizer step reads and writes per parameter of its shard (TE FusedAdam, optimizer.py):
    the master weight and the two moments read and written, the gradient read, upcast to fp32 and read again
    (and once more for the norm clip), the new parameter written."""
    return 2 * st.master_bytes + 4 * st.state_bytes + st.grad_bytes + 3 * FP32 + st.param_bytes
