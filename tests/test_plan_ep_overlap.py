"""EP communication overlap (overlap_moe_expert_parallel_comm: megatron-core's combined 1F1B schedule) and delayed
weight gradients (delay_wgrad_compute), each term pinned to the code it comes from: pure functions on a small MoE
stack first, then one shipped recipe that sets both (a module-scoped build)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from mbmem_overlays.memory import model as P
from mbmem_overlays.memory.activations import OverlapLayer, overlap_layer
from mbmem_overlays.memory.pipeline import combined_step_extra
from mbmem_overlays.memory.stage_activations import (EP_OVERLAP_EMBEDDING, EP_OVERLAP_WORKING,
                                                     ep_overlap_working)

MOE = P.Shape(layers=4, hidden=1024, ffn=4096, heads=8, groups=2, head_dim=128, vocab=2048, gated=True,
              experts=64, moe_ffn=512, topk=8, moe_layers=4, layer_kinds=("attn+moe",) * 4)
LAY = P.Layout(world=8, ep=8, seq=4096, mbs=1, gbs=8)
ON = P.Settings(ep_overlap=True)


def _site_packages() -> Path:
    import megatron.core
    return Path(megatron.core.__file__).resolve().parents[2]


CITED = [
    ("megatron/core/pipeline_parallel/schedules.py", 942, "if overlap_moe_expert_parallel_comm:"),
    ("megatron/core/pipeline_parallel/schedules.py", 943, "num_warmup_microbatches = num_warmup_microbatches + 1"),
    ("megatron/core/pipeline_parallel/schedules.py", 751, "if config.overlap_moe_expert_parallel_comm and not"),
    ("megatron/core/models/common/model_chunk_schedule_plan.py", 224,
     "def run(f_layer, b_layer, f_input=None, b_grad=None, is_last_layer_in_bwd=False):"),
    ("megatron/core/models/common/model_chunk_schedule_plan.py", 265, "b_layer.mlp.backward_dw()"),
    ("megatron/core/models/common/model_chunk_schedule_plan.py", 289,
     "b_layer.pre_dispatch_computation.backward_dw()"),
    ("megatron/core/models/common/model_chunk_schedule_plan.py", 530,
     "f_input = f_schedule_plan.pre_process.forward()"),
    ("megatron/core/models/common/model_chunk_schedule_plan.py", 609,
     "b_schedule_plan.pre_process.backward(b_grad)"),
    ("megatron/core/models/gpt/fine_grained_callables.py", 129,
     "shared_expert_output = layer.mlp.shared_experts_compute(pre_mlp_layernorm_output)"),
    ("megatron/core/transformer/transformer_config.py", 2752,
     "), 'overlap_moe_expert_parallel_comm must be enabled when enabling delay_wgrad_compute'"),
]


@pytest.mark.parametrize("path,line,text", CITED)
def test_the_cited_code_is_there(path, line, text):
    lines = (_site_packages() / path).read_text().splitlines()
    assert text in lines[line - 1]


def test_the_plan_counts_stay_and_one_layer_pair_is_added_without_pipelining():
    # a uniform stack: the worst moment is the forward's finished layer beside the backward layer whose
    # pre-dispatch part is still alive: one layer's pre-dispatch bytes more than one microbatch
    part = overlap_layer(MOE, LAY, ON, "attn+moe")
    assert ep_overlap_working(MOE, LAY, ON, 0) == pytest.approx(part.pre)
    terms = P.layer_activation_terms(MOE, LAY, ON, "attn+moe")
    assert part.pre + part.mlp == pytest.approx(sum(terms.values()) * P._tokens(LAY))
    off = P.stage_activations(MOE, LAY, P.Settings(), 0)
    on = P.stage_activations(MOE, LAY, ON, 0)
    detail = dict(on.detail)
    embedding = P.BF16 * MOE.hidden * P._tokens(LAY)
    assert detail[EP_OVERLAP_EMBEDDING] == pytest.approx(embedding)
    # one rank is first and last: the layer transient and the logits never coexist (the forward's loss runs after
    # every layer pair), so the larger of the two is the peak
    logits = dict(off.detail)["loss: logits and their fp32 softmax/gradient (last stage)"]
    assert detail[EP_OVERLAP_WORKING] == pytest.approx(part.pre)
    assert on.steady - off.steady == pytest.approx(embedding + part.pre - min(part.pre, logits))


def test_without_the_overlap_nothing_is_added():
    assert ep_overlap_working(MOE, LAY, P.Settings(), 0) == 0.0
    assert EP_OVERLAP_EMBEDDING not in dict(P.stage_activations(MOE, LAY, P.Settings(), 0).detail)


def test_the_combined_step_walks_the_layer_pairs_in_the_schedules_order():
    a = OverlapLayer(pre=10.0, mlp=30.0, dispatched=5.0, mlp_wgrad=12.0, pre_wgrad=4.0)
    # two equal layers: after the forward's pre-dispatch and dispatch, the backward's mlp is freed (-30): 10 + 5 - 30
    # < 0; after the forward's mlp and combine the forward layer is whole (+40) and the backward has freed only its
    # mlp: +10, the backward's pre-dispatch part
    assert combined_step_extra((a, a), (a, a)) == pytest.approx(10.0)
    # with the delay the backward's mlp keeps its wgrad tensors through the forward's dispatch: 10 - 30 + 12 + 5,
    # still below the pair's end; a bigger wgrad set decides
    assert combined_step_extra((a, a), (a, a), delay=True) == pytest.approx(10.0)
    big = replace(a, mlp_wgrad=40.0)
    assert combined_step_extra((big,), (big,), delay=True) == pytest.approx(10 - 30 + 40 + 5)
    # a forward chunk longer than the backward's runs its remaining layers whole after the pairs, the backward's
    # one layer freed by then: two forward layers less one backward layer
    assert combined_step_extra((a, a), (a,)) == pytest.approx(2 * 40.0 - 40.0)
    # a backward chunk longer than the forward's only frees
    assert combined_step_extra((a,), (a, a)) == pytest.approx(10.0)


def test_delayed_wgrad_keeps_the_gemm_inputs_and_output_gradients():
    st = P.Settings(ep_overlap=True, delay_wgrad=True)
    part = overlap_layer(MOE, LAY, st, "attn+moe")
    terms = P.layer_activation_terms(MOE, LAY, st, "attn+moe")
    tokens = P._tokens(LAY)
    routed = MOE.topk
    grads = routed * (2 * MOE.moe_ffn + MOE.hidden)        # grouped FC1 and FC2 output gradients, bf16
    assert part.mlp_wgrad == pytest.approx((terms["moe_permuted_input"] + terms["moe_act_output"]
                                            + P.BF16 * grads) * tokens)
    qkv = (MOE.heads + 2 * MOE.groups) * MOE.head_dim
    assert part.pre_wgrad == pytest.approx((terms["attention_layernorm_output"] + terms["attention_output"]
                                            + terms["moe_layernorm_output"] + P.BF16 * (qkv + MOE.hidden)) * tokens)
    assert overlap_layer(MOE, LAY, ON, "attn+moe").mlp_wgrad == 0.0


def test_pipelining_keeps_the_counts_taken_after_a_forward():
    # warm-up + 1 (schedules.py:942-943): the combined step starts where the plan's count after a forward stands
    lay = P.Layout(world=16, pp=2, vpp=2, ep=8, seq=4096, mbs=1, gbs=16)
    shape = replace(MOE, layers=8, moe_layers=8, layer_kinds=("attn+moe",) * 8)
    off = P.stage_activations(shape, lay, P.Settings(), 1)
    on = P.stage_activations(shape, lay, ON, 1)
    extra = ep_overlap_working(shape, lay, ON, 1)
    assert extra == pytest.approx(overlap_layer(shape, lay, ON, "attn+moe").pre)
    logits = dict(off.detail)["loss: logits and their fp32 softmax/gradient (last stage)"]
    assert on.steady - off.steady == pytest.approx(extra - min(extra, logits))


def test_refused_combinations_stay_named():
    from types import SimpleNamespace as NS

    from mbmem_overlays.memory.coverage import not_modelled
    model = dict(overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=True, pipeline_model_parallel_size=1,
                 virtual_pipeline_model_parallel_size=None, expert_model_parallel_size=8,
                 moe_token_dispatcher_type="alltoall", recompute_granularity=None, recompute_method=None)
    assert not [n for n in not_modelled(NS(model=NS(**model))) if "overlap" in n or "wgrad" in n]
    no_vpp = NS(model=NS(**{**model, "pipeline_model_parallel_size": 4}))
    assert [n for n in not_modelled(no_vpp) if n.startswith("model.overlap_moe_expert_parallel_comm")]
    alone = NS(model=NS(**{**model, "overlap_moe_expert_parallel_comm": False}))
    assert [n for n in not_modelled(alone) if n.startswith("model.delay_wgrad_compute")]


# ----------------------------------------------------------------------------- a shipped recipe
@pytest.fixture(scope="module")
def gpt_oss(bridge):
    from mbmem_overlays.bridge.as_run import as_run
    cfg = bridge.build_recipe("megatron.bridge.perf_recipes.gpt_oss.gb200.gpt_oss."
                              "gpt_oss_120b_pretrain_64gpu_gb200_bf16_config")
    run = as_run(cfg, 64).config
    return run, P.from_config(run, 64, arch=10)


@pytest.mark.bridge
def test_a_shipped_recipe_plans_the_overlap_and_the_delayed_wgrad(gpt_oss):
    from mbmem_overlays.memory.coverage import not_modelled
    run, (shape, lay, st) = gpt_oss
    assert run.model.overlap_moe_expert_parallel_comm and run.model.delay_wgrad_compute
    assert st.ep_overlap and st.delay_wgrad
    b = P.estimate(shape, lay, st)
    detail = dict(b.detail) | dict(P.stage_activations(shape, lay, st, b.rank).detail)
    name = EP_OVERLAP_WORKING + " with delayed weight gradients"
    assert detail[name] == pytest.approx(ep_overlap_working(shape, lay, st, b.rank)) and detail[name] > 0
    assert not [n for n in not_modelled(run) if "overlap_moe" in n or "delay_wgrad" in n]
