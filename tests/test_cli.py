"""The acceptance commands of `mbmem apply`, as a user types them."""

import shlex

import pytest
from conftest import mbmem, paste

pytestmark = pytest.mark.bridge


def test_apply_rejects_cpu_offload_with_pp():
    out = mbmem("apply", "--recipe", "llama3_70b_pretrain_config", "--overlay", "cpu_offload",
                "--set", "model.pipeline_model_parallel_size=4", "--world-size", "32")
    assert out.returncode != 0
    assert "Pipeline parallelism" in out.stderr and "model.pipeline_model_parallel_size=1" in out.stderr
    assert "optimizer_offload" in out.stderr and "Traceback" not in out.stderr


def test_apply_accepts_and_prints_each_change():
    out = mbmem("apply", "--recipe", "llama3_70b_pretrain_config",
                "--overlay", "expandable_segments,selective_recompute,dist_optimizer", "--world-size", "32")
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[selective_recompute] model.recompute_granularity: None -> 'selective'" in out.stdout
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in out.stdout
    assert "validation: PASSED" in out.stdout and "not checkable here: model.apply_rope_fusion" in out.stdout


def test_apply_unknown_recipe_and_unknown_field():
    out = mbmem("apply", "--recipe", "llama3_8b_pretrian_config", "--overlay", "expandable_segments")
    assert out.returncode != 0 and "did you mean" in out.stderr and "llama3_8b_pretrain_config" in out.stderr
    out = mbmem("apply", "--recipe", "llama3_8b_pretrain_config", "--set", "model.num_layers=abc")
    assert out.returncode != 0 and "expects int" in out.stderr


def test_apply_prints_a_train_command_that_runs_as_printed(bridge, capsys, tmp_path):
    """The "next:" line of `mbmem apply` is a train.py command line; pasted (as a dry run) it passes too."""
    from mbmem_overlays.cli import main
    code = main(["apply", "--recipe", "llama3_8b_pretrain", "-O", "expandable,recompute", "--world-size", "8",
                 "--set", "model.tensor_model_parallel_size=2", "--set", "mem.selective_recompute.modules=[core_attn]"])
    out = capsys.readouterr().out
    assert code == 0, out[-2000:]
    command = out.split("next: ", 1)[1].splitlines()[0]
    argv = shlex.split(command)
    assert argv[:2] == ["python", "train.py"]
    done = paste(f"{command} run.dry_run=true", env={"MBMEM_RUNS_DIR": str(tmp_path), "MBMEM_QUIET": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[you] model.tensor_model_parallel_size: 1 -> 2" in done.stdout and "validation: PASSED" in done.stdout
    assert "[selective_recompute] model.recompute_modules" in done.stdout or "recompute_granularity" in done.stdout
