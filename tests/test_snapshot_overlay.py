"""+mem=memory_snapshot (issue 24): Bridge's own validation accepts it on real recipes, it composes with every other
overlay in either order, the rejected combinations are named by our rules and by Bridge, and the Slurm script,
`mbmem args`, train.py and `mbmem explain` carry it. Also `mbmem doctor SNAPSHOT --plan` (Bridge)."""

from __future__ import annotations

import copy
import json
import os

import pytest

from conftest import ROOT, mbmem
from mbmem_overlays import OverlayError, apply_overlay, plan_overlays
from mbmem_overlays.core import rules
from mbmem_overlays.core.catalog import Catalog
from mbmem_overlays.core.paths import write

L8, L70, L8_PEFT = "llama3_8b_pretrain_config", "llama3_70b_pretrain_config", "llama3_8b_peft_config"
FIX = ROOT / "tests" / "fixtures" / "snapshots"
PROFILING_FIELDS = ("record_memory_history", "memory_snapshot_path", "profile_ranks", "profile_step_start",
                    "profile_step_end")


def profiling(cfg) -> dict:
    return {k: getattr(cfg.profiling, k) for k in PROFILING_FIELDS}


def failing_checks(cfg, overlays, **kw) -> set[str]:
    try:
        plan_overlays(cfg, overlays, env={}, **kw)
    except OverlayError as exc:
        return {p.check for p in exc.problems}
    return set()


# ----------------------------------------------------------------------------- no Bridge
def test_explain_states_the_cost_and_where_the_files_land(capsys):
    from mbmem_overlays.cli import main
    assert main(["explain", "memory_snapshot"]) == 0
    out = capsys.readouterr().out
    for needle in ("100,000", "<base>_oom_rank-<R><ext>", "<base>_<R><ext>", "several KB per entry",
                   "Python stack at every allocation", "profile_ranks_in_world", "memory_snapshot_folder"):
        assert needle in out, needle
    assert main(["explain", "snapshot"]) == 0   # the alias


def test_the_slurm_script_carries_the_overlay_and_its_parameters():
    out = mbmem("slurm", "--recipe", "llama3_8b_pretrain", "--overlay", "memory_snapshot,expandable_segments",
                "--set", "mem.memory_snapshot.dump_step=5", "--set", "mem.memory_snapshot.ranks=[0,8]",
                "--nodes", "2", "--gpus-per-node", "8", "--no-validate", timeout=120)
    assert out.returncode == 0, out.stderr
    script = out.stdout
    assert "+mem=[expandable_segments,memory_snapshot]" in script or "+mem=[memory_snapshot,expandable_segments]" \
        in script, script
    assert "mem.memory_snapshot.dump_step=5" in script and "memory_snapshot.ranks" in script


def test_the_profiling_rules_are_a_topic_and_cite_bridge():
    ids = {c.id: c for c in rules.CHECKS if c.topic == "profiling"}
    assert set(ids) == {"profilers_exclusive", "profile_steps_ordered", "profile_ranks_in_world",
                        "memory_snapshot_folder", "memory_snapshot_dump_step", "memory_history_cost"}
    assert ids["profilers_exclusive"].enforced_by == "bridge" and ids["profilers_exclusive"].oracle
    assert "memory_snapshot" in rules.RESOLVERS


# ----------------------------------------------------------------------------- Bridge


@pytest.mark.bridge
def test_validated_by_bridge_on_a_real_recipe_with_the_path_in_the_run_folder(bridge, recipe, clean_env):
    cfg = recipe(L8)
    run = os.path.dirname(cfg.checkpoint.save)
    report = apply_overlay(cfg, "memory_snapshot", env=clean_env, world_size=8, validate=True)
    assert report.validation.ok, report.validation.verdict
    assert profiling(cfg) == {"record_memory_history": True, "memory_snapshot_path": f"{run}/memory_snapshot.pickle",
                              "profile_ranks": [0], "profile_step_start": 10, "profile_step_end": 12}
    assert not cfg.profiling.memory_snapshot_path.startswith("/nemo_run")
    assert any("1F1B makes the hottest" in n and "_oom_rank-<R>.pickle" in n for n in report.notes), report.notes


@pytest.mark.bridge
def test_the_launching_process_creates_the_snapshot_folder(bridge, recipe, clean_env, tmp_path):
    """Bridge opens <base>_oom_rank-<R>.pickle without creating its folder: train.py and the GPU harness create it
    before training (launch/process.py), so an OOM never loses its snapshot."""
    from mbmem_overlays.launch.process import prepare_snapshot_folder
    cfg = recipe(L8)
    base = tmp_path / "run" / "snapshots" / "mem.pickle"
    assert prepare_snapshot_folder(cfg) is None and not base.parent.exists()   # nothing recorded: nothing made
    apply_overlay(cfg, "memory_snapshot", env=clean_env, world_size=8, params={"memory_snapshot.path": str(base)})
    assert prepare_snapshot_folder(cfg) == base.parent and base.parent.is_dir()


@pytest.mark.bridge
def test_ranks_and_dump_step_on_a_pipelined_recipe(bridge, recipe, clean_env):
    cfg = recipe(L70)   # TP4 PP4 CP2: at 32 GPUs stage 3 starts at rank 24
    report = apply_overlay(cfg, "memory_snapshot", env=clean_env, world_size=32, validate=True,
                           params={"memory_snapshot.ranks": "pipeline_ends", "memory_snapshot.dump_step": 5})
    assert report.validation.ok, report.validation.verdict
    assert cfg.profiling.profile_ranks == [0, 24]
    assert (cfg.profiling.profile_step_start, cfg.profiling.profile_step_end) == (5, 5)


@pytest.mark.bridge
def test_composes_with_every_other_overlay_in_either_order(bridge, recipe, clean_env):
    catalog = Catalog()
    bases = {L8: recipe(L8), L8_PEFT: recipe(L8_PEFT, "model.tensor_model_parallel_size=2",
                                               "model.sequence_parallel=true")}
    others = [n for n in catalog.names() if n != "memory_snapshot"]
    assert len(others) >= 8
    for other in others:
        name = L8_PEFT if other == "lora_sp_regather" else L8
        base = bases[name]
        one, _, _ = plan_overlays(copy.deepcopy(base), ["memory_snapshot", other], env=clean_env, world_size=8)
        two, _, _ = plan_overlays(copy.deepcopy(base), [other, "memory_snapshot"], env=clean_env, world_size=8)
        assert [c.render() for c in one.changes] == [c.render() for c in two.changes], other
        assert {c.target for c in one.changes if c.overlay == "memory_snapshot"} >= {
            "profiling.record_memory_history", "profiling.memory_snapshot_path"}, other
        cfg = copy.deepcopy(base)
        report = apply_overlay(cfg, [other, "memory_snapshot"], env=dict(clean_env), world_size=8, validate=True)
        assert report.validation.ok, (other, report.validation.verdict)
        assert cfg.profiling.record_memory_history is True


@pytest.mark.bridge
def test_both_profilers_are_rejected_by_us_and_by_bridge(bridge, recipe):
    cfg = recipe(L8, "profiling.use_pytorch_profiler=true", "profiling.use_nsys_profiler=true")
    assert "profilers_exclusive" in failing_checks(cfg, ["memory_snapshot"], world_size=8)
    result = bridge.validate_config(cfg, world_size=8, env={})
    assert not result.ok and "Exactly one of pytorch or nsys profiler should be enabled" in result.error


@pytest.mark.bridge
def test_a_dump_step_before_a_pinned_start_is_rejected_by_us_and_by_bridge(bridge, recipe):
    cfg = recipe(L8, "profiling.profile_step_start=20", "profiling.profile_step_end=30")   # the user's window
    with pytest.raises(OverlayError) as exc:
        plan_overlays(cfg, ["memory_snapshot"], env={}, world_size=8, params={"memory_snapshot.dump_step": 15},
                      locked={"profiling.profile_step_start": 20})
    assert "your override sets profiling.profile_step_start=20" in str(exc.value)
    write(cfg, "profiling.profile_step_end", 15)
    assert "profile_steps_ordered" in failing_checks(cfg, [], world_size=8)
    result = bridge.validate_config(cfg, world_size=8, env={})
    assert not result.ok and "must be >= profile_step_start" in result.error


@pytest.mark.bridge
def test_stricter_than_bridge_where_the_job_would_silently_record_nothing(bridge, recipe, tmp_path):
    cfg = recipe(L8)
    assert "profile_ranks_in_world" in failing_checks(cfg, ["memory_snapshot"], world_size=8,
                                                      params={"memory_snapshot.ranks": [0, 8]})
    with pytest.raises(OverlayError, match=r"must be one of \['auto', 'pipeline_ends', 'all'\], a whole number"):
        plan_overlays(cfg, ["memory_snapshot"], env={}, world_size=8, params={"memory_snapshot.ranks": "first"})
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert "memory_snapshot_folder" in failing_checks(cfg, ["memory_snapshot"], world_size=8,
                                                      params={"memory_snapshot.path": f"{blocker}/s.pickle"})
    assert "memory_snapshot_folder" in failing_checks(cfg, ["memory_snapshot"], world_size=8,
                                                      params={"memory_snapshot.path": "~/s.pickle"})
    write(cfg, "profiling.record_memory_history", True)
    write(cfg, "profiling.profile_ranks", [8])
    assert bridge.validate_config(cfg, world_size=8, env={}).ok      # Bridge accepts: nothing fails, nothing records
    report, _, _ = plan_overlays(recipe(L8), ["memory_snapshot"], env={}, world_size=8,
                                 params={"memory_snapshot.path": str(tmp_path / "new" / "s.pickle")})
    assert any("mkdir -p" in w for w in report.warnings) and not (tmp_path / "new").exists()   # changes nothing


@pytest.mark.bridge
def test_the_profiling_checks_read_only_what_they_declare(recipe):
    from test_architecture import RecordingView
    cfg = recipe(L70)
    for path, value in {"profiling.record_memory_history": True, "profiling.use_nsys_profiler": True,
                        "profiling.profile_step_end": 99999, "profiling.memory_snapshot_path": "rel/s.pickle"}.items():
        write(cfg, path, value)
    for c in (c for c in rules.CHECKS if c.topic == "profiling"):
        view = RecordingView(cfg, {}, {}, 32, ("memory_snapshot",),
                             {"memory_snapshot": {"path": "auto", "ranks": "pipeline_ends", "dump_step": 0}})
        found = list(c(view))
        assert not view.seen - set(c.reads), (c.id, view.seen - set(c.reads))
        if c.id in ("memory_snapshot_dump_step", "memory_history_cost", "memory_snapshot_folder"):
            assert found, c.id


@pytest.mark.bridge
def test_mbmem_args_prints_overrides_bridge_reads_back_to_the_same_config(bridge, capsys):
    from megatron.bridge.training.utils.omegaconf_utils import process_config_with_overrides

    from mbmem_overlays.cli import main
    code = main(["args", "--recipe", "llama3_8b_pretrain", "--overlay", "memory_snapshot,expandable_segments",
                 "--world-size", "8", "--param", "memory_snapshot.dump_step=5", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0, out
    overrides = out["launcher"]["overrides"]
    assert "profiling.record_memory_history=true" in overrides and "profiling.profile_step_end=5" in overrides
    from mbmem_overlays.bridge.recipes import load_recipe
    mine = load_recipe("llama3_8b_pretrain")
    apply_overlay(mine, ["memory_snapshot", "expandable_segments"], env={}, world_size=8,
                  params={"memory_snapshot.dump_step": 5})
    theirs = process_config_with_overrides(load_recipe("llama3_8b_pretrain"), cli_overrides=overrides)
    assert profiling(theirs) == profiling(mine)


@pytest.mark.bridge
def test_train_py_composes_the_overlay_with_hydra_parameters(tmp_path, capsys):
    from hydra import compose, initialize_config_dir

    from mbmem_overlays.launch.hydra_entry import run
    with initialize_config_dir(config_dir=str(ROOT / "recipes"), version_base="1.3"):
        cfg = compose("train", overrides=["recipe=llama3_8b_pretrain", "+mem=[memory_snapshot,expandable_segments]",
                                          "mem.memory_snapshot.ranks=[0,1]", "mem.memory_snapshot.dump_step=3",
                                          "run.dry_run=true", "run.world_size=8", f"+run.record_dir={tmp_path}"])
    assert run(cfg) == 0
    out = capsys.readouterr().out
    assert "profiling.profile_ranks: [0] -> [0, 1]" in out and "profiling.profile_step_end: 12 -> 3" in out, out


@pytest.mark.bridge
def test_doctor_plan_sets_the_plan_beside_the_snapshot_and_validates_the_command(bridge, capsys):
    from mbmem_overlays.cli import main
    code = main(["doctor", str(FIX / "snapshot_oom_rank-0.pickle"), "--plan", "--recipe", "llama3_8b_pretrain",
                 "--world-size", "8", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0, out
    rows = {r["component"]: r for r in out["plan"]["components"]}
    assert set(rows) == {"parameters+gradients", "optimizer", "activations", "other", "total"}
    assert rows["total"]["snapshot_bytes"] == out["oom"]["allocated_bytes"] and rows["total"]["plan_bytes"] > 0
    assert out["next_command"].startswith("python train.py recipe=llama3_8b_pretrain +mem=")
    assert out["command_check"].startswith("validated by the engine on recipe llama3_8b_pretrain at world size 8")
