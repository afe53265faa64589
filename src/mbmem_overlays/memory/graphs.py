"""Per-layer CUDA graphs: which activation terms a captured scope keeps in the graphs' private pool, and the
static input and output buffers each graphed layer and in-flight microbatch holds."""

from __future__ import annotations

from . import variants
from .activations import _selected_terms
from .inputs import Layout, Settings, Shape, _tokens
from .pipeline import blocks_of, rank_chunks

# CUDA graph module -> the activation terms a captured graph of that scope keeps inside its private memory pool.
# Everything a graph saves is written by replay into pool memory the caching allocator has already handed to
# the graph, so it is reserved but not counted as allocated (torch.cuda.graphs: private mempools; megatron-core
# transformer/cuda_graphs.py captures the scopes, transformer_layer.py _get_submodules_under_cudagraphs).
GRAPH_SCOPE_TERMS = {
    "attn": ("attn_layernorm_input", "attention_layernorm_output", "attention_qkv", "attention_qk_norm_inputs",
             "attention_softmax_stats", "attention_scores", "attn_dropout_mask", "attention_output", "attention_kernel_output", "attention_output_fp8",
             "mla_up_proj_inputs", "lora_a_gathered_input_linear_qkv", "attention_gate", "attention_gate_input",
             *variants.GRAPH_TERMS),
    "mlp": ("mlp_layernorm_input", "mlp_dropout_mask", "mlp_layernorm_output", "mlp_fc1_output", "mlp_silu_output",
            "mlp_glu_linear_input", "mlp_glu_clamped_input", "mlp_act_output", "lora_a_gathered_input_linear_fc1"),
    "moe": ("moe_layernorm_input", "moe_dropout_mask", "moe_layernorm_output", "moe_permuted_input", "moe_fc1_output",
            "moe_silu_output", "moe_glu_linear_input", "moe_glu_clamped_input", "moe_probs_mul_input",
            "moe_act_output", "moe_router", "moe_unpermute_input", "shared_expert", "moe_latent_fc1_input_fp8",
            "moe_latent_fc2_input", "moe_dispatch_handle", "shared_expert_gate", "moe_op_weight_copies"),
    # up to the router: the pre-MLP norm and the router, and the shared experts unless they overlap with the
    # EP communication (then they run outside the graph)
    "moe_router": ("moe_layernorm_input", "moe_layernorm_output", "moe_router", "shared_expert",
                   "shared_expert_gate"),
    "mamba": ("mamba_layernorm_input", "mamba_dropout_mask", "mamba_layernorm_output", "mamba_in_proj_output", "mamba_scan_output",
              "mamba_norm_input", "mamba_out_proj_input", "lora_a_gathered_input_in_proj"),
}
WHOLE_LAYER = ("attn", "mlp", "moe", "mamba")   # empty cuda_graph_modules: every graphable layer, whole


def graphed_blocks(kind: str, scopes: tuple[str, ...]) -> dict[str, str]:
    """Block -> the graph module that captures (part of) it, for one layer of ``kind``; {} when the layer is eager
    (cuda_graphs.py _layer_is_graphable: attn for layers with attention, mlp for dense MLP layers, moe or
    moe_router for MoE layers, mamba for Mamba layers)."""
    out = {}
    for block in blocks_of(kind):
        if block in ("mla", *variants.VARIANT_BLOCKS) and "attn" in scopes:
            out[block] = "attn"   # any TransformerLayer with a self_attention (_layer_is_graphable :2066-2072)
        elif block in scopes:
            out[block] = block
        elif block == "moe" and "moe_router" in scopes:
            out[block] = "moe_router"
    return out


def layer_graph_parts(s: Shape, lay: Layout, st: Settings, kind: str) -> tuple[float, float, float]:
    """(eager, pool, static) bytes one layer of ``kind`` keeps per microbatch under CUDA graphs.

    TE captures one graph per graphable layer and microbatch (transformer_layer.py _te_cuda_graph_capture: the
    selected parts of the layer, in order). Its saved activations go to the pool. ``static`` is its static
    input (_get_layer_static_inputs: the bf16 hidden state, and for attention the bool mask mbs x s/cp x s) plus
    its static output; layer_graph_buffers splits the two. The first graphed block reads the static input
    directly, so that block's norm input is the static input rather than a tensor of its own.
    """
    terms = _selected_terms(s, lay, st, kind)
    graphed = graphed_blocks(kind, st.graph_scopes)
    if not graphed:
        return sum(terms.values()) * _tokens(lay), 0.0, 0.0
    first = next(iter(graphed))
    hidden = st.dtype_bytes * s.hidden / (lay.tp if lay.sp else 1)
    static = terms.pop(f"{first}_layernorm_input", hidden) + hidden      # static input + static output
    if "attn" in graphed:
        static += 1.0 * lay.seq                                           # bool mask: s bytes per local token
    inside = {name for block, module in graphed.items() for name in GRAPH_SCOPE_TERMS[module]}
    if graphed.get("moe") == "moe_router" and st.shared_expert_overlap:
        inside -= {"shared_expert", "shared_expert_gate"}
    pool = sum(v for k, v in terms.items() if k in inside)
    eager = sum(v for k, v in terms.items() if k not in inside)
    return eager * _tokens(lay), pool * _tokens(lay), static * _tokens(lay)


def layer_graph_buffers(s: Shape, lay: Layout, st: Settings, kind: str) -> tuple[float, float]:
    """(static input, static output) bytes of one graphed layer of ``kind`` per microbatch; (0, 0) when eager.

    The static input is megatron-core's sample argument (module.py get_layer_static_inputs: a torch.ones
    hidden state, plus the attention mask for attention graphs), allocated before capture and written by
    every replay (TE graph.py Graphed.forward: static_input_surface[i].copy_(inputs[i])); megatron-core reuses
    one once its microbatch's backward is captured (cuda_graphs.py _get_sample_arguments), so there is one per
    in-flight microbatch, allocated in every phase. The static output is allocated while capturing; TE then
    weak-references it once its backward graph exists (graph.py, _reuse_graph_input_output_buffers, which
    megatron-core passes for TE >= 2.7: cuda_graphs.py), so in replay it is pool memory, as is the saved input
    of whatever eager norm reads it next (see graph_outputs_read_eagerly).
    """
    if not graphed_blocks(kind, st.graph_scopes):
        return 0.0, 0.0
    hidden = st.dtype_bytes * s.hidden / (lay.tp if lay.sp else 1) * _tokens(lay)
    static_in = hidden + (1.0 * lay.seq * _tokens(lay) if "attn" in graphed_blocks(kind, st.graph_scopes) else 0.0)
    return static_in, hidden


def graph_outputs_read_eagerly(s: Shape, lay: Layout, st: Settings, rank: int) -> int:
    """How many graphed layers per microbatch on pipeline rank ``rank`` hand their output to an eager norm.

    That norm saves its input for its backward, and the input is the graph's static output, which replay
    writes into pool memory the allocator does not count (layer_graph_buffers). The norm is the next block of
    the same layer, or the first block of the next layer of the same model chunk when that block is eager; a
    chunk's last layer hands its output to the next stage instead. A moe_router graph covers only part of its
    block (the dispatcher reads its outputs), so it is not counted.
    """
    n = 0
    for chunk in rank_chunks(s, lay, rank):
        for j, kind in enumerate(chunk):
            graphed = graphed_blocks(kind, st.graph_scopes)
            blocks = blocks_of(kind)
            whole = [b for b, module in graphed.items() if module == b]
            if not whole or len(whole) != len(graphed):
                continue
            last = max(blocks.index(b) for b in whole)
            if last + 1 < len(blocks):
                n += 1
            elif j + 1 < len(chunk) and blocks_of(chunk[j + 1])[0] not in graphed_blocks(chunk[j + 1],
                                                                                         st.graph_scopes):
                n += 1
    return n
