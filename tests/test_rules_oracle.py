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

# What +mem=megatron_fsdp, +mem=fine_grained_offload and +mem=precision_aware_optimizer write, for the oracle side.
FSDP_FIELDS = {"dist.use_megatron_fsdp": True, "ddp.use_megatron_fsdp": True, "ddp.average_in_collective": False,
               "ddp.data_parallel_sharding_strategy": "optim_grads_params", "checkpoint.ckpt_format": "fsdp_dtensor",
               "optimizer.use_distributed_optimizer": True, "ddp.use_distributed_optimizer": True}
OFFLOAD_FIELDS = {"model.fine_grained_activation_offloading": True, "model.offload_modules": ["core_attn"],
                  "model.activation_offload_fraction": 1.0}
PRECISION_AWARE_FIELDS = {"optimizer.use_precision_aware_optimizer": True, "optimizer.use_distributed_optimizer": True,
                          "ddp.use_distributed_optimizer": True}
CASES += [
    ("fsdp+weight_hash", L8, ["train.check_weight_hash_across_dp_replicas_interval=10"], ["megatron_fsdp"], None, 4,
     "check_weight_hash_across_dp_replicas_interval is not supported",
     {**FSDP_FIELDS, "train.check_weight_hash_across_dp_replicas_interval": 10},
     "check_weight_hash_across_dp_replicas_interval is not supported with the Megatron-FSDP optim_grads_params"),
    ("fsdp+tp_pp_dp_mapping", L8, ["dist.use_tp_pp_dp_mapping=true"], ["fsdp"], None, 4,
     "use_tp_pp_dp_mapping is not supported with Megatron FSDP", {**FSDP_FIELDS, "dist.use_tp_pp_dp_mapping": True},
     "use_tp_pp_dp_mapping is not supported with Megatron FSDP"),
    ("fsdp+torch_fsdp2", L8, ["dist.use_torch_fsdp2=true"], ["megatron_fsdp"], {"strategy": "optim_grads"}, 4,
     "mutually exclusive", {**FSDP_FIELDS, "dist.use_torch_fsdp2": True}, "use_megatron_fsdp and use_torch_fsdp2 are mutually exclusive"),
    ("fsdp+manual_registration", L8, ["ddp.fsdp_manual_registration=true"], ["megatron_fsdp"], None, 4,
     "fsdp_manual_registration requires DDP.nccl_ub", {**FSDP_FIELDS, "ddp.fsdp_manual_registration": True},
     "DDP.fsdp_manual_registration requires DDP.nccl_ub"),
    ("fsdp_dtensor_without_fsdp", L8, ["checkpoint.ckpt_format=fsdp_dtensor"], ["dist_optimizer"], None, 4,
     "fsdp_dtensor checkpoint format only supports Megatron FSDP", {"checkpoint.ckpt_format": "fsdp_dtensor"},
     "fsdp_dtensor checkpoint format only supports Megatron FSDP"),
    ("offload+min_size", L8, ["model.min_offloaded_tensor_size=-1"], ["fine_grained_offload"], None, 2,
     "min_offloaded_tensor_size must be non-negative", {**OFFLOAD_FIELDS, "model.min_offloaded_tensor_size": -1},
     "min_offloaded_tensor_size must be non-negative"),
    ("offload+delta_bytes", L8, ["model.delta_offload_bytes_across_pp_ranks=-1"], ["offload_modules"], None, 2,
     "delta_offload_bytes_across_pp_ranks must be non-negative",
     {**OFFLOAD_FIELDS, "model.delta_offload_bytes_across_pp_ranks": -1},
     "delta_offload_bytes_across_pp_ranks must be non-negative"),
    ("offload+attn_proj_alone", L8, [], ["fine_grained_offload"], {"modules": ["attn_proj"]}, 2,
     "attn_proj cannot be set to offload_modules alone", {**OFFLOAD_FIELDS, "model.offload_modules": ["attn_proj"]},
     "attn_proj cannot be set to offload_modules alone"),
    ("offload+bad_label", L8, [], ["fine_grained_offload"], {"modules": ["core_attn", "mlp"]}, 2,
     "Invalid choices for offload_modules", {**OFFLOAD_FIELDS, "model.offload_modules": ["core_attn", "mlp"]},
     "Invalid choices for offload_modules"),
    ("offload+recomputed_moe", MOE, [], ["fine_grained_offload", "selective_recompute"],
     {"fine_grained_offload.modules": ["expert_fc1"], "selective_recompute.modules": ["moe"]}, 8,
     "while recomputing the entire MoE layer",
     {**OFFLOAD_FIELDS, "model.offload_modules": ["expert_fc1"], "model.recompute_granularity": "selective",
      "model.recompute_modules": ["moe"]}, "while recomputing the entire MoE layer"),
    ("offload+cpu_offload", L8, [], ["fine_grained_offload", "cpu_offload"], None, 2,
     "fine_grained_activation_offloading cannot be enabled with cpu_offloading",
     {**OFFLOAD_FIELDS, "model.cpu_offloading": True, "model.cpu_offloading_num_layers": 1},
     "fine_grained_activation_offloading cannot be enabled with cpu_offloading"),
    ("offload+local_graphs", L8, ["model.cuda_graph_impl=local"],
     ["fine_grained_offload"], None, 2, "cuda_graph_impl='local' only supports offload_modules",
     # Bridge refuses per-layer local graphs before megatron-core's own fine-grained check (which says the same)
     OFFLOAD_FIELDS, 'supports model.cuda_graph_impl="local" only for full-iteration CUDA graphs'),
    ("offload+te_graphs_no_warmup", L8, ["model.cuda_graph_impl=transformer_engine", "model.cuda_graph_warmup_steps=0"],
     ["fine_grained_offload"], None, 2, "cuda_graph_warmup_steps must be greater than 0", OFFLOAD_FIELDS,
     "cuda_graph_warmup_steps must be greater than 0"),
    ("offload+transformer_impl_local", L8, ["model.transformer_impl=local"], ["fine_grained_offload"], None, 2,
     "only supported with transformer_engine implementation", OFFLOAD_FIELDS,
     "Fine-grained activation offloading is only supported with transformer_engine implementation"),
    ("bf16_moments+sgd", L8, ["optimizer.optimizer=sgd"], ["bf16_moments"], None, 4,
     "only supported with adam", PRECISION_AWARE_FIELDS, "--use-precision-aware-optimizer only supported with adam"),
    ("moment_dtype_without_precision_aware", L8, ["optimizer.exp_avg_dtype=bfloat16"], ["dist_optimizer"], None, 4,
     "exp_avg_dtype can only be fp32 when not using precision-aware optimizer", {},
     "exp_avg_dtype can only be fp32 when not using precision-aware optimizer"),
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


# ----------------------------------------------------------------------------- megatron_fsdp, fine_grained_offload,
# precision_aware_optimizer: what they write, their compositions, their parameters
def test_megatron_fsdp_writes_the_skill_settings_and_the_checkpoint_format(recipe, clean_env):
    cfg = recipe(L8)  # the recipe saves checkpoints: Bridge asserts fsdp_dtensor then
    report = apply_overlay(cfg, "fsdp", env=clean_env, world_size=4)
    assert cfg.dist.use_megatron_fsdp and cfg.ddp.use_megatron_fsdp and not cfg.ddp.average_in_collective
    assert cfg.ddp.data_parallel_sharding_strategy == "optim_grads_params" and cfg.checkpoint.ckpt_format == "fsdp_dtensor"
    assert {c.target for c in report.changes} >= {"dist.use_megatron_fsdp", "checkpoint.ckpt_format"}
    no_io = recipe(L8, "checkpoint.save=null", "checkpoint.load=null")
    apply_overlay(no_io, "megatron_fsdp", env=clean_env, world_size=4, params={"strategy": "optim"})
    assert no_io.checkpoint.ckpt_format == "torch_dist" and no_io.ddp.data_parallel_sharding_strategy == "optim"


@pytest.mark.parametrize("order", [["megatron_fsdp", "dist_optimizer"], ["dist_optimizer", "megatron_fsdp"]])
def test_dist_optimizer_is_implied_by_megatron_fsdp_not_a_conflict(recipe, clean_env, order):
    cfg = recipe(L8, "optimizer.use_distributed_optimizer=false", "ddp.use_distributed_optimizer=false")
    apply_overlay(cfg, order, env=clean_env, world_size=4)
    assert cfg.optimizer.use_distributed_optimizer and cfg.ddp.use_distributed_optimizer and cfg.ddp.use_megatron_fsdp


def test_megatron_fsdp_refuses_cuda_device_max_connections_1_and_changes_nothing(recipe, clean_env, bridge):
    clean_env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    cfg = recipe(L8)
    before, env_before = snapshot(cfg), dict(clean_env)
    rejected(cfg, ["megatron_fsdp"], clean_env, "FSDP requires CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset", world_size=4)
    assert snapshot(cfg) == before and clean_env == env_before
    oracle = recipe(L8)
    for path, value in FSDP_FIELDS.items():
        write(oracle, path, value)
    result = bridge.validate_config(oracle, world_size=4, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
    assert not result.ok and "FSDP requires CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset" in result.error


def test_megatron_fsdp_strategy_is_validated(recipe, clean_env):
    with pytest.raises(OverlayError, match="must be one of"):
        apply_overlay(recipe(L8), "megatron_fsdp", env=clean_env, params={"strategy": "no_shard"})


def test_fine_grained_offload_sets_the_te_environment_it_needs(recipe, clean_env, bridge):
    cfg = recipe(L8, "model.pipeline_model_parallel_size=2")  # unlike cpu_offload, any PP
    report = apply_overlay(cfg, "offload_modules", env=clean_env, world_size=4,
                           params={"modules": ["core_attn", "attn_proj", "qkv_linear"], "fraction": 0.5})
    assert cfg.model.fine_grained_activation_offloading and cfg.model.activation_offload_fraction == 0.5
    assert cfg.model.offload_modules == ["core_attn", "attn_proj", "qkv_linear"]
    assert clean_env["NVTE_CPU_OFFLOAD_V1"] == "1" and report.env_to_export["NVTE_CPU_OFFLOAD_V1"] == "1"
    assert bridge.validate_config(cfg, world_size=4, env=clean_env).ok


def test_fine_grained_offload_refuses_a_contradicting_nvte_setting(recipe, clean_env):
    clean_env["NVTE_CPU_OFFLOAD_V1"] = "0"
    rejected(recipe(L8), ["fine_grained_offload"], clean_env, "needs NVTE_CPU_OFFLOAD_V1=1")
    assert clean_env["NVTE_CPU_OFFLOAD_V1"] == "0"


@pytest.mark.parametrize("order", [["fine_grained_offload", "cpu_offload"], ["cpu_offload", "fine_grained_offload"]])
def test_fine_grained_and_layer_offload_conflict_both_ways(recipe, clean_env, order):
    err = rejected(recipe(L8), order, clean_env, "cannot be enabled with cpu_offloading")
    assert any({"cpu_offload", "fine_grained_offload"} <= set(p.overlays) for p in err.problems)


def test_fine_grained_offload_parameters_are_validated(recipe, clean_env):
    with pytest.raises(OverlayError, match="must be <= 1.0"):
        apply_overlay(recipe(L8), "fine_grained_offload", env=clean_env, params={"fraction": 1.5})


def test_precision_aware_optimizer_writes_torch_dtypes(recipe, clean_env, bridge):
    import torch
    cfg = recipe(L8, "optimizer.use_distributed_optimizer=false", "ddp.use_distributed_optimizer=false")
    report = apply_overlay(cfg, "bf16_moments", env=clean_env, world_size=4,
                           params={"exp_avg_sq_dtype": "fp8", "main_params_dtype": "fp16"})
    o = cfg.optimizer
    assert o.use_precision_aware_optimizer and o.use_distributed_optimizer and cfg.ddp.use_distributed_optimizer
    assert (o.exp_avg_dtype, o.exp_avg_sq_dtype, o.main_params_dtype, o.main_grads_dtype) == \
        (torch.bfloat16, torch.uint8, torch.float16, torch.float32)
    assert any(c.target == "optimizer.exp_avg_dtype" for c in report.changes)
    # the same dtypes given the way Bridge's overrides take them, then the overlay: nothing left to change
    again = recipe(L8, "optimizer.exp_avg_dtype=bfloat16", "optimizer.exp_avg_sq_dtype=bfloat16",
                   "optimizer.use_precision_aware_optimizer=true")
    report = apply_overlay(again, "precision_aware_optimizer", env=clean_env, world_size=4)
    assert not any(c.target.endswith("_dtype") for c in report.changes)


def test_precision_aware_optimizer_dtype_choices_are_megatron_cores(recipe, clean_env):
    with pytest.raises(OverlayError, match="must be one of"):
        apply_overlay(recipe(L8), "precision_aware_optimizer", env=clean_env, params={"main_params_dtype": "bf16"})


def test_precision_aware_optimizer_precision_flags_match_bridges_own_check(recipe, clean_env, bridge):
    # Without a mixed_precision config nothing copies model.bf16 onto the optimizer. On this host megatron-core's
    # optimizer finalize (TE's FusedAdam) stops runtime_config_update before this check, so Bridge's own function
    # is the oracle here.
    from megatron.bridge.training.config import _validate_mixed_precision_consistency
    cfg = recipe(L8, "mixed_precision=null", "model.bf16=true", "optimizer.bf16=false")
    rejected(cfg, ["precision_aware_optimizer"], clean_env, "optimizer.bf16=True must be set when model.bf16=True",
             world_size=4)
    for path, value in PRECISION_AWARE_FIELDS.items():
        write(cfg, path, value)
    with pytest.raises(AssertionError, match="optimizer.bf16=True must be set when model.bf16=True"):
        _validate_mixed_precision_consistency(cfg)
    apply_overlay(recipe(L8), "precision_aware_optimizer", env=clean_env, world_size=4)  # bf16_mixed aligns them


def test_fine_grained_offload_ncclep_overlap_matches_megatron_core(recipe, clean_env):
    # The flex dispatcher needs a GPU in Bridge's validation, so megatron-core's TransformerConfig is the oracle.
    cfg = recipe(MOE, "model.expert_model_parallel_size=2", "model.pipeline_model_parallel_size=1",
                 "model.virtual_pipeline_model_parallel_size=null", "model.moe_token_dispatcher_type=flex",
                 "model.moe_flex_dispatcher_backend=ncclep", "model.overlap_moe_expert_parallel_comm=true",
                 "model.fine_grained_activation_offloading=true", "model.offload_modules=[expert_fc1]")
    if cfg.comm_overlap is not None:
        cfg.comm_overlap.overlap_moe_expert_parallel_comm = True
    view = View(cfg, {}, {"NVTE_CPU_OFFLOAD_V1": "1"}, 8, (), {})
    from mbmem_overlays.core.rules.offload import fine_grained_offload_ncclep_overlap as rule
    from mbmem_overlays.core.rules import CHECKS
    check = next(c for c in CHECKS if c.id == "fine_grained_offload_ncclep_overlap")
    assert [p.check for p in check(view)] == [check.id] and rule
    import dataclasses
    from megatron.core.transformer.transformer_config import TransformerConfig
    names = {f.name for f in dataclasses.fields(TransformerConfig)}
    kwargs = {k: getattr(cfg.model, k) for k in names if hasattr(cfg.model, k)}
    kwargs.update(apply_rope_fusion=False, moe_permute_fusion=False)  # what needs TE on this host, as validation.py
    with pytest.raises((AssertionError, ValueError), match="ncclep does not support offloading"):
        TransformerConfig(**kwargs)
