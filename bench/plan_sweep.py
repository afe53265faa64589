"""Plan evaluations per second at 1k and 10k candidate layouts (pure model, no Bridge in the loop).

Usage: .venv/bin/python bench/plan_sweep.py   Goal: >= 1,000/s on the 2-core machine, linear growth.
"""

import itertools
import time
from dataclasses import replace

from mbmem_overlays.bridge.recipes import build_recipe
from mbmem_overlays.bridge.stack import prepare
from mbmem_overlays.memory import model as P

prepare()
cfg = build_recipe("llama3_70b_pretrain_config")
shape, lay0, st0 = P.from_config(cfg, 256)
grid = list(itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16), (1, 2, 4, 5), (1, 2), (None, "selective", "full"),
                              (False, True), (0.0, 0.5)))


def candidates(n):
    out = []
    for tp, pp, vpp, cp, rec, dist, off in itertools.islice(itertools.cycle(grid), n):
        out.append((replace(lay0, tp=tp, pp=pp, vpp=vpp if pp > 1 else 1, cp=cp, sp=tp > 1),
                    replace(st0, recompute=rec, modules=("core_attn",) if rec == "selective" else (),
                            dist_optimizer=dist, optimizer_offload=off)))
    return out


rates = {}
for n in (1_000, 10_000):
    cands = candidates(n)
    t = time.perf_counter()
    for lay, st in cands:
        P.estimate(shape, lay, st)
    secs = time.perf_counter() - t
    rates[n] = n / secs
    print(f"{n:>6} candidates: {secs:6.3f} s, {rates[n]:,.0f} configurations/s")
print(f"growth 1k -> 10k: time x{(10_000 / rates[10_000]) / (1_000 / rates[1_000]):.1f} for x10 candidates "
      f"(linear = x10); goal >= 1,000/s: {'met' if min(rates.values()) >= 1000 else 'NOT met'}")
