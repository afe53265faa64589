"""The snapshot reader (issue 24): safe loading, every format, exact sums, the OOM replayed from the trace, attribution,
the verdict and next command, JSON, the offline HTML page, comparing two runs. No Bridge, no torch.

Ground truth comes from tests/snapshot_gen.py, a model of the caching allocator that writes each format and records
the state it saw at the OOM."""

from __future__ import annotations

import copy
import gzip
import json
import os
import pickle
import pickletools
import subprocess
import sys
from pathlib import Path

import pytest

import snapshot_gen as G
from conftest import ROOT, mbmem
from mbmem_overlays.doctor.snapshot import looks_like_snapshot
from mbmem_overlays.doctor.snapshot.analyze import analyze, compare, dump_totals
from mbmem_overlays.doctor.snapshot.load import SnapshotError, load
from mbmem_overlays.doctor.snapshot.model import MalformedSnapshot, normalize

FIX = ROOT / "tests" / "fixtures" / "snapshots"
GiB, MiB = 1 << 30, 1 << 20


def report_of(obj, name="snap.pickle", capacity=None):
    return analyze(normalize(obj), name, capacity=capacity)


def sim_oom(**kw):
    G._FRAMES.clear()
    return G.oom_run(**kw)


def doctor_json(*argv):
    out = mbmem("doctor", *map(str, argv), "--json", timeout=120)
    return out.returncode, json.loads(out.stdout), out


# ----------------------------------------------------------------------------- fixtures are the generator's output
def test_committed_fixtures_are_what_the_generator_writes(tmp_path):
    G.main(str(tmp_path))
    for name in G.FIXTURES:
        assert (tmp_path / name).read_bytes() == (FIX / name).read_bytes(), f"regenerate: python tests/snapshot_gen.py ({name})"


# ----------------------------------------------------------------------------- safe loading
EVIL_MARK = "mbmem-evil-ran"


class Evil:
    def __init__(self, target):
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def _crafted(target: Path) -> dict[str, bytes]:
    """Pickles that would run `touch target` (or need a callable) through every opcode that can call."""
    cmd = f"touch {target}".encode()
    s = b"X" + len(cmd).to_bytes(4, "little") + cmd        # BINUNICODE
    return {
        "STACK_GLOBAL+REDUCE": pickle.dumps({"segments": [Evil(target)]}, protocol=4),
        "GLOBAL+REDUCE": b"\x80\x02cos\nsystem\n" + s + b"\x85R.",
        "INST": b"\x80\x02(" + s + b"ios\nsystem\n.",
        "OBJ": b"\x80\x02(cos\nsystem\n" + s + b"o.",
        "NEWOBJ": b"\x80\x02cos\nsystem\n" + s + b"\x85\x81.",
        "NEWOBJ_EX": b"\x80\x04cos\nsystem\n" + s + b"\x85}\x92.",
        "PERSID": b"\x80\x02P" + cmd + b"\n.",
        "BINPERSID": b"\x80\x02" + s + b"Q.",
        "BUILD on a dict": b"\x80\x02}}(" + s + s + b"ub.",
        "REDUCE on a str": b"\x80\x02" + s + s + b"\x85R.",
    }


@pytest.mark.parametrize("case", sorted(_crafted(Path("/x"))))
def test_a_pickle_that_could_run_anything_is_refused_and_nothing_runs(tmp_path, case):
    target = tmp_path / EVIL_MARK
    data = _crafted(target)[case]
    ops = {op.name for op, _, _ in pickletools.genops(data)}
    wanted = {"STACK_GLOBAL+REDUCE": {"STACK_GLOBAL", "REDUCE"}, "GLOBAL+REDUCE": {"GLOBAL", "REDUCE"},
              "INST": {"INST"}, "OBJ": {"OBJ"}, "NEWOBJ": {"NEWOBJ"}, "NEWOBJ_EX": {"NEWOBJ_EX"}, "PERSID": {"PERSID"},
              "BINPERSID": {"BINPERSID"}, "BUILD on a dict": {"BUILD"}, "REDUCE on a str": {"REDUCE"}}[case]
    assert wanted <= ops, ops   # the crafted input really holds the opcode under test
    path = tmp_path / "snap.pickle"
    path.write_bytes(data)
    with pytest.raises(SnapshotError):
        load(str(path))
    assert not target.exists()


def test_the_cli_refuses_a_class_with_exit_2_and_a_json_error(tmp_path):
    target = tmp_path / EVIL_MARK
    path = tmp_path / "rank0_oom.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[Evil(target)]]}, protocol=4))
    code, payload, out = doctor_json(path)
    assert code == 2 and payload["ok"] is False and payload["exit_code"] == 2
    assert "asks to load the Python object posix.system" in payload["error"] and "nothing from the file was run" in \
        payload["error"]
    assert not target.exists() and "Traceback" not in out.stderr


def test_a_registered_copyreg_extension_still_needs_a_class(tmp_path):
    import copyreg
    copyreg.add_extension("os", "system", 0xF1)
    try:
        data = b"\x80\x02\x82\xf1X\x04\x00\x00\x00true\x85R."
        assert "EXT1" in {op.name for op, _, _ in pickletools.genops(data)}
        (tmp_path / "s.pickle").write_bytes(data)
        with pytest.raises(SnapshotError, match="refused"):
            load(str(tmp_path / "s.pickle"))
    finally:
        copyreg.remove_extension("os", "system", 0xF1)


def test_size_limit_before_reading_and_while_decompressing(tmp_path, monkeypatch):
    path = FIX / "snapshot_0.pickle"
    with pytest.raises(SnapshotError, match="MBMEM_SNAPSHOT_MAX_BYTES"):
        load(str(path), limit=1000)
    bomb = tmp_path / "bomb.pickle.gz"
    bomb.write_bytes(gzip.compress(pickle.dumps({"segments": [], "pad": "0" * (64 * MiB)}, protocol=4)))
    assert bomb.stat().st_size < 1 * MiB
    with pytest.raises(SnapshotError, match="decompresses to more than"):
        load(str(bomb), limit=4 * MiB)
    monkeypatch.setenv("MBMEM_SNAPSHOT_MAX_BYTES", "5000")
    out = mbmem("doctor", str(path), env={"MBMEM_SNAPSHOT_MAX_BYTES": "5000"}, timeout=60)
    assert out.returncode == 2 and "MBMEM_SNAPSHOT_MAX_BYTES" in out.stdout + out.stderr
    monkeypatch.setenv("MBMEM_SNAPSHOT_MAX_BYTES", "lots")
    with pytest.raises(SnapshotError, match="MBMEM_SNAPSHOT_MAX_BYTES"):
        load(str(path))


def _deep_frames_pickle(depth: int) -> bytes:
    """A valid snapshot whose block frames are a list nested ``depth`` deep (crafted with opcodes)."""
    G._FRAMES.clear()
    snap = G.dump([G.peak_run()])
    snap["segments"][0]["blocks"][0]["frames"] = "DEEPFRAMES"
    data = pickle.dumps(snap, protocol=4)
    marker = b"\x8c\x0aDEEPFRAMES\x94"
    assert data.count(marker) == 1
    return data.replace(marker, b"]\x94" + b"]" * (depth - 1) + b"a" * (depth - 1))


def test_deep_nesting_neither_recurses_nor_blows_up(tmp_path):
    path = tmp_path / "deep.pickle"
    path.write_bytes(_deep_frames_pickle(300_000))
    snap = normalize(load(str(path)).data)
    report = analyze(snap, str(path))
    assert report.kind == "none" and report.moment.totals.allocated > 0
    path.write_bytes(b"\x80\x04" + b"]" * 300_000 + b"a" * 299_999 + b".")
    with pytest.raises(MalformedSnapshot):
        normalize(load(str(path)).data)


def test_a_list_that_contains_itself_is_no_problem(tmp_path):
    cycle: list = []
    cycle.append(cycle)
    (tmp_path / "c.pickle").write_bytes(pickle.dumps({"segments": cycle, "device_traces": [cycle]}, protocol=4))
    obj = load(str(tmp_path / "c.pickle")).data
    assert obj["segments"][0] is obj["segments"]
    with pytest.raises(MalformedSnapshot, match="not a segment"):
        normalize(obj)


@pytest.mark.parametrize("data,why", [
    (b"not a pickle at all\n", "is not a pickle"),
    (pickle.dumps({"segments": []}, protocol=4)[:-3], "truncated"),
    (gzip.compress(b"plain text", mtime=0), "not a pickle"),
])
def test_unreadable_files_are_clear_errors(tmp_path, data, why):
    path = tmp_path / "x.pickle"
    path.write_bytes(data)
    with pytest.raises(SnapshotError, match=why):
        load(str(path))


@pytest.mark.parametrize("obj,why", [
    ({"device_traces": []}, "without 'segments'"),
    ({"segments": "x"}, "'segments' is not a list"),
    ({"segments": [{"address": 1, "total_size": 2 ** 70, "blocks": []}]}, "lacks a valid"),
    ({"segments": [{"address": 1, "total_size": 512, "blocks": [{"size": 512, "state": "weird"}]}]}, "state"),
    (42, "not a memory snapshot"),
])
def test_malformed_snapshots_are_refused(obj, why):
    with pytest.raises(MalformedSnapshot, match=why):
        normalize(obj)


def test_looks_like_snapshot_sniffs_content_and_never_opens_a_fifo(tmp_path):
    assert looks_like_snapshot(str(FIX / "snapshot_0.pickle"))
    assert looks_like_snapshot(str(FIX / "no_time.pickle.gz"))
    renamed = tmp_path / "job.log"
    renamed.write_bytes((FIX / "snapshot_0.pickle").read_bytes())
    assert looks_like_snapshot(str(renamed))                       # content, not the name
    log = tmp_path / "job.log.gz"
    log.write_bytes(gzip.compress(b"[rank0]: iteration 1\n"))
    assert not looks_like_snapshot(str(log))
    fifo = tmp_path / "pipe.pickle"
    os.mkfifo(fifo)
    assert not looks_like_snapshot(str(fifo))                      # returns at once: the fifo has no writer
    assert not looks_like_snapshot(str(tmp_path))
    assert not looks_like_snapshot(str(tmp_path / "missing.pickle"))


# ----------------------------------------------------------------------------- every format, exact sums
def _raw_sums(obj) -> dict[int, dict[str, int]]:
    """Per device, sums over the raw pickle's segments and blocks, written independently of the reader."""
    segments = obj if isinstance(obj, list) else obj["segments"]
    out: dict[int, dict[str, int]] = {}
    for seg in segments:
        d = out.setdefault(seg.get("device", 0), dict(reserved=0, allocated=0, active=0, inactive=0, segments=0,
                                                    largest_free=0))
        d["reserved"] += seg["total_size"]
        d["segments"] += 1
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                d["allocated"] += b["size"]
            if b["state"] != "inactive":
                d["active"] += b["size"]
            else:
                d["inactive"] += b["size"]
                d["largest_free"] = max(d["largest_free"], b["size"])
    return out


@pytest.mark.parametrize("name", sorted(G.FIXTURES))
def test_per_device_figures_equal_the_sums_over_segments_and_blocks(name):
    obj = load(str(FIX / name)).data
    report = analyze(normalize(obj), name)
    raw = _raw_sums(obj)
    assert {d.device for d in report.devices} == set(raw) | {
        i for i, t in enumerate(obj.get("device_traces", []) if isinstance(obj, dict) else []) if t}
    for d in report.devices:
        want = raw.get(d.device, dict(reserved=0, allocated=0, active=0, inactive=0, segments=0, largest_free=0))
        t = d.dump
        assert (t.reserved, t.allocated, t.active, t.inactive, t.segments, t.largest_free) == (
            want["reserved"], want["allocated"], want["active"], want["inactive"], want["segments"],
            want["largest_free"]), (name, d.device)
    assert not report.problems, report.problems


FORMATS = {  # fixture -> (layout, features that must be named)
    "snapshot_oom_rank-0.pickle": ("snapshot_dict", {"time_us", "frames", "allocator_settings", "external_annotations"}),
    "no_time.pickle.gz": ("snapshot_dict", {"frames"}),
    "compile_context.pickle": ("snapshot_dict", {"compile_context/user_metadata"}),
    "legacy_history.pickle": ("snapshot_dict", {"block history (older torch)"}),
    "segment_list.pickle": ("segment_list", set()),
    "expandable_oom.pickle": ("snapshot_dict", {"expandable segments"}),
    "two_devices.pickle": ("snapshot_dict", {"2 devices"}),
    "empty.pickle": ("snapshot_dict", {"empty"}),
}


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_every_format_is_read_and_named(name):
    layout, features = FORMATS[name]
    report = analyze(normalize(load(str(FIX / name)).data), name)
    assert report.format.layout == layout
    assert features <= set(report.format.features), report.format.features
    if name == "no_time.pickle.gz":
        assert "time_us" not in report.format.features and load(str(FIX / name)).gzip


def test_the_same_state_reads_the_same_in_every_format():
    """One allocator's state written in each format gives the same dump figures (history-less formats included)."""
    G._FRAMES.clear()
    a = G.peak_run()
    figures = {fmt: dump_totals(normalize(G.dump([a], fmt)).segments[0]) for fmt in
               ("modern", "no_time", "compile", "legacy", "segment_list")}
    assert len(set(figures.values())) == 1, figures
    assert figures["modern"].reserved == a.reserved and figures["modern"].allocated == a.allocated()


# ----------------------------------------------------------------------------- the state at the OOM
def test_oom_observer_dump_reports_the_state_the_allocator_saw_exactly():
    a = sim_oom()
    r = report_of(G.dump([a]), "x_oom_rank-3.pickle")
    f, m = r.oom, r.moment
    assert (r.rank, r.dump_kind, r.kind, r.confidence) == (3, "oom_observer", "capacity", "high")
    assert (f.request, f.device_free, f.allocated, f.reserved) == (
        a.truth["request"], a.truth["device_free"], a.truth["allocated"], a.truth["reserved"])
    assert m.totals.active == a.truth["active"] and m.error_bytes == 0


def test_a_dump_taken_after_unwinding_is_replayed_back_to_the_oom():
    a = sim_oom(unwind=True)
    r = report_of(G.dump([a]))
    dump = r.lead_device.dump
    f, m = r.oom, r.moment
    assert dump.allocated < a.truth["allocated"] - 6 * GiB     # at the dump the activations look freed ...
    assert dump.inactive > 6 * GiB
    assert f.reserved == a.truth["reserved"] and f.device_free == a.truth["device_free"]
    assert f.allocated <= a.truth["allocated"] <= f.allocated + m.error_bytes    # ... replayed, they are live
    assert m.error_bytes < MiB
    assert f.freed_after == f.allocated - dump.allocated and any("exception unwound" in x for x in f.reasons)
    assert r.kind == "capacity"


def test_fragmentation_when_free_plus_usable_reserved_covers_the_request():
    G._FRAMES.clear()
    a = G.fragmentation_run()
    r = report_of(G.dump([a]))
    f = r.oom
    assert r.kind == "fragmentation"
    assert f.request == 160 * MiB and f.device_free == a.truth["device_free"] < f.request
    assert f.largest_usable_free == 96 * MiB and f.usable_free >= f.request - f.device_free
    assert (f.allocated, f.reserved) == (a.truth["allocated"], a.truth["reserved"])


def test_other_processes_only_with_the_gpus_capacity():
    a = sim_oom(other=6 * GiB)
    obj = G.dump([a])
    assert report_of(obj).kind == "capacity"                 # capacity unknown: no claim about other processes
    r = report_of(obj, capacity=40 * GiB)
    assert r.kind == "other_processes" and r.oom.other_bytes == 6 * GiB


def test_expandable_segments_oom_is_capacity_and_says_what_mapping_could_give():
    a = sim_oom(expandable=True)
    r = report_of(G.dump([a]))
    f = r.oom
    assert r.kind == "capacity" and f.expandable and f.mapping_could_give is not None
    assert f.mapping_could_give < f.request
    assert (f.allocated, f.reserved, f.device_free) == (a.truth["allocated"], a.truth["reserved"],
                                                        a.truth["device_free"])
    assert any(s.expandable for s in r.moment.segments)


def test_every_device_is_reported_and_the_failing_one_leads():
    G._FRAMES.clear()
    obj = G.dump([G.peak_run(0), G.oom_run(device=1)])
    r = report_of(obj)
    assert [d.device for d in r.devices] == [0, 1] and r.lead == 1 and r.oom.device == 1
    assert r.devices[0].peak_allocated > 0 and r.devices[0].oom is None


def test_without_an_oom_the_peak_of_the_trace_is_reported():
    G._FRAMES.clear()
    a = G.peak_run()
    r = report_of(G.dump([a]), "base_0.pickle")
    d = r.lead_device
    assert (r.kind, r.rank, r.dump_kind) == ("none", 0, "scheduled")
    assert d.peak_allocated > d.dump.allocated and r.moment.kind == "peak"
    assert r.moment.totals.allocated == d.peak_allocated
    assert d.snapshot_checks == (1, 1)       # the replay agrees with torch's own 'snapshot' marker


def test_the_ring_keeps_the_last_events_only():
    G._FRAMES.clear()
    a = G.peak_run()
    a.max_entries = 60
    r = report_of(G.dump([a]))
    assert r.lead_device.entries == 60 and r.lead_device.inconsistent == 0
    assert r.moment.totals.allocated <= r.lead_device.peak_allocated


def test_an_oom_named_file_without_its_oom_entry_is_unsure():
    G._FRAMES.clear()
    obj = G.dump([G.peak_run()], "segment_list")
    r = report_of(obj, "snapshot_oom_rank-2.pickle")
    assert r.kind == "oom_unknown" and r.confidence == "low"


# ----------------------------------------------------------------------------- attribution
def test_sites_skip_cpp_and_framework_frames_and_agree_with_python_only_stacks():
    py = report_of(G.dump([sim_oom()])).moment
    cpp = report_of(G.dump([sim_oom(cpp=True)])).moment
    assert [(s.name, s.bytes, s.count) for s in py.sites] == [(s.name, s.bytes, s.count) for s in cpp.sites]
    names = [s.name for s in cpp.sites]
    assert "megatron/core/transformer/mlp.py:150 (forward)" in names
    assert not any("unwind" in n or "torch/" in n or "transformer_engine/pytorch" in n for n in names), names


def test_categories_come_from_the_frames():
    cats = {c.name: c.bytes for c in report_of(G.dump([sim_oom()])).moment.categories}
    assert cats["optimizer state"] == 16 * GiB
    assert cats["parameters and gradient buffers"] == 16 * GiB
    assert cats["activations: mlp"] > 0 and cats["activations: attention"] > 0


def test_a_private_memory_pool_is_the_cuda_graphs_category():
    obj = G.dump([sim_oom()])
    for seg in obj["segments"][:3]:
        seg["segment_pool_id"] = (1, 7)
    cats = {c.name for c in report_of(obj).moment.categories}
    assert "CUDA graphs (private memory pool)" in cats


def test_a_cpp_only_stack_is_named_by_its_first_non_allocator_frame():
    from mbmem_overlays.doctor.snapshot.sites import Attributor
    frames = [G.frame(f, line, n) for f, line, n in G.CPP[:4]] + [
        G.frame("ProcessGroupNCCL.cpp", 0, "c10d::ProcessGroupNCCL::allgather(...)")]
    site = Attributor().site(frames)
    assert site.text.startswith("(C++) c10d::ProcessGroupNCCL") and site.category == "communication buffers"
    assert Attributor().site([]).text.startswith("<no stack: allocated before history recording started")


def test_a_cpp_only_backward_stack_is_named_by_its_autograd_node():
    # autograd's thread records no Python frames: the node (MmBackward0) says what ran, the ATen helper does not
    from mbmem_overlays.doctor.snapshot.sites import Attributor
    frames = [G.frame(f, line, n) for f, line, n in G.CPP[:4]] + [
        G.frame("??", 0, "at::(anonymous namespace)::create_out(c10::ArrayRef<long>, c10::ArrayRef<long>, "
                         "c10::TensorOptions const&)"),
        G.frame("??", 0, "at::native::mm(at::Tensor const&, at::Tensor const&)"),
        G.frame("??", 0, "torch::autograd::generated::MmBackward0::apply(std::vector<at::Tensor>&&)"),
        G.frame("??", 0, "torch::autograd::Engine::evaluate_function(...)")]
    assert Attributor().site(frames).text == "(C++) torch::autograd::generated::MmBackward0::apply(std::vector<at::Tensor>&&)"


# ----------------------------------------------------------------------------- CLI: JSON, next command, HTML
def test_json_schema_of_one_snapshot():
    code, p, _ = doctor_json(FIX / "unwound_oom.pickle", "--top", "3")
    assert code == 0 and p["schema_version"] == 1
    assert {"devices", "oom", "peak", "top_sites", "kind", "confidence", "next_command", "exit_code"} <= set(p)
    for d in p["devices"]:
        assert {"reserved_bytes", "allocated_bytes", "active_bytes", "inactive_bytes", "largest_free_block_bytes",
                "segments"} <= set(d)
    assert {"device", "request_bytes", "device_free_bytes", "allocated_bytes", "reserved_bytes"} <= set(p["oom"])
    assert {"device", "allocated_bytes", "time_us"} <= set(p["peak"])
    assert len(p["top_sites"]) == 3 and all({"site", "bytes", "count"} <= set(s) for s in p["top_sites"])
    assert p["kind"] == "capacity" and p["confidence"] == "high" and p["next_command"].startswith("python train.py")
    assert p["oom"]["allocated_bytes"] > p["devices"][0]["allocated_bytes"]   # the OOM state, not the dump


def test_next_command_for_fragmentation_is_expandable_segments():
    code, p, _ = doctor_json(FIX / "fragmentation.pickle", "--recipe", "llama3_8b_pretrain")
    assert code == 0 and p["kind"] == "fragmentation"
    assert p["next_command"] == "python train.py recipe=llama3_8b_pretrain +mem=expandable_segments"
    assert "checked against the overlay catalogue" in p["command_check"]


def test_several_ranks_at_once_the_oom_leads(tmp_path):
    for name in ("snapshot_0.pickle", "snapshot_oom_rank-0.pickle", "empty.pickle"):
        (tmp_path / name).write_bytes((FIX / name).read_bytes())
    code, p, _ = doctor_json(tmp_path / "*.pickle")
    assert code == 0 and len(p["snapshots"]) == 3
    assert p["file"].endswith("snapshot_oom_rank-0.pickle") and p["kind"] == "capacity"


def test_an_unreadable_file_among_good_ones_makes_exit_2(tmp_path):
    (tmp_path / "bad.pickle").write_bytes(b"\x80\x04garbage")
    code, p, out = doctor_json(FIX / "snapshot_0.pickle", tmp_path / "bad.pickle")
    assert code == 2 and p["exit_code"] == 2 and any(s.get("ok") is False for s in p["snapshots"])
    assert "Traceback" not in out.stderr


def test_unsure_exit_4():
    G._FRAMES.clear()
    obj = G.dump([G.peak_run()], "segment_list")
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"mbmem-test-{os.getpid()}_oom_rank-0.pickle"
    path.write_bytes(pickle.dumps(obj, protocol=4))
    try:
        code, p, _ = doctor_json(path)
    finally:
        path.unlink()
    assert code == 4 and p["kind"] == "oom_unknown"


@pytest.mark.parametrize("argv,why", [
    (["--top", "0"], "--top"), (["--top", "x"], "--top"), (["--gpu-memory", "lots"], "--gpu-memory"),
    (["--margin", "2"], "--margin"), (["--world-size", "0"], "--world-size"), (["--plan"], "--plan needs --recipe"),
    (["--recipe", "os.system"], "os.system"), (["--html", "x.png"], "--html"), (["--plot", "p.png"], "--html FILE"),
    (["--set", "model..x=1"], "model..x"),
])
def test_bad_options_are_exit_2_with_a_json_error(argv, why):
    code, p, out = doctor_json(FIX / "snapshot_0.pickle", *argv)
    assert code == 2 and p["ok"] is False and why in p["error"], p
    assert "Traceback" not in out.stderr


def test_html_is_offline_self_contained_and_escaped(tmp_path):
    obj = G.dump([sim_oom()])
    evil = "<script>alert(1)</script>\u202e"
    for seg in obj["segments"]:
        for b in seg["blocks"]:
            for f in b["frames"]:
                if f.get("name") == "forward" and "mlp.py" in f["filename"]:
                    f["name"] = evil
    path = tmp_path / "s.pickle"
    path.write_bytes(pickle.dumps(obj, protocol=4))
    page = tmp_path / "page.html"
    out = mbmem("doctor", str(path), "--html", str(page), timeout=120)
    assert out.returncode == 0, out.stderr
    html = page.read_text()
    assert "http://" not in html and "https://" not in html and "<script" not in html
    assert "&lt;script&gt;" in html and "OOM" in html and "<svg" in html
    assert "\\u202e" in out.stdout and "\u202e" not in out.stdout      # escaped in text too
    again = mbmem("doctor", str(path), "--html", str(page), timeout=60)
    assert again.returncode == 2 and "exists already" in again.stdout + again.stderr


def test_compare_two_snapshots_lists_settings_first_and_what_grew():
    code, p, _ = doctor_json(FIX / "regression_after.pickle", "--against", FIX / "regression_before.pickle")
    assert code == 0 and p["kind"] == "comparison"
    assert {s["key"] for s in p["allocator_settings_differ"]} == {"PYTORCH_CUDA_ALLOC_CONF", "max_split_size"}
    grew = p["categories"][0]
    assert grew["name"] == "activations: mlp" and grew["delta_bytes"] > 2 * GiB
    assert p["sites"][0]["delta_bytes"] == grew["delta_bytes"]
    out = mbmem("doctor", str(FIX / "regression_after.pickle"), "--against", str(FIX / "regression_before.pickle"))
    text = out.stdout
    assert text.index("allocator settings that differ") < text.index("what changed, by category")


def test_compare_is_a_direct_function_too():
    a, b = report_of(G.dump([sim_oom(act=768 * MiB)])), report_of(G.dump([sim_oom()]))
    c = compare(a, b)
    assert not c.settings and c.totals[0].name == "allocated"
    assert c.categories[0].delta > 0


def test_against_needs_one_snapshot():
    out = mbmem("doctor", str(FIX / "snapshot_0.pickle"), str(FIX / "empty.pickle"), "--against",
                str(FIX / "regression_before.pickle"), timeout=60)
    assert out.returncode == 2 and "exactly one snapshot" in out.stdout + out.stderr


def test_the_snapshot_doctor_imports_neither_torch_nor_bridge(tmp_path):
    code = ("import sys; from mbmem_overlays.cli import main;"
            f"main(['doctor', {str(FIX / 'unwound_oom.pickle')!r}, '--html', {str(tmp_path / 'p.html')!r}]);"
            f"main(['doctor', {str(FIX / 'regression_after.pickle')!r}, '--against', "
            f"{str(FIX / 'regression_before.pickle')!r}]);"
            "print('LEAK' if any(m.startswith(('megatron','torch')) for m in sys.modules) else 'CLEAN')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("CLEAN")


def test_a_real_shaped_file_with_hostile_strings_is_shown_escaped():
    obj = G.dump([sim_oom()])
    obj["allocator_settings"]["PYTORCH_CUDA_ALLOC_CONF"] = "\x1b[2Jexpandable_segments:False"
    from mbmem_overlays.doctor.snapshot.advice import advise
    from mbmem_overlays.doctor.snapshot.render import render
    r = report_of(copy.deepcopy(obj))
    text = render(r, advise(r, None), 5)
    assert "\x1b" not in text and "\\x1b[2J" in text


def test_the_docs_show_what_the_commands_print():
    """docs/snapshots.md's report and comparison are this code's output, word for word."""
    import re
    import shlex
    text = (ROOT / "docs" / "snapshots.md").read_text()
    blocks = re.findall(r"```text\n\$ (mbmem doctor [^\n]*)\n((?:(?!```)[^\n]*\n)*)```", text)
    assert len(blocks) >= 2 and any("--against" in cmd for cmd, _ in blocks)
    for cmd, shown_output in blocks:
        out = mbmem(*shlex.split(cmd)[1:], timeout=120)
        assert out.stdout.rstrip() == shown_output.rstrip(), f"docs/snapshots.md is out of date for: {cmd}"


# ----------------------------------------------------------------------------- hand-built traces (torch's schema)
def _blk(addr, size, state="active_allocated"):
    return {"address": addr, "size": size, "requested_size": size, "state": state, "frames": []}


def _seg(addr, blocks, pool=(0, 0), expandable=False, kind=None):
    total = sum(b["size"] for b in blocks)
    return {"device": 0, "address": addr, "total_size": total, "stream": 0, "segment_pool_id": pool,
            "segment_type": kind or ("small" if total == 2 * MiB and not expandable else "large"),
            "is_expandable": expandable, "frames": [], "blocks": blocks,
            "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
            "active_size": sum(b["size"] for b in blocks if b["state"] != "inactive")}


def _trace(*entries):
    out = []
    for i, (action, where, size, *pool) in enumerate(entries):
        out.append({"action": action, ("device_free" if action == "oom" else "addr"): where, "size": size,
                    "stream": 0, "time_us": G.T0 + i, "pool_id": pool[0] if pool else (0, 0)})
    return out


def test_a_trace_recorded_without_free_requested_replays_frees_as_allocated():
    # _record_memory_history(skip_actions=["free_requested"]) (torch/cuda/memory.py's own example): undoing a
    # free_completed that nothing announced gives back an allocated block, not one awaiting other streams
    A, B = 0x7F0000000000, 0x7F0000800000
    segs = [_seg(A, [_blk(A, 8 * MiB), _blk(B, 8 * MiB, "inactive"), _blk(B + 8 * MiB, 4 * MiB, "inactive")])]
    full = _trace(("segment_alloc", A, 20 * MiB), ("alloc", A, 8 * MiB), ("alloc", B, 8 * MiB),
                  ("oom", MiB, 10 * MiB), ("free_requested", B, 8 * MiB), ("free_completed", B, 8 * MiB))
    skipped = [e for e in full if e["action"] != "free_requested"]
    for trace in (full, skipped):
        r = report_of({"segments": segs, "device_traces": [trace]})
        t = r.moment.totals
        assert (t.allocated, t.active, r.lead_device.inconsistent) == (16 * MiB, 16 * MiB, 0), trace
        assert r.kind == "capacity"


def test_an_oom_in_a_private_pool_is_judged_on_that_pool_only():
    # during CUDA graph capture the request comes from the capture's private pool (the oom entry's pool_id), and
    # the default pool's cached 16 MiB cannot be released for it: 1 + 2 MiB < 10 MiB is capacity
    D, P = 0x7FC000000000, 0x7FC002000000
    segs = [_seg(D, [_blk(D, 4 * MiB), _blk(D + 4 * MiB, 16 * MiB, "inactive")]),
            _seg(P, [_blk(P, 18 * MiB), _blk(P + 18 * MiB, 2 * MiB, "inactive")], pool=(1, 0))]
    trace = _trace(("segment_alloc", D, 20 * MiB), ("alloc", D, 4 * MiB), ("segment_alloc", P, 20 * MiB, (1, 0)),
                   ("alloc", P, 18 * MiB, (1, 0)), ("oom", MiB, 10 * MiB, (1, 0)))
    r = report_of({"segments": segs, "device_traces": [trace]})
    assert r.kind == "capacity" and r.oom.usable_free == 2 * MiB
    assert any("private pool (1, 0)" in x for x in r.oom.reasons)
    trace[-1]["pool_id"] = (0, 0)   # the same request in the default pool: its 16 MiB block serves it
    assert report_of({"segments": segs, "device_traces": [trace]}).kind == "fragmentation"


def test_expandable_large_pool_maps_20_mib_granules():
    # the large pool's expandable segment maps kLargeBuffer (20 MiB) at a time: 19 MiB free on the device is no
    # whole granule, so only the 7 MiB free tail could grow an 18 MiB block
    E = 0x7F0000000000
    segs = [_seg(E, [_blk(E, 30 * MiB), _blk(E + 30 * MiB, 8 * MiB, "inactive"), _blk(E + 38 * MiB, 15 * MiB),
                     _blk(E + 53 * MiB, 7 * MiB, "inactive")], expandable=True)]
    trace = _trace(("segment_map", E, 40 * MiB), ("alloc", E, 30 * MiB), ("alloc", E + 30 * MiB, 8 * MiB),
                   ("segment_map", E + 40 * MiB, 20 * MiB), ("alloc", E + 38 * MiB, 15 * MiB),
                   ("free_requested", E + 30 * MiB, 8 * MiB), ("free_completed", E + 30 * MiB, 8 * MiB),
                   ("oom", 19 * MiB, 18 * MiB))
    r = report_of({"segments": segs, "device_traces": [trace]})
    assert r.kind == "capacity" and r.oom.mapping_could_give == 7 * MiB
    trace[-1]["device_free"] = 21 * MiB   # one whole granule free: mapping could give 27 MiB
    assert report_of({"segments": segs, "device_traces": [trace]}).oom.mapping_could_give == 27 * MiB


def test_an_expandable_range_the_replay_recreates_takes_its_pool_from_its_blocks():
    # a large-pool range unmapped before the dump, beside a small-pool segment at a lower address: a 50 MiB
    # block can only be the large pool's (get_pool: requests over kSmallSize)
    ES, EL = 0x7FA000000000, 0x7FB000000000
    segs = [_seg(ES, [_blk(ES, 512 * 1024), _blk(ES + 512 * 1024, 1536 * 1024, "inactive")], expandable=True,
                 kind="small")]
    trace = _trace(("segment_map", ES, 2 * MiB), ("alloc", ES, 512 * 1024), ("segment_map", EL, 60 * MiB),
                   ("alloc", EL, 50 * MiB), ("oom", 5 * MiB, 40 * MiB), ("free_requested", EL, 50 * MiB),
                   ("free_completed", EL, 50 * MiB), ("segment_unmap", EL, 60 * MiB))
    r = report_of({"segments": segs, "device_traces": [trace]})
    (large,) = [s for s in r.moment.segments if s.address == EL]
    assert large.kind == "large" and r.oom.usable_free == 10 * MiB and r.oom.mapping_could_give == 10 * MiB
