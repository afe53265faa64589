"""The GPU harness's logic on CPU: parsing recorded metrics, comparing to baseline, deciding pass/fail.
The sample records in tests/data/gpu_runs follow the recorder's format; they were written by hand
(no GPU was available when they were made)."""

import dataclasses
import json

import pytest

from mbmem_overlays.launch.gpu_harness import EXPECTATIONS, TE_FREE, MetricsError, RunMetrics, judge, load_run, parse_job

from conftest import ROOT

RUNS = ROOT / "tests" / "data" / "gpu_runs"


def run(name):
    return load_run(RUNS / name, name)


def test_parse_and_summaries():
    b = run("baseline")
    assert b.peak_allocated == 3_200_000_000 and b.reserved_gap == 900_000_000
    assert b.step_time == pytest.approx(0.30)  # median of the steps after the 2 warm-up steps
    assert b.finite_loss


def test_recompute_passes_when_peak_drops():
    v = judge("selective_recompute", run("baseline"), run("selective_recompute"))
    assert v.passed and v.peak_allocated_ratio == pytest.approx(2.5 / 3.2)
    assert v.step_time_ratio == pytest.approx(1.12, rel=1e-3)


def test_no_saving_fails_with_the_numbers():
    v = judge("full_recompute", run("baseline"), run("full_recompute_no_saving"))
    assert not v.passed and any("not lower" in r and "MiB" in r for r in v.reasons)


def test_non_finite_loss_fails_even_if_memory_drops():
    v = judge("selective_recompute", run("baseline"), run("nan_loss"))
    assert not v.passed and any("not finite" in r for r in v.reasons)


def test_expandable_segments_needs_setting_and_smaller_gap():
    assert judge("expandable_segments", run("baseline"), run("expandable_segments")).passed
    v = judge("expandable_segments", run("baseline"), run("expandable_not_seen"))
    assert not v.passed and any("was not in the training process" in r for r in v.reasons)


def test_missing_rank_is_an_error():
    with pytest.raises(MetricsError, match="1 of 2 ranks"):
        run("two_ranks_one_missing")


def test_empty_and_corrupt(tmp_path):
    with pytest.raises(MetricsError, match="no rank"):
        load_run(tmp_path)
    (tmp_path / "rank0.json").write_text(json.dumps({"rank": 0}))
    with pytest.raises(MetricsError, match="not a metrics record"):
        load_run(tmp_path)


def test_every_shipped_overlay_has_an_expectation():
    assert {"selective_recompute", "full_recompute", "cpu_offload", "lora_sp_regather", "dist_optimizer",
            "expandable_segments", "memory_snapshot", "optimizer_offload", "sequence_parallel"} <= set(EXPECTATIONS)
    shipped = {p.stem for p in (ROOT / "overlays" / "mem").glob("*.yaml")}
    assert shipped <= set(EXPECTATIONS), shipped - set(EXPECTATIONS)


def test_unchanged_means_within_two_percent():
    b = run("baseline")
    rank = b.ranks[0]
    same = RunMetrics("snap", {0: dataclasses.replace(rank, peak_allocated=int(rank.peak_allocated * 1.01))})
    moved = RunMetrics("snap", {0: dataclasses.replace(rank, peak_allocated=int(rank.peak_allocated * 0.9))})
    assert judge("memory_snapshot", b, same).passed
    v = judge("memory_snapshot", b, moved)
    assert not v.passed and any("not within 2%" in r for r in v.reasons)


def test_runner_arguments():
    job = parse_job(["--overlay", "memory_snapshot", "--param", "memory_snapshot.dump_step=3", "--param",
                     "selective_recompute.modules=[core_attn,mlp]", "--set", "train.train_iters=6", "--oom-at", "3"])
    assert job.overlays == ("memory_snapshot",) and job.oom_at == 3 and job.sets == ("train.train_iters=6",)
    assert job.params == {"memory_snapshot": {"dump_step": 3}, "selective_recompute": {"modules": ["core_attn", "mlp"]}}
    for bad in (["--param", "nodot=1"], ["--param", "a.b"], ["--set", "novalue"], ["--oom-at", "0"], ["--bogus"]):
        with pytest.raises(SystemExit) as exc:
            parse_job(bad)
        assert exc.value.code == 2


def test_runner_refuses_an_oom_without_the_snapshot_overlay(capsys):
    from mbmem_overlays.launch.gpu_harness import main
    assert main(["train", "--oom-at", "2"]) == 2
    assert "needs --overlay memory_snapshot" in capsys.readouterr().err
    assert main([]) == 2


def test_te_free_fields_are_model_fields_switched_off():
    assert all(k.startswith("model.") and v is False for k, v in TE_FREE.items())


def test_gpu_tests_are_collected_and_skipped_with_reasons_on_cpu():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-rs", "-q"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:]
    assert f"{len(EXPECTATIONS)} skipped" in out.stdout and "CUDA is not available" in out.stdout


# ----------------------------------------------------------------------------- issue 31: judged against the plan, LoRA
def _with_plan(run_metrics: RunMetrics, baseline: int, planned: int, scale: float = 1.0) -> RunMetrics:
    ranks = {r: dataclasses.replace(m, peak_allocated=int(m.peak_allocated * scale)) for r, m in run_metrics.ranks.items()}
    return RunMetrics(run_metrics.name, ranks, {"baseline": baseline, "planned": planned})


def test_a_saving_is_judged_against_the_planned_one():
    b = run("baseline")  # 3.2 GB peak
    planned = 400_000_000
    near = _with_plan(b, 5_000_000_000, 5_000_000_000 - planned, scale=(3_200_000_000 - 380_000_000) / 3_200_000_000)
    v = judge("lora_sp_regather", b, near)
    assert v.passed and any("planned 381 MiB" in r for r in v.reasons), v.reasons
    far = _with_plan(b, 5_000_000_000, 5_000_000_000 - planned, scale=0.5)  # 1.6 GB measured, 0.4 GB planned
    v = judge("lora_sp_regather", b, far)
    assert not v.passed and any("off by more than 50%" in r for r in v.reasons), v.reasons
    missing = RunMetrics("x", near.ranks, {"error": "ValueError: no plan"})
    v = judge("lora_sp_regather", b, missing)
    assert not v.passed and any("no planned saving" in r and "no plan" in r for r in v.reasons)


def test_the_new_overlays_and_lora_are_judged_against_the_plan():
    for name in ("lora_sp_regather", "megatron_fsdp", "fine_grained_offload", "precision_aware_optimizer"):
        assert EXPECTATIONS[name].plan_tolerance is not None and EXPECTATIONS[name].note
    assert EXPECTATIONS["lora_sp_regather"].lora and EXPECTATIONS["lora_sp_regather"].min_gpus == 2


def test_plan_json_is_read_beside_the_metrics(tmp_path):
    (tmp_path / "rank0.json").write_text((RUNS / "baseline" / "rank0.json").read_text())
    assert load_run(tmp_path).plan == {} and load_run(tmp_path).planned_saving is None
    (tmp_path / "plan.json").write_text(json.dumps({"baseline": 10, "planned": 4}))
    assert load_run(tmp_path).planned_saving == 6
    (tmp_path / "plan.json").write_text("{not json")
    assert "plan.json" in load_run(tmp_path).plan["error"]


def test_lora_runner_needs_the_pretrained_checkpoint():
    job = parse_job(["--lora", "--overlay", "lora_sp_regather", "--set", "checkpoint.pretrained_checkpoint=/tmp/x"])
    assert job.lora and job.overlays == ("lora_sp_regather",)
    with pytest.raises(SystemExit) as exc:
        parse_job(["--lora"])
    assert exc.value.code == 2
