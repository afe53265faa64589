"""The memory plan: per-GPU bytes for the most-loaded GPU, before and after each overlay.

Shaped like Bridge's ``training/utils/theoretical_memory_utils.py``: pure functions over
frozen dataclasses, assumptions returned as data, formatting kept separate. Bridge's
estimator ignores recompute, offload, SP, LoRA and precision (bridge-config-surface.md §5);
this model accounts for each, term by term, from what the training step keeps alive.

Units: bytes. "Per token" terms are multiplied by the tokens a GPU holds per microbatch
(seq x MBS / CP) and by the microbatches in flight on the pipeline stage.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

BF16 = 2            # bytes per bf16/fp16 element
FP32 = 4
FP8 = 1
ADAM_MOMENTS = 2    # exp_avg and exp_avg_sq
# At the loss, megatron-core holds the bf16 logits and their fp32 copy at once (cross_entropy.py:
# calculate_logits_max does logits.float(); exp_logits (fp32) is saved for backward).
LOGITS_BYTES = BF16 + FP32

ASSUMPTIONS = (
    "allocated memory only: allocator fragmentation (reserved-but-unallocated) is not modelled; "
    "expandable_segments therefore shows 0 B of change although it is the fix for that gap",
    "CUDA context, NCCL communicators and cuBLAS/TE workspaces are outside torch's allocated memory and not counted",
    "attention uses a fused/flash kernel (TE default): only softmax statistics are kept, so core_attn recompute "
    "saves almost nothing; an unfused backend would keep the s x s scores",
    "linear-layer inputs are kept for the weight gradient; with FP8 they are kept in FP8 (1 byte)",
    "frozen (LoRA base) GEMMs still keep their inputs, as trainable ones do; under SP a column-parallel LoRA-A "
    "additionally keeps the full gathered input unless input re-gather lets it reuse the sequence-local shard "
    "(consistent with the measured Qwen3-8B re-gather saving: one gathered bf16 copy per eligible adapter and layer)",
    "MoE tokens are balanced across experts; capacity factor and token imbalance are not modelled",
    "activation CPU offload removes the offloaded layers' activations from the GPU (double buffering adds one layer back)",
    "the peak is taken at the end of the pipeline warm-up, when the most microbatches are in flight",
)


# ----------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    gated: bool = True
    tied: bool = False
    experts: int = 0
    moe_ffn: int = 0
    topk: int = 0
    shared_ffn: int = 0
    moe_layers: int = 0           # how many of the layers are MoE
    mla: bool = False
    qk_head_dim: int = 0
    qk_pos_dim: int = 0
    v_head_dim: int = 0
    kv_lora_rank: int = 0
    q_lora_rank: int = 0


@dataclass(frozen=True)
class Layout:
    world: int
    tp: int = 1
    pp: int = 1
    vpp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    sp: bool = False
    seq: int = 4096
    mbs: int = 1
    gbs: int = 1

    @property
    def dp(self) -> int:
        return max(1, self.world // (self.tp * self.pp * self.cp))

    @property
    def microbatches(self) -> int:
        return max(1, self.gbs // (self.mbs * self.dp))


@dataclass(frozen=True)
class Settings:
    recompute: str | None = None              # None | "selective" | "full"
    modules: tuple[str, ...] = ()
    recompute_method: str | None = None
    recompute_layers: int = 1
    cpu_offload_layers: int = 0
    cpu_offload_double_buffer: bool = False
    dist_optimizer: bool = False
    optimizer_offload: float = 0.0
    grad_bytes: int = FP32
    param_bytes: int = BF16
    state_bytes: int = FP32                   # exp_avg / exp_avg_sq (bf16 with the precision-aware optimizer)
    master_bytes: int = FP32
    fp8: bool = False
    lora_rank: int = 0                        # 0: full training
    lora_targets: tuple[str, ...] = ()
    lora_regather: tuple[str, ...] = ()       # targets that really re-gather (see rules.regather_fallbacks)


@dataclass(frozen=True)
class Breakdown:
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    other: float
    detail: tuple[tuple[str, float], ...] = ()

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations + self.other

    def as_dict(self) -> dict[str, float]:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer": self.optimizer,
                "activations": self.activations, "other": self.other, "total": self.total}


# ----------------------------------------------------------------------------- parameters
def _attention_params(s: Shape) -> float:
    if s.mla:
        q = s.hidden * s.heads * (s.qk_head_dim + s.qk_pos_dim) if not s.q_lora_rank else \
            s.hidden * s.q_lora_rank + s.q_lora_rank * s.heads * (s.qk_head_dim + s.qk_pos_dim)
        kv = s.hidden * (s.kv_lora_rank + s.qk_pos_dim) + s.kv_lora_rank * s.heads * (s.qk_head_dim + s.v_head_dim)
        return q + kv + s.heads * s.v_head_dim * s.hidden
    return s.hidden * (s.heads + 2 * s.groups) * s.head_dim + s.heads * s.head_dim * s.hidden


def _mlp_params(hidden: int, ffn: int, gated: bool) -> float:
    return (3 if gated else 2) * hidden * ffn


def stage_params(s: Shape, lay: Layout, first: bool, last: bool) -> tuple[float, float, float]:
    """(transformer-layer params, embedding/output params, expert params) on one GPU of a pipeline stage."""
    per_stage = s.layers / lay.pp
    moe_per_stage = s.moe_layers / lay.pp
    dense_layers = per_stage - moe_per_stage
    dense = per_stage * (_attention_params(s) / lay.tp + 2 * s.hidden)
    dense += dense_layers * _mlp_params(s.hidden, s.ffn, s.gated) / lay.tp
    expert = 0.0
    if s.experts:
        dense += moe_per_stage * (s.hidden * s.experts + _mlp_params(s.hidden, s.shared_ffn, s.gated) / lay.tp)
        expert = moe_per_stage * s.experts * _mlp_params(s.hidden, s.moe_ffn, s.gated) / (lay.ep * lay.etp)
    embed = 0.0
    if first:
        embed += s.vocab * s.hidden / lay.tp
    if last and (not s.tied or lay.pp > 1):
        embed += s.vocab * s.hidden / lay.tp
    return dense, embed, expert


def lora_params(s: Shape, lay: Layout, st: Settings) -> float:
    if not st.lora_rank:
        return 0.0
    dims = {"linear_qkv": (s.hidden, (s.heads + 2 * s.groups) * s.head_dim),
            "linear_proj": (s.heads * s.head_dim, s.hidden),
            "linear_fc1": (s.hidden, (2 if s.gated else 1) * s.ffn), "linear_fc2": (s.ffn, s.hidden)}
    per_layer = sum(st.lora_rank * (i + o) / lay.tp for t, (i, o) in dims.items() if t in st.lora_targets)
    return per_layer * s.layers / lay.pp


def model_state(s: Shape, lay: Layout, st: Settings, first: bool, last: bool) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer) bytes on one GPU of the stage."""
    layer_params, embed, expert = stage_params(s, lay, first, last)
    dense = layer_params + embed
    adapters = lora_params(s, lay, st)
    frozen = st.lora_rank > 0
    trainable_dense = adapters if frozen else dense
    trainable_expert = 0.0 if frozen else expert
    # FP8 parameters (fp8_param_gather) cover transformer-layer GEMM weights; embeddings stay bf16.
    params = (layer_params + expert) * st.param_bytes + embed * BF16 + adapters * BF16
    grads = (trainable_dense + trainable_expert) * st.grad_bytes
    per_param_state = st.master_bytes + ADAM_MOMENTS * st.state_bytes
    dense_shards = lay.dp * lay.cp if st.dist_optimizer else 1
    expert_dp = max(1, lay.world // (lay.pp * lay.ep * lay.etp))
    expert_shards = expert_dp if st.dist_optimizer else 1
    opt = (trainable_dense / dense_shards + trainable_expert / expert_shards) * per_param_state
    return params, grads, opt * (1.0 - st.optimizer_offload)


# ----------------------------------------------------------------------------- activations
def layer_activation_terms(s: Shape, lay: Layout, st: Settings, moe_layer: bool) -> dict[str, float]:
    """Bytes kept per token of one microbatch for one transformer layer on one GPU (before recompute)."""
    t = lay.tp
    sp_div = t if lay.sp else 1   # LayerNorm-region tensors are split across TP only with SP
    gemm_in = FP8 if st.fp8 else BF16
    terms: dict[str, float] = {"layernorm_inputs": 2 * BF16 * s.hidden / sp_div}
    # inputs of the QKV and FC1 GEMMs (layernorm outputs), kept for their weight gradients
    terms["layernorm_outputs"] = 2 * gemm_in * s.hidden / sp_div
    if s.mla:
        terms["attention_qkv"] = BF16 * s.heads * (2 * (s.qk_head_dim + s.qk_pos_dim) + s.v_head_dim) / t
        terms["mla_up_proj_inputs"] = BF16 * (s.kv_lora_rank + (s.q_lora_rank or 0)) / sp_div
    else:
        terms["attention_qkv"] = BF16 * (s.heads + 2 * s.groups) * s.head_dim / t
    terms["attention_softmax_stats"] = FP32 * s.heads / t
    terms["attention_output"] = gemm_in * s.heads * (s.v_head_dim or s.head_dim) / t
    if moe_layer:
        routed = s.topk / lay.etp
        terms["moe_permuted_input"] = routed * BF16 * s.hidden
        terms["moe_fc1_output"] = routed * BF16 * (2 if s.gated else 1) * s.moe_ffn
        terms["moe_act_output"] = routed * gemm_in * s.moe_ffn
        terms["moe_router"] = FP32 * s.experts
        if s.shared_ffn:
            terms["shared_expert"] = (BF16 * (2 if s.gated else 1) + gemm_in) * s.shared_ffn / t
    else:
        terms["mlp_fc1_output"] = BF16 * (2 if s.gated else 1) * s.ffn / t
        terms["mlp_act_output"] = gemm_in * s.ffn / t
    if st.lora_rank:
        # Under SP, LoRA-A of a column-parallel target (QKV, FC1) keeps the full gathered LayerNorm output
        # until backward; input re-gather keeps only the sequence-local shard, which the base GEMM keeps
        # anyway (memory-tuning skill, PEFT + SP input re-gather). Without SP, and for row-parallel
        # targets, LoRA-A reads the tensor the base layer already keeps.
        if lay.sp:
            for target in ("linear_qkv", "linear_fc1"):
                if target in st.lora_targets and target not in st.lora_regather \
                        and not (moe_layer and target == "linear_fc1"):
                    terms[f"lora_a_gathered_input_{target}"] = BF16 * s.hidden
        terms["lora_intermediates"] = 2 * BF16 * st.lora_rank * len(st.lora_targets)
    return terms


RECOMPUTE_DROPS = {  # selective label -> terms it discards (activation-recompute skill, Decision Table)
    "core_attn": ("attention_softmax_stats",),
    "mlp": ("mlp_fc1_output", "mlp_act_output"),
    "layernorm": ("layernorm_outputs",),
    "moe_act": ("moe_act_output",),
    "moe": ("moe_permuted_input", "moe_fc1_output", "moe_act_output", "moe_router", "shared_expert"),
    "shared_experts": ("shared_expert",),
    "mla_up_proj": ("attention_qkv",),
}


def layer_activation(s: Shape, lay: Layout, st: Settings, moe_layer: bool) -> float:
    terms = layer_activation_terms(s, lay, st, moe_layer)
    if st.recompute == "selective":
        for label in st.modules:
            for name in RECOMPUTE_DROPS.get(label, ()):
                terms.pop(name, None)
    return sum(terms.values()) * lay.seq * lay.mbs / lay.cp


def in_flight(lay: Layout, rank: int) -> float:
    """Layer-microbatches of activations alive on pipeline rank ``rank``, in units of 'all this stage's layers'."""
    m = lay.microbatches
    if lay.pp == 1:
        return 1.0
    if lay.vpp > 1:  # interleaved 1F1B: warm-up chunks, each 1/vpp of the stage's layers (Megatron schedules)
        chunks = min((lay.pp - rank - 1) * 2 + (lay.vpp - 1) * lay.pp + 1, m * lay.vpp)
        return chunks / lay.vpp
    return float(min(lay.pp - rank, m))


def stage_activations(s: Shape, lay: Layout, st: Settings, rank: int) -> tuple[float, list[tuple[str, float]]]:
    per_stage = s.layers / lay.pp
    moe_frac = (s.moe_layers / s.layers) if s.layers else 0.0
    per_layer = (1 - moe_frac) * layer_activation(s, lay, st, False) + moe_frac * layer_activation(s, lay, st, True)
    full_layer = per_layer
    mbs_alive = in_flight(lay, rank)
    detail: list[tuple[str, float]] = []
    if st.recompute == "full":
        # Only each checkpointed group's input survives; one group is re-materialized at a time.
        boundary = 2 * BF16 * s.hidden / (lay.tp if lay.sp else 1) * lay.seq * lay.mbs / lay.cp
        n = max(1, st.recompute_layers)
        if st.recompute_method == "block":
            ckpt = min(per_stage / lay.vpp, n) * lay.vpp
            kept = (per_stage - ckpt) * per_layer + ckpt * boundary
        else:
            kept = per_stage / n * boundary
        acts = kept * mbs_alive + n * full_layer
        detail.append(("full recompute working set", n * full_layer))
    else:
        layers_on_gpu = per_stage
        if st.cpu_offload_layers:
            layers_on_gpu -= min(per_stage, st.cpu_offload_layers) - (1 if st.cpu_offload_double_buffer else 0)
        acts = layers_on_gpu * per_layer * mbs_alive
    tokens = lay.seq * lay.mbs / lay.cp
    if rank == 0:
        acts += BF16 * s.hidden * tokens * mbs_alive / (lay.tp if lay.sp else 1)  # embedding output
    if rank == lay.pp - 1:
        logits = LOGITS_BYTES * s.vocab / lay.tp * tokens
        detail.append(("logits (fp32, last stage)", logits))
        acts += logits
    return acts, detail


# ----------------------------------------------------------------------------- the most-loaded GPU
def estimate(s: Shape, lay: Layout, st: Settings) -> Breakdown:
    best: Breakdown | None = None
    for rank in sorted({0, lay.pp - 1}):
        p, g, o = model_state(s, lay, st, first=rank == 0, last=rank == lay.pp - 1)
        a, detail = stage_activations(s, lay, st, rank)
        other = 0.0
        if st.dist_optimizer and lay.dp * lay.cp > 1:
            # overlap_param_gather keeps one bucket's all-gathered params (Megatron bucket_size 40M params)
            other += min(40e6, (p / st.param_bytes)) * st.param_bytes
        b = Breakdown(p, g, o, a, other, tuple(detail) + (("pipeline rank", rank),))
        if best is None or b.total > best.total:
            best = b
    return best


# ----------------------------------------------------------------------------- from a Bridge config
def _dtype_bytes(dtype: Any, default: int) -> int:
    name = str(dtype)
    return {"torch.float32": FP32, "torch.bfloat16": BF16, "torch.float16": BF16, "torch.uint8": FP8}.get(name, default)


def from_config(cfg: Any, world: int) -> tuple[Shape, Layout, Settings]:
    from .engine import View, read
    from .rules import mixed_precision_config, regather_fallbacks
    m = cfg.model
    layers = m.num_layers
    freq = getattr(m, "moe_layer_freq", 1)
    experts = getattr(m, "num_moe_experts", None) or 0
    if not experts:
        moe_layers = 0
    elif isinstance(freq, int):
        moe_layers = sum(1 for i in range(layers) if i % freq == 0)
    else:
        moe_layers = sum(int(x) for x in freq)
    vocab = int(getattr(m, "vocab_size", 0) or 0)
    div = int(getattr(m, "make_vocab_size_divisible_by", 128) or 128) * m.tensor_model_parallel_size
    vocab = int(math.ceil(vocab / div) * div) if vocab else 0
    shape = Shape(
        layers=layers, hidden=m.hidden_size, ffn=m.ffn_hidden_size or 4 * m.hidden_size, heads=m.num_attention_heads,
        groups=m.num_query_groups or m.num_attention_heads, head_dim=m.kv_channels or m.hidden_size // m.num_attention_heads,
        vocab=vocab, gated=bool(getattr(m, "gated_linear_unit", False)),
        tied=bool(getattr(m, "share_embeddings_and_output_weights", False)),
        experts=experts, moe_ffn=getattr(m, "moe_ffn_hidden_size", 0) or 0, topk=getattr(m, "moe_router_topk", 0) or 0,
        shared_ffn=getattr(m, "moe_shared_expert_intermediate_size", 0) or 0, moe_layers=moe_layers,
        mla=bool(getattr(m, "multi_latent_attention", False)), qk_head_dim=getattr(m, "qk_head_dim", 0) or 0,
        qk_pos_dim=getattr(m, "qk_pos_emb_head_dim", 0) or 0, v_head_dim=getattr(m, "v_head_dim", 0) or 0,
        kv_lora_rank=getattr(m, "kv_lora_rank", 0) or 0, q_lora_rank=getattr(m, "q_lora_rank", 0) or 0)
    lay = Layout(world=world, tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size,
                 vpp=m.virtual_pipeline_model_parallel_size or 1, cp=m.context_parallel_size,
                 ep=getattr(m, "expert_model_parallel_size", 1) or 1,
                 etp=getattr(m, "expert_tensor_parallel_size", None) or 1,
                 sp=bool(m.sequence_parallel) and m.tensor_model_parallel_size > 1,
                 seq=m.seq_length, mbs=cfg.train.micro_batch_size, gbs=cfg.train.global_batch_size)
    mp = mixed_precision_config(getattr(cfg, "mixed_precision", None))
    grad_fp32 = getattr(mp, "grad_reduce_in_fp32", None)
    if grad_fp32 is None:
        grad_fp32 = bool(read(cfg, "ddp.grad_reduce_in_fp32", True))
    opt = cfg.optimizer
    precision_aware = bool(getattr(opt, "use_precision_aware_optimizer", False))
    peft = getattr(cfg, "peft", None)
    regather: tuple[str, ...] = ()
    if peft is not None and getattr(peft, "sequence_parallel_input_regather", False):
        view = View(cfg, {}, {}, world, (), {})
        regather = tuple(t for t, r in regather_fallbacks(view).items() if r is None)
    settings = Settings(
        recompute=m.recompute_granularity,
        modules=tuple(m.recompute_modules if m.recompute_modules is not None else ["core_attn"])
        if m.recompute_granularity == "selective" else (),
        recompute_method=m.recompute_method, recompute_layers=m.recompute_num_layers or 1,
        cpu_offload_layers=(m.cpu_offloading_num_layers if m.cpu_offloading and m.cpu_offloading_activations else 0),
        cpu_offload_double_buffer=bool(getattr(m, "cpu_offloading_double_buffering", False)),
        dist_optimizer=bool(opt.use_distributed_optimizer or read(cfg, "ddp.use_distributed_optimizer", False)),
        optimizer_offload=float(opt.optimizer_offload_fraction or 0.0) if opt.optimizer_cpu_offload else 0.0,
        grad_bytes=FP32 if grad_fp32 else BF16,
        param_bytes=FP8 if (getattr(m, "fp8_param", False) or getattr(mp, "fp8_param_gather", False)) else BF16,
        state_bytes=_dtype_bytes(getattr(opt, "exp_avg_dtype", None), FP32) if precision_aware else FP32,
        master_bytes=_dtype_bytes(getattr(opt, "main_params_dtype", None), FP32) if precision_aware else FP32,
        fp8=bool(getattr(mp, "fp8", None) or getattr(m, "fp8", None)),
        lora_rank=int(getattr(peft, "dim", 0) or 0) if type(peft).__name__ in ("LoRA", "DoRA") else 0,
        lora_targets=tuple(getattr(peft, "target_modules", ()) or ()),
        lora_regather=regather)
    return shape, lay, settings


# ----------------------------------------------------------------------------- steps
@dataclass(frozen=True)
class Step:
    name: str                 # "baseline" or the overlay added at this step
    breakdown: Breakdown
    note: str = ""

    def as_dict(self, previous: "Step | None") -> dict[str, Any]:
        d = {"name": self.name, **{k: int(v) for k, v in self.breakdown.as_dict().items()}}
        d["total_bytes"] = d.pop("total")
        d["delta_bytes"] = 0 if previous is None else int(self.breakdown.total - previous.breakdown.total)
        if self.note:
            d["note"] = self.note
        return d


@dataclass(frozen=True)
class Plan:
    recipe: str
    world: int
    layout: Layout
    steps: tuple[Step, ...]
    capacity: float | None
    margin: float
    bridge_estimate: float | None
    assumptions: tuple[str, ...] = ASSUMPTIONS

    @property
    def total(self) -> float:
        return self.steps[-1].breakdown.total

    def fits(self, step: Step) -> bool | None:
        return None if self.capacity is None else step.breakdown.total <= self.capacity * (1 - self.margin)

    def as_dict(self) -> dict[str, Any]:
        steps = []
        for i, s in enumerate(self.steps):
            d = s.as_dict(self.steps[i - 1] if i else None)
            d["fits"] = self.fits(s)
            steps.append(d)
        return {"recipe": self.recipe, "world_size": self.world,
                "layout": {k: getattr(self.layout, k) for k in ("tp", "pp", "vpp", "cp", "ep", "sp", "seq", "mbs", "gbs")}
                | {"dp": self.layout.dp, "microbatches": self.layout.microbatches},
                "total_bytes": int(self.total), "capacity_bytes": None if self.capacity is None else int(self.capacity),
                "margin": self.margin, "fits": self.fits(self.steps[-1]),
                "bridge_estimator_bytes": None if self.bridge_estimate is None else int(self.bridge_estimate),
                "steps": steps, "assumptions": list(self.assumptions)}


STEP_NOTES = {"expandable_segments": "no change in allocated memory; removes fragmentation (reserved-but-unallocated)"}
