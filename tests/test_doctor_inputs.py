"""The doctor's side of issue 22, each test failing on the code before it: inputs that are not regular files
never block (#6), printed commands and hints are validated and shell-quoted (#2b) and carry where user
overlays live (#2a), text from a log is escaped (#9), and --plot writes only through core/outfile.py (#5).
Plus issue 23's bad inputs: binary, damaged gzip, fifos and devices are a clear exit 2, never a traceback."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import mbmem, shell_invocations

RUNS = Path(__file__).parent / "fixtures" / "runs"
DOCTOR = Path(__file__).parent / "fixtures" / "doctor"
OOM = ("[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB. GPU 0 has a total capacity of "
       "79.11 GiB of which 1.05 GiB is free. Of the allocated memory 76.80 GiB is allocated by PyTorch, and 1.12 GiB is "
       "reserved by PyTorch but unallocated.")


def write(tmp_path: Path, name: str, *lines: str) -> str:
    p = tmp_path / name
    p.write_text("\n".join(lines) + "\n")
    return str(p)


# ----------------------------------------------------------------------------- #6 no blocking on non-regular paths
def test_a_fifo_is_skipped_and_the_good_file_beside_it_is_read(tmp_path):
    fifo = tmp_path / "pipe.log"
    os.mkfifo(fifo)
    good = write(tmp_path, "good.log", OOM)
    out = mbmem("doctor", str(fifo), good, timeout=60)            # the old code blocked here forever
    assert out.returncode == 0 and "genuine capacity limit" in out.stdout
    assert f"{fifo}: is a fifo (named pipe), not a log file; skipped" in out.stdout


def test_a_glob_matching_a_fifo_and_a_folder(tmp_path):
    os.mkfifo(tmp_path / "b.log")
    (tmp_path / "c.log").mkdir()
    write(tmp_path, "a.log", OOM)
    out = mbmem("doctor", str(tmp_path / "*.log"), "--json", timeout=60)
    data = json.loads(out.stdout)
    assert out.returncode == 0 and data["kind"] == "capacity"
    assert any("is a fifo" in p for p in data["problems"]) and any("is a folder" in p for p in data["problems"])


@pytest.mark.parametrize("path, kind", [("/dev/zero", "a device"), ("FIFO", "a fifo"), ("DIR", "a folder")])
def test_only_non_regular_inputs_exit_2(tmp_path, path, kind):
    if path == "FIFO":
        path = str(tmp_path / "f")
        os.mkfifo(path)
    elif path == "DIR":
        path = str(tmp_path)
    out = mbmem("doctor", path, "--json", timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    data = json.loads(out.stdout)
    assert data["kind"] == "unreadable" and any(f"is {kind}" in p for p in data["problems"])


def test_stdin_is_still_read():
    out = subprocess.run([os.sys.executable, "-m", "mbmem_overlays.cli", "doctor", "-"], input=OOM.encode(),
                         capture_output=True, timeout=60, check=False)
    assert out.returncode == 0 and b"genuine capacity limit" in out.stdout


# ----------------------------------------------------------------------------- issue 23: bad input, exit 2
def test_binary_and_damaged_gzip_exit_2(tmp_path):
    binary = tmp_path / "core.bin"
    binary.write_bytes(bytes(range(256)) * 64)
    out = mbmem("doctor", str(binary))
    assert out.returncode == 2 and "binary" in out.stdout and "Traceback" not in out.stderr
    good = gzip.compress(b"".join(b"[rank%d]: iteration %d loss %d\n" % (i % 8, i, i * 7919) for i in range(40000)))
    damaged = tmp_path / "job.log.gz"
    damaged.write_bytes(good[:20] + b"\xff" * 16 + good[36:])
    out = mbmem("doctor", str(damaged))
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stdout    # nothing can be ruled out
    assert "could not be read" in out.stdout


# ----------------------------------------------------------------------------- #2b validated, quoted values
def test_recipe_option_is_validated_before_anything(tmp_path):
    marker = tmp_path / "PWNED"
    log = write(tmp_path, "a.log", OOM)
    out = mbmem("doctor", log, "--recipe", f"x;touch {marker};#", "--json")
    assert out.returncode == 2 and "not a recipe function name" in out.stdout + out.stderr
    assert json.loads(out.stdout)["ok"] is False and not marker.exists()


@pytest.mark.parametrize("argv, option", [(["--world-size", "10" * 20], "--world-size"), (["--margin", "2"], "--margin"),
                                          (["--gpu-memory", "lots"], "--gpu-memory"), (["--set", "no-equals"], "no-equals")])
def test_bad_options_are_usage_errors(tmp_path, argv, option):
    out = mbmem("doctor", write(tmp_path, "a.log", OOM), *argv)
    assert out.returncode == 2 and option in out.stderr and "Traceback" not in out.stderr


def test_the_recommend_hint_is_quoted(tmp_path):
    """The hint's placeholders (<N>) were printed bare: pasted, the shell read them as redirections."""
    log = write(tmp_path, "a.log", "torchrun --nproc_per_node=8 train.py recipe=llama3_8b_pretrain", OOM)
    out = mbmem("doctor", log)
    hint = re.search(r"`(mbmem recommend [^`]+)`", out.stdout).group(1)
    (call,) = shell_invocations(hint, cwd=tmp_path)
    assert call[1] == ["mbmem", "recommend", "--recipe", "llama3_8b_pretrain", "--world-size", "8", "--gpu-memory",
                       "79.11GiB"]
    out = mbmem("doctor", write(tmp_path, "b.log", OOM), "--recipe", "llama3_8b_pretrain")
    hint = re.search(r"`(mbmem recommend [^`]+)`", out.stdout).group(1)
    (call,) = shell_invocations(hint, cwd=tmp_path)
    assert call[1][-4:] == ["--world-size", "<N>", "--gpu-memory", "79.11GiB"]


def test_commands_rebuilt_from_a_hostile_log_stay_words(tmp_path):
    marker = tmp_path / "M"
    log = write(tmp_path, "a.log", f"python train.py recipe=llama3_8b_pretrain 'model.x=$(touch {marker})' "
                                   f"'train.y=`touch {marker}`'", OOM)
    cmd = json.loads(mbmem("doctor", log, "--json").stdout)["next_command"]
    (call,) = shell_invocations(cmd, cwd=tmp_path)
    assert call[1][:3] == ["python", "train.py", "recipe=llama3_8b_pretrain"]
    assert f"model.x=$(touch {marker})" in call[1] and not marker.exists()


def test_a_launch_command_with_a_bad_recipe_is_not_reused(tmp_path):
    log = write(tmp_path, "a.log", "python train.py 'recipe=os.system' +mem=dist_optimizer", OOM)
    out = mbmem("doctor", log, "--json")
    data = json.loads(out.stdout)
    assert "os.system" not in (data["next_command"] or "")
    assert any("is not reused" in p for p in data["problems"])


# ----------------------------------------------------------------------------- #2a user overlays travel along
def user_overlay(tmp_path: Path) -> Path:
    d = tmp_path / "overlays"
    (d / "mem").mkdir(parents=True)
    (d / "mem" / "my_nccl.yaml").write_text(
        "# @package mem.my_nccl\noverlay:\n  summary: larger NCCL buffers\n  env:\n    NCCL_BUFFSIZE: '8388608'\n")
    return d


@pytest.mark.parametrize("how", ["option", "env"])
def test_printed_commands_carry_the_user_overlay_dir(tmp_path, how):
    d = user_overlay(tmp_path)
    log = write(tmp_path, "a.log", "torchrun --nproc_per_node=8 train.py recipe=llama3_8b_pretrain +mem=my_nccl", OOM)
    if how == "option":
        out = mbmem("--overlay-dir", str(d), "doctor", log, "--json")
    else:
        out = mbmem("doctor", log, "--json", env={"MBMEM_OVERLAY_DIRS": str(d)})
    data = json.loads(out.stdout)
    assert data["next_command"].startswith(f"MBMEM_OVERLAY_DIRS={d.resolve()} torchrun ")
    assert "'+mem=[my_nccl,selective_recompute]'" in data["next_command"]
    assert not data["command_check"].startswith("NOT VALID")          # the catalogue found the user overlay


def test_builtin_overlays_need_no_dir(tmp_path):
    d = user_overlay(tmp_path)
    log = write(tmp_path, "a.log", "torchrun --nproc_per_node=8 train.py recipe=llama3_8b_pretrain", OOM)
    data = json.loads(mbmem("--overlay-dir", str(d), "doctor", log, "--json").stdout)
    assert not data["next_command"].startswith("MBMEM_OVERLAY_DIRS")


# ----------------------------------------------------------------------------- #9 escaped output
def test_control_and_bidi_characters_from_the_log_are_escaped(tmp_path):
    p = tmp_path / "a.log"
    p.write_text("python train.py recipe=llama3_8b_pretrain\x1b]0;owned\x07 \u202etxt.exe\n"
                 "[rank0]: ValueError: Currently there is no support for Pipeline parallelism with CPU offloading"
                 " \x1b[2J\u202e\n" + OOM + "\n")
    assert not any(c in mbmem("doctor", str(p)).stdout for c in "\x1b\u202e\x07")
    out = mbmem("doctor", str(p), "-v")   # with the evidence lines, which quote the log
    assert "\x1b" not in out.stdout and "\u202e" not in out.stdout and "\x07" not in out.stdout
    assert "\\x1b" in out.stdout and "\\u202e" in out.stdout
    data = json.loads(mbmem("doctor", str(p), "--json").stdout)
    assert "recipe=llama3_8b_pretrain\x1b" not in (data["next_command"] or "")   # not reused: refused, not pasted


# ----------------------------------------------------------------------------- #5 --plot through the one writer
@pytest.fixture
def run_log() -> str:
    return str(RUNS / "megatron_lm_tp4_pp2.log")


def test_plot_never_writes_through_a_link(tmp_path, run_log):
    target = tmp_path / "target.png"
    target.write_bytes(b"keep")
    link = tmp_path / "link.png"
    link.symlink_to(target)
    for extra in ([], ["--force"]):
        out = mbmem("doctor", run_log, "--plot", str(link), *extra)
        assert out.returncode == 2 and "symbolic link" in out.stderr
        assert target.read_bytes() == b"keep"


@pytest.mark.parametrize("kind", ["fifo", "folder", "suffix", "missing_folder"])
def test_plot_refuses_what_is_not_a_new_regular_file(tmp_path, run_log, kind):
    path = {"fifo": tmp_path / "p.png", "folder": tmp_path / "d.png", "suffix": tmp_path / "p.gif",
            "missing_folder": tmp_path / "nope" / "p.png"}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    if kind == "folder":
        path.mkdir()
    out = mbmem("doctor", run_log, "--plot", str(path), "--force", timeout=60)
    assert out.returncode == 2 and "--plot" in out.stderr and "Traceback" not in out.stderr


def test_plot_path_is_checked_before_any_input_is_read(tmp_path):
    out = mbmem("doctor", str(tmp_path / "missing.log"), "--plot", str(tmp_path / "x.gif"), "--json")
    assert out.returncode == 2 and "cannot read" not in out.stdout and "--plot" in out.stdout


def test_plot_without_matplotlib_is_a_clear_usage_error(tmp_path, run_log, monkeypatch, capsys):
    import importlib.util

    from mbmem_overlays.cli import main
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None if name == "matplotlib" else real(name, *a, **k))
    assert main(["doctor", run_log, "--plot", str(tmp_path / "p.png")]) == 2
    assert "pip install 'mbmem-overlays[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()
