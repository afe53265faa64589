"""The plan's uncertainty, stated: a range for each component its assumptions leave unsure, derived from the
configuration; a fit verdict that says "fits unless ..."; the ranges in plan.as_dict() and `mbmem plan --json`;
every range's assumption in the plan's assumptions."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mbmem_overlays.cli import main
from mbmem_overlays.core.sizes import parse_size
from mbmem_overlays.memory import model as P
from mbmem_overlays.memory.ranges import moe_worst_load, uncertainty, verdict
from mbmem_overlays.memory.steps import build_plan, render_plan

GiB = 2**30
MOE = "qwen3_30b_a3b_pretrain_config"


# ----------------------------------------------------------------------------- pure: no Bridge
def dense() -> tuple[P.Shape, P.Layout, P.Settings]:
    shape = P.Shape(layers=4, hidden=1024, ffn=4096, heads=8, groups=8, head_dim=128, vocab=32768)
    return shape, P.Layout(world=1, seq=2048), P.Settings()


def test_a_plan_it_is_sure_of_has_no_range_and_a_bare_verdict():
    shape, lay, st = dense()
    assert uncertainty(shape, lay, st) == ()
    assert verdict(True, (), 80 * GiB) == ("fits", [])
    assert verdict(False, (), 80 * GiB) == ("does NOT fit", [])
    assert verdict(None, (), None) == ("-", [])


def test_an_unknown_vocabulary_says_how_large_a_vocabulary_still_fits():
    shape, lay, st = dense()
    unknown = replace(shape, vocab=0)
    (r,) = uncertainty(unknown, lay, st)
    assert r.high is None and r.per_unit > 0 and r.assumption == P.VOCAB_FROM_TOKENIZER
    base = P.estimate(unknown, lay, st).footprint
    limit = base + 1000 * r.per_unit + 1
    text, clauses = verdict(True, (r,), limit)
    assert text == "fits unless the vocabulary is larger than 1,000 vocabulary tokens" and len(clauses) == 1
    # linear in the vocabulary: 1,000 more tokens cost what the range says
    thousand = P.estimate(replace(shape, vocab=1024), lay, st).footprint - base
    assert thousand == pytest.approx(1024 * r.per_unit, rel=1e-6)


def test_fp8_transposes_make_the_low_end_of_the_parameters():
    shape, lay, st = dense()
    fp8 = replace(st, fp8=True, param_bytes=P.FP8, fp8_weight_copy_bytes=P.FP8)
    (r,) = uncertainty(shape, lay, fp8)
    layer_params = P.stage_params(shape, lay, True, True)[0]
    assert r.high - r.low == pytest.approx(layer_params * P.FP8) and r.assumption == P.FP8_TRANSPOSE
    # a plan that does not fit with the transposes, but would without them, says so
    text, _ = verdict(False, (r,), (r.low + r.high) / 2)
    assert text.startswith("does NOT fit (it would on a GPU with non-TN FP8 GEMMs (Blackwell)")


def moe_shape(experts=64, topk=8):
    return P.Shape(layers=4, hidden=1024, ffn=4096, heads=8, groups=8, head_dim=128, vocab=32768,
                   experts=experts, moe_ffn=512, topk=topk, moe_layers=4)


@pytest.mark.parametrize("ep, factor, expected", [(8, None, 8.0), (64, None, 8.0), (8, 1.25, 1.25), (1, None, 1.0)])
def test_worst_expert_load_follows_capacity_factor_and_expert_parallelism(ep, factor, expected):
    # dropless: every token of the EP group may pick this GPU's experts, each at most min(topk, local experts)
    # of them; with a capacity factor each source rank sends an expert at most c x its share
    lay = P.Layout(world=ep, ep=ep)
    st = P.Settings(moe_capacity_factor=factor)
    assert moe_worst_load(moe_shape(), lay, st) == expected


def test_moe_range_is_the_plan_at_the_worst_expert_load():
    shape, lay, st = moe_shape(), P.Layout(world=8, ep=8, seq=4096), P.Settings(moe_capacity_factor=1.5)
    (r,) = uncertainty(shape, lay, st)
    assert r.assumption == P.MOE_BALANCE and r.low == P.estimate(shape, lay, st).footprint
    assert r.high == P.estimate(shape, lay, replace(st, moe_load=1.5)).footprint > r.low
    routed = P.layer_activation_terms(shape, lay, replace(st, moe_load=1.5), "attn+moe")["moe_fc1_output"]
    assert routed == pytest.approx(1.5 * P.layer_activation_terms(shape, lay, st, "attn+moe")["moe_fc1_output"])
    text, clauses = verdict(True, (r,), (r.low + r.high) / 2)
    assert text.startswith("fits unless MoE routing fills experts to capacity factor 1.5") and clauses


# ----------------------------------------------------------------------------- on real recipes, in the JSON
@pytest.mark.bridge
def test_plan_json_carries_each_range_and_the_verdict(bridge, capsys):
    capsys.readouterr()
    rc = main(["plan", "--recipe", MOE, "--world-size", "16", "--gpu-memory", "80GiB", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc in (0, 1, 4) and d["uncertainty"], d.get("error")   # 4: its flex dispatcher is not modelled
    moe = next(r for r in d["uncertainty"] if r["component"].startswith("activations (routed MoE"))
    assert moe["low_bytes"] <= d["steps"][-1]["resident_bytes" if "resident_bytes" in d["steps"][-1] else
                                             "total_bytes"] < moe["high_bytes"]
    assert "dropless" in moe["reason"] and moe["assumption"] in d["assumptions"]
    assert all(r["assumption"] in d["assumptions"] for r in d["uncertainty"])
    if d["fits"]:
        assert d["fit_verdict"].startswith("fits unless") and d["fits_unless"]


@pytest.mark.bridge
def test_capacity_factor_bounds_the_moe_range_and_padding_is_the_load(bridge, recipe):
    cfg = recipe(MOE, "model.moe_expert_capacity_factor=1.25")
    shape, lay, st = P.from_config(cfg, 16)
    assert st.moe_capacity_factor == 1.25 and st.moe_load == 1.0
    (r,) = [r for r in uncertainty(shape, lay, st) if r.assumption == P.MOE_BALANCE]
    assert r.high == P.estimate(shape, lay, replace(st, moe_load=1.25)).footprint
    padded = P.from_config(recipe(MOE, "model.moe_expert_capacity_factor=1.25",
                                  "model.moe_pad_expert_input_to_capacity=true"), 16)[2]
    assert padded.moe_load == 1.25   # padded to capacity: the load is the capacity, no range left
    assert not [r for r in uncertainty(shape, lay, padded) if r.assumption == P.MOE_BALANCE]


@pytest.mark.bridge
def test_cuda_graph_warm_up_is_the_high_end_and_the_text_says_fits_unless(bridge, recipe):
    perf = "megatron.bridge.perf_recipes.llama.h100.llama3.llama3_70b_sft_32gpu_h100_fp8cs_config"
    cfg = recipe(perf)
    plan = build_plan(cfg, [], world=32, recipe="llama3_70b_sft_fp8", capacity=parse_size("80GiB"), margin=0.0)
    warm = next(r for r in plan.ranges if r.assumption == P.GRAPH_WARMUP)
    plan = replace(plan, capacity=(warm.low + warm.high) / 2)   # between the two ends
    shape, lay, st = P.from_config(cfg, 32)
    assert st.graph_warmup_steps == 3
    eager = P.estimate(shape, lay, replace(st, graph_scopes=())).footprint
    assert warm.high >= eager and warm.high > warm.low
    text = render_plan(plan)
    verdict_text = plan.verdict()[0]
    assert plan.fits(plan.steps[-1]) and verdict_text.startswith("fits unless")
    assert f"-> * {verdict_text}" in text and "yes*" in text and "uncertain (" in text
    assert all(r.assumption in plan.assumptions for r in plan.ranges)


@pytest.mark.bridge
def test_the_plan_says_what_the_jobs_memory_lines_will_show(bridge, recipe, capsys):
    """Bridge reports after iterations 1 and 2; with three eager warm-up steps those lines are the eager run."""
    perf = "megatron.bridge.perf_recipes.llama.h100.llama3.llama3_70b_sft_32gpu_h100_fp8cs_config"
    cfg = recipe(perf)
    plan = build_plan(cfg, [], world=32, recipe="llama3_70b_sft_fp8")
    shape, lay, st = P.from_config(cfg, 32)
    assert [it for it, _ in plan.memory_lines] == list(P.REPORTED_ITERATIONS) == [1, 2]
    for it, per_rank in plan.memory_lines:
        assert per_rank == tuple(b.total for b in P.reported_breakdowns(shape, lay, st, it)) and len(per_rank) == lay.pp
    text = render_plan(plan)
    (line,) = [x for x in text.splitlines() if x.startswith("memory lines to expect")]
    one = plan.memory_lines[0][1]
    assert f"after iteration 1 {max(one) / 1e9:.2f} GB on pipeline rank {one.index(max(one))}" in line
    d = plan.as_dict()
    assert d["memory_lines"][1] == {"iteration": 2, "max_allocated_bytes": [int(v) for v in plan.memory_lines[1][1]]}
