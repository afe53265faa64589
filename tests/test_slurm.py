"""mbmem slurm: rendering, quoting, shellcheck, and real jobs on a one-node Slurm."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from mbmem_overlays import OverlayError
from mbmem_overlays.launch.slurm import render

from conftest import ROOT, mbmem
from slurm_cluster import Cluster, available

HOSTILE = ["x; rm -rf ~", "$(id)", "`id`", "a'b\"c", "${HOME}", "x && touch /tmp/mbmem-pwned", "x|id", "* ?"]


def _render(**kw):
    base = dict(recipe="llama3_8b_pretrain", overlays=["expandable_segments"], sets=[], nodes=2, gpus_per_node=8,
                env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    base.update(kw)
    return render(**base)


def _lint(path):
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    if shutil.which("shellcheck"):
        out = subprocess.run(["shellcheck", str(path)], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout
    elif os.environ.get("CI"):
        pytest.fail("shellcheck is not installed; .ci/run installs it from the OS packages")


def test_script_shape(tmp_path):
    text = _render(partition="batch", account="proj", time="01:00:00", container_image="/images/nemo.sqsh",
                   container_mounts="/data:/data")
    for needle in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                   "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "export CUDA_DEVICE_MAX_CONNECTIONS=1",
                   '--nnodes="$SLURM_JOB_NUM_NODES" --node_rank="$SLURM_NODEID"', "--master_addr=\"$MASTER_ADDR\"",
                   "'+mem=[expandable_segments]'", "--container-image=/images/nemo.sqsh"):
        assert needle in text, needle
    p = tmp_path / "job.sh"
    p.write_text(text)
    _lint(p)


def test_cpu_smoke_drops_gpu_directives():
    text = _render(cpu_smoke=True)
    assert "--gpus-per-node" not in text and "--exclusive" not in text
    assert "run.dry_run=true" in text and "run.world_size=16" in text and "NPROC_PER_NODE=1" in text


@pytest.mark.parametrize("value", HOSTILE)
def test_hostile_values_in_shell_words_stay_literal(tmp_path, value):
    marker = tmp_path / "pwned"
    text = _render(sets=[f"train.exit_signal_handler_name={value}", f"model.x={value} ; touch {marker}"],
                   container_image=value, container_mounts=value, python=value, workdir=value)
    p = tmp_path / "job.sh"
    p.write_text(text)
    _lint(p)
    # Evaluate everything the script would evaluate before srun, with srun and scontrol replaced by
    # printers: hostile values must arrive as literal words and run nothing.
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "srun").write_text('#!/bin/bash\nprintf "ARG<%s>\\n" "$@"\n')
    (stub / "scontrol").write_text("#!/bin/bash\necho node0\n")
    for f in stub.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node0", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NUM_NODES": "1"}
    out = subprocess.run(["bash", str(p)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=30)
    assert out.returncode == 0, out.stderr
    assert f"ARG<model.x={value} ; touch {marker}>" in out.stdout
    assert not marker.exists() and not os.path.exists("/tmp/mbmem-pwned")


@pytest.mark.parametrize("field", ["partition", "account", "time", "job_name", "output"])
@pytest.mark.parametrize("value", ["x; rm -rf ~", "$(id)", "a b", "x\n#SBATCH --nodes=99"])
def test_hostile_values_in_sbatch_lines_are_rejected(field, value):
    with pytest.raises(OverlayError, match="sbatch would misread"):
        _render(**{field: value})


def test_newlines_are_rejected_everywhere():
    with pytest.raises(OverlayError, match="newline"):
        _render(sets=["model.x=1\nrm -rf ~"])


def test_cli_render_without_bridge(tmp_path):
    out = mbmem("slurm", "--recipe", "llama3_8b_pretrain", "--overlay", "expandable,selective_recompute", "--nodes", "2",
                "--gpus-per-node", "8", "--no-validate", "-o", str(tmp_path / "job.sh"))
    assert out.returncode == 0, out.stderr
    _lint(tmp_path / "job.sh")


@pytest.mark.bridge
def test_cli_validates_before_writing(tmp_path):
    out = mbmem("slurm", "--recipe", "llama3_70b_pretrain_config", "--overlay", "cpu_offload", "--nodes", "4",
                "--gpus-per-node", "8", "-o", str(tmp_path / "job.sh"))
    assert out.returncode == 1 and "Pipeline parallelism" in out.stderr
    assert not (tmp_path / "job.sh").exists()


# ----------------------------------------------------------------------------- a real Slurm
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = available()
    if reason:
        if os.environ.get("CI"):
            pytest.fail(f"Slurm integration test cannot run in CI: {reason}")
        pytest.skip(reason)
    c = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.mark.slurm
@pytest.mark.bridge
def test_real_sbatch_runs_the_plan_and_refuses_a_bad_set(cluster, tmp_path):
    good, bad = tmp_path / "good.sh", tmp_path / "bad.sh"
    out = mbmem("slurm", "--recipe", "llama3_8b_pretrain", "--overlay", "expandable_segments,selective_recompute",
                "--nodes", "1", "--gpus-per-node", "2", "--cpu-smoke", "--no-validate", "-o", str(good))
    assert out.returncode == 0, out.stderr
    out = mbmem("slurm", "--recipe", "llama3_8b_pretrain", "--overlay", "cpu_offload,selective_recompute",
                "--nodes", "1", "--gpus-per-node", "2", "--cpu-smoke", "--no-validate", "-o", str(bad))
    assert out.returncode == 0, out.stderr
    jobs = {name: cluster.submit(path, tmp_path) for name, path in (("good", good), ("bad", bad))}
    states = {name: cluster.wait(job) for name, job in jobs.items()}
    good_log = (tmp_path / f"slurm-{jobs['good']}.out").read_text()
    bad_log = (tmp_path / f"slurm-{jobs['bad']}.out").read_text()
    assert states["good"] == "COMPLETED", good_log[-4000:]
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in good_log
    assert "validation: PASSED" in good_log and "world size 2" in good_log
    assert states["bad"] == "FAILED", bad_log[-4000:]
    assert "CPU offloading does not work when activation recomputation is enabled" in bad_log
