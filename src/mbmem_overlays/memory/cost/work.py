"""What one layer of a microbatch asks of one GPU, region by region: tensor-core FLOPs, HBM bytes of the
memory-bound kernels, and the bytes its collectives move, forward and backward, and what recompute replays.

Units: per microbatch on one GPU. FLOPs count a multiply-add as two. Every GEMM's FLOPs are the layer's over the
tensor-parallel group divided by TP (each rank multiplies its shard of the weight by the gathered sequence), for
MoE experts too: a microbatch's routed tokens (topk per token) spread over the expert-parallel ranks, which are
the same GPUs (Layout: every GPU of a stage runs its share of every expert GEMM on average).

Sources (megatron-core 0.19.2 as installed, TE v2.17.1):
- GEMM shapes: the parameters of memory/weights.py (_attention_params, _mlp_params, _mamba_params), which cite
  the modules; each weight's forward GEMM is 2 x tokens x its elements, its backward the data gradient and the
  weight gradient, 2 x more; a frozen weight (LoRA's base) has no weight gradient (TE linear.py / layernorm_linear.py
  backward computes wgrad only when weight.requires_grad).
- Attention core: QK^T and PV, 2 x s_kv x (q and v head dims) x heads per token; the fused/flash kernels skip the
  blocks a causal mask hides, so a token attends to (s + 1) / 2 keys on average; backward runs five matrix
  products to forward's two, 2.5x (FlashAttention-2, Dao 2023, arXiv:2307.08691 section 3.1 and its FLOP count,
  "the backward pass ... 2.5 times the forward"; "causal: divide by 2"). megatron-core's own (unfused)
  DotProductAttention computes all s x s scores and masks them (dot_product_attention.py:194-239): s keys, and
  backward twice forward (two products each).
- Mamba: in_proj and out_proj GEMMs, the scan's 7 x d_inner x d_state per token and the depthwise conv
  (Megatron Bridge training/utils/flop_utils.py mamba_layer_flops :607-628, which states the scan term).
- Memory-bound kernels (norms, residual adds, RoPE, activations, MoE permute/unpermute, the softmax of a non-fused
  attention, the loss): the bytes each reads and writes once; backward reads the saved input and the incoming
  gradient and writes one gradient: 1.5x forward.
- Tensor-parallel collectives under sequence parallelism (tensor_parallel/layers.py, TE layernorm_linear.py and
  linear.py with sequence_parallel): forward all-gathers each column-parallel GEMM's input and reduce-scatters each
  row-parallel GEMM's output; backward reduce-scatters the gathered input's gradient, all-gathers the row-parallel
  output's gradient, and all-gathers the input again for the weight gradient (only its sequence shard was kept:
  activations.py "TE re-gathers it in backward"); without SP one all-reduce each way. A ring collective moves
  (n - 1) / n of the gathered tensor per GPU, an all-reduce twice that.
- Expert parallelism: the alltoall/flex dispatchers send each routed token's hidden state to its expert and back
  (token_dispatcher.py: dispatch and combine), forward and again in backward.
- Context parallelism (TE's p2p ring, attention.py / TE context_parallel.py): each rank passes its K and V on
  cp - 1 times in forward; backward passes K, V and their gradients.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

from ..activations import layer_activation
from ..inputs import FP8, FP32, Layout, Settings, Shape, _tokens

# The fields of one region's forward demand, and of a layer's totals.
GEMM8, GEMM16, ATTN, HBM, TP, EP, CP = range(7)


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
    regather: float = 0.0  # LoRA input re-gather: backward all-gather bytes (TP link)
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

    def __add__(self, other: "LayerWork") -> "LayerWork":
        return LayerWork(**{f.name: _plus(getattr(self, f.name), getattr(other, f.name)) for f in fields(self)})

    def scaled(self, k: float) -> "LayerWork":
        return LayerWork(**{f.name: _times(getattr(self, f.name), k) for f in fields(self)})


def _plus(a, b):
    return tuple(x + y for x, y in zip(a, b)) if isinstance(a, tuple) else a + b


def _times(a, k):
    return tuple(x * k for x in a) if isinstance(a, tuple) else a * k


ZERO = LayerWork()


def _ring(n: int) -> float:
    return (n - 1) / n if n > 1 else 0.0


def _region(g8=0.0, g16=0.0, attn=0.0, hbm=0.0, tp=0.0, ep=0.0, cp=0.0) -> tuple[float, ...]:
    return (g8, g16, attn, hbm, tp, ep, cp)


def _blocks_regions(s: Shape, lay: Layout, st: Settings, block: str, dispatcher: str) -> dict[str, tuple]:
    """The forward demand of each region of one block, per token of the microbatch on this GPU (tokens =
    seq x MBS / CP), GEMMs already divided by TP."""
    t = lay.tp
    D = st.dtype_bytes
    sp = t if lay.sp else 1
    fp8 = st.fp8
    gi = FP8 if fp8 else D     # bytes of an all-gathered GEMM input (TE gathers the quantized norm output)

    def gemm(flops: float) -> tuple[float, float]:
        return (flops / t, 0.0) if fp8 else (0.0, flops / t)

    h = s.hidden
    tp_col_fwd = h * gi * _ring(t) if lay.sp else 0.0   # all-gather of a column-parallel input
    tp_row_fwd = h * D * _ring(t) if lay.sp else 2 * h * D * _ring(t)   # reduce-scatter (or all-reduce) after
    regions: dict[str, tuple] = {}
    norm = 2 * h * D / sp
    if block == "attn":
        regions["norm"] = _region(hbm=norm)
        causal = 1.0 if st.attention_scores else 0.5   # a non-fused attention computes every score and masks them
        keys = lay.seq * causal
        if s.mla:
            nq = s.heads
            dq = s.qk_head_dim + s.qk_pos_dim
            q_up = 2 * (s.q_lora_rank or h) * nq * dq   # the q up-projection, or q_proj without a q LoRA rank
            kv_up = 2 * s.kv_lora_rank * nq * (s.qk_head_dim + s.v_head_dim)
            down = 2 * h * (s.q_lora_rank or 0) + 2 * h * (s.kv_lora_rank + s.qk_pos_dim)
            regions["qkv"] = _region(*gemm(down), tp=tp_col_fwd)
            # multi_latent_attention.py qkv_up_proj_and_rope_apply (:846-940): the up-projections, RoPE on the
            # positional parts and the contiguous query, key and value it returns
            copies = 2 * nq * (2 * dq + s.v_head_dim) * D / t + 2 * (s.kv_lora_rank + (s.q_lora_rank or 0)) * D / sp
            regions["mla_up"] = _region(*gemm(q_up + kv_up), hbm=copies)
            attn = 2 * nq * (dq + s.v_head_dim) * keys / t
            kv_bytes = nq * (dq + s.v_head_dim) * D / t
            proj = 2 * nq * s.v_head_dim * h
        else:
            qkv = 2 * h * (s.heads + 2 * s.groups) * s.head_dim
            regions["qkv"] = _region(*gemm(qkv), tp=tp_col_fwd)
            rope = 2 * (s.heads + s.groups) * s.head_dim * D / t * (2 if s.qk_norm else 1)
            regions["rope"] = _region(hbm=rope)
            attn = 2 * s.heads * 2 * s.head_dim * keys / t
            kv_bytes = 2 * s.groups * s.head_dim * D / t
            proj = 2 * s.heads * s.head_dim * h
        softmax = 2 * s.heads / t * lay.seq * D if st.attention_scores else 0.0
        cp_fwd = (lay.cp - 1) * kv_bytes if lay.cp > 1 else 0.0
        regions["core_attn"] = _region(attn=attn, hbm=softmax, cp=cp_fwd)
        regions["proj"] = _region(*gemm(proj), tp=tp_row_fwd)
        regions["bda"] = _region(hbm=3 * h * D / sp)
    elif block == "mlp":
        up = (2 if s.gated else 1) * s.ffn
        regions["norm"] = _region(hbm=norm)
        regions["fc1"] = _region(*gemm(2 * h * up), tp=tp_col_fwd)
        regions["act"] = _region(hbm=(3 if s.gated else 2) * s.ffn * D / t)
        regions["fc2"] = _region(*gemm(2 * s.ffn * h), tp=tp_row_fwd)
        regions["bda"] = _region(hbm=3 * h * D / sp)
    elif block == "moe":
        routed = s.topk / sp * st.moe_load   # routed tokens per token of this GPU's sequence shard
        g = 2 if s.gated else 1
        regions["norm"] = _region(hbm=norm)
        regions["router"] = _region(g16=2 * h * s.experts / sp)
        # dispatch and combine: each routed token's hidden state to its expert and back (all-to-all over EP)
        a2a = 2 * routed * h * D * _ring(lay.ep)
        regions["permute"] = _region(hbm=(1 + s.topk) * h * D / sp * st.moe_load * 2, ep=a2a)
        regions["experts"] = _region(*gemm(s.topk * st.moe_load * (2 * h * g * s.moe_ffn + 2 * s.moe_ffn * h)))
        regions["moe_act"] = _region(hbm=routed * (3 if s.gated else 2) * s.moe_ffn * D)
        if s.shared_ffn:
            regions["shared"] = _region(*gemm(2 * h * g * s.shared_ffn + 2 * s.shared_ffn * h),
                                        hbm=(3 if s.gated else 2) * s.shared_ffn * D / t,
                                        tp=tp_col_fwd + tp_row_fwd)
        regions["bda"] = _region(hbm=3 * h * D / sp)
    elif block == "mamba":
        inner = s.mamba_heads * s.mamba_head_dim
        bc = 2 * s.mamba_groups * s.mamba_state
        regions["norm"] = _region(hbm=norm)
        regions["in_proj"] = _region(*gemm(2 * h * (2 * inner + bc + s.mamba_heads)), tp=tp_col_fwd)
        regions["conv"] = _region(attn=2 * s.mamba_conv * (inner + bc) / t, hbm=2 * (inner + bc) * D / t)
        regions["scan"] = _region(attn=7 * inner * s.mamba_state / t)
        regions["gate_norm"] = _region(hbm=5 * inner * D / t)
        regions["out_proj"] = _region(*gemm(2 * inner * h), tp=tp_row_fwd)
        regions["bda"] = _region(hbm=3 * h * D / sp)
    else:
        raise ValueError(f"unknown layer block {block!r}")
    return regions


LORA_BLOCK_TARGETS = {"attn": ("linear_qkv", "linear_proj"), "mlp": ("linear_fc1", "linear_fc2"),
                      "moe": ("linear_fc1", "linear_fc2"), "mamba": ("in_proj", "out_proj")}
# the LoRA targets whose column-parallel A reads a gathered norm output (core/rules REGATHER_SURFACES) per block
REGATHER_BLOCK = {"attn": "linear_qkv", "mlp": "linear_fc1", "moe": "linear_fc1"}


def _lora_flops(s: Shape, lay: Layout, st: Settings, block: str) -> float:
    """Forward FLOPs of the LoRA adapters on one block (A: in -> r, B: r -> out), per token per GPU."""
    if not st.lora_rank:
        return 0.0
    inner = s.mamba_heads * s.mamba_head_dim
    dims = {"linear_qkv": (s.hidden, (s.heads + 2 * s.groups) * s.head_dim),
            "linear_proj": (s.heads * s.head_dim, s.hidden),
            "linear_fc1": (s.hidden, (2 if s.gated else 1) * (s.moe_ffn if block == "moe" else s.ffn)),
            "linear_fc2": ((s.moe_ffn if block == "moe" else s.ffn), s.hidden),
            "in_proj": (s.hidden, 2 * inner + 2 * s.mamba_groups * s.mamba_state + s.mamba_heads),
            "out_proj": (inner, s.hidden)}
    per = s.topk if block == "moe" else 1
    return sum(2 * st.lora_rank * (dims[t][0] + dims[t][1]) * per / lay.tp
               for t in LORA_BLOCK_TARGETS[block] if t in st.lora_targets)


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
    "moe": {"moe": ("router", "permute", "experts", "moe_act", "shared")},   # moe/moe_layer.py :694-712
    "shared_experts": {"moe": ("shared",)},                    # moe/moe_layer.py :510-525
}
NOT_PRICED_LABELS = {"gdn_norm_out": "GatedDeltaNet layers are not in the memory model's Shape"}


def recompute_regions(s: Shape, label: str, block: str) -> tuple[str, ...]:
    regions = RECOMPUTE_REGIONS.get(label, {}).get(block, ())
    if label == "layernorm" and block == "attn" and s.mla:
        regions = ("norm",)
    return regions


@functools.lru_cache(maxsize=1024)
def layer_work(s: Shape, lay: Layout, st: Settings, kind: str, dispatcher: str = "alltoall",
               offloaded: bool = False) -> LayerWork:
    """One layer of ``kind`` ("attn+mlp", "attn+moe", or a hybrid block), one microbatch, one GPU: forward and
    backward demand, what selective recompute replays, and the whole forward (for full recompute).
    ``offloaded``: this layer's activations go to the host (layer-level CPU offload)."""
    tokens = _tokens(lay)
    frozen = st.lora_rank > 0
    k = 1.0 if frozen else 2.0             # backward GEMM FLOPs per forward FLOP (no weight gradient when frozen)
    ka = 2.0 if st.attention_scores else 2.5
    sp = lay.sp and lay.tp > 1
    D = st.dtype_bytes
    gi = FP8 if st.fp8 else D
    total = [0.0] * 7
    out = dict(f8=0.0, f16=0.0, fm=0.0, b8=0.0, b16=0.0, bm=0.0, attn=0.0, tp_f=0.0, tp_b=0.0, ep_f=0.0,
               ep_b=0.0, cp_f=0.0, cp_b=0.0, regather=0.0, r8=0.0, r16=0.0, rm=0.0, r_tp=0.0, r_ep=0.0, r_cp=0.0)
    labels = st.modules if st.recompute == "selective" else ()
    for block in kind.split("+"):
        regions = _blocks_regions(s, lay, st, block, dispatcher)
        lora = _lora_flops(s, lay, st, block)
        for name, r in regions.items():
            for i in range(7):
                total[i] += r[i]
            out["f8"] += r[GEMM8]
            out["f16"] += r[GEMM16] + r[ATTN]
            out["attn"] += r[ATTN] if name == "core_attn" else 0.0
            out["fm"] += r[HBM]
            out["b8"] += k * r[GEMM8]
            out["b16"] += (2.0 if name == "router" and not frozen else k) * r[GEMM16] + \
                (ka if name == "core_attn" else 2.0) * r[ATTN]
            out["bm"] += 1.5 * r[HBM]
            out["tp_f"] += r[TP]
            out["ep_f"] += r[EP]
            out["ep_b"] += r[EP]
            out["cp_f"] += r[CP]
            out["cp_b"] += 2 * r[CP]
        out["f16"] += lora
        out["b16"] += 2 * lora
        total[GEMM16] += lora
        # backward tensor-parallel collectives of the block (see the module docstring)
        n_col = n_row = 0
        if block in ("attn", "mlp", "mamba"):
            n_col, n_row = 1, 1
        elif block == "moe" and s.shared_ffn:
            n_col, n_row = 1, 1
        ring = _ring(lay.tp)
        if sp:
            regather_for_wgrad = 0 if frozen else n_col
            out["tp_b"] += s.hidden * ring * (n_col * D + n_row * D + regather_for_wgrad * gi)
            target = REGATHER_BLOCK.get(block)
            if frozen and target and target in st.lora_targets and target in st.lora_regather:
                # LoRA input re-gather: the base layer no longer hands the adapter its gathered norm output
                # (Bridge peft/utils.py:600-624 return_layernorm_output_gathered = not regather), the adapter's
                # own sequence-parallel ColumnParallelLinear gathers it (peft/utils.py:1202-1210), which is
                # megatron-core's LinearWithGradAccumulationAndAsyncCommunication: an all-gather in forward
                # (tensor_parallel/layers.py:566-571), one again in backward for the weight gradient (:610-620,
                # async, waited before the wgrad) and a reduce-scatter of its input gradient (:643-650). The
                # backward gather overlaps only LoRA-A's own rank-r data gradient: all three are on the path.
                out["regather"] += 3 * s.hidden * D * ring
        else:
            out["tp_b"] += 2 * s.hidden * D * ring * (n_col + n_row)
        for label in labels:
            for name in recompute_regions(s, label, block):
                if name not in regions:
                    continue
                r = regions[name]
                out["r8"] += r[GEMM8]
                out["r16"] += r[GEMM16] + r[ATTN]
                out["rm"] += r[HBM]
                out["r_tp"] += r[TP]
                out["r_ep"] += r[EP]
                out["r_cp"] += r[CP]
    d2h = h2d = 0.0
    if offloaded:
        # layer-level CPU offload (cpu_offloading): the layer's saved activations leave in forward and come back in
        # backward (transformer/cpu_offload.py via TE's CPU offload context, one copy each way)
        d2h = h2d = layer_activation(s, lay, st, kind)
    elif st.fine_grained_offload is not None and st.recompute != "full":
        from ..levers import layer_offload
        host = sum(layer_offload(s, lay, st, kind).host.values()) * tokens * st.fine_grained_offload.fraction
        d2h = h2d = host
    scaled = {key: value * tokens for key, value in out.items()}
    return LayerWork(**scaled, d2h=d2h, h2d=h2d, full=tuple(x * tokens for x in total))


def output_layer_work(s: Shape, lay: Layout, st: Settings, mtp: int = 0, wgrad_share: float = 1.0) -> LayerWork:
    """The last stage's output layer (a bf16 ColumnParallelLinear, models/gpt/gpt_model.py) and its loss, once per
    MTP depth too, per microbatch per GPU; the loss reads the logits and writes their gradient (st.logits_bytes).
    ``wgrad_share``: the share of microbatches whose output-layer weight gradient runs in the steady state (the
    rest deferred to the flush: defer_embedding_wgrad_compute)."""
    tokens = _tokens(lay)
    frozen = st.lora_rank > 0
    depths = 1 + mtp
    out = 2 * s.hidden * s.vocab / lay.tp * depths
    fm = (st.logits_bytes + st.dtype_bytes) * s.vocab / lay.tp * depths
    f16 = out + mtp_eh(s, lay, mtp)
    b16 = f16 if frozen else 2.0 * f16 - (1.0 - wgrad_share) * out
    return LayerWork(f16=f16 * tokens, fm=fm * tokens, b16=b16 * tokens,
                     bm=0.5 * fm * tokens, full=(0.0, f16 * tokens, 0.0, fm * tokens, 0.0, 0.0, 0.0))


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
