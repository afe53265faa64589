"""`mbmem doctor` throughput and peak memory: the friendly case side by side with the worst cases.

Usage: .venv/bin/python bench/doctor_throughput.py [--only CASE,...] [GB ...]   (default: 0.1 0.4)

Cases (issue 15, item 17: measure the worst case, not only the friendly one):
- friendly:   realistic interleaved 32-rank training noise, one OOM in the middle
- error-flood: nothing but short "Error" lines (1.1 MB/s and growing RSS before the fix)
- exc-flood:  short exception lines ("ValueError: Error N: ...") that all hold a trigger literal
- kill-flood: short "worker N Killed" lines, each a host-kill candidate
- giant-line: one OOM per 1 MB line of repeated "Of the allocated memory" clauses (quadratic before the fix)
- healthy-run: a healthy 64-GPU Bridge run (TP2 PP4 DP8): the last rank's iteration lines, INFO noise, and every
  100th iteration the memory lines of its 8 reporting ranks (DP rank 0 of each TP x PP group; Bridge itself prints
  them after the first two iterations only, forks at every log interval; issue 23: a 1 GB log in
  under 15 s on one core, flat memory); the run report must name every reporting rank
- memory-flood: nothing but memory lines, 1024 ranks every iteration (a fork that reports each step)
Each log is diagnosed in a fresh process pinned to one core, which reports its wall time and peak RSS; the OOM
in the middle must still be found (the healthy cases have none: their run report must list every reporting
rank). Goal: no case collapses (within ~5x of the friendly case), RSS stays flat in log size, and the healthy
run reads 1 GB in under 15 s.
"""

import os
import random
import subprocess
import sys
import tempfile

argv = sys.argv[1:]
only = None
if argv[:1] == ["--only"]:
    only, argv = set(argv[1].split(",")), argv[2:]
sizes = [float(x) for x in argv] or [0.1, 0.4]
rng = random.Random(0)
lines = []
for i in range(20000):  # ~2 MB of realistic interleaved 32-rank noise
    r = rng.randrange(32)
    lines.append(rng.choice([
        (f"[rank{r}]: iteration {i:>7}/ 1000000 | consumed samples: {i * 32} | elapsed time per iteration (ms): "
        f"{rng.uniform(4000, 6000):.1f} | learning rate: 1.0E-04 | global batch size: 32 | lm loss: {rng.uniform(1, 3):.4E}"),
        f"[rank{r}]: [2026-11-30 04:{i % 60:02d}:{r:02d}] INFO megatron.core.distributed: bucket {i % 97} all-reduce done",
        f"[default{r}]:W1130 04:{i % 60:02d}:00 torch/distributed/elastic: heartbeat ok",
    ]))
OOM = (b"[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.96 GiB. GPU 3 has a total capacity of "
       b"79.11 GiB of which 1.12 GiB is free. Of the allocated memory 54.76 GiB is allocated by PyTorch, and 21.63 GiB "
       b"is reserved by PyTorch but unallocated.\n")
CLAUSE = "Of the allocated memory 1.00 GiB is allocated by PyTorch, "


def bridge_memory(rank: int, it: int, alloc: float) -> str:
    """Bridge 0.6.2's memory line (train_utils.py training_log / report_memory: GB, 5 significant digits)."""
    return (f"[default{rank % 8}]:[Rank {rank}] (after {it} iterations) memory (GB) | mem-allocated-gigabytes: "
            f"{alloc * 0.45:.5g} | mem-active-gigabytes: {alloc * 0.46:.5g} | mem-inactive-gigabytes: 0.41235 | "
            f"mem-reserved-gigabytes: {alloc * 1.05:.5g} | mem-max-allocated-gigabytes: {alloc:.5g} | "
            f"mem-max-active-gigabytes: {alloc * 1.002:.5g} | mem-max-inactive-gigabytes: 1.0987 | "
            f"mem-max-reserved-gigabytes: {alloc * 1.06:.5g} | mem-alloc-retires: 0 | mem-allocated-count: 2913")


# TP2 PP4 on 64 GPUs (DP8): ranks with DP rank 0 print (tp + dp*2 + pp*16 with dp = 0): 2 per stage.
REPORTERS = [tp + pp * 16 for pp in range(4) for tp in range(2)]
healthy = []
for i in range(1, 4001):
    healthy.append(f"[default7]: [2026-11-28 09:{i % 60:02d}:{i * 7 % 60:02d}] iteration {i:8d}/  100000 | consumed "
                   f"samples: {i * 512:12d} | elapsed time per iteration (ms): {rng.uniform(5000, 5500):.1f} | "
                   f"throughput per GPU (TFLOP/s/GPU): 411.3 | learning rate: 3.000000E-04 | global batch size:   512 | "
                   f"lm loss: {rng.uniform(1, 3):.6E} | loss scale: 1.0 | grad norm: 1.300 | number of skipped "
                   "iterations:   0 | number of nan iterations:   0 |")
    healthy.append(f"[default{i % 8}]:[2026-11-28 09:00:00] INFO megatron.core.distributed: bucket {i % 97} grads "
                   "reduced")
    if i % 100 == 0:
        healthy += [bridge_memory(r, i, 60.0 - r * 0.1) for r in REPORTERS]
flood = [bridge_memory(r, i, 40.0 + (r % 7)) for i in range(1, 6) for r in range(1024)]
CASES = {
    "friendly": ("\n".join(lines) + "\n").encode(),
    "error-flood": b"Error\n" * 350_000,
    "exc-flood": b"".join(b"[rank%d]: ValueError: Error %d: bad value\n" % (i % 8, i) for i in range(50_000)),
    "kill-flood": b"".join(b"[rank%d]: worker %d Killed\n" % (i % 8, i) for i in range(80_000)),
    "giant-line": (("[rank0]: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 79.11 GiB "
                    "of which 1.00 GiB is free. " + CLAUSE * (1_000_000 // len(CLAUSE))) + "\n").encode(),
    "healthy-run": ("\n".join(healthy) + "\n").encode(),
    "memory-flood": ("\n".join(flood) + "\n").encode(),
}
HEALTHY = {"healthy-run": len(REPORTERS), "memory-flood": 1024}
if only:
    CASES = {k: v for k, v in CASES.items() if k in only}

CHILD = """
import os, resource, sys, time
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})   # one core
from mbmem_overlays.doctor.diagnose import diagnose
from mbmem_overlays.doctor.parse import scan
t, c = time.perf_counter(), time.process_time()
f = scan([sys.argv[1]]); d = diagnose(f)
dt, cpu = time.perf_counter() - t, time.process_time() - c
found = len(f.ooms) if sys.argv[2] == "oom" else len((d.run or {}).get("ranks", []))
print(f.bytes_read, dt, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, d.kind, found, cpu)
"""

print(f"{'case':>12} {'log size':>9} {'MB/s':>7} {'peak RSS':>9}  diagnosis (OOMs found)")
results: dict[str, list[tuple[float, float]]] = {}
cpu_per_gb: dict[str, list[float]] = {}
with tempfile.TemporaryDirectory() as tmp:
    for name, chunk in CASES.items():
        for gb in sizes:
            path = os.path.join(tmp, f"{name}-{gb}.log")
            target = int(gb * 1e9)
            with open(path, "wb") as out:
                written, oom_written = 0, False
                while written < target:
                    out.write(chunk)
                    written += len(chunk)
                    if not oom_written and written >= target // 2 and name not in HEALTHY:
                        out.write(OOM)
                        oom_written = True
            res = subprocess.run([sys.executable, "-c", CHILD, path, "run" if name in HEALTHY else "oom"],
                                 capture_output=True, text=True, check=True)
            nbytes, secs, rss_kb, kind, ooms, cpu = res.stdout.split()
            mbps, rss = int(nbytes) / 1e6 / float(secs), int(rss_kb) / 1024
            results.setdefault(name, []).append((mbps, rss))
            cpu_per_gb.setdefault(name, []).append(float(cpu) / (int(nbytes) / 1e9))
            what = f"{ooms} reporting ranks of {HEALTHY[name]}" if name in HEALTHY else f"{ooms} OOMs"
            # wall time is what a user waits; CPU time is the one core's work (the same when the machine is idle)
            print(f"{name:>12} {int(nbytes) / 1e9:>7.2f}GB {mbps:>7.0f} {rss:>7.0f}MB  {kind} ({what}); "
                  f"{float(secs) / (int(nbytes) / 1e9):.1f} s per GB wall, {cpu_per_gb[name][-1]:.1f} s CPU")
            os.remove(path)
for name in HEALTHY:
    if name in results:
        slowest = min(m for m, _ in results[name])
        print(f"{name}: {1000 / slowest:.1f} s per GB wall, {max(cpu_per_gb[name]):.1f} s CPU, on one core "
              "(goal for healthy-run: < 15 s)")
if "friendly" not in results:
    sys.exit(0)
friendly = min(m for m, _ in results["friendly"])
worst_name, worst = min(((n, min(m for m, _ in r)) for n, r in results.items()), key=lambda x: x[1])
print(f"friendly: min {friendly:.0f} MB/s; worst case: {worst_name} at {worst:.0f} MB/s "
      f"({worst / friendly:.2f}x of friendly; goal >= 0.2x)")
for name, r in results.items():
    print(f"  {name}: peak RSS {r[0][1]:.0f} -> {r[-1][1]:.0f} MB from smallest to largest log (x{r[-1][1] / r[0][1]:.2f})")
