"""The allocator model (doctor/snapshot/allocator.py) and --what-if (whatif.py), issue 34: one test per allocator
rule on generated requests, the proof on generated snapshots of several shapes (mid-run ring, several streams,
deferred frees, expandable segments, an OOM), a deliberately wrong rule lowering the agreement, and the CLI.
No torch, no Bridge."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import snapshot_gen as G
from conftest import ROOT, mbmem
from mbmem_overlays.doctor.snapshot import allocator as A
from mbmem_overlays.doctor.snapshot import whatif as W
from mbmem_overlays.doctor.snapshot.model import normalize

FIX = ROOT / "tests" / "fixtures" / "snapshots"
KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def model(settings=A.Settings(), capacity=None) -> A.Allocator:
    return A.Allocator(settings, A.ModelDevice(capacity, 0, 1 << 44))


# -- rules -------------------------------------------------------------------------------------------------
def test_round_size_512_and_power2_divisions():
    assert A.round_size(1, A.Settings()) == 512
    assert A.round_size(513, A.Settings()) == 1024
    four = A.Settings(roundup_power2_divisions=(4,) * 16)
    assert A.round_size(1200 * 1024, four) == 1280 * 1024        # 1 MiB .. 2 MiB in 4 steps of 256 KiB
    assert A.round_size(2 * MiB, four) == 2 * MiB                 # a power of two stays


def test_allocation_size_small_large_and_rounded():
    assert A.allocation_size(600 * KiB) == 2 * MiB
    assert A.allocation_size(3 * MiB) == 20 * MiB
    assert A.allocation_size(10 * MiB + 1) == 12 * MiB


def test_small_requests_never_use_the_large_pool():
    a = model()
    big = a.malloc(30 * MiB, 0)
    a.free(big.ptr, False)
    small = a.malloc(4 * KiB, 0)
    assert not (big.ptr <= small.ptr < big.ptr + 30 * MiB)
    assert a.stats.segment_allocs == 2


def test_best_fit_on_the_same_stream_only():
    a = model()
    x, y = a.malloc(40 * MiB, 0).ptr, a.malloc(24 * MiB, 0).ptr
    a.free(x, False)
    a.free(y, False)
    assert a.malloc(22 * MiB, 0).ptr == y            # the smallest free block that fits
    other = a.malloc(22 * MiB, 7)                     # another stream never takes stream 0's blocks
    assert other.ptr not in (x, y) and a.stats.segment_allocs == 3


def test_should_split_large_remainder_over_1mib_only():
    a = model()
    seg = a.malloc(20 * MiB, 0)
    a.free(seg.ptr, False)
    whole = a.malloc(19 * MiB + 512 * KiB, 0)         # remainder 512 KiB <= 1 MiB: the whole block
    assert whole.size == 20 * MiB and a.stats.segment_allocs == 1
    a.free(whole.ptr, False)
    part = a.malloc(12 * MiB, 0)                      # remainder 8 MiB: split
    assert part.size == 12 * MiB


def test_max_split_size_oversize_blocks():
    s = A.Settings(max_split_size=512 * MiB)
    a = model(s)
    big = a.malloc(600 * MiB, 0).ptr
    a.free(big, False)
    assert a.malloc(100 * MiB, 0).ptr != big          # no oversize block for a request under max_split_size
    taken = a.malloc(590 * MiB, 0)
    assert taken.ptr == big and taken.size == 600 * MiB   # within 20 MiB of the request: taken whole
    b2 = a.malloc(700 * MiB, 0).ptr
    a.free(b2, False)
    assert a.malloc(650 * MiB, 0).ptr != b2           # 50 MiB over the request: refused


def test_free_merges_neighbours():
    a = model()
    x, y, z = (a.malloc(6 * MiB, 0).ptr for _ in range(3))  # one 20 MiB segment, three blocks and a tail
    a.free(x, False)
    a.free(y, False)
    assert a.malloc(12 * MiB, 0).ptr == x                 # x and y coalesced
    a.free(z, False)
    assert a.largest_free_block() == 8 * MiB              # z merged with the 2 MiB tail


def test_deferred_free_waits_for_free_completed():
    a = model()
    x = a.malloc(6 * MiB, 0)
    ptr = x.ptr
    a.free(ptr, True)                                     # used on another stream: events pending
    assert a.malloc(6 * MiB, 0).ptr != ptr
    a.free_block(x)                                       # free_completed
    assert a.malloc(6 * MiB, 0).ptr == ptr


def test_release_cached_blocks_then_retry_when_the_device_is_full():
    a = model(capacity=100 * MiB)
    x = a.malloc(60 * MiB, 0)
    a.free(x.ptr, False)                                  # cached, unsplit
    y = a.malloc(80 * MiB, 0)                              # 60 + 80 > 100: release the cached one, retry
    assert y is not None and a.stats.segment_frees == 1 and a.stats.reserved == 80 * MiB
    assert a.malloc(30 * MiB, 0) is None                  # nothing left to release: OOM


def test_release_available_cached_blocks_only_with_max_split():
    for s, frees in ((A.Settings(max_split_size=40 * MiB), 1), (A.Settings(), 1)):
        a = model(s, capacity=150 * MiB)
        x = a.malloc(60 * MiB, 0)
        a.free(x.ptr, False)
        assert a.malloc(100 * MiB, 0) is not None
        assert a.stats.segment_frees == frees


def test_expandable_segments_map_granules_and_grow_in_place():
    a = model(A.Settings(expandable_segments=True))
    x = a.malloc(30 * MiB, 0).ptr
    assert a.stats.reserved == 40 * MiB                   # two 20 MiB granules
    y = a.malloc(15 * MiB, 0)                             # fits in the mapped 10 MiB tail + one more granule
    assert y.ptr == x + 30 * MiB and a.stats.reserved == 60 * MiB
    s = a.malloc(4 * KiB, 0)                              # the small pool maps 2 MiB granules of its own
    assert a.stats.reserved == 62 * MiB and not (x <= s.ptr < x + 60 * MiB)


def test_expandable_unmaps_free_granules_when_full():
    a = model(A.Settings(expandable_segments=True), capacity=100 * MiB)
    x = a.malloc(60 * MiB, 0)
    y = a.malloc(20 * MiB, 0)
    a.free(x.ptr, False)
    z = a.malloc(70 * MiB, 0)                             # 60 MiB free below y cannot hold it: unmap, remap
    assert z is not None and a.stats.reserved <= 100 * MiB
    assert y.allocated


def test_garbage_collection_needs_a_memory_fraction():
    s = A.Settings(garbage_collection_threshold=0.3)
    for fraction, released in ((None, 0), (1.0, 1)):
        a = model(replace(s, memory_fraction=fraction), capacity=200 * MiB)
        x = a.malloc(80 * MiB, 0)
        a.free(x.ptr, False)
        a.malloc(30 * MiB, 1)                             # another stream: a new segment, after GC if any
        assert a.stats.segment_frees == released


def test_empty_cache_calls_are_told_from_malloc_retries():
    g = G.Allocator(0, capacity=8 * GiB)
    x, y = g.malloc(960 * MiB, "fc1"), g.malloc(96 * MiB, "fc1")
    g.free(x)
    g.release_cached()                                    # an empty_cache(): no segment_alloc follows
    g.free(y)
    g.release_cached()                                    # followed by a new segment: read as malloc's retry
    g.malloc(96 * MiB, "fc1")
    snap = normalize(G.dump([g]))
    calls = A.empty_cache_calls(snap.traces[0])
    assert len(calls) == 1


# -- the proof on generated snapshots of real shapes -------------------------------------------------------
def _proof(obj, settings=None):
    snap = normalize(obj)
    out = W.analyse(snap, [], None)
    return {d.device: d.proof for d in out}


def mid_run_multi_stream() -> G.Allocator:
    """A ring that starts mid-run (max_entries), two streams, deferred frees, small and large pools."""
    G._FRAMES.clear()
    a = G.Allocator(0, 80 * GiB, max_entries=400)
    G.model_state(a, params=2 * GiB)
    for step in range(6):
        keep = []
        for layer in range(6):
            keep.append(a.malloc(96 * MiB + layer * 512, "qkv", stream=0))
            keep.append(a.malloc(300 * KiB, "qkv", stream=0))
            comm = a.malloc(5 * MiB + step * 4096, "allgather", stream=1)
            a.free(comm, pending=layer % 2 == 0)
            if layer % 2 == 0:
                a.complete(comm)
            tmp = a.malloc(24 * MiB, "core_attn", stream=0)
            a.free(tmp)
        for addr in reversed(keep):
            a.free(addr)
    a.snapshot_marker()
    return a


@pytest.mark.parametrize("make", [
    lambda: G.dump([mid_run_multi_stream()]),
    lambda: G.dump([G.oom_run(act=384 * MiB)]),
    lambda: G.dump([G.oom_run(expandable=True)]),
    lambda: G.dump([G.fragmentation_run()]),
    lambda: G.dump([G.peak_run(0), G.oom_run(device=1)]),
], ids=["mid_run_multi_stream", "oom", "expandable_oom", "fragmentation", "two_devices"])
def test_proof_on_generated_snapshots(make):
    G._FRAMES.clear()
    proofs = _proof(make())
    for p in proofs.values():
        assert p.allocations > 0 and p.agreement == 1.0, p.first_divergence
        assert p.segments.differed == 0


def test_mid_run_trace_starts_with_live_blocks():
    obj = G.dump([mid_run_multi_stream()])
    first = obj["device_traces"][0][0]["action"]
    assert first != "segment_alloc" or len(obj["device_traces"][0]) == 400
    assert {e.get("stream") for e in obj["device_traces"][0]} >= {0, 1}


def test_a_wrong_rule_lowers_the_agreement(monkeypatch):
    obj = G.dump([mid_run_multi_stream()])
    right = _proof(obj)[0]
    # worst fit instead of best fit: the largest free block of the stream
    def worst_fit(self, pool, size, stream):
        keys = [k for k in pool.keys if k[0] == stream and k[1] >= size]
        if not keys:
            return None
        b = pool.blocks[keys[-1]]
        pool.erase(b)
        return b
    monkeypatch.setattr(A.Allocator, "get_free_block", worst_fit)
    wrong = _proof(obj)[0]
    assert wrong.at_recorded < right.at_recorded and wrong.first_divergence is not None
    monkeypatch.undo()
    # never split a large block
    frag = G.dump([G.fragmentation_run()])
    right = _proof(frag)[0]
    assert right.agreement == 1.0
    monkeypatch.setattr(A.Allocator, "should_split", lambda self, b, size: b.pool.small)
    assert _proof(frag)[0].at_recorded < right.at_recorded


def test_addresses_no_allocator_gives_are_not_proven():
    obj = G.dump([G.peak_run()])
    for e in obj["device_traces"][0]:
        if e["action"] == "alloc":
            e["addr"] += 3
    p = _proof(obj)[0]
    assert p.not_proven and p.at_recorded == 0


# -- what if -----------------------------------------------------------------------------------------------
def test_fragmentation_served_with_expandable_segments_capacity_not():
    snap = normalize(G.dump([G.fragmentation_run()]))
    d = W.analyse(snap, ["expandable_segments:True"], None)[0]
    assert d.baseline.served is False                       # the file's own settings reproduce the OOM
    assert d.scenarios[1].served is True and d.scenarios[1].spare > 0
    G._FRAMES.clear()
    snap = normalize(G.dump([G.oom_run()]))
    d = W.analyse(snap, ["all"], None)[0]
    assert d.baseline.served is False and not d.fitting()


def test_what_if_values_are_checked():
    assert W.check_values(["expandable_segments:True,max_split_size_mb:512", "all"]) is None
    for bad in ("max_split_size_mb:8", "nonsense:1", "expandable_segments:yes", "roundup_power2_divisions:3",
                "garbage_collection_threshold:2", "roundup_power2_divisions:[256:1,>:8]", ""):
        assert W.check_values([bad]), bad


def test_file_settings_the_model_does_not_know_are_named():
    s, notes = W.settings_of_file({"expandable_segments": False, "some_future_knob": 3}, [], None)
    assert any("some_future_knob" in n for n in notes)
    s, notes = W.settings_of_file({}, [], None)
    assert notes and "does not record" in notes[0]


def test_cli_what_if_text_and_json():
    r = mbmem("doctor", str(FIX / "fragmentation.pickle"), "--what-if", "expandable_segments:True")
    assert r.returncode == 0
    assert "with expandable_segments:True the failing request is served with" in r.stdout
    r = mbmem("doctor", str(FIX / "fragmentation.pickle"), "--what-if", "all", "--json")
    data = json.loads(r.stdout)["what_if"][0]
    assert data["proof"]["agreement"] == 1.0 and data["proof"]["chosen"][0]["address"] > 0
    r = mbmem("doctor", str(FIX / "fragmentation.pickle"), "--what-if", "max_split_size_mb:1", "--json")
    assert r.returncode == 2 and "at least 20" in json.loads(r.stdout)["error"]


def test_real_shaped_fixture_fragmentation_backed_by_the_replay():
    """The committed 1F1B fixture: a ring that starts mid-run, two streams, deferred frees, an OOM."""
    r = mbmem("doctor", str(FIX / "whatif_1f1b_oom.pickle"), "--what-if", "all")
    assert r.returncode == 0
    assert "959 at the recorded address (100.0%)" in r.stdout
    assert "  - with expandable_segments:True the failing request is served with 86.00 MiB to spare (replayed)" \
        in r.stdout.replace("; also", "\n").splitlines()


def test_capacity_backed_by_no_setting_serving_it():
    G._FRAMES.clear()
    snap = normalize(G.dump([G.one_f_one_b_run(capacity=17 * GiB, period=7, last=8)]))
    from mbmem_overlays.doctor.snapshot.advice import advise, with_replay
    from mbmem_overlays.doctor.snapshot.analyze import analyze
    report = analyze(snap, "x.pickle")
    assert report.kind == "capacity"
    d = W.analyse(snap, ["all"], None)
    assert d[0].proof.agreement == 1.0 and not d[0].fitting()
    adv = with_replay(advise(report, None), report, d)
    assert adv.reasons[-1].startswith("no allocator setting serves it (replayed; tried: expandable_segments:True")


def test_a_trace_no_model_would_follow_is_replayed_and_scored_low():
    """Allocations at random (aligned) places of four 1 GiB segments: the proof runs through, scores low and
    names the first divergence; the what-if replay still completes."""
    import random
    rng = random.Random(7)
    segs = [{"device": 0, "address": (1 << 40) + k * (1 << 32), "total_size": 1 << 30, "stream": 0,
             "segment_type": "large", "blocks": [{"size": 1 << 30, "state": "inactive"}]} for k in range(4)]
    trace, live = [], []
    while len(trace) < 3000:
        if live and rng.random() < 0.5:
            a = live.pop(rng.randrange(len(live)))
            trace += [{"action": "free_requested", "addr": a, "size": 4 * MiB},
                      {"action": "free_completed", "addr": a, "size": 4 * MiB}]
        else:
            a = (1 << 40) + rng.randrange(4) * (1 << 32) + rng.randrange(200) * 4 * MiB
            if a not in live:
                live.append(a)
                trace.append({"action": "alloc", "addr": a, "size": 4 * MiB})
    d = W.analyse(normalize({"segments": segs, "device_traces": [trace]}), ["expandable_segments:True"], None)[0]
    assert d.proof.allocations > 900 and d.proof.agreement < 0.2 and d.proof.first_divergence[0] == 0
    assert d.scenarios[1].peak_reserved > 0


@pytest.mark.parametrize("name", ["segment_list.pickle", "empty.pickle"])
def test_what_if_without_a_trace_says_so(name):
    r = mbmem("doctor", str(FIX / name), "--what-if", "all")
    assert r.returncode == 0 and "nothing to replay" in r.stdout
