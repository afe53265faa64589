"""Hostile input, round 2 (issue 22): one test (or more) per numbered item, each written against the class of
defect, and each failing on the code before the fix.

Nothing here imports Bridge except the tests marked ``bridge``: every refusal below happens before the import,
so the cases run in seconds."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import ROOT, paste, train, train_process

from mbmem_overlays import OverlayError, apply_overlay
from mbmem_overlays.core.catalog import Catalog
from mbmem_overlays.core.report import EXIT_OK, EXIT_USAGE, SCHEMA_VERSION

# The documented figures (README "Exit codes", "Guarantees"): named here, so a change to them is a test failure.
EXIT_OUTPUT = 74
MAX_WORLD_SIZE = 2**20

FAST = 20          # seconds for a whole refused command, Python start-up included (no Bridge import)
VENV_BIN = str(Path(sys.executable).parent)


def no_traceback(out) -> None:
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout, out.stderr[-3000:]


def cli(*argv: str) -> SimpleNamespace:
    """``mbmem`` in this process, output captured (for the many refusals that never import Bridge)."""
    from mbmem_overlays.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def overlay_file(base: Path, name: str, body: str, *, header: str | None = None, folder: str = "mem") -> Path:
    (base / folder).mkdir(parents=True, exist_ok=True)
    path = base / folder / f"{name}.yaml"
    path.write_text((f"# @package mem.{name}\n" if header is None else header) + body)
    return path


SMALL_BATCH = "mbs: 1\noverlay:\n  summary: one sample per microbatch\n  set:\n    train.micro_batch_size: '@mbs'\n"


def billion_laughs(levels: int = 9, width: int = 9) -> str:
    """The 399-byte file of the issue: ``levels`` anchors, each ``width`` aliases of the one before."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * width) + "]")
    return "\n".join(lines) + "\noverlay:\n  summary: boom\n"


# ============================================================================ 1. exponential work from a tiny file
@pytest.mark.parametrize("text, fragment", [
    (billion_laughs(), "expands to more than"),
    ("x: &x [*x]\noverlay: {}\n", "refers to itself"),
    ("x: " + "[" * 200 + "]" * 200 + "\noverlay: {}\n", "nested deeper than"),
    ("".join(f"k{i}: &k{i} [1]\n" for i in range(150)) + "l: [" + ",".join(f"*k{i}" for i in range(150))
     + "]\noverlay: {}\n", "more than 100 aliases"),
])
def test_yaml_bombs_are_refused_by_the_loader_in_milliseconds(text, fragment):
    from mbmem_overlays.core import safeyaml
    start = time.monotonic()
    with pytest.raises(safeyaml.YamlRefused, match=fragment):
        safeyaml.load(text)
    assert time.monotonic() - start < 0.5


def test_shared_nodes_and_merge_keys_still_load():
    from mbmem_overlays.core import safeyaml
    data = safeyaml.load("base: &b {x: 1, y: [1, 2]}\none: *b\ntwo: {<<: *b, z: 3}\n")
    assert data["one"] == {"x": 1, "y": [1, 2]} and data["two"] == {"x": 1, "y": [1, 2], "z": 3}


def test_alias_bomb_in_a_user_overlay_is_refused_fast_by_every_entry_point(tmp_path):
    """Issue 22 #1: `mbmem list`, `mbmem apply` and train.py (even with the overlay unselected) ran past a minute."""
    bomb = overlay_file(tmp_path, "bomb", billion_laughs())
    start = time.monotonic()
    cat = Catalog([tmp_path])
    assert time.monotonic() - start < 1.0
    assert "bomb" not in cat.names() and str(bomb) in cat.problems[0].field and "aliases" in cat.problems[0].message
    out = cli("--overlay-dir", str(tmp_path), "list")                 # listed as a warning, the rest still lists
    assert out.returncode == EXIT_OK and f"{bomb}" in out.stderr and "expandable_segments" in out.stdout
    out = cli("--overlay-dir", str(tmp_path), "apply", "--recipe", "llama3_8b_pretrain", "-O", "bomb", "--json")
    assert out.returncode == EXIT_USAGE and "expands to more than" in json.loads(out.stdout)["error"]
    env = {"MBMEM_OVERLAY_DIRS": str(tmp_path), "MBMEM_RUNS_DIR": str(tmp_path / "runs")}
    for argv in (["recipe=llama3_8b_pretrain", "+mem=bomb"], ["recipe=llama3_8b_pretrain", "run.world_size=0"]):
        start = time.monotonic()
        done = train(*argv, env=env, timeout=60)
        assert done.returncode == EXIT_USAGE and time.monotonic() - start < FAST, done.stderr[-2000:]
        no_traceback(done)
    assert "expands to more than" in train("recipe=llama3_8b_pretrain", "+mem=bomb", env=env).stderr


# ============================================================================ 2a. printed commands find the overlays
def test_printed_train_command_carries_every_user_overlay_dir(tmp_path, monkeypatch):
    from mbmem_overlays.cli.common import train_command
    from mbmem_overlays.core.catalog import all_user_dirs
    (tmp_path / "a" / "mem").mkdir(parents=True)
    (tmp_path / "b" / "mem").mkdir(parents=True)
    monkeypatch.setenv("MBMEM_OVERLAY_DIRS", str(tmp_path / "b"))
    monkeypatch.chdir(tmp_path)
    dirs = all_user_dirs(["a", str(tmp_path / "b")])      # the flag, then the environment; one directory once
    assert dirs == [str(tmp_path / "a"), str(tmp_path / "b")]
    words = shlex.split(train_command("llama3_8b_pretrain", ["small_batch"], [], 8, ["a"]))
    assert words[0] == f"MBMEM_OVERLAY_DIRS={tmp_path / 'a'}:{tmp_path / 'b'}" and words[1:3] == ["python", "train.py"]


def test_slurm_script_runs_train_py_with_the_user_overlays(tmp_path):
    """The rendered script, run as Slurm would (stub srun/scontrol), reaches the real train.py with the user's
    overlay directory exported: Hydra composes the user overlay (``--cfg job``; no Bridge import)."""
    overlay_file(tmp_path / "mine", "small_batch", SMALL_BATCH)
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (stub / "scontrol").write_text("#!/bin/bash\necho node0\n")
    # The job's python: drop torch.distributed.run's options, run train.py for real and print the composed job.
    (stub / "jobpython").write_text(f'#!/bin/bash\nwhile [[ "$1" != train.py ]]; do shift; done\n'
                                    f'exec {shlex.quote(sys.executable)} "$@" --cfg job\n')
    for f in stub.iterdir():
        f.chmod(0o755)
    out = cli("--overlay-dir", str(tmp_path / "mine"), "slurm", "--recipe", "llama3_8b_pretrain", "-O", "small_batch",
              "--set", "mem.small_batch.mbs=3", "--nodes", "1", "--gpus-per-node", "2", "--cpu-smoke", "--no-validate",
              "--python", str(stub / "jobpython"), "-o", str(tmp_path / "job.sh"))
    assert out.returncode == EXIT_OK, out.stderr
    script = (tmp_path / "job.sh").read_text()
    assert f"export MBMEM_OVERLAY_DIRS={tmp_path / 'mine'}\n" in script
    env = {k: v for k, v in os.environ.items() if k != "MBMEM_OVERLAY_DIRS"}
    env.update(PATH=f"{stub}:{env['PATH']}", SLURM_JOB_NODELIST="node0", SLURM_JOB_ID="7", SLURM_JOB_NUM_NODES="1",
               SLURM_NODEID="0", SLURM_CPUS_ON_NODE="4", MBMEM_RUNS_DIR=str(tmp_path / "runs"))
    done = subprocess.run(["bash", str(tmp_path / "job.sh")], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "small_batch:" in done.stdout and "mbs: 3" in done.stdout, done.stdout[-2000:]


def test_slurm_container_mounts_the_user_overlay_dirs(tmp_path):
    from mbmem_overlays.launch.slurm import container_mounts_with_workdir
    assert container_mounts_with_workdir("/repo", None, ["/home/u/ov"]) == "/repo:/repo,/home/u/ov:/home/u/ov"
    assert container_mounts_with_workdir("/repo", "/home:/home", ["/home/u/ov"]) == "/repo:/repo,/home:/home"
    assert container_mounts_with_workdir("/repo", "/data:/home", ["/home/u/ov"]).endswith(",/home/u/ov:/home/u/ov")


@pytest.mark.bridge
def test_apply_next_line_pasted_into_a_shell_finds_the_user_overlay(bridge, tmp_path, capsys, monkeypatch):
    """`mbmem apply --overlay-dir D`'s next: line, pasted as it is into bash (no MBMEM_OVERLAY_DIRS in the
    shell), runs: the command itself says where the overlay lives (issue 22 #2a). A real bash parses it;
    the train.py it starts runs in this process (conftest.paste)."""
    from mbmem_overlays.cli import main
    overlay_file(tmp_path / "mine", "small_batch", SMALL_BATCH)
    code = main(["--overlay-dir", str(tmp_path / "mine"), "apply", "--recipe", "llama3_8b_pretrain", "-O",
                 "small_batch", "--set", "mem.small_batch.mbs=2", "--world-size", "8"])
    out = capsys.readouterr().out
    assert code == EXIT_OK, out[-2000:]
    line = out.split("next: ", 1)[1].splitlines()[0]
    monkeypatch.delenv("MBMEM_OVERLAY_DIRS", raising=False)
    done = paste(f"{line} run.dry_run=true", env={"MBMEM_RUNS_DIR": str(tmp_path / "runs"), "MBMEM_QUIET": "1"})
    assert done.returncode == EXIT_OK, done.stderr[-3000:]
    assert "[small_batch] train.micro_batch_size: 1 -> 2" in done.stdout


# ============================================================================ 2b. every printed value is quoted
def test_a_fix_that_names_a_command_quotes_the_users_value():
    hostile = "$(touch /tmp/mbmem-pwned)"
    out = cli("apply", "--recipe", "llama3_8b_pretrain", "-O", "cpu_offload", "--set",
              f"mem.cpu_offload.num_layerz={hostile}")
    assert out.returncode == EXIT_USAGE
    fix = next(line for line in out.stderr.splitlines() if "fix: use " in line).split("fix: use ", 1)[1]
    assert shlex.split(fix) == [f"mem.cpu_offload.num_layers={hostile}"]   # one word, pasted as text


# ============================================================================ 2c. one rule for ${...}
INTERPOLATIONS = ["${oc.env:MBMEM_TEST_SECRET}", "${oc.env:NOPE}", "x${now:%H}", "\\${escaped}", "[${a},b]"]


@pytest.mark.parametrize("value", INTERPOLATIONS)
def test_interpolations_are_refused_by_mbmem_before_bridge(value):
    extra = {"plan": ["--world-size", "8"], "recommend": ["--world-size", "8", "--gpu-memory", "80GiB"],
             "slurm": ["--nodes", "1", "--gpus-per-node", "8", "--no-validate"]}
    cases = [(c, ["--set", f"logger.wandb_exp_name={value}"]) for c in ("apply", "args", "plan", "recommend", "slurm")]
    cases += [(c, ["-O", "cpu_offload", "--set", f"mem.cpu_offload.num_layers={value}"])
              for c in ("apply", "args", "plan", "recommend", "slurm")]
    cases += [(c, ["-O", "cpu_offload", "--param", f"cpu_offload.num_layers={value}"]) for c in ("apply", "args")]
    for command, argv in cases:
        out = cli(command, "--recipe", "llama3_8b_pretrain", *argv, *extra.get(command, []), "--json")
        assert out.returncode == EXIT_USAGE, (command, argv, out.stderr)
        assert "interpolation" in json.loads(out.stdout)["error"]


def test_train_refuses_interpolations_and_writes_no_record(tmp_path):
    runs = tmp_path / "runs"
    env = {"MBMEM_RUNS_DIR": str(runs), "MBMEM_TEST_SECRET": "hunter2"}
    for argv in (["logger.wandb_exp_name=${oc.env:MBMEM_TEST_SECRET}"], ["+mem=cpu_offload",
                 "mem.cpu_offload.num_layers=${oc.env:MBMEM_TEST_SECRET}"], ["run.world_size=${oc.env:WORLD}"],
                 ["recipe.kwargs.x=${oc.env:MBMEM_TEST_SECRET}"]):
        out = train("recipe=llama3_8b_pretrain", *argv, "run.json=true", env=env, timeout=60)
        assert out.returncode == EXIT_USAGE, out.stderr[-2000:]
        assert "interpolation" in json.loads(out.stdout)["error"] and "hunter2" not in out.stdout + out.stderr
        no_traceback(out)
    assert not runs.exists() or not any(runs.rglob("*"))


def test_train_body_never_resolves_what_composition_put_in(tmp_path, monkeypatch):
    """The Compose API path (no command-line check before it): run() reads the config unresolved."""
    from hydra import compose, initialize_config_dir

    from mbmem_overlays.launch import hydra_entry
    monkeypatch.setenv("MBMEM_TEST_SECRET", "hunter2")
    with initialize_config_dir(config_dir=str(ROOT / "recipes"), version_base="1.3"):
        cfg = compose("train", overrides=["recipe=llama3_8b_pretrain", f"+run.record_dir={tmp_path}",
                                          "+bridge.logger.wandb_exp_name=${oc.env:MBMEM_TEST_SECRET}"])
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert hydra_entry.run(cfg) == EXIT_USAGE
    assert "interpolation" in err.getvalue() and "hunter2" not in err.getvalue() and not any(tmp_path.iterdir())


def test_interpolation_in_an_overlay_file_is_one_verdict_everywhere(tmp_path):
    overlay_file(tmp_path, "sneaky", "overlay:\n  summary: x\n  set: {logger.wandb_exp_name: '${oc.env:HOME}'}\n")
    cat = Catalog([tmp_path])
    assert "sneaky" not in cat.names() and "interpolation" in cat.problems[0].message
    mine = cli("--overlay-dir", str(tmp_path), "apply", "--recipe", "llama3_8b_pretrain", "-O", "sneaky")
    theirs = train("recipe=llama3_8b_pretrain", "+mem=sneaky", env={"MBMEM_OVERLAY_DIRS": str(tmp_path),
                                                                    "MBMEM_RUNS_DIR": str(tmp_path / "runs")})
    assert mine.returncode == theirs.returncode == EXIT_USAGE
    assert cat.problems[0].message in mine.stderr and cat.problems[0].message in theirs.stderr


def test_api_refuses_interpolated_parameters_before_touching_anything():
    @dataclasses.dataclass
    class Tiny:
        x: int = 1
    cfg = Tiny()
    with pytest.raises(OverlayError, match="interpolation"):
        apply_overlay(cfg, "cpu_offload", env={}, params={"num_layers": "${oc.env:HOME}"})
    assert cfg == Tiny()


# ============================================================================ 3. numbers with bounds
HUGE = "9" * 4301


@pytest.mark.parametrize("argv", [
    ["apply", "--recipe", "llama3_8b_pretrain", "--set", f"train.train_iters={HUGE}"],
    ["apply", "--recipe", "llama3_8b_pretrain", "-O", "cpu_offload", "--param", f"cpu_offload.num_layers={HUGE}"],
    ["apply", "--recipe", "llama3_8b_pretrain", "-O", "cpu_offload", "--set", f"mem.cpu_offload.num_layers={HUGE}"],
    ["apply", "--recipe", "llama3_8b_pretrain", "--world-size", str(10**21)],
    ["apply", "--recipe", "llama3_8b_pretrain", "--world-size", HUGE],
    ["args", "--recipe", "llama3_8b_pretrain", "--world-size", str(MAX_WORLD_SIZE + 1)],
    ["apply", "--recipe", "llama3_8b_pretrain", "--set", "train.train_iters=" + "9" * 30],
    ["apply", "--recipe", "llama3_8b_pretrain", "--set", "optimizer.lr=nan"],
    ["plan", "--recipe", "llama3_8b_pretrain", "--world-size", str(10**21)],
    ["plan", "--recipe", "llama3_8b_pretrain", "--world-size", "8", "--search", "--gpu-memory", "80GiB", "--top", HUGE],
    ["plan", "--recipe", "llama3_8b_pretrain", "--world-size", "8", "--margin", "1e999"],
    ["plan", "--recipe", "llama3_8b_pretrain", "--world-size", "8", "--gpu-memory", HUGE],
    ["recommend", "--recipe", "llama3_8b_pretrain", "--world-size", "8", "--gpu-memory", "9" * 70 + "GiB"],
    ["slurm", "--recipe", "llama3_8b_pretrain", "--nodes", HUGE, "--gpus-per-node", "8", "--no-validate"],
    ["slurm", "--recipe", "llama3_8b_pretrain", "--nodes", str(10**6), "--gpus-per-node", "8", "--no-validate"],
    ["slurm", "--recipe", "llama3_8b_pretrain", "--nodes", "1", "--gpus-per-node", "8", "--cpus-per-task", HUGE,
     "--no-validate"],
    ["doctor", "tests/fixtures/snapshots/unwound_oom.pickle", "--top", HUGE],
    ["doctor", "tests/fixtures/snapshots/unwound_oom.pickle", "--world-size", HUGE],
    ["doctor", "tests/fixtures/snapshots/unwound_oom.pickle", "--margin", "1e999"],
    ["doctor", "tests/fixtures/runs/bridge_llama3_8b_tp2_pp2.log", "--world-size", HUGE],
    ["doctor", "tests/fixtures/runs/bridge_llama3_8b_tp2_pp2.log", "--gpu-memory", HUGE],
], ids=lambda argv: " ".join(a[:20] for a in argv))
def test_every_numeric_option_is_bounded_and_a_usage_error(argv):
    for as_json in (False, True):
        out = cli(*argv, *(["--json"] if as_json else []))
        assert out.returncode == EXIT_USAGE, (argv[:6], out.stderr[-1500:])
        no_traceback(out)
        if as_json:
            doc = json.loads(out.stdout)
            assert doc["schema_version"] == SCHEMA_VERSION and doc["exit_code"] == EXIT_USAGE
        assert len(out.stderr) < 20_000  # a 4,301-digit value is shown shortened, never in full


@pytest.mark.parametrize("argv, fragment", [
    ([f"train.train_iters={HUGE}"], "characters long"),            # measured before Hydra parses it
    ([f"train.train_iters={'9' * 4000}"], "out of range"),
    ([f"run.world_size={10**21}"], "at most 1048576"),
    ([f"run.world_size={'9' * 4301}"], "characters long"),
    (["+mem=cpu_offload", f"mem.cpu_offload.num_layers={10**30}"], "out of range"),
    (["run.gpu_memory=" + "9" * 100], "longer than 64 characters"),
])
def test_train_numbers_are_bounded_before_bridge_with_json(argv, fragment, tmp_path):
    out = train("recipe=llama3_8b_pretrain", *argv, "run.json=true", env={"MBMEM_RUNS_DIR": str(tmp_path)}, timeout=60)
    assert out.returncode == EXIT_USAGE, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    assert doc["exit_code"] == EXIT_USAGE and fragment in doc["error"]
    no_traceback(out)


def test_api_world_size_has_an_upper_bound():
    @dataclasses.dataclass
    class Tiny:
        x: int = 1
    with pytest.raises(OverlayError, match="at most 1048576 GPUs"):
        apply_overlay(Tiny(), [], env={}, world_size=10**21)


# ============================================================================ 4. Hydra's errors are ours
def test_train_answers_unknown_recipe_overlay_and_parameter_like_apply_all_at_once(tmp_path):
    env = {"MBMEM_RUNS_DIR": str(tmp_path)}
    out = train("recipe=nope", "+mem=[cpu_offload,nopelay]", "mem.cpu_offload.num_layerz=2", "run.json=true", env=env)
    assert out.returncode == EXIT_USAGE, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    assert doc["exit_code"] == EXIT_USAGE and len(doc["problems"]) == 3
    messages = [p["message"] for p in doc["problems"]]
    assert any("unknown recipe 'nope'" in m for m in messages)
    apply = cli("apply", "--recipe", "llama3_8b_pretrain", "-O", "cpu_offload,nopelay",
                "--set", "mem.cpu_offload.num_layerz=2", "--json")
    assert [p["message"] for p in json.loads(apply.stdout)["problems"]] == messages[1:]  # the same words
    assert "Could not find" not in out.stderr  # Hydra's own text no longer answers


@pytest.mark.parametrize("word", ["mem.cpu_offload.num_layers=2", "+mem.cpu_offload.num_layers=2",
                                  "++mem.cpu_offload.num_layers=2"])
def test_a_parameter_never_selects_its_overlay(word, tmp_path):
    out = train("recipe=llama3_8b_pretrain", word, env={"MBMEM_RUNS_DIR": str(tmp_path)})
    apply = cli("apply", "--recipe", "llama3_8b_pretrain", "--set", "mem.cpu_offload.num_layers=2")
    assert out.returncode == apply.returncode == EXIT_USAGE
    assert "parameters for 'cpu_offload', which is not selected" in out.stderr
    assert "parameters for 'cpu_offload', which is not selected" in apply.stderr
    no_traceback(out)


def test_a_parameter_of_a_selected_overlay_with_plus_still_composes():
    from mbmem_overlays.launch.hydra_entry import hydra_argv
    argv = ["train.py", "+mem=[expandable,activation_offload]", "+mem.cpu_offload.num_layers=2", "+mem.x.y=1"]
    assert hydra_argv(argv)[1:] == ["+mem=[expandable_segments,cpu_offload]", "mem.cpu_offload.num_layers=2",
                                    "+mem.x.y=1"]


def test_compose_api_parameter_without_its_overlay_is_refused(tmp_path):
    from hydra import compose, initialize_config_dir

    from mbmem_overlays.launch import hydra_entry
    with initialize_config_dir(config_dir=str(ROOT / "recipes"), version_base="1.3"):
        cfg = compose("train", overrides=["recipe=llama3_8b_pretrain", "+mem.cpu_offload.num_layers=2"])
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert hydra_entry.run(cfg) == EXIT_USAGE
    assert "which is not selected" in err.getvalue()


@pytest.mark.parametrize("argv, fragment", [
    (["run.nope=1"], "train.py has no setting run.nope"),
    (["+mem=cpu_offload,expandable_segments"], "Ambiguous value"),
    (["mem=cpu_offload"], "Could not override 'mem'"),
])
def test_train_other_composition_errors_are_usage_errors_with_json(argv, fragment, tmp_path):
    out = train("recipe=llama3_8b_pretrain", *argv, "run.json=true", env={"MBMEM_RUNS_DIR": str(tmp_path)})
    assert out.returncode == EXIT_USAGE, out.stderr[-2000:]
    assert fragment in json.loads(out.stdout)["error"]


# ============================================================================ 5. output files
def _kinds(tmp_path: Path) -> dict[str, Path]:
    target = tmp_path / "precious.png"
    target.write_bytes(b"keep me")
    (tmp_path / "link.png").symlink_to(target)
    os.mkfifo(tmp_path / "fifo.png")
    (tmp_path / "folder.png").mkdir()
    (tmp_path / "dangling.png").symlink_to(tmp_path / "nowhere.png")
    return {"existing file": target, "link": tmp_path / "link.png", "fifo": tmp_path / "fifo.png",
            "folder": tmp_path / "folder.png", "dangling link": tmp_path / "dangling.png",
            "missing folder": tmp_path / "no" / "plan.png", "no suffix": tmp_path / "plan"}


@pytest.mark.parametrize("command", ["plan", "recommend"])
def test_plot_paths_are_refused_before_bridge_and_nothing_is_written(tmp_path, command):
    kinds = _kinds(tmp_path)
    before = sorted(os.listdir(tmp_path))
    for kind, path in kinds.items():
        out = cli(command, "--recipe", "llama3_8b_pretrain", "--world-size", "8", "--gpu-memory", "80GiB",
                  "--plot", str(path), "--json")
        assert out.returncode == EXIT_USAGE, (kind, out.stderr)
        assert json.loads(out.stdout)["problems"][0]["field"] == "--plot", kind
    assert sorted(os.listdir(tmp_path)) == before and kinds["existing file"].read_bytes() == b"keep me"


def test_the_plot_is_rendered_in_memory_then_written_by_the_one_writer(tmp_path):
    pytest.importorskip("matplotlib")
    from mbmem_overlays.cli.plan import write_plot
    from mbmem_overlays.cli.common import UsageError
    from mbmem_overlays.memory.model import Breakdown
    from mbmem_overlays.memory.steps import draw_bars
    rows = [("baseline", Breakdown(parameters=2**30, gradients=2**30, optimizer=2**30, activations=2**30, other=0))]

    def draw():
        return draw_bars(rows, title="t", capacity=80 * 2**30, margin=0.05)
    target = tmp_path / "plan.svg"
    write_plot(SimpleNamespace(plot=str(target), force=False), draw)
    assert target.read_bytes().lstrip().startswith(b"<?xml")          # the format follows the name
    with pytest.raises(UsageError, match="exists already"):
        write_plot(SimpleNamespace(plot=str(target), force=False), draw)
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    (tmp_path / "link.svg").symlink_to(victim)                         # a link made after the early check
    with pytest.raises(UsageError, match="symbolic link"):
        write_plot(SimpleNamespace(plot=str(tmp_path / "link.svg"), force=True), draw)
    assert victim.read_text() == "keep me"


# ============================================================================ 7. user overlays: one verdict
def _both(tmp_path: Path, name: str, env_dir: Path) -> tuple[SimpleNamespace, SimpleNamespace]:
    mine = cli("--overlay-dir", str(env_dir), "apply", "--recipe", "llama3_8b_pretrain", "-O", name)
    theirs = train("recipe=llama3_8b_pretrain", f"+mem={name}",
                   env={"MBMEM_OVERLAY_DIRS": str(env_dir), "MBMEM_RUNS_DIR": str(tmp_path / "runs")})
    return mine, theirs


@pytest.mark.parametrize("header", ["", "# my overlay\n# @package mem.small_batch\n", "# @package mem.other\n",
                                    "# @package _global_\n"])
def test_an_overlay_without_its_package_header_is_refused_everywhere(tmp_path, header):
    overlay_file(tmp_path, "small_batch", SMALL_BATCH, header=header)
    mine, theirs = _both(tmp_path, "small_batch", tmp_path)
    assert mine.returncode == theirs.returncode == EXIT_USAGE, theirs.stderr[-2000:]
    for out in (mine, theirs):
        assert "# @package mem.small_batch" in out.stderr and "unknown overlay 'overlay'" not in out.stderr


def test_overlay_files_directly_in_the_directory_are_refused_everywhere(tmp_path):
    overlay_file(tmp_path, "small_batch", SMALL_BATCH, folder=".")
    mine, theirs = _both(tmp_path, "small_batch", tmp_path)
    assert mine.returncode == theirs.returncode == EXIT_USAGE
    for out in (mine, theirs):
        assert "has no mem/ folder" in out.stderr and "small_batch.yaml" in out.stderr
    listed = cli("--overlay-dir", str(tmp_path), "list")
    assert listed.returncode == EXIT_USAGE and "has no mem/ folder" in listed.stderr


def test_a_folder_named_mem_works_everywhere(tmp_path):
    overlay_file(tmp_path, "small_batch", SMALL_BATCH)
    mem = tmp_path / "mem"
    assert "small_batch" in cli("--overlay-dir", str(mem), "list").stdout
    out = train_process("recipe=llama3_8b_pretrain", "+mem=small_batch", "mem.small_batch.mbs=4", "--cfg", "job",
                        env={"MBMEM_OVERLAY_DIRS": str(mem), "MBMEM_RUNS_DIR": str(tmp_path / "runs")}, timeout=120)
    assert out.returncode == 0 and "mbs: 4" in out.stdout, out.stderr[-2000:]


# ============================================================================ 8. the API's contract
def test_apply_overlay_refuses_a_plain_dict_and_leaves_it_alone():
    cfg = {"model": {"recompute_granularity": None}}
    with pytest.raises(OverlayError, match="cfg must be a config object"):
        apply_overlay(cfg, "selective_recompute", env={})
    assert cfg == {"model": {"recompute_granularity": None}}


@pytest.mark.parametrize("validate", ["yes", "false", 1, 0, None, [True]])
def test_validate_must_be_a_bool(validate):
    @dataclasses.dataclass
    class Tiny:
        x: int = 1
    cfg, env = Tiny(), {"A": "1"}
    with pytest.raises(OverlayError) as exc:
        apply_overlay(cfg, "expandable_segments", env=env, validate=validate, world_size=0)
    assert [p.field for p in exc.value.problems] == ["validate", "world_size"]   # every wrong argument at once
    assert cfg == Tiny() and env == {"A": "1"}


# ============================================================================ 9. output hygiene
ESC, RLO = "\x1b]0;pwned\x07\x1b[2J", "\u202e"


def test_control_and_bidi_characters_from_user_files_are_escaped(tmp_path):
    yaml_esc = "\\x1b]0;pwned\\a\\x1b[2J"   # YAML's own escapes: the file is valid YAML, the text is hostile
    overlay_file(tmp_path, "shady", f"overlay:\n  summary: \"clear{yaml_esc}screen \\u202etxt.exe\"\n"
                                    f"  sources: [\"a{yaml_esc}\"]\n  effect: \"b\\u202e\"\n")
    overlay_file(tmp_path, f"bad{RLO}name", "overlay: {}\n")
    for argv in (["list"], ["explain", "shady"], ["apply", "--recipe", "os.system", "-O", f"x{ESC}"]):
        out = cli("--overlay-dir", str(tmp_path), *argv)
        for stream in (out.stdout, out.stderr):
            assert "\x1b" not in stream and RLO not in stream and "\x07" not in stream, (argv, stream)
        assert "\\x1b" in out.stdout + out.stderr or "\\u202e" in out.stdout + out.stderr


def test_argparse_echoes_are_escaped():
    out = cli("list", f"--bogus{ESC}")
    assert out.returncode == EXIT_USAGE and "\x1b" not in out.stderr and "\\x1b" in out.stderr


def test_values_with_control_characters_are_refused_where_they_would_reach_a_command(tmp_path):
    out = cli("apply", "--recipe", "llama3_8b_pretrain", "-O", "cpu_offload", "--param",
              f"cpu_offload.num_layers=a{RLO}b")
    assert out.returncode == EXIT_USAGE and "bidirectional" in out.stderr and RLO not in out.stderr
    out = cli("slurm", "--recipe", "llama3_8b_pretrain", "--nodes", "1", "--gpus-per-node", "8", "--no-validate",
              "--python", f"py{ESC}")
    assert out.returncode == EXIT_USAGE and "control or bidirectional" in out.stderr


def _closed_reader(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run with stdout a pipe whose reader is gone before the first write (`| head -0`)."""
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})
    proc.stdout.close()
    err = proc.stderr.read()
    return subprocess.CompletedProcess(argv, proc.wait(timeout=120), "", err)


MBMEM = [sys.executable, "-m", "mbmem_overlays.cli"]


@pytest.mark.parametrize("how", ["closed pipe", "full disk", "no stdout"])
@pytest.mark.parametrize("argv", [MBMEM + ["list"], MBMEM + ["explain", "cpu_offload", "--json"],
                                  MBMEM + ["apply", "--recipe", "os.system", "--json"],
                                  [sys.executable, "train.py", "recipe=nope", "run.json=true"]],
                         ids=["list", "explain", "apply-json-error", "train-json-error"])
def test_a_closed_or_full_stdout_is_one_line_and_exit_74(argv, how, tmp_path):
    if how == "full disk" and not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this system")
    env = {"MBMEM_RUNS_DIR": str(tmp_path)}
    if how == "closed pipe":
        out = _closed_reader(argv, env)
    else:
        with open("/dev/full", "w") if how == "full disk" else contextlib.nullcontext() as sink:
            out = subprocess.run(argv, cwd=ROOT, stdout=sink if sink else subprocess.DEVNULL, stderr=subprocess.PIPE,
                                 text=True, env={**os.environ, **env}, timeout=120,
                                 **({} if sink else {"preexec_fn": lambda: os.close(1)}))
    assert out.returncode == EXIT_OUTPUT, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "Exception ignored" not in out.stderr
    assert sum("cannot write to standard output" in line for line in out.stderr.splitlines()) == 1


def test_an_output_only_to_a_file_needs_no_stdout(tmp_path):
    out = subprocess.run(MBMEM + ["slurm", "--recipe", "llama3_8b_pretrain", "--nodes", "1", "--gpus-per-node", "8",
                                  "--no-validate", "-o", str(tmp_path / "job.sh")], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=120,
                         preexec_fn=lambda: os.close(1))
    assert out.returncode == EXIT_OK, out.stderr and (tmp_path / "job.sh").is_file()



def test_the_documented_figures_are_the_codes():
    from mbmem_overlays.core import report, values
    assert report.EXIT_OUTPUT == EXIT_OUTPUT and values.MAX_WORLD_SIZE == MAX_WORLD_SIZE


@pytest.mark.parametrize("value", ["[" * 1000 + "1" + "]" * 1000, "x" * 5000, "{a:" * 300 + "1" + "}" * 300],
                         ids=["1000 brackets", "5000 characters", "300 braces"])
def test_deep_or_long_values_never_reach_hydras_recursive_parser(value, tmp_path):
    """Hydra's override parser raised RecursionError (a traceback) at a few hundred brackets, and took
    seconds per 10,000 characters: such a value is measured first, on every entry point."""
    for argv in (["--set", f"model.x={value}"], ["-O", "cpu_offload", "--param", f"cpu_offload.num_layers={value}"]):
        start = time.monotonic()
        out = cli("apply", "--recipe", "llama3_8b_pretrain", *argv, "--json")
        assert out.returncode == EXIT_USAGE and time.monotonic() - start < 5, out.stderr[-1500:]
        assert json.loads(out.stdout)["exit_code"] == EXIT_USAGE
        no_traceback(out)
    out = train("recipe=llama3_8b_pretrain", f"model.x={value}", "run.json=true", env={"MBMEM_RUNS_DIR": str(tmp_path)})
    assert out.returncode == EXIT_USAGE and json.loads(out.stdout)["exit_code"] == EXIT_USAGE, out.stderr[-1500:]
    no_traceback(out)


def test_a_directory_of_thousands_of_files_is_not_read(tmp_path):
    (tmp_path / "mem").mkdir()
    for i in range(1001):
        (tmp_path / "mem" / f"o{i}.yaml").write_text("")
    start = time.monotonic()
    out = cli("--overlay-dir", str(tmp_path), "list")
    assert out.returncode == EXIT_USAGE and "more than 1000" in out.stderr and time.monotonic() - start < 5


@pytest.mark.parametrize("text", ["x: 1e-4\n", "d: 2020-01-01\n", "n: .nan\ni: 1_000\n", "s: 1:30\nf: 6.02e+23\n",
                                  "b: [yes, no, on, off, true]\n", "m: &m {a: 1}\nn: {<<: *m, b: 2}\n", "a: 1\na: 2\n",
                                  "t: !!timestamp 2020-01-01\n", "x: ~\ny: 0o17\nz: 0x1f\n", "k: 1.\nl: .5\n"])
def test_the_loader_reads_as_hydras_omegaconf_loader_does(text):
    """One verdict: a file means to mbmem what it means to train.py, which reads it with OmegaConf's loader."""
    import yaml
    from omegaconf._utils import get_yaml_loader

    from mbmem_overlays.core import safeyaml

    def read(load):
        try:
            return ("ok", load())
        except yaml.YAMLError as exc:
            return ("error", type(exc).__name__)
    ours = read(lambda: safeyaml.load(text))
    theirs = read(lambda: yaml.load(text, Loader=get_yaml_loader()))
    assert repr(ours) == repr(theirs)   # repr: nan == nan is False


@pytest.mark.parametrize("env, fragment", [({"RANK": "9" * 5000}, "is not a process rank"),
                                           ({"MBMEM_RUNS_DIR": "/tmp/" + "a" * 5000}, "File name too long")])
def test_train_environment_values_are_bounded_too(env, fragment, tmp_path):
    out = train("recipe=llama3_8b_pretrain", "run.json=true", env={"MBMEM_RUNS_DIR": str(tmp_path), **env})
    assert out.returncode == EXIT_USAGE and fragment in json.loads(out.stdout)["error"], out.stderr[-1500:]
    no_traceback(out)


def test_an_output_path_too_long_for_the_filesystem_is_a_usage_error(tmp_path):
    out = cli("plan", "--recipe", "llama3_8b_pretrain", "--world-size", "8", "--plot",
              str(tmp_path / ("a" * 300) / "p.png"), "--json")
    assert out.returncode == EXIT_USAGE and "File name too long" in json.loads(out.stdout)["error"]


@pytest.mark.parametrize("argv", [
    ["apply", "--recipe", "llama3_8b_pretrian", "--overlay", "expandable_segments"],
    ["plan", "--recipe", "llama3_8b_pretrian", "--world-size", "8"],
    ["slurm", "--recipe", "llama3_8b_pretrian", "--nodes", "1", "--gpus-per-node", "8"],
    ["doctor", str(ROOT / "tests" / "fixtures" / "runs" / "megatron_lm_tp4_pp2.log"), "--recipe", "not_a_recipe"],
    ["recommend", "--recipe", "megatron.bridge.recipes.llama.llama3_8b_pretrian_config", "--world-size", "8",
     "--gpu-memory", "80GB"],
])
def test_a_recipe_no_bridge_module_defines_is_a_usage_error_before_the_import(argv):
    # read from the installed sources' text (a few ms); typed wrong, it fails here, not after the 30 s import or
    # in a queued Slurm job
    from conftest import imports_of, mbmem
    with imports_of("megatron") as imported:
        out = mbmem(*argv, "--json")
    assert out.returncode == EXIT_USAGE and not imported, (out.stdout, imported[:3])
    data = json.loads(out.stdout)
    text = json.dumps(data)
    assert "no Bridge recipe function or train.py recipe named" in text
    if "pretrian" in argv[2]:
        assert "did you mean llama3_8b_pretrain" in text


def test_train_py_refuses_an_unknown_recipe_function_before_the_import():
    out = train("recipe=tiny_llama", "recipe.function=llama3_8b_pretrian_config", "run.dry_run=true")
    assert out.returncode == EXIT_USAGE and "no Bridge recipe function or train.py recipe named" in out.stderr


# ----------------------------------------------------------------------------- round 3: train.py's own surface
@pytest.mark.parametrize("args, fragment", [
    (["--experimental-rerun", "{pickle}"], "train.py does not take '--experimental-rerun'"),
    (["--config-name", "nope"], "train.py does not take '--config-name'"),
    (["--config-path", "/etc"], "train.py does not take '--config-path'"),
    (["--shell-completion"], "train.py does not take '--shell-completion'"),
    (["--hydra-help"], "train.py does not take '--hydra-help'"),
    (["--cfg", "all", "--package", "../../x"], "train.py does not take '--package'"),
    (["--cfg", "everything"], "--cfg needs one of job, hydra, all"),
    (["hydra.output_subdir={tmp}"], "hydra.output_subdir is train.py's to set"),
    (["hydra.run.dir={tmp}"], "hydra.run.dir is train.py's to set"),
    (["hydra.job.name=../../x"], "hydra.job.name is train.py's to set"),
    (["hydra/job_logging=disabled"], "hydra/job_logging is train.py's to set"),
    (["run=5"], "run is a group of settings"),
    (["bridge=5"], "bridge is a group of settings"),
    (["+run.nope=1"], "train.py has no setting run.nope"),
    (["run.dryrun=true"], "did you mean run.dry_run?"),
    (["~model.seq_length"], "deleting config fields is not supported"),
    (["~model"], "deleting config fields is not supported"),
])
def test_train_py_refuses_what_would_run_a_pickle_write_anywhere_or_drop_settings(tmp_path, args, fragment):
    # --experimental-rerun unpickles its file (a class's __reduce__ runs code); hydra.output_subdir wrote
    # .hydra/*.yaml into any folder; run=5 dropped run.json; ~key gave Hydra's exit 1 without JSON
    marker = tmp_path / "PWNED"
    evil = tmp_path / "config.pickle"
    evil.write_bytes(b"cos\nsystem\n(S'touch " + str(marker).encode() + b"'\ntR.")
    argv = [a.format(pickle=evil, tmp=tmp_path / "out") for a in args]
    out = train("recipe=llama3_8b_pretrain", "run.dry_run=true", "run.json=true", *argv)
    assert out.returncode == EXIT_USAGE, (out.stdout, out.stderr)
    data = json.loads(out.stdout)
    assert data["exit_code"] == EXIT_USAGE and any(fragment in p["message"] for p in data["problems"]), data
    assert not marker.exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, expect", [(["--help"], "== Configuration groups =="), (["--cfg=job"], "recipe:"),
                                           (["-c", "job"], "recipe:"), (["--resolve", "--cfg", "job"], "recipe:"),
                                           (["--version"], "Hydra ")])
def test_the_hydra_flags_train_py_takes_work(tmp_path, flags, expect):
    out = train("recipe=tiny_llama", "run.dry_run=true", *flags, env={"MBMEM_RUNS_DIR": str(tmp_path)})
    assert out.returncode == 0 and expect in out.stdout + out.stderr and "Traceback" not in out.stderr


def test_train_py_takes_its_flags_anywhere_on_the_command_line():
    # Hydra's argparse takes -m only before the overrides; train.py moves its flags first, so the order is free
    out = train("recipe=tiny_llama", "run.dry_run=true", "run.validate=false", "-m", "train.train_iters=5,6")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "sweep: 2 jobs; 2 passed" in out.stderr


def test_a_whole_section_given_one_value_is_refused_by_name(bridge):
    cfg = bridge.build_recipe("llama3_8b_pretrain_config")
    with pytest.raises(OverlayError, match=r"model is a \w+ config object; a int cannot replace it .* e\.g\. model\."):
        bridge.apply_overrides(cfg, ["model=1"])
    assert cfg.model.num_layers == 32


def test_a_logged_command_holding_an_interpolation_is_not_reused(tmp_path):
    from conftest import mbmem
    log = tmp_path / "i.log"
    lines = (ROOT / "tests" / "fixtures" / "runs" / "bridge_at_risk_then_oom.log").read_text().splitlines()
    lines = [ln for ln in lines if "train.py" not in ln]
    log.write_text("\n".join(["+ torchrun --nproc_per_node=8 train.py recipe=llama3_8b_pretrain "
                              "'checkpoint.save=${oc.env:HOME}'", *lines]) + "\n")
    out = mbmem("doctor", str(log), "--json")
    data = json.loads(out.stdout)
    assert "${" not in data["next_command"]
    assert any("holds an interpolation" in p for p in data["problems"])


def test_a_gzip_log_that_inflates_like_a_bomb_stops_early_and_is_unreadable(tmp_path):
    import gzip
    from conftest import mbmem
    bomb = tmp_path / "b.log.gz"
    with gzip.open(bomb, "wb", 9) as f:
        for _ in range(24):
            f.write(b"a" * (16 << 20))           # 384 MiB of one byte: 0.4 MB compressed, ~1000x
    started = time.monotonic()
    out = mbmem("doctor", str(bomb), "--json")
    data = json.loads(out.stdout)
    assert out.returncode == EXIT_USAGE and data["verdict"] == "unreadable"
    assert any("a gzip bomb, not a log" in p for p in data["problems"])
    assert time.monotonic() - started < 30


def test_a_newline_in_a_file_or_folder_name_never_starts_a_line_of_its_own(tmp_path):
    from conftest import mbmem
    (tmp_path / "mem").mkdir()
    (tmp_path / "mem" / "a\nFAKE: b.yaml").write_text("# @package mem.ok\noverlay:\n  summary: a\n")
    out = mbmem("--overlay-dir", str(tmp_path), "list")
    assert not any(line.startswith("FAKE") for line in out.stderr.splitlines()), out.stderr
    assert "a\\nFAKE" in out.stderr
    out = mbmem("list", env={"MBMEM_OVERLAY_DIRS": f"{tmp_path}/x\nFAKE: y"})
    assert out.returncode == EXIT_USAGE and not any(ln.startswith("FAKE") for ln in out.stderr.splitlines())


def test_slurm_creates_the_log_folder_only_once_the_script_is_written(tmp_path):
    from conftest import mbmem
    logs = tmp_path / "logs"
    out = mbmem("slurm", "--recipe", "llama3_8b_pretrain", "--nodes", "1", "--gpus-per-node", "8", "--no-validate",
                "--output-log", f"{logs}/x_%j.log", "-o", str(tmp_path / "no" / "such" / "job.sh"), "--json")
    assert out.returncode == EXIT_USAGE and not logs.exists()
    out = mbmem("slurm", "--recipe", "llama3_8b_pretrain", "--nodes", "1", "--gpus-per-node", "8", "--no-validate",
                "--output-log", f"{logs}/x_%j.log", "-o", str(tmp_path / "job.sh"))
    assert out.returncode == 0 and logs.is_dir() and (tmp_path / "job.sh").is_file()


def test_sizes_are_ascii():
    from conftest import mbmem
    out = mbmem("doctor", str(ROOT / "tests" / "fixtures" / "runs" / "megatron_lm_tp4_pp2.log"), "--gpu-memory",
                "\u0668\u0660GiB", "--json")
    assert out.returncode == EXIT_USAGE and "ASCII digits" in out.stdout


def test_the_api_refuses_an_overlay_folder_that_is_not_one_and_a_locked_key_that_is_no_field(bridge, tmp_path):
    cfg = bridge.build_recipe("llama3_8b_pretrain_config")
    for dirs in (["/dev/zero"], [str(tmp_path / "missing")]):
        with pytest.raises(OverlayError) as exc:
            apply_overlay(cfg, ["expandable_segments"], env={}, overlay_dirs=dirs)
        assert exc.value.problems[0].check == "overlay_dir"
    with pytest.raises(OverlayError, match="names a Python internal|has no field"):
        apply_overlay(cfg, ["expandable_segments"], env={}, locked={"__class__": 1})


def test_explain_prints_a_use_line_that_finds_a_user_overlay(tmp_path):
    from conftest import mbmem
    (tmp_path / "mem").mkdir()
    (tmp_path / "mem" / "mine.yaml").write_text("# @package mem.mine\noverlay:\n  summary: mine\n")
    out = mbmem("--overlay-dir", str(tmp_path), "explain", "mine")
    (use,) = [ln for ln in out.stdout.splitlines() if ln.startswith("use: ")]
    assert use.startswith(f"use: MBMEM_OVERLAY_DIRS={tmp_path.resolve()} python train.py")


def test_the_recipe_check_never_refuses_when_it_cannot_see_bridges_recipes(tmp_path, monkeypatch):
    # a Bridge whose recipe functions are made at import time (not visible in its text) must not get a real
    # recipe refused: the text scan is trusted only when it finds every function train.py ships
    from mbmem_overlays.bridge import recipes as R
    (tmp_path / "megatron" / "bridge" / "recipes").mkdir(parents=True)
    (tmp_path / "megatron" / "bridge" / "recipes" / "made.py").write_text(
        "for n in NAMES:\n    globals()[n] = make(n)\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    assert R.bridge_recipe_functions() is None
    assert R.recipe_name_problem("some_recipe_made_at_import_config") is None
    (tmp_path / "megatron" / "bridge" / "recipes" / "made.py").write_text("".join(
        f"def {R.recipe_spec(R.recipe_file(r))['function'].rpartition('.')[2]}(): ...\n"
        for r in R.shipped_recipes()))
    monkeypatch.setattr(sys, "path", [str(tmp_path), ""])   # a new sys.path: read again
    assert R.bridge_recipe_functions() is not None
    assert R.recipe_name_problem("some_recipe_made_at_import_config") is not None
