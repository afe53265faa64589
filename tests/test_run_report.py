"""The run report (issue 23): a healthy run's memory lines read exactly, per rank and per pipeline stage, judged
(at_risk / fragmenting / over_provisioned / healthy), planned against measured with --plan, and advice in both
directions; plus the doctor's recall (anything that says out of memory is never "no OOM, high").

Fixtures: tests/fixtures/runs/ (written by generate.py from Megatron-LM's and Bridge's own format code) and the
doctor corpus (tests/fixtures/doctor/). The per-rank figures are checked against the log's printed text with a
reader written here, independently of memlines.py.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from conftest import mbmem, paste

from mbmem_overlays.doctor import memlines as ML
from mbmem_overlays.doctor import run_report as RR
from mbmem_overlays.doctor.diagnose import diagnose
from mbmem_overlays.doctor.parse import scan

RUNS = Path(__file__).parent / "fixtures" / "runs"
DOCTOR = Path(__file__).parent / "fixtures" / "doctor"
GiB = 1 << 30


def doctor(*names: str):
    f = scan([str(RUNS / n) for n in names])
    return f, diagnose(f)


def doctor_json(*args: str, env: dict | None = None):
    out = mbmem("doctor", *args, "--json", env=env, timeout=120)
    assert "Traceback" not in out.stderr, out.stderr
    return out.returncode, json.loads(out.stdout)


# ----------------------------------------------------------------------------- the printed figures, read here
LINE = re.compile(r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \((MB|GB)\)((?: \| [^|:]+: [^|\[\s]+)+)")


def printed(path: Path) -> dict[int, dict[str, float]]:
    """rank -> {metric name: value} of each rank's latest report, read with a regex of this test."""
    out: dict[int, tuple[int, str, dict]] = {}
    for m in LINE.finditer(path.read_text()):
        rank, it, unit = int(m.group(1)), int(m.group(2)), m.group(3)
        fields = {}
        for piece in m.group(4).split(" | ")[1:]:
            name, _, value = piece.partition(": ")
            fields[name.strip()] = value.strip()
        if rank not in out or it >= out[rank][0]:
            out[rank] = (it, unit, fields)
    return {r: {"unit": u, "iteration": it, **fs} for r, (it, u, fs) in out.items()}


NAMES = {"MB": {"allocated": "allocated_bytes", "max allocated": "max_allocated_bytes", "reserved": "reserved_bytes",
                "max reserved": "max_reserved_bytes"},
         "GB": {"mem-allocated-gigabytes": "allocated_bytes", "mem-max-allocated-gigabytes": "max_allocated_bytes",
                "mem-reserved-gigabytes": "reserved_bytes", "mem-max-reserved-gigabytes": "max_reserved_bytes",
                "mem-max-inactive-gigabytes": "max_inactive_bytes", "mem-alloc-retires": "alloc_retries"}}


@pytest.mark.parametrize("name", ["bridge_llama3_8b_tp2_pp2.log", "bridge_fragmenting.log", "megatron_lm_tp4_pp2.log",
                                  "bridge_at_risk.log"])
def test_per_rank_figures_equal_the_log_to_the_printed_precision(name):
    """Bytes are the printed value times its unit (Bridge GB = 1e9, Megatron-LM MB = 2^20), exactly."""
    code, data = doctor_json(str(RUNS / name))
    assert code == 0
    ranks = {r["rank"]: r for r in data["run"]["ranks"]}
    want = printed(RUNS / name)
    assert set(ranks) == set(want)
    for rank, fields in want.items():
        unit = fields["unit"]
        scale = 1e9 if unit == "GB" else 2**20
        assert ranks[rank]["iteration"] == fields["iteration"]
        for metric, key in NAMES[unit].items():
            value = fields[metric]
            expect = int(value) if key == "alloc_retries" else round(float(value) * scale)
            assert ranks[rank][key] == expect, (rank, metric)


def test_the_text_table_prints_each_figure_as_the_log_does():
    out = mbmem("doctor", str(RUNS / "bridge_llama3_8b_tp2_pp2.log"))
    row = next(line for line in out.stdout.splitlines() if re.match(r"\s*\*?\s+4\s+1\s+2\s", line))
    log = printed(RUNS / "bridge_llama3_8b_tp2_pp2.log")[4]
    assert log["mem-max-allocated-gigabytes"] in row.split() and log["mem-max-reserved-gigabytes"] in row.split()
    out = mbmem("doctor", str(RUNS / "megatron_lm_tp4_pp2.log"))
    row = next(line for line in out.stdout.splitlines() if re.match(r"\s*\*?\s+9\s+1\s+10\s", line))
    log = printed(RUNS / "megatron_lm_tp4_pp2.log")[9]
    assert log["max allocated"] in row.split() and "MiB, as the log prints them" in out.stdout


# ----------------------------------------------------------------------------- the formats, line by line
@pytest.mark.parametrize("line, rank, iteration, field, expect", [
    ("[Rank 3] (after 10 iterations) memory (MB) | allocated: 1024.00 | max allocated: 2048.50 | reserved: 3072.00 | "
     "max reserved: 4096.00", 3, 10, "max_allocated", round(2048.5 * 2**20)),
    ("[Rank 0] (after 1 iterations) memory (MB) | allocated: 18243.64111328125 | max allocated: 50664.2548828125 | "
     "reserved: 54556.0 | max reserved: 54556.0", 0, 1, "max_allocated", round(50664.2548828125 * 2**20)),
    ("[Rank 7] (after 2 iterations) memory (GB) | mem-allocated-gigabytes: 63.66 | mem-max-allocated-gigabytes: 153.4 "
     "| mem-max-reserved-gigabytes: 182.2 | mem-alloc-retires: 3 | mem-allocated-count: 507", 7, 2, "max_reserved",
     round(182.2e9)),
    ("[Rank 7] (after 2 iterations) memory (GB) | mem-allocated-gigabytes: 1.2345e-05 | mem-max-allocated-gigabytes: "
     "0.0012346 | mem-alloc-retires: 3", 7, 2, "allocated", round(1.2345e-05 * 1e9)),
    ("(after 20 iterations) memory (MB) | allocated: 10.5 | max allocated: 20.25", None, 20, "max_allocated",
     round(20.25 * 2**20)),
    # Megatron-LM before the parentheses (report_memory('after {} iterations'.format(iteration)))
    ("after 5 iterations memory (MB) | allocated: 10250.5693359375 | max allocated: 12606.06201171875 | "
     "reserved: 17482.0 | max reserved: 17482.0", None, 5, "max_allocated", round(12606.06201171875 * 2**20)),
])
def test_memory_line_formats(line, rank, iteration, field, expect):
    (r,) = ML.parse_reports(line, "x.log:1", None)
    assert not r.unreadable and r.rank == rank and r.iteration == iteration and r.values[field] == expect
    if "retires" in line:
        assert r.values["alloc_retries"] == 3


@pytest.mark.parametrize("prefix", ["3: ", "[default3]:", "p4_v2_perf/0 [default3]:", "[2026-11-28 09:00:01][INFO]"
                                    "[utils:190] - ", "[1,3]<stdout>:"])
def test_launcher_and_logging_prefixes(tmp_path, prefix):
    p = tmp_path / "p.log"
    p.write_text(prefix + "[Rank 3] (after 5 iterations) memory (MB) | allocated: 1.00 | max allocated: 2.00 | "
                 "reserved: 3.00 | max reserved: 4.00\n")
    f = scan([str(p)])
    assert list(f.memory) == [3] and f.memory[3].latest.values["max_reserved"] == 4 * 2**20


def test_a_report_without_a_rank_takes_the_launcher_prefix():
    (r,) = ML.parse_reports("(after 5 iterations) memory (MB) | allocated: 1.00 | max allocated: 2.00", "x:1", 12)
    assert r.rank == 12


def test_two_reports_on_one_line_and_interleaved_ranks():
    f, d = doctor("megatron_lm_tp4_pp2.log")
    assert sorted(f.memory) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert f.memory[2].latest.values["max_allocated"] == round(17510.40 * 2**20)   # the first of the glued pair
    assert f.memory[3].latest.values["max_allocated"] == round(17408.00 * 2**20)


def test_user_memory_keys_are_read_by_their_printed_form():
    """Bridge prints a byte statistic as a float in GB and a count as an int, whatever the user named it."""
    f, d = doctor("bridge_user_memory_keys.log")
    r = f.memory[0].latest
    assert r.values["max_allocated"] == round(44.44e9) and r.values["max_reserved"] == round(47.29e9)
    assert r.values["alloc_retries"] == 0
    assert "alloc_count" not in r.values and ("live_blocks", "2913") in r.other    # a count it cannot place: kept
    assert any("read by their words" in x for x in d.reasons)


def test_many_reports_across_blocks_keep_each_ranks_first_and_latest(tmp_path):
    """12 MB of reports (several reader blocks, the flood path): every rank's latest iteration and its first."""
    line = ("[default{r}]:[Rank {r}] (after {i} iterations) memory (GB) | mem-allocated-gigabytes: 20.0 | "
            "mem-max-allocated-gigabytes: {a} | mem-max-reserved-gigabytes: 50.0 | mem-alloc-retires: 0\n")
    p = tmp_path / "many.log"
    with open(p, "w") as out:
        for i in range(1, 13001):
            out.writelines(line.format(r=r, i=i, a=30 + i / 1000) for r in range(8))
    f = scan([str(p)])
    assert sorted(f.memory) == list(range(8))
    for r in range(8):
        s = f.memory[r]
        assert (s.first_iteration, s.latest.iteration) == (1, 13000)
        assert s.latest.values["max_allocated"] == round((30 + 13000 / 1000) * 1e9)
        assert s.latest.where.endswith(f":{12999 * 8 + r + 1}")      # the line number of the latest report


def test_a_counted_oom_in_the_memory_line_is_an_oom(tmp_path):
    """torch's num_ooms statistic, logged through logger.memory_keys, counts allocations that failed."""
    p = tmp_path / "n.log"
    p.write_text("[Rank 0] (after 9 iterations) memory (GB) | mem-max-allocated-gigabytes: 70.1 | num_ooms: 2\n")
    d = diagnose(scan([str(p)]))
    assert d.verdict == "unsure" and d.kind == "oom_unclassified" and d.run["ranks"][0]["rank"] == 0


def test_the_run_report_imports_neither_torch_nor_bridge():
    import subprocess
    import sys
    code = ("import sys; from mbmem_overlays.cli import main; main(['doctor', sys.argv[1]]);"
            "print('LEAK' if any(m.startswith(('megatron', 'torch')) for m in sys.modules) else 'CLEAN')")
    out = subprocess.run([sys.executable, "-c", code, str(RUNS / "bridge_over_provisioned_recompute_offload.log")],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.stdout.strip().endswith("CLEAN"), out.stdout[-500:] + out.stderr[-500:]


def test_latest_report_wins_and_iteration_one_is_flagged(tmp_path):
    line = "[Rank 0] (after {i} iterations) memory (GB) | mem-max-allocated-gigabytes: {a} | mem-max-reserved-gigabytes: {r}"
    p = tmp_path / "it.log"
    p.write_text(line.format(i=2, a=30.0, r=31.0) + "\n" + line.format(i=1, a=20.0, r=21.0) + "\n")
    f = scan([str(p)])
    assert f.memory[0].latest.iteration == 2 and f.memory[0].first_iteration == 1
    p.write_text(line.format(i=1, a=20.0, r=21.0) + "\n")
    d = diagnose(scan([str(p)]), capacity=80e9)
    assert any("optimizer" in x and "iteration 1" in x for x in d.reasons)
    assert d.confidence == "medium"


@pytest.mark.parametrize("line, why", [
    ("allocated: -12.00 | max allocated: 900.00 | reserved: 1000.00 | max reserved: 1000.00", "not a memory figure"),
    ("allocated: 1.00 | max allocated: nan | reserved: 1000.00", "not a memory figure"),
    ("allocated: 10.00 | max allocated: 99999999999999999999.00", "more than 1 PiB"),
    ("allocated: 5000.00 | max allocated: 4000.00 | reserved: 6000.00", "a peak cannot be"),
    ("allocated: 5000.00 | max allocated: 6000.00 | reserved: 100.00 | max reserved: 100.00", "reserved is below"),
    ("allocated: 0.0 | max allocated: 0.0 | reserved: 0.0 | max reserved: 0.0", "every figure is 0"),
    ("allocated: 1.2.3 | max allocated: 2.0", "not a number"),
])
def test_absurd_numbers_are_unreadable_not_used(line, why):
    (r,) = ML.parse_reports("[Rank 1] (after 3 iterations) memory (MB) | " + line, "x:1", None)
    assert why in r.unreadable


def test_unreadable_reports_are_listed_and_never_plotted():
    code, data = doctor_json(str(RUNS / "unreadable_numbers.log"))
    assert code == 0 and [r["rank"] for r in data["run"]["ranks"]] == [4]
    assert len(data["run"]["unreadable"]) == 5
    from mbmem_overlays.doctor.plot import rows_to_plot
    assert [r["rank"] for r in rows_to_plot(data["run"])] == [4]


def test_theoretical_estimate_is_shown_beside():
    f, d = doctor("megatron_lm_tp4_pp2.log")
    (t,) = f.theoretical
    assert t.parts == {"weight_and_optimizer": round(9036.77 * 2**20), "activation": round(6144.00 * 2**20),
                       "total": round(15180.77 * 2**20)}
    assert any("the job's own estimate" in x and "total 14.82 GiB" in x for x in d.run_lines)


# ----------------------------------------------------------------------------- ranks -> pipeline stages
def test_stages_follow_megatron_core_rank_order():
    """tp-cp-ep-dp-pp (the default): TP2 CP2 PP2 on 8 GPUs -> ranks 0-3 stage 0, 4-7 stage 1; TP4 PP2 DP2 on 16:
    the DP-rank-0 reporters are 0-3 (stage 0) and 8-11 (stage 1)."""
    f, _ = doctor("bridge_llama3_8b_tp2_pp2.log")
    rep = RR.build(f)
    assert {r.rank: r.stage for r in rep.rows} == {r: r // 4 for r in range(8)}
    f, _ = doctor("megatron_lm_tp4_pp2.log")
    rep = RR.build(f)
    assert {r.rank: r.stage for r in rep.rows} == {0: 0, 1: 0, 2: 0, 3: 0, 8: 1, 9: 1, 10: 1, 11: 1}
    assert rep.stages.expected == 8


def test_tp_pp_dp_mapping_changes_the_stage(tmp_path):
    p = tmp_path / "m.log"
    lines = ["WORLD_SIZE=16", "tensor_model_parallel_size: 2", "pipeline_model_parallel_size: 4",
             "use_tp_pp_dp_mapping: True"]
    lines += [f"[Rank {r}] (after 3 iterations) memory (MB) | allocated: 1.00 | max allocated: 2.00" for r in (0, 2, 6, 8)]
    p.write_text("\n".join(lines) + "\n")
    rep = RR.build(scan([str(p)]))
    assert {r.rank: r.stage for r in rep.rows} == {0: 0, 2: 1, 6: 3, 8: 0}   # stage = (rank // TP*CP) % PP


def test_stages_unknown_without_the_world_size_are_said(tmp_path):
    p = tmp_path / "m.log"
    p.write_text("pipeline_model_parallel_size: 4\n[Rank 5] (after 3 iterations) memory (MB) | allocated: 1.00 | "
                 "max allocated: 2.00\n")
    rep = RR.build(scan([str(p)]))
    assert rep.rows[0].stage is None and any("world size" in u for u in rep.unknown)


# ----------------------------------------------------------------------------- verdicts
def series(**ranks) -> dict:
    out = {}
    for key, (alloc, reserved, retries, inactive) in ranks.items():
        values = {"max_allocated": int(alloc * GiB), "max_reserved": int(reserved * GiB)}
        if retries is not None:
            values["alloc_retries"] = retries
        if inactive is not None:
            values["max_inactive"] = int(inactive * GiB)
        r = ML.MemoryReport(int(key[1:]), 10, f"x.log:{key[1:]}", "GB", values)
        out[r.rank] = ML.RankSeries(r, 10)
    return out


def findings_with(memory) -> object:
    from mbmem_overlays.doctor.parse import Findings
    f = Findings()
    f.memory = memory
    return f


@pytest.mark.parametrize("ranks, capacity, kind, hot", [
    ({"r0": (70, 77, 0, 1), "r1": (60, 62, 0, 1)}, 80, "at_risk", 0),             # 3 GiB free < 5% of 80
    ({"r0": (40, 60, 0, 1), "r1": (40, 42, 0, 1)}, 80, "fragmenting", 0),         # 20 GiB reserved never allocated
    ({"r0": (40, 42, 3, 1), "r1": (40, 42, 0, 1)}, 80, "fragmenting", 0),         # allocator retries
    ({"r0": (40, 47, 0, 9), "r1": (40, 42, 0, 1)}, 80, "fragmenting", 0),         # inactive split blocks
    ({"r0": (40, 42, 0, 1), "r1": (50, 52, 0, 1)}, 80, "over_provisioned", 1),    # >= 25% free everywhere
    ({"r0": (60, 63, 0, 1), "r1": (50, 52, 0, 1)}, 80, "healthy", 0),
    ({"r0": (55, 58, 0, 1), "r1": (50, 52, 0, 1)}, None, "healthy", 0),           # no capacity: headroom unknown
    ({"r0": (75, 78, 2, 1), "r1": (50, 52, 0, 1)}, 80, "at_risk", 0),             # at risk outranks fragmenting
])
def test_verdict_table(ranks, capacity, kind, hot):
    rep = RR.build(findings_with(series(**ranks)), capacity * GiB if capacity else None, 0.05)
    assert rep.kind == kind and rep.hot.rank == hot
    main = [x for x in rep.findings if x.kind == kind]
    assert main and all("[x.log:" in x.text for x in main)       # each verdict names its line
    if capacity is None:
        assert rep.confidence == "low" and any("capacity" in u for u in rep.unknown)


def test_margin_moves_the_at_risk_line():
    ranks = series(r0=(70, 74, 0, 1))
    assert RR.build(findings_with(ranks), 80 * GiB, 0.05).kind == "healthy"      # 6 GiB free = 7.5%
    assert RR.build(findings_with(ranks), 80 * GiB, 0.10).kind == "at_risk"


# ----------------------------------------------------------------------------- one command, documented codes
@pytest.mark.parametrize("name, kind, code", [
    ("bridge_llama3_8b_tp2_pp2.log", "over_provisioned", 0), ("bridge_at_risk.log", "at_risk", 0),
    ("bridge_fragmenting.log", "fragmenting", 0), ("megatron_lm_old_prefixes.log", "healthy", 0),
    ("bridge_at_risk_then_oom.log", "capacity", 0),
])
def test_one_command_for_any_log(name, kind, code):
    rc, data = doctor_json(str(RUNS / name))
    assert (rc, data["kind"], data["exit_code"]) == (code, kind, code)
    assert data["schema_version"] == 3 and data["run"]["ranks"]
    assert data["verdict"] == ("diagnosed" if kind == "capacity" else "reported")


def test_json_run_object_has_the_documented_keys():
    rc, data = doctor_json(str(RUNS / "bridge_llama3_8b_tp2_pp2.log"))
    run = data["run"]
    assert {"ranks", "hot_rank", "capacity_bytes", "planned"} <= set(run)
    assert {"rank", "stage", "iteration", "allocated_bytes", "max_allocated_bytes", "reserved_bytes",
            "max_reserved_bytes", "max_inactive_bytes", "alloc_retries"} <= set(run["ranks"][0])
    assert run["hot_rank"] == 0 and run["capacity_bytes"] == 81559 * 2**20 and run["planned"] == []


def test_an_oom_log_gets_the_diagnosis_and_the_per_rank_table():
    out = mbmem("doctor", str(RUNS / "bridge_at_risk_then_oom.log"))
    assert out.returncode == 0
    assert out.stdout.startswith("diagnosis: genuine capacity limit") and "per-rank memory (GB" in out.stdout
    # the table's capacity is the OOM message's (torch's own total), the exact one
    rc, data = doctor_json(str(RUNS / "bridge_at_risk_then_oom.log"))
    assert data["run"]["capacity_bytes"] == int(79.11 * GiB)


def test_at_risk_advice_starts_from_what_the_log_shows_is_on():
    _, d = doctor("bridge_at_risk.log")
    names = [r["name"] for r in d.remedies]
    assert names[0] == "selective_recompute" and "dist_optimizer" not in names   # Bridge's summary shows it on
    assert d.next_command.endswith("train.py recipe=llama3_8b_pretrain +mem=selective_recompute")


def test_fragmenting_advice_is_expandable_segments():
    _, d = doctor("bridge_fragmenting.log")
    assert d.kind == "fragmenting" and d.next_command.endswith("+mem=expandable_segments")
    assert any("7 allocator retries" in x for x in d.reasons)


def test_over_provisioned_lists_what_can_be_turned_off_by_throughput_gain():
    _, d = doctor("bridge_over_provisioned_recompute_offload.log")
    assert [r["name"] for r in d.remedies] == ["optimizer_offload_off", "full_to_selective", "tp_halved", "pp_halved"]
    assert d.savings.startswith("not sized")     # without --plan nothing is sized


def test_over_provisioned_next_command_is_the_doctor_with_plan():
    out = mbmem("doctor", "tests/fixtures/runs/bridge_over_provisioned_recompute_offload.log", "--gpu-memory", "80GiB")
    cmd = next(line for line in out.stdout.splitlines() if line.startswith("next command: "))[14:]
    assert shlex.split(cmd) == ["mbmem", "doctor", "tests/fixtures/runs/bridge_over_provisioned_recompute_offload.log",
                                "--plan", "--gpu-memory", "80GiB"]


def test_plan_says_what_the_log_lacks(tmp_path):
    """--plan on a log without a recipe or world size says what is missing (and imports nothing)."""
    from mbmem_overlays.doctor.run_plan import make_run_planner
    f = scan([str(RUNS / "megatron_lm_old_prefixes.log")])
    rep = RR.build(f)
    planner = make_run_planner(None, [], None, None, 0.05)
    from mbmem_overlays.doctor.diagnose import _context
    ctx = _context(f, None, None)
    # Megatron-LM's memory lines without its arguments: what is missing is the job's flags, not a recipe
    assert planner(rep, ctx, f) is None and "the job's Megatron-LM arguments" in rep.plan_status
    assert "mbmem plan --megatron-args" in rep.plan_status
    log = tmp_path / "bridge.log"   # Bridge's memory line alone: a recipe is what is missing
    log.write_text(next(line for line in (RUNS / "bridge_at_risk.log").read_text().splitlines()
                        if "mem-allocated-gigabytes" in line) + "\n")
    bridge = scan([str(log)])
    rep = RR.build(bridge)
    assert planner(rep, _context(bridge, None, None), bridge) is None and "the recipe (give --recipe)" in rep.plan_status


def test_the_json_says_why_nothing_was_planned(tmp_path):
    """run.plan_status carries the status line the text prints, also when nothing could be planned."""
    from mbmem_overlays.cli import main
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["doctor", str(RUNS / "megatron_lm_old_prefixes.log"), "--plan", "--json"])
    status = json.loads(buf.getvalue())["run"]["plan_status"]
    assert status.startswith("not planned: the log does not show the job's Megatron-LM arguments")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["doctor", str(RUNS / "megatron_lm_old_prefixes.log"), "--json"])
    assert json.loads(buf.getvalue())["run"]["plan_status"] is None


def test_a_rank_beyond_the_world_size_is_noted(tmp_path):
    log = tmp_path / "job.log"
    line = ("[Rank {}] (after 2 iterations) memory (GB) | mem-allocated-gigabytes: 30.0 | "
            "mem-max-allocated-gigabytes: {} | mem-max-reserved-gigabytes: 45.0")
    log.write_text("torchrun --nproc_per_node=8 pretrain.py\n" + line.format(0, 40.0) + "\n"
                   + line.format(12, 44.0) + "\n")
    rep = RR.build(scan([str(log)]))
    (note,) = [n for n in rep.notes if "beyond the world size" in n]
    assert "1 line(s) name a rank at or beyond the world size 8" in note and "(12)" in note
    assert rep.confidence != "high"


def test_iterations_count_from_the_jobs_start():
    """Bridge reports after the first two iterations a process runs: reports after J and J + 1 mean the job
    started after J - 1; otherwise the printed iteration is counted from 0 (never fewer phases than ran)."""
    from types import SimpleNamespace as Row

    from mbmem_overlays.doctor.run_plan import iteration_offset
    assert iteration_offset([Row(first_iteration=1001, iteration=1002), Row(first_iteration=1001, iteration=1001)]) \
        == (1000, True)
    assert iteration_offset([Row(first_iteration=1, iteration=2)]) == (0, False)
    assert iteration_offset([Row(first_iteration=10, iteration=10)]) == (0, False)   # log_interval 10, fresh
    assert iteration_offset([Row(first_iteration=None, iteration=None)]) == (0, False)
    assert iteration_offset([Row(first_iteration=0, iteration=0), Row(first_iteration=51, iteration=52)]) == (50, True)


def test_healthy_without_a_capacity_does_not_claim_headroom(tmp_path):
    log = tmp_path / "job.log"
    log.write_text("[Rank 0] (after 2 iterations) memory (GB) | mem-allocated-gigabytes: 30.0 | "
                   "mem-max-allocated-gigabytes: 40.0 | mem-max-reserved-gigabytes: 41.0\n")
    out = mbmem("doctor", str(log))
    assert out.returncode == 0 and "report: healthy as far as the log shows" in out.stdout
    assert "unknown without the GPU's capacity (give --gpu-memory)" in out.stdout
    out = mbmem("doctor", str(log), "--gpu-memory", "80GiB")
    assert "report: healthy: no rank is near capacity" in out.stdout or "over-provisioned" in out.stdout


def test_a_line_before_the_first_iteration_is_noted(tmp_path):
    log = tmp_path / "job.log"
    log.write_text("[Rank 0] (after 0 iterations) memory (GB) | mem-allocated-gigabytes: 30.0 | "
                   "mem-max-allocated-gigabytes: 31.0 | mem-max-reserved-gigabytes: 32.0\n")
    rep = RR.build(scan([str(log)]))
    assert any("before the first training iteration" in n for n in rep.notes) and rep.confidence != "high"


# ----------------------------------------------------------------------------- issue 23 §3: recall
OOM_LIKE = re.compile(r"(?i:out[ _-]?of[ _-]?memory|cannot allocate memory|can't allocate memory|not enough memory|"
                      r"insufficient memory|failed to allocate|alloc(?:ation)? failed|out of resource)|\bOOM\b|"
                      r"_ALLOC_FAILED|CUDA_ERROR_OUT_OF_MEMORY|MemoryAllocation|CUresult error[: ]+(?:result=)?2\b")


def every_fixture() -> list[Path]:
    return sorted(p for p in [*DOCTOR.rglob("*.log"), *RUNS.glob("*.log")])


@pytest.mark.parametrize("path", every_fixture(), ids=lambda p: str(p.relative_to(p.parents[1])))
def test_no_oom_like_fixture_is_called_no_oom_high(path):
    d = diagnose(scan([str(path)]))
    lines = [line for line in path.read_text(errors="replace").splitlines() if OOM_LIKE.search(line)]
    if d.verdict == "no_oom" and d.confidence == "high":
        assert not lines, lines[:3]


@pytest.mark.parametrize("line", [
    "torch.OutOfMemoryError: Tried to allocate 12.60 GiB. GPU had 12.44 GiB free of 79.19",
    "[torch_memory_saver.cpp] CUresult error: 2 (out of memory) file=csrc/core.cpp func=cu_mem_create line=57",
    "RuntimeError: OOM when allocating tensor with shape [8, 4096]",
    "ERROR: cudaErrorMemoryAllocation returned from cudaMalloc",
    "CUDA_ERROR_OUT_OF_MEMORY in cuMemCreate",
    "RuntimeError: CUDA error: out of memory",
    "NCCL WARN Failed to CUDA calloc 2097152 bytes",
    "RuntimeError: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
    "RuntimeError: transformer_engine/common/util/cuda_runtime.cpp:42 CUDA Error: out of memory",
    "triton.runtime.errors.OutOfResources: out of resource: shared memory, Required: 262144",
    "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization`",
    "RuntimeError: Not enough memory. Please try to increase --mem-fraction-static.",
    "HIP out of memory. Tried to allocate 2.00 GiB",
    "hipErrorOutOfMemory: out of memory",
    "Out Of Memory while allocating the workspace",
    "failed to allocate 2.00 GiB of device memory",
    "RuntimeError: DefaultCPUAllocator: can't allocate memory: you tried to allocate 34359738368 bytes",
])
def test_every_spelling_of_out_of_memory_is_an_oom(tmp_path, line):
    p = tmp_path / "x.log"
    p.write_text("python train.py recipe=llama3_8b_pretrain\n[rank0]: " + line + "\n[rank0]: [after training is done]\n")
    d = diagnose(scan([str(p)]))
    assert d.verdict in ("diagnosed", "unsure") and d.kind != "none", (d.kind, d.summary)


def test_the_abbreviated_message_keeps_the_numbers_it_shows(tmp_path):
    p = tmp_path / "x.log"
    p.write_text("[rank1]: torch.OutOfMemoryError: Tried to allocate 12.60 GiB. GPU had 12.44 GiB free of 79.19\n")
    f = scan([str(p)])
    o = f.ooms[0]
    assert (o.requested, o.free, o.capacity) == (int(12.60 * GiB), int(12.44 * GiB), int(79.19 * GiB))
    d = diagnose(f)
    assert d.verdict == "unsure" and "reserved-but-unallocated" in d.unknown


@pytest.mark.parametrize("line", ["set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid OOM",
                                  "if you run out of memory, lower the micro batch size"])
def test_advice_that_mentions_oom_is_not_an_oom_but_not_high(tmp_path, line):
    p = tmp_path / "x.log"
    p.write_text(f"[rank0]: {line}\n[rank0]: [after training is done] datetime: 2026\n")
    d = diagnose(scan([str(p)]))
    assert (d.kind, d.verdict, d.confidence) == ("none", "no_oom", "medium")


def test_no_oom_is_high_only_when_the_log_reached_its_end(tmp_path):
    p = tmp_path / "x.log"
    p.write_text("[rank0]: iteration 10/ 100 | lm loss: 1.0\n")
    assert diagnose(scan([str(p)])).confidence == "medium"
    p.write_text("[rank0]: iteration 100/ 100 | lm loss: 1.0\n[rank0]: [after training is done] datetime: x\n")
    assert diagnose(scan([str(p)])).confidence == "high"


def test_fragmentation_barely_covering_says_both():
    d = diagnose(scan([str(DOCTOR / "allocator/fragmentation_barely_near_capacity.log")]))
    assert d.kind == "fragmentation" and d.confidence == "medium"
    assert d.summary.startswith("fragmentation caused this failure; capacity is next")
    assert [r["name"] for r in d.remedies][:2] == ["expandable_segments", "selective_recompute"]


# ----------------------------------------------------------------------------- --plot
def test_plot_writes_a_picture_of_the_run(tmp_path):
    pytest.importorskip("matplotlib")
    out_file = tmp_path / "ranks.png"
    out = mbmem("doctor", str(RUNS / "megatron_lm_tp4_pp2.log"), "--plot", str(out_file))
    assert out.returncode == 0 and f"plot: {out_file}" in out.stdout
    assert out_file.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = mbmem("doctor", str(RUNS / "megatron_lm_tp4_pp2.log"), "--plot", str(out_file))
    assert out.returncode == 2 and "exists already" in out.stderr            # --force to replace
    out = mbmem("doctor", str(RUNS / "megatron_lm_tp4_pp2.log"), "--plot", str(out_file), "--force")
    assert out.returncode == 0


def test_plot_without_memory_lines_says_so(tmp_path):
    pytest.importorskip("matplotlib")
    out = mbmem("doctor", str(DOCTOR / "allocator/current_capacity.log"), "--plot", str(tmp_path / "p.svg"))
    assert out.returncode == 0 and "plot: not written (no readable per-rank memory lines" in out.stdout
    assert not (tmp_path / "p.svg").exists()


# ----------------------------------------------------------------------------- --plan (imports Bridge once)
@pytest.fixture(scope="module")
def planned(bridge):
    """Each fixture's --plan report, in this process (Bridge is imported once per test session)."""
    from mbmem_overlays.cli import main
    cache: dict = {}

    def run(name: str, *extra: str) -> tuple[int, dict, str]:
        key = (name, extra)
        if key not in cache:
            import contextlib
            import io
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                rc = main(["doctor", str(RUNS / name), "--plan", "--json", *extra])
            data = json.loads(buf.getvalue())
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                main(["doctor", str(RUNS / name), "--plan", *extra])
            cache[key] = (rc, data, buf.getvalue())
        return cache[key]
    return run


@pytest.mark.bridge
def test_plan_puts_planned_beside_measured_for_every_reporting_rank(planned):
    rc, data, text = planned("bridge_llama3_8b_tp2_pp2.log")
    assert rc == 0
    run = data["run"]
    reporting = {r["rank"] for r in run["ranks"]}
    rows = {p["rank"]: p for p in run["planned"]}
    assert set(rows) == reporting
    for r in run["ranks"]:
        p = rows[r["rank"]]
        assert p["stage"] == r["stage"] and p["measured_max_allocated_bytes"] == r["max_allocated_bytes"]
        assert p["error_percent"] == round((p["planned_peak_bytes"] - r["max_allocated_bytes"])
                                           / r["max_allocated_bytes"] * 100, 1)
        assert p["iteration"] == r["iteration"]
    assert run["plan"]["layout"] == "TP2 PP2 CP2 DP1" and run["plan"]["recipe"] == "llama3_8b_pretrain"
    assert any("the phases run by its iteration" in a for a in run["plan"]["assumptions"])
    assert "planned" in text and "error" in text and "mean |error|" in text


@pytest.mark.bridge
def test_each_line_is_planned_as_of_its_iteration(bridge, tmp_path):
    """A line printed after iteration K is compared with the phases run by then (model.reported_breakdowns):
    under CUDA graphs with cuda_graph_warmup_steps >= K the eager run, not the replay peak after capture."""
    import contextlib
    import io

    from mbmem_overlays.cli import main
    from mbmem_overlays.memory import model as M
    # Nemotron 3 Nano's 16-H100 performance recipe: TE graphs on attention and Mamba, three eager warm-up steps
    recipe = "megatron.bridge.perf_recipes.nemotronh.h100.nemotronh.nemotron_3_nano_pretrain_16gpu_h100_bf16_config"
    cfg = bridge.build_recipe(recipe)
    shape, lay, st = M.from_config(cfg, 16)
    assert st.graph_scopes and st.graph_warmup_steps >= 2
    line = ("[Rank {}] (after {} iterations) memory (GB) | mem-allocated-gigabytes: 40.0 | "
            "mem-reserved-gigabytes: 62.0 | mem-max-allocated-gigabytes: 60.0 | mem-max-reserved-gigabytes: 64.0")
    log = tmp_path / "job.log"
    log.write_text(line.format(0, 1) + "\n" + line.format(1, 2) + "\n")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["doctor", str(log), "--plan", "--json", "--recipe", recipe, "--world-size", "16"])
    rows = {p["rank"]: p for p in json.loads(buf.getvalue())["run"]["planned"]}
    assert rows[0]["iteration"] == 1 and rows[1]["iteration"] == 2
    for rank, stage, iteration in ((0, 0, 1), (1, 0, 2)):
        want = M.reported_breakdowns(shape, lay, st, iteration)[stage]
        assert rows[rank]["planned_peak_bytes"] == int(want.total) and rows[rank]["phase"].startswith("eager")
        assert want.total != M.stage_breakdowns(shape, lay, st)[stage].total


@pytest.mark.bridge
def test_plan_lines_by_the_jobs_own_iterations(bridge, tmp_path):
    """A resumed job (reports after 1001 and 1002) is planned as iterations 1 and 2; a line after 0 iterations and
    a line without a max allocated are not compared; --world-size wins over the log's, and the status says so."""
    import contextlib
    import io

    from mbmem_overlays.cli import main
    from mbmem_overlays.memory import model as M
    recipe = "megatron.bridge.perf_recipes.nemotronh.h100.nemotronh.nemotron_3_nano_pretrain_16gpu_h100_bf16_config"
    full = ("[Rank {}] (after {} iterations) memory (GB) | mem-allocated-gigabytes: 40.0 | "
            "mem-max-allocated-gigabytes: 60.0 | mem-max-reserved-gigabytes: 64.0")
    no_max = "[Rank {}] (after {} iterations) memory (GB) | mem-allocated-gigabytes: 31.0"
    log = tmp_path / "job.log"
    log.write_text("\n".join(["torchrun --nproc_per_node=8 pretrain.py", full.format(0, 1001), full.format(0, 1002),
                              full.format(1, 1001), full.format(1, 1002), full.format(2, 0), no_max.format(3, 1002)])
                   + "\n")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        main(["doctor", str(log), "--plan", "--json", "--recipe", recipe, "--world-size", "16"])
    run = json.loads(buf.getvalue())["run"]
    rows = {p["rank"]: p for p in run["planned"]}
    cfg = bridge.build_recipe(recipe)
    shape, lay, st = M.from_config(cfg, 16)
    assert rows[0]["iteration"] == 1002 and rows[0]["planned_peak_bytes"] == int(
        M.reported_breakdowns(shape, lay, st, 2)[0].total)
    assert 2 not in rows                                        # after 0 iterations: no step has run
    assert rows[3]["measured_max_allocated_bytes"] is None and rows[3]["error_percent"] is None
    status = run["plan_status"]
    assert "at world size 16" in status and "world size from --world-size 16, not the 8 the log shows" in status
    assert "the job started after iteration 1000" in status and "1 line(s) printed before the first" in status
    assert "over 2 rank(s)" in status                           # ranks 0 and 1 only


@pytest.mark.bridge
def test_stage_breakdowns_agree_with_the_model_and_ranks_with_megatron_core(bridge):
    """The per-stage plan is memory/model.py's estimate on every rank; the stage of each rank is megatron-core's
    own RankGenerator's pipeline group (core/parallel_state.py)."""
    from megatron.core.parallel_state import RankGenerator

    from mbmem_overlays.doctor.run_plan import stage_breakdowns
    from mbmem_overlays.memory import model as M
    cfg = bridge.load_recipe("llama3_8b_pretrain")
    bridge.apply_overrides(cfg, ["model.pipeline_model_parallel_size=4"])
    shape, lay, st = M.from_config(cfg, 16)
    stages = stage_breakdowns(shape, lay, st)
    assert len(stages) == 4 and [b.rank for b in stages] == [0, 1, 2, 3]
    assert max(b.footprint for b in stages) == M.estimate(shape, lay, st).footprint
    for tp, cp, dp, pp, order, mapping in [(2, 2, 2, 2, "tp-cp-ep-dp-pp", "False"), (4, 1, 2, 2, "tp-cp-ep-dp-pp", "False"),
                                           (2, 1, 2, 4, "tp-cp-ep-pp-dp", "True")]:
        groups = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order).get_ranks("pp")
        want = {rank: stage for group in groups for stage, rank in enumerate(group)}
        from mbmem_overlays.doctor.parse import Findings, Seen
        f = Findings()
        f.layout, f.world = {"tp": tp, "cp": cp, "pp": pp, "dp": dp}, Seen(tp * cp * dp * pp, "x")
        f.config["use_tp_pp_dp_mapping"] = Seen(mapping, "x")
        smap = RR.stage_map(f)
        assert {r: smap.stage(r) for r in want} == want, (tp, cp, dp, pp, order)


@pytest.mark.bridge
def test_over_provisioned_advice_turns_something_off_validated_with_the_new_peak(planned):
    rc, data, text = planned("bridge_over_provisioned_recompute_offload.log")
    assert rc == 0 and data["kind"] == "over_provisioned"
    offs = [r for r in data["remedies"] if r["name"] in ("optimizer_offload_off", "full_to_selective")]
    assert offs and all(r["train_command"] and r["check"].startswith("validated") for r in offs)
    first = offs[0]
    assert first["predicted_peak_bytes"] > data["run"]["ranks"][0]["max_reserved_bytes"] and first["fits"]
    assert data["next_command"] == data["remedies"][0]["train_command"]
    # the largest step-time gain first (memory/cost/): giving full recompute back (~21% of this job's step) before
    # optimizer offload (<1% at GBS 512: the CPU step is a small part of 128 microbatches); turned off: it is gone
    assert [r["name"] for r in offs] == ["full_to_selective", "optimizer_offload_off"]
    assert offs[0]["step_cost"]["high"] < offs[1]["step_cost"]["high"] < 0
    assert "full_recompute" not in data["next_command"] and "selective_recompute" in data["next_command"]
    assert "predicted peak" in text


@pytest.mark.bridge
def test_the_turn_off_command_runs_as_pasted(planned):
    """Pasted into a shell at the repository root: train.py dry-runs it, our rules and Bridge's validation pass."""
    rc, data, _ = planned("bridge_over_provisioned_recompute_offload.log")
    out = paste(data["next_command"])
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]


@pytest.mark.bridge
def test_at_risk_with_plan_prices_the_ladder(planned):
    rc, data, _ = planned("bridge_at_risk.log")
    assert data["kind"] == "at_risk"
    priced = [r for r in data["remedies"] if r.get("predicted_peak_bytes") is not None]
    assert priced and all(r["predicted_peak_bytes"] < data["run"]["ranks"][0]["max_reserved_bytes"] for r in priced)
    if data["next_command"]:
        assert data["next_command"].startswith("python train.py recipe=llama3_8b_pretrain")


# ----------------------------------------------------------------------------- any memory line: no exception
def test_memory_line_fuzz_never_raises_and_keeps_bounds():
    from hypothesis import given, settings
    from hypothesis import strategies as st
    names = ["allocated", "max allocated", "reserved", "max reserved", "mem-max-allocated-gigabytes",
             "mem-max-reserved-gigabytes", "mem-alloc-retires", "peak_alloc", "num_ooms", "x", ""]
    values = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr), st.integers(-10**30, 10**30).map(str),
                       st.sampled_from(["1.2.3", "", "nan", "1e999", "-0.0", "0x10", "1_000", "٣"]),
                       st.text(max_size=12))
    field = st.tuples(st.sampled_from(names), values).map(lambda nv: f" | {nv[0]}: {nv[1]}")

    @settings(max_examples=300, derandomize=True, deadline=None)
    @given(st.sampled_from(["MB", "GB"]), st.lists(field, max_size=14), st.integers(0, 3), st.text(max_size=30))
    def check(unit, fields, copies, noise):
        line = (noise + "".join(f"[Rank {k}] (after {k} iterations) memory ({unit})" + "".join(fields)
                                for k in range(copies)))
        for r in ML.parse_reports(line, "x:1", None):
            if not r.unreadable:
                assert all(0 <= v <= ML.MAX_BYTES or k in ML.COUNT_FIELDS for k, v in r.values.items())
    check()


def test_the_substring_prefilter_never_hides_an_out_of_memory_line():
    """parse._oom_like skips the regexes when patterns.may_say_out_of_memory says the line cannot match them."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from mbmem_overlays.doctor import patterns as P
    words = ["out", "of", "memory", "Out", "OF", "Memory", "OOM", "oom", "room", "_", "-", " ", "cannot", "allocate",
             "Allocation", "failed", "Unable", "to", "enough", "GPU", "insufficient", "resource", "Resources", "OutOf",
             "CUresult", "error", ":", "2", "cudaError", "_t", "_ALLOC_FAILED", "MemoryAllocation", "could not",
             "alloc", "GiB", "1.0", "x"]

    @settings(max_examples=400, deadline=None, derandomize=True)
    @given(st.lists(st.sampled_from(words), max_size=12).map("".join))
    def check(text):
        matches = P.OOM_WORDS.search(text) or (P.ALLOC_WORDS.search(text) and P.MEMORY_WORDS.search(text))
        assert not matches or P.may_say_out_of_memory(text.lower())
    check()


def test_device_memory_used_counts_what_the_allocator_does_not_hold(tmp_path):
    # Megatron-LM --log-device-memory-used: torch.cuda.device_memory_used() (NVML, the whole device) at the report
    p = tmp_path / "dev.log"
    p.write_text("[Rank 0] (after 10 iterations) memory (MB) | allocated: 60000.00 | max allocated: 70000.00 | "
                 "reserved: 72000.00 | max reserved: 74000.00 | total device memory used: 76000.00\n")
    code, data = doctor_json(str(p), "--gpu-memory", "80GiB")
    (row,) = data["run"]["ranks"]
    assert row["device_used_bytes"] == 76000 * 2**20 and row["outside_torch_bytes"] == 4000 * 2**20
    assert row["headroom_bytes"] == 80 * GiB - 74000 * 2**20 - 4000 * 2**20
    assert data["run"]["verdict"] == "at_risk"          # 2.1 GiB left is under 5% of 80 GiB; without it, 7.7 GiB
    assert any("outside PyTorch's allocator" in x["text"] for x in data["run"]["findings"])
    p.write_text(p.read_text().replace(" | total device memory used: 76000.00", ""))
    code, data = doctor_json(str(p), "--gpu-memory", "80GiB")
    assert data["run"]["ranks"][0]["headroom_bytes"] == 80 * GiB - 74000 * 2**20
    assert data["run"]["verdict"] == "healthy"


def test_json_ranks_are_integers_or_null_with_a_label(tmp_path):
    p = tmp_path / "old.log"
    p.write_text("after 5 iterations memory (MB) | allocated: 10250.5693359375 | max allocated: 12606.06201171875 | "
                 "reserved: 17482.0 | max reserved: 17482.0\n")
    code, data = doctor_json(str(p))
    (row,) = data["run"]["ranks"]
    assert row["rank"] is None and row["label"] == f"? ({p})" and row["iteration"] == 5
    assert data["run"]["hot_rank"] is None and data["run"]["hot_label"] == f"? ({p})"
    assert all(x["rank"] is None for x in data["run"]["findings"])
    code, data = doctor_json(str(RUNS / "megatron_lm_tp4_pp2.log"))
    assert all(isinstance(r["rank"], int) and r["label"] == str(r["rank"]) for r in data["run"]["ranks"])
