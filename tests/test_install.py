"""Installing where users train (issue 32, docs/install.md): the wheel changes nothing of a supported stack, a light
install (no torch, megatron-core or Bridge) reads logs and snapshots and says in one line what the other commands
need, a Bridge / megatron-core pair that does not import is one line naming both versions (exit 69), a stack
outside the matrix is one note, and ``mbmem check-stack`` measures the rules on the installed stack.

.ci/run runs this file on each stack of the matrix (.venv, then .venv-0.6.0): each run checks the stack it runs on.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
from conftest import ROOT, mbmem, run_cmd

from mbmem_overlays.bridge import stack
from mbmem_overlays.core.rules.versions import SUPPORTED

STACK = ("torch", "megatron-core", "megatron-bridge")
# uv: scripts/env puts it in .venv; scripts/env_stack's venvs use that one
UV = next((p for p in (Path(sys.executable).with_name("uv"), ROOT / ".venv" / "bin" / "uv") if p.exists()),
          Path(shutil.which("uv") or "uv"))
EXIT_STACK = 69


def _env_script(which: str) -> Path:
    out = run_cmd([str(ROOT / "scripts" / "env_stack"), which], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return Path(out.stdout.strip().splitlines()[-1]).parent


# ----------------------------------------------------------------------------- versions, no Bridge needed
def test_the_matrix_and_the_note():
    supported = stack.Installed(*next(iter(SUPPORTED.items())), "2.14.1")
    assert supported.supported and stack.version_note(supported) is None
    outside = stack.Installed("0.5.1", "0.18.2", "2.9.0")
    note = stack.version_note(outside)
    assert not outside.supported and "\n" not in note
    assert "megatron-bridge 0.5.1 + megatron-core 0.18.2" in note
    assert all(f"Bridge {b} + megatron-core {c}" in note for b, c in SUPPORTED.items())
    # a supported Bridge with another megatron-core is outside too: the pair is what was checked
    assert not stack.Installed("0.6.2", "0.19.0", None).supported


def test_every_rule_names_the_versions_it_was_checked_against():
    from mbmem_overlays.core import rules
    for check in rules.CHECKS:
        assert check.versions.bridge and set(check.versions.bridge) <= set(SUPPORTED), check.id


def test_the_wheel_changes_nothing_of_the_installed_stack(tmp_path):
    """The built wheel (and its [stack] extra), installed into this environment, which holds a supported stack:
    uv's dry run lists what would change, and no torch, megatron-core or megatron-bridge is among it."""
    installed = stack.installed()
    assert installed.supported, f"run on a stack of the matrix, not {installed.describe()}"
    build = run_cmd([str(UV), "build", "--wheel", "-q", "-o", str(tmp_path), str(ROOT)], timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    wheel = next(tmp_path.glob("mbmem_overlays-*.whl"))
    for target in (str(wheel), f"{wheel}[stack]"):
        out = run_cmd([str(UV), "pip", "install", "--dry-run", "--python", sys.executable, target], timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        changes = [line for line in out.stderr.splitlines() if re.match(r"\s*[-+] ", line)]
        touched = {re.split(r"[=@ ]", line.strip()[2:], maxsplit=1)[0].lower() for line in changes}
        assert touched & set(STACK) == set(), f"{target} would change the stack: {changes}"
        assert touched <= {"mbmem-overlays"}, f"{target} would change more than the package: {changes}"


# ----------------------------------------------------------------------------- a light install
@pytest.fixture(scope="module")
def light():
    """.venv-light: the package with only its own requirements (scripts/env_stack light; seconds with uv's cache)."""
    return _env_script("light")


def test_the_light_install_holds_only_the_package_requirements(light):
    out = run_cmd([str(light / "python"), "-c", "import importlib.util as u; print([m for m in "
                   "('torch', 'megatron', 'transformers') if u.find_spec(m)])"])
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("argv", [
    ["list"], ["explain", "selective_recompute"],
    ["doctor", "tests/fixtures/runs/bridge_llama3_8b_tp2_pp2.log"],
    ["doctor", "tests/fixtures/snapshots/unwound_oom.pickle"],
    ["slurm", "--no-validate", "--recipe", "llama3_70b_sft", "--nodes", "2", "--gpus-per-node", "8",
     "--partition", "batch", "--time", "01:00:00", "-o", "{tmp}/job.sh"],
])
def test_light_install_reads_without_bridge(light, argv, tmp_path):
    out = run_cmd([str(light / "mbmem"), *(a.replace("{tmp}", str(tmp_path)) for a in argv)], timeout=120)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stdout.strip() or (tmp_path / "job.sh").read_text().startswith("#!")


@pytest.mark.parametrize("argv", [
    ["mbmem", "plan", "--recipe", "llama3_8b_pretrain", "--world-size", "8"],
    ["mbmem", "apply", "--recipe", "llama3_8b_pretrain", "--overlay", "selective_recompute", "--world-size", "8"],
    ["mbmem", "recommend", "--recipe", "llama3_8b_pretrain", "--world-size", "8", "--gpu-memory", "80GiB"],
    ["mbmem", "args", "--recipe", "llama3_8b_pretrain", "--overlay", "expandable_segments"],
    ["mbmem", "slurm", "--recipe", "llama3_70b_sft", "--nodes", "2", "--gpus-per-node", "8", "--partition", "b",
     "--time", "01:00:00", "-o", "job.sh"],
    ["mbmem", "check-stack", "--cases", "5"],
    ["train.py", "recipe=llama3_70b_sft", "+mem=[expandable_segments]", "run.dry_run=true"],
])
def test_light_install_says_in_one_line_what_to_install(light, argv, tmp_path):
    command = [str(light / "python"), str(ROOT / "train.py"), *argv[1:]] if argv[0] == "train.py" else \
        [str(light / "mbmem"), *argv[1:]]
    out = run_cmd(command, timeout=120, cwd=tmp_path)
    assert out.returncode == EXIT_STACK, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "torch, megatron-core, megatron-bridge are not installed" in lines[0] and "docs/install.md" in lines[0]
    if argv[1] in ("plan", "apply"):
        as_json = run_cmd([*command, "--json"], timeout=120, cwd=tmp_path)
        assert as_json.returncode == EXIT_STACK and json.loads(as_json.stdout)["exit_code"] == EXIT_STACK


# ----------------------------------------------------------------------------- other megatron-core releases
def _with_core(version: str, tmp_path: Path, *argv: str):
    """``mbmem ARGV`` with the real megatron-core VERSION in front of this environment's own (PYTHONPATH; megatron
    is a namespace package, so megatron.core and megatron.training come from it, Bridge from the environment)."""
    target = tmp_path / f"core-{version}"
    got = run_cmd([str(UV), "pip", "install", "-q", "--no-deps", "--target", str(target), f"megatron-core=={version}"],
                  timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    return run_cmd([sys.executable, "-m", "mbmem_overlays.cli", *argv],
                   env={"PYTHONPATH": str(target), "MBMEM_QUIET": "1"}, timeout=900)


APPLY = ("apply", "--recipe", "llama3_8b_pretrain", "--overlay", "selective_recompute", "--world-size", "8")


@pytest.mark.bridge
def test_a_pair_that_does_not_import_is_one_line_naming_both_versions(tmp_path):
    """Bridge 0.6.x's config needs megatron.training.models.gpt, which megatron-core 0.18.2 lacks."""
    out = _with_core("0.18.2", tmp_path, *APPLY)
    assert out.returncode == EXIT_STACK and "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert f"megatron-bridge {stack.installed().bridge} + megatron-core 0.18.2 does not import" in lines[0]
    assert "No module named 'megatron.training.models.gpt'" in lines[0]


@pytest.mark.bridge
def test_a_pair_outside_the_matrix_is_one_note_and_bridge_still_validates(tmp_path):
    """This Bridge with the 0.19.x megatron-core it was not checked with: it imports, so the command runs as always
    (Bridge's own validation on the installed code) after one note naming both versions and the checked pairs."""
    other = "0.19.0" if stack.installed().core != "0.19.0" else "0.19.2"
    out = _with_core(other, tmp_path, *APPLY)
    assert out.returncode in (0, 3) and "Traceback" not in out.stderr, out.stderr[-3000:]
    notes = [line for line in out.stderr.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and f"megatron-bridge {stack.installed().bridge} + megatron-core {other} is installed" \
        in notes[0], out.stderr
    assert "validation: PASSED" in out.stdout, out.stdout


# ----------------------------------------------------------------------------- on the installed (supported) stack
@pytest.mark.bridge
def test_apply_and_plan_on_two_recipes(bridge):
    assert stack.installed().supported
    for recipe, overlays, world in (("llama3_8b_pretrain", "selective_recompute,dist_optimizer", "8"),
                                    ("qwen3_8b_peft", "expandable_segments,selective_recompute", "8")):
        out = mbmem("apply", "--recipe", recipe, "--overlay", overlays, "--world-size", world,
                    env={"MBMEM_QUIET": "1"})
        assert out.returncode in (0, 3), out.stderr[-3000:]  # 3: a TE check not checkable on this host
        assert "validation: PASSED" in out.stdout and "note:" not in out.stderr, out.stdout + out.stderr
        out = mbmem("plan", "--recipe", recipe, "--overlay", overlays, "--world-size", world, "--json",
                    env={"MBMEM_QUIET": "1"})
        assert out.returncode in (0, 1), out.stderr[-3000:]  # 1: the last step does not fit (no --gpu-memory: fits)
        assert json.loads(out.stdout)["schema_version"]


@pytest.mark.bridge
def test_check_stack_on_the_installed_stack(bridge):
    out = mbmem("check-stack", "--cases", "30", "--seed", "3", env={"MBMEM_QUIET": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"^agreement: (\d+)/\1 \(100\.0%\)$", out.stdout, re.MULTILINE), out.stdout
    assert "cases (seed 3)" in out.stdout and "about" in out.stderr and "a supported pair" in out.stdout
    as_json = json.loads(mbmem("check-stack", "--cases", "10", "--json", env={"MBMEM_QUIET": "1"}).stdout)
    assert as_json["supported"] and as_json["disagreements"] == [] and as_json["decided"] > 0
    assert as_json["installed"]["megatron-bridge"] in SUPPORTED


def test_check_stack_refuses_bad_counts():
    out = mbmem("check-stack", "--cases", "0", "--json")
    assert out.returncode == 2 and json.loads(out.stdout)["exit_code"] == 2
