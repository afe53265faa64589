"""What the plan assumes and where its terms come from, as data: the assumptions a plan prints (and its
uncertainty ranges qualify, memory/ranges.py), each with a summary and when it applies to a job, and the terms
added for issue 25 with their sources."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .inputs import Layout, Settings, Shape
from .pipeline import layer_kinds

# The assumptions a plan's uncertainty ranges qualify (memory/ranges.py); each range names one of these.
MOE_BALANCE = (
    "MoE tokens are balanced across experts (each GPU's experts take topk x its tokens); the range for "
    "activations runs to the most one GPU's experts can receive: capacity factor x that share when tokens beyond "
    "moe_expert_capacity_factor are dropped (moe_utils.py get_capacity, per source rank and expert), or, dropless, "
    "every token of the expert-parallel group routed to this GPU's experts; with "
    "moe_pad_expert_input_to_capacity the load is the capacity itself")
VOCAB_FROM_TOKENIZER = (
    "the vocabulary is the one Bridge sets at setup (training/setup.py:293-299, _validate_and_set_vocab_size): "
    "the tokenizer's, padded to make_vocab_size_divisible_by x TP, when tokenizer.use_tokenizer_vocab_size is set "
    "(the pretrain recipes' NullTokenizer) or model.vocab_size is None; else model.vocab_size as it is. The "
    "tokenizer's is tokenizer.vocab_size, or for a Hugging Face tokenizer the model's shipped config.json "
    "vocab_size (the padded embedding size, which can exceed the tokenizer's own by a few hundred tokens); when "
    "neither is known (and the recipe presets none) the embedding, output layer and logits are not counted and "
    "the range says how large a vocabulary still fits")
FP8_TRANSPOSE = (
    "FP8 weights keep a transposed FP8 copy (Hopper GEMMs take only the TN layout: TE v2.17.1 tensor/utils.py "
    "post_all_gather_processing _create_transpose); on a GPU with non-TN FP8 GEMMs (Blackwell) that byte per "
    "layer weight is not kept: the low end of the parameters' range")
GRAPH_WARMUP = (
    "with TE CUDA graphs the first cuda_graph_warmup_steps (W) iterations run eagerly and the graphs are captured "
    "at the start of iteration W + 1 (Bridge training/train.py:429-438), before that iteration's zero_grad "
    "(train.py:866-869; megatron-core zeroes the gradients only after capture, cuda_graphs.py:2671-2681 "
    "_reset_after_capture). With W >= 1 the capture therefore runs beside the Adam moments and the W-th step's "
    "fp32 gradient copies; with W = 0 it runs before the first step, when FusedAdam has not created its moments "
    "yet (TE v2.17.1 optimizers/fused_adam.py:615-616 initialize_state on first use). The eager iterations hold "
    "every activation (beside the moments from the second on). These one-time phases come before training and "
    "are the high end of the activations' range; the headline plan is training after capture: graph replay and "
    "the optimizer step")
PRECISION_AWARE_PATH = (
    "use_precision_aware_optimizer keeps the gradients in bf16 at the step (decoupled_grad) and gives the "
    "master weights to FusedAdam only where megatron-core's use_precision_aware_optimizer_no_fp8_or_ds_fp8 holds "
    "(optimizer_config.py:404-411: main params not fp32, an fp8_recipe of None or delayed, or CPU offload). "
    "Bridge's mixed-precision setup copies mixed_precision.fp8_recipe (default 'tensorwise', also without FP8) "
    "into the optimizer config (mixed_precision.py setup) before finalize computes it, so with fp32 main params "
    "the step takes the regular path: DistributedOptimizer's fp32 masters and fp32 gradient copies "
    "(distrib_optimizer.py:2782), with the moments in exp_avg_dtype")

ATTENTION_KERNEL = (
    "attention uses a fused/flash kernel (TE default): only softmax statistics and the output are kept "
    "beside q, k, v, so core_attn recompute drops the statistics and the kernel's output (a quantized or "
    "adapter-read copy for linear_proj stays). A non-fused attention (attention_backend unfused or local, "
    "or the local transformer_impl) keeps the s x s scores per head and microbatch: the softmax output (in"
    " the compute dtype with megatron-core's fused softmax kernel, else fp32 plus its cast back, or in the compute "
    "dtype without attention_softmax_in_fp32), and with"
    " attention dropout a bool mask and the dropped probabilities (activations.attention_scores_bytes); "
    "TE's unfused backend is taken to keep the same tensors as megatron-core's DotProductAttention. Gemma 2's own "
    "core attention is planned on FlexAttention (torch 2.5 and later; its softcap a score_mod, its output kept apart "
    "from the layer's), and where the job's torch lacks it its materialized, softcapped scores are the high end of "
    "the activations' range")
OUTSIDE_TORCH = (
    "CUDA context, NCCL communicators and TE userbuffers (cudaMalloc/cuMemCreate outside torch: TE v2.17.1 "
    "comm_gemm_overlap.cpp:421, userbuffers-host.cpp:660) are outside torch's allocated memory and not counted; "
    "neither are the flex MoE dispatcher's communication buffers (DeepEP's cudaMalloc'd NVLink buffer, NVSHMEM "
    "RDMA buffer and workspace: DeepEP v1.2.1 csrc/deep_ep.cpp:48, :62, :227; HybridEP's cuMemCreate / cudaMalloc "
    "buffers: hybrid-ep csrc/hybrid_ep/allocator/allocator.cu:87-96), which the code sizes from the group, the "
    "dispatched width and the tokens, so they are a range of the fit instead (buffers.flex_outside_torch_bytes); "
    "the cuBLAS workspaces are inside it and counted (buffers.gemm_workspaces: torch's per thread and stream, two "
    "threads; Transformer Engine's one, plus one per compute stream with its grouped GEMM) for a GPU of compute "
    "capability 9 (H100/H200) unless the plan is told another")

VISION_IMAGES = (
    "a vision-language model's vision encoder runs on the images of each microbatch, and what it keeps for backward "
    "grows with their patches (memory/vision.py terms): every image token is a position of the language model's "
    "sequence, one merged token of spatial_merge_size^2 patches (Qwen-VL; Gemma 3: (image_size / patch)^2 patches per "
    "mm_tokens_per_image tokens), so a microbatch carries at most seq_length x micro_batch_size image tokens. Where "
    "the dataset states its images (Bridge's mock VLM dataset: num_images of image_size each, at that size rounded "
    "to the patch grid, the processor's min/max pixels not being read offline) the plan sizes those and the range "
    "runs to the bound; otherwise (Hugging Face conversations, Energon) the plan sizes the bound and the range runs "
    "down to a microbatch without images. The encoder sits on the first pipeline stage's first model chunk "
    "(pre_process), whole there; Qwen3-VL's ViT is split over the language model's TP (not sequence parallel), "
    "the Hugging Face towers are whole on every TP rank")
FROZEN_PARTS = (
    "frozen parts (freeze_language_model, freeze_vision_model, freeze_vision_projection, PEFT's frozen base) have "
    "requires_grad False: no main-grad buffer (distributed_data_parallel.py:114-116, Megatron FSDP's "
    "only_create_grad_buffer_and_main_weight_buffer_for_param_requires_grad), no optimizer state or fp32 master "
    "(optimizer/__init__.py:330-331), their weights still in the params dtype. A frozen GEMM keeps no input for a "
    "weight gradient (TE backward_needs_input = weight.requires_grad; a frozen megatron-core Linear runs "
    "linear_with_frozen_weight, which saves only the weight), but where something before it trains the backward "
    "still runs through it and every other saved tensor stays (norm inputs, q/k/v, the activation's input); a part "
    "with nothing trainable in or before it (a frozen encoder fed by pixels) keeps nothing")


@dataclass(frozen=True)
class Assumption:
    """One assumption of the plan: its text (with its sources), a one-line summary, and when it changes a job's
    figure (``applies`` on the plan's inputs; None: every job's). The plan's default text names the assumptions that
    apply to the job in their summary; ``--assumptions`` and ``--json`` give them all, in full."""
    name: str
    applies: Callable[[Shape, Layout, Settings], bool] | None
    summary: str
    text: str

    def holds(self, s: Shape, lay: Layout, st: Settings) -> bool:
        return self.applies is None or bool(self.applies(s, lay, st))


ASSUMPTION_TABLE: tuple[Assumption, ...] = (
    Assumption("allocated_only", None,
               "allocated memory only (torch's max_memory_allocated, Bridge's mem-max-allocated): allocator "
               "fragmentation (reserved-but-unallocated) is not counted",
               "allocated memory only (torch's max_memory_allocated, what Bridge reports as mem-max-allocated): "
               "allocator fragmentation (reserved-but-unallocated) is not modelled; expandable_segments therefore "
               "shows 0 B of change although it is the fix for that gap. The caching allocator rounds every request "
               "up to 512 bytes (negligible) and hands out a cached large block whole when less than 1 MiB would be "
               "left over (CUDACachingAllocator should_split): that slack depends on the order of allocations and is "
               "not modelled"),
    Assumption("outside_torch", None,
               "CUDA context, NCCL communicators, TE userbuffers and the flex dispatcher's buffers are outside torch's "
               "allocator and not counted; the cuBLAS workspaces are counted",
               OUTSIDE_TORCH),
    Assumption("headline_phases", None,
               "the peak is the larger of the 1F1B steady state and the optimizer step, per pipeline rank; the "
               "one-time warm-up and graph capture bound the range",
               "the headline peak is the larger of the two phases every training iteration goes through, on the first"
               " and last pipeline ranks (and any middle rank whose layers differ): the 1F1B steady state (most "
               "microbatches in flight, plus the last stage's loss, deferred output-layer gradients and "
               "megatron-core's global memory buffer) and the optimizer step (fp32 copies of bf16 gradients, the "
               "params-dtype casts of FP8 master weights, and the CUDA graphs' static inputs). The one-time phases "
               "before training, eager warm-up iterations and CUDA graph capture, are planned per rank too and bound "
               "the activations' range"),
    Assumption("cuda_graphs", lambda s, lay, st: bool(st.graph_scopes),
               "per-layer CUDA graphs as megatron-core's TECudaGraphHelper captures them: one per graphable layer and"
               " in-flight microbatch, their pool reserved (not allocated) in replay",
               "per-layer CUDA graphs (cuda_graph_modules, or the deprecated cuda_graph_scope; none: the whole layer)"
               " follow megatron-core's TECudaGraphHelper (transformer/cuda_graphs.py) and TE v2.17.1's "
               "make_graphed_callables (pytorch/graph.py): one graph per graphable layer (_layer_is_graphable: attn, "
               "mlp, moe/moe_router, mamba by layer type) and per microbatch in the pipeline order (one microbatch "
               "without PP), captured after the warm-up steps; the captured scopes' saved activations for the "
               "in-flight microbatches are the capture peak and stay as the graphs' private pool (reserved, not "
               "allocated, in replay). Each graphed layer and in-flight microbatch has a static input (the hidden "
               "state, plus for attention graphs the bool mask mbs x s/cp x s: _get_layer_static_inputs), allocated "
               "throughout, and a static output, allocated while capturing and weak-referenced into the pool after "
               "its backward graph is captured (_reuse_graph_input_output_buffers), so in replay it and the next "
               "eager norm's saved copy of it are pool memory. Static gradient buffers (reused by shape; the previous"
               " graph's weak-referenced) are not counted. The local implementation is modelled the same way"),
    Assumption("graph_warmup", lambda s, lay, st: bool(st.graph_scopes),
               "the graphs are captured after cuda_graph_warmup_steps eager iterations, once, before training: the "
               "high end of the activations' range",
               GRAPH_WARMUP),
    Assumption("precision_aware", lambda s, lay, st: st.precision_aware,
               "the precision-aware optimizer keeps bf16 gradients at the step only where megatron-core's "
               "use_precision_aware_optimizer_no_fp8_or_ds_fp8 holds",
               PRECISION_AWARE_PATH),
    Assumption("attention_kernel", lambda s, lay, st: any("attn" in k for k in layer_kinds(s)),
               "attention keeps softmax statistics and its output with a fused/flash kernel, the s x s scores with a "
               "non-fused one",
               ATTENTION_KERNEL),
    Assumption("hidden_dropout", lambda s, lay, st: st.hidden_dropout,
               "hidden dropout keeps one bool mask per block per token",
               "hidden dropout (hidden_dropout > 0) keeps one bool mask per block per token (the bias-dropout-add); "
               "fused attention's own dropout keeps only its RNG state"),
    Assumption("lora_gemm_inputs", lambda s, lay, st: st.lora_rank > 0,
               "a frozen GEMM keeps its input only when a LoRA adapter reads the same tensor",
               "a GEMM input is kept only for a weight gradient (TE backward_needs_input): frozen LoRA base GEMMs "
               "keep theirs only when an adapter reads the same tensor; under SP a column-parallel LoRA-A keeps the "
               "full gathered input unless input re-gather lets it reuse the sequence-local shard"),
    Assumption("fp8_transpose", lambda s, lay, st: st.fp8 and not st.fp4,
               "FP8 weights keep a transposed FP8 copy on Hopper, not on Blackwell (the parameters' low end)",
               FP8_TRANSPOSE),
    Assumption("moe_balance", lambda s, lay, st: bool(s.experts and s.moe_layers),
               "MoE tokens are balanced across experts; the activations' range runs to the most one GPU's experts can"
               " receive",
               MOE_BALANCE),
    Assumption("moe_recompute", lambda s, lay, st: st.recompute == "selective" and "moe" in st.modules,
               "'moe' selective recompute keeps the pre-MLP norm output unless 'layernorm' is recomputed too",
               "'moe' selective recompute checkpoints the MoE layer with the pre-MLP norm output as its saved input "
               "(moe/moe_layer.py tensor_parallel.checkpoint(custom_forward, False, hidden_states, ...)): that output"
               " stays unless 'layernorm' is selected too, which megatron-core turns off for MoE layers under a TE "
               "moe_router graph unless moe_preprocess is graphed with the alltoall dispatcher (transformer_layer.py "
               "can_recompute_pre_mlp_layernorm_for_cudagraph)"),
    Assumption("mamba_kernel", lambda s, lay, st: "mamba" in layer_kinds(s),
               "Mamba blocks use the fused conv1d+scan kernel (use_mamba_mem_eff_path)",
               "hybrid (Mamba) blocks use the fused conv1d+scan kernel (use_mamba_mem_eff_path, the default), which "
               "keeps its input projection and scan output and recomputes the conv output and chunk states; the "
               "mixer's group RMSNorm keeps its input and out_proj its input"),
    Assumption("vocabulary", None,
               "the vocabulary is the one Bridge sets at setup: the tokenizer's, padded to "
               "make_vocab_size_divisible_by x TP, or model.vocab_size",
               VOCAB_FROM_TOKENIZER),
    Assumption("activation_offload", lambda s, lay, st: st.cpu_offload_layers > 0,
               "activation CPU offload removes the offloaded layers' activations (double buffering adds one layer "
               "back)",
               "activation CPU offload removes the offloaded layers' activations from the GPU (double buffering adds "
               "one layer back)"),
    Assumption("optimizer_offload", lambda s, lay, st: st.optimizer_offload > 0,
               "optimizer CPU offload moves the offloaded Adam moments; the distributed optimizer's fp32 master shard"
               " stays on the GPU",
               "optimizer CPU offload (HybridDeviceOptimizer, optimizer/cpu_offloading/hybrid_optimizer.py) clones "
               "the offloaded fraction of the optimizer's parameters to pinned CPU memory and copies each CPU step's "
               "result back to the GPU parameter: with the distributed optimizer and a non-precision-aware optimizer "
               "that parameter is DistributedOptimizer's fp32 master shard, which therefore stays on the GPU, and "
               "only the offloaded Adam moments leave; the fp32 gradient copy at the step is still made for every "
               "shard (distrib_optimizer.py _copy_model_grads_to_main_grads). With the precision-aware optimizer "
               "megatron-core keeps no master (shard_main_param=None) and the hybrid optimizer makes fp32 masters "
               "itself, the offloaded part on the CPU and the rest on the GPU with fp32 moments (its GPU Adam gets no"
               " exp_avg_dtype, optimizer/__init__.py). Without the distributed optimizer, Float16Optimizer's fp32 "
               "masters stay beside the hybrid optimizer's own fp32 copies of the GPU part"),
    Assumption("distributed_optimizer", lambda s, lay, st: st.dist_optimizer and not st.fsdp,
               "the distributed optimizer shards over DP x CP / ddp.num_distributed_optimizer_instances ranks",
               "the distributed optimizer shards over DP x CP / ddp.num_distributed_optimizer_instances ranks (expert"
               " state over expert DP / instances: parallel_state.py intra-partial distributed-optimizer groups)"),
    Assumption("megatron_fsdp", lambda s, lay, st: bool(st.fsdp),
               "Megatron FSDP shards per data_parallel_sharding_strategy, with two units of parameters and one of "
               "gradients unsharded at a time",
               "Megatron FSDP shards, per ddp.data_parallel_sharding_strategy, the optimizer state (optim), also the "
               "gradients (optim_grads) and also the parameters (optim_grads_params) across the same groups "
               "(megatron_fsdp/param_and_grad_buffer.py _init_each_parameter_group_buffers; with several optimizer "
               "instances optimizer state spans all of DP only when outer_dp_sharding_strategy is optim); every layer"
               " is one FSDP unit, and the transient unsharded copies are two units of parameters (the current one "
               "and the prefetched next) and one unit of gradients; under optim_grads_params the embedding and output"
               " layer (outside every unit) stay gathered for the whole job beside their shard; no fp32 gradient copy"
               " is made at the step (FSDP owns its main-grad buffers)"),
    Assumption("vision_images", lambda s, lay, st: s.vision is not None,
               "the vision encoder is sized for the images the configuration allows or the mock dataset states, on "
               "the first pipeline stage",
               VISION_IMAGES),
    Assumption("frozen_parts", lambda s, lay, st: st.frozen_lm or (s.vision is not None and not (
        s.vision.encoder_trains and s.vision.projector_trains)),
               "frozen parts keep no gradients or optimizer state, and their GEMMs no inputs for a weight gradient",
               FROZEN_PARTS),
    Assumption("muon", lambda s, lay, st: st.optimizer == "muon",
               "Muon keeps one fp32 momentum per 2-D non-embedding parameter, Adam's moments for the rest",
               "Muon steps every 2-D non-embedding parameter with one fp32 momentum, Adam the rest; with the "
               "distributed optimizer it is the layer-wise optimizer's legacy path (--no-use-layer-wise-param-layout:"
               " whole parameters ping-pong over DP ranks, the plan's figure is the most loaded rank unless "
               "Settings.dp_rank names one); the default shard-aligned layout path (bin-packed buckets, Adam "
               "parameters byte-sharded by a DistributedOptimizer) is planned the same way; Newton-Schulz temporaries"
               " of one matrix at the step are not counted"),
)
ASSUMPTIONS = tuple(a.text for a in ASSUMPTION_TABLE)
BY_TEXT = {a.text: a for a in ASSUMPTION_TABLE}


def applying(inputs) -> tuple[str, ...]:
    """The texts of the assumptions that change the figure of any of ``inputs`` ((Shape, Layout, Settings) each,
    e.g. a plan's steps), in the table's order."""
    inputs = list(inputs)
    return tuple(a.text for a in ASSUMPTION_TABLE if any(a.holds(*i) for i in inputs))


# Terms added for issue 25, each found in the code path of a measured configuration (bench/plan_accuracy.py) and
# physically general; Settings.without switches any of them off so the bench can show what each one changes.
# name -> (what the model now counts, where it comes from: installed megatron-core 0.19.2 / Bridge 0.6.2 files,
# Transformer Engine at tag v2.17.1, the commit Bridge 0.6.x's uv.lock pins).
ADDED_TERMS = {
    "glu_linear_copy": (
        "unfused GLU (bias_activation_fusion off): the linear half plus glu_linear_offset is a new tensor the "
        "product keeps, a clamped gate is a new tensor silu keeps; MoE experts without the fused weighted kernel "
        "also keep the activation output for the probabilities' gradient",
        "megatron/core/transformer/mlp.py:324-331 (glu: activation_func(x_glu) * (x_linear + glu_linear_offset)); "
        "transformer/moe/experts.py:861-879 (the same, then intermediate_parallel * permuted_probs)"),
    "core_attn_output": (
        "core_attn recompute keeps q, k, v only: the fused kernel's bf16 output is dropped unless linear_proj "
        "keeps that same tensor for a bf16 weight gradient (under FP8 it keeps a quantized copy instead)",
        "megatron/core/transformer/attention.py:461,494 (_checkpointed_attention_forward: checkpoint(custom_forward, "
        "False, query, key, value, ...)); tensor_parallel/random.py:618 (CheckpointFunction: "
        "ctx.save_for_backward(*args))"),
    "te_cross_entropy_in_place": (
        "TE's fused cross entropy writes the gradient into the bf16 logits and saves them: 2 bytes per logit, "
        "not 6",
        "TE v2.17.1 transformer_engine/pytorch/cross_entropy.py:53-62; common/triton/cross_entropy.py:190 "
        "(tl.store(X_ptr + X_offsets, X_block.to(grad_dtype))); megatron/core/models/common/language_module/"
        "language_module.py:186 (te_parallel_cross_entropy(logits, ...))"),
    "graph_outputs_in_pool": (
        "in CUDA graph replay a graph's static output, and the next eager norm's saved copy of it, are pool "
        "memory (weak references), not allocated",
        "TE v2.17.1 transformer_engine/pytorch/graph.py:719-723 (make_weak_ref(static_outputs)), :866 (replay "
        "returns static_outputs); megatron/core/transformer/cuda_graphs.py:2593-2595 "
        "(_reuse_graph_input_output_buffers=True for TE >= 2.7)"),
    "graph_static_inputs_at_step": (
        "CUDA graph static inputs (one hidden state per in-flight layer-microbatch) stay allocated at the optimizer "
        "step",
        "megatron/core/transformer/module.py:257 (get_layer_static_inputs: torch.ones hidden state), "
        "transformer/cuda_graphs.py:2231 (_get_sample_arguments: reused per signature), TE v2.17.1 graph.py:848 "
        "(replay copies each input into its static buffer)"),
    "block_recompute_one_layer": (
        "full recompute with method block checkpoints each of its first n layers on its own, so one layer is "
        "re-materialized at a time (uniform re-materializes a group of n)",
        "megatron/core/recompute.py:167-181 (block: chunk_runner(layer_idx, layer_idx + 1, use_checkpoint)); "
        ":157-166 (uniform: chunk_runner(layer_idx, layer_idx + recompute_num_layers, True))"),
    "global_memory_buffer": (
        "the last stage's trainable output layer under SP all-gathers into megatron-core's global memory buffer "
        "(full sequence x hidden, bf16), kept for the job; the deferred-wgrad drain keeps a second one",
        "megatron/core/tensor_parallel/layers.py:570 (get_global_memory_buffer().get_tensor(dim_size, input.dtype, "
        "\"mpu\")); megatron/core/utils.py:1259 (drain_embedding_wgrad_compute: \"mpu_0\")"),
    "fp8_master_cast_copies": (
        "FP8 primary weights with the distributed optimizer: at the step TE first casts every fp32 master shard of a "
        "quantized weight to the params dtype and holds all the casts in a list until it has quantized them into "
        "the FP8 weights, beside the step's fp32 gradient copies: 2 bytes per quantized weight element of this "
        "rank's optimizer shard (bf16 params)",
        "megatron/core/optimizer/optimizer.py:786,808 (optimizer.step(), then _copy_main_params_to_model_params); "
        "optimizer/distrib_optimizer.py:2815,2837 (fp8_param_gather: quantize_param_shard); fp8_utils.py:415 "
        "(cast_master_weights_to_fp8); TE v2.17.1 transformer_engine/pytorch/tensor/utils.py:139-144 "
        "(master_weight = master_weight.to(model_weight.dtype)), :148-167 (appended to the per-recipe lists), "
        ":171-181 (cast after the loop)"),
    "precision_aware_grad_upcast": (
        "use_precision_aware_optimizer with fp32 main params and an fp8_recipe other than delayed (Bridge's default "
        "'tensorwise', also without FP8) and no CPU offload takes megatron-core's regular path: the step makes "
        "fp32 gradient copies (the plan said bf16 decoupled gradients)",
        "megatron/core/optimizer/optimizer_config.py:404-411 (use_precision_aware_optimizer_no_fp8_or_ds_fp8); "
        "optimizer/distrib_optimizer.py:2774-2782 (decoupled_grad only under that flag, else .float()); "
        "megatron/bridge/training/mixed_precision.py:130-131 (setup copies fp8_recipe into the optimizer config), "
        "megatron/bridge/training/config.py:136-142 (OptimizerConfig.finalize runs the post-init after that)"),
    "param_gather_in_place": (
        "the distributed optimizer all-gathers each bucket's parameters into the bucket's own param_data, which "
        "every rank already holds whole (its shard is a view of it): no in-flight copy of a bucket (before: one "
        "bucket of up to 40M parameters counted beside the state)",
        "megatron/core/distributed/param_and_grad_buffer.py:504-518 (start_param_sync: shard_buffer(bucket.param_data), "
        "dist_all_gather_func(bucket.param_data, local_data_view))"),
    "gemm_workspaces": (
        "the cuBLAS workspaces torch's caching allocator holds from the first GEMM on: torch's one per thread and "
        "stream (the forward's thread and the autograd engine's device thread: 2 x 32 MiB on compute capability "
        "9/10/12, or CUBLAS_WORKSPACE_CONFIG's sum), Transformer Engine's one (32 MiB from capability 9 on, else 4 "
        "MiB), and with TE's grouped GEMM one more per TE compute stream (4)",
        "torch 2.14.1 aten/src/ATen/cuda/CublasHandlePool.cpp (parseChosenWorkspaceSize; setCublasWorkspace: one "
        "workspace per (cuBLAS handle, stream), getNewWorkspace from CUDACachingAllocator; the unified cuBLASLt "
        "workspace), declared in torch/include/ATen/cuda/CUDAContextLight.h:97,99 (cublas_handle_stream_to_workspace, "
        "getChosenWorkspaceSize); a handle per thread (ATen/cuda/detail/DeviceThreadHandles.h); the autograd "
        "engine's worker thread per device runs the backward (torch/include/torch/csrc/autograd/engine.h:237 "
        "start_device_threads); TE v2.17.1 transformer_engine/pytorch/module/base.py (get_cublas_workspace_size_bytes, "
        "get_workspace, get_multi_stream_cublas_workspace)"),
    "recompute_after_loss": (
        "full recompute on the last stage: a checkpointed group is re-materialized only in its own backward, after "
        "the loss and the output layer have released the logits, so the peak holds the larger of the loss buffers "
        "and the re-materialized group, not both",
        "megatron/core/tensor_parallel/random.py:625,647 (CheckpointFunction.backward: outputs = "
        "ctx.run_function(*detached_inputs)); pipeline_parallel/schedules.py:532 (backward_step from the loss)"),
    "interleaved_schedule": (
        "the microbatches alive on a pipeline rank follow Megatron's schedule step by step: per model chunk (chunks "
        "of an uneven split, a pipeline layout or the embedding/loss counted as a layer hold different layers, the "
        "last rank's last chunk holds the loss), with the interleaved warm-up of (pp - rank - 1) x 2 + (vpp - 1) x "
        "microbatch_group_size_per_vp_stage (before: every chunk alike, the group taken as pp)",
        "megatron/core/pipeline_parallel/schedules.py:937-951 (get_pp_rank_microbatches), :962-989 "
        "(get_schedule_table), :1217-1222 (get_model_chunk_id: backward runs chunk vpp - 1 - c), :1706-1900 (steady "
        "1F1B: a forward, then a backward); megatron/core/model_parallel_config.py:567-568 (group defaults to pp)"),
    "loss_chunk_inputs": (
        "the last stage keeps, per microbatch, the final norm's input and the output layer's input (two "
        "sequence-local hidden states no decoder layer keeps)",
        "megatron/core/transformer/transformer_block.py:692-693 (final_layernorm on the last layer's output); "
        "megatron/core/tensor_parallel/layers.py:548 (the output layer's LinearWithGradAccumulationAndAsync"
        "Communication: ctx.save_for_backward(input, weight))"),
    "mcore_attention_buffer": (
        "megatron-core's own DotProductAttention (transformer_impl local, attention_backend local) preallocates "
        "its raw scores [b x heads/tp, s, s] in the global memory buffer, which keeps the largest request for the "
        "job; the output layer's SP gather shares that buffer (name \"mpu\", the same dtype)",
        "megatron/core/transformer/dot_product_attention.py:189-191 (get_global_memory_buffer().get_tensor(..., "
        "query.dtype, \"mpu\")); megatron/core/utils.py:701-719 (GlobalMemoryBuffer.get_tensor: one buffer per "
        "name and dtype, grown, never freed); megatron/bridge/models/gpt_provider.py:277-279 (attention_backend "
        "local swaps DotProductAttention in)"),
    "graph_capture_after_warmup": (
        "the CUDA graph capture as Bridge runs it, once, before training: with cuda_graph_warmup_steps >= 1 beside "
        "the last warm-up step's fp32 gradient copies, with 0 before the Adam moments exist; a one-time phase "
        "like the eager warm-up, so it bounds the range and the headline is replay and the optimizer step (before: "
        "the capture's activations beside the full state, in the headline)",
        "megatron/bridge/training/train.py:429-438 (create_cudagraphs when step - start == "
        "cuda_graph_warmup_steps, before train_step), :866-869 (train_step: optimizer.zero_grad); "
        "megatron/core/transformer/cuda_graphs.py:2671-2681 (_reset_after_capture zeroes after capture); TE "
        "v2.17.1 transformer_engine/pytorch/optimizers/fused_adam.py:615-616 (moments created at the first step)"),
    # issue 30, Megatron FSDP, non-fused attention and Muon (found on the corpus's FSDP, MLA and Muon cases)
    "fsdp_non_unit_params": (
        "Megatron FSDP optim_grads_params keeps the parameters outside its units (embedding, output layer, final "
        "norm) all-gathered for the whole job beside their shard: only units are released after their forward, "
        "and the all-gather pipeline's reset preserves non-unit buckets",
        "megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py:1072 (the post-forward release hook, "
        "units only); megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:4352-4361 "
        "(AllGatherPipeline.reset: non-unit buckets PRESERVED), :4632 (release_bucket: non-unit modules remain "
        "persistently allocated)"),
    "fsdp_grad_dtypes": (
        "Megatron FSDP with FP8 parameters and megatron_fsdp_main_grads_dtype unset keeps only the FP8 weights' "
        "gradients in bf16; the other parameters' (embeddings, output layer) stay in the params dtype (fp32 "
        "when training in fp32)",
        "megatron/core/distributed/fsdp/src/megatron_fsdp/param_and_grad_buffer.py:2306-2315 "
        "(_resolve_group_grad_dtype: bf16 for float8 groups, else the group's dtype)"),
    "unfused_attention_output": (
        "a non-fused attention (unfused/local backend) ends in bmm(probs, v), which saves its inputs, not its "
        "output: no kernel output is kept beside linear_proj's own (FP8: quantized) input",
        "megatron/core/transformer/dot_product_attention.py:239 (context = torch.bmm(attention_probs, value...)); "
        "TE v2.17.1 transformer_engine/pytorch/attention/dot_product_attention/backends.py "
        "UnfusedDotProductAttention.forward (torch.bmm(attention_probs, value_layer...), then a permuted copy)"),
    "muon_state": (
        "Muon keeps one fp32 momentum per 2-D non-embedding parameter beside its fp32 master (Adam's two moments "
        "only for the rest), and is never the DistributedOptimizer: --use-distributed-optimizer becomes the "
        "layer-wise optimizer, which gives whole parameters to data-parallel ranks ping-pong by size, so the rank "
        "that draws the embedding holds its state",
        "megatron/core/optimizer/emerging_optimizers.py:128-130 (_is_nonlinear_or_embedding: embeddings and "
        "non-2-D to the scalar optimizer); Emerging-Optimizers orthogonalized_optimizer.py _init_group "
        "(state['momentum_buffer'] = torch.zeros_like(p)); megatron/training/arguments.py:1670-1682 "
        "(use_layer_wise_distributed_optimizer, use_distributed_optimizer = False); "
        "megatron/core/optimizer/layer_wise_optimizer.py:645,659 (_shard_params_ping_pong)"),
}
