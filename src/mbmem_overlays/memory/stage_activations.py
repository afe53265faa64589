"""Activations on one pipeline rank: the layers' terms times the microbatches in flight, under full recompute,
activation offload or CUDA graphs, plus the first stage's embedding output and the last stage's loss buffers."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .activations import layer_activation, quantized_bytes
from .graphs import graph_outputs_read_eagerly, layer_graph_buffers, layer_graph_parts
from .inputs import BF16, FP32, Layout, Settings, Shape
from .pipeline import blocks_of, combined_step_extra, in_flight, rank_alive, rank_chunks, rank_layers
from .vision import activations as vision_activations
from .weights import mtp_blocks

# the named transients of the combined 1F1B schedule (stage_activations detail)
EP_OVERLAP_WORKING = "EP overlap: one layer's forward beside another microbatch's backward"
EP_OVERLAP_EMBEDDING = "EP overlap: the next microbatch's embedding output beside the backward's (first stage)"


@dataclass(frozen=True)
class StageActivations:
    """Activation bytes on one pipeline rank in the two phases that can hold the most of them."""
    steady: float             # the 1F1B steady state: everything eager, plus the last stage's loss buffers
    capture: float = 0.0      # CUDA graph capture: the graphed scopes' activations for every in-flight microbatch
    pool: float = 0.0         # the graphs' private pool, reserved through the steady state
    detail: tuple[tuple[str, float], ...] = ()
    persistent: float = 0.0   # allocated in every phase, the optimizer step included (graph static inputs)


def mtp_layer_activation(s: Shape, lay: Layout, st: Settings) -> float:
    """Bytes one MTP layer keeps per microbatch beside its loss (transformer/multi_token_prediction.py
    _get_embeddings, _concat_embeddings, forward): the embedding of the shifted tokens and the main hidden state
    (the enorm and hnorm inputs), their concatenation (eh_proj's input, 2h), its decoder blocks' own terms
    (weights.mtp_blocks, each block a layer of its own), the final norm's input and the output layer's input."""
    tokens = lay.seq * lay.mbs / lay.cp
    hidden_local = st.dtype_bytes * s.hidden * tokens / (lay.tp if lay.sp else 1)
    if st.fp4:
        # MTP layers run under get_fp8_context alone (multi_token_prediction.py :1179-1186), a nullcontext without
        # FP8: an FP4 job's MTP blocks keep bf16 GEMM inputs
        st = replace(st, fp8=False)
    # the output layer's input: with fp8_output_proj its MXFP8 copy (output_layer_input_bytes)
    out_in = output_layer_input_bytes(st) / st.dtype_bytes * hidden_local
    return 5 * hidden_local + out_in + sum(layer_activation(s, lay, st, block) for block in mtp_blocks(s))


def output_layer_input_bytes(st: Settings) -> float:
    """Bytes per element of the input the output layer keeps for its weight gradient: the compute dtype
    (tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication), or with fp8_output_proj the one
    MXFP8 layout TE's Linear keeps of the input it quantized (TE v2.17.1 module/linear.py :545-560: the
    columnwise one, or under sequence parallelism the rowwise one it all-gathers again, the same bytes)."""
    if st.output_proj_fp8 and not (st.lora_rank or st.frozen_lm):
        return quantized_bytes("mxfp8")
    return st.dtype_bytes


def loss_kept_bytes(st: Settings) -> float:
    """Bytes per logit a loss keeps from its forward to its backward: the fp32 softmax megatron-core's cross
    entropy saves (tensor_parallel/cross_entropy.py :25 .float(), :77 div_ in place, :181 save_for_backward; the
    native fusion alike, fusions/fused_cross_entropy.py _VocabParallelCrossEntropy.forward), or TE's bf16 logits
    holding the gradient written in the forward (loss_bytes). The bf16 logits themselves are freed."""
    if st.cross_entropy_impl == "te" and "te_cross_entropy_in_place" not in st.without:
        return BF16
    return FP32


def loss_chunk_inputs(s: Shape, lay: Layout, st: Settings) -> float:
    """Bytes the last model chunk keeps per microbatch between its decoder layers and the logits: the final
    norm's input (the last layer's output, which no layer keeps) and the output layer's input (the norm's output),
    both sequence-local hidden states (gpt_model.py _postprocess -> output_layer; layers.py
    LinearWithGradAccumulationAndAsyncCommunication saves its sequence-local input; TE's and megatron-core's
    norms save their input)."""
    if "loss_chunk_inputs" in st.without:
        return 0.0
    tokens = lay.seq * lay.mbs / lay.cp
    # a frozen output layer (LoRA's base, freeze_language_model) runs linear_with_frozen_weight, which saves only
    # the weight (tensor_parallel/layers.py:1095-1096, LinearWithFrozenWeight.forward :415-417): the norm's input
    # alone is kept
    frozen = bool(st.lora_rank or st.frozen_lm)
    per_element = st.dtype_bytes + (0 if frozen else output_layer_input_bytes(st))
    return per_element * s.hidden * tokens / (lay.tp if lay.sp else 1)


def logit_softcap_bytes(s: Shape, lay: Layout, st: Settings) -> float:
    """Bytes final_logit_softcapping keeps per loss microbatch: ``scale * tanh(logits / scale)`` (Bridge's
    gemma2_provider.py Gemma2OutputLayer :408-423, gemma/modeling_gemma4.py Gemma4OutputLayer :1479-1491, mixed into
    the output layer by the providers, gemma2_provider.py :522, gemma4_provider.py :261, :372): tanh saves its
    output for the backward, a logits-sized tensor in the compute dtype; the division and the product by a Python
    float save nothing. It lives from the output layer's forward to the loss's backward, beside the loss's own."""
    if not st.logit_softcap:
        return 0.0
    return st.dtype_bytes * s.vocab / lay.tp * lay.seq * lay.mbs / lay.cp


def kept_stage_outputs(s: Shape, lay: Layout, st: Settings, rank: int, chunks: int) -> tuple[int, ...]:
    """Per model chunk of pipeline rank ``rank``, 1 where each of its in-flight microbatches keeps its output hidden
    state (sequence-local) after sending it: with deallocate_pipeline_outputs off the schedules'
    deallocate_output_tensor returns without touching it (pipeline_parallel/schedules.py :166-190; called after
    every send, :1633, :1663, :1741, :1916, :2334, :2389), and the tensor stays in output_tensors until its
    backward. Set, it keeps a one-element stand-in. The last chunk of the last rank outputs the loss; a whole-layer
    CUDA graph's output lives in the graphs' pool."""
    if not st.keep_stage_outputs or lay.pp <= 1:
        return (0,) * chunks
    from .graphs import WHOLE_LAYER
    if st.graph_scopes == WHOLE_LAYER and st.recompute != "full" and not st.cpu_offload_layers:
        return (0,) * chunks
    last = rank == lay.pp - 1
    return tuple(0 if last and c == chunks - 1 else 1 for c in range(chunks))


def cp_allgather_working(s: Shape, lay: Layout, st: Settings, mla: bool = False) -> float:
    """The one attention layer's transient of TE's all-gather context parallelism (cp_comm_type allgather, CP > 1):
    the saved tensors are the p2p ring's (the local q, k, v, the output and the log-sum-exp: TE v2.17.1
    attention/dot_product_attention/context_parallel.py AttnFuncWithCPAndKVAllGather.forward :3393-3441), but
    the backward gathers K and V over the whole sequence again and accumulates dK and dV there before its
    reduce-scatter (backward :3575-3604, :3826-3833): the gathered K and V, dK and dV, and the chunk reorder's copy
    of one of them (index_select) at once, in the compute dtype (the forward's gather holds fewer)."""
    if lay.cp <= 1 or st.cp_comm != "allgather":
        return 0.0
    if s.mla or mla:
        k, v = s.heads * (s.qk_head_dim + s.qk_pos_dim), s.heads * s.v_head_dim
    else:
        k = v = s.groups * s.head_dim
    full = st.dtype_bytes * lay.seq * lay.mbs / lay.tp
    return full * (2 * (k + v) + max(k, v))


def paged_stash_working(s: Shape, lay: Layout, st: Settings, rank: int) -> float:
    """The paged stash's working set on a rank with MoE layers: a layer's backward reloads its stashed tensors into
    new tensors of their padded shape (the dispatched budget: moe/paged_stash.py reload_paged_tensors :511-540
    allocates torch.empty(original_shape)), and the schedule reloads the next backward layer's as it goes
    (PipelinePreScheduleFunction.backward :296-323): two layers' at the budget (Settings.moe_load)."""
    from .activations import paged_stash_active, paged_stash_layer_bytes
    if not paged_stash_active(st):
        return 0.0
    per_layer = max((paged_stash_layer_bytes(s, lay, st, kind, st.moe_load) for chunk in rank_chunks(s, lay, rank)
                     for kind in chunk), default=0.0)
    return 2 * per_layer


def ep_overlap_working(s: Shape, lay: Layout, st: Settings, rank: int) -> float:
    """What the combined 1F1B schedule (overlap_moe_expert_parallel_comm) holds on rank ``rank`` beyond the
    microbatches the plan counts alive, at its worst step (pipeline.combined_step_extra), over every pair of this
    rank's model chunks that can run one step (the forward chunk and the backward chunk: get_model_chunk_id,
    schedules.py:1217-1222; the same chunk without pipelining).

    The counts stay the plan's: without pipelining the schedule runs microbatch 1's forward alone, then each
    step k the forward of k + 1 beside the backward of k (pipeline_parallel/combined_1f1b.py
    combined_1f1b_schedule_for_no_pipelining :51-133), so a step starts with one microbatch alive, as the plan's
    1.0; with pipelining megatron-core needs the interleaved schedule (transformer_config.py:2674-2678) and runs one
    more warm-up forward (schedules.py get_pp_rank_microbatches :939-943), so each combined step (:1458, and
    combined_1f1b.py combined_1f1b_schedule_for_interleaved_pipelining) starts with the counts the plan takes right
    after a forward step (pipeline.alive_chunk_microbatches). 0 without the overlap."""
    if not st.ep_overlap:
        return 0.0
    from .activations import overlap_layer
    chunks = rank_chunks(s, lay, rank)
    memo: dict[str, object] = {}

    def parts(chunk: tuple[str, ...]) -> tuple:
        return tuple(memo.setdefault(kind, overlap_layer(s, lay, st, kind)) for kind in chunk)

    layered = [parts(chunk) for chunk in chunks if chunk]
    return max((combined_step_extra(f, b, st.delay_wgrad) for f in layered for b in layered), default=0.0)


def layer_transients(s: Shape, lay: Layout, st: Settings, rank: int) -> tuple[tuple[str, float], ...]:
    """One layer's transients the steady state holds beside the in-flight activations (named, bytes)."""
    out = []
    blocks = {b for kind in rank_layers(s, lay, rank) for b in blocks_of(kind)}
    if blocks & {"attn", "mla"}:   # TE's attention; the gated delta net's and DSA's CP paths are their own
        if (gathered := cp_allgather_working(s, lay, st, mla="mla" in blocks and "attn" not in blocks)):
            out.append(("context-parallel all-gather: one layer's gathered K/V and their gradients", gathered))
    if (reload := paged_stash_working(s, lay, st, rank)):
        out.append(("MoE paged stash: two layers' reloaded expert tensors", reload))
    if (overlap := ep_overlap_working(s, lay, st, rank)):
        out.append((EP_OVERLAP_WORKING + (" with delayed weight gradients" if st.delay_wgrad else ""), overlap))
    return tuple(out)


def peak_alive(s: Shape, lay: Layout, st: Settings, rank: int, weights: tuple[float, ...],
               once: float = 0.0) -> tuple[float, ...]:
    """The per-chunk count of microbatches alive (pipeline.rank_alive) at which pipeline rank ``rank`` holds the
    most activation bytes: ``weights`` are each chunk's bytes per alive microbatch, ``once`` what the last chunk
    adds once while any of its microbatches is alive (the loss's own peak). With interleaved_schedule switched off:
    the count before it, every chunk alike at min(warm-up + 1, m x vpp) with the pipeline size as the group."""
    if "interleaved_schedule" in st.without and lay.pp > 1:
        alive = in_flight(replace(lay, vp_group=0, chunk_layers=()), rank) * lay.vpp
        return tuple([alive / len(weights)] * len(weights))
    moments = rank_alive(lay, rank)
    if len(moments) == 1 or (not once and len(set(weights)) == 1):   # every moment alike (their counts sum alike)
        return moments[0]
    return max(moments, key=lambda counts: sum(n * w for n, w in zip(counts, weights)) + (once if counts[-1] else 0.0))


def stage_activations(s: Shape, lay: Layout, st: Settings, rank: int) -> StageActivations:
    counts = rank_layers(s, lay, rank)
    per_stage = sum(counts.values()) or 1

    def mean(value) -> float:
        return sum(n * value(kind) for kind, n in counts.items()) / per_stage

    tokens = lay.seq * lay.mbs / lay.cp
    hidden_local = st.dtype_bytes * s.hidden * tokens / (lay.tp if lay.sp else 1)   # one sequence-local hidden state
    layer_bytes = {kind: layer_activation(s, lay, st, kind) for kind in counts}
    per_layer = full_layer = mean(lambda kind: layer_bytes[kind])
    last = rank == lay.pp - 1
    per_logit = st.logits_bytes
    if "te_cross_entropy_in_place" in st.without and st.cross_entropy_impl == "te":
        per_logit = BF16 + FP32
    logits = per_logit * s.vocab / lay.tp * tokens
    # What the loss keeps from its forward to its backward: the fp32 softmax (tensor_parallel/cross_entropy.py:181
    # save_for_backward(exp_logits, ...); the native fusion alike) or TE's bf16 logits that receive the gradient;
    # the rest of logits_bytes is the loss's own transient, for the one microbatch whose loss runs
    saved = min(logits, loss_kept_bytes(st) * s.vocab / lay.tp * tokens)
    softcap = logit_softcap_bytes(s, lay, st)
    logits, saved = logits + softcap, saved + softcap
    # Which microbatches of which model chunk are alive at the rank's peak (Megatron's schedules): chunks may hold
    # different layers (an uneven split, a pipeline layout, the embedding or loss counted as a layer), and the
    # interleaved schedule's warm-up depends on microbatch_group_size_per_vp_stage.
    chunks = rank_chunks(s, lay, rank)
    chunk_bytes = [sum(layer_bytes[kind] for kind in chunk) for chunk in chunks]
    weights = list(chunk_bytes)
    embedding_out = hidden_local * (lay.tp if st.embedding_whole else 1)
    vision = vision_activations(s, lay, st) if rank == 0 else 0.0
    if rank == 0:
        weights[0] += embedding_out + vision   # the embedding output; the vision encoder's (vision.terms)
    outputs = [k * hidden_local for k in kept_stage_outputs(s, lay, st, rank, len(chunks))]
    weights = [w + outputs[c] for c, w in enumerate(weights)]
    if last:
        weights[-1] += saved + loss_chunk_inputs(s, lay, st)
    # MTP, in the last model chunk, which like the loss runs its backward right after its forward: one
    # microbatch's worth. Each depth computes its logits and loss in the forward (process_mtp_loss: output_layer,
    # compute_language_model_loss) and keeps only what its loss saves (loss_kept_bytes) until the backward; the
    # main loss's backward, which runs first, is the one at the loss's peak (the MTP losses join through
    # MTPLossAutoScaler, multi_token_prediction.py:714-747, after it).
    mtp = s.mtp_layers * (mtp_layer_activation(s, lay, st) + saved) if last and s.mtp_layers else 0.0
    once = logits - saved + mtp if last else 0.0
    offload = None            # levers.OffloadedActivations with fine-grained activation offloading
    offloading = st.fine_grained_offload is not None and st.recompute != "full"
    if offloading:
        # The rank peaks where what stays on the GPU peaks: each chunk's alive microbatches without what the offload
        # takes from its layers, and the loss beside the kept layer rather than beside the working set (below)
        from .levers import offloaded_activations
        offload = offloaded_activations(s, lay, st, rank)
        if offload.chunk_removed and len(offload.chunk_removed) == len(weights):
            weights = [w - r for w, r in zip(weights, offload.chunk_removed)]
            if last:
                once = max(0.0, logits + mtp + (0.0 if s.mtp_layers else offload.beside_loss) - offload.working) - saved
    alive = peak_alive(s, lay, st, rank, tuple(weights), once)
    # the loss's microbatches: in the 1F1B steady state the last chunk's forward is followed by its backward (one
    # alive), but an interleaved schedule whose last microbatch group is shorter (m not a multiple of the group)
    # can run a second one's forward first
    n_loss = 1 if "interleaved_schedule" in st.without else alive[-1]
    stage_bytes = sum(chunk_bytes)
    if stage_bytes > 0:
        mbs_alive = sum(n * b for n, b in zip(alive, chunk_bytes)) / stage_bytes
    else:
        mbs_alive = float(max(alive))
    detail: list[tuple[str, float]] = []
    capture = pool = 0.0
    graphed = bool(st.graph_scopes) and st.recompute != "full" and not st.cpu_offload_layers
    persistent = 0.0
    if graphed:
        # Graphed scopes keep their activations in the graphs' private pool: allocated while the graphs are
        # captured (after the warm-up steps, in pipeline order, no eager activations alive), reserved-only in
        # replay. Static inputs and outputs are allocated while capturing; in replay only the static inputs are
        # (layer_graph_buffers), one per in-flight microbatch, and they stay allocated through the optimizer step.
        parts = {kind: layer_graph_parts(s, lay, st, kind) for kind in counts}
        eager, inside, static = (mean(lambda kind, i=i: parts[kind][i]) for i in range(3))
        capture = per_stage * (inside + static) * mbs_alive
        buffers = {kind: layer_graph_buffers(s, lay, st, kind) for kind in counts}
        static_in, static_out = (mean(lambda kind, i=i: buffers[kind][i]) for i in range(2))
        if "graph_outputs_in_pool" in st.without:
            per_layer = eager + static
            pool = per_stage * inside * mbs_alive
            detail.append(("CUDA graph static inputs and outputs", per_stage * static * mbs_alive))
        else:
            read = graph_outputs_read_eagerly(s, lay, st, rank) * hidden_local / per_stage
            per_layer = eager - read + static_in
            pool = per_stage * (inside + static_out) * mbs_alive
            detail.append(("CUDA graph static inputs", per_stage * static_in * mbs_alive))
        if "graph_static_inputs_at_step" not in st.without:
            persistent = per_stage * static_in * mbs_alive
        detail.insert(0, ("CUDA graph pool (reserved; allocated only while capturing)", pool))
    if st.recompute == "full":
        # Only each checkpointed group's input survives; one group is re-materialized at a time.
        boundary = 2 * st.dtype_bytes * s.hidden / (lay.tp if lay.sp else 1) * lay.seq * lay.mbs / lay.cp
        n = max(1, st.recompute_layers)
        working = n * full_layer   # uniform: each group of n layers is re-materialized at once
        if st.recompute_method == "block":
            ckpt = min(per_stage / lay.vpp, n) * lay.vpp
            kept = (per_stage - ckpt) * per_layer + ckpt * boundary
            if "block_recompute_one_layer" not in st.without:
                working = full_layer   # block checkpoints (and replays) its first n layers one at a time
        else:
            kept = per_stage / n * boundary
        acts = kept * mbs_alive + working
        detail.append(("full recompute working set", working))
        recompute_working = working
    else:
        recompute_working = 0.0
        layers_on_gpu = per_stage
        if st.cpu_offload_layers:
            layers_on_gpu -= min(per_stage, st.cpu_offload_layers) - (1 if st.cpu_offload_double_buffer else 0)
        acts = layers_on_gpu * per_layer * mbs_alive
        if offloading:   # the offloaded modules' saved inputs wait on the host, counted at the same moment
            offload = offloaded_activations(s, lay, st, rank, tuple(alive))
            acts -= offload.gpu_removed
            if offload.working:
                detail.append(("fine-grained offload: working layer and reloaded layer", offload.working))
    if rank == 0:
        acts += embedding_out * alive[0]  # embedding output, one per microbatch alive in the first chunk
        if vision:
            # a VL model's vision encoder and projector run in the first chunk's forward (pre_process), and keep
            # their tensors until that microbatch's backward reaches them, after the language model's
            detail.append(("vision encoder and projector (first stage)", vision * alive[0]))
            acts += vision * alive[0]
    if rank == 0 and st.ep_overlap:
        # each combined step starts with the forward's embedding (its pre_process, model_chunk_schedule_plan.py
        # :530) and ends with the backward's embedding backward (:604-609), after the forward's loss: one more
        # microbatch's embedding output through the step, beside the loss too
        detail.append((EP_OVERLAP_EMBEDDING, embedding_out))
        acts += embedding_out
    if any(outputs):
        kept = sum(n * o for n, o in zip(alive, outputs))
        detail.append(("stage outputs kept after the send (deallocate_pipeline_outputs off)", kept))
        acts += kept
    transient = layer_transients(s, lay, st, rank)
    for name, value in transient:
        detail.append((name, value))
        acts += value
    if last:
        loss = 0.0
        if n_loss:
            loss = logits + (n_loss - 1) * saved
            detail.append(("loss: logits and their fp32 softmax/gradient (last stage)", loss))
        inputs = loss_chunk_inputs(s, lay, st) * n_loss
        if inputs:
            detail.append(("final norm and output layer inputs (last stage)", inputs))
            acts += inputs
        if s.mtp_layers and n_loss:
            detail.append(("MTP layers with their logits and loss (last stage)", mtp))
            loss += mtp
        if offload is not None and offload.working:
            # with fine-grained offloading the loss runs beside the layer the offload keeps (the loss chunk's last
            # layer: an MTP layer, or the margin / look-ahead layer; levers.offloaded_activations), not beside
            # another layer's working set: the larger of the two is the peak
            loss = max(0.0, loss + (0.0 if s.mtp_layers else offload.beside_loss) - offload.working)
        acts += loss
        if recompute_working and "recompute_after_loss" not in st.without:
            # the loss buffers live from the output layer's forward to its backward; a checkpointed group is
            # re-materialized only in its own backward (tensor_parallel/random.py:625-647 CheckpointFunction.backward
            # re-runs the forward), which the autograd pass reaches after the loss and output layer have released
            # the logits: the two never coexist, and the larger of them is the peak's
            loss_time = logits + mtp   # mtp is 0 without MTP layers
            acts -= min(recompute_working, loss_time)
        if transient:
            # a layer's own transients (its forward or backward) never coexist with the loss's logits either: the
            # peak holds the larger of the two beside what is left of the loss
            left = max(0.0, logits + mtp - (recompute_working if "recompute_after_loss" not in st.without else 0.0))
            acts -= min(sum(v for _, v in transient), left)
        if st.deferred_wgrad_microbatches:
            # defer_embedding_wgrad_compute: the output layer keeps each microbatch's bf16 dY (tokens x vocab/tp)
            # and its sequence-local input until the pipeline flush (megatron-core tensor_parallel/layers.py)
            per_mb = BF16 * tokens * s.vocab / lay.tp + hidden_local
            deferred = st.deferred_wgrad_microbatches * per_mb
            detail.append(("deferred output-layer wgrad inputs", deferred))
            acts += deferred
    return StageActivations(acts, capture, pool, tuple(detail), persistent)
