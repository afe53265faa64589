"""The plan's physics on real recipes, and the plan command."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mbmem_overlays.memory import model as P
from mbmem_overlays.core.engine import apply_overlay
from mbmem_overlays.core.sizes import parse_size
from mbmem_overlays.memory.search import search
from mbmem_overlays.memory.steps import build_plan

from conftest import mbmem

pytestmark = pytest.mark.bridge
L8 = "llama3_8b_pretrain_config"


def est(cfg, world, **settings):
    shape, lay, st = P.from_config(cfg, world)
    return P.estimate(shape, lay, replace(st, **settings))


def test_recompute_ordering(recipe):
    cfg = recipe(L8, "model.tensor_model_parallel_size=2", "model.sequence_parallel=true")
    none = est(cfg, 4).activations
    selective = est(cfg, 4, recompute="selective", modules=("core_attn", "mlp")).activations
    full = est(cfg, 4, recompute="full", recompute_method="uniform", recompute_layers=1).activations
    assert full < selective < none


def test_dp_doubling_halves_sharded_optimizer_state(recipe):
    cfg = recipe(L8, "model.context_parallel_size=1")
    a, b = est(cfg, 2, dist_optimizer=True), est(cfg, 4, dist_optimizer=True)
    assert b.optimizer == pytest.approx(a.optimizer / 2, rel=1e-9)
    assert est(cfg, 4, dist_optimizer=False).optimizer == pytest.approx(2 * a.optimizer)


def test_lora_base_weights_carry_no_grads_or_optimizer_state(recipe):
    peft = recipe("llama3_8b_peft_config")
    full = recipe("llama3_8b_sft_config", "model.tensor_model_parallel_size=1")
    p, f = est(peft, 1), est(full, 1)
    assert p.optimizer < 0.01 * f.optimizer and p.gradients < 0.01 * f.gradients
    assert p.parameters == pytest.approx(f.parameters, rel=0.01)  # base weights are still held


def test_frozen_gemms_keep_their_inputs_only_for_an_adapter(recipe):
    # TE keeps a GEMM input only for its weight gradient: with adapters on attention alone, the frozen FC1
    # and FC2 keep neither the pre-MLP norm output nor the SwiGLU output; adapters on them bring both back
    attn = recipe("llama3_8b_peft_config", "peft.target_modules=[linear_qkv,linear_proj]")
    every = recipe("llama3_8b_peft_config", "peft.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]")
    s, lay, st = P.from_config(attn, 1)
    rank = st.lora_rank
    expected = P.BF16 * (s.hidden + s.ffn + 2 * 2 * rank) * lay.seq * lay.mbs * s.layers  # + 2 adapters' A outputs
    assert est(every, 1).activations - est(attn, 1).activations == pytest.approx(expected, rel=1e-9)


def test_regather_saves_exactly_the_gathered_lora_inputs(recipe):
    base = recipe("qwen3_8b_peft_config", "model.tensor_model_parallel_size=2", "model.sequence_parallel=true")
    with_regather = recipe("qwen3_8b_peft_config", "model.tensor_model_parallel_size=2", "model.sequence_parallel=true")
    apply_overlay(with_regather, "lora_regather", env={})
    a, b = est(base, 2), est(with_regather, 2)
    s = P.from_config(base, 2)[0]
    expected = 2 * s.hidden * 2048 * s.layers  # one gathered bf16 copy per layer, linear_qkv only, seq 2048
    assert a.activations - b.activations == pytest.approx(expected, rel=1e-6)
    assert a.parameters == b.parameters and a.optimizer == b.optimizer


def test_sp_divides_layernorm_activations(recipe):
    on = recipe(L8, "model.tensor_model_parallel_size=4", "model.sequence_parallel=true")
    off = recipe(L8, "model.tensor_model_parallel_size=4", "model.sequence_parallel=false")
    assert est(on, 8).activations < est(off, 8).activations


def test_cpu_offload_and_optimizer_offload(recipe):
    cfg = recipe(L8)
    base = est(cfg, 2)
    assert est(cfg, 2, cpu_offload_layers=16).activations < base.activations
    # half the Adam moments leave; the fp32 master shard stays (4 of 12 bytes per parameter)
    assert est(cfg, 2, optimizer_offload=0.5).optimizer == pytest.approx(base.optimizer * (4 + 4) / 12)


def test_vpp_adds_in_flight_activations(recipe):
    cfg = recipe("llama3_70b_pretrain_config")
    shape, lay, st = P.from_config(cfg, 32)
    # Megatron's interleaved warm-up on rank 0: (pp-1)*2 + (vpp-1)*pp + 1 chunks of 1/vpp of the stage
    assert P.in_flight(lay, 0) == pytest.approx(((lay.pp - 1) * 2 + (lay.vpp - 1) * lay.pp + 1) / lay.vpp)
    assert P.in_flight(replace(lay, vpp=1), 0) == lay.pp
    assert P.in_flight(lay, 0) > P.in_flight(replace(lay, vpp=1), 0)


def test_plan_steps_and_expandable_segments_zero(recipe):
    cfg = recipe("llama3_70b_pretrain_config")
    plan = build_plan(cfg, ["selective_recompute", "expandable_segments"], world=32, recipe="llama3_70b_pretrain",
                      capacity=parse_size("80GiB"))
    d = plan.as_dict()
    assert [s["name"] for s in d["steps"]] == ["baseline", "expandable_segments", "selective_recompute"]
    assert d["steps"][1]["delta_bytes"] == 0 and "fragmentation" in d["steps"][1]["note"]
    assert d["total_bytes"] == d["steps"][-1]["total_bytes"]
    assert any("fragmentation" in a for a in d["assumptions"])
    # each step priced against the one before it (memory/cost/): expandable segments changes no FLOP or byte,
    # core_attn recompute replays the attention kernel
    assert "cost" not in d["steps"][0]
    assert d["steps"][1]["cost"]["low"] == d["steps"][1]["cost"]["high"] == 0
    assert d["steps"][2]["cost"]["flops"] > 0 and d["steps"][2]["cost"]["high"] > 0


def test_search_finds_cheap_fitting_layouts(recipe):
    rows, n, secs = search(recipe("llama3_70b_pretrain_config"), 32, parse_size("80GiB"))
    assert rows and n > 100
    assert all(r["total_bytes"] <= 0.95 * 80 * 2**30 for r in rows)
    assert all(not ("cpu_offload" in r["overlays"] and r["pp"] > 1) for r in rows)
    # ranked by the cost model (memory/cost/ rank_key of the step-time range), then memory
    from mbmem_overlays.memory.cost import rank_key
    assert rows == sorted(rows, key=lambda r: (rank_key(*r["cost_range"]), r["total_bytes"]))
    assert all(r["cost"]["high"] == r["cost_range"][1] or abs(r["cost"]["high"] - r["cost_range"][1]) < 1e-3
               for r in rows)
    assert all({"flops", "bytes_per_link", "bubble", "text"} <= set(r["cost"]) for r in rows)


def test_plan_cli_json_and_plot(tmp_path):
    png = tmp_path / "plan.png"
    out = mbmem("plan", "--recipe", "llama3_8b_pretrain", "--overlay", "expandable_segments,selective_recompute",
                "--world-size", "2", "--gpu-memory", "80GiB", "--json", "--plot", str(png))
    d = json.loads(out.stdout)
    assert out.returncode == (0 if d["fits"] else 1), out.stderr[-2000:]  # exit 1 means: does not fit
    assert d["total_bytes"] > 0 and len(d["steps"]) == 3 and png.stat().st_size > 10_000
    assert {"parameters", "gradients", "optimizer", "activations", "other", "total_bytes"} <= set(d["steps"][0])


# ----------------------------------------------------------------------------- recommend
def test_recommend_follows_the_ladder_and_skips_what_rules_reject(recipe):
    from mbmem_overlays.memory.ladder import recommend
    cfg = recipe("llama3_70b_pretrain_config", "model.context_parallel_size=1")  # DP 2: a PP step exists
    # 24 GiB: below what bf16 moments, FSDP and mlp recompute reach (issue 31's rungs), so the walk gets to PP
    rec = recommend(cfg, 32, parse_size("24GiB"), recipe="llama3_70b_pretrain")
    steps = [r["step"] for r in rec["steps"]]
    assert steps[:2] == ["baseline", "expandable_segments"]
    offload = next(r for r in rec["steps"] if r["step"] == "cpu_offload")
    assert "skipped" in offload and "Pipeline parallelism" in offload["skipped"]
    assert "cpu_offload" not in rec["command"]
    assert steps.index("selective_recompute") < next(i for i, s in enumerate(steps) if s.startswith("PP"))


def test_recommend_stops_at_first_fit(recipe):
    from mbmem_overlays.memory.ladder import recommend
    rec = recommend(recipe("llama3_70b_pretrain_config"), 32, parse_size("200GiB"), recipe="llama3_70b_pretrain")
    assert rec["fits"] and [r["step"] for r in rec["steps"]] == ["baseline", "expandable_segments"]
    # the recipe's env_vars already carry expandable_segments:True, so the step is in effect and not re-added
    assert rec["steps"][1].get("skipped", "").startswith("already in effect")
    assert rec["command"].startswith("python train.py recipe=llama3_70b_pretrain")


# ----------------------------------------------------------------------------- terms pinned to their source
LLAMA70_PERF = "megatron.bridge.perf_recipes.llama.h100.llama3.llama3_70b_sft_32gpu_h100_fp8cs_config"


@pytest.mark.parametrize("name, published", [
    ("llama3_70b_pretrain_config", 70.6e9), ("qwen3_8b_pretrain_config", 8.2e9),
    ("qwen3_30b_a3b_pretrain_config", 30.5e9), ("gpt_oss_20b_pretrain_config", 20.9e9),
    ("nemotron_3_nano_peft_config", 31.6e9),   # hybrid Mamba/MoE/attention stack
])
def test_parameter_count_matches_the_published_model_size(recipe, name, published):
    # the published size has the model's own vocabulary; pretrain recipes let a NullTokenizer's replace it
    # (use_tokenizer_vocab_size, Bridge setup.py:702), which test_vocab_of_the_tiny_recipe_and_of_a_preset_one pins
    shape, _, _ = P.from_config(recipe(name, "tokenizer.use_tokenizer_vocab_size=false"), 1)
    dense, embed, expert = P.stage_params(shape, P.Layout(world=1), first=True, last=True)
    assert dense + embed + expert == pytest.approx(published, rel=0.02)


def test_hybrid_pattern_is_counted_block_by_block(recipe):
    shape, lay, st = P.from_config(recipe("nemotron_3_nano_peft_config", "model.pipeline_model_parallel_size=1"), 2)
    assert P.rank_layers(shape, P.Layout(world=1), 0) == {"mamba": 23, "moe": 23, "attn": 6}
    terms = P.layer_activation_terms(shape, lay, st, "mamba")
    assert "mamba_in_proj_output" in terms and "attention_qkv" not in terms and "moe_fc1_output" not in terms


def test_fp8_weights_keep_a_second_layout_unless_nothing_caches_it():
    assert P.fp8_weight_copy_bytes(fp8=False, fp8_params=False, transpose_cache_disabled=False) == 0
    assert P.fp8_weight_copy_bytes(fp8=True, fp8_params=True, transpose_cache_disabled=True) == 1  # Hopper transpose
    assert P.fp8_weight_copy_bytes(fp8=True, fp8_params=False, transpose_cache_disabled=False) == 2  # cached FP8 copy
    assert P.fp8_weight_copy_bytes(fp8=True, fp8_params=False, transpose_cache_disabled=True) == 0


def test_loss_bytes_follow_the_cross_entropy_implementation():
    from types import SimpleNamespace as NS
    assert P.loss_bytes(NS(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="native")) == 10
    assert P.loss_bytes(NS(cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te")) == 2  # grad in place
    assert P.loss_bytes(NS(cross_entropy_loss_fusion=False, cross_entropy_fusion_impl="native")) == 6


def test_cuda_graph_scope_moves_its_activations_into_the_pool(recipe):
    shape, lay, st = P.from_config(recipe(LLAMA70_PERF), 32)
    assert st.graph_scopes == ("mlp",)
    eager = P.stage_activations(shape, lay, replace(st, graph_scopes=()), 0)
    graphed = P.stage_activations(shape, lay, st, 0)
    # the MLP norm's input is the graph's static input, not pool memory
    mlp = sum(v for k, v in P.layer_activation_terms(shape, lay, st).items()
              if k in P.GRAPH_SCOPE_TERMS["mlp"] and k != "mlp_layernorm_input")
    in_flight_layers = shape.layers / lay.pp * P.in_flight(lay, 0)
    # the pool also holds each graph's static output, weak-referenced after its backward graph is captured
    # (TE v2.17.1 graph.py:719-723)
    static_out = P.BF16 * shape.hidden / lay.tp
    assert graphed.pool == pytest.approx((mlp + static_out) * lay.seq * in_flight_layers, rel=1e-9)
    assert graphed.steady < eager.steady and eager.capture == eager.pool == 0
    b = P.estimate(shape, lay, st)
    assert b.resident > b.total  # the pool stays reserved while replaying
    between = P.Plan("perf", 32, lay, (P.Step("baseline", b),), capacity=(b.total + b.resident) / 2, margin=0.0,
                     bridge_estimate=None)
    assert between.fits(between.steps[0]) is False  # allocated alone would fit; with the pool it does not


def test_deferred_output_layer_gradients_wait_on_the_last_stage(recipe):
    shape, lay, st = P.from_config(recipe(LLAMA70_PERF, "model.tensor_model_parallel_size=8"), 32)
    assert lay.microbatches == 32 and st.deferred_wgrad_microbatches == 22  # wgrad_deferral_limit caps it
    with_defer = P.stage_activations(shape, lay, st, lay.pp - 1).steady
    without = P.stage_activations(shape, lay, replace(st, deferred_wgrad_microbatches=0), lay.pp - 1).steady
    tokens = lay.seq * lay.mbs
    assert with_defer - without == pytest.approx(22 * P.BF16 * tokens * (shape.vocab / 8 + shape.hidden / 8))


def test_optimizer_step_upcasts_bf16_gradients(recipe):
    shape, lay, st = P.from_config(recipe(LLAMA70_PERF, "model.tensor_model_parallel_size=8"), 32)
    assert st.grad_bytes == P.BF16
    layer_params, embed, _ = P.stage_params(shape, lay, True, False)
    assert P.optimizer_step_buffers(shape, lay, st, True, False) == pytest.approx(P.FP32 * (layer_params + embed))
    assert P.optimizer_step_buffers(shape, lay, replace(st, grad_bytes=P.FP32), True, False) == 0


def test_qk_norm_keeps_copies_of_q_and_k(recipe):
    qwen = P.from_config(recipe("qwen3_8b_pretrain_config"), 2)
    llama = P.from_config(recipe(L8), 2)
    assert "attention_qk_norm_inputs" in P.layer_activation_terms(*qwen)
    assert "attention_qk_norm_inputs" not in P.layer_activation_terms(*llama)


def test_frozen_experts_keep_no_inputs(recipe):
    lora = P.from_config(recipe("qwen3_30b_a3b_peft_config", "peft.target_modules=[linear_qkv,linear_proj]"), 2)
    full = P.from_config(recipe("qwen3_30b_a3b_sft_config"), 16)
    frozen = P.layer_activation_terms(*lora, "attn+moe")
    trained = P.layer_activation_terms(*full, "attn+moe")
    assert "moe_permuted_input" not in frozen and "moe_act_output" not in frozen
    assert "moe_permuted_input" in trained and "moe_act_output" in trained


# ----------------------------------------------------------------------------- issue 14: corrections tied to upstream
NANO = "nemotron_3_nano_pretrain_config"     # TE graphs on attn + mamba, recompute moe + layernorm (Bridge 0.6.2)


def offloaded(cfg, fraction, world=2):
    apply_overlay(cfg, "optimizer_offload", env={}, params={"fraction": fraction}, world_size=world)
    return cfg


def test_optimizer_offload_keeps_the_fp32_master_shard_on_the_gpu(recipe):
    # distributed optimizer, not precision-aware: the hybrid optimizer steps CPU clones of DistributedOptimizer's
    # fp32 master shards and copies the result back; only the Adam moments leave the GPU
    base = est(recipe(L8), 2)
    full = est(offloaded(recipe(L8), 1.0), 2)
    shape, lay, st = P.from_config(recipe(L8), 2)
    dense, embed, _ = P.stage_params(shape, lay, True, True)
    assert st.dist_optimizer and not st.precision_aware
    assert full.optimizer == pytest.approx(P.FP32 * (dense + embed) / P.optimizer_shards(lay, st)[0], rel=1e-9)
    assert full.optimizer == pytest.approx(base.optimizer / 3, rel=1e-9)


def test_optimizer_offload_still_upcasts_every_gradient_shard(recipe):
    # bf16 gradients: DistributedOptimizer makes shard_main_param.grad = grad.float() for every shard, and the
    # hybrid optimizer copies the offloaded ones to the CPU from there
    cfg = offloaded(recipe(LLAMA70_PERF, "model.tensor_model_parallel_size=8"), 1.0, world=32)
    shape, lay, st = P.from_config(cfg, 32)
    assert st.optimizer_offload == 1.0 and st.grad_bytes == P.BF16
    layer_params, embed, _ = P.stage_params(shape, lay, True, False)
    assert P.optimizer_step_buffers(shape, lay, st, True, False) == pytest.approx(P.FP32 * (layer_params + embed))


def test_precision_aware_offload_moves_the_masters_of_the_offloaded_part(recipe):
    # precision-aware: megatron-core keeps no master; the hybrid optimizer makes fp32 masters and fp32 moments,
    # the offloaded part on the CPU
    cfg = offloaded(recipe("qwen3_30b_a3b_pretrain_config"), 0.25, world=16)
    shape, lay, st = P.from_config(cfg, 16)
    assert st.precision_aware
    assert P.optimizer_gpu_bytes(st) == pytest.approx(0.75 * 3 * P.FP32)


def test_moe_recompute_keeps_the_pre_mlp_norm_output(recipe):
    # the MoE checkpoint saves its input, the pre-MLP norm output, unless "layernorm" recomputes the norm too
    def moe_layer(modules):
        cfg = recipe("qwen3_30b_a3b_pretrain_config", "model.recompute_granularity=selective",
                     f"model.recompute_modules=[{','.join(modules)}]", "model.cuda_graph_impl=none")
        shape, lay, st = P.from_config(cfg, 16)
        return shape, lay, P.layer_activation(shape, lay, st, "attn+moe")
    shape, lay, moe = moe_layer(["moe"])
    _, _, both = moe_layer(["moe", "layernorm"])
    norm_output = P.BF16 * shape.hidden * lay.seq * lay.mbs / lay.cp
    assert moe - both == pytest.approx(norm_output, rel=1e-9)


def test_optimizer_instances_divide_the_shard_count(recipe):
    one = recipe("qwen3_30b_a3b_pretrain_config")
    two = recipe("qwen3_30b_a3b_pretrain_config", "ddp.num_distributed_optimizer_instances=2")
    _, lay, st1 = P.from_config(one, 64)
    _, _, st2 = P.from_config(two, 64)
    expert_dp = 64 // (lay.pp * lay.ep * lay.etp)
    assert st2.optimizer_instances == 2
    assert P.optimizer_shards(lay, st1) == (lay.dp * lay.cp, expert_dp)
    assert P.optimizer_shards(lay, st2) == (lay.dp * lay.cp // 2, expert_dp // 2)
    assert est(two, 64).optimizer == pytest.approx(2 * est(one, 64).optimizer, rel=1e-9)


def test_cuda_graph_modules_is_read_and_hybrid_layers_are_graphed_by_type(recipe):
    # Bridge 0.6.2 sets cuda_graph_modules (the deprecated cuda_graph_scope stays None) on Nemotron-3-Nano
    cfg = recipe(NANO, "model.pipeline_model_parallel_size=1")
    assert cfg.model.cuda_graph_scope is None
    shape, lay, st = P.from_config(cfg, 8)
    assert st.graph_scopes == ("attn", "mamba")
    tokens = lay.seq * lay.mbs / lay.cp
    hidden = P.BF16 * shape.hidden / (lay.tp if lay.sp else 1)
    # MoE layers are eager; each attention and Mamba layer owns a static input and output, attention also the
    # bool mask (mbs x s/cp x s), and keeps the rest of its activations in the pool
    assert P.layer_graph_parts(shape, lay, st, "moe")[1:] == (0.0, 0.0)
    eager, pool, static = P.layer_graph_parts(shape, lay, st, "mamba")
    assert static == pytest.approx(2 * hidden * tokens) and pool > 0 and eager == 0
    eager, pool, static = P.layer_graph_parts(shape, lay, st, "attn")
    assert static == pytest.approx((2 * hidden + lay.seq) * tokens) and pool > 0
    # the 23 Mamba layers' activations leave allocated memory in the steady state
    eager_run = P.stage_activations(shape, lay, replace(st, graph_scopes=()), 0)
    graphed = P.stage_activations(shape, lay, st, 0)
    assert graphed.pool == pytest.approx(23 * P.layer_graph_parts(shape, lay, st, "mamba")[1]
                                         + 6 * P.layer_graph_parts(shape, lay, st, "attn")[1]
                                         + (23 + 6) * hidden * tokens)   # + each graph's static output
    assert graphed.steady < eager_run.steady


def test_layernorm_recompute_is_off_for_moe_layers_under_a_router_graph(recipe):
    # TE moe_router graph: megatron-core keeps the pre-MLP norm output (a static graph output) unless
    # moe_preprocess is graphed with the alltoall dispatcher
    cfg = recipe("qwen3_30b_a3b_pretrain_config", "model.recompute_granularity=selective",
                 "model.recompute_modules=[layernorm]")
    assert P.graph_scopes(cfg.model) == ("moe_router", "moe_preprocess")
    assert cfg.model.moe_token_dispatcher_type == "flex"
    assert P.from_config(cfg, 16)[2].modules == ()
    cfg.model.moe_token_dispatcher_type = "alltoall"
    assert P.from_config(cfg, 16)[2].modules == ("layernorm",)


@pytest.mark.parametrize("strategy, params_sharded, grads_sharded", [
    ("optim", False, False), ("optim_grads", False, True), ("optim_grads_params", True, True)])
def test_megatron_fsdp_shards_params_and_grads(recipe, strategy, params_sharded, grads_sharded):
    ddp = recipe(L8)
    fsdp = recipe(L8, "ddp.use_megatron_fsdp=true", f"ddp.data_parallel_sharding_strategy={strategy}")
    a, b = est(ddp, 8), est(fsdp, 8)
    lay = P.from_config(ddp, 8)[1]
    dp = lay.dp * lay.cp   # FSDP shards over the data-parallel x context-parallel group
    assert dp == 8
    assert b.parameters == pytest.approx(a.parameters / (dp if params_sharded else 1), rel=1e-9)
    # Megatron FSDP's own gradient buffer is in the bf16 parameters' dtype (megatron_fsdp_main_grads_dtype unset),
    # whatever grad_reduce_in_fp32 says (memory/levers.py apply_config)
    fsdp_dtype = P.BF16 / P.FP32
    assert b.gradients == pytest.approx(a.gradients * fsdp_dtype / (dp if grads_sharded else 1), rel=1e-9)
    assert b.optimizer == pytest.approx(a.optimizer, rel=1e-9)   # the distributed optimizer already shards it


def test_megatron_fsdp_forces_the_distributed_optimizer(recipe):
    cfg = recipe(L8, "optimizer.use_distributed_optimizer=false", "ddp.use_distributed_optimizer=false",
                 "ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params")
    shape, lay, st = P.from_config(cfg, 8)
    assert st.dist_optimizer and st.fsdp == "optim_grads_params"
    assert P.optimizer_shards(lay, st) == (8, 8)


def test_vocab_left_to_the_tokenizer_comes_from_its_config(recipe):
    # Nemotron-3-Nano's pretrain recipe leaves model.vocab_size to the HF tokenizer; without it the plan would
    # drop the embedding, the output layer and the loss's logits
    cfg = recipe(NANO)
    assert cfg.model.vocab_size is None
    shape = P.from_config(cfg, 8)[0]
    assert shape.vocab == 131072


def test_set_takes_a_list_moe_layer_freq_where_the_recipe_has_an_int(bridge):
    """model.moe_layer_freq is Union[int, List[int]] in megatron-core: --set may give the per-layer list even where
    the recipe's default is an int, and the plan follows it (memory/from_config.py reads the list)."""
    cfg = bridge.build_recipe("qwen3_30b_a3b_pretrain_config")
    n = cfg.model.num_layers
    assert isinstance(cfg.model.moe_layer_freq, int)
    pattern = [0] + [1] * (n - 1)
    bridge.apply_overrides(cfg, [f"model.moe_layer_freq=[{','.join(map(str, pattern))}]"])
    assert list(cfg.model.moe_layer_freq) == pattern
    shape, _, _ = P.from_config(cfg, 16)
    assert shape.moe_layers == n - 1 and shape.layer_kinds[0] == "attn+mlp"
