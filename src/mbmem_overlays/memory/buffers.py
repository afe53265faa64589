"""Buffers beside the model state and the activations: the optimizer step's fp32 gradient copies and FP8 master
casts, the data-parallel communication buffers (Megatron FSDP's gathered units, the distributed optimizer's
bucket) and megatron-core's global memory buffer."""

from __future__ import annotations

from .inputs import FP32, Layout, Settings, Shape, _tokens
from .weights import fsdp_shards, largest_layer_params, optimizer_shards, stage_params

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
    shards, expert_shards = optimizer_shards(lay, st)
    return FP32 * ((layer_params + embed) / shards + expert / expert_shards) * fraction


def fp8_master_cast_copies(s: Shape, lay: Layout, st: Settings, first: bool, last: bool,
                           rank: int | None = None) -> float:
    """The params-dtype casts of the FP8 weights' fp32 master shards, alive together at the end of the step.

    With FP8 primary weights (fp8_param_gather) the distributed optimizer's step ends in quantize_param_shard
    (distrib_optimizer.py:2815,2837), TE's quantize_master_weights, which first casts each master shard to the
    weight's nominal dtype and appends it to a per-recipe list (TE v2.17.1 tensor/utils.py:139-167), and only
    after the loop quantizes the list into the FP8 weights (:171-181). The step's fp32 gradient copies are still
    allocated then (optimizer.py:786,808: the inner step, then the copy to the model params). Only the layer
    GEMM weights are FP8 (embeddings and the output layer stay bf16: stage_params' embed)."""
    if not st.fp8_cast_copy_bytes or st.lora_rank or "fp8_master_cast_copies" in st.without:
        return 0.0
    layer_params, _, expert = stage_params(s, lay, first, last, rank)
    shards, expert_shards = optimizer_shards(lay, st)
    return st.fp8_cast_copy_bytes * (layer_params / shards + expert / expert_shards)

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
        unsharded_grads = unit * st.grad_bytes if g_shard > 1 and not st.lora_rank else 0.0
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
    """megatron-core's GlobalMemoryBuffer on the last stage under SP: the trainable output layer (a megatron-core,
    not TE, ColumnParallelLinear) all-gathers its sequence-parallel input into a buffer that lives for the rest
    of the job (tensor_parallel/layers.py LinearWithGradAccumulationAndAsyncCommunication:
    get_global_memory_buffer().get_tensor(dim_size, input.dtype, "mpu"), full sequence x hidden, bf16); the
    deferred output-layer wgrad drain gathers into a second one ("mpu_0", utils.py drain_embedding_wgrad_compute).
    A frozen output layer (LoRA) gathers into a fresh tensor instead (layers.py linear_with_frozen_weight)."""
    if "global_memory_buffer" in st.without or not lay.sp or rank != lay.pp - 1 or st.lora_rank or not s.vocab:
        return 0.0
    full = st.dtype_bytes * s.hidden * _tokens(lay)   # the gathered sequence: s x mbs / cp tokens x hidden
    return full * (2 if st.deferred_wgrad_microbatches else 1)
