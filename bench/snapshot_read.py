"""`mbmem doctor SNAPSHOT` speed and peak memory on a large snapshot (issue 24: a 100 MB snapshot with 100k
trace entries is read and summarised in under 10 s with peak memory under 10x the file size).

Usage: .venv/bin/python bench/snapshot_read.py [--what-if] [MB] [ENTRIES] [SEGMENTS]   (default: 100 100000 30000;
--what-if: only the what-if replays, the generated training trace and the hostile shapes of issue 39)

The snapshot is generated to the documented schema with the shape of a real Bridge dump: 100,000 trace entries
(Bridge's ring) of alloc / free_requested / free_completed over 1 GiB segments, each entry with its own frame
list of shared frame dicts (torch dedups frames, pickle memoizes them), an OOM near the end and the unwinding
frees after it, so the replay runs back past them. Each case runs in a fresh process through the CLI's own
report function (safe load, every device, the OOM replay, attribution, the next command, JSON), which reports
its wall time and peak RSS; the ratio is peak RSS / file size.

Then the hostile files of issue 33, each in a fresh process the same way: SEGMENTS expandable segments (each
mapped range was matched against every segment: quadratic), and pickles built to expand in memory far beyond
their size (a memo index far past the memo, millions of empty dicts, shared segments and trace entries
referenced over and over, a deep tuple as a dict key). Each must end within seconds with exit 2 (or 0 for the
expandable segments) and a peak RSS within the reader's budget: 12x the pickle plus 64 MiB, plus the
interpreter.
"""

import os
import pickle
import subprocess
import sys
import tempfile

MiB, GiB = 1 << 20, 1 << 30
WHAT_IF_ONLY = "--what-if" in sys.argv      # only the what-if replays (issue 34, issue 39 #15)
_args = [a for a in sys.argv[1:] if a != "--what-if"]
target_mb = float(_args[0]) if len(_args) > 0 else 100.0
entries = int(_args[1]) if len(_args) > 1 else 100_000
expandable_segments = int(_args[2]) if len(_args) > 2 else 30_000

SITES = [("megatron/core/transformer/attention.py", 1012, "forward"), ("megatron/core/transformer/mlp.py", 150, "forward"),
         ("megatron/core/models/gpt/gpt_model.py", 480, "_postprocess"),
         ("megatron/core/tensor_parallel/mappings.py", 280, "_gather_along_first_dim")]
PREFIX = "/usr/local/lib/python3.12/site-packages/"


def frames_pool(depth: int) -> list[list[dict]]:
    """Per site a stack of ``depth`` shared frames: framework internals, the site, then the training loop."""
    pools = []
    for k, (f, line, name) in enumerate(SITES):
        inner = [{"filename": PREFIX + f"torch/nn/modules/module{i % 7}.py", "line": 1700 + i, "name": "_call_impl"}
                 for i in range(depth // 3)]
        site = [{"filename": PREFIX + f, "line": line, "name": name}]
        outer = [{"filename": PREFIX + f"megatron/core/pipeline_parallel/schedules{i % 5}.py", "line": 400 + i + k,
                  "name": "forward_step"} for i in range(depth - len(inner) - 1)]
        pools.append(inner + site + outer)
    return pools


def snapshot(n_entries: int, depth: int) -> dict:
    """Segments of 64 x 16 MiB slots; a rolling window of live slots; an OOM, then the unwinding frees."""
    slots_per_seg, slot = 64, 16 * MiB
    n_seg = 16
    base = 0x7F0000000000
    addrs = [base + s * (GiB + 64 * MiB) + k * slot for s in range(n_seg) for k in range(slots_per_seg)]
    pools = frames_pool(depth)
    trace, live, t = [], {}, 1_764_000_000_000_000
    for s in range(n_seg):
        trace.append({"action": "segment_alloc", "addr": base + s * (GiB + 64 * MiB), "size": GiB, "stream": 0,
                      "time_us": t, "frames": list(pools[0])})
    i = 0
    oom_at = n_entries - 2000
    while len(trace) < n_entries:
        t += 11
        if len(trace) == oom_at:
            trace.append({"action": "oom", "device_free": 300 * MiB, "size": GiB, "stream": 0, "time_us": t,
                          "frames": list(pools[1])})
            for addr in list(live)[::-1]:
                if len(trace) + 2 > n_entries:
                    break
                fr = live.pop(addr)
                trace.append({"action": "free_requested", "addr": addr, "size": slot, "stream": 0, "time_us": t, "frames": fr})
                trace.append({"action": "free_completed", "addr": addr, "size": slot, "stream": 0, "time_us": t, "frames": fr})
            continue
        addr = addrs[i % len(addrs)]
        i += 1
        if addr in live:
            fr = live.pop(addr)
            trace.append({"action": "free_requested", "addr": addr, "size": slot, "stream": 0, "time_us": t, "frames": fr})
            trace.append({"action": "free_completed", "addr": addr, "size": slot, "stream": 0, "time_us": t, "frames": fr})
        else:
            fr = list(pools[i % len(pools)])
            live[addr] = fr
            trace.append({"action": "alloc", "addr": addr, "size": slot, "stream": 0, "time_us": t, "frames": fr})
    trace = trace[:n_entries]
    segments = []
    for s in range(n_seg):
        seg_base = base + s * (GiB + 64 * MiB)
        blocks, run = [], None
        for k in range(slots_per_seg):
            a = seg_base + k * slot
            if a in live:
                if run:
                    blocks.append(run)
                    run = None
                blocks.append({"address": a, "size": slot, "requested_size": slot, "state": "active_allocated",
                               "frames": live[a]})
            elif run:
                run["size"] += slot
            else:
                run = {"address": a, "size": slot, "requested_size": 0, "state": "inactive", "frames": []}
        if run:
            blocks.append(run)
        used = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
        segments.append({"device": 0, "address": seg_base, "total_size": GiB, "allocated_size": used,
                         "active_size": used, "requested_size": used, "stream": 0, "segment_type": "large",
                         "segment_pool_id": (0, 0), "is_expandable": False, "frames": [], "blocks": blocks})
    return {"segments": segments, "device_traces": [trace], "allocator_settings": {"expandable_segments": False},
            "external_annotations": []}


def expandable_snapshot(n: int) -> dict:
    """``n`` expandable segments, each one mapped range with one live block (tests/snapshot_gen.py)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import snapshot_gen
    return snapshot_gen.expandable_snapshot(n, PREFIX)


def hostile_files() -> list[tuple[str, bytes]]:
    seg = {"device": 0, "address": 1 << 40, "total_size": 1000 * 512, "stream": 0,
           "blocks": [{"size": 512, "state": "inactive"} for _ in range(1000)]}
    entry = {"action": "alloc", "addr": 1 << 40, "size": 512, "stream": 0}
    return [
        # a quarter and the whole: linear time takes ~4x as long for the whole, quadratic took ~16x
        (f"{expandable_segments // 4:,} expandable segments",
         pickle.dumps(expandable_snapshot(expandable_segments // 4), 4)),
        (f"{expandable_segments:,} expandable segments", pickle.dumps(expandable_snapshot(expandable_segments), 4)),
        ("memo index 2**31 (9 bytes)", b"\x80\x04K\x01r\xff\xff\xff\x7f."),
        ("10M empty dicts in a list", b"\x80\x04](" + b"}" * 10_000_000 + b"e."),
        ("1 segment x 1,000 blocks, 1M refs", pickle.dumps({"segments": [seg] * 1_000_000, "device_traces": []}, 4)),
        ("1 trace entry, 20M refs", pickle.dumps({"segments": [], "device_traces": [[entry] * 20_000_000]}, 4)),
        ("tuple 1M deep as a dict key", b"\x80\x04}(" + b")" + b"\x85" * 1_000_000 + b"K\x01u."),
    ]


CHILD = """
import resource, sys, time, json
from types import SimpleNamespace
from mbmem_overlays.cli.doctor_snapshot import report
args = SimpleNamespace(logs=[sys.argv[1]], recipe=None, set=[], world_size=None, plan=False, gpu_memory=None,
                       margin="0.05", plot=None, html=sys.argv[2] if len(sys.argv) > 2 else None, against=None,
                       top="10", force=True, json=True, overlay_dir=[])
t = time.perf_counter(); out = report(args, [sys.argv[1]]); dt = time.perf_counter() - t
p = out.payload
# VmHWM: this process's own peak RSS. ru_maxrss would be wrong here: on Linux it survives exec, so a child
# started by a parent that built the snapshot in memory reports the parent's peak.
try:
    peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
except OSError:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(dt, peak, out.exit_code, p.get("kind"),
      (p.get("oom") or {}).get("allocated_bytes") or 0, len(json.dumps(p, allow_nan=False)))
"""

def read_bench() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "snapshot_oom_rank-0.pickle")
        depth = 8
        while True:  # deepen the stacks until the file reaches the target size
            data = pickle.dumps(snapshot(entries, depth), protocol=4)
            if len(data) >= target_mb * 1e6 or depth > 2000:
                break
            depth = int(depth * max(1.2, (target_mb * 1e6 / len(data)) ** 0.9))
        with open(path, "wb") as f:
            f.write(data)
        size = len(data)
        del data
        print(f"snapshot: {size / 1e6:.1f} MB, {entries:,} trace entries, {depth} frames per stack")
        print(f"{'case':>18} {'seconds':>8} {'peak RSS':>10} {'RSS / file':>10}  result")
        for case, extra in (("summary (--json)", []), ("summary + --html", [os.path.join(tmp, "page.html")])):
            out = subprocess.run([sys.executable, "-c", CHILD, path, *extra], capture_output=True, text=True, timeout=600)
            if out.returncode:
                print(f"{case:>18}  failed: {out.stderr[-800:]}")
                continue
            dt, rss, code, kind, alloc, _ = out.stdout.split()
            ratio = int(rss) / size
            print(f"{case:>18} {float(dt):8.2f} {int(rss) / 1e6:8.0f} MB {ratio:10.2f}  exit {code}, {kind}, "
                  f"allocated at the OOM {int(alloc) / GiB:.2f} GiB")
        print("targets: under 10 s and under 10x the file size (issue 24)")
        print()
        print("hostile files (issue 33): each ends within seconds; peak RSS within 12x the pickle + 64 MiB + the interpreter")
        print(f"{'case':>36} {'file':>10} {'seconds':>8} {'peak RSS':>10}  result")
        for case, data in hostile_files():
            path = os.path.join(tmp, "hostile.pickle")
            with open(path, "wb") as f:
                f.write(data)
            out = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True, timeout=600)
            if out.returncode:
                print(f"{case:>36}  failed (exit {out.returncode}): {out.stderr[-300:]}")
                continue
            dt, rss, code, kind, _, _ = out.stdout.split()
            budget = 12 * len(data) + 64 * MiB
            print(f"{case:>36} {len(data) / 1e6:8.1f}MB {float(dt):8.2f} {int(rss) / 1e6:8.0f} MB  exit {code}"
                  + (f", {kind}" if code == "0" else "") + f" (budget {budget / 1e6:,.0f} MB + the interpreter)")


# -- issue 34: the trace replayed forward through the allocator model (doctor --what-if) -----------------------
def what_if_replay(sizes=(25_000, 50_000, 100_000)) -> None:
    """A training-shaped run from tests/snapshot_gen.py's allocator (two streams, deferred frees on the second,
    small and large pools, a ring that starts mid-run), dumped with rings of several lengths; per length, the
    proof on the file (allocations at the recorded address) and one what-if scenario, timed in this process.
    Linear in the trace: the seconds per 100k entries stay flat as the ring grows."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import snapshot_gen as G
    from mbmem_overlays.doctor.snapshot.model import normalize
    a = G.Allocator(0, 80 * GiB)
    G.model_state(a, params=2 * GiB)
    step = 0
    while len(a.trace) < max(sizes) + 5000:
        keep = []
        for layer in range(8):
            keep.append(a.malloc(96 * MiB + 512 * (layer % 3), "qkv", stream=0))
            keep.append(a.malloc(300 * 1024 + 512 * layer, "qkv", stream=0))
            comm = a.malloc(5 * MiB + 4096 * (step % 4), "allgather", stream=1)
            a.free(comm, pending=layer % 2 == 0)
            if layer % 2 == 0:
                a.complete(comm)
            tmp = a.malloc(24 * MiB + 512 * (step % 5), "core_attn", stream=0)
            a.free(tmp)
        for addr in reversed(keep):
            a.free(addr)
        step += 1
    print(f"\nwhat-if replay (issue 34): a generated two-stream training trace, {step} steps")
    print(f"{'entries':>8} {'allocs':>7} {'at recorded':>12} {'start state s':>13} {'proof s':>8} "
          f"{'what-if s':>9} {'s per 100k':>10}")
    for n in sizes:
        a.max_entries = n
        snap = normalize(G.dump([a]))
        trace, proof, (t0, t1, t2, t3) = timed_what_if(snap, "expandable_segments:True")
        print(f"{len(trace):>8,} {proof.allocations:>7,} {proof.agreement:>12.2%} {t1 - t0:>13.2f} {t2 - t1:>8.2f} "
              f"{t3 - t2:>9.2f} {(t3 - t0) * 100_000 / len(trace):>10.2f}")
    print("target: a 100k-entry trace replays in under 10 s, linear in the trace (issue 34)")


def timed_what_if(snap, scenario: str) -> tuple:
    """(the trace, the proof, the clock at start, after the start state, after the proof, after the what-if) of one
    snapshot's first device: its start state, its replay proven against the recorded trace, one what-if
    ``scenario`` replayed at 80 GiB."""
    import time
    from mbmem_overlays.doctor.snapshot import allocator as A
    from mbmem_overlays.doctor.snapshot import whatif as W
    from mbmem_overlays.doctor.snapshot.replay import Replayer, Rounding
    trace, segments = snap.traces[0], snap.segments[0]
    base, _ = W.settings_of_file(snap.allocator_settings, segments, trace)
    t0 = time.perf_counter()
    start = A.start_state(Replayer(segments, trace, Rounding.from_settings(snap.allocator_settings, False))
                          .state_at(0), segments, trace)
    t1 = time.perf_counter()
    proof = A.prove(trace, start, base)
    t2 = time.perf_counter()
    W.replay(trace, start, W.parse_what_if(scenario, base), 80 * GiB, None, scenario)
    t3 = time.perf_counter()
    return trace, proof, (t0, t1, t2, t3)


def what_if_hostile(n: int) -> None:
    """The two shapes that made the replay quadratic (issue 39 #15), a quarter and the whole side by side: ``n``
    expandable segments with one trace entry (the start state matched each mapped range against every segment),
    and ``n`` segment_map + alloc pairs (each map searched every unmapped block). The start state, the proof and
    one what-if scenario, timed in this process; linear time takes ~4x for the whole, the scans took ~16x."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import snapshot_gen as G
    from mbmem_overlays.doctor.snapshot.model import normalize

    def one_entry(k: int) -> dict:
        snap = G.expandable_snapshot(k)
        snap["device_traces"] = [snap["device_traces"][0][-1:]]
        return snap

    print("\nwhat-if replay of hostile files (issue 39 #15): a quarter and the whole, side by side")
    print(f"{'case':>36} {'start state s':>13} {'proof s':>8} {'what-if s':>9} {'total s':>8} {'x the quarter':>13}")
    for label, make in (("expandable segments, 1 trace entry", one_entry),
                        ("segment_map + alloc pairs", G.expandable_snapshot)):
        quarter = None
        for k in (n // 4, n):
            _, _, (t0, t1, t2, t3) = timed_what_if(normalize(make(k)), "expandable_segments:False")
            quarter = quarter or (t3 - t0)
            print(f"{f'{k:,} {label}':>36} {t1 - t0:>13.2f} {t2 - t1:>8.2f} {t3 - t2:>9.2f} {t3 - t0:>8.2f} "
                  f"{(t3 - t0) / quarter:>13.1f}")
    print("target: linear in the segments and maps (~4x for 4x)")


if not WHAT_IF_ONLY:
    read_bench()
what_if_replay()
what_if_hostile(expandable_segments)
