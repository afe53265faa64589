"""Regression tests from real GPU runs: what `scripts/gpu_check` brought back from a GPU machine, unpacked into
tests/data/gpu_runs/<YYYY-MM-DD>/ by `scripts/gpu_check --import-results` (docs/gpu-check.md).

- the snapshots: `mbmem doctor FILE --json` must give exactly the sums recomputed here from the pickle (a tiny
  reference over segments and blocks, loaded with a loader that refuses every class);
- the provoked OOM: the doctor's failed request and free memory are the trace's own `oom` entry;
- the job log: the doctor's run report must give, per rank, the figures of the log's own memory lines;
- the measured overlay table (bench/gpu_overlays.py): savings against the plan's predictions and the overlays'
  documented effects, with the tolerances stated below;
- the GPU smoke tests' JUnit XML: nothing failed, and what skipped says why.

Until a run is committed, each test skips with the reason.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import pickle
import re
import xml.etree.ElementTree as ET
from decimal import Decimal
from pathlib import Path

import pytest

from conftest import ROOT, mbmem

# MBMEM_GPU_RUNS_DIR: a folder of runs to test before committing them (scripts/gpu_check --import-results puts
# them in tests/data/gpu_runs)
RUNS = Path(os.environ.get("MBMEM_GPU_RUNS_DIR") or ROOT / "tests" / "data" / "gpu_runs")
NO_RUN = ("no GPU run is committed yet: tests/data/gpu_runs/<date>/ is made by `scripts/gpu_check --import-results` "
          "from the files of one device call of scripts/gpu_check (docs/gpu-check.md)")
# Savings are compared in bytes, as a fraction of the plan's baseline peak: the local layer spec's unfused
# attention adds the s x s scores to every measured activation, a term the plan (which assumes TE's fused or flash
# attention, memory/model.py ASSUMPTIONS) does not have, so ratios to the measured baseline would mix the two.
SAVING_TOLERANCE = 0.10
UNCHANGED_TOLERANCE = 0.02      # "no change in allocated memory" (expandable_segments, memory_snapshot)
BASELINE_UNDER = 0.15           # the plan may under-state the measured baseline peak by the unfused scores, never
                                # over-state it by more than this fraction
# Rows whose saving includes the unfused attention scores (recompute frees them too): one-sided comparison.
ATTENTION_RECOMPUTE = {"selective_recompute[core_attn]", "full_recompute"}


def dated_runs() -> list[Path]:
    if not RUNS.is_dir():
        return []
    return sorted(d for d in RUNS.iterdir() if re.fullmatch(r"\d{4}-\d{2}-\d{2}", d.name) and (d / "summary.json").is_file())


RUN_PARAMS = [pytest.param(d, id=d.name) for d in dated_runs()] or [pytest.param(None, id="none",
                                                                                 marks=pytest.mark.skip(reason=NO_RUN))]


@pytest.fixture(params=RUN_PARAMS)
def run(request) -> Path:
    return request.param


def need(run: Path, rel: str) -> Path:
    """The run's file, or a skip that names the step that should have written it and how it ended."""
    for candidate in (run / rel, run / f"{rel}.gz"):
        if candidate.is_file():
            return candidate
    summary = json.loads((run / "summary.json").read_text())
    step = rel.split("/")[0].removesuffix(".json").removesuffix(".xml")
    status = {s["name"]: f"{s['status']} ({s.get('detail') or 'no detail'})" for s in summary.get("steps", [])}
    pytest.skip(f"{run.name}: {rel} is not in this run (step {step}: {status.get(step, 'not run')}); "
                f"step statuses: {status}")


class PlainOnly(pickle.Unpickler):
    """Snapshots hold only dicts, lists, strings, numbers and tuples: any class is refused."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refused {module}.{name}")


def load(path: Path):
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        return PlainOnly(f).load()


def reference_totals(snapshot) -> dict[int, dict[str, int]]:
    """Per device: the sums the doctor must report, straight from segments and blocks (runtime-outputs.md schema)."""
    segments = snapshot["segments"] if isinstance(snapshot, dict) else snapshot
    out: dict[int, dict[str, int]] = {}
    for seg in segments:
        d = out.setdefault(int(seg.get("device", 0)), {"reserved_bytes": 0, "allocated_bytes": 0, "active_bytes": 0,
                                                       "requested_bytes": 0, "segments": 0,
                                                       "largest_free_block_bytes": 0})
        d["reserved_bytes"] += seg["total_size"]
        d["segments"] += 1
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                d["allocated_bytes"] += block["size"]
                d["requested_bytes"] += block.get("requested_size", block["size"])
            if block["state"] != "inactive":
                d["active_bytes"] += block["size"]
            else:
                d["largest_free_block_bytes"] = max(d["largest_free_block_bytes"], block["size"])
    return out


def doctor_json(path: Path) -> dict:
    res = mbmem("doctor", str(path), "--json")
    assert res.returncode in (0, 3, 4), res.stderr
    return json.loads(res.stdout)


@pytest.mark.parametrize("rel", ["snapshot/memory_snapshot_0.pickle", "oom/memory_snapshot_oom_rank-0.pickle"])
def test_doctor_reads_the_real_snapshot_exactly(run, rel):
    path = need(run, rel)
    want = reference_totals(load(path))
    got = {d["device"]: d for d in doctor_json(path)["devices"]}
    assert want, f"{path}: no segments"
    for device, totals in want.items():
        assert {k: got[device][k] for k in totals} == totals, f"device {device}"


def test_the_provoked_oom_is_the_traces_own_oom_entry(run):
    path = need(run, "oom/memory_snapshot_oom_rank-0.pickle")
    snapshot = load(path)
    ooms = [(dev, e) for dev, trace in enumerate(snapshot.get("device_traces", [])) for e in trace
            if e.get("action") == "oom"]
    assert ooms, "the OOM observer's snapshot has no oom trace entry"
    device, entry = ooms[-1]
    got = doctor_json(path)["oom"]
    assert got is not None and got["device"] == device
    assert got["request_bytes"] == entry["size"]
    assert got["device_free_bytes"] == entry["device_free"]
    # gpu_harness.make_oom_provoker asks for the free memory plus 1 GiB: the failed request is larger than what was free
    assert entry["size"] > entry["device_free"]


MEMORY_LINE = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(GB\)((?: \| [\w-]+: [0-9.eE+-]+)+)")
LOG_FIELDS = {"mem-allocated-gigabytes": "allocated_bytes", "mem-max-allocated-gigabytes": "max_allocated_bytes",
              "mem-reserved-gigabytes": "reserved_bytes", "mem-max-reserved-gigabytes": "max_reserved_bytes"}


def log_memory_lines(text: str) -> dict[tuple[int, int], dict[str, int]]:
    """(rank, iteration) -> bytes per field, from Bridge's report_memory lines (GB = 10^9 bytes, 5 digits)."""
    out = {}
    for rank, iteration, fields in MEMORY_LINE.findall(text):
        pairs = dict(p.split(": ") for p in fields.strip(" |").split(" | "))
        out[(int(rank), int(iteration))] = {LOG_FIELDS[k]: int(Decimal(v) * 10**9) for k, v in pairs.items()
                                            if k in LOG_FIELDS}
    return out


@pytest.mark.parametrize("rel", ["snapshot/job.log", "oom/job.log"])
def test_run_report_per_rank_figures_are_the_logs(run, rel):
    path = need(run, rel)
    lines = log_memory_lines(path.read_text(errors="replace"))
    assert lines, f"{rel}: no per-rank memory lines (Bridge prints them at iterations 1 and 2 with log_interval=1)"
    report = doctor_json(path).get("run")
    assert report and report["ranks"], "the doctor found no per-rank memory lines"
    for row in report["ranks"]:
        want = lines[(int(row["rank"]), int(row["iteration"]))]
        for key, value in want.items():
            assert abs(row[key] - value) <= 1, f"rank {row['rank']} {key}: doctor {row[key]}, log {value}"


def bench_rows(run: Path) -> tuple[dict, dict[str, dict]]:
    data = json.loads(need(run, "overlays.json").read_text())
    rows = {r["name"]: r for r in data["rows"]}
    base = rows.get("baseline", {})
    if not base.get("measured"):
        pytest.fail(f"the baseline was not measured: {base.get('error')}")
    return data, rows


def test_every_measured_case_trained_with_finite_loss(run):
    _, rows = bench_rows(run)
    failed = {n: r["error"] for n, r in rows.items() if "error" in r}
    assert not failed
    for name, r in rows.items():
        if "skipped" in r:
            assert "GPUs" in r["skipped"] or "Transformer Engine" in r["skipped"], name
            continue
        assert r["measured"]["losses"] and all(math.isfinite(x) for x in r["measured"]["losses"]), name


def test_the_plan_does_not_overstate_the_measured_baseline(run):
    _, rows = bench_rows(run)
    base = rows["baseline"]
    assert base["predicted_bytes"] <= base["measured"]["peak_allocated"] * (1 + BASELINE_UNDER), (
        f"plan {base['predicted_bytes']} vs measured {base['measured']['peak_allocated']}")


def test_measured_savings_against_the_plan_and_the_documented_effects(run):
    _, rows = bench_rows(run)
    base = rows["baseline"]
    scale = base["predicted_bytes"]
    problems = []
    for name, r in rows.items():
        if name == "baseline" or "measured" not in r:
            continue
        m, b = r["measured"], base["measured"]
        measured = (b["peak_allocated"] - m["peak_allocated"]) / scale
        predicted = (base["predicted_bytes"] - r["predicted_bytes"]) / scale
        if name in ("expandable_segments", "memory_snapshot"):  # documented: no change in allocated memory
            if abs(m["peak_allocated"] - b["peak_allocated"]) > UNCHANGED_TOLERANCE * b["peak_allocated"]:
                problems.append(f"{name}: allocated moved {measured:+.3f} of the baseline; documented: unchanged")
            if name == "expandable_segments" and (m["peak_reserved"] - m["peak_allocated"]
                                                  > b["peak_reserved"] - b["peak_allocated"]):
                problems.append(f"{name}: reserved-allocated gap grew; documented: it shrinks (no fragmentation)")
        elif name in ATTENTION_RECOMPUTE:
            if measured < predicted - SAVING_TOLERANCE:
                problems.append(f"{name}: saved {measured:.3f}, plan {predicted:.3f} (with the unfused scores it "
                                f"can only save more)")
        elif abs(measured - predicted) > SAVING_TOLERANCE:
            problems.append(f"{name}: saved {measured:.3f} of the plan's baseline, plan {predicted:.3f} "
                            f"(tolerance {SAVING_TOLERANCE})")
    assert not problems, problems


def test_the_gpu_smoke_tests_passed_or_said_why_not(run):
    root = ET.parse(need(run, "pytest-gpu.xml")).getroot()
    cases = list(root.iter("testcase"))
    assert cases, "no test case ran"
    bad = [c.get("name") for c in cases if c.find("failure") is not None or c.find("error") is not None]
    assert not bad, bad
    for c in cases:
        skipped = c.find("skipped")
        if skipped is not None:
            assert re.search(r"GPUs|Transformer Engine|checkpoint", skipped.get("message", "")), (c.get("name"),
                                                                                                skipped.get("message"))


def test_every_step_is_in_the_summary(run):
    summary = json.loads((run / "summary.json").read_text())
    names = {s["name"]: s["status"] for s in summary["steps"]}
    assert {"install", "bench", "smoke", "snapshot", "oom", "doctor"} <= set(names), names
    assert all(s in ("passed", "failed", "timeout", "skipped", "error") for s in names.values())
