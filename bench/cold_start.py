"""Cold start of `mbmem list` next to `import megatron.bridge`, measured side by side in one run.

`mbmem list` must not import Bridge. Each command runs N times in a fresh process;
the medians and their ratio are printed. Run: .venv/bin/python bench/cold_start.py [N]
"""

import statistics
import subprocess
import sys
import time

N = int(sys.argv[1]) if len(sys.argv) > 1 else 3
COMMANDS = {
    "mbmem list": [sys.executable, "-m", "mbmem_overlays.cli", "list"],
    # Bridge cannot import on a host without Transformer Engine except through our shim (bridge.stack.prepare).
    "import megatron.bridge": [sys.executable, "-c", "from mbmem_overlays.bridge.stack import prepare; prepare()"],
}


def once(cmd):
    t = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True)
    return time.perf_counter() - t


times = {name: [] for name in COMMANDS}
for _ in range(N):  # interleaved, so machine load affects both alike
    for name, cmd in COMMANDS.items():
        times[name].append(once(cmd))
med = {name: statistics.median(ts) for name, ts in times.items()}
for name, m in med.items():
    print(f"{name:<24} median {m:7.3f} s  (runs: {', '.join(f'{t:.2f}' for t in times[name])})")
print(f"ratio import megatron.bridge / mbmem list: {med['import megatron.bridge'] / med['mbmem list']:.0f}x")
