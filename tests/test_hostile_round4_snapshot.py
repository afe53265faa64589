"""Hostile input, round 4 (issue 33): the snapshot reader (classes 1-7) and the run-log reader (classes 16-18).
Each test failed before its fix. A snapshot is data from another machine: every file here is crafted."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
import time

import pytest

import snapshot_gen as G
from conftest import ROOT, mbmem
from mbmem_overlays.doctor.snapshot.analyze import analyze
from mbmem_overlays.doctor.snapshot.load import SnapshotError, load
from mbmem_overlays.doctor.snapshot.model import MalformedSnapshot, normalize, shown_value

MiB = 1 << 20
D = 200_000   # nesting levels: far past the C stack for an unchecked recursion


def strict_json(text: str):
    """json.loads that refuses NaN and Infinity (what a strict JSON reader does)."""
    def bad(name):
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=bad)


def doctor_process(*argv, timeout=60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mbmem_overlays.cli", "doctor", *map(str, argv)], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout, check=False)


def small_snapshot() -> dict:
    G._FRAMES.clear()
    return G.dump([G.peak_run()])


# --- class 1: deep nesting where hashing recurses in C ---------------------------------------------------------------
DEEP = {
    "tuple as a dict key": b"\x80\x04}(" + b")" + b"\x85" * D + b"K\x01u.",
    "tuple in a set": b"\x80\x04\x8f(" + b")" + b"\x85" * D + b"\x90.",
    "frozensets in a frozenset": b"\x80\x04(" + b"(" * D + b")" + b"\x91" * D + b"\x91.",
    "tuple key built by TUPLE from marks": b"\x80\x04}(" + b"(" * D + b")" + b"t" * D + b"K\x01u.",
    "tuple key, protocol 2 with BINPUT": b"\x80\x02}(" + b")" + b"\x85q\x00" + b"\x85" * D + b"K\x01u.",
}


@pytest.mark.parametrize("case", sorted(DEEP))
def test_deep_hashable_nesting_is_refused_with_exit_2_not_a_crash(tmp_path, case):
    """A tuple nested 200,000 deep as a dict key or set element killed the process with SIGSEGV (tuplehash
    recurses in C without a check); the scan refuses it before the unpickler builds or hashes anything."""
    path = tmp_path / "deep.pickle"
    path.write_bytes(DEEP[case])
    out = doctor_process(path, "--json")
    assert out.returncode == 2, (out.returncode, out.stderr[-500:])
    payload = strict_json(out.stdout)
    assert payload["exit_code"] == 2 and "nests" in payload["error"] and "Traceback" not in out.stderr


def test_a_snapshots_own_shallow_tuples_still_read(tmp_path):
    """pool_id tuples and a few levels of tuples are no problem: the bound is far above any snapshot."""
    snap = small_snapshot()
    snap["segments"][0]["segment_pool_id"] = (0, 0)
    snap["extra"] = {((((1,),),),): ((1, 2), (3, (4, 5)))}
    path = tmp_path / "shallow.pickle"
    path.write_bytes(pickle.dumps(snap, protocol=4))
    assert normalize(load(str(path)).data).segments


# --- class 2: no raw value is formatted unbounded -------------------------------------------------------------------
def _shared_lists(levels: int) -> list:
    a: list = []
    for _ in range(levels):
        a = [a, a]   # repr doubles per level: 2**levels leaves
    return a


@pytest.mark.parametrize("value", [_shared_lists(60), 10 ** 5000, -(10 ** 5000), "x" * 10 ** 6, {str(i): [i] * 9 for i in
                                   range(10 ** 5)}, (1, [2, {3: (4, [5, [6, [7]]])}]), b"\x00" * 10 ** 6, 1.5e308],
                         ids=["shared lists", "big int", "big negative int", "long str", "big dict", "mixed", "bytes",
                              "float"])
def test_the_bounded_formatter_is_short_and_quick_for_any_value(value):
    start = time.perf_counter()
    text = shown_value(value)
    assert len(text) <= 80 and time.perf_counter() - start < 1.0
    assert "\n" not in text


@pytest.mark.parametrize("field,value", [("state", "SHARED"), ("size", "SHARED"), ("state", "BIGINT")])
def test_a_hostile_value_in_an_error_message_neither_hangs_nor_raises(tmp_path, field, value):
    """An error message showed a block's state with str(): a shared-list structure (a few hundred bytes in the
    pickle) expanded to 2**60 elements and hung; a many-digit integer raised ValueError (int->str limit)."""
    snap = small_snapshot()
    snap["segments"][0]["blocks"][0][field] = _shared_lists(60) if value == "SHARED" else 10 ** 600
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snap, protocol=4))
    start = time.perf_counter()
    out = doctor_process(path, "--json", timeout=30)
    assert time.perf_counter() - start < 10
    assert out.returncode == 2 and "Traceback" not in out.stderr
    message = strict_json(out.stdout)["error"]
    assert "no valid size/state" in message and len(message) < 600


def test_an_unknown_action_of_any_size_is_named_bounded():
    snap = small_snapshot()
    snap["device_traces"][0].append({"action": "\x1b[2J" + "a" * 10 ** 6, "addr": 1, "size": 1})
    report = analyze(normalize(snap), "s.pickle")
    assert any("not replayed" in p and "\\x1b" in p and len(p) < 400 for p in report.problems)


def test_a_frame_line_number_past_any_file_reads_as_unknown():
    from mbmem_overlays.doctor.snapshot.sites import Attributor
    frames = [{"filename": "megatron/core/transformer/mlp.py", "line": 10 ** 600, "name": "forward"}]
    assert Attributor().site(frames).text == "megatron/core/transformer/mlp.py:0 (forward)"


# --- class 3: allocator_settings checked; strict JSON ---------------------------------------------------------------
HOSTILE_SETTINGS = {"garbage_collection_threshold": float("nan"), "max_split_size": 2 ** 2000,
                    "expandable_segments": "yes", "pinned_num_register_threads": float("inf"),
                    "roundup_power2_divisions": {"1": 2 ** 900, "2": float("-inf"), "4": 4},
                    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "some_new_key": -float("inf"),
                    "x" * 5000: 1}


def _settings_file(tmp_path, name: str, settings: dict):
    snap = small_snapshot()
    snap["allocator_settings"] = settings
    path = tmp_path / name
    path.write_bytes(pickle.dumps(snap, protocol=4))
    return path


def test_hostile_allocator_settings_are_reported_and_left_out(tmp_path):
    path = _settings_file(tmp_path, "a.pickle", HOSTILE_SETTINGS)
    out = doctor_process(path, "--json")
    assert out.returncode == 0, out.stderr[-800:]
    assert "NaN" not in out.stdout and "Infinity" not in out.stdout
    payload = strict_json(out.stdout)
    settings = payload["allocator_settings"]
    assert settings == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "roundup_power2_divisions": {"4": 4}}
    problems = " ".join(payload["problems"])
    for word in ("garbage_collection_threshold is nan", "max_split_size is an integer of 2,001 bits",
                 "expandable_segments is 'yes', not true/false", "some_new_key is -inf",
                 "roundup_power2_divisions['1']", "not a setting name"):
        assert word in problems, (word, problems)
    text = doctor_process(path)
    assert text.returncode == 0 and "Traceback" not in text.stderr


def test_against_with_hostile_settings_prints_and_writes_strict_json(tmp_path):
    a = _settings_file(tmp_path, "a.pickle", HOSTILE_SETTINGS)
    b = _settings_file(tmp_path, "b.pickle", {"max_split_size": 2 ** 64 - 1, "garbage_collection_threshold": 0.6})
    for extra in ([], ["--json"]):
        out = doctor_process(a, "--against", b, *extra)
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-800:]
    payload = strict_json(out.stdout)
    differ = {d["key"]: (d["a"], d["b"]) for d in payload["allocator_settings_differ"]}
    assert differ["max_split_size"] == (None, 2 ** 64 - 1)   # SIZE_MAX (torch's "unset") is a valid setting
    assert differ["garbage_collection_threshold"] == (None, 0.6)


def test_every_snapshot_json_is_strict_even_with_a_nan_that_slipped_through():
    from mbmem_overlays.doctor.snapshot.render import json_safe
    obj = json_safe({"a": float("nan"), "b": [float("inf"), 2 ** 100000, (1, 2)], 3: -float("inf")})
    text = json.dumps(obj, allow_nan=False)
    assert strict_json(text) == {"a": None, "b": [None, strict_json(text)["b"][1], [1, 2]], "3": None}
    assert len(strict_json(text)["b"][1]) <= 80


# --- class 4: --html with a zero-size segment -----------------------------------------------------------------------
def test_html_with_only_empty_segments(tmp_path):
    snap = {"segments": [{"device": 0, "address": 4096, "total_size": 0, "stream": 0, "blocks": []}],
            "device_traces": [[]]}
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snap, protocol=4))
    out = doctor_process(path, "--html", tmp_path / "page.html")
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-800:]
    assert "<svg" in (tmp_path / "page.html").read_text()


# --- class 5: segments sharing an address ---------------------------------------------------------------------------
@pytest.mark.parametrize("pool", [(0, 0), (1, 7), None])
def test_a_plain_and_an_expandable_segment_at_one_address(tmp_path, pool):
    seg = {"device": 0, "address": 1 << 40, "total_size": 20 * MiB, "stream": 0, "segment_type": "large",
           "blocks": [{"size": 20 * MiB, "state": "inactive"}]}
    plain = dict(seg, segment_pool_id=pool) if pool else dict(seg)
    snap = {"segments": [plain, dict(seg, is_expandable=True)], "device_traces": [[]]}
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(snap, protocol=4))
    for extra in ([], ["--json"], ["--html", tmp_path / "p.html", "--force"]):
        out = doctor_process(path, *extra)
        assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr[-800:]


# --- class 6: what the unpickler builds is bounded, not only the file's bytes ---------------------------------------
def _shared_segments(refs: int) -> bytes:
    seg = {"device": 0, "address": 1 << 40, "total_size": 1000 * 512, "stream": 0,
           "blocks": [{"size": 512, "state": "inactive"} for _ in range(1000)]}
    return pickle.dumps({"segments": [seg] * refs, "device_traces": []}, protocol=4)


def _shared_entries(refs: int) -> bytes:
    entry = {"action": "alloc", "addr": 1 << 40, "size": 512, "stream": 0}
    return pickle.dumps({"segments": [], "device_traces": [[entry] * refs]}, protocol=4)


BOMBS = {
    "LONG_BINPUT with a huge index (9 bytes)": lambda: b"\x80\x04K\x01r\xff\xff\xff\x7f.",
    "PUT with a huge text index": lambda: b"\x80\x04K\x01p99999999999\n.",
    "BINPUT past the memo": lambda: b"\x80\x02K\x01q\x05.",
    "a list of 2 million empty dicts": lambda: b"\x80\x04](" + b"}" * 2_000_000 + b"e.",
    "a 2 KB integer": lambda: b"\x80\x04\x8b\x00\x08\x00\x00" + b"\x01" * 2048 + b".",
    "a text integer of 5,000 digits": lambda: b"\x80\x04I" + b"7" * 5000 + b"\n.",
    "a shared segment of 1,000 blocks referenced 200,000 times": lambda: _shared_segments(200_000),
    "a shared trace entry referenced 3 million times": lambda: _shared_entries(3_000_000),
}
RSS_CHILD = """
import resource, sys, json
from types import SimpleNamespace
from mbmem_overlays.cli.doctor_snapshot import report
args = SimpleNamespace(logs=[sys.argv[1]], recipe=None, set=[], world_size=None, plan=False, gpu_memory=None,
                       margin="0.05", plot=None, html=None, against=None, top="10", force=True, json=True, overlay_dir=[])
out = report(args, [sys.argv[1]])
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"code": out.exit_code, "text": out.text[-600:], "rss": peak}))   # ru_maxrss survives exec
"""


@pytest.mark.parametrize("case", sorted(BOMBS))
def test_what_a_hostile_pickle_would_build_is_refused_within_the_memory_budget(tmp_path, case):
    """A 9-byte pickle made a multi-GB memo table; a few MB of shared references expanded to GBs when normalised.
    Now: exit 2, and the process's peak RSS stays within the budget the docs give (12x + 64 MiB, plus the
    interpreter)."""
    data = BOMBS[case]()
    path = tmp_path / "bomb.pickle"
    path.write_bytes(data)
    out = subprocess.run([sys.executable, "-c", RSS_CHILD, str(path)], capture_output=True, text=True, cwd=ROOT,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-800:]
    result = json.loads(out.stdout)
    assert result["code"] == 2, result["text"]
    assert result["rss"] < 12 * len(data) + 64 * MiB + 150 * MiB, (result["rss"] / MiB, len(data) / MiB)


def test_the_build_budget_is_charged_before_building(tmp_path):
    """The refusal comes from the scan (nothing built), with the budget in the message."""
    path = tmp_path / "b.pickle"
    path.write_bytes(BOMBS["a list of 2 million empty dicts"]())
    with pytest.raises(SnapshotError, match="would take more than .* MiB in memory"):
        load(str(path))
    path.write_bytes(_shared_segments(200_000))
    loaded = load(str(path))
    with pytest.raises(MalformedSnapshot, match="more memory to analyse"):
        normalize(loaded.data, loaded.budget_left)


# --- class 7: linear in the number of expandable segments -----------------------------------------------------------
expandable_snapshot = G.expandable_snapshot   # shared with bench/snapshot_read.py


def test_expandable_segments_cost_linear_time():
    """A scan of every segment per mapped range made 20,000 segments take tens of seconds (quadratic); 4x the
    segments must cost well under 16x the time."""
    def cost(n: int) -> float:
        snap = normalize(expandable_snapshot(n))
        best = 1e9
        for _ in range(3):   # best of three: a busy CI worker slows single runs, not the best one
            start = time.perf_counter()
            report = analyze(snap, "s.pickle")
            best = min(best, time.perf_counter() - start)
        assert report.moment.totals.segments == n
        return best
    small, large = cost(1500), cost(6000)
    assert large < 10 * small + 0.3, (small, large)   # linear: ~4x; the quadratic scan was ~16x


# --- class 16: a log whose only memory lines are unreadable ---------------------------------------------------------
UNREADABLE = ("[Rank 0] (after 10 iterations) memory (MB) | allocated: nan | max allocated: nan | reserved: 5 | "
              "max reserved: inf\n"
              "[Rank 1] (after 10 iterations) memory (MB) | allocated: -3 | max allocated: 4 | reserved: 5 | "
              "max reserved: 6\n"
              "[Rank 2] (after 10 iterations) memory (GB) | mem-allocated-gigabytes: -inf | "
              "mem-max-reserved-gigabytes: NaN\n")


def test_a_log_of_only_unreadable_memory_lines_lists_them(tmp_path):
    """Exit 3 and not a word about the memory lines: now each is listed with why, in text and JSON."""
    log = tmp_path / "job.log"
    log.write_text(UNREADABLE)
    text = mbmem("doctor", str(log), timeout=60)
    assert text.returncode == 3
    assert "memory lines that could not be used (3" in text.stdout
    for where, why in (("job.log:1", "allocated: nan is not a memory figure"), ("job.log:2", "-3 is not a memory"),
                       ("job.log:3", "-inf is not a memory figure")):
        assert any(where in ln and why in ln for ln in text.stdout.splitlines()), (where, text.stdout)
    out = mbmem("doctor", str(log), "--json", timeout=60)
    payload = strict_json(out.stdout)
    assert payload["exit_code"] == 3 and payload["memory_unreadable"]["count"] == 3
    assert [r["where"].rpartition("/")[2] for r in payload["memory_unreadable"]["reports"]] == \
        ["job.log:1", "job.log:2", "job.log:3"]
    assert "nan" in payload["memory_unreadable"]["reports"][0]["why"]


# --- class 17: past MAX_RANKS ranks, the coolest are left out, never the hot one ----------------------------------
def _ranks_log(path, ranks: int, hot: int, order) -> None:
    lines = []
    for r in order(range(ranks)):
        mib = 80_500 if r == hot else 1000 + r % 7
        lines.append(f"[Rank {r}] (after 10 iterations) memory (MB) | allocated: {mib} | max allocated: {mib} | "
                     f"reserved: {mib} | max reserved: {mib}")
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("hot,order", [(0, reversed), (199, lambda r: r), (77, lambda r: sorted(r, key=lambda x: -x % 13))],
                         ids=["hot printed last", "hot is the highest rank", "scrambled"])
def test_past_max_ranks_the_hot_rank_is_kept_and_what_was_left_out_is_said(tmp_path, monkeypatch, hot, order):
    from mbmem_overlays.doctor import memlines as ML
    from mbmem_overlays.doctor.diagnose import diagnose
    from mbmem_overlays.doctor.parse import scan
    from mbmem_overlays.doctor.render import as_json, render
    monkeypatch.setattr(ML, "MAX_RANKS", 64)
    log = tmp_path / "job.log"
    _ranks_log(log, 200, hot, order)
    f = scan([str(log)])
    d = diagnose(f, capacity=80 * (1 << 30))
    assert d.kind == "at_risk" and d.run["hot_rank"] == hot, (d.kind, d.summary)
    left = d.run["ranks_left_out"]
    assert left["ranks"] == 136 and left["kept"] == 64 and left["first_rank"] is not None
    assert "left out 136 rank(s), ranks" in render(d, f)
    json.dumps(as_json(d, f), allow_nan=False)


def test_left_out_ranks_are_the_ones_with_the_lowest_peaks():
    from mbmem_overlays.doctor import memlines as ML
    peaks = [5, 1, 9, 3, 7, 2, 8]
    original = ML.MAX_RANKS
    try:
        ML.MAX_RANKS = 3
        series, dropped = {}, ML.Dropped()
        for rank, peak in enumerate(peaks):
            rep = ML.MemoryReport(rank, 10, f"x:{rank}", "GB", {"max_allocated": peak, "max_reserved": peak})
            ML.add_report(series, rank, rep, dropped)
    finally:
        ML.MAX_RANKS = original
    assert sorted(series) == [2, 4, 6]                  # peaks 9, 7, 8: the three hottest
    assert dropped.summary()["ranks"] == 4 and dropped.summary()["first_rank"] == 0


# --- class 18: contradictory world sizes ----------------------------------------------------------------------------
def test_contradictory_world_sizes_are_named_with_the_one_used(tmp_path):
    log = tmp_path / "job.log"
    log.write_text("torchrun --nproc_per_node 8 --nnodes 2 pretrain.py\nWORLD_SIZE=8\n"
                   "using world size: 32, data-parallel size: 4\n"
                   "[Rank 0] (after 10 iterations) memory (MB) | allocated: 1000 | max allocated: 2000 | "
                   "reserved: 3000 | max reserved: 3000\n")
    text = mbmem("doctor", str(log), timeout=60).stdout
    assert "world sizes in the log disagree" in text
    for value in ("16 from torchrun", "8 from the launcher", "32 from the launcher", "the doctor uses 8"):
        assert value in text, text
    assert "'WORLD_SIZE=8' [" in text and text.count("<- used") == 1
    payload = strict_json(mbmem("doctor", str(log), "--json", timeout=60).stdout)
    claims = {(c["value"], c["kind"], c["used"]) for c in payload["world_sizes"]}
    assert claims == {(16, "torchrun", False), (8, "launcher", True), (32, "launcher", False)}
    assert payload["world_size"] == 8


def test_agreeing_world_sizes_say_nothing_extra(tmp_path):
    log = tmp_path / "job.log"
    log.write_text("torchrun --nproc_per_node 8 --nnodes 2 pretrain.py\nWORLD_SIZE=16\n")
    assert "disagree" not in mbmem("doctor", str(log), timeout=60).stdout
