"""Issue 25's memory-model terms, each pinned to the code it comes from; the off switch that reproduces the
model before them (what bench/plan_accuracy.py prints as "before"); the per-rank breakdowns; and that the terms
stay physical on MoE, MLA and hybrid recipes (parameters unchanged, no blow-up)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from mbmem_overlays.core.engine import apply_overlay
from mbmem_overlays.memory import model as P

pytestmark = pytest.mark.bridge

LLAMA70_PERF = "megatron.bridge.perf_recipes.llama.h100.llama3.llama3_70b_sft_32gpu_h100_fp8cs_config"
QWEN_LORA = ("model.tensor_model_parallel_size=2", "model.sequence_parallel=true", "model.seq_length=8192",
             "dataset.seq_length=8192", "peft.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]",
             "peft.dim=32", "peft.alpha=32")
ALL_OFF = frozenset(P.ADDED_TERMS)


def planned(bridge, name, *overrides, overlays=(), params=None, world=1):
    cfg = bridge.build_recipe(name)
    if overrides:
        bridge.apply_overrides(cfg, list(overrides))
    if overlays:
        apply_overlay(cfg, list(overlays), env={}, params=params, world_size=world)
    return P.from_config(cfg, world)


@pytest.fixture(scope="module")
def llama_fp8(bridge):
    """The bench's Llama3-70B SFT FP8 row: TP4 PP4 VPP5 DP2, core_attn recompute, TE graphs on the MLP."""
    return planned(bridge, LLAMA70_PERF, overlays=["selective_recompute"], params={"modules": ["core_attn"]},
                   world=32)


@pytest.fixture(scope="module")
def qwen_lora(bridge):
    return planned(bridge, "qwen3_8b_peft_config", *QWEN_LORA, world=2)


# ----------------------------------------------------------------------------- the off switch
@pytest.mark.parametrize("row, overrides, modules, before", [
    ("TP4 PP4 VPP5 DP2", (), ["core_attn"], 62821521920),
    ("PP8", ("model.pipeline_model_parallel_size=8",), ["core_attn"], 56181129216),
    ("TP8", ("model.tensor_model_parallel_size=8",), ["core_attn"], 45430865920),
    ("mlp recompute", (), ["mlp"], 57874340352),
])
def test_every_added_term_off_is_the_model_before_issue_25(bridge, row, overrides, modules, before):
    shape, lay, st = planned(bridge, LLAMA70_PERF, *overrides, overlays=["selective_recompute"],
                             params={"modules": modules}, world=32)
    assert P.estimate(shape, lay, replace(st, without=ALL_OFF)).total == pytest.approx(before, rel=1e-9)


def test_every_added_term_off_is_the_model_before_issue_25_on_lora(qwen_lora):
    shape, lay, st = qwen_lora
    assert P.estimate(shape, lay, replace(st, without=ALL_OFF)).total == pytest.approx(43971313664, rel=1e-9)


# ----------------------------------------------------------------------------- each term, pinned to its code
def _site_packages() -> Path:
    import megatron.core
    return Path(megatron.core.__file__).resolve().parents[2]


# term -> (file under site-packages, 1-based line, text on that line): the installed megatron-core lines each
# ADDED_TERMS source names (TE's are at tag v2.17.1, not installed here; their behaviour is pinned below).
CITED_LINES = {
    "glu_linear_copy": [("megatron/core/transformer/mlp.py", 330, "x_linear + self.config.glu_linear_offset"),
                        ("megatron/core/transformer/moe/experts.py", 871, "x_linear + self.config.glu_linear_offset"),
                        ("megatron/core/transformer/moe/experts.py", 878,
                         "intermediate_parallel = intermediate_parallel * permuted_probs")],
    "core_attn_output": [("megatron/core/transformer/attention.py", 494,
                          "tensor_parallel.checkpoint(custom_forward, False, *checkpoint_inputs)"),
                         ("megatron/core/tensor_parallel/random.py", 618, "ctx.save_for_backward(*args)")],
    "te_cross_entropy_in_place": [("megatron/core/models/common/language_module/language_module.py", 186,
                                   "loss = te_parallel_cross_entropy(")],
    "graph_outputs_in_pool": [("megatron/core/transformer/cuda_graphs.py", 2595,
                               "kwargs['_reuse_graph_input_output_buffers'] = True")],
    "graph_static_inputs_at_step": [("megatron/core/transformer/module.py", 257,
                                     'static_inputs["hidden_states"] = torch.ones(')],
    "block_recompute_one_layer": [("megatron/core/recompute.py", 181,
                                   "chunk_runner(layer_idx, layer_idx + 1, use_checkpoint)")],
    "global_memory_buffer": [("megatron/core/tensor_parallel/layers.py", 570,
                              'get_global_memory_buffer().get_tensor(dim_size, input.dtype, "mpu")'),
                             ("megatron/core/utils.py", 1259, '"mpu_0"')],
}


def test_every_added_term_names_code_that_is_there():
    assert set(CITED_LINES) == set(P.ADDED_TERMS)
    root = _site_packages()
    for term, lines in CITED_LINES.items():
        for path, line, text in lines:
            assert path in P.ADDED_TERMS[term][1] or path.split("megatron/core/")[-1] in P.ADDED_TERMS[term][1]
            assert text in (root / path).read_text().splitlines()[line - 1], (term, path, line)


def test_unfused_glu_keeps_the_linear_half_plus_its_offset(qwen_lora):
    # Qwen3 runs the unfused SwiGLU (bias_activation_fusion off): silu(a) * (b + 0.0) keeps b + 0.0, a new
    # tensor the size of silu(a)
    shape, lay, st = qwen_lora
    assert not st.swiglu_fused
    terms = P.layer_activation_terms(shape, lay, st)
    assert terms["mlp_glu_linear_input"] == terms["mlp_silu_output"] == P.BF16 * shape.ffn / lay.tp
    assert "mlp_glu_clamped_input" not in terms
    clamped = P.layer_activation_terms(shape, lay, replace(st, glu_clamped=True))
    assert clamped["mlp_glu_clamped_input"] == P.BF16 * shape.ffn / lay.tp
    off = P.layer_activation_terms(shape, lay, replace(st, without=frozenset({"glu_linear_copy"})))
    assert "mlp_glu_linear_input" not in off
    # 36 layers x 8192 tokens x ffn/tp bf16: the bench's Qwen3-8B LoRA rows gain exactly this
    gain = P.estimate(shape, lay, st).total - P.estimate(shape, lay, replace(st, without=frozenset({
        "glu_linear_copy"}))).total
    assert gain == pytest.approx(shape.layers * lay.seq * P.BF16 * shape.ffn / lay.tp, rel=1e-9)


def test_fused_activations_keep_only_their_input(bridge):
    # the fused SwiGLU (Llama) and the fused weighted squared ReLU (Nemotron-3-Nano's experts) keep no copies;
    # OLMoE's experts run the unfused GLU and weight it by the probabilities afterwards
    llama = planned(bridge, "llama3_8b_pretrain_config", world=8)
    assert "mlp_glu_linear_input" not in P.layer_activation_terms(*llama)
    nano = planned(bridge, "nemotron_3_nano_peft_config", "model.pipeline_model_parallel_size=1", world=2)
    assert not nano[2].moe_probs_mul and "moe_probs_mul_input" not in P.layer_activation_terms(*nano, "moe")
    olmoe = planned(bridge, "olmoe_7b_pretrain_config", world=8)
    terms = P.layer_activation_terms(*olmoe, "attn+moe")
    assert olmoe[2].moe_probs_mul
    assert terms["moe_glu_linear_input"] == terms["moe_probs_mul_input"] == terms["moe_silu_output"]


def test_core_attn_recompute_drops_the_kernel_output_unless_linear_proj_keeps_it(llama_fp8, bridge):
    shape, lay, st = llama_fp8
    assert st.fp8 and st.modules == ("core_attn",)
    # FP8: linear_proj keeps a quantized copy, so the kernel's bf16 output goes with the checkpoint
    kept = P._selected_terms(shape, lay, st, "attn+mlp")
    assert "attention_kernel_output" not in kept and "attention_output_fp8" in kept
    eager = P._selected_terms(shape, lay, replace(st, recompute=None, modules=()), "attn+mlp")
    assert eager["attention_kernel_output"] == P.BF16 * shape.heads * shape.head_dim / lay.tp
    # bf16: linear_proj's saved input is that same tensor, so core_attn recompute cannot drop it
    bf16 = planned(bridge, "llama3_8b_pretrain_config", "model.recompute_granularity=selective",
                   "model.recompute_modules=[core_attn]", world=8)
    assert "attention_output" in P._selected_terms(*bf16, "attn+mlp")


def test_te_cross_entropy_keeps_only_the_bf16_logits(llama_fp8):
    shape, lay, st = llama_fp8
    assert st.cross_entropy_impl == "te" and st.logits_bytes == P.BF16
    last = lay.pp - 1
    on = dict(P.stage_activations(shape, lay, st, last).detail)
    off = dict(P.stage_activations(shape, lay, replace(st, without=frozenset({"te_cross_entropy_in_place"})),
                                   last).detail)
    key = "loss: logits and their fp32 softmax/gradient (last stage)"
    tokens = lay.seq * lay.mbs
    assert on[key] == pytest.approx(P.BF16 * shape.vocab / lay.tp * tokens)
    assert off[key] == pytest.approx((P.BF16 + P.FP32) * shape.vocab / lay.tp * tokens)


def test_graph_outputs_are_pool_memory_in_replay(llama_fp8):
    shape, lay, st = llama_fp8
    # 4 layers per chunk, 5 chunks on rank 0: each chunk's first three layers hand their MLP graph's output to
    # the next layer's (eager) attention norm; the fourth sends it to the next stage
    assert P.graph_outputs_read_eagerly(shape, lay, st, 0) == 15
    on = P.stage_activations(shape, lay, st, 0)
    off = P.stage_activations(shape, lay, replace(st, without=frozenset({"graph_outputs_in_pool"})), 0)
    hidden = P.BF16 * shape.hidden / lay.tp * lay.seq
    per_stage, alive = shape.layers / lay.pp, P.in_flight(lay, 0)
    assert off.steady - on.steady == pytest.approx(alive * (per_stage * hidden + 15 * hidden), rel=1e-9)
    assert on.pool - off.pool == pytest.approx(alive * per_stage * hidden, rel=1e-9)
    assert on.capture == off.capture   # while capturing, the static outputs are allocated


def test_graph_static_inputs_outlive_the_backward(llama_fp8):
    shape, lay, st = llama_fp8
    step = P.phase_breakdowns(shape, lay, st, 0)["optimizer step"]
    static_in = P.BF16 * shape.hidden / lay.tp * lay.seq
    assert step.activations == pytest.approx(shape.layers / lay.pp * P.in_flight(lay, 0) * static_in, rel=1e-9)
    off = P.phase_breakdowns(shape, lay, replace(st, without=frozenset({"graph_static_inputs_at_step"})), 0)
    assert off["optimizer step"].activations == 0


def test_global_memory_buffer_on_the_last_stage_only(llama_fp8, qwen_lora):
    shape, lay, st = llama_fp8
    gathered = P.BF16 * shape.hidden * lay.seq * lay.mbs
    assert st.deferred_wgrad_microbatches   # the drain gathers into a second buffer ("mpu_0")
    assert P.global_memory_buffer(shape, lay, st, lay.pp - 1) == pytest.approx(2 * gathered)
    assert P.global_memory_buffer(shape, lay, st, 0) == 0
    assert P.global_memory_buffer(*qwen_lora, 0) == 0   # a frozen output layer gathers into a fresh tensor


def test_block_recompute_replays_one_layer_at_a_time(bridge):
    shape, lay, st = planned(bridge, "llama3_8b_pretrain_config", world=8)
    block = replace(st, recompute="full", recompute_method="block", recompute_layers=8)
    uniform = replace(st, recompute="full", recompute_method="uniform", recompute_layers=8)
    layer = P.layer_activation(shape, lay, st)
    assert dict(P.stage_activations(shape, lay, block, 0).detail)["full recompute working set"] == layer
    assert dict(P.stage_activations(shape, lay, uniform, 0).detail)["full recompute working set"] == 8 * layer


# ----------------------------------------------------------------------------- per rank, for the doctor
def test_stage_breakdowns_cover_every_pipeline_rank(llama_fp8):
    shape, lay, st = llama_fp8
    stages = P.stage_breakdowns(shape, lay, st)
    assert [b.rank for b in stages] == list(range(lay.pp))
    assert all(b.phase in P.PHASES for b in stages)
    # the embedding sits on the first stage, the output layer on the last, neither on the middle ones
    assert stages[0].parameters > stages[1].parameters < stages[-1].parameters
    peak = P.estimate(shape, lay, st)
    assert peak == max(stages, key=lambda b: b.footprint)
    phases = P.phase_breakdowns(shape, lay, st, 0)
    assert set(phases) == set(P.PHASES) and stages[0] == max(phases.values(), key=lambda b: b.total)


def test_a_middle_rank_with_other_layers_is_considered(bridge):
    # Nemotron-3-Nano's hybrid pattern puts different blocks on each stage: estimate looks at every stage
    # whose layers differ from the first's and the last's
    shape, lay, st = planned(bridge, "nemotron_3_nano_pretrain_config", "model.pipeline_model_parallel_size=4",
                             world=32)
    assert len(P._candidate_ranks(shape, lay)) > 2
    assert P.estimate(shape, lay, st).footprint == max(b.footprint for b in P.stage_breakdowns(shape, lay, st))


# ----------------------------------------------------------------------------- general, not fitted
@pytest.mark.parametrize("name, world", [
    ("qwen3_30b_a3b_pretrain_config", 16), ("qwen3_30b_a3b_peft_config", 2), ("moonlight_16b_pretrain_config", 8),
    ("nemotron_3_nano_pretrain_config", 8), ("nemotron_3_nano_peft_config", 2), ("gpt_oss_20b_pretrain_config", 16),
    ("olmoe_7b_pretrain_config", 8), ("llama3_70b_pretrain_config", 32),
])
def test_added_terms_keep_moe_mla_and_hybrid_plans_physical(bridge, name, world):
    shape, lay, st = planned(bridge, name, world=world)
    before, after = P.estimate(shape, lay, replace(st, without=ALL_OFF)), P.estimate(shape, lay, st)
    assert after.parameters == before.parameters and after.optimizer == before.optimizer
    assert 0.85 < after.total / before.total < 1.15
    for term in P.ADDED_TERMS:   # no term turns a component negative
        b = P.estimate(shape, lay, replace(st, without=ALL_OFF - {term}))
        assert min(b.parameters, b.gradients, b.optimizer, b.activations, b.other) >= 0
