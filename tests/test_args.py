"""mbmem args: overlays as Bridge-launcher arguments. The printed overrides go through Bridge's own override
machinery (omegaconf_utils.process_config_with_overrides, what run_recipe.py calls) on a real recipe, and the
result must equal what apply_overlay makes of the same recipe."""

from __future__ import annotations

import json
import shlex

import pytest
from conftest import imports_of, mbmem, snapshot

from mbmem_overlays.launch.nemo_run import env_words, hydra_word

OVERLAYS = "expandable_segments,cpu_offload,dist_optimizer"
SETS = ["--set", "train.micro_batch_size=2", "--param", "cpu_offload.num_layers=2"]


def _args_json(capsys, *argv):
    from mbmem_overlays.cli import main
    code = main(["args", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("value", ["1e-4", "a:b", "it's", "x,y", "[a]", "null", "true", "", " lead", "back\\slash",
                                   0.0001, 3, True, None, ["core_attn", "mlp"], []])
def test_hydra_word_reads_back_the_same_value(value):
    from mbmem_overlays.bridge.overrides import parse_override
    from mbmem_overlays.core.values import plain
    word = hydra_word("model.x", value)
    assert parse_override(word) == ("model.x", plain(value))


def test_env_words_are_launcher_env_pairs():
    assert env_words({"B": "2", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) == [
        "--env", "B=2", "--env", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]


def test_usage_error_before_bridge():
    out = mbmem("args", "--recipe", "llama3_8b_pretrain", "--overlay", "no_such_overlay", timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stdout == "" and "no_such_overlay" in out.stderr and "Traceback" not in out.stderr
    assert "importing Megatron Bridge" not in out.stderr


@pytest.mark.bridge
def test_printed_overrides_through_bridges_machinery_equal_apply_overlay(bridge, capsys):
    from megatron.bridge.training.utils.omegaconf_utils import (
        process_config_with_overrides,
    )

    from mbmem_overlays import apply_overlay
    code, out = _args_json(capsys, "--recipe", "llama3_8b_pretrain", "--overlay", OVERLAYS, "--world-size", "8", *SETS)
    assert code == 0, out
    launcher = out["launcher"]
    assert launcher["overrides"][0] == "train.micro_batch_size=2"  # the user's own override comes first, verbatim
    assert "model.cpu_offloading=true" in launcher["overrides"]
    assert launcher["env"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert launcher["argv"][:2] == ["--env", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]

    by_bridge = bridge.load_recipe("llama3_8b_pretrain")
    process_config_with_overrides(by_bridge, cli_overrides=launcher["overrides"])
    by_api = bridge.load_recipe("llama3_8b_pretrain")
    bridge.apply_overrides(by_api, ["train.micro_batch_size=2"])
    report = apply_overlay(by_api, OVERLAYS.split(","), env={}, params={"cpu_offload.num_layers": 2}, world_size=8,
                           locked={"train.micro_batch_size": 2}, validate=True)
    assert report.field_changes  # the comparison below would be vacuous without a change
    assert snapshot(by_bridge) == snapshot(by_api)
    untouched = bridge.load_recipe("llama3_8b_pretrain")
    process_config_with_overrides(untouched, cli_overrides=["train.micro_batch_size=2"])
    assert snapshot(untouched) != snapshot(by_bridge)  # the overlays' words did change what Bridge built


@pytest.mark.bridge
def test_env_vars_entry_is_added_in_struct_mode(bridge, capsys):
    """A recipe without PYTORCH_CUDA_ALLOC_CONF in env_vars: Bridge's struct-mode parser needs '+' to add the
    key; the printed word must be accepted and give what apply_overlay writes."""
    from megatron.bridge.training.utils.omegaconf_utils import (
        process_config_with_overrides,
    )

    from mbmem_overlays import apply_overlay
    from mbmem_overlays.launch.nemo_run import launcher_overrides
    cfg = bridge.load_recipe("llama3_8b_pretrain")
    del cfg.env_vars["PYTORCH_CUDA_ALLOC_CONF"]
    by_bridge = bridge.load_recipe("llama3_8b_pretrain")
    del by_bridge.env_vars["PYTORCH_CUDA_ALLOC_CONF"]
    report = apply_overlay(cfg, ["expandable_segments"], env={}, world_size=8, validate=False)
    words = launcher_overrides(report)
    assert words == ["++env_vars.PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]
    process_config_with_overrides(by_bridge, cli_overrides=words)
    assert snapshot(by_bridge) == snapshot(cfg)


@pytest.mark.bridge
def test_rejected_prints_nothing_for_the_launcher(bridge, capsys):
    from mbmem_overlays.cli import main
    code = main(["args", "--recipe", "llama3_8b_pretrain", "--overlay", "cpu_offload",
                 "--set", "model.pipeline_model_parallel_size=2", "--world-size", "8"])
    out = capsys.readouterr()
    assert code == 1
    assert out.out == ""  # $(mbmem args ...) must not feed a half plan to the launcher
    assert "cpu_offload" in out.err


@pytest.mark.bridge
def test_text_output_is_one_shell_line_and_nemo_run_is_never_imported(bridge):
    """``mbmem list`` and ``mbmem args``: the printed line splits (shlex) into the --env pairs and the overrides,
    and nothing imports nemo_run: the package, the plugin module, list or args (every import of it is seen,
    even when an earlier test in this session imported it)."""
    with imports_of("nemo_run") as imported:
        import mbmem_overlays.launch.nemo_run  # noqa: F401  (the plugin module alone does not import it)
        assert mbmem("list").returncode == 0
        out = mbmem("args", "--recipe", "llama3_8b_pretrain", "--overlay", OVERLAYS, "--world-size", "8", *SETS)
    assert out.returncode == 0, out.stderr
    assert imported == []
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("--env"))
    words = shlex.split(line)
    assert words[:2] == ["--env", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]
    assert "train.micro_batch_size=2" in words and "model.cpu_offloading=true" in words
    assert "# validated for world size 8: PASSED" in out.stderr


@pytest.mark.bridge
def test_only_prints_one_half_and_json_rejection_is_an_object(bridge, capsys):
    from mbmem_overlays.cli import main
    base = ["args", "--recipe", "llama3_8b_pretrain", "--overlay", OVERLAYS, "--world-size", "8", *SETS]
    assert main([*base, "--only", "env"]) == 0
    assert shlex.split(capsys.readouterr().out) == ["--env", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"]
    assert main([*base, "--only", "overrides"]) == 0
    words = shlex.split(capsys.readouterr().out)
    assert words[0] == "train.micro_batch_size=2" and not any(w.startswith("-") for w in words)
    code = main(["args", "--recipe", "llama3_8b_pretrain", "--overlay", "cpu_offload",
                 "--set", "model.pipeline_model_parallel_size=2", "--world-size", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["ok"] is False and out["exit_code"] == 1 and "launcher" not in out


# ----------------------------------------------------------------------------- issue 31: the three new overlays
@pytest.mark.bridge
def test_fsdp_and_fine_grained_offload_words_equal_apply_overlay(bridge, capsys):
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from mbmem_overlays import apply_overlay
    code, out = _args_json(capsys, "--recipe", "llama3_8b_pretrain", "--overlay", "fsdp,offload_modules",
                           "--world-size", "8", "--param", "fine_grained_offload.modules=[core_attn,attn_proj]")
    assert code == 0, out
    launcher = out["launcher"]
    assert launcher["env"]["NVTE_CPU_OFFLOAD_V1"] == "1"  # the environment Bridge needs with TE >= 2.10
    assert "checkpoint.ckpt_format=fsdp_dtensor" in launcher["overrides"]
    assert "ddp.data_parallel_sharding_strategy=optim_grads_params" in launcher["overrides"]
    by_bridge = bridge.load_recipe("llama3_8b_pretrain")
    process_config_with_overrides(by_bridge, cli_overrides=launcher["overrides"])
    by_api = bridge.load_recipe("llama3_8b_pretrain")
    apply_overlay(by_api, ["megatron_fsdp", "fine_grained_offload"], env={}, world_size=8, validate=True,
                  params={"fine_grained_offload.modules": ["core_attn", "attn_proj"]})
    assert snapshot(by_bridge) == snapshot(by_api)


@pytest.mark.bridge
def test_precision_aware_optimizer_dtypes_are_words_bridge_reads_back(bridge, capsys):
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from mbmem_overlays import apply_overlay
    code, out = _args_json(capsys, "--recipe", "llama3_8b_pretrain", "--overlay", "bf16_moments", "--world-size", "8")
    assert code in (0, 3), out  # 3: TE's FusedAdam cannot be checked on a host without TE (docs/exit-codes.md)
    overrides = out["launcher"]["overrides"]
    assert "optimizer.exp_avg_dtype=bfloat16" in overrides and "optimizer.exp_avg_sq_dtype=bfloat16" in overrides
    by_bridge = bridge.load_recipe("llama3_8b_pretrain")
    process_config_with_overrides(by_bridge, cli_overrides=overrides)
    by_api = bridge.load_recipe("llama3_8b_pretrain")
    apply_overlay(by_api, ["precision_aware_optimizer"], env={}, world_size=8)
    assert snapshot(by_bridge) == snapshot(by_api)
