"""`mbmem doctor` throughput and peak memory: the friendly case side by side with the worst cases.

Usage: .venv/bin/python bench/doctor_throughput.py [GB ...]   (default: 0.1 0.4)

Cases (issue 15, item 17: measure the worst case, not only the friendly one):
- friendly:   realistic interleaved 32-rank training noise, one OOM in the middle
- error-flood: nothing but short "Error" lines (1.1 MB/s and growing RSS before the fix)
- exc-flood:  short exception lines ("ValueError: Error N: ...") that all hold a trigger literal
- kill-flood: short "worker N Killed" lines, each a host-kill candidate
- giant-line: one OOM per 1 MB line of repeated "Of the allocated memory" clauses (quadratic before the fix)
Each log is diagnosed in a fresh process, which reports its wall time and peak RSS; the OOM in the middle must
still be found. Goal: no case collapses (within ~5x of the friendly case) and RSS stays flat in log size.
"""

import os
import random
import subprocess
import sys
import tempfile

sizes = [float(x) for x in sys.argv[1:]] or [0.1, 0.4]
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
CASES = {
    "friendly": ("\n".join(lines) + "\n").encode(),
    "error-flood": b"Error\n" * 350_000,
    "exc-flood": b"".join(b"[rank%d]: ValueError: Error %d: bad value\n" % (i % 8, i) for i in range(50_000)),
    "kill-flood": b"".join(b"[rank%d]: worker %d Killed\n" % (i % 8, i) for i in range(80_000)),
    "giant-line": (("[rank0]: CUDA out of memory. Tried to allocate 1.00 GiB. GPU 0 has a total capacity of 79.11 GiB "
                    "of which 1.00 GiB is free. " + CLAUSE * (1_000_000 // len(CLAUSE))) + "\n").encode(),
}

CHILD = """
import resource, sys, time
from mbmem_overlays.doctor.diagnose import diagnose
from mbmem_overlays.doctor.parse import scan
t = time.perf_counter(); f = scan([sys.argv[1]]); d = diagnose(f); dt = time.perf_counter() - t
print(f.bytes_read, dt, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, d.kind, len(f.ooms))
"""

print(f"{'case':>12} {'log size':>9} {'MB/s':>7} {'peak RSS':>9}  diagnosis (OOMs found)")
results: dict[str, list[tuple[float, float]]] = {}
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
                    if not oom_written and written >= target // 2:
                        out.write(OOM)
                        oom_written = True
            res = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True, check=True)
            nbytes, secs, rss_kb, kind, ooms = res.stdout.split()
            mbps, rss = int(nbytes) / 1e6 / float(secs), int(rss_kb) / 1024
            results.setdefault(name, []).append((mbps, rss))
            print(f"{name:>12} {int(nbytes) / 1e9:>7.2f}GB {mbps:>7.0f} {rss:>7.0f}MB  {kind} ({ooms})")
            os.remove(path)
friendly = min(m for m, _ in results["friendly"])
worst_name, worst = min(((n, min(m for m, _ in r)) for n, r in results.items()), key=lambda x: x[1])
print(f"friendly: min {friendly:.0f} MB/s; worst case: {worst_name} at {worst:.0f} MB/s "
      f"({worst / friendly:.2f}x of friendly; goal >= 0.2x)")
for name, r in results.items():
    print(f"  {name}: peak RSS {r[0][1]:.0f} -> {r[-1][1]:.0f} MB from smallest to largest log (x{r[-1][1] / r[0][1]:.2f})")
