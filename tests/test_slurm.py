"""mbmem slurm: rendering, quoting, shellcheck, -o, option errors, and real jobs on a one-node Slurm."""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import sys

import pytest

from mbmem_overlays import OverlayError
from mbmem_overlays.launch import slurm as slurm_mod
from mbmem_overlays.launch.slurm import render

from conftest import mbmem, run_cmd

HOSTILE = ["x; rm -rf ~", "$(id)", "`id`", "a'b\"c", "${HOME}", "x && touch /tmp/mbmem-pwned", "x|id", "* ?"]
# Template syntax inside values (issue 15 #1): the old renderer expanded {{KEY}} found inside an earlier value.
TEMPLATE_SYNTAX = ["{{SRUN_EXTRA}}", "{{ workdir | q }}", "{% if true %}x{% endif %}", "{{TRAIN_ARGS}}", "{# c #}"]


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


def _stub_bin(tmp_path):
    """srun prints its arguments, then runs the task command (everything after its own options) the way a
    node would; scontrol names one node; a fake python prints what it was asked to run."""
    stub = tmp_path / "bin"
    stub.mkdir(exist_ok=True)
    (stub / "srun").write_text('#!/bin/bash\nprintf "SRUN<%s>\\n" "$@"\n'
                               'while [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (stub / "scontrol").write_text("#!/bin/bash\necho node0\n")
    (stub / "fakepython").write_text('#!/bin/bash\nprintf "PY<%s>\\n" "$@"\n'
                                     'echo "PY_ENV PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-}"\n'
                                     'echo "PY_ENV PYTHONPATH=${PYTHONPATH:-}"\n')
    shutil.copy(stub / "fakepython", stub / "python")  # a container's default `python`: never the real one here
    for f in stub.iterdir():
        f.chmod(0o755)
    return stub


def _run_script(path, tmp_path, nodes="2", **extra_env):
    stub = _stub_bin(tmp_path)
    env = {**os.environ, "PATH": f"{stub}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node0", "SLURM_JOB_ID": "7",
           "SLURM_JOB_NUM_NODES": nodes, "SLURM_NODEID": "0", "SLURM_CPUS_ON_NODE": "4", **extra_env}
    env.pop("PYTHONPATH", None)
    return subprocess.run(["bash", str(path)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=30)


# ----------------------------------------------------------------------------- the template
def test_script_shape(tmp_path):
    text = _render(partition="batch", account="proj", time="01:00:00", container_image="/images/nemo.sqsh",
                   container_mounts="/data:/data", cpus_per_task=32, workdir="/lustre/me/mbmem")
    for needle in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8",
                   "#SBATCH --cpus-per-task=32", "#SBATCH --exclusive", "MBMEM_NPROC_PER_NODE=8",
                   "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "export CUDA_DEVICE_MAX_CONNECTIONS=1",
                   '--nnodes="$SLURM_JOB_NUM_NODES" --node_rank="$SLURM_NODEID"', "--master_addr=\"$MASTER_ADDR\"",
                   "'+mem=[expandable_segments]'", "--container-image=/images/nemo.sqsh",
                   # the repository mounted at the same path, and the container's workdir
                   "--container-mounts=/lustre/me/mbmem:/lustre/me/mbmem,/data:/data",
                   "--container-workdir=/lustre/me/mbmem", "--no-container-mount-home",
                   'export PYTHONPATH="$MBMEM_WORKDIR/src${PYTHONPATH:+:$PYTHONPATH}"'):
        assert needle in text, needle
    container_env = next(line for line in text.splitlines() if "--container-env=" in line).split("=", 1)[1]
    assert {"PYTORCH_CUDA_ALLOC_CONF", "CUDA_DEVICE_MAX_CONNECTIONS", "MBMEM_WORKDIR", "MASTER_ADDR"} <= set(
        container_env.split(","))
    p = tmp_path / "job.sh"
    p.write_text(text)
    _lint(p)


def test_a_mount_the_user_gives_for_the_workdir_replaces_the_default():
    text = _render(container_image="img.sqsh", container_mounts="/lustre/me/mbmem:/work,/data", workdir="/work")
    assert "--container-mounts=/lustre/me/mbmem:/work,/data\n" in text


def test_cpu_smoke_drops_gpu_directives():
    text = _render(cpu_smoke=True)
    assert "--gpus-per-node" not in text and "--exclusive" not in text and "--container" not in text
    assert "run.dry_run=true" in text and "run.world_size=16" in text and "MBMEM_NPROC_PER_NODE=1" in text


def test_every_value_in_the_template_is_quoted_or_checked():
    import jinja2
    from jinja2 import nodes
    source = slurm_mod.TEMPLATE.read_text()
    tree = jinja2.Environment().parse(source)
    outputs = [n for out in tree.find_all(nodes.Output) for n in out.nodes if not isinstance(n, nodes.TemplateData)]
    assert outputs
    for expr in outputs:
        assert isinstance(expr, nodes.Filter) and expr.name in ("q", "sbatch", "envname"), expr
    # and a bare {{ value }} cannot slip in later: rendering refuses it
    env = slurm_mod.template_environment()
    with pytest.raises(slurm_mod.UnsafeValue, match="neither quoted"):
        env.from_string("echo {{ value }}").render(value="$(id)")
    assert env.from_string("echo {{ value | q }}").render(value="$(id)") == "echo '$(id)'"
    with pytest.raises(jinja2.UndefinedError):
        env.from_string("echo {{ missing | q }}").render()


# ----------------------------------------------------------------------------- hostile values
@pytest.mark.parametrize("value", HOSTILE + TEMPLATE_SYNTAX)
def test_hostile_values_in_shell_words_stay_literal(tmp_path, value):
    marker = tmp_path / "pwned"
    payload = f"{value} $(touch {marker}) `touch {marker}`"
    text = _render(sets=[f"train.exit_signal_handler_name={payload}", f"model.x={payload} ; touch {marker}"],
                   container_image=payload, container_mounts=payload, python=payload, workdir=payload)
    for word in (f"train.exit_signal_handler_name={payload}", payload):
        assert shlex.quote(word) in text  # inserted once, as one quoted word, never expanded
    p = tmp_path / "job.sh"
    p.write_text(text)
    _lint(p)
    out = _run_script(p, tmp_path)
    assert f"SRUN<--container-image={payload}>" in out.stdout, out.stdout + out.stderr
    assert out.returncode == 1  # the task's cd into the (hostile, nonexistent) workdir fails; nothing else ran
    assert not marker.exists() and not os.path.exists("/tmp/mbmem-pwned")


@pytest.mark.parametrize("value", HOSTILE + TEMPLATE_SYNTAX)
def test_training_arguments_reach_python_as_single_words(tmp_path, value):
    marker = tmp_path / "pwned"
    payload = f"{value} $(touch {marker})"
    text = _render(sets=[f"model.x={payload}"], workdir=str(tmp_path), python=str(tmp_path / "bin" / "fakepython"),
                   cpu_smoke=True, nodes=1)
    p = tmp_path / "job.sh"
    p.write_text(text)
    out = _run_script(p, tmp_path, nodes="1")
    assert out.returncode == 0, out.stderr
    assert f"PY<model.x={payload}>" in out.stdout and "PY<train.py>" in out.stdout
    assert "PY_ENV PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in out.stdout  # exported before the process
    assert not marker.exists()


def test_the_script_refuses_an_allocation_it_was_not_validated_for(tmp_path):
    p = tmp_path / "job.sh"
    p.write_text(_render(nodes=2, gpus_per_node=8))
    out = _run_script(p, tmp_path, nodes="3")
    assert out.returncode == 2 and "validated for 2 node(s) x 8 GPU(s)" in out.stderr and "SRUN<" not in out.stdout
    out = _run_script(p, tmp_path, nodes="2", SLURM_GPUS_ON_NODE="4")
    assert out.returncode == 2 and "--gpus-per-node 4" in out.stderr


@pytest.mark.parametrize("field", ["partition", "account", "time", "job_name", "output"])
@pytest.mark.parametrize("value", ["x; rm -rf ~", "$(id)", "a b", "x\n#SBATCH --nodes=99", "x\n", "{{SRUN_EXTRA}}"])
def test_hostile_values_in_sbatch_lines_are_rejected(field, value):
    with pytest.raises(OverlayError, match="sbatch would misread"):
        _render(**{field: value})


def test_newlines_are_rejected_everywhere():
    with pytest.raises(OverlayError, match="newline"):
        _render(sets=["model.x=1\nrm -rf ~"])
    with pytest.raises(OverlayError, match="newline"):
        _render(workdir="/a\n/b")


@pytest.mark.parametrize("name", ["X=1; touch /tmp/pwned #", "my.var", "1X", "A B", "$(id)", ""])
def test_environment_names_are_checked_by_the_renderer(name):
    with pytest.raises(OverlayError) as err:
        _render(env={name: "1"})
    assert "not a valid environment variable name" in str(err.value) and repr(name) in str(err.value)


def test_overlay_environment_names_name_the_overlay(tmp_path):
    from mbmem_overlays.core.catalog import Catalog, OverlaySpec
    catalog = Catalog()
    # A spec as a catalogue that forgot to check names would hold it (the renderer must not rely on that check).
    catalog._add(OverlaySpec(name="evil", path=tmp_path / "evil.yaml", summary="", aliases=(), params={}, set={},
                             env={"X=1; touch /tmp/pwned #": "1"}, sources=(), effect="", builtin=False))
    problems = slurm_mod.overlay_env_problems(["expandable_segments", "evil"], catalog)
    assert len(problems) == 1 and problems[0].overlays == ("evil",)
    assert "X=1; touch /tmp/pwned #" in problems[0].render() and "evil.yaml" in problems[0].fix


def test_cli_refuses_a_user_overlay_with_a_bad_variable_name(tmp_path):
    marker = tmp_path / "pwned"
    (tmp_path / "mine" / "mem").mkdir(parents=True)
    (tmp_path / "mine" / "mem" / "evil.yaml").write_text(
        "# @package mem.evil\noverlay:\n  summary: evil\n"
        f"  env: {{'X=1; touch {marker} #': '1'}}\n")
    out = mbmem("--overlay-dir", str(tmp_path / "mine"), "slurm", "--recipe", "llama3_8b_pretrain", "--overlay", "evil",
                "--nodes", "1", "--gpus-per-node", "8", "--no-validate", "-o", str(tmp_path / "job.sh"))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "evil" in out.stderr and f"X=1; touch {marker} #" in out.stderr
    assert not (tmp_path / "job.sh").exists() and not marker.exists() and out.stdout == ""


# ----------------------------------------------------------------------------- the command line
def _slurm_cli(*extra, o=None):
    args = ["slurm", "--recipe", "llama3_8b_pretrain", "--overlay", "expandable,selective_recompute", "--nodes", "2",
            "--gpus-per-node", "8", "--no-validate", *extra]
    return mbmem(*args, *(["-o", str(o)] if o else []))


def test_cli_render_without_bridge(tmp_path):
    out = _slurm_cli(o=tmp_path / "job.sh")
    assert out.returncode == 0, out.stderr
    assert stat.S_IMODE((tmp_path / "job.sh").stat().st_mode) == 0o755
    _lint(tmp_path / "job.sh")


@pytest.mark.parametrize("how", [
    ["--workdir", "{{SRUN_EXTRA}}", "--container-image", "$(touch {m})"],
    ["--set", "model.x='{{SRUN_EXTRA}} $(touch {m})'", "--container-image", "{{TRAIN_ARGS}}"],  # Hydra quoting
    ["--python", "{{SRUN_EXTRA}}", "--container-image", "`touch {m}`", "--container-mounts", "{{WORKDIR}}"],
])
def test_cli_template_syntax_and_commands_in_values_stay_literal(tmp_path, how):
    marker = tmp_path / "x"
    how = [a.replace("{m}", str(marker)) for a in how]
    out = _slurm_cli(*how, o=tmp_path / "job.sh")
    assert out.returncode == 0, out.stderr
    text = (tmp_path / "job.sh").read_text()
    for value in how[1::2]:
        assert shlex.quote(value) in text or shlex.quote(f"--container-image={value}") in text or value in text
    assert "--ntasks-per-node=1\n" in text  # the srun options are the template's, not a value's
    _lint(tmp_path / "job.sh")
    ran = _run_script(tmp_path / "job.sh", tmp_path)
    assert "SRUN<--ntasks-per-node=1>" in ran.stdout, ran.stderr
    assert not marker.exists()


def test_cli_refuses_template_syntax_as_a_recipe(tmp_path):
    marker = tmp_path / "x"
    out = mbmem("slurm", "--recipe", f"{{{{SRUN_EXTRA}}}}$(touch {marker})", "--nodes", "1", "--gpus-per-node", "8",
                "--no-validate", "-o", str(tmp_path / "job.sh"))
    assert out.returncode == 2 and "--recipe" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "job.sh").exists() and not marker.exists()


def test_every_option_problem_is_reported_at_once(tmp_path):
    out = mbmem("slurm", "--recipe", "llama3_8b_pretrain", "--overlay", "expandable,no_such_overlay", "--nodes", "0",
                "--gpus-per-node", "8", "--partition", "a b", "--time", "$(id)", "--output-log", "logs/%j/x.log",
                "--container-mounts", "/data", "--no-validate", "-o", "/nonexistent/job.sh")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    for needle in ("no_such_overlay", "--nodes", "--partition", "--time", "--output-log", "--container-mounts",
                   "/nonexistent"):
        assert needle in out.stderr, needle
    assert "7 problems found" in out.stderr


# ----------------------------------------------------------------------------- -o FILE
def test_o_into_a_missing_folder_is_a_clear_error():
    out = _slurm_cli(o="/nonexistent/job.sh")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "the folder '/nonexistent' does not exist" in out.stderr and "mkdir -p /nonexistent" in out.stderr


def _special_files(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "folder").mkdir()
    made = {"fifo": fifo, "folder": tmp_path / "folder"}
    try:
        os.mknod(tmp_path / "null", 0o600 | stat.S_IFCHR, os.makedev(1, 3))  # a character device, like /dev/null
        made["device"] = tmp_path / "null"
    except PermissionError:
        if os.environ.get("CI"):
            raise
    return made


def test_o_refuses_devices_fifos_folders_and_links(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    target.chmod(0o600)
    link = tmp_path / "link.sh"
    link.symlink_to(target)
    cases = {**_special_files(tmp_path), "link": link, "link to a device": tmp_path / "devlink"}
    (tmp_path / "devlink").symlink_to(cases.get("device", cases["fifo"]))
    names = sorted(p.name for p in tmp_path.iterdir())
    for kind, path in cases.items():
        before = os.lstat(path)
        out = _slurm_cli(o=path)
        assert out.returncode == 2 and "Traceback" not in out.stderr, (kind, out.stderr)
        after = os.lstat(path)
        assert (after.st_mode, after.st_ino) == (before.st_mode, before.st_ino), kind  # neither chmod nor replaced
    assert target.read_text() == "keep me" and stat.S_IMODE(target.stat().st_mode) == 0o600
    if "device" in cases:
        assert stat.S_IMODE(cases["device"].stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == names  # no temporary file left behind


def test_o_replaces_a_regular_file_only_with_force_and_atomically(tmp_path):
    target = tmp_path / "job.sh"
    target.write_text("old")
    target.chmod(0o600)
    twin = tmp_path / "twin"
    os.link(target, twin)  # a hard link sees in-place writes, not a rename
    out = _slurm_cli(o=target)  # -o writes a new file: an existing one is refused, untouched (issue 22 #5)
    assert out.returncode == 2 and "exists already" in out.stderr and "--force" in out.stderr, out.stderr
    assert target.read_text() == "old" and stat.S_IMODE(target.stat().st_mode) == 0o600
    out = _slurm_cli("--force", o=target)
    assert out.returncode == 0, out.stderr
    assert target.read_text().startswith("#!/bin/bash") and twin.read_text() == "old"
    assert stat.S_IMODE(target.stat().st_mode) == 0o755 and stat.S_IMODE(twin.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.sh", "twin"]  # no temporary file left


def test_output_log_is_absolute_and_its_folder_exists(tmp_path):
    out = run_cmd([sys.executable, "-m", "mbmem_overlays.cli", "slurm", "--recipe", "llama3_8b_pretrain", "--nodes",
                   "1", "--gpus-per-node", "8", "--no-validate", "--output-log", "logs/deep/%x_%j.log",
                   "-o", "job.sh"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    # relative to the folder you render in (sbatch would resolve it against wherever you submit from)
    assert f"#SBATCH --output={tmp_path}/logs/deep/%x_%j.log\n" in (tmp_path / "job.sh").read_text()
    assert (tmp_path / "logs" / "deep").is_dir()


@pytest.mark.parametrize("recipe", ["llama3_8b_peft", "llama3_8b_peft_config",
                                    "megatron.bridge.recipes.llama.llama3_8b_peft_config"])
def test_no_validate_still_refuses_peft_without_a_checkpoint(tmp_path, recipe):
    args = ["slurm", "--recipe", recipe, "--nodes", "1", "--gpus-per-node", "8", "--no-validate"]
    out = mbmem(*args, "-o", str(tmp_path / "job.sh"))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "--set checkpoint.pretrained_checkpoint=" in out.stderr and not (tmp_path / "job.sh").exists()
    out = mbmem(*args, "--set", "checkpoint.pretrained_checkpoint=/lustre/base", "-o", str(tmp_path / "job.sh"))
    assert out.returncode == 0, out.stderr
    out = mbmem("slurm", "--recipe", "llama3_8b_sft", "--nodes", "1", "--gpus-per-node", "8", "--no-validate")
    assert out.returncode == 0, out.stderr


# ----------------------------------------------------------------------------- validated renders (Bridge)
@pytest.mark.bridge
def test_cli_validates_before_writing(tmp_path):
    out = mbmem("slurm", "--recipe", "llama3_70b_pretrain_config", "--overlay", "cpu_offload", "--nodes", "4",
                "--gpus-per-node", "8", "-o", str(tmp_path / "job.sh"))
    assert out.returncode == 1 and "Pipeline parallelism" in out.stderr
    assert not (tmp_path / "job.sh").exists()


@pytest.mark.bridge
def test_peft_without_a_checkpoint_is_not_passed(tmp_path):
    out = mbmem("slurm", "--recipe", "llama3_8b_peft", "--overlay", "expandable_segments", "--nodes", "1",
                "--gpus-per-node", "8", "-o", str(tmp_path / "job.sh"))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "PASSED" not in out.stderr + out.stdout
    assert "PEFT requires a pretrained checkpoint" in out.stderr
    assert "--set 'checkpoint.pretrained_checkpoint=" in out.stderr  # the placeholder is shell-quoted (issue 33 #8)
    assert not (tmp_path / "job.sh").exists()
    checkpoint = tmp_path / "base_model"
    checkpoint.mkdir()
    out = mbmem("slurm", "--recipe", "llama3_8b_peft", "--overlay", "expandable_segments", "--nodes", "1",
                "--gpus-per-node", "8", "--set", f"checkpoint.pretrained_checkpoint={checkpoint}",
                "-o", str(tmp_path / "job.sh"))
    assert out.returncode == 0 and "PASSED" in out.stderr, out.stderr
    assert shlex.quote(f"checkpoint.pretrained_checkpoint={checkpoint}") in (tmp_path / "job.sh").read_text()


# ----------------------------------------------------------------------------- a real Slurm


PROCESS_ENV_PROBE = """#!{python}
# Stands in for `python` in the job: prints what the process srun started sees, then becomes python.
import os, sys
print("PROCESS_ENV PYTORCH_CUDA_ALLOC_CONF=" + os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "<unset>"), flush=True)
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


@pytest.mark.slurm
@pytest.mark.bridge
def test_real_sbatch_runs_the_plan_and_refuses_a_bad_set(cluster, tmp_path):
    good, bad = tmp_path / "good.sh", tmp_path / "bad.sh"
    probe = tmp_path / "probe"
    probe.write_text(PROCESS_ENV_PROBE.format(python=sys.executable))
    probe.chmod(0o755)
    log = tmp_path / "not-yet" / "logs" / "%x_%j.log"  # slurmd needs the folder: mbmem creates it at render time
    # validated at render time too (the job validates again): ~60 s of Bridge in total
    out = mbmem("slurm", "--recipe", "llama3_8b_pretrain", "--overlay", "expandable_segments,selective_recompute",
                "--nodes", "1", "--gpus-per-node", "2", "--cpu-smoke", "--cpus-per-task", "1", "--job-name", "good",
                "--python", str(probe), "--output-log", str(log), "-o", str(good), timeout=600)
    assert out.returncode == 0 and "validated for world size 2" in out.stderr, out.stderr
    assert (tmp_path / "not-yet" / "logs").is_dir()
    _lint(good)
    out = mbmem("slurm", "--recipe", "llama3_8b_pretrain", "--overlay", "cpu_offload,selective_recompute",
                "--nodes", "1", "--gpus-per-node", "2", "--cpu-smoke", "--no-validate", "-o", str(bad))
    assert out.returncode == 0, out.stderr
    jobs = {"good": cluster.submit(good, tmp_path, output=None), "bad": cluster.submit(bad, tmp_path)}
    states = {name: cluster.wait(job) for name, job in jobs.items()}
    good_log = (tmp_path / "not-yet" / "logs" / f"good_{jobs['good']}.log").read_text()
    bad_log = (tmp_path / f"slurm-{jobs['bad']}.out").read_text()
    assert states["good"] == "COMPLETED", good_log[-4000:]
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in good_log          # exported by the script
    assert "PROCESS_ENV PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in good_log  # seen by the process
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1" in good_log
    assert "validation: PASSED" in good_log and "world size 2" in good_log           # train.py's plan and verdict
    assert "[selective_recompute] model.recompute_granularity" in good_log and "dry run" in good_log  # the plan
    assert states["bad"] == "FAILED", bad_log[-4000:]
    assert "CPU offloading does not work when activation recomputation is enabled" in bad_log


@pytest.mark.bridge
def test_megatron_fsdp_job_leaves_cuda_device_max_connections_unset():
    # Bridge refuses FSDP with CUDA_DEVICE_MAX_CONNECTIONS=1, which the field's standard environment sets
    out = mbmem("slurm", "--recipe", "llama3_8b_pretrain", "--overlay", "expandable_segments",
                "--set", "ddp.use_megatron_fsdp=true", "--set", "checkpoint.ckpt_format=fsdp_dtensor",
                "--nodes", "1", "--gpus-per-node", "2")
    assert out.returncode == 0, out.stderr
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in out.stdout and "export PYTORCH_CUDA_ALLOC_CONF" in out.stdout
    plain = mbmem("slurm", "--recipe", "llama3_8b_pretrain", "--nodes", "1", "--gpus-per-node", "2", "--no-validate")
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in plain.stdout


def test_no_validate_carries_the_new_overlays_environment(tmp_path):
    # +mem=megatron_fsdp: Bridge refuses the standard CUDA_DEVICE_MAX_CONNECTIONS=1, also without validation here;
    # +mem=fine_grained_offload: NVTE_CPU_OFFLOAD_V1=1 for Transformer Engine >= 2.10
    out = mbmem("slurm", "--recipe", "llama3_8b_pretrain", "--overlay", "fsdp,fine_grained_offload,bf16_moments",
                "--nodes", "1", "--gpus-per-node", "8", "--no-validate")
    assert out.returncode == 0, out.stderr
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in out.stdout and "export NVTE_CPU_OFFLOAD_V1=1" in out.stdout
    assert "+mem=[megatron_fsdp,fine_grained_offload,precision_aware_optimizer]" in out.stdout
    by_set = mbmem("slurm", "--recipe", "llama3_8b_pretrain", "--set", "ddp.use_megatron_fsdp=true", "--nodes", "1",
                   "--gpus-per-node", "8", "--no-validate")
    assert by_set.returncode == 0 and "CUDA_DEVICE_MAX_CONNECTIONS" not in by_set.stdout
    assert slurm_mod.standard_env(overlays=["dist_optimizer"])["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
