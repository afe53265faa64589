"""train.py: Hydra's Compose API and real subprocess runs."""

from __future__ import annotations

import json
import sys

import pytest
from hydra import compose, initialize_config_dir

from mbmem_overlays.launch.hydra_entry import hydra_argv, run, selected_overlays
from mbmem_overlays.core.catalog import Catalog

from conftest import ROOT, run_cmd, train

RECIPES = str(ROOT / "recipes")


def test_argv_rewrite():
    argv = ["train.py", "recipe=llama3_8b_peft", "+mem=lora_regather", "model.tensor_model_parallel_size=2",
            "mem.lora_regather.strict=false", "'+mem=[expandable,recompute]'".strip("'"), "run.dry_run=true",
            "hydra.run.dir=/tmp/x", "--cfg", "job"]
    out = hydra_argv(argv)
    assert out == ["train.py", "recipe=llama3_8b_peft", "+mem=lora_sp_regather",
                   "+bridge.model.tensor_model_parallel_size=2", "mem.lora_sp_regather.strict=false",
                   "+mem=[expandable_segments,selective_recompute]", "run.dry_run=true", "hydra.run.dir=/tmp/x",
                   "--cfg", "job"]


@pytest.mark.parametrize("order", [["cpu_offload", "selective_recompute"], ["selective_recompute", "cpu_offload"]])
def test_compose_keeps_every_selected_overlay(order):
    with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
        cfg = compose("train", overrides=["recipe=llama3_70b_pretrain", f"+mem=[{','.join(order)}]",
                                          "mem.selective_recompute.modules=[core_attn,mlp]"])
    from omegaconf import OmegaConf
    names, params = selected_overlays(OmegaConf.to_container(cfg)["mem"], Catalog())
    assert sorted(names) == ["cpu_offload", "selective_recompute"]
    assert params["selective_recompute"] == {"modules": ["core_attn", "mlp"]}
    assert params["cpu_offload"] == {"num_layers": 1, "double_buffering": False}


@pytest.mark.bridge
def test_compose_then_run_rejects_both_overlays(capsys):
    with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
        cfg = compose("train", overrides=["recipe=llama3_8b_pretrain", "+mem=[selective_recompute,cpu_offload]",
                                          "run.dry_run=true"])
    assert run(cfg) == 1
    err = capsys.readouterr().err
    assert "[cpu_offload + selective_recompute]" in err


@pytest.mark.bridge
def test_compose_then_run_plans(tmp_path, capsys):
    with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
        cfg = compose("train", overrides=["recipe=llama3_8b_sft", "+mem=[expandable_segments,dist_optimizer]",
                                          "run.dry_run=true", f"+run.record_dir={tmp_path}",
                                          "+bridge.train.train_iters=20"])
    assert run(cfg) == 0
    out = capsys.readouterr().out
    assert "validation: PASSED" in out
    assert (tmp_path / "mbmem_report.json").is_file() and (tmp_path / "bridge_config.yaml").is_file()
    assert "train_iters: 20" in (tmp_path / "bridge_config.yaml").read_text()


@pytest.mark.bridge
def test_run_plan_prints_the_memory_plan_and_json_stays_one_object(tmp_path, capsys):
    overrides = ["recipe=llama3_8b_sft", "+mem=[expandable_segments,selective_recompute]", "run.dry_run=true",
                 "run.plan=true", "run.gpu_memory=80GiB", f"+run.record_dir={tmp_path}"]
    with initialize_config_dir(config_dir=RECIPES, version_base="1.3"):
        text_cfg = compose("train", overrides=overrides)
        json_cfg = compose("train", overrides=overrides + ["run.json=true"])
    assert run(text_cfg) == 0
    out = capsys.readouterr().out
    assert "memory plan:" in out and "+ expandable_segments" in out and "+ selective_recompute" in out
    assert "capacity 80.0 GiB" in out
    assert run(json_cfg) == 0
    doc = json.loads(capsys.readouterr().out)  # the whole of stdout is one JSON object
    assert [s["name"] for s in doc["plan"]["steps"]] == ["baseline", "expandable_segments", "selective_recompute"]
    assert doc["plan"]["capacity_bytes"] == 80 * 2**30 and doc["plan"]["total_bytes"] > 0


@pytest.mark.bridge
@pytest.mark.parametrize("order", ["[cpu_offload,selective_recompute]", "[selective_recompute,cpu_offload]"])
def test_train_rejects_both_overlays_in_either_order(order, tmp_path):
    out = train("recipe=llama3_70b_pretrain", f"+mem={order}", env={"MBMEM_RUNS_DIR": str(tmp_path)})
    assert out.returncode != 0
    assert "cpu_offload" in out.stderr and "selective_recompute" in out.stderr
    assert "Pipeline parallelism with CPU offloading" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.bridge
def test_train_lora_regather_plan(tmp_path):
    base = ["recipe=llama3_8b_peft", "+mem=lora_regather", "run.dry_run=true"]
    env = {"MBMEM_RUNS_DIR": str(tmp_path)}
    out = train(*base, "model.tensor_model_parallel_size=2", "model.sequence_parallel=true", env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "peft.sequence_parallel_input_regather: False -> True" in out.stdout
    assert "2 of 4 target modules will re-gather" in out.stdout and "linear_qkv: re-gathers" in out.stdout
    out = train(*base, env=env)
    assert out.returncode != 0
    assert "no LoRA adapter will re-gather" in out.stderr and "model.tensor_model_parallel_size=2" in out.stderr
    assert not any(ROOT.glob("outputs")), "Hydra littered the working tree"


@pytest.mark.bridge
def test_train_misspellings_say_what_to_type(tmp_path):
    env = {"MBMEM_RUNS_DIR": str(tmp_path)}
    out = train("recipe=llama3_8b_pretrain", "+mem=selective_recompte", env=env)
    # answered before Hydra, as `mbmem apply` answers it (issue 22 #4): exit 2, the close match named
    assert out.returncode == 2 and "unknown overlay 'selective_recompte'" in out.stderr
    assert "Did you mean 'selective_recompute'" in out.stderr
    out = train("recipe=llama3_8b_pretrain", "+mem=selective_recompute", "mem.selective_recompute.modules_=[mlp]",
                "model.tensor_model_parall_size=2", env=env)
    assert out.returncode != 0
    assert "did you mean 'modules'" in out.stderr or "modules_" in out.stderr
    out = train("recipe=llama3_8b_pretrain", "model.tensor_model_parall_size=2", env=env)
    assert out.returncode != 0 and "Did you mean model.tensor_model_parallel_size" in out.stderr


def test_foreign_hydra_app_sees_the_mem_group(tmp_path):
    """Any Hydra app in an environment with mbmem-overlays installed can compose +mem=... (SearchPathPlugin)."""
    app = tmp_path / "app.py"
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text("lr: 0.1\n")
    app.write_text(
        "import hydra\nfrom omegaconf import OmegaConf\n"
        "@hydra.main(version_base='1.3', config_path='conf', config_name='config')\n"
        "def main(cfg):\n    print(OmegaConf.to_yaml(cfg.mem))\n"
        "if __name__ == '__main__':\n    main()\n")
    out = run_cmd([sys.executable, str(app), "+mem=[expandable_segments,cpu_offload]", "mem.cpu_offload.num_layers=3",
                   f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "cpu_offload:" in out.stdout and "num_layers: 3" in out.stdout and "expandable_segments:" in out.stdout


@pytest.mark.bridge
def test_user_overlay_from_hydra_search_path(tmp_path):
    (tmp_path / "mine" / "mem").mkdir(parents=True)
    (tmp_path / "mine" / "mem" / "small_batch.yaml").write_text(
        "# @package mem.small_batch\nmbs: 1\noverlay:\n  summary: one sample per microbatch\n"
        "  set:\n    train.micro_batch_size: '@mbs'\n")
    out = train("recipe=llama3_8b_pretrain", f"hydra.searchpath=[file://{tmp_path / 'mine'}]", "+mem=small_batch",
                "mem.small_batch.mbs=2", "run.dry_run=true", env={"MBMEM_RUNS_DIR": str(tmp_path / "runs")})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[small_batch] train.micro_batch_size: 1 -> 2" in out.stdout
