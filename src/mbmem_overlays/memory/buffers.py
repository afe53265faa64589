"""Buffers beside the model state and the activations: the optimizer step's fp32 gradient copies and FP8 master
casts, the data-parallel communication buffers (Megatron FSDP's gathered units, the distributed optimizer's
bucket) and megatron-core's global memory buffer."""

from __future__ import annotations

import math
from dataclasses import replace

from .inputs import FP32, Layout, Settings, Shape, _tokens
from .pipeline import blocks_of, rank_layers
from .weights import fsdp_shards, largest_layer_params, optimizer_shards, stage_bf16_params, stage_params

MiB = 1 << 20
# The autograd engine runs a CUDA backward on its own worker thread per device (torch/csrc/autograd/engine.cpp
# Engine::start_device_threads), so torch's GEMMs run on two threads: the Python thread's forward and that one's
# backward, and torch keeps a cuBLAS workspace per thread and stream
GEMM_THREADS = 2
TE_GEMM_STREAMS = 4       # TE common/util nvte_get_num_compute_streams (tex.get_num_cublas_streams): 4


def torch_cublas_workspace(arch: int, env: dict[str, str] | None = None) -> int:
    """Bytes of one torch cuBLAS workspace (torch 2.14.1 aten/src/ATen/cuda/CublasHandlePool.cpp
    parseChosenWorkspaceSize): CUBLAS_WORKSPACE_CONFIG's ``:SIZE_KiB:COUNT`` pairs summed, else 32 MiB on compute
    capability 9, 10 and 12 and ``:4096:2:16:8`` (8 MiB + 128 KiB) on the others. cuBLASLt shares it (the
    unified workspace, TORCH_CUBLASLT_UNIFIED_WORKSPACE unset)."""
    import re
    config = (env or {}).get("CUBLAS_WORKSPACE_CONFIG")
    if config:
        pairs = re.findall(r":([0-9]+):([0-9]+)", config)
        if pairs:
            return sum(int(size) * 1024 * int(count) for size, count in pairs)
    return 32 * MiB if arch in (9, 10, 12) else 4096 * 1024 * 2 + 16 * 1024 * 8


def gemm_workspaces(arch: int, env: dict[str, str] | None, te: bool, te_grouped_gemm: bool) -> float:
    """cuBLAS workspaces torch's caching allocator holds from the first GEMM to the end of the job, all counted
    in its allocated bytes:

    - torch's: one per (thread, stream) that runs a torch GEMM (CublasHandlePool.cpp setCublasWorkspace:
      cublas_stream_to_workspace is thread_local, each entry getNewWorkspace() from CUDACachingAllocator), here
      the output layer's and the router's GEMMs in the forward and on the autograd thread: GEMM_THREADS of
      torch_cublas_workspace;
    - Transformer Engine's: one for its GEMMs (TE v2.17.1 pytorch/module/base.py get_workspace: torch.empty of
      get_cublas_workspace_size_bytes(), 32 MiB from compute capability 9 on, else 4 MiB), and with TE's grouped
      GEMM (MoE experts as TEGroupedMLP) one per compute stream (get_multi_stream_cublas_workspace)."""
    out = float(GEMM_THREADS * torch_cublas_workspace(arch, env))
    if te:
        te_workspace = 32 * MiB if arch >= 9 else 4 * MiB
        out += te_workspace * (1 + (TE_GEMM_STREAMS if te_grouped_gemm else 0))
    return out

def optimizer_step_buffers(s: Shape, lay: Layout, st: Settings, first: bool, last: bool,
                           rank: int | None = None) -> float:
    """fp32 gradient copies the distributed optimizer makes at its step when gradients are kept in bf16
    (distrib_optimizer.py _copy_model_grads_to_main_grads: shard_main_param.grad = shard_model_grad.float()).
    They stay allocated until the next iteration's zero_grad (Bridge train.py:866-869)."""
    if st.grad_bytes >= FP32 or not st.master_bytes or st.lora_rank:
        return 0.0  # fp32 gradients are used in place (.float() is a no-op); adapters only: negligible
    from .weights import vision_params
    vision = vision_params(s, lay, st, (0 if first else lay.pp - 1) if rank is None else rank)[1]
    if st.fsdp is not None:
        return 0.0  # Megatron FSDP owns its main-grad buffers: _copy_model_grads_to_main_grads returns early
    upcasts = st.step_upcasts_grads
    if "precision_aware_grad_upcast" in st.without:
        upcasts = upcasts and not st.precision_aware
    if not upcasts:
        # decoupled_grad is the bf16 shard itself; under CPU offload the hybrid optimizer upcasts the GPU part
        # for its fp32 masters (fp32_param.grad = grad.to(fp32), hybrid_optimizer.py _set_sub_optimizer_grads)
        fraction = 1.0 - st.optimizer_offload if st.optimizer_offload else 0.0
    else:
        # every shard is upcast, offloaded or not: the hybrid optimizer copies the offloaded ones to the CPU from
        # this fp32 gradient (cpu_copy_map_grad[param].copy_(gpu_param.grad))
        fraction = 1.0
    if not fraction:
        return 0.0
    layer_params, embed, expert = stage_params(s, lay, first, last, rank)
    if st.frozen_lm:
        # freeze_language_model: only the vision side trains, so only its shards are stepped
        layer_params = embed = expert = 0.0
    shards, expert_shards = optimizer_shards(lay, st)
    return FP32 * ((layer_params + embed + vision) / shards + expert / expert_shards) * fraction


def fp8_master_cast_copies(s: Shape, lay: Layout, st: Settings, first: bool, last: bool,
                           rank: int | None = None) -> float:
    """The params-dtype casts of the FP8 weights' fp32 master shards, alive together at the end of the step.

    With FP8 primary weights (fp8_param_gather) the distributed optimizer's step ends in quantize_param_shard
    (distrib_optimizer.py:2815,2837), TE's quantize_master_weights, which first casts each master shard to the
    weight's nominal dtype and appends it to a per-recipe list (TE v2.17.1 tensor/utils.py:139-167), and only
    after the loop quantizes the list into the FP8 weights (:171-181). The step's fp32 gradient copies are still
    allocated then (optimizer.py:786,808: the inner step, then the copy to the model params). Only the layer
    GEMM weights are FP8 (embeddings and the output layer stay bf16: stage_params' embed)."""
    if not st.fp8_cast_copy_bytes or st.lora_rank or st.frozen_lm or "fp8_master_cast_copies" in st.without:
        return 0.0
    layer_params, _, expert = stage_params(s, lay, first, last, rank)
    # the first/last layers an FP8 job keeps in bf16 have params-dtype weights, copied from their masters in place
    bf16_dense, bf16_expert = stage_bf16_params(s, lay, st, (0 if first else lay.pp - 1) if rank is None else rank)
    shards, expert_shards = optimizer_shards(lay, st)
    casts = st.fp8_cast_copy_bytes * ((layer_params - bf16_dense) / shards + (expert - bf16_expert) / expert_shards)
    if st.fp4:
        # NVFP4 primary weights (fp4_param_gather: distrib_optimizer.py:2843-2847 quantize_nvfp4_param_shard,
        # fp4_utils.py:135-173) take the same path into _cast_master_weights_to_nvfp4_2d (TE utils.py:180-181),
        # which beside the casts allocates an fp32 amax and an fp32 scale per 16x16 tile of every local NVFP4
        # weight, whole, not its shard (utils.py:603-622 packed_amaxes, packed_scales): 8 bytes per 256 elements
        casts += NVFP4_TILE_STATS * ((layer_params - bf16_dense) + (expert - bf16_expert))
    return casts


# fp32 amax + fp32 scale per 16 x 16 tile of an NVFP4 weight during the master cast (fp8_master_cast_copies)
NVFP4_TILE_STATS = 2 * 4 / (16 * 16)

def communication_buffers(s: Shape, lay: Layout, st: Settings, rank: int, params: float) -> float:
    """Transient unsharded copies the data-parallel communication keeps beside the sharded state, and
    megatron-core's global memory buffer on the last stage."""
    if st.fsdp is not None:
        # Megatron FSDP: each layer is one FSDP unit (mcore_fsdp_adapter.py fsdp_unit_modules: TransformerLayer,
        # MoETransformerLayer, MambaLayer). Sharded parameters are all-gathered per unit, the next unit prefetched
        # (megatron_fsdp.py prefetch=True); sharded gradients are reduce-scattered from one unsharded unit.
        (p_shard, _), (g_shard, _) = fsdp_shards(lay, st)
        unit = largest_layer_params(s, lay, rank)
        gathered = 2 * unit * (st.param_bytes + st.fp8_weight_copy_bytes) if p_shard > 1 else 0.0
        unsharded_grads = unit * st.grad_bytes if g_shard > 1 and not (st.lora_rank or st.frozen_lm) else 0.0
        return gathered + unsharded_grads + fsdp_non_unit_params(s, lay, st, rank) + global_memory_buffer(
            s, lay, st, rank)
    out = global_memory_buffer(s, lay, st, rank)
    if st.dist_optimizer and lay.dp * lay.cp > 1 and "param_gather_in_place" in st.without:
        # the term before issue 30: one bucket's all-gathered params (Megatron bucket_size 40M params) in flight
        out += min(40e6, (params / st.param_bytes)) * st.param_bytes
    return out


def fsdp_non_unit_params(s: Shape, lay: Layout, st: Settings, rank: int) -> float:
    """The unsharded copy Megatron FSDP keeps of the parameters outside its units (embedding, output layer, final
    norm: every module that is not a TransformerLayer, MoETransformerLayer or MambaLayer) under
    optim_grads_params.

    Their modules all-gather their own parameters before their forward (megatron_fsdp.py _register_fsdp_hooks:
    the pre-forward unshard hook on every module) but only FSDP units get the post-forward release hook
    (megatron_fsdp.py:1072), and the all-gather pipeline's reset marks non-unit buckets PRESERVED instead of
    freeing them (param_and_grad_buffer.py AllGatherPipeline.reset :4352-4361; release_bucket: "Non-unit modules
    should remain persistently allocated", :4632): the gathered copy lives beside the shard for the whole job, in
    the compute dtype (embeddings are never FP8)."""
    if st.fsdp is None or "fsdp_non_unit_params" in st.without:
        return 0.0
    (p_shard, _), _ = fsdp_shards(lay, st)
    if p_shard <= 1:
        return 0.0
    _, embed, _ = stage_params(s, lay, rank == 0, rank == lay.pp - 1, rank)
    return embed * st.dtype_bytes


def global_memory_buffer(s: Shape, lay: Layout, st: Settings, rank: int) -> float:
    """megatron-core's GlobalMemoryBuffer: one tensor per (name, dtype), grown to the largest request and kept for
    the rest of the job (utils.py GlobalMemoryBuffer.get_tensor :701-719).

    Under "mpu": on the last stage under SP the trainable output layer (a megatron-core, not TE,
    ColumnParallelLinear) all-gathers its sequence-parallel input into it (tensor_parallel/layers.py:570, full
    sequence x hidden); megatron-core's DotProductAttention (mcore_attention_buffer) preallocates its raw scores
    there (transformer/dot_product_attention.py:189-191, [b x heads/tp, sq, sk] in the query's dtype) on every
    rank with attention layers. Both ask for the compute dtype, so they share one buffer: the larger. The deferred
    output-layer wgrad drain gathers into a second one ("mpu_0", utils.py drain_embedding_wgrad_compute). A frozen
    output layer (LoRA, freeze_language_model) gathers into a fresh tensor instead (layers.py
    linear_with_frozen_weight)."""
    if "global_memory_buffer" in st.without:
        return 0.0
    gather = 0.0
    if lay.sp and rank == lay.pp - 1 and not (st.lora_rank or st.frozen_lm) and s.vocab:
        gather = st.dtype_bytes * s.hidden * _tokens(lay)   # the gathered sequence: s x mbs / cp tokens x hidden
    scores = 0.0
    if st.mcore_attention and "mcore_attention_buffer" not in st.without and any(
            "attn" in kind for kind in rank_layers(s, lay, rank)):
        # DotProductAttention refuses context parallelism (dot_product_attention.py:57-58): sq = sk = seq
        scores = st.dtype_bytes * lay.mbs * max(1, s.heads // lay.tp) * lay.seq * lay.seq
    return max(gather, scores) + (gather if st.deferred_wgrad_microbatches else 0.0)


def _moe_dispatchers(s: Shape, lay: Layout, rank: int) -> int:
    """MoE layers (each with its own token dispatcher and its manager) on pipeline rank ``rank``: the decoder's, and
    on the last rank the MTP depths' (one module for all depths with mtp_use_repeated_layer)."""
    n = sum(count for kind, count in rank_layers(s, lay, rank).items() if "moe" in blocks_of(kind))
    if rank == lay.pp - 1 and s.mtp_layers:
        from .weights import mtp_blocks
        n += (1 if s.mtp_shared else s.mtp_layers) * sum(1 for b in mtp_blocks(s) if b == "moe")
    return n


def flex_dispatcher_state(s: Shape, lay: Layout, st: Settings, rank: int) -> float:
    """Routing tensors each MoE layer's flex dispatcher keeps referenced from one forward to its next, so one set
    per MoE layer is allocated in every phase (the step included), beside what autograd saves.

    The manager of each layer (token_dispatcher.py:1764-1792, one per MoELayer) stores what setup_metadata makes
    and nothing clears it (combine releases only the handle and the dispatched tensors, :1196, :1378-1381):
    HybridEP the routing map and probabilities expanded to the expert-TP-folded experts, new contiguous tensors
    [N, expert TP x experts] in bool and fp32 (_initialize_metadata :1827-1854, setup_metadata :1087-1088);
    DeepEP their top-k, [N, topk x expert TP] fp32 values and int64 indices (:1291). N: the sequence-local tokens
    of a microbatch."""
    if st.moe_dispatcher != "flex" or not s.experts:
        return 0.0
    local_tokens = _tokens(lay) / (lay.tp if lay.sp else 1)
    if st.flex_backend == "hybridep":
        per_token = (1 + FP32) * s.experts * lay.etp
    elif st.flex_backend == "deepep":
        per_token = (FP32 + 8) * s.topk * lay.etp
    else:
        return 0.0
    return _moe_dispatchers(s, lay, rank) * local_tokens * per_token


def paged_stash_tokens_bytes(s: Shape, lay: Layout, st: Settings, rank: int) -> float:
    """The most bytes of stashed expert tensors pipeline rank ``rank`` holds at once, at the balanced token count:
    what moe_paged_stash's capture iteration measures. In its first iteration the manager adds each marked saved
    tensor's expected tokens (``avg_num_tokens``, the dispatched budget over moe_expert_rank_capacity_factor:
    moe/experts.py :654-670) at save and takes them off when the backward reads it, and keeps the largest running
    sum per (dtype, width) (moe/paged_stash.py on_save_for_backward :704-740, on_get_saved_tensor :775-800): the
    peak of the in-flight MoE layer-microbatches over the rank's schedule (pipeline.rank_alive), each chunk's MoE
    layers weighted by what they stash (activations.paged_stash_layer_bytes), with the last rank's MTP MoE layers
    beside its loss microbatch."""
    from .activations import paged_stash_active, paged_stash_layer_bytes
    if not paged_stash_active(st) or not s.experts:
        return 0.0
    from .pipeline import rank_alive, rank_chunks
    from .weights import mtp_blocks
    per_chunk = [sum(paged_stash_layer_bytes(s, lay, st, kind, 1.0) for kind in chunk)
                 for chunk in rank_chunks(s, lay, rank)]
    mtp = 0.0
    if rank == lay.pp - 1 and s.mtp_layers and "moe" in mtp_blocks(s):
        mtp = s.mtp_layers * paged_stash_layer_bytes(s, lay, st, "attn+moe", 1.0)
    if "moe" in st.modules and st.recompute == "selective":
        # the MoE checkpoint's forward saves nothing; its recompute in the backward saves one layer's at a time
        return max((b for chunk in rank_chunks(s, lay, rank) for kind in chunk
                    if (b := paged_stash_layer_bytes(s, lay, replace(st, modules=tuple(
                        x for x in st.modules if x != "moe")), kind, 1.0))), default=0.0)
    return max(sum(n * b for n, b in zip(counts, per_chunk)) + (mtp if counts[-1] else 0.0)
               for counts in rank_alive(lay, rank))


def paged_stash_buffer(s: Shape, lay: Layout, st: Settings, rank: int) -> float:
    """The paged stash's GPU buffers on pipeline rank ``rank`` (moe_paged_stash with the fused grouped MLP; 0
    otherwise), allocated at the second iteration's reset and kept for the job (moe/paged_stash.py
    paged_stash_reset :908-915, allocate_stash_buffers :546-630): per (dtype, width) the measured peak
    (paged_stash_tokens_bytes; avg-based for a positive moe_paged_stash_buffer_size_factor_cuda, the actual
    tokens for a negative one, the same at balanced routing) times |factor|, in pages of moe_paged_stash_page_size
    tokens (PagedStashBuffer.__init__ :64-68; the page rounding, under a page per buffer, is left out)."""
    return abs(st.paged_stash_cuda) * paged_stash_tokens_bytes(s, lay, st, rank)


def paged_stash_host_buffer(s: Shape, lay: Layout, st: Settings, rank: int) -> float:
    """The pinned host buffer the stash spills to once its GPU pages run out (moe_paged_stash_buffer_size_factor_cpu;
    0: none, paged_stash.py :71-80, allocate_stash_buffers :580-590): host memory, not in the GPU's figure."""
    if not st.paged_stash_cpu:
        return 0.0
    return abs(st.paged_stash_cpu) * paged_stash_tokens_bytes(s, lay, st, rank)


# DeepEP v1.2.1 deep_ep/buffer.py get_dispatch_config / get_combine_config: (NVL chunked recv tokens, RDMA chunked
# send tokens, RDMA chunked recv tokens) per EP group size, for the dispatch and the combine (csrc/config.hpp
# Config; the NVL send-chunk size does not size a buffer)
DEEPEP_CONFIGS = {
    2: ((256, 6, 128), (256, 6, 128)), 4: ((256, 6, 128), (256, 6, 128)), 8: ((256, 6, 128), (256, 6, 128)),
    16: ((288, 20, 128), (288, 12, 128)), 24: ((288, 32, 128), (288, 8, 128)), 32: ((288, 32, 128), (288, 8, 128)),
    64: ((288, 28, 128), (288, 20, 128)), 128: ((560, 32, 128), (560, 12, 128)),
    144: ((720, 12, 128), (720, 8, 128)), 160: ((720, 12, 128), (720, 8, 128)),
}
DEEPEP_DEFAULT_SMS = 20            # fused_a2a.py set_deepep_num_sms: moe_flex_dispatcher_num_sms or 20
DEEPEP_WORKSPACE = 32 * MiB        # csrc/kernels/configs.cuh NUM_WORKSPACE_BYTES, cudaMalloc'd by Buffer::Buffer
NUM_MAX_NVL_PEERS = 8              # csrc/kernels/configs.cuh


def _deepep_nvl_bytes(hidden_bytes: int, ranks: int, sms: int, recv_tokens: int) -> int:
    """Config::get_nvl_buffer_size_hint (csrc/config.hpp): per channel (sms / 2) and NVL peer, the chunked
    receive tokens' data, source meta (8 bytes), top-k indices (128 x int64), weights and scales (128 x fp32)."""
    rdma_ranks, nvl_ranks, channels = max(ranks // NUM_MAX_NVL_PEERS, 1), min(ranks, NUM_MAX_NVL_PEERS), sms // 2
    n = channels * nvl_ranks * (2 * rdma_ranks + 3) * 4
    n += channels * nvl_ranks * recv_tokens * (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4)
    return (n + 127) // 128 * 128


def _deepep_rdma_bytes(hidden_bytes: int, ranks: int, sms: int, send_tokens: int, recv_tokens: int) -> int:
    """Config::get_rdma_buffer_size_hint (csrc/config.hpp): 0 within one NVLink node (legacy mode), else per
    channel and RDMA peer a send and a receive copy of the chunked tokens' data, source meta, top-k indices,
    weights, scales and an int4 each; the Config constructor first rounds the chunked receive tokens up to a
    multiple of the send chunk."""
    if ranks <= NUM_MAX_NVL_PEERS:
        return 0
    recv_tokens = math.ceil(recv_tokens / send_tokens) * send_tokens
    rdma_ranks, channels = ranks // NUM_MAX_NVL_PEERS, sms // 2
    n = channels * rdma_ranks * (NUM_MAX_NVL_PEERS * 2 + 2) * 2 * 4
    n += channels * rdma_ranks * recv_tokens * (hidden_bytes + 8 + 128 * 8 + 128 * 4 + 128 * 4 + 16) * 2
    return (n + 127) // 128 * 128


def flex_outside_torch_bytes(s: Shape, lay: Layout, st: Settings) -> float | None:
    """Bytes one GPU gives the flex dispatcher's communication buffers outside torch's caching allocator (so not
    in max_memory_allocated, nor in the plan's figure, yet on the GPU); 0 without the flex dispatcher, None when
    the code does not size them from the configuration (NCCL EP, a group size DeepEP has no config for).

    - DeepEP (v1.2.1, the legacy Buffer that fused_a2a.py get_buffer builds once, sized by the largest of the
      dispatch and combine configs' hints for 2-byte tokens of the dispatched width, hidden_bytes = width x
      max(element size, 2)): the NVLink buffer is cudaMalloc'd (csrc/deep_ep.cpp:48), the RDMA buffer NVSHMEM's
      (:227 internode::alloc), the 32 MiB workspace cudaMalloc'd (:62).
    - HybridEP (DeepEP hybrid-ep branch, commit 94a9f8f): ExtendedMemoryAllocator::allocate is cuMemCreate or
      cudaMalloc (csrc/hybrid_ep/allocator/allocator.cu:87-96). Every rank's NVLink buffers hold the worst case,
      all T x group tokens (buffer/intranode.cu:127-129; T: this rank's tokens, rounded up to 16 by
      hybrid_ep_buffer.py update_template_config): their 2-byte data, one fp32 probability per local expert of the
      NVLink domain (allocate_combine_buffers :253-261, shared with the dispatch's, :205-208) and the dispatch's
      fp32 scaling factors per 128 channels (:201, :213); across NVLink domains the RDMA buffers
      (buffer/internode_doca.cu allocate_dispatch_buffers :383-420, allocate_combine_buffers :557-580)."""
    if st.moe_dispatcher != "flex" or not s.experts:
        return 0.0
    group = max(1, lay.etp * lay.ep)
    width = s.moe_latent or s.hidden
    if st.flex_backend == "deepep":
        if group not in DEEPEP_CONFIGS:
            return None
        sms = st.flex_num_sms or DEEPEP_DEFAULT_SMS
        hidden_bytes = width * max(st.dtype_bytes, 2)
        nvl = max(_deepep_nvl_bytes(hidden_bytes, group, sms, c[0]) for c in DEEPEP_CONFIGS[group])
        rdma = max(_deepep_rdma_bytes(hidden_bytes, group, sms, c[1], c[2]) for c in DEEPEP_CONFIGS[group])
        return float(nvl + rdma + DEEPEP_WORKSPACE)
    if st.flex_backend == "hybridep":
        from .activations import hybridep_nodes
        per_domain = group // hybridep_nodes(lay, st)
        nodes = group // per_domain
        tokens = math.ceil(_tokens(lay) / (lay.tp if lay.sp else 1) / 16) * 16
        local_experts = max(1, s.experts // max(1, lay.ep))
        scale = FP32 * (width // 128)
        probs = FP32 * local_experts * per_domain          # one per local expert of the NVLink domain
        nvl = tokens * group * (2 * width + probs + scale)
        rdma = 0.0
        if nodes > 1:
            rest = nodes - 1
            rdma += tokens * (2 * width + probs * nodes + scale)                 # the attention side's input
            rdma += tokens * rest * (2 * width + probs + scale)                  # the inter-node group's
            rdma += 2 * tokens * rest * (2 * width + probs)                      # combine: reduced and grouped
        return float(nvl + rdma)
    return None
