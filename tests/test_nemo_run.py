"""The NeMo-Run plugin (extra ``run``): same engine and verdicts as apply_overlay, the executor's environment,
refusal before submission, and a real submission through NeMo-Run's SlurmExecutor + LocalTunnel."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT, script, snapshot

if importlib.util.find_spec("nemo_run") is None:
    pytest.skip("the [run] extra (requirements/run.lock) is not installed", allow_module_level=True)
# isort: off
# nemo_run imports huggingface_hub: the plugin module must come first so the hub reads the offline HF configs
from mbmem_overlays.launch.nemo_run import MemoryOverlays
import nemo_run
# isort: on

JOB = ROOT / "examples" / "run_recipe_dry.py"
EXAMPLE = ROOT / "examples" / "nemo_run_launch.py"
RECIPE = "tiny_llama"  # TP1 PP1 CP1: valid for the one CPU task the Slurm job runs


@pytest.fixture
def nemorun_home(tmp_path):
    before = nemo_run.config.get_nemorun_home()
    nemo_run.config.set_nemorun_home(str(tmp_path / "nemo_run"))
    yield tmp_path / "nemo_run"
    nemo_run.config.set_nemorun_home(before)


def _script(*extra):
    return nemo_run.Script(path=str(JOB), entrypoint=sys.executable, args=["--recipe", RECIPE, *extra])


def test_import_of_the_module_alone_does_not_import_nemo_run():
    probe = ("import sys, mbmem_overlays.launch.nemo_run as m\nassert 'nemo_run' not in sys.modules\n"
             "m.MemoryOverlays\nassert 'nemo_run' in sys.modules\nprint('ok')")
    out = subprocess.run(check=False, args=[sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.bridge
def test_partial_task_config_gets_the_same_changes_as_apply_overlay(bridge):
    from mbmem_overlays import apply_overlay
    cfg, expected = bridge.load_recipe("llama3_8b_pretrain"), bridge.load_recipe("llama3_8b_pretrain")
    task = nemo_run.Partial(dict, config=cfg)
    executor = nemo_run.LocalExecutor(ntasks_per_node=8)
    plugin = MemoryOverlays(overlays=["cpu_offload", "expandable_segments"], params={"cpu_offload.num_layers": 2})
    plugin.setup(task, executor)
    report = apply_overlay(expected, ["cpu_offload", "expandable_segments"], env={},
                           params={"cpu_offload.num_layers": 2}, world_size=8, validate=True)
    assert report.field_changes and snapshot(task.config) == snapshot(expected)
    assert executor.env_vars["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert plugin.report.validation.world_size == 8  # from the executor: 1 node x 8 processes


@pytest.mark.bridge
def test_refusal_stops_the_launch_before_submission_with_apply_overlays_message(bridge, nemorun_home):
    from mbmem_overlays import OverlayError, apply_overlay
    executor = nemo_run.LocalExecutor()
    plugin = MemoryOverlays(overlays=["cpu_offload"], recipe=RECIPE)
    task = _script("model.pipeline_model_parallel_size=2")  # cpu_offload needs PP=1 (as mbmem apply)
    with pytest.raises(OverlayError) as info:
        nemo_run.run(task, executor=executor, plugins=[plugin], dryrun=True)
    cfg = bridge.load_recipe(RECIPE)
    bridge.apply_overrides(cfg, ["model.pipeline_model_parallel_size=2"])
    with pytest.raises(OverlayError) as direct:
        apply_overlay(cfg, ["cpu_offload"], env={}, world_size=1, validate=True,
                      locked={"model.pipeline_model_parallel_size": 2})
    assert str(info.value) == str(direct.value) and "cpu_offload" in str(info.value)
    assert executor.env_vars == {} and plugin.report is None
    assert not list(nemorun_home.rglob("*_sbatch.sh")) and not list(nemorun_home.rglob("log-*"))




@pytest.mark.slurm
@pytest.mark.bridge
def test_slurm_executor_submits_a_job_with_the_overlays(cluster, tmp_path):
    """examples/nemo_run_launch.py through SlurmExecutor + LocalTunnel to the real Slurm: the job imports the
    package and prints the plan it received (its overrides and its environment at start)."""
    env = {**os.environ, "SLURM_CONF": str(cluster.conf), "NEMORUN_HOME": str(tmp_path / "nrhome")}
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)  # only the launcher may set it
    # observed with NeMo-Run 0.11.1: NEMORUN_HOME=<tmp>/nemo_run with the launch run from <tmp> doubled the job
    # paths in the sbatch script (#SBATCH --output=<tmp>/<tmp>/...); another name and working folder do not
    jobs = tmp_path / "nrhome"
    work = tmp_path / "work"
    work.mkdir()
    out = subprocess.run(check=False, args=[sys.executable, str(EXAMPLE), "--executor", "slurm", "--account", "mbmem",
                          "--recipe", RECIPE, "--overlay", "expandable_segments,selective_recompute",
                          "--set", "train.micro_batch_size=2", "--plan-only"],
                         cwd=work, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    deadline, line = time.time() + 180, None
    while line is None and time.time() < deadline:  # NeMo-Run returns once sbatch has accepted the job
        logs = [p for p in jobs.rglob("log-*.out") if p.is_file()]
        text = "\n".join(p.read_text(errors="replace") for p in logs)
        line = next((ln for ln in text.splitlines() if "MBMEM_PLAN " in ln), None)
        time.sleep(0.5)
    assert line, f"no plan in the job's output: {logs} {text[-2000:]} {out.stdout[-2000:]}"
    plan = json.loads(line.split("MBMEM_PLAN ", 1)[1])
    assert plan["package"]  # the job imported mbmem_overlays
    assert plan["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"  # set by the launcher, before start
    assert plan["overrides"] == ["train.micro_batch_size=2", "model.recompute_granularity=selective",
                                 "model.recompute_modules=[core_attn]"]
    sbatch = "\n".join(p.read_text() for p in jobs.rglob("*.sh"))
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in sbatch


@pytest.mark.bridge
def test_example_refuses_before_submitting(bridge, tmp_path):
    out = script(EXAMPLE, "--recipe", RECIPE, "--overlay", "cpu_offload", "--set", "model.pipeline_model_parallel_size=2",
                 "--world-size", "2", env={"NEMORUN_HOME": str(tmp_path / "nemo_run")}, cwd=tmp_path, timeout=600)
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "not launched" in out.stderr and "cpu_offload" in out.stderr and "Traceback" not in out.stderr
    assert "MBMEM_PLAN" not in out.stdout


def test_offline_configs_are_found_when_nemo_run_was_imported_first(monkeypatch):
    """``import nemo_run`` imports huggingface_hub, which reads HF_HOME/HF_HUB_OFFLINE once: activating the offline
    configs afterwards re-points the imported hub, so the import order no longer matters."""
    import huggingface_hub.constants as hub
    from mbmem_overlays.bridge import hf_offline
    for name in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE"):
        monkeypatch.setattr(hub, name, getattr(hub, name))  # put back afterwards
    for var in ("HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(var, os.environ.get(var, ""))
    monkeypatch.setattr(hub, "HF_HUB_CACHE", "/nonexistent/huggingface/hub")
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", False)
    home = hf_offline.activate()
    assert hub.HF_HUB_CACHE == str(home / "hub") and hub.HF_HUB_OFFLINE is True and hub.HF_HOME == str(home)
    assert any((home / "hub").glob("models--*/snapshots/*/config.json"))


@pytest.mark.bridge
def test_plugin_carries_the_new_overlays_and_their_environment(bridge):
    import torch

    from mbmem_overlays import apply_overlay
    names = ["megatron_fsdp", "fine_grained_offload", "precision_aware_optimizer"]
    cfg, expected = bridge.load_recipe("llama3_8b_pretrain"), bridge.load_recipe("llama3_8b_pretrain")
    task = nemo_run.Partial(dict, config=cfg)
    executor = nemo_run.LocalExecutor(ntasks_per_node=8)
    plugin = MemoryOverlays(overlays=names)
    plugin.setup(task, executor)
    apply_overlay(expected, names, env={}, world_size=8, validate=True)
    assert snapshot(task.config) == snapshot(expected)
    assert task.config.ddp.use_megatron_fsdp and task.config.optimizer.exp_avg_dtype == torch.bfloat16
    assert executor.env_vars["NVTE_CPU_OFFLOAD_V1"] == "1"
    assert executor.env_vars.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1"
