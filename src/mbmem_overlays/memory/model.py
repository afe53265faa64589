"""The memory plan: per-GPU bytes for the most-loaded GPU, before and after each overlay.

Shaped like Bridge's ``training/utils/theoretical_memory_utils.py``: pure functions over
frozen dataclasses, assumptions returned as data, formatting kept separate. Bridge's
estimator ignores recompute, offload, SP, LoRA and precision (bridge-config-surface.md §5);
this model accounts for each, term by term, from what the training step keeps alive.

Units: bytes. "Per token" terms are multiplied by the tokens a GPU holds per microbatch
(seq x MBS / CP) and by the microbatches in flight on the pipeline stage.

This module is the model's one public name space; each concern lives in its own file, with its sources
(docs/memory-model.md maps every term to its file):

- ``inputs``: Shape, Layout, Settings, Breakdown and the bytes per element
- ``assumptions``: the assumption texts and the issue-25 terms with their sources
- ``pipeline``: which layers each pipeline rank holds, microbatches in flight, candidate ranks
- ``weights``: parameters, gradients and optimizer state (distributed optimizer, FSDP, CPU offload)
- ``activations``: what one layer keeps per token, block by block, and selective recompute
- ``graphs``: per-layer CUDA graphs (pool, static buffers)
- ``stage_activations``: one pipeline rank's activations (in flight, full recompute, offload, loss)
- ``buffers``: optimizer-step copies, communication buffers, the global memory buffer
- ``phases``: the phases, each rank's peak, memory lines per iteration, the most-loaded GPU
- ``from_config``: Shape, Layout and Settings from a Bridge ConfigContainer
- ``plan``: Step, Plan and the fit verdict
"""

from __future__ import annotations

from .activations import (RECOMPUTE_DROPS, _selected_terms, dispatcher_terms, latent_width,  # noqa: F401
                          layer_activation, layer_activation_terms)
from .assumptions import (ADDED_TERMS, ASSUMPTIONS, ATTENTION_KERNEL, FP8_TRANSPOSE, FROZEN_PARTS,  # noqa: F401
                          GRAPH_WARMUP, MOE_BALANCE, OUTSIDE_TORCH, PRECISION_AWARE_PATH, VISION_IMAGES,
                          VOCAB_FROM_TOKENIZER)
from .buffers import (communication_buffers, flex_dispatcher_state, flex_outside_torch_bytes,  # noqa: F401
                      fp8_master_cast_copies, global_memory_buffer, optimizer_step_buffers, paged_stash_buffer,
                      paged_stash_host_buffer)
from .from_config import (_capacity_factor, _dtype_bytes, _moe_weights_activation_separately,  # noqa: F401
                          _tokenizer_vocab, bf16_layer_span, cross_entropy_impl, fp8_cast_copy_bytes,
                          fp8_weight_copy_bytes, from_config, graph_scopes, loss_bytes, model_vocab, moe_dispatcher,
                          recompute_modules, vocab_size)
from .graphs import (GRAPH_SCOPE_TERMS, WHOLE_LAYER, graph_outputs_read_eagerly, graphed_blocks,  # noqa: F401
                     layer_graph_buffers, layer_graph_parts)
from .inputs import (ADAM_MOMENTS, BF16, FP8, FP32, Breakdown, Layout, Settings, Shape,  # noqa: F401
                     _tokens)
from .phases import (HEADLINE_PHASES, ONE_TIME_PHASES, PHASES, REPORTED_ITERATIONS, _graphed,  # noqa: F401
                     _phases, estimate, memory_lines, one_time_peak, phase_breakdowns, reported_breakdowns,
                     reported_phases, stage_breakdowns, stage_peak)
from .pipeline import (BF16_LAYER, HYBRID_SYMBOLS, _candidate_ranks, _rank_chunks, _rank_layers,  # noqa: F401
                       blocks_of, in_flight, layer_kinds, rank_chunks, rank_layers, runs_bf16)
from .plan import (DOES_NOT_FIT, FITS, NO_CAPACITY, STEP_NOTES, UNKNOWN, Plan, Step, Verdict,  # noqa: F401
                   fit_verdict, judge)
from .stage_activations import StageActivations, stage_activations  # noqa: F401
from .vision import VisionTower, vision_tower_of  # noqa: F401
from .weights import (FSDP_SHARDS, _attention_params, _block_params, _mamba_params, _mlp_params,  # noqa: F401
                      data_parallel_shards, fsdp_shards, largest_layer_params, lora_params, model_state,
                      latent_projection_params, optimizer_before_first_step, optimizer_gpu_bytes,
                      optimizer_gpu_parts, optimizer_shards, stage_bf16_params, stage_params)
