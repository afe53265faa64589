"""Issue 31's levers in the plan: each overlay changes the component it claims by the planned amount (the formula
its code gives, written out here), says "saves nothing here" where it cannot, and the plan reads the same
environment as `mbmem apply`.

Figures from the corpus (Megatron-LM's measured runs) are printed by bench/plan_levers.py, not asserted here.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from mbmem_overlays.core.catalog import Catalog
from mbmem_overlays.memory import levers as L
from mbmem_overlays.memory import model as P

L8 = "llama3_8b_pretrain_config"
DP8 = ("model.context_parallel_size=1",)   # Llama3-8B's recipe on 8 GPUs: TP1 PP1, then DP 8


def plan_of(cfg, world):
    shape, lay, st = P.from_config(cfg, world)
    return shape, lay, st, P.estimate(shape, lay, st)


def steps(recipe, overlays, *sets, world=8, params=None):
    from mbmem_overlays.memory.steps import build_plan
    cfg = recipe(L8, *DP8, *sets)
    locked = {s.split("=")[0]: None for s in sets}
    return build_plan(cfg, list(overlays), world=world, recipe=L8, params=params, locked=locked,
                      catalog=Catalog()).steps


# ----------------------------------------------------------------------------- bf16 moments
@pytest.mark.bridge
def test_bf16_moments_halve_the_adam_moments_and_nothing_else(bridge, recipe):
    base, bf16 = steps(recipe, ["precision_aware_optimizer"])
    a, b = base.breakdown, bf16.breakdown
    shape, lay, st = P.from_config(recipe(L8, *DP8), 8)
    moments = a.optimizer * (P.ADAM_MOMENTS * P.FP32) / (P.FP32 + P.ADAM_MOMENTS * P.FP32)   # fp32 master + 2 moments
    assert b.optimizer == pytest.approx(a.optimizer - moments / 2, rel=1e-9)
    assert (b.parameters, b.gradients, b.activations) == (a.parameters, a.gradients, a.activations)
    assert "saves nothing" not in bf16.note


@pytest.mark.bridge
def test_each_moment_keeps_its_own_dtype(bridge, recipe):
    import torch
    cfg = recipe(L8, "optimizer.use_precision_aware_optimizer=true")
    cfg.optimizer.exp_avg_dtype, cfg.optimizer.exp_avg_sq_dtype = torch.bfloat16, torch.float32
    assert P.from_config(cfg, 8)[2].state_bytes == (P.BF16 + P.FP32) / 2


# ----------------------------------------------------------------------------- Megatron FSDP
@pytest.mark.bridge
def test_megatron_fsdp_shards_weights_and_gradients_and_gathers_two_units(bridge, recipe):
    """optim_grads_params at DP 8: weights and gradients / 8, the gradients in FSDP's own buffer dtype (the
    parameters' bf16, Bridge leaves megatron_fsdp_main_grads_dtype unset), the optimizer state as the distributed
    optimizer already had it; in flight the current and the prefetched layer's weights and one layer's gradients,
    and for the whole job the embedding and output layer all-gathered (outside every FSDP unit: issue 30)."""
    base, fsdp = steps(recipe, ["megatron_fsdp"])
    a, b = base.breakdown, fsdp.breakdown
    shape, lay, st = P.from_config(recipe(L8, *DP8), 8)
    assert lay.dp == 8 and st.grad_bytes == P.FP32
    assert b.parameters == pytest.approx(a.parameters / 8, rel=1e-9)
    assert b.gradients == pytest.approx(a.gradients / 8 * P.BF16 / P.FP32, rel=1e-9)
    assert b.optimizer == pytest.approx(a.optimizer, rel=1e-9)
    unit = P.largest_layer_params(shape, lay, 0)
    _, embed, _ = P.stage_params(shape, lay, True, True, 0)
    assert b.other == pytest.approx(2 * unit * P.BF16 + unit * P.BF16 + P.global_memory_buffer(shape, lay, st, 0)
                                    + embed * P.BF16 + st.gemm_workspace_bytes, rel=1e-9)
    assert "saves nothing" not in fsdp.note and "shards nothing" not in fsdp.note


@pytest.mark.bridge
def test_megatron_fsdp_reads_its_own_buffer_dtypes(bridge, recipe):
    import torch
    cfg = recipe(L8, "ddp.use_megatron_fsdp=true", "ddp.data_parallel_sharding_strategy=optim_grads_params")
    st = P.from_config(cfg, 8)[2]
    assert (st.grad_bytes, st.master_bytes) == (P.BF16, P.FP32)   # unset main grads: the bf16 parameters' dtype
    cfg.ddp.megatron_fsdp_main_grads_dtype = torch.float32
    cfg.ddp.megatron_fsdp_main_params_dtype = None                 # the compute weights are the masters
    st = P.from_config(cfg, 8)[2]
    assert (st.grad_bytes, st.master_bytes) == (P.FP32, 0)


@pytest.mark.bridge
def test_megatron_fsdp_at_dp1_shards_nothing_and_says_so(bridge, recipe):
    """World size 1: nothing to shard. With FSDP's gradients kept in fp32 the plan does not move and says "saves
    nothing here"; left to Bridge's default the only change is FSDP's bf16 gradient buffer, and the note says that
    it is a dtype, not sharding."""
    import torch
    sets = ("model.num_layers=4", "model.seq_length=2048", "dataset.seq_length=2048")
    base, fsdp = steps(recipe, ["megatron_fsdp"], *sets, world=1)
    assert "shards nothing here (DP x CP is 1" in fsdp.note and "gradient buffer dtype" in fsdp.note
    assert fsdp.breakdown.parameters == base.breakdown.parameters
    from mbmem_overlays.memory.steps import build_plan
    cfg = recipe(L8, *DP8, *sets)
    cfg.ddp.megatron_fsdp_main_grads_dtype = torch.float32
    plan = build_plan(cfg, ["megatron_fsdp"], world=1, recipe=L8, catalog=Catalog())
    assert plan.steps[1].breakdown.total == pytest.approx(plan.steps[0].breakdown.total, abs=1 << 20)
    assert plan.steps[1].note.startswith("saves nothing here: DP x CP is 1")
    assert plan.as_dict()["steps"][1]["note"] == plan.steps[1].note


# ----------------------------------------------------------------------------- fine-grained offloading
MODULES = ["qkv_linear", "core_attn", "attn_proj"]


@pytest.mark.bridge
def test_fine_grained_offload_removes_the_named_modules_saved_inputs(bridge, recipe):
    """Llama3-8B (TE's fused norm + QKV, bf16), PP1: qkv_linear takes the layer input and the norm output,
    core_attn q, k, v (the softmax statistics are under 1M elements and stay), attn_proj the attention output;
    every layer but the last one (megatron-core's offload margin) leaves the GPU. The host holds every layer's,
    the attention output twice (core_attn's and attn_proj's hooks each copy it)."""
    base, off = steps(recipe, ["fine_grained_offload"], params={"fine_grained_offload": {"modules": MODULES}})
    a, b = base.breakdown, off.breakdown
    shape, lay, st = P.from_config(recipe(L8, *DP8), 8)
    terms = P.layer_activation_terms(shape, lay, st)
    tokens = lay.seq * lay.mbs / lay.cp
    assert terms["attention_softmax_stats"] * tokens / P.FP32 < L.MIN_OFFLOADED_ELEMENTS
    per_layer = (terms["attn_layernorm_input"] + terms["attention_layernorm_output"] + terms["attention_qkv"]
                 + terms["attention_output"]) * tokens
    assert a.activations - b.activations == pytest.approx(per_layer * (shape.layers - 1), rel=1e-9)
    assert (b.parameters, b.gradients, b.optimizer) == (a.parameters, a.gradients, a.optimizer)
    host = (per_layer + terms["attention_output"] * tokens) * shape.layers
    assert f"host: {host / 2**30:.2f} GiB of pinned memory per GPU, {8 * host / 2**30:.1f} GiB per node" in off.note


@pytest.mark.bridge
def test_fine_grained_offload_fraction_keeps_the_later_groups(bridge, recipe):
    cfg = recipe(L8, *DP8, "model.fine_grained_activation_offloading=true",
                 f"model.offload_modules=[{','.join(MODULES)}]")
    shape, lay, st = P.from_config(cfg, 8)
    full = L.offloaded_activations(shape, lay, st, 0)
    half = L.offloaded_activations(shape, lay, replace(st, fine_grained_offload=replace(
        st.fine_grained_offload, fraction=0.5)), 0)
    assert half.gpu_removed == pytest.approx(full.gpu_removed / 2, rel=1e-9)   # 96 groups per chunk, 48 kept
    assert half.host_per_gpu == full.host_per_gpu   # the warm-up iteration offloads every group


@pytest.mark.bridge
@pytest.mark.parametrize("modules, sets, why", [
    (["mlp_norm"], (), "the dense MLP's norm is fused into linear_fc1"),
    (["expert_fc1", "moe_act"], (), "the model has no MoE layers"),
    (["core_attn"], ("model.recompute_granularity=selective", "model.recompute_modules=[core_attn]"),
     "core_attn is recomputed"),
    (["qkv_linear"], ("model.recompute_granularity=full", "model.recompute_method=uniform",
                      "model.recompute_num_layers=1"), "full recompute keeps only each layer's input"),
])
def test_fine_grained_offload_saves_nothing_where_nothing_is_saved(bridge, recipe, modules, sets, why):
    base, off = steps(recipe, ["fine_grained_offload"], *sets, params={"fine_grained_offload": {"modules": modules}})
    assert off.breakdown.total == pytest.approx(base.breakdown.total, abs=1 << 20)
    assert off.note.startswith("saves nothing here: ") and why in off.note


# ----------------------------------------------------------------------------- the environment apply reads
@pytest.mark.bridge
def test_plan_reads_the_environment_apply_reads(bridge, monkeypatch, capsys):
    """Issue 31: with NVTE_CPU_OFFLOAD_V1=1 exported, `mbmem apply` passes and `mbmem plan` must plan (it refused);
    without it both refuse with the same fix. The plan then counts the offload."""
    from mbmem_overlays.cli import main
    argv = ["--recipe", "llama3_8b_pretrain", "--world-size", "8", "--set", "model.fine_grained_activation_offloading=true",
            "--set", "model.offload_modules=[core_attn,qkv_linear]"]
    monkeypatch.delenv("NVTE_CPU_OFFLOAD_V1", raising=False)
    capsys.readouterr()
    assert main(["plan", *argv]) == 1
    assert "export NVTE_CPU_OFFLOAD_V1=1" in capsys.readouterr().err
    monkeypatch.setenv("NVTE_CPU_OFFLOAD_V1", "1")
    assert main(["apply", *argv, "--no-validate"]) == 0
    capsys.readouterr()
    assert main(["plan", *argv]) == 0
    out = capsys.readouterr().out
    baseline = next(line for line in out.splitlines() if line.strip().startswith("baseline"))
    assert float(baseline.split()[-2]) < 67.9   # 67.95 GiB without offloading (issue 31: 72.96 GB)
