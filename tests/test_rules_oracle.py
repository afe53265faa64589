"""Every documented incompatibility: our error fires before launch, and — where
megatron-core/Bridge enforce the rule — Bridge's own validation rejects the same
config with our engine out of the way (fields set directly, runtime_config_update)."""

from __future__ import annotations

import pytest

from mbmem_overlays import OverlayError, apply_overlay
from mbmem_overlays.core.engine import View
from mbmem_overlays.core.paths import write

from conftest import snapshot

pytestmark = pytest.mark.bridge

L8 = "llama3_8b_pretrain_config"     # 32 layers, TP1 CP2
L70 = "llama3_70b_pretrain_config"   # 80 layers, TP4 PP4 VPP5 CP2
MOE = "qwen3_30b_a3b_pretrain_config"


def rejected(cfg, overlays, env, fragment, **kw):
    with pytest.raises(OverlayError) as exc:
        apply_overlay(cfg, overlays, env=env, **kw)
    assert fragment in str(exc.value), str(exc.value)
    return exc.value


def oracle_rejects(bridge, cfg, fields: dict, fragment: str, world_size: int):
    for path, value in fields.items():
        write(cfg, path, value)
    result = bridge.validate_config(cfg, world_size=world_size)
    assert not result.ok, f"Bridge accepted a config we reject: {result}"
    assert fragment in result.error, result.error


CASES = [
    # id, recipe, overrides, overlays, params, world size, our message, fields for the oracle, oracle message
    ("cpu_offload+pp", L70, [], ["cpu_offload"], None, 32,
     "Pipeline parallelism with CPU offloading",
     {"model.cpu_offloading": True, "model.cpu_offloading_num_layers": 1},
     "Currently there is no support for Pipeline parallelism with CPU offloading"),
    ("cpu_offload+selective", L8, [], ["cpu_offload", "selective_recompute"], None, 2,
     "CPU offloading does not work when activation recomputation is enabled",
     {"model.cpu_offloading": True, "model.cpu_offloading_num_layers": 1, "model.recompute_granularity": "selective"},
     "CPU offloading does not work when activation recomputation is enabled"),
    ("cpu_offload+full", L8, [], ["cpu_offload", "full_recompute"], None, 2,
     "CPU offloading does not work when activation recomputation is enabled",
     {"model.cpu_offloading": True, "model.cpu_offloading_num_layers": 1, "model.recompute_granularity": "full",
      "model.recompute_method": "uniform", "model.recompute_num_layers": 1},
     "CPU offloading does not work when activation recomputation is enabled"),
    ("cpu_offload+num_layers", L8, [], ["cpu_offload"], {"num_layers": 32}, 2,
     "CPU offloading can be done only for layers less than 32",
     {"model.cpu_offloading": True, "model.cpu_offloading_num_layers": 32},
     "CPU offloading can be done only for layers less than 32"),
    ("recompute_label", L8, [], ["selective_recompute"], {"modules": ["core_attn", "attn_everything"]}, 2,
     "Invalid choices for recompute_modules", {"model.recompute_granularity": "selective",
                                               "model.recompute_modules": ["core_attn", "attn_everything"]},
     "Invalid choices for recompute_modules"),
    ("moe_act_dense", L8, [], ["selective_recompute"], {"modules": ["moe_act"]}, 2,
     "moe_act in recompute_modules is only supported with moe_grouped_gemm",
     {"model.recompute_granularity": "selective", "model.recompute_modules": ["moe_act"]},
     "moe_act in recompute_modules is only supported with moe_grouped_gemm"),
    ("mla_up_proj_no_mla", L8, [], ["selective_recompute"], {"modules": ["mla_up_proj"]}, 2,
     "mla_up_proj in recompute_modules is only supported with multi-latent attention",
     {"model.recompute_granularity": "selective", "model.recompute_modules": ["mla_up_proj"]},
     "mla_up_proj"),
    ("cpu_offload+te_graphs", L8, ["model.cuda_graph_impl=transformer_engine"], ["cpu_offload"], None, 2,
     "CUDA graphs not supported with CPU offloading",
     {"model.cpu_offloading": True, "model.cpu_offloading_num_layers": 1},
     "CUDA graphs not supported with CPU offloading"),
    ("fp8_delayed+layernorm", L8, ["mixed_precision=bf16_with_fp8_delayed_scaling_mixed"], ["selective_recompute"],
     {"modules": ["layernorm"]}, 2, "Delayed scaling does not support moe_act and layernorm",
     {"model.recompute_granularity": "selective", "model.recompute_modules": ["layernorm"]},
     "Delayed scaling does not support moe_act and layernorm"),
    ("full_recompute+te_graphs", L8, ["model.cuda_graph_impl=transformer_engine"], ["full_recompute"], None, 2,
     "full recompute is only supported with full iteration CUDA graph",
     {"model.recompute_granularity": "full", "model.recompute_method": "uniform", "model.recompute_num_layers": 1},
     "full recompute is only supported with full iteration CUDA graph"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_incompatibility_ours_and_oracle(case, recipe, bridge, clean_env):
    _, name, overrides, overlays, params, ws, ours, fields, theirs = case
    cfg = recipe(name, *overrides)
    before = snapshot(cfg)
    env_before = dict(clean_env)
    err = rejected(cfg, overlays, clean_env, ours, params=params, world_size=ws)
    assert snapshot(cfg) == before and clean_env == env_before, "a rejected apply changed something"
    assert all(p.fix and p.source for p in err.problems)
    oracle_rejects(bridge, recipe(name, *overrides), fields, theirs, ws)


def test_error_names_both_overlays_in_either_order(recipe, clean_env):
    for order in (["cpu_offload", "selective_recompute"], ["selective_recompute", "cpu_offload"]):
        err = rejected(recipe(L8), order, clean_env, "CPU offloading does not work")
        assert any({"cpu_offload", "selective_recompute"} <= set(p.overlays) for p in err.problems)


def test_all_violations_reported_at_once(recipe, clean_env):
    err = rejected(recipe(L70), ["cpu_offload", "selective_recompute"], clean_env, "Pipeline", world_size=32)
    checks = {p.check for p in err.problems}
    assert {"cpu_offload_pipeline", "cpu_offload_recompute"} <= checks


def test_cpu_offload_with_te_cuda_graphs(recipe, clean_env):
    rejected(recipe(L8, "model.cuda_graph_impl=transformer_engine"), ["cpu_offload"], clean_env,
             "CUDA graphs not supported with CPU offloading")


def test_cpu_offload_with_fine_grained_offloading(recipe, clean_env):
    cfg = recipe(L8, "model.fine_grained_activation_offloading=true", "model.offload_modules=[core_attn]")
    rejected(cfg, ["cpu_offload"], clean_env, "fine_grained_activation_offloading cannot be enabled with cpu_offloading")


def test_full_recompute_num_layers_range_is_doc_only_and_enforced(recipe, clean_env, bridge):
    rejected(recipe(L8), ["full_recompute"], clean_env, "between 1 and num_layers_per_pipeline_rank: 32",
             params={"num_layers": 40})


def test_expandable_segments_nccl_ub_warns_on_new_torch(recipe, clean_env, bridge):
    cfg = recipe(L8, "ddp.nccl_ub=true")
    report = apply_overlay(cfg, "expandable_segments", env=clean_env)
    assert any("nccl_ub" in w and "torch<2.11" in w for w in report.warnings)
    assert bridge.validate_config(cfg, world_size=2).ok  # megatron-core agrees: inactive on torch>=2.11


def test_expandable_segments_nccl_ub_is_an_error_on_old_torch(recipe, clean_env, monkeypatch):
    monkeypatch.setattr(View, "torch_version", property(lambda self: (2, 10)))
    rejected(recipe(L8, "ddp.nccl_ub=true"), ["expandable_segments"], clean_env, "not supported with nccl_ub")


def test_expandable_segments_with_cuda_graphs_sets_nccl_graph_register(recipe, clean_env):
    cfg = recipe(L8, "model.cuda_graph_impl=transformer_engine")
    clean_env["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:256"
    report = apply_overlay(cfg, "expandable_segments", env=clean_env)
    assert clean_env["NCCL_GRAPH_REGISTER"] == "0"
    assert clean_env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:256,expandable_segments:True"
    assert any(c.target == "$PYTORCH_CUDA_ALLOC_CONF" for c in report.changes)


def test_expandable_segments_refuses_contradicting_nccl_graph_register(recipe, clean_env):
    clean_env["NCCL_GRAPH_REGISTER"] = "1"
    rejected(recipe(L8, "model.cuda_graph_impl=transformer_engine"), ["expandable_segments"], clean_env,
             "needs NCCL_GRAPH_REGISTER=0")
    assert clean_env["NCCL_GRAPH_REGISTER"] == "1"


def test_expandable_segments_explicit_false_is_a_conflict(recipe, clean_env):
    clean_env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:False"
    rejected(recipe(L8), ["expandable_segments"], clean_env, "already has expandable_segments:False")
    assert clean_env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"


def test_expandable_segments_respects_pytorch_alloc_conf(recipe, clean_env):
    clean_env["PYTORCH_ALLOC_CONF"] = "roundup_power2_divisions:16"
    apply_overlay(recipe(L8), "expandable_segments", env=clean_env)
    assert clean_env["PYTORCH_ALLOC_CONF"] == "roundup_power2_divisions:16,expandable_segments:True"
    # torch 2.14.1 reads PYTORCH_CUDA_ALLOC_CONF first: the user's keys must be in it too (issue 33 #9)
    assert clean_env["PYTORCH_CUDA_ALLOC_CONF"] == "roundup_power2_divisions:16,expandable_segments:True"


def test_malformed_allocator_setting_is_refused(recipe, clean_env):
    clean_env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:maybe"
    rejected(recipe(L8), ["expandable_segments"], clean_env, "must be True or False")


@pytest.mark.parametrize("name, overrides, expected", [
    (L8, [], ["core_attn"]),
    (MOE, [], ["moe_act"]),
    ("moonlight_16b_pretrain_config", [], ["mla_up_proj"]),
])
def test_selective_recompute_default_follows_architecture(recipe, clean_env, name, overrides, expected):
    cfg = recipe(name, *overrides)
    apply_overlay(cfg, "selective_recompute", env=clean_env)
    assert cfg.model.recompute_granularity == "selective" and cfg.model.recompute_modules == expected


def test_mlp_recompute_on_pure_moe_warns(recipe, clean_env):
    report = apply_overlay(recipe(MOE), "selective_recompute", env=clean_env, params={"modules": ["mlp"]})
    assert any("'mlp' has no effect" in w for w in report.warnings)


def test_moe_recompute_with_ep_overlap(recipe, clean_env):
    cfg = recipe(MOE, "comm_overlap.overlap_moe_expert_parallel_comm=true")
    rejected(cfg, ["selective_recompute"], clean_env, "overlap_moe_expert_parallel_comm", params={"modules": ["moe"]})


def test_shared_experts_recompute_with_shared_expert_overlap(recipe, clean_env):
    cfg = recipe("moonlight_16b_pretrain_config", "model.moe_shared_expert_overlap=true")
    rejected(cfg, ["selective_recompute"], clean_env, "shared_experts recompute cannot work",
             params={"modules": ["shared_experts"]})


def test_fp8_delayed_scaling_with_layernorm_recompute(recipe, clean_env):
    cfg = recipe(L8, "mixed_precision=bf16_with_fp8_delayed_scaling_mixed")
    rejected(cfg, ["selective_recompute"], clean_env, "Delayed scaling does not support", params={"modules": ["layernorm"]})
    # current scaling is fine
    cfg = recipe(L8, "mixed_precision=bf16_with_fp8_current_scaling_mixed")
    apply_overlay(cfg, "selective_recompute", env=clean_env, params={"modules": ["layernorm"]})


def test_vpp_divisibility_is_a_runtime_rule_bridge_validation_skips_for_even_pp(recipe, clean_env, bridge):
    # 80 layers / PP4 = 20 per rank, VPP 3 does not divide it. megatron-core's config checks run it only for
    # uneven pipeline splits; for even ones it asserts at model build (transformer_block.py): Bridge's
    # validation accepts, the job would fail on the GPUs, we refuse before launch.
    rejected(recipe(L70, "model.virtual_pipeline_model_parallel_size=3"), ["expandable_segments"], clean_env,
             "should be divisible by vp_size 3", world_size=32)
    assert bridge.validate_config(recipe(L70, "model.virtual_pipeline_model_parallel_size=3"), world_size=32).ok
    from mbmem_overlays.core.rules import doc_only_checks
    assert "vpp_layer_divisibility" in doc_only_checks()


def test_optimizer_offload_fraction_range(recipe, clean_env):
    with pytest.raises(OverlayError, match="must be <= 1.0"):
        apply_overlay(recipe(L8), "optimizer_offload", env=clean_env, params={"fraction": 1.5})


def test_dist_optimizer_sets_both_flags(recipe, clean_env):
    cfg = recipe(L8, "optimizer.use_distributed_optimizer=false", "ddp.use_distributed_optimizer=false")
    apply_overlay(cfg, "dist_optimizer", env=clean_env)
    assert cfg.optimizer.use_distributed_optimizer and cfg.ddp.use_distributed_optimizer


def test_dist_optimizer_no_dp_is_surfaced(recipe, clean_env):
    cfg = recipe(L8, "model.context_parallel_size=1")
    report = apply_overlay(cfg, "dist_optimizer", env=clean_env, world_size=1)
    assert any("nothing to shard" in w for w in report.warnings)
