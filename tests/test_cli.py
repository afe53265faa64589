"""The acceptance commands of `mbmem apply`, as a user types them."""

import pytest

from conftest import mbmem

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
