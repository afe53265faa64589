"""Guarantees: atomic, idempotent, order-independent, all problems at once, nothing silent."""

from __future__ import annotations

import os

import pytest

from mbmem_overlays import OverlayError, apply_overlay
from mbmem_overlays.core import engine

from conftest import snapshot

pytestmark = pytest.mark.bridge
L8 = "llama3_8b_pretrain_config"
SAFE = ["expandable_segments", "selective_recompute", "dist_optimizer", "optimizer_offload"]


def test_order_independent(recipe, clean_env):
    a, b = recipe(L8), recipe(L8)
    env_a, env_b = dict(clean_env), dict(clean_env)
    ra = apply_overlay(a, SAFE, env=env_a)
    rb = apply_overlay(b, list(reversed(SAFE)), env=env_b)
    assert snapshot(a) == snapshot(b) and env_a == env_b
    assert [c.render() for c in ra.changes] == [c.render() for c in rb.changes]


def test_idempotent(recipe, clean_env):
    cfg = recipe(L8)
    apply_overlay(cfg, SAFE, env=clean_env)
    once, env_once = snapshot(cfg), dict(clean_env)
    report = apply_overlay(cfg, SAFE, env=clean_env)
    assert snapshot(cfg) == once and clean_env == env_once
    assert report.changes == []


def test_report_lists_every_change_old_to_new(recipe, clean_env):
    cfg = recipe(L8)
    report = apply_overlay(cfg, ["full_recompute"], env=clean_env, params={"method": "block", "num_layers": 2})
    rendered = [c.render() for c in report.changes]
    assert "[full_recompute] model.recompute_granularity: None -> 'full'" in rendered
    assert "[full_recompute] model.recompute_method: None -> 'block'" in rendered
    assert cfg.model.recompute_num_layers == 2


def test_failure_midway_restores_config_and_env(recipe, clean_env, monkeypatch):
    cfg = recipe(L8)
    clean_env["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:128"
    before, env_before = snapshot(cfg), dict(clean_env)
    real_put, calls = engine.put, []

    def flaky_put(obj, key, value):
        calls.append(key)
        if len(calls) == 3:
            raise RuntimeError("injected failure")
        real_put(obj, key, value)

    monkeypatch.setattr(engine, "put", flaky_put)
    with pytest.raises(RuntimeError, match="injected"):
        apply_overlay(cfg, ["selective_recompute", "optimizer_offload", "expandable_segments"], env=clean_env)
    assert len(calls) > 3  # writes happened, then were undone
    assert snapshot(cfg) == before and clean_env == env_before


def test_bridge_exception_restores_environment(recipe, bridge, monkeypatch):
    import megatron.bridge.training.config as bcfg
    marker = "MBMEM_TEST_SENTINEL"
    os.environ.pop(marker, None)

    def boom(cfg):
        os.environ[marker] = "set by a crashing validator"
        os.environ["WORLD_SIZE"] = "999"
        raise RuntimeError("validator exploded")

    before = dict(os.environ)
    monkeypatch.setattr(bcfg, "runtime_config_update", boom)
    result = bridge.validate_config(recipe(L8), world_size=2)
    assert not result.ok and "validator exploded" in result.error
    assert dict(os.environ) == before


def test_validation_runs_on_a_copy(recipe, bridge):
    cfg = recipe(L8)
    before = snapshot(cfg)
    assert bridge.validate_config(cfg, world_size=2).ok
    assert snapshot(cfg) == before


def test_te_checks_are_reported_not_passed(recipe, bridge):
    result = bridge.validate_config(recipe(L8), world_size=2)
    assert result.ok and any("apply_rope_fusion" in n and "not checkable" in n for n in result.not_checkable)


def test_validate_flag_attaches_bridge_verdict(recipe, clean_env):
    report = apply_overlay(recipe(L8), ["selective_recompute"], env=clean_env, world_size=2, validate=True)
    assert report.validation.ok and report.validation.data_parallel_size == 1


def test_bridge_rejection_is_reported_with_original_message(recipe, clean_env):
    cfg = recipe(L8, "model.recompute_granularity=selective", "model.distribute_saved_activations=true",
                 "model.tensor_model_parallel_size=2", "model.sequence_parallel=true")
    with pytest.raises(OverlayError, match="distribute_saved_activations must be false"):
        apply_overlay(cfg, "expandable_segments", env=clean_env)


@pytest.mark.parametrize("params, fragment", [
    ({"num_layrs": 2}, "did you mean 'num_layers'"),
    ({"num_layers": "two"}, "must be an integer"),
    ({"num_layers": True}, "must be an integer"),
    ({"num_layers": -1}, "must be >= 0"),
])
def test_bad_parameters(recipe, clean_env, params, fragment):
    cfg = recipe(L8)
    before = snapshot(cfg)
    with pytest.raises(OverlayError, match=fragment):
        apply_overlay(cfg, "cpu_offload", env=clean_env, params=params)
    assert snapshot(cfg) == before


def test_params_for_unselected_overlay(recipe, clean_env):
    with pytest.raises(OverlayError, match="not selected"):
        apply_overlay(recipe(L8), "expandable_segments", env=clean_env, params={"cpu_offload": {"num_layers": 1}})


def test_unknown_overlay(recipe, clean_env):
    cfg = recipe(L8)
    before, env_before = snapshot(cfg), dict(clean_env)
    with pytest.raises(OverlayError, match="unknown overlay 'selective_recompte'.*selective_recompute"):
        apply_overlay(cfg, ["expandable_segments", "selective_recompte"], env=clean_env)
    assert snapshot(cfg) == before and clean_env == env_before


def test_conflicting_overlays_name_both(recipe, clean_env):
    with pytest.raises(OverlayError) as exc:
        apply_overlay(recipe(L8), ["full_recompute", "selective_recompute"], env=clean_env)
    assert any(set(p.overlays) == {"full_recompute", "selective_recompute"} for p in exc.value.problems)


def test_overlay_may_not_silently_override_user_setting(recipe, clean_env):
    with pytest.raises(OverlayError, match="your override sets model.recompute_granularity"):
        apply_overlay(recipe(L8), "selective_recompute", env=clean_env, locked={"model.recompute_granularity": "full"})


def test_user_overlay_with_misspelled_field(recipe, clean_env, tmp_path):
    (tmp_path / "mem").mkdir()
    (tmp_path / "mem" / "typo.yaml").write_text(
        "# @package mem.typo\noverlay:\n  summary: t\n  set:\n    model.recompute_granularty: selective\n")
    cfg = recipe(L8)
    with pytest.raises(OverlayError, match="Did you mean model.recompute_granularity"):
        apply_overlay(cfg, "typo", env=clean_env, overlay_dirs=[str(tmp_path)])
    assert not hasattr(cfg.model, "recompute_granularty")


def test_user_overlay_wrong_type(recipe, clean_env, tmp_path):
    (tmp_path / "mem").mkdir()
    (tmp_path / "mem" / "wrong.yaml").write_text("# @package mem.wrong\noverlay:\n  summary: t\n  set:\n    model.num_layers: many\n")
    with pytest.raises(OverlayError, match="expects int"):
        apply_overlay(recipe(L8), "wrong", env=clean_env, overlay_dirs=[str(tmp_path)])


def test_user_overlay_applies(recipe, clean_env, tmp_path):
    (tmp_path / "mem").mkdir()
    (tmp_path / "mem" / "mbs1.yaml").write_text(
        "# @package mem.mbs1\nmbs: 1\noverlay:\n  summary: t\n  set:\n    train.micro_batch_size: '@mbs'\n")
    cfg = recipe(L8)
    apply_overlay(cfg, ["mbs1", "expandable_segments"], env=clean_env, overlay_dirs=[str(tmp_path)],
                  params={"mbs1": {"mbs": 2}})
    assert cfg.train.micro_batch_size == 2


def test_lora_regather_on_non_peft_recipe(recipe, clean_env):
    with pytest.raises(OverlayError, match="(?s)peft is None.*llama3_8b_peft"):
        apply_overlay(recipe(L8), "lora_regather", env=clean_env)


def test_lora_regather_reports_k_of_n(recipe, clean_env):
    cfg = recipe("qwen3_8b_peft_config", "model.tensor_model_parallel_size=2", "model.sequence_parallel=true")
    report = apply_overlay(cfg, "lora_regather", env=clean_env)
    assert any("1 of 2 target modules will re-gather" in n and "linear_proj: falls back (the adapter is row-parallel)" in n
               for n in report.notes)


def test_lora_regather_fallbacks(recipe, clean_env):
    cfg = recipe("llama3_8b_peft_config", "model.tensor_model_parallel_size=2", "model.sequence_parallel=true")
    report = apply_overlay(cfg, ["lora_regather", "selective_recompute"], env=clean_env,
                           params={"selective_recompute": {"modules": ["mlp"]}})
    note = next(n for n in report.notes if "re-gather" in n)
    # the reason's wording follows the peft rule; that linear_fc1 falls back under MLP recompute does not
    assert "1 of 4" in note and "linear_fc1: falls back" in note and "mlp" in note.split("linear_fc1: falls back")[1].lower()


def test_lora_regather_on_moe_falls_back_for_experts_but_not_shared_experts(recipe, clean_env):
    # Bridge's adapter refuses expert adapters (is_expert); a shared expert's FC1 is an ordinary column-parallel one
    tp2 = ("model.tensor_model_parallel_size=2", "model.sequence_parallel=true")
    routed_only = recipe("qwen3_30b_a3b_peft_config", *tp2,
                         "peft.target_modules=[linear_qkv,linear_proj,linear_fc1,linear_fc2]")
    note = next(n for n in apply_overlay(routed_only, "lora_regather", env=clean_env, world_size=16).notes
                if "re-gather" in n)
    assert "linear_fc1: falls back (expert adapters use a separate path)" in note
    shared = recipe("nemotron_3_nano_peft_config", *tp2)  # 3712-wide shared expert in every MoE layer
    note = next(n for n in apply_overlay(shared, "lora_regather", env=clean_env, world_size=16).notes
                if "re-gather" in n)
    assert "linear_fc1: re-gathers" in note


def test_lora_regather_sp_off_is_refused_unless_not_strict(recipe, clean_env):
    cfg = recipe("llama3_8b_peft_config", "model.tensor_model_parallel_size=2", "model.sequence_parallel=false")
    with pytest.raises(OverlayError, match="sequence-parallel communication is disabled"):
        apply_overlay(cfg, "lora_regather", env=clean_env)
    report = apply_overlay(cfg, "lora_regather", env=clean_env, params={"strict": False})
    assert any("silent no-op" in w for w in report.warnings)


def test_sequence_parallel_at_tp1_is_surfaced(recipe, clean_env):
    report = apply_overlay(recipe(L8), "sequence_parallel", env=clean_env)
    assert any("silently turned off by Bridge" in w for w in report.warnings)


def test_env_none_reads_but_does_not_write_process_env(recipe, monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    cfg = recipe(L8)
    report = apply_overlay(cfg, "expandable_segments")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64"
    assert report.env_to_export["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64,expandable_segments:True"
    assert cfg.env_vars["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:64,expandable_segments:True"
    assert any("wins over cfg.env_vars" in w for w in report.warnings)


# ----------------------------------------------------------------------------- bad-input catalogue
@pytest.mark.parametrize("value, fragment", [
    ("expandable_segments:maybe", "must be True or False"),
    ("max_split_size_mb:128,max_split_size_mb:256", "appears twice"),
    ("max_split_size_mb:128,", "trailing comma"),
])
def test_malformed_alloc_conf_changes_nothing(recipe, clean_env, value, fragment):
    cfg = recipe(L8)
    clean_env["PYTORCH_CUDA_ALLOC_CONF"] = value
    before, env_before = snapshot(cfg), dict(clean_env)
    with pytest.raises(OverlayError, match=fragment):
        apply_overlay(cfg, ["expandable_segments", "selective_recompute"], env=clean_env)
    assert snapshot(cfg) == before and clean_env == env_before


def test_world_size_not_divisible(recipe, clean_env):
    cfg = recipe(L8, "model.tensor_model_parallel_size=2")  # TP2 x CP2 = 4
    before = snapshot(cfg)
    env_before = dict(clean_env)
    with pytest.raises(OverlayError, match="world size 6 is not divisible by TP\\*PP\\*CP = 2\\*1\\*2 = 4"):
        apply_overlay(cfg, "expandable_segments", env=clean_env, world_size=6)
    assert snapshot(cfg) == before and clean_env == env_before


def test_recipe_whose_hf_config_is_not_available_offline(bridge):
    # Step-3.5-Flash ships no fixture (no public source of its config.json, hf_configs/SOURCES.md): the error says
    # which file to provide.
    with pytest.raises(OverlayError) as exc:
        bridge.build_recipe("step35_196b_a11b_pretrain_512gpu_h100_bf16_config")
    text = str(exc.value)
    assert "stepfun-ai/Step-3.5-Flash" in text and "stepfun-ai--Step-3.5-Flash/config.json" in text


def test_user_hf_config_dir_makes_a_recipe_build(bridge, tmp_path, monkeypatch):
    src = bridge.hf_offline.FIXTURE_DIR / "meta-llama--Meta-Llama-3-8B" / "config.json"
    (tmp_path / "org--not-shipped-7B").mkdir()
    (tmp_path / "org--not-shipped-7B" / "config.json").write_text(src.read_text())
    monkeypatch.setenv("MBMEM_HF_CONFIGS", str(tmp_path))
    home = bridge.hf_offline.build_cache(tmp_path / "cache")
    assert (home / "hub" / "models--org--not-shipped-7B" / "refs" / "main").is_file()
