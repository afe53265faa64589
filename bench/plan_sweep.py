"""Plan evaluations per second at 1k and 10k candidate layouts (pure model, no Bridge in the loop): the memory model
alone, and with the cost model (memory/cost/ cost_range against the recipe's own configuration, what
memory/search.py computes for every candidate that fits) — the search's rate.

Usage: .venv/bin/python bench/plan_sweep.py   Goal: >= 3,000 plans/s with the cost model on the 2-core machine,
linear growth. Rates are per second of this process's CPU time (time.process_time), which a machine shared with
other jobs does not inflate; the wall-clock rate is printed beside it (the same on an idle machine).
"""

import itertools
import time
from dataclasses import replace

from mbmem_overlays.bridge.recipes import build_recipe
from mbmem_overlays.bridge.stack import prepare
from mbmem_overlays.memory import cost as K
from mbmem_overlays.memory import model as P
from mbmem_overlays.memory.cost.work import layer_work

prepare()
cfg = build_recipe("llama3_70b_pretrain_config")
shape, lay0, st0 = P.from_config(cfg, 256)
ci = K.cost_inputs(cfg)
own = (shape, lay0, st0, ci)
grid = list(itertools.product((1, 2, 4, 8), (1, 2, 4, 8, 16), (1, 2, 4, 5), (1, 2), (None, "selective", "full"),
                              (False, True), (0.0, 0.5)))


def candidates(n):
    out = []
    for tp, pp, vpp, cp, rec, dist, off in itertools.islice(itertools.cycle(grid), n):
        out.append((replace(lay0, tp=tp, pp=pp, vpp=vpp if pp > 1 else 1, cp=cp, sp=tp > 1),
                    replace(st0, recompute=rec, modules=("core_attn",) if rec == "selective" else (),
                            dist_optimizer=dist, optimizer_offload=off)))
    return out


rates, priced, walls = {}, {}, {}
for n in (1_000, 10_000):
    cands = candidates(n)
    w, t = time.perf_counter(), time.process_time()
    for lay, st in cands:
        P.estimate(shape, lay, st)
    secs, wall = time.process_time() - t, time.perf_counter() - w
    w, t = time.perf_counter(), time.process_time()
    for i, (lay, st) in enumerate(cands):
        if i % len(grid) == 0:   # the grid repeats after len(grid): every candidate is priced afresh, as in a search
            K.evaluate.cache_clear()
            layer_work.cache_clear()
            K.evaluate(own, 9)
        K.cost_range(own, (shape, lay, st, ci), 9)
    cost_secs, cost_wall = time.process_time() - t, time.perf_counter() - w
    rates[n] = n / secs
    priced[n] = n / (secs + cost_secs)
    walls[n] = n / (wall + cost_wall)
    print(f"{n:>6} candidates: {secs:6.3f} s, {rates[n]:,.0f} configurations/s; with the cost model "
          f"{secs + cost_secs:6.3f} s, {priced[n]:,.0f} plans/s (CPU time; wall clock {walls[n]:,.0f}/s)")
print(f"growth 1k -> 10k: time x{(10_000 / priced[10_000]) / (1_000 / priced[1_000]):.1f} for x10 candidates "
      f"(linear = x10); goal >= 3,000 plans/s with the cost model: "
      f"{'met' if min(priced.values()) >= 3000 else 'NOT met'}")
