"""Hostile input at the entry points (`mbmem apply`, `train.py`): a clear error and the documented exit
code, never a traceback, nothing run that is not a recipe, nothing exported that is not a name.

Issue 15 (#2, #3, #7, #10, #12, #14), issue 14 item 6 (exit code 3 for an incomplete validation) and
issue 17 ("Entry points do what Bridge does", "Fast, quiet, visible"). The cases that fail before Bridge
is imported run as real subprocesses and must answer in seconds; the others share one Bridge import.
"""

from __future__ import annotations

import json
import sys
import time

import pytest
from conftest import ROOT, mbmem, snapshot, train

from mbmem_overlays.bridge.recipes import (
    RECIPE_MODULES_ENV,
    recipe_name_problem,
    training_mode,
    world_size_problem,
)
from mbmem_overlays.bridge.validation import ValidationResult
from mbmem_overlays.core.engine import Report
from mbmem_overlays.core.report import (
    EXIT_INCOMPLETE,
    EXIT_OK,
    EXIT_REJECTED,
    EXIT_USAGE,
    SCHEMA_VERSION,
    exit_code,
    render_text,
)
from mbmem_overlays.core.sizes import parse_size
from mbmem_overlays.launch import hydra_entry

NO_TE = pytest.mark.skipif(__import__("importlib").util.find_spec("transformer_engine") is not None,
                           reason="with Transformer Engine installed, Bridge's validation completes")
FAST = 20  # seconds: the whole process, with Python start-up, and without the 20-30 s Bridge import


def no_traceback(out) -> None:
    assert "Traceback" not in out.stderr and "Traceback" not in out.stdout, out.stderr[-3000:]


# ------------------------------------------------------------------ cheap errors, before the Bridge import

TRAIN_CASES = [
    # (argv, environment, what the message must name)
    (["+mem=lora_regather"], {}, "no recipe selected"),                       # issue 17: no silent default
    (["recipe=llama3_8b_peft", "+mem.cpu_offload=5"], {}, "mem.cpu_offload holds the overlay's parameters"),
    (["recipe=llama3_8b_peft", "run.world_size=abc"], {}, "world size must be a positive integer"),
    (["recipe=llama3_8b_peft", "run.world_size=0"], {}, "world size must be a positive integer"),
    (["recipe=llama3_8b_peft", "run.world_size=-8"], {}, "world size must be a positive integer"),
    (["recipe=llama3_8b_peft", "run.gpu_memory=abc"], {}, "cannot read memory size 'abc'"),
    (["recipe=llama3_8b_peft", "run.gpu_memory=1.2.3GiB"], {}, "cannot read memory size"),
    (["recipe=llama3_8b_peft"], {"RANK": "abc"}, "RANK='abc'"),
    (["recipe=llama3_8b_peft", "+mem=cpu_offload", "mem.cpu_offload.num_layers=abc"], {}, "must be an integer"),
    (["recipe.function=os.system"], {}, "outside the recipe modules"),
    (["recipe.function=builtins.exit"], {}, "outside the recipe modules"),
    (["recipe.function=os.getcwd"], {}, "outside the recipe modules"),
    (["recipe=llama3_8b_peft", "model.__class__=1"], {}, "dunder"),
    (["recipe=llama3_8b_peft", "model..x=1"], {}, "cannot parse 'model..x=1'"),
    (["recipe=llama3_8b_peft", "model.seq_length=[1,"], {}, "cannot parse 'model.seq_length=[1,'"),
]


@pytest.mark.parametrize("argv,env,message", TRAIN_CASES, ids=[" ".join(c[0]) + str(c[1]) for c in TRAIN_CASES])
def test_train_refuses_fast_and_cleanly(argv, env, message, tmp_path):
    start = time.monotonic()
    out = train(*argv, env={"MBMEM_RUNS_DIR": str(tmp_path), **env}, timeout=120)
    assert out.returncode == EXIT_USAGE, (out.returncode, out.stderr[-2000:])
    assert message in out.stderr
    no_traceback(out)
    assert "importing Megatron Bridge" not in out.stderr  # refused before the import
    assert time.monotonic() - start < FAST


def test_train_without_recipe_lists_the_recipes_and_points_lora_users_at_peft(tmp_path):
    out = train("+mem=lora_regather", env={"MBMEM_RUNS_DIR": str(tmp_path)})
    assert "recipe=llama3_8b_peft" in out.stderr and "recipe=qwen3_8b_pretrain" in out.stderr
    assert "*_peft recipe" in out.stderr


def test_recipe_function_never_runs_a_command(tmp_path):
    marker = tmp_path / "pwned"
    out = train("recipe.function=os.system", f"+recipe.kwargs.command='touch {marker}'",
                env={"MBMEM_RUNS_DIR": str(tmp_path / "runs")})
    assert out.returncode == EXIT_USAGE and not marker.exists()
    no_traceback(out)


@pytest.mark.parametrize("target", ["file", "file/below"])
def test_train_runs_dir_that_is_a_file(tmp_path, target):
    (tmp_path / "file").write_text("not a folder")
    out = train("recipe=llama3_8b_peft", env={"MBMEM_RUNS_DIR": str(tmp_path / target)})
    assert out.returncode == EXIT_USAGE and "is not a directory" in out.stderr and "MBMEM_RUNS_DIR" in out.stderr
    no_traceback(out)


def test_train_json_errors_are_one_json_object(tmp_path):
    out = train("recipe=llama3_8b_peft", "run.world_size=0", "run.json=true", env={"MBMEM_RUNS_DIR": str(tmp_path)})
    doc = json.loads(out.stdout)
    assert doc["schema_version"] == SCHEMA_VERSION and doc["exit_code"] == EXIT_USAGE and not doc["ok"]
    assert doc["problems"][0]["field"] == "run.world_size"


APPLY_CASES = [
    (["--recipe", "llama3_8b_pretrain", "--world-size", "0"], "must be a positive integer"),
    (["--recipe", "llama3_8b_pretrain", "--world-size", "-4"], "must be a positive integer"),
    (["--recipe", "llama3_8b_pretrain", "--world-size", "abc"], "must be a positive integer"),
    (["--recipe", "os.system"], "outside the recipe modules"),
    (["--recipe", "builtins.exit"], "outside the recipe modules"),
    (["--recipe", "os.getcwd"], "outside the recipe modules"),
    (["--recipe", "llama3_8b_pretrain", "--set", "model..x=1"], "cannot parse override 'model..x=1'"),
    (["--recipe", "llama3_8b_pretrain", "--set", "model.seq_length=[1,"], "cannot parse override"),
    (["--recipe", "llama3_8b_pretrain", "--set", "model.__class__=1"], "dunder"),
    (["--recipe", "llama3_8b_pretrain", "-O", "nope"], "unknown overlay 'nope'"),
]


@pytest.mark.parametrize("argv,message", APPLY_CASES, ids=[" ".join(c[0]) for c in APPLY_CASES])
def test_apply_refuses_fast_and_cleanly(argv, message):
    start = time.monotonic()
    out = mbmem("apply", *argv)
    assert out.returncode == EXIT_USAGE, (out.returncode, out.stderr[-2000:])
    assert message in out.stderr
    no_traceback(out)
    assert time.monotonic() - start < FAST
    # --json: the same failure as one JSON object on stdout (never an empty stdout)
    out = mbmem("apply", *argv, "--json")
    doc = json.loads(out.stdout)
    assert doc["schema_version"] == SCHEMA_VERSION and doc["exit_code"] == EXIT_USAGE and message in doc["error"]


def test_apply_reports_every_cheap_problem_at_once():
    out = mbmem("apply", "--recipe", "llama3_8b_pretrain", "-O", "nope,cpu_offload",
                "--set", "mem.cpu_offload.num_layerz=2", "--set", "model..x=1", "--set", "model.seq_length=[1,")
    assert out.returncode == EXIT_USAGE and "4 problems found" in out.stderr
    for fragment in ("unknown overlay 'nope'", "did you mean 'num_layers'", "'model..x=1'", "'model.seq_length=[1,'"):
        assert fragment in out.stderr
    no_traceback(out)


# ------------------------------------------------------------------ pure functions behind the entry points


@pytest.mark.parametrize("text,expected", [("80GiB", 80 * 2**30), ("80 GiB", 80 * 2**30), ("80gib", 80 * 2**30),
                                           ("80GB", 80e9), ("80G", 80e9), ("85899345920", 85899345920),
                                           ("1.5 TiB", 1.5 * 2**40), ("512MiB", 512 * 2**20)])
def test_parse_size_reads_the_usual_spellings(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["abc", "1.2.3GiB", "nan", "inf", "-5G", "0", "", "80XB", "9" * 400, "2PiB"])
def test_parse_size_refuses_with_a_clear_value_error(text):
    from mbmem_overlays.core.sizes import SizeError
    with pytest.raises(SizeError, match="memory size"):   # a ValueError, which mbmem turns into exit 2
        parse_size(text)


@pytest.mark.parametrize("value", [0, -1, "0", "-8", "abc", "8.5", 2.0, True, None, "²"])
def test_world_size_must_be_a_positive_integer(value):
    assert world_size_problem(value, "run.world_size") is not None


@pytest.mark.parametrize("value", [1, 8, "16"])
def test_world_size_accepts_positive_integers(value):
    assert world_size_problem(value, "run.world_size") is None


@pytest.mark.parametrize("name", ["os.system", "builtins.exit", "os.getcwd", "subprocess.run", "megatron.bridge.training.pretrain.pretrain",
                                  "megatron.bridge.recipes_evil.x", "megatron.bridge.recipes.llama._private",
                                  "megatron.bridge.recipes.__builtins__.exit", "x; rm -rf ~", "", None, 5])
def test_recipe_names_outside_the_recipe_modules_are_refused_before_import(name):
    assert recipe_name_problem(name) is not None


def test_recipe_modules_are_extended_only_explicitly(monkeypatch):
    assert recipe_name_problem("my_recipes.big_config") is not None
    monkeypatch.setenv(RECIPE_MODULES_ENV, "my_recipes, other.pkg")
    assert recipe_name_problem("my_recipes.big_config") is None
    assert recipe_name_problem("other.pkg.sub.fn_config") is None
    assert recipe_name_problem("my_recipes_evil.fn") is not None
    assert recipe_name_problem("llama3_8b_pretrain_config") is None and recipe_name_problem(
        "megatron.bridge.recipes.llama.llama3_8b_peft_config") is None


@pytest.mark.parametrize("function,mode", [
    ("megatron.bridge.recipes.llama.llama3_8b_sft_config", "finetune"),
    ("megatron.bridge.recipes.llama.llama3_8b_peft_config", "finetune"),
    ("llama32_1b_finetune_config", "finetune"),
    ("megatron.bridge.recipes.llama.llama3_70b_pretrain_config", "pretrain"),
])
def test_training_mode_follows_bridges_run_recipe(function, mode):
    """scripts/training/run_recipe.py infer_train_mode: the name decides when it says one of the two."""
    assert training_mode(function, None)[0] == mode


def incomplete_report() -> Report:
    report = Report(overlays=("expandable_segments",), params={"expandable_segments": {}})
    stopped = ("model.rotary_interleaved: rotary_interleaved does not work with apply_rope_fusion for TE < 2.3.0 "
               "(needs Transformer Engine; validation stopped here, later checks did not run)")
    report.validation = ValidationResult(True, 8, None, None, [stopped], [], complete=False)
    return report


def test_incomplete_validation_is_exit_code_3_and_says_what_did_not_run():
    report = incomplete_report()
    assert exit_code(report) == EXIT_INCOMPLETE
    text = render_text(report)
    assert "validation: INCOMPLETE" in text and "stopped at: model.rotary_interleaved" in text
    assert "not run here: every check of Bridge's runtime_config_update after that one" in text
    assert "exit code 3" in text
    report.validation.complete = True
    assert exit_code(report) == EXIT_OK
    report.validation.ok = False
    assert exit_code(report) == EXIT_REJECTED


def test_default_text_is_short_and_verbose_lists_the_rules():
    report = incomplete_report()
    report.checks = [f"rule_{i}" for i in range(40)]
    short, long = render_text(report, user_changes=[("model.tensor_model_parallel_size", 1, 2)]), \
        render_text(report, verbose=True)
    assert "rules checked: 40 (-v lists them)" in short and "rule_39" not in short
    assert "rule_39" in long
    assert "[you] model.tensor_model_parallel_size: 1 -> 2" in short


@pytest.mark.parametrize("name", ["X=1; touch /tmp/pwned #", "my.var", "1ABC", "A B", ""])
def test_environment_names_are_checked_before_export(name, monkeypatch):
    report = Report(overlays=("mine",), params={})
    report.env_to_export = {"GOOD_NAME": "1", name: "1"}
    problems = hydra_entry.env_name_problems(report)
    assert [p.field for p in problems] == [name]
    monkeypatch.delenv("GOOD_NAME", raising=False)
    with pytest.raises(hydra_entry.OverlayError):
        hydra_entry.export_environment(report, None)
    import os
    assert "GOOD_NAME" not in os.environ  # nothing exported unless every name is valid


def test_a_sweep_exits_with_the_worst_job_after_listing_every_verdict(capsys, monkeypatch):
    monkeypatch.setattr(hydra_entry, "JOBS", [hydra_entry.JobResult(0, "+mem=a", 0), hydra_entry.JobResult(1, "+mem=b", 3),
                                             hydra_entry.JobResult(2, "+mem=c", 1)])
    assert hydra_entry.finish() == EXIT_REJECTED
    err = capsys.readouterr().err
    assert "sweep: 3 jobs" in err and "#1 incomplete (exit 3): +mem=b" in err and "#2 rejected (exit 1)" in err


def test_sweep_folders_are_unique_per_sweep():
    """Two sweeps started in the same second used to share one folder (issue 15 #7)."""
    from hydra import compose, initialize_config_dir
    dirs = []
    for _ in range(2):
        with initialize_config_dir(config_dir=str(ROOT / "recipes"), version_base="1.3"):
            cfg = compose("train", overrides=["recipe=llama3_8b_pretrain"], return_hydra_config=True)
            dirs.append(str(cfg.hydra.sweep.dir))
    assert dirs[0] != dirs[1]
    assert dirs[0].rsplit("-", 1)[1] == str(__import__("os").getpid())


# ------------------------------------------------------------------ with Bridge (one import, in-process)


@pytest.mark.bridge
def test_overrides_convert_as_in_bridges_scripts(bridge, recipe):
    import torch
    cfg = recipe("llama3_8b_pretrain_config")
    bridge.apply_overrides(cfg, ["model.params_dtype=float32"])   # a string before this change (issue 17)
    assert cfg.model.params_dtype is torch.float32
    bridge.apply_overrides(cfg, ["model.params_dtype=bf16"])      # Bridge's short names too (str_to_dtype)
    assert cfg.model.params_dtype is torch.bfloat16


@pytest.mark.bridge
def test_overrides_are_all_reported_and_atomic(bridge, recipe):
    from mbmem_overlays import OverlayError
    cfg = recipe("llama3_8b_pretrain_config")
    before = snapshot(cfg)
    with pytest.raises(OverlayError) as exc:
        bridge.apply_overrides(cfg, ["model.tensor_model_parallel_size=2", "model.params_dtype=bfloat17",
                                     "model.__class__=1", "model.tensor_model_parall_size=2"])
    assert len(exc.value.problems) == 3 and "bfloat17" in str(exc.value) and "dunder" in str(exc.value)
    assert snapshot(cfg) == before


@pytest.mark.bridge
def test_only_recipe_functions_run_and_must_return_a_config(bridge, tmp_path, monkeypatch):
    from mbmem_overlays import OverlayError
    with pytest.raises(OverlayError, match="not a recipe function"):  # a class imported into a recipe module
        bridge.build_recipe("megatron.bridge.recipes.common.ConfigContainer")
    with pytest.raises(OverlayError, match="not a recipe function"):  # a helper re-exported by the package
        bridge.build_recipe("set_deepseek_v4_pipeline_model_parallel_layout")
    (tmp_path / "my_recipes.py").write_text("def not_a_config():\n    return {'model': 1}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(OverlayError, match="outside the recipe modules"):
        bridge.build_recipe("my_recipes.not_a_config")
    monkeypatch.setenv(RECIPE_MODULES_ENV, "my_recipes")
    with pytest.raises(OverlayError, match="returned dict, not a ConfigContainer"):
        bridge.build_recipe("my_recipes.not_a_config")


def cli(*argv):
    from mbmem_overlays.cli import main
    return main(list(argv))


@pytest.mark.bridge
def test_apply_reports_override_typos_with_overlay_problems(bridge, capsys):
    code = cli("apply", "--recipe", "llama3_8b_pretrain_config", "-O", "cpu_offload", "--world-size", "32",
               "--set", "model.pipeline_model_parallel_size=4", "--set", "model.tensor_model_parall_size=2")
    err = capsys.readouterr().err
    assert code == EXIT_REJECTED and "2 problems found" in err
    assert "Did you mean model.tensor_model_parallel_size" in err and "Pipeline parallelism" in err


@pytest.mark.bridge
def test_apply_json_marks_user_overrides_and_carries_the_schema_version(bridge, capsys):
    code = cli("apply", "--recipe", "llama3_8b_pretrain_config", "-O", "expandable", "--world-size", "8",
               "--set", "model.tensor_model_parallel_size=2", "--set", "model.params_dtype=bfloat16", "--json")
    doc = json.loads(capsys.readouterr().out)
    assert code == doc["exit_code"] == EXIT_OK and doc["schema_version"] == SCHEMA_VERSION
    assert {"target": "model.tensor_model_parallel_size", "old": 1, "new": 2} in doc["user_overrides"]
    assert doc["env_to_export"]["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


@pytest.mark.bridge
def test_apply_text_is_short_marks_overrides_and_names_the_next_step(bridge, capsys):
    code = cli("apply", "--recipe", "llama3_8b_pretrain_config", "-O", "expandable", "--world-size", "8",
               "--set", "model.tensor_model_parallel_size=2")
    out = capsys.readouterr().out
    assert code == EXIT_OK
    assert "[you] model.tensor_model_parallel_size: 1 -> 2" in out and "(-v lists them)" in out
    assert "next: python train.py recipe=llama3_8b_pretrain_config" not in out  # a function name goes to recipe.function
    assert "next: python train.py recipe.function=llama3_8b_pretrain_config '+mem=[expandable]'" in out


@pytest.mark.bridge
@NO_TE
def test_apply_incomplete_validation_exits_3(bridge, capsys):
    """rotary_interleaved with rope fusion needs TE >= 2.3 (transformer_config.py, the apply_rope_fusion block):
    on a host without TE, Bridge's validation stops there; the verdict must not be a plain pass."""
    code = cli("apply", "--recipe", "llama3_8b_pretrain_config", "-O", "expandable", "--world-size", "8",
               "--set", "model.rotary_interleaved=true")
    out = capsys.readouterr().out
    assert code == EXIT_INCOMPLETE, out[-2000:]
    assert "validation: INCOMPLETE" in out and "stopped at:" in out and "rotary_interleaved" in out


@pytest.mark.bridge
@pytest.mark.parametrize("as_json", [False, True])
def test_apply_bridge_rejection_prints_the_report_and_exits_1(bridge, capsys, as_json):
    """A layout only Bridge refuses: 32 heads over TP3 (megatron-core TransformerConfig.__post_init__).
    Whether the engine returns the rejected report or raises ValidationRejected with it, the user gets
    the report, the verdict and exit code 1."""
    code = cli("apply", "--recipe", "llama3_8b_pretrain_config", "-O", "expandable", "--world-size", "6",
               "--set", "model.tensor_model_parallel_size=3", "--set", "train.global_batch_size=513",
               *(["--json"] if as_json else []))
    captured = capsys.readouterr()
    assert code == EXIT_REJECTED and "Traceback" not in captured.err
    assert "num_attention_heads (32) must be a multiple of tensor_model_parallel_size (3)" in captured.err
    if as_json:
        doc = json.loads(captured.out)
        assert doc["exit_code"] == EXIT_REJECTED and doc["validation"]["ok"] is False and not doc["ok"]
        assert doc["user_overrides"][0]["target"] == "model.tensor_model_parallel_size"
    else:
        assert "validation: REJECTED by Bridge validation" in captured.out and "[you] train.global_batch_size" in captured.out


@pytest.mark.bridge
def test_train_sft_recipe_says_finetune(bridge, tmp_path, capsys):
    from hydra import compose, initialize_config_dir
    with initialize_config_dir(config_dir=str(ROOT / "recipes"), version_base="1.3"):
        cfg = compose("train", overrides=["recipe=llama3_8b_sft", "run.dry_run=true", f"+run.record_dir={tmp_path}"])
    assert hydra_entry.run(cfg) == EXIT_OK
    out = capsys.readouterr().out
    assert "megatron.bridge.training.finetune.finetune(cfg, forward_step)" in out and "pretrain(" not in out
    assert "run_recipe.py" in out


@pytest.mark.bridge
def test_train_overrides_are_typed_by_bridge(bridge, tmp_path):
    from hydra import compose, initialize_config_dir
    with initialize_config_dir(config_dir=str(ROOT / "recipes"), version_base="1.3"):
        cfg = compose("train", overrides=["recipe=llama3_8b_pretrain", "run.dry_run=true", f"+run.record_dir={tmp_path}",
                                          "+bridge.model.params_dtype=float32"])
    assert hydra_entry.run(cfg) == EXIT_OK
    record = json.loads((tmp_path / "mbmem_report.json").read_text())
    assert {"target": "model.params_dtype", "old": "torch.bfloat16", "new": "torch.float32"} in record["user_overrides"]


def compose_train(*overrides):
    from hydra import compose, initialize_config_dir
    with initialize_config_dir(config_dir=str(ROOT / "recipes"), version_base="1.3"):
        return compose("train", overrides=list(overrides))


@pytest.mark.bridge
def test_train_reports_override_typos_with_overlay_problems(bridge, tmp_path, capsys):
    cfg = compose_train("recipe=llama3_8b_pretrain", "+mem=cpu_offload", "run.dry_run=true", "run.world_size=32",
                        f"+run.record_dir={tmp_path}", "+bridge.model.pipeline_model_parallel_size=4",
                        "+bridge.model.tensor_model_parall_size=2")
    assert hydra_entry.run(cfg) == EXIT_REJECTED
    err = capsys.readouterr().err
    assert "2 problems found" in err and "Did you mean model.tensor_model_parallel_size" in err
    assert "Pipeline parallelism" in err


@pytest.mark.bridge
@NO_TE
def test_train_incomplete_validation_exits_3_and_launches_nothing(bridge, tmp_path, capsys):
    cfg = compose_train("recipe=llama3_8b_pretrain", "+mem=expandable_segments", "run.dry_run=false",
                        f"+run.record_dir={tmp_path}", "+bridge.model.rotary_interleaved=true")
    assert hydra_entry.run(cfg) == EXIT_INCOMPLETE   # run.dry_run=false: a passing config would launch here
    out = capsys.readouterr().out
    assert "validation: INCOMPLETE" in out and "nothing was launched" in out


# ------------------------------------------------------------------ subprocesses with Bridge


@pytest.mark.bridge
def test_sweep_runs_every_job_from_the_starting_environment(tmp_path):
    """-m: job 1 is rejected, job 2 still runs, and sees the environment as the sweep started (the variable
    unset), not as job 0 exported it; the sweep exits 1 after listing every verdict (issue 15 #7, issue 17).
    The sweep runs its jobs one after another in one process, so it runs in this one (train: the worker's Bridge
    import is reused) with the same os.environ a fresh process would start from."""
    import os
    (tmp_path / "mine" / "mem").mkdir(parents=True)
    (tmp_path / "mine" / "mem" / "leaky.yaml").write_text(
        "# @package mem.leaky\noverlay:\n  summary: sets one variable\n  env: {MBMEM_TEST_LEAK: '1'}\n")
    assert "MBMEM_TEST_LEAK" not in os.environ
    out = train("-m", "recipe=llama3_8b_pretrain", "+mem=leaky,cpu_offload,leaky", "model.pipeline_model_parallel_size=2",
                "run.dry_run=true", env={"MBMEM_RUNS_DIR": str(tmp_path / "runs"), "MBMEM_QUIET": "1",
                                         "MBMEM_OVERLAY_DIRS": str(tmp_path / "mine")}, timeout=600)
    assert out.returncode == EXIT_REJECTED, out.stderr[-3000:]
    no_traceback(out)
    assert "sweep: 3 jobs; 2 passed, 1 rejected" in out.stderr
    assert out.stdout.count("[leaky] $MBMEM_TEST_LEAK: None -> '1'") == 2, out.stdout[-3000:]
    reports = sorted((tmp_path / "runs").glob("multirun/*/*/mbmem_report.json"))
    assert len(reports) == 2  # the job our rules rejected planned nothing
