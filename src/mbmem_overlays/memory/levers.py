"""The memory levers issue 31 made overlays, as the plan counts them: Megatron FSDP's buffer dtypes, fine-grained
activation offloading, and the precision-aware optimizer's moment dtypes.

Pure functions over the model's frozen dataclasses (inputs.py), each term cited to megatron-core 0.19.2 as installed
in ``.venv`` (``megatron/core/...``) or Megatron Bridge 0.6.2 (``megatron/bridge/...``). ``apply_config`` is the
one hook ``model.from_config`` calls: it reads the fields below from a Bridge ``ConfigContainer`` into ``Settings``;
``offloaded_activations`` is the one hook ``stage_activations`` calls. What FSDP shards (parameters, gradients,
optimizer state by ``data_parallel_sharding_strategy``) and the units it gathers (the current and the prefetched
layer) were already in model.py (``FSDP_SHARDS``, ``communication_buffers``); bf16 moments already halved the
moments (``Settings.state_bytes``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

# the model's own files, not its model.py name space (which imports from_config, which calls apply_config here)
from . import variants
from .activations import RECOMPUTE_DROPS, _selected_terms, layer_activation_terms
from .graphs import GRAPH_SCOPE_TERMS, graphed_blocks
from .inputs import BF16, FP8, FP32, Layout, Settings, Shape, _tokens
from .pipeline import blocks_of, layer_kinds, rank_alive, rank_chunks, rank_layers
from .weights import data_parallel_shards

# megatron-core transformer_config.py:1247 (min_offloaded_tensor_size default, in elements) and :1262
# (activation_offload_fraction default)
MIN_OFFLOADED_ELEMENTS = 1024 * 1024
GPUS_PER_NODE = 8   # what "per node" assumes (DGX/HGX H100, H200, B200 nodes); the plan has no node size


@dataclass(frozen=True)
class FineGrainedOffload:
    """model.fine_grained_activation_offloading as megatron-core runs it (Settings.fine_grained_offload)."""
    modules: tuple[str, ...]                   # model.offload_modules
    fraction: float = 1.0                      # model.activation_offload_fraction
    min_elements: int = MIN_OFFLOADED_ELEMENTS  # model.min_offloaded_tensor_size
    graph_modules: tuple[str, ...] = ()        # model.cuda_graph_modules (as TransformerLayer reads them)
    delta_bytes: int = 0                       # model.delta_offload_bytes_across_pp_ranks (kept per PP rank)

    def __post_init__(self):
        # megatron-core only asks whether a module is in offload_modules (transformer_layer.py _set_offload_modules:
        # `"core_attn" in self.config.offload_modules`): a module named twice offloads once (issue 39 #13). Every
        # way the plan builds this (a config, the ladder, the search) passes here.
        object.__setattr__(self, "modules", tuple(dict.fromkeys(str(m) for m in self.modules)))
        object.__setattr__(self, "graph_modules", tuple(dict.fromkeys(str(m) for m in self.graph_modules)))


# offload_modules label -> the activation terms (model.layer_activation_terms) whose saved tensors its
# saved-tensor hooks move to pinned host memory (pipeline_parallel/fine_grained_activation_offload.py
# PipelineOffloadManager.on_save_for_backward -> ChunkOffloadHandler.tensor_push / bulk_offload_group), and the
# code where each context is entered.
OFFLOAD_TERMS = {
    # transformer_layer.py:631-706: the separate input norm saves the layer input (residual stream: the attention
    # block's "<block>_layernorm_input", _captured_names); _set_offload_modules (:1442) turns it off when
    # input_layernorm is an IdentityOp (TE's norm fused into linear_qkv, the GPT specs: models/gpt/gpt_layer_specs.py;
    # the gated delta net's in_proj: separate_input_norm) or under an attn CUDA graph (:1460)
    "attn_norm": ("attn_layernorm_input",),
    # attention.py:1385-1394: get_query_key_value_tensors under the hooks: linear_qkv's saved input (the norm
    # output; with TE's fused norm also the norm's input), q/k norm inputs (:1920-1924), MLA's up-projection inputs
    "qkv_linear": ("attention_layernorm_output", "attention_qk_norm_inputs", "mla_up_proj_inputs"),
    # attention.py:1541-1596 (MLA: multi_latent_attention.py:380-431): the fused kernel's saved q, k, v
    # (force-released), softmax statistics and its own output; a non-fused attention's saved probabilities
    # (attention_scores: TE backends.py UnfusedDotProductAttention.forward, megatron-core dot_product_attention.py
    # :194-239) and q, k, v, but not its output (NON_FUSED_CORE_ATTN); bypassed when core_attn is recomputed (the
    # checkpointed path, :1546)
    "core_attn": ("attention_qkv", "attention_softmax_stats", "attention_kernel_output", "attention_output",
                  "attention_scores"),
    # attention.py:1615-1618: linear_proj's saved input, core_attn_out force-released
    "attn_proj": ("attention_output", "attention_output_fp8"),
    # transformer_layer.py:763-773, :998-1004: a separate pre-MLP norm (MoE layers) saves the residual stream;
    # off for an IdentityOp (dense TE layers) and under attn or moe_router graphs (:1469-1475)
    "mlp_norm": ("moe_layernorm_input",),
    # moe/experts.py:792-803: the grouped FC1's saved input, force-released
    "expert_fc1": ("moe_permuted_input",),
    # moe/experts.py:805-901: the activation's saved input (FC1's output, force-released) and its own copies
    "moe_act": ("moe_fc1_output", "moe_silu_output", "moe_glu_linear_input", "moe_glu_clamped_input",
                "moe_probs_mul_input"),
    # moe/experts.py:673-711: the whole fused grouped MLP (TE op fuser)
    "fused_group_mlp": ("moe_permuted_input", "moe_fc1_output", "moe_silu_output", "moe_glu_linear_input",
                        "moe_glu_clamped_input", "moe_probs_mul_input", "moe_act_output"),
}
# Terms that stay on the GPU although a module's hooks copy them to the host: another module keeps the same tensor
# (the bf16 attention output is also linear_proj's saved input unless attn_proj offloads and releases it).
SHARED_WITH = {"attention_output": "attn_proj"}
_FP32_TERMS = ("attention_softmax_stats", "moe_router")
# A non-fused attention saves its probabilities and q, k, v, not its output (the bmm with v makes it): the output is
# only linear_proj's saved input, attn_proj's group (TE backends.py UnfusedDotProductAttention.forward, :684)
NON_FUSED_CORE_ATTN = ("attention_qkv", "attention_scores")
# The modules of each block of a layer: a layer's forward holds one block's groups at a time (the attention block's
# commit after self_attn_bda, transformer_layer.py:697-702; the MLP block's after mlp_bda, :998-1004)
ATTENTION_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj")
MLP_MODULES = ("mlp_norm", "expert_fc1", "moe_act", "fused_group_mlp")


def _element_bytes(term: str) -> int:
    return FP32 if term in _FP32_TERMS else FP8 if term.endswith("_fp8") else BF16


def offload_from_config(m: Any) -> FineGrainedOffload | None:
    """Settings.fine_grained_offload from a Bridge model config (None: off)."""
    if not bool(getattr(m, "fine_grained_activation_offloading", False)):
        return None
    modules = tuple(str(x) for x in (getattr(m, "offload_modules", None) or ()))
    graphs = getattr(m, "cuda_graph_modules", None) or ()
    if isinstance(graphs, str):   # transformer_config.py:1047: one name ("full" by default) or a list
        graphs = (graphs,)
    graphs = tuple(str(getattr(x, "name", x)) for x in graphs)
    return FineGrainedOffload(
        modules=modules, fraction=float(getattr(m, "activation_offload_fraction", 1.0) or 0.0),
        min_elements=int(getattr(m, "min_offloaded_tensor_size", MIN_OFFLOADED_ELEMENTS) or 0), graph_modules=graphs,
        delta_bytes=int(getattr(m, "delta_offload_bytes_across_pp_ranks", 0) or 0))


# The attention blocks whose forward enters the qkv_linear / core_attn / attn_proj offload contexts: softmax
# attention (attention.py Attention.forward :1385, :1541, :1615; a hybrid stack's "*") and MLA
# (multi_latent_attention.py MultiLatentAttention.forward :343, :380, :462; a hybrid stack's "+"). The gated delta
# net (ssm/gated_delta_net/gdn.py GatedDeltaNet.forward :64-278) and DSA's AbsorbedMLASelfAttention
# (experimental_attention_variant/absorbed_mla.py forward :791-904, get_query_key_value_tensors :390-674, its own
# _checkpointed_attention_forward :737-789, and DSAttention in dsa.py) enter none: their saved tensors stay on the
# GPU whatever offload_modules says (Attention.__init__ sets offload_qkv_linear & co., :397-410, but only
# Attention.forward reads them)
HOOKED_ATTENTION = ("attn", "mla")
ATTENTION_BLOCKS = ("attn", "mla", *variants.VARIANT_BLOCKS)


def attention_block(kind: str) -> str:
    """The attention block of a layer of ``kind`` ("" for a layer without one: a hybrid stack's M, -, E)."""
    first = blocks_of(kind)[0]
    return first if first in ATTENTION_BLOCKS else ""


def separate_input_norm(s: Shape, block: str) -> bool:
    """Whether the layer of attention ``block`` has an input norm of its own (a TENorm, not the IdentityOp of a
    norm fused into the first GEMM), whose saved input attn_norm offloads (transformer_layer.py
    _set_offload_modules :1442-1444): MLA in a GPT model (gpt_layer_specs.py) and a hybrid stack's "+"
    (hybrid_layer_specs.py mla_layer :171-193), DSA in both (experimental_attention_variant_module_specs.py
    get_dsa_module_spec_for_backend metainfo fuse_input_layernorm False :127, read at :245-249; hybrid_layer_specs.py
    dsa_layer :137-170); not softmax attention with TE's fused norm, nor the gated delta net (fuse_input_layernorm
    True :76; the hybrid gdn_layer sets no input_layernorm: IdentityOp)."""
    if block == "attn":
        return s.mla          # Shape.mla: multi_latent_attention in a GPT model (a hybrid's "*" is never MLA)
    return block in ("mla", variants.DSA, variants.DSA_SHARED)


def _captured_names(s: Shape, st: Settings, kind: str, module: str) -> list[str]:
    """The activation terms whose saved tensors ``module``'s hooks capture in a layer of ``kind`` (before the size
    and CUDA graph filters of layer_offload)."""
    off = st.fine_grained_offload
    recomputed = set(st.modules) if st.recompute == "selective" else set()
    names = list(OFFLOAD_TERMS.get(module, ()))
    block = attention_block(kind)
    separate = separate_input_norm(s, block)
    if module in ("qkv_linear", "core_attn", "attn_proj") and block not in HOOKED_ATTENTION:
        return []
    if module == "attn_norm":
        # the layer input the separate norm saves: "<block>_layernorm_input" (activations.layer_activation_terms)
        names = [f"{block}_layernorm_input"] if separate and "attn" not in off.graph_modules else []
    if module == "qkv_linear" and not separate:
        names.append(f"{block}_layernorm_input")   # TE's LayerNormLinear saves the norm's input too
    if module == "core_attn":
        if "core_attn" in recomputed:
            names = []
        elif st.attention_scores:
            names = [n for n in names if n in NON_FUSED_CORE_ATTN]
    if module == "mlp_norm" and ("moe" not in blocks_of(kind) or {"attn", "moe_router"} & set(off.graph_modules)):
        names = []
    return names


@dataclass(frozen=True)
class LayerOffload:
    """Fine-grained offloading in one layer of one microbatch, bytes per token (layer_offload)."""
    gpu: dict[str, float]       # stored terms the GPU no longer holds once their groups commit
    host: dict[str, float]      # what the hooks copy to the host, one entry per copy; backward reloads each copy
    attention_live: float       # the attention block's captured tensors, alive in its forward until they commit
    mlp_live: float             # the MLP block's
    scores_transient: float     # non-fused core_attn offloaded: one s x s tensor beside the probabilities


def layer_offload(s: Shape, lay: Layout, st: Settings, kind: str) -> LayerOffload:
    """What the offload hooks take from one layer of ``kind`` and one microbatch, before the fraction, the groups
    megatron-core keeps and the working set (offloaded_activations).

    Only terms that survive selective recompute leave the stored activations (what a recomputed module drops is
    not saved at all), only tensors of at least min_offloaded_tensor_size elements are copied
    (ChunkOffloadHandler tensor_need_offloading_checker, fine_grained_activation_offload.py:986-999), and none
    inside a captured CUDA graph scope (those are graph-pool memory, not allocated: model.GRAPH_SCOPE_TERMS).

    The host side counts one copy per saved tensor: bulk_offload_group (:1002-1034) copies every tensor the group's
    hooks captured on its own, and backward reloads each into a new GPU tensor (reload, :849-862). Two saves of one
    tensor are two copies: a non-fused attention's probabilities, which the fused softmax saves as its output and
    the bmm with v as its input when no dropout makes a new tensor in between (TE v2.17.1
    attention/dot_product_attention/softmax.py ScaledMaskedSoftmax.forward :107; backends.py
    UnfusedDotProductAttention.forward, the bmm at :684), and the attention output that both core_attn's and
    attn_proj's groups capture. MLA's up-projection recompute drops q, k, v from the stored activations, but only
    after core attention (multi_latent_attention.py:456): core_attn's commit (:429) has copied them first."""
    off = st.fine_grained_offload
    if off is None or st.recompute == "full":
        return LayerOffload({}, {}, 0.0, 0.0, 0.0)
    terms = _selected_terms(s, lay, st, kind)
    raw = layer_activation_terms(s, lay, st, kind)
    graphed = graphed_blocks(kind, st.graph_scopes)
    in_graph = {name for _, module in graphed.items() for name in GRAPH_SCOPE_TERMS[module]}
    tokens = _tokens(lay)
    mods = set(off.modules)
    recomputed = set(st.modules) if st.recompute == "selective" else set()
    up_proj_dropped = set(RECOMPUTE_DROPS["mla_up_proj"]) if "mla_up_proj" in recomputed else set()
    twice = {"attention_scores"} if st.attention_scores == "fused_softmax" and not st.attention_dropout else set()
    gpu: dict[str, float] = {}
    host: dict[str, float] = {}
    live: dict[str, dict[str, float]] = {"attention": {}, "mlp": {}}
    transient = 0.0
    for module in off.modules:
        for name in _captured_names(s, st, kind, module):
            value = terms.get(name, 0.0)
            captured = value or (raw.get(name, 0.0) if module == "core_attn" and name in up_proj_dropped else 0.0)
            if not captured or name in in_graph or captured * tokens / _element_bytes(name) < off.min_elements:
                continue
            host[name] = host.get(name, 0.0) + captured * (2 if name in twice else 1)
            live["attention" if module in ATTENTION_MODULES else "mlp"][name] = captured
            if name == "attention_scores":
                # the pre-softmax scores stay referenced through the softmax and the bmm with v (TE backends.py
                # :567 matmul_result, :644-684; dot_product_attention.py:194-210 attention_scores); in backward
                # the probabilities' gradient is the same size beside a reloaded copy of them
                transient = st.dtype_bytes * s.heads / lay.tp * lay.seq / lay.cp
            if not value or (SHARED_WITH.get(name) and SHARED_WITH[name] not in mods):
                continue
            gpu[name] = value
    return LayerOffload(gpu, host, sum(live["attention"].values()), sum(live["mlp"].values()), transient)


def layer_offload_terms(s: Shape, lay: Layout, st: Settings, kind: str) -> tuple[dict[str, float],
                                                                                       dict[str, float]]:
    """({term: bytes per token} the GPU no longer holds, {term: bytes per token} the host receives) for one layer
    of ``kind`` and one microbatch (layer_offload)."""
    one = layer_offload(s, lay, st, kind)
    return one.gpu, one.host


@dataclass(frozen=True)
class OffloadedActivations:
    """What fine-grained offloading changes on one pipeline rank (bytes)."""
    gpu_removed: float       # net: activations no longer allocated on the GPU at the 1F1B steady-state peak
    host_per_gpu: float      # pinned host memory this rank's offload pool grows to
    kept_margin: float       # one layer's offloaded groups kept on the GPU (the margin: the loss chunk's last layer)
    working: float = 0.0     # what the peak holds beside the stored activations (included in gpu_removed)
    beside_loss: float = 0.0  # what the last stage holds beside its loss instead (stage_activations)
    chunk_removed: tuple[float, ...] = ()   # per model chunk: what each of its alive microbatches leaves off the GPU


def offloaded_activations(s: Shape, lay: Layout, st: Settings, rank: int,
                          alive: tuple[float, ...] | None = None) -> OffloadedActivations:
    """Fine-grained activation offloading on pipeline rank ``rank``, at the moment of the schedule where each of its
    model chunks has ``alive`` microbatches in flight (stage_activations.peak_alive, from pipeline.rank_alive: the
    moment the rank's activations peak once the offloaded bytes are left out, OffloadedActivations.chunk_removed);
    None: the moment with the most offloaded bytes in flight. Each chunk's own layers count (rank_chunks): an uneven
    split or a pipeline layout gives chunks different layers, and the last chunk may hold only the loss (and MTP).

    Every in-flight layer-microbatch's offloaded terms leave the GPU, except (PipelineOffloadManager
    post_warmup_callback, fine_grained_activation_offload.py:566-650): pipeline rank r keeps
    r x delta_offload_bytes_across_pp_ranks, and per chunk int(n x (1 - activation_offload_fraction)) of its n
    eligible groups, the last ones in forward order.

    What the steady state holds beside them (one layer's worth each; the largest of the rank's layer kinds):
    - the working layer: a layer's forward holds its block's captured tensors until the block's groups commit, and
      a non-fused attention its s x s scores beside the probabilities (LayerOffload.scores_transient);
    - the margin: post_warmup_callback (:583-593) keeps one group per module name, the last layer of the chunk that
      runs backward first, and should_bulk_offload (:1066-1087) the last layer of any chunk whose backward comes
      next (the loss chunk's); these groups are never pushed to the chunk's reload stack (bulk_offload, :1096-1097);
    - the reloaded layer: every group start in backward reloads the top of that stack (on_group_start_backward
      :1192-1202, bulk_reload :1131-1146), so a chunk whose last layer was kept reloads each earlier layer one layer
      ahead, and once its stack is empty it pre-reloads the next backward chunk's last layer
      (pre_reload_last_layer :1058-1064) when that chunk's forward is done: with more than one microbatch-chunk in
      flight (1F1B: the next forward runs before that backward) that layer's copies (LayerOffload.host) wait on
      the GPU through the next forward, beside its working layer. In backward a reloaded layer is used beside the
      probabilities' gradient.
    The peak is the larger of forward (working layer plus, with that look-ahead, a reloaded layer) and backward (a
    reloaded layer and the gradient). The warm-up iteration offloads every group (should_bulk_offload returns True
    while is_warmup), so its stack is complete and it reloads nothing ahead: only from iteration 2 on.

    The host side is megatron-core's pinned OffloadTensorPool (:115-345): it grows on demand and is only reset,
    never released, between iterations, and the warm-up iteration offloads every group, so it holds every
    eligible group's copies of the in-flight microbatches."""
    if st.fine_grained_offload is None or st.recompute == "full":
        return OffloadedActivations(0.0, 0.0, 0.0)
    counts = rank_layers(s, lay, rank)
    per_stage = sum(counts.values()) or 1
    tokens = _tokens(lay)
    parts = {kind: layer_offload(s, lay, st, kind) for kind in counts}
    moments = rank_alive(lay, rank)   # per-chunk microbatches in flight at each moment of the schedule
    chunks = rank_chunks(s, lay, rank)
    if len(chunks) != len(moments[0]):   # one pipeline stage: its chunks run as one
        chunks = (tuple(kind for chunk in chunks for kind in chunk),)
    chunk_gpu = tuple(sum(sum(parts[kind].gpu.values()) for kind in chunk) * tokens for chunk in chunks)
    chunk_host = tuple(sum(sum(parts[kind].host.values()) for kind in chunk) * tokens for chunk in chunks)
    if not any(chunk_gpu) and not any(chunk_host):
        return OffloadedActivations(0.0, 0.0, 0.0)
    host = max(sum(n * b for n, b in zip(counts_, chunk_host)) for counts_ in moments)
    if alive is None:
        alive = max(moments, key=lambda counts_: sum(n * b for n, b in zip(counts_, chunk_gpu)))
    groups = sum(n * sum(1 for m in st.fine_grained_offload.modules if _module_offloads(s, lay, st, kind, m))
                 for kind, n in counts.items())
    held = max(sum(p.gpu.values()) for p in parts.values()) * tokens
    reloaded = max(sum(p.host.values()) for p in parts.values()) * tokens
    live = max(max(p.attention_live + p.scores_transient, p.mlp_live) for p in parts.values()) * tokens
    gradient = max(p.scores_transient for p in parts.values()) * tokens
    chunk_groups = max(1.0, groups / max(1, lay.vpp))  # eligible groups of one chunk (one microbatch)
    kept = math.floor(chunk_groups * (1.0 - st.fine_grained_offload.fraction)) / chunk_groups
    # pipeline rank r keeps r x delta_offload_bytes_across_pp_ranks more on the GPU (post_warmup_callback :598-607)
    balance = rank * st.fine_grained_offload.delta_bytes
    chunk_removed = tuple(b * (1.0 - kept) for b in chunk_gpu)
    removed = max(0.0, (sum(n * b for n, b in zip(alive, chunk_gpu)) - balance) * (1.0 - kept))
    look_ahead = sum(alive) > 1                       # microbatch-chunks in flight (pipeline.rank_alive)
    reloads_in_backward = look_ahead or per_stage / lay.vpp > 1
    forward = live + (reloaded if look_ahead else 0.0)
    backward = (reloaded if reloads_in_backward else 0.0) + gradient
    working = max(forward, backward)
    if working >= removed:
        # The plan's stored activations leave out a layer's own transients (a non-fused attention's scores beside
        # its probabilities): where the offload removes less than the working set, it is planned as saving nothing
        return OffloadedActivations(0.0, host, held)
    beside_loss = reloaded if look_ahead else held
    return OffloadedActivations(removed - working, host, held, working, beside_loss, chunk_removed)


def _module_reason(module: str, s: Shape, st: Settings) -> str:
    """Why one offload_modules label moves no GPU memory here (no_saving_reason)."""
    off = st.fine_grained_offload
    kinds = set(layer_kinds(s))
    recomputed = set(st.modules) if st.recompute == "selective" else set()
    if module in ("expert_fc1", "moe_act", "fused_group_mlp", "mlp_norm") and not any("moe" in k for k in kinds):
        return ("the dense MLP's norm is fused into linear_fc1 (an IdentityOp, transformer_layer.py "
                "_set_offload_modules)" if module == "mlp_norm" else "the model has no MoE layers")
    blocks = {attention_block(k) for k in kinds} - {""}
    if module in ("qkv_linear", "core_attn", "attn_proj") and not blocks & set(HOOKED_ATTENTION):
        return ("the model's attention layers are gated delta nets or DSA, whose forward enters no offload context "
                "(ssm/gated_delta_net/gdn.py, experimental_attention_variant/absorbed_mla.py)")
    if module == "attn_norm" and not any(separate_input_norm(s, b) for b in blocks):
        return ("the input norm is fused into the first projection (an IdentityOp, transformer_layer.py "
                "_set_offload_modules)")
    if module == "core_attn" and "core_attn" in recomputed:
        return "core_attn is recomputed: its checkpointed path saves q, k, v outside the offload hooks (attention.py)"
    if module == "core_attn" and "attn_proj" not in off.modules:
        return "q, k, v only: the kernel's output stays, linear_proj keeps the same tensor"
    return (f"its saved tensors are recomputed, inside a CUDA graph, or under min_offloaded_tensor_size "
            f"({off.min_elements:,} elements)")


def _module_offloads(s: Shape, lay: Layout, st: Settings, kind: str, module: str) -> bool:
    one = replace(st, fine_grained_offload=replace(st.fine_grained_offload, modules=(module,)))
    return bool(layer_offload_terms(s, lay, one, kind)[1])


def host_memory_text(host_per_gpu: float, world: int) -> str:
    """The host memory fine-grained offloading needs, per GPU and per node, in words."""
    node = min(world, GPUS_PER_NODE)
    return (f"host: {host_per_gpu / 2**30:.2f} GiB of pinned memory per GPU, {node * host_per_gpu / 2**30:.1f} GiB "
            f"per node of {node} GPUs (megatron-core's OffloadTensorPool, sized in the warm-up iteration)")


# ----------------------------------------------------------------------------- Megatron FSDP and the optimizer
def _dtype(value: Any, default: int | None) -> int | None:
    """Bytes of a torch dtype (or its name) as the config holds it; ``default`` for None."""
    if value is None:
        return default
    name = str(value).replace("torch.", "")
    return {"float32": FP32, "fp32": FP32, "bfloat16": BF16, "bf16": BF16, "float16": BF16,
            "fp16": BF16, "uint8": FP8, "fp8": FP8}.get(name, default)


def apply_config(cfg: Any, st: Settings) -> Settings:
    """The settings model.from_config read, with what these levers change:

    - Megatron FSDP keeps its own buffers (megatron_fsdp/param_and_grad_buffer.py
      _init_each_parameter_group_buffers): gradients in ddp.megatron_fsdp_main_grads_dtype, or, unset (Bridge's
      default), in the parameters' own dtype (bf16; bf16 for FP8 parameters too: _resolve_group_grad_dtype,
      :2306-2315, while the non-FP8 ones of an FP8 run, the embeddings, keep the params dtype: embed_grad_bytes),
      whatever grad_reduce_in_fp32 says; master weights in ddp.megatron_fsdp_main_params_dtype
      (fp32 by default; None: the compute weights are the masters, :2682-2694; mcore_fsdp_adapter.py:134-138).
    - The precision-aware optimizer keeps exp_avg and exp_avg_sq each in its own dtype
      (optimizer_config.py exp_avg_dtype / exp_avg_sq_dtype; TE FusedAdam): the plan's per-moment bytes are
      their mean.
    - Fine-grained activation offloading (offload_from_config)."""
    from ..core.paths import read
    out = st
    if st.fsdp is not None:
        params_dtype = getattr(cfg.model, "params_dtype", None)
        compute = BF16 if st.param_bytes == FP8 else (_dtype(params_dtype, BF16) or BF16)
        grads = _dtype(read(cfg, "ddp.megatron_fsdp_main_grads_dtype", None), compute)
        main = read(cfg, "ddp.megatron_fsdp_main_params_dtype", "fp32")
        out = replace(out, grad_bytes=grads or compute, master_bytes=_dtype(main, 0) or 0)
        if st.param_bytes == FP8 and read(cfg, "ddp.megatron_fsdp_main_grads_dtype", None) is None:
            # only the FP8 weights' gradients are bf16; the embeddings' stay in the params dtype (:2315)
            out = replace(out, embed_grad_bytes=_dtype(params_dtype, BF16) or BF16)
    if st.precision_aware:
        opt = cfg.optimizer
        first = _dtype(getattr(opt, "exp_avg_dtype", None), FP32)
        second = _dtype(getattr(opt, "exp_avg_sq_dtype", None), FP32)
        out = replace(out, state_bytes=(first + second) / 2)
    return replace(out, fine_grained_offload=offload_from_config(cfg.model))


# ----------------------------------------------------------------------------- "saves nothing here"
def no_saving_reason(overlay: str, s: Shape, lay: Layout, st: Settings) -> str:
    """Why ``overlay`` cannot change the plan of this configuration (a step that saves nothing says it); "" when
    nothing in the configuration rules a saving out."""
    if overlay == "megatron_fsdp":
        dense, expert = data_parallel_shards(lay, st)
        if dense <= 1 and expert <= 1:
            return (f"DP x CP is {lay.dp * lay.cp}: Megatron FSDP has no data-parallel ranks to shard parameters, "
                    "gradients or optimizer state across")
        return ""
    if overlay == "fine_grained_offload":
        off = st.fine_grained_offload
        if off is None:
            return ""
        if st.recompute == "full":
            return "full recompute keeps only each layer's input: the offloaded modules save nothing in forward"
        if off.fraction <= 0:
            return "activation_offload_fraction is 0: no group is offloaded after the warm-up iteration"
        if not any(layer_offload_terms(s, lay, st, kind)[0] for kind in set(layer_kinds(s))):
            return "; ".join(f"{m}: {_module_reason(m, s, st)}" for m in off.modules)
        return ""
    if overlay == "dist_optimizer":
        dense, expert = data_parallel_shards(lay, st)
        if dense <= 1 and expert <= 1:
            return f"DP x CP is {lay.dp * lay.cp}: the distributed optimizer has nothing to shard across"
        return ""
    if overlay == "precision_aware_optimizer":
        if st.lora_rank:
            return "LoRA trains only the adapters: their optimizer state is negligible"
        return ""
    return ""


# ----------------------------------------------------------------------------- the layout search (search.py)
SEARCH_FSDP_STRATEGY = "optim_grads_params"   # NVIDIA's recommended path (megatron-fsdp card, recommended_path)
SEARCH_OFFLOAD_ATTENTION = ("qkv_linear", "core_attn", "attn_proj")
SEARCH_OFFLOAD_MOE = ("mlp_norm", "expert_fc1", "moe_act")


def search_offload_modules(moe: bool) -> tuple[str, ...]:
    """The offload_modules the search tries: the attention's saved inputs, and the MoE layers' too."""
    return SEARCH_OFFLOAD_ATTENTION + (SEARCH_OFFLOAD_MOE if moe else ())


def search_settings(base: Settings, s: set[str], shape: Shape) -> Settings:
    """``base`` with the levers in ``s`` on, as their overlays set them with the parameters search.candidate_for
    passes (Bridge's defaults for the rest: FSDP's fp32 main weights and gradients in the parameters' dtype, bf16
    moments with fp32 masters, offload fraction 1)."""
    out = base
    if "megatron_fsdp" in s and base.fsdp is None:
        out = replace(out, fsdp=SEARCH_FSDP_STRATEGY, dist_optimizer=True, grad_bytes=BF16, master_bytes=FP32)
    if "precision_aware_optimizer" in s and not base.precision_aware:
        # bf16 parameters (not FP8/FP4, not FSDP's or the CPU optimizer's own masters): FusedAdam keeps int16
        # remainders of the fp32 masters (from_config.master_bytes)
        remainders = (out.fsdp is None and out.param_bytes == BF16 and out.dtype_bytes == BF16
                      and not out.optimizer_offload)
        out = replace(out, precision_aware=True, state_bytes=BF16, dist_optimizer=True,
                      master_bytes=BF16 if remainders else out.master_bytes)
    if "fine_grained_offload" in s and base.fine_grained_offload is None:
        moe = any("moe" in k for k in layer_kinds(shape))
        out = replace(out, fine_grained_offload=FineGrainedOffload(search_offload_modules(moe),
                                                                   graph_modules=tuple(base.graph_scopes)))
    return out


# ----------------------------------------------------------------------------- the plan's step notes (steps.py)
SAVES_NOTHING = "saves nothing here"
MIN_SAVING = 1 << 20   # a step the plan prices at less than 1 MiB saved saves nothing (as memory/ladder.py)


def step_note(overlay: str, s: Shape, lay: Layout, st: Settings, saving: float) -> str:
    """What ``mbmem plan`` says beside the step that adds ``overlay`` (``saving``: bytes it took off the
    most-loaded GPU): "saves nothing here" with the reason where it changes nothing, and for fine-grained
    offloading the host memory it needs per GPU and per node."""
    parts = []
    reason = no_saving_reason(overlay, s, lay, st)
    if abs(saving) < MIN_SAVING:
        parts.append(SAVES_NOTHING + (f": {reason}" if reason else ""))
    elif overlay == "megatron_fsdp" and reason:
        # Megatron FSDP at DP x CP 1 shards nothing, but its own buffers keep the gradients in the parameters' dtype
        # unless ddp.megatron_fsdp_main_grads_dtype says otherwise (apply_config)
        parts.append(f"shards nothing here ({reason}); the change is Megatron FSDP's gradient buffer dtype "
                     "(ddp.megatron_fsdp_main_grads_dtype unset: the parameters' dtype, not grad_reduce_in_fp32)")
    if overlay == "fine_grained_offload" and st.fine_grained_offload is not None:
        host = max(offloaded_activations(s, lay, st, r).host_per_gpu for r in range(lay.pp))
        if host:
            parts.append(host_memory_text(host, lay.world))
        kept = unhooked_layers_text(s, st)
        if kept and abs(saving) >= MIN_SAVING:   # where it saves nothing, the reason says so per module
            parts.append(kept)
    return "; ".join(parts)


VARIANT_NAMES = {variants.GDN: "gated delta net", variants.DSA: "DSA", variants.DSA_SHARED: "DSA"}


def unhooked_layers_text(s: Shape, st: Settings) -> str:
    """Where offload_modules name attention modules that some of the model's layers do not run (a gated delta net
    or DSA attention enters no offload context: HOOKED_ATTENTION), how many layers keep their attention's saved
    tensors on the GPU; "" when every layer runs them or no attention module is named."""
    off = st.fine_grained_offload
    named = [m for m in ("qkv_linear", "core_attn", "attn_proj") if m in off.modules]
    if not named:
        return ""
    kinds = layer_kinds(s)
    counts: dict[str, int] = {}
    for kind in kinds:
        block = attention_block(kind)
        if block in VARIANT_NAMES:
            counts[VARIANT_NAMES[block]] = counts.get(VARIANT_NAMES[block], 0) + 1
    if not counts:
        return ""
    which = " and ".join(f"{n} {name}" for name, n in counts.items())
    return (f"{', '.join(named)}: the {which} layer{'s' if sum(counts.values()) > 1 else ''} of {len(kinds)} keep "
            "their attention's saved tensors (their forward enters no offload context: gated_delta_net/gdn.py, "
            "absorbed_mla.py)")
