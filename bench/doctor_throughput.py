"""`mbmem doctor` throughput and peak memory on generated multi-rank logs of growing size.

Usage: .venv/bin/python bench/doctor_throughput.py [GB ...]   (default: 0.25 1 2)
Each size is diagnosed in a fresh process, which reports its own wall time and peak RSS;
goal: >= 50 MB/s, RSS flat in log size.
"""

import os
import random
import subprocess
import sys
import tempfile

sizes = [float(x) for x in sys.argv[1:]] or [0.25, 1.0, 2.0]
rng = random.Random(0)
lines = []
for i in range(20000):  # ~2 MB of realistic interleaved 32-rank noise
    r = rng.randrange(32)
    lines.append(rng.choice([
        f"[rank{r}]: iteration {i:>7}/ 1000000 | consumed samples: {i * 32} | elapsed time per iteration (ms): "
        f"{rng.uniform(4000, 6000):.1f} | learning rate: 1.0E-04 | global batch size: 32 | lm loss: {rng.uniform(1, 3):.4E}",
        f"[rank{r}]: [2026-11-30 04:{i % 60:02d}:{r:02d}] INFO megatron.core.distributed: bucket {i % 97} all-reduce done",
        f"[default{r}]:W1130 04:{i % 60:02d}:00 torch/distributed/elastic: heartbeat ok",
    ]))
chunk = ("\n".join(lines) + "\n").encode()
oom = ("[rank3]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.96 GiB. GPU 3 has a total capacity of "
       "79.11 GiB of which 1.12 GiB is free. Of the allocated memory 54.76 GiB is allocated by PyTorch, and 21.63 GiB "
       "is reserved by PyTorch but unallocated.\n").encode()

CHILD = """
import resource, sys, time
from mbmem_overlays.doctor.diagnose import diagnose
from mbmem_overlays.doctor.parse import scan
t = time.perf_counter(); f = scan([sys.argv[1]]); d = diagnose(f); dt = time.perf_counter() - t
print(f.bytes_read, dt, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, d.kind)
"""

print(f"{'log size':>10} {'MB/s':>8} {'peak RSS':>10}  diagnosis")
results = []
with tempfile.TemporaryDirectory() as tmp:
    for gb in sizes:
        path = os.path.join(tmp, f"job-{gb}.log")
        target = int(gb * 1e9)
        with open(path, "wb") as out:
            written = 0
            while written < target:
                out.write(chunk)
                written += len(chunk)
                if written >= target // 2 and written - len(chunk) < target // 2:
                    out.write(oom)
        res = subprocess.run([sys.executable, "-c", CHILD, path], capture_output=True, text=True, check=True)
        nbytes, secs, rss_kb, kind = res.stdout.split()
        mbps, rss = int(nbytes) / 1e6 / float(secs), int(rss_kb) / 1024
        results.append((mbps, rss))
        print(f"{int(nbytes) / 1e9:>8.2f}GB {mbps:>8.0f} {rss:>8.0f}MB  {kind}")
        os.remove(path)
print(f"throughput: min {min(r[0] for r in results):.0f} MB/s (goal >= 50); peak RSS {results[0][1]:.0f} -> "
      f"{results[-1][1]:.0f} MB from smallest to largest log (x{results[-1][1] / results[0][1]:.2f})")
