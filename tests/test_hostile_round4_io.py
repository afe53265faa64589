"""Hostile input, round 4 (issue 33): printed hints (#8), the allocator environment torch 2.14.1 really reads
(#9-#11), processes with broken stdio or surroundings (#12-#15), large jobs and message size (#19).

The hint tests paste each hint into bash, in a sandbox folder, with ``mbmem`` replaced by a shell function that
records its arguments: a name with ``;``, spaces, ``$(...)``, backquotes or quotes must arrive as one argument,
and nothing else may run (an injected command would create the file PWNED)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mbmem_overlays.core import allocconf, engine, rules
from mbmem_overlays.core.errors import OverlayError, Problem

ROOT = Path(__file__).resolve().parents[1]
MBMEM = [sys.executable, "-m", "mbmem_overlays.cli"]

HOSTILE_NAMES = [
    "a b",
    "x; touch PWNED",
    "$(touch PWNED)",
    "`touch PWNED`",
    "it's \"quoted\"",
    "semi;colon & amp | pipe > gt",
    "-leading-dash",
    "* star ?",
]

# mbmem and cat stand-ins: record each argument on its own line (NUL-free names), and what came on stdin.
RECORDER = ('mbmem() { printf "%s\\n" "$@" > "$SANDBOX/.args"; if [ "${@: -1}" = "-" ]; then '
            'command cat > "$SANDBOX/.stdin"; fi; }\n')


def paste(command: str, sandbox: Path, *, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``command`` as a user pasting it would (bash, in ``sandbox``), after ``bash -n`` accepted it."""
    assert subprocess.run(["bash", "-n", "-c", command], capture_output=True).returncode == 0, command
    full = {**os.environ, "SANDBOX": str(sandbox), **(env or {})}
    done = subprocess.run(["bash", "-c", RECORDER + command], cwd=sandbox, capture_output=True, text=True,
                          env=full, timeout=30)
    assert not list(sandbox.rglob("PWNED")), f"the hint ran an injected command: {command}"
    return done


def recorded_args(sandbox: Path) -> list[str]:
    return (sandbox / ".args").read_text().splitlines()


class FakeView:
    """The part of the engine's View the profiling checks read."""

    def __init__(self, fields, selected=(), params=None, world_size=None, env=None):
        self.fields, self.selected, self.params, self.world_size = fields, selected, params or {}, world_size
        self.env = env or {}

    def get(self, path, default=None):
        return self.fields.get(path, default)

    def parties(self, *paths):
        return ("config",)


def run_check(check_id: str, view) -> list:
    check = next(c for c in rules.CHECKS if c.id == check_id)
    return list(check(view))


# ----------------------------------------------------------------------------- 8. hints are pasted, not executed
@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_cat_into_doctor_hint(tmp_path, name):
    from mbmem_overlays.doctor.read import skipped_problem
    (tmp_path / name).write_text("hello log\n")
    hint = skipped_problem(name, "a fifo")
    command = re.search(r"`(cat -- .*\| mbmem doctor -)`", hint).group(1)
    paste(command, tmp_path)
    assert (tmp_path / ".stdin").read_text() == "hello log\n"


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_snapshot_folder_mkdir_hint(tmp_path, name):
    path = str(tmp_path / name / "deeper" / "snap.pickle")
    found = run_check("memory_snapshot_folder", FakeView({"profiling.record_memory_history": True,
                                                          "profiling.memory_snapshot_path": path}))
    hint = next(w for w in found if isinstance(w, str) and "mkdir -p" in w)
    command = re.search(r"\((mkdir -p -- .*)\) or an OOM", hint).group(1)
    paste(command, tmp_path)
    assert (tmp_path / name / "deeper").is_dir()


@pytest.mark.parametrize("name", HOSTILE_NAMES)
@pytest.mark.parametrize("ext", [".pickle", ""])
def test_snapshot_glob_hint_keeps_the_glob(tmp_path, name, ext):
    folder = tmp_path / name
    folder.mkdir()
    base = str(folder / "memory snapshot;x")
    for suffix in ("_oom_rank-3", "_0"):
        Path(base + suffix + ext).write_bytes(b"")
    found = run_check("memory_history_cost", FakeView({"profiling.record_memory_history": True,
                                                       "profiling.profile_ranks": [0, 3],
                                                       "profiling.memory_snapshot_path": base + ext}))
    note = next(w for w in found if isinstance(w, str) and "mbmem doctor" in w)
    command = re.search(r"`(mbmem doctor .*)`$", note).group(1)
    paste(command, tmp_path)
    assert sorted(recorded_args(tmp_path)) == sorted(["doctor", base + "_0" + ext, base + "_oom_rank-3" + ext])


@pytest.mark.parametrize("value", HOSTILE_NAMES)
def test_export_hint_of_an_environment_conflict(tmp_path, value):
    _, problems = engine._env_plan([engine.EnvClaim("ov", "MY_VAR", value=value)], {"MY_VAR": "other"})
    command = re.search(r"or (export MY_VAR=.*)$", problems[0].fix).group(1)
    paste(command + '; printf "%s" "$MY_VAR" > "$SANDBOX/.value"', tmp_path)
    assert (tmp_path / ".value").read_text() == value


@pytest.mark.parametrize("name", HOSTILE_NAMES)
def test_overlay_name_hints(tmp_path, name):
    fix = engine.unselected_problem(name, "mem.x.y", 1).fix
    command = "mbmem apply " + re.search(r"/ (--overlay .*)\), or drop", fix).group(1)
    paste(command, tmp_path)
    assert recorded_args(tmp_path) == ["apply", "--overlay", name]


# ----------------------------------------------------------------------------- 9-11. the variable torch reads
def test_user_alloc_conf_is_kept_in_the_variable_torch_reads():
    claim = engine.EnvClaim("expandable_segments", "PYTORCH_CUDA_ALLOC_CONF", merge={"expandable_segments": "True"})
    for user in ("max_split_size_mb:512", "backend:native,garbage_collection_threshold:0.6"):
        plan, problems = engine._env_plan([claim], {"PYTORCH_ALLOC_CONF": user})
        assert not problems
        assert plan["PYTORCH_CUDA_ALLOC_CONF"][2] == f"{user},expandable_segments:True"
        assert plan["PYTORCH_ALLOC_CONF"][2] == f"{user},expandable_segments:True"  # the two never disagree


def test_the_users_variable_wins_over_a_recipe_that_creates_the_primary():
    """Bridge's recipes put PYTORCH_CUDA_ALLOC_CONF in cfg.env_vars (applied with setdefault): at launch it would
    shadow the user's PYTORCH_ALLOC_CONF. The merge keeps both, the user's keys winning."""
    claim = engine.EnvClaim("expandable_segments", "PYTORCH_CUDA_ALLOC_CONF", merge={"expandable_segments": "True"})
    process = {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512,garbage_collection_threshold:0.7"}
    effective = {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6", **process}
    plan, problems = engine._env_plan([claim], effective, process)
    assert not problems
    assert plan["PYTORCH_CUDA_ALLOC_CONF"][2] == \
        "max_split_size_mb:512,garbage_collection_threshold:0.7,expandable_segments:True"


def test_a_set_but_empty_primary_is_what_torch_reads():
    claim = engine.EnvClaim("expandable_segments", "PYTORCH_CUDA_ALLOC_CONF", merge={"expandable_segments": "True"})
    plan, _ = engine._env_plan([claim], {"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "max_split_size_mb:512"})
    assert plan["PYTORCH_CUDA_ALLOC_CONF"][2] == "expandable_segments:True"
    view = FakeView({}, env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
                             "PYTORCH_ALLOC_CONF": "max_split_size_mb:512,expandable_segments:True"})
    said = run_check("allocator_settings_torch_accepts", view)
    assert any(s.startswith("note: torch reads PYTORCH_CUDA_ALLOC_CONF") and "ignores PYTORCH_ALLOC_CONF" in s
               for s in said)
    assert any("max_split_size_mb:512, which torch ignores" in s and
               "export PYTORCH_CUDA_ALLOC_CONF=max_split_size_mb:512,expandable_segments:True" in s for s in said)


def test_a_claim_on_the_secondary_variable_lands_where_torch_reads():
    claim = engine.EnvClaim("mine", "PYTORCH_ALLOC_CONF", merge={"expandable_segments": "True"})
    plan, _ = engine._env_plan([claim], {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"})
    assert plan["PYTORCH_CUDA_ALLOC_CONF"][2] == "max_split_size_mb:256,expandable_segments:True"


@pytest.mark.parametrize("user, fragment", [
    ("max_split_size_mb:8", "must be at least 20"),
    ("garbage_collection_threshold:1.5", "strictly between 0 and 1"),
    ("expandable_segment:True", "is not a setting torch knows"),
    ("backend:cudaMallocAsyn", "must be one of"),
])
def test_values_torch_refuses_are_refused_before_export(user, fragment):
    claim = engine.EnvClaim("expandable_segments", "PYTORCH_CUDA_ALLOC_CONF", merge={"expandable_segments": "True"})
    _, problems = engine._env_plan([claim], {"PYTORCH_ALLOC_CONF": user})
    assert problems and fragment in problems[0].message and problems[0].fix
    said = run_check("allocator_settings_torch_accepts", FakeView({}, env={"PYTORCH_ALLOC_CONF": user}))
    assert any(isinstance(p, Problem) and fragment in p.message for p in said)


def test_expandable_segments_under_cuda_malloc_async_is_refused_not_applied():
    env = {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync,expandable_segments:True"}
    said = run_check("expandable_segments_async_backend", FakeView({}, selected=("expandable_segments",), env=env))
    assert len(said) == 1 and isinstance(said[0], Problem)
    assert "does nothing" in said[0].message and "backend:cudaMallocAsync" in said[0].fix
    alone = run_check("expandable_segments_async_backend", FakeView({}, env=env))
    assert alone and all(isinstance(s, str) and "does nothing" in s for s in alone)


@pytest.mark.bridge
def test_apply_keeps_the_users_settings_and_refuses_the_async_backend(recipe, clean_env):
    from mbmem_overlays import apply_overlay
    cfg = recipe("llama3_8b_pretrain_config")
    cfg.env_vars = {"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"}
    env = {**clean_env, "PYTORCH_ALLOC_CONF": "max_split_size_mb:512"}
    report = apply_overlay(cfg, "expandable_segments", env=env)
    kept = "max_split_size_mb:512,garbage_collection_threshold:0.6,expandable_segments:True"
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == kept and cfg.env_vars["PYTORCH_CUDA_ALLOC_CONF"] == kept
    assert any(n.startswith("torch reads PYTORCH_CUDA_ALLOC_CONF=") for n in report.notes)
    cfg = recipe("llama3_8b_pretrain_config")
    cfg.env_vars = {}
    env = {**clean_env, "PYTORCH_ALLOC_CONF": "backend:cudaMallocAsync"}
    before = dict(env)
    with pytest.raises(OverlayError, match="does nothing"):
        apply_overlay(cfg, "expandable_segments", env=env)
    assert env == before


def test_slurm_no_validate_carries_the_inherited_keys():
    from mbmem_overlays.core.catalog import Catalog
    from mbmem_overlays.launch.slurm import static_env
    env = static_env(["expandable_segments"], Catalog(), {"PYTORCH_ALLOC_CONF": "max_split_size_mb:512"})
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:512,expandable_segments:True"


# ----------------------------------------------------------------------------- 12-15. broken stdio, deleted cwd
def run(args, *, env=None, cwd=ROOT, shell_redirect="", timeout=120):
    full = {**os.environ, **(env or {})}
    command = " ".join(map(_q, args)) + " " + shell_redirect
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=full, capture_output=True, timeout=timeout)


def _q(word: str) -> str:
    import shlex
    return shlex.quote(word)


ASCII_ENVS = [{"PYTHONIOENCODING": "ascii"}, {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0",
                                               "PYTHONCOERCECLOCALE": "0"}]


@pytest.mark.parametrize("env", ASCII_ENVS)
def test_ascii_only_streams_never_raise(tmp_path, env):
    name = tmp_path / "log \u2014 caf\u00e9 \u202e.log"
    name.write_text("nothing here\n")
    for args in (["explain", "expandable_segments"], ["doctor", str(name)], ["doctor", str(name), "--json"],
                 ["explain", "no_such_overlay_\u2014"]):
        done = run([*MBMEM, *args], env=env)
        text = (done.stdout + done.stderr).decode("ascii")  # nothing but ASCII reached the streams
        assert "UnicodeEncodeError" not in text and "Traceback" not in text, text
        assert done.returncode in (0, 2, 3), text
    train = run([sys.executable, "train.py", "recipe=llama\u2014x"], env=env)
    text = (train.stdout + train.stderr).decode("ascii")
    assert train.returncode == 2 and "Traceback" not in text and "llama\\u" in text  # escaped, not raised


def test_closed_stderr_never_reaches_json_stdout(tmp_path):
    for args in (["doctor", str(tmp_path / "missing.log"), "--json"], ["explain", "nope", "--json"],
                 ["list", "--json"]):
        done = run([*MBMEM, *args], shell_redirect="2>&-")
        json.loads(done.stdout)  # one JSON object, nothing else
    train = run([sys.executable, "train.py", "recipe=no_such_recipe", "run.json=true"], shell_redirect="2>&-")
    assert train.returncode == 2
    assert json.loads(train.stdout)["exit_code"] == 2


def test_deleted_working_directory_is_one_line(tmp_path):
    gone = tmp_path / "gone"
    script = (f"mkdir -p {_q(str(gone))} && cd {_q(str(gone))} && rmdir {_q(str(gone))} && "
              f"PYTHONPATH={_q(str(ROOT / 'src'))} {_q(sys.executable)} -m mbmem_overlays.cli ")
    for args in ("slurm --recipe llama3_8b_pretrain --nodes 1 --gpus-per-node 8 --no-validate --output-log x/log.txt",
                 "--overlay-dir some_overlays list", "doctor some.log"):
        done = subprocess.run(["bash", "-c", script + args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().count("\n") == 0 and "the working directory no longer exists" in done.stderr
        assert "Traceback" not in done.stderr and "bug" not in done.stderr
    done = subprocess.run(["bash", "-c", script + "apply --recipe x --json"], capture_output=True, text=True,
                          timeout=120)
    assert json.loads(done.stdout)["exit_code"] == 2
    train = subprocess.run(["bash", "-c", f"cd {_q(str(tmp_path))} && mkdir g && cd g && rmdir ../g && "
                                          f"{_q(sys.executable)} {_q(str(ROOT / 'train.py'))} recipe=llama3_8b_pretrain"],
                           capture_output=True, text=True, timeout=120)
    assert train.returncode == 2 and "the working directory no longer exists" in train.stderr
    assert "Primary config" not in train.stderr and "Traceback" not in train.stderr


def test_snapshot_resolver_without_a_working_directory(tmp_path):
    """The API (no entry point checked the cwd): the relative snapshot path is refused with the reason."""
    from mbmem_overlays.core.rules import profiling
    gone = tmp_path / "gone"
    gone.mkdir()
    here = os.getcwd()
    os.chdir(gone)
    gone.rmdir()
    try:
        folder = profiling.run_folder(FakeView({}))
        said = run_check("memory_snapshot_folder", FakeView({"profiling.record_memory_history": True,
                                                             "profiling.memory_snapshot_path":
                                                             os.path.join(folder, "memory_snapshot.pickle")}))
    finally:
        os.chdir(here)
    assert any(isinstance(p, Problem) and "the working directory no longer exists" in p.message for p in said)


@pytest.mark.parametrize("redirect", [">&-", ">/dev/full", "| head -c 0"])
@pytest.mark.parametrize("command", [[*MBMEM, "--help"], [*MBMEM, "doctor", "--help"], [*MBMEM, "slurm", "-h"],
                                     [sys.executable, "train.py", "--help"]])
def test_help_to_a_closed_or_full_stdout_is_74(command, redirect):
    if redirect.startswith("|"):
        done = run(command, shell_redirect=redirect + "; exit ${PIPESTATUS[0]}")
    else:
        done = run(command, shell_redirect=redirect)
    assert done.returncode == 74, done.stderr
    assert b"Traceback" not in done.stderr


# ----------------------------------------------------------------------------- 19. large jobs, bounded messages
def test_ranks_all_past_the_override_limit_is_one_line_before_bridge():
    done = run([*MBMEM, "args", "--recipe", "llama3_8b_pretrain_config", "-O", "memory_snapshot", "--param",
                "memory_snapshot.ranks=all", "--world-size", "4096"], timeout=60)
    assert done.returncode == 2
    assert len(done.stderr) < 800 and b"ranks=auto" in done.stderr and b"importing Megatron Bridge" not in done.stderr


def test_launcher_override_too_long_is_bounded():
    from mbmem_overlays.launch.nemo_run import hydra_word
    with pytest.raises(OverlayError) as info:
        hydra_word("profiling.profile_ranks", list(range(20_000)))
    assert len(str(info.value)) < 800 and "ranks=auto" in str(info.value)


def test_every_message_is_bounded_in_text_and_json():
    from mbmem_overlays.core.report import render_error_json
    huge = Problem(("x",), "f" * 5000, list(range(100_000)), "m" * 100_000, "fix " * 10_000)
    error = OverlayError([huge] * 500)
    assert len(str(error)) < 40_000 and "more problems" in str(error)
    one = json.loads(render_error_json(OverlayError([huge]), 1))
    assert len(json.dumps(one)) < 10_000 and "more characters not shown" in one["problems"][0]["message"]
