"""Agreement of our verdicts with Bridge's own validation over generated configurations.

Usage: .venv/bin/python bench/agreement.py [N=1000] [SEED=0]
Prints the agreement matrix (oracle's rule x our verdict), the doc-only rules where we are
deliberately stricter, every disagreement, and last: `agreement on enforced rules: A/B (P%)`.
"""

import random
import sys
import time

from mbmem_overlays.bridge.stack import prepare
from mbmem_overlays.core.catalog import Catalog
from mbmem_overlays.bridge.differential import evaluate, generate, summarize

n = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
seed = int(sys.argv[2]) if len(sys.argv) > 2 else 0
prepare()
catalog, rng = Catalog(), random.Random(seed)
t0 = time.perf_counter()
outcomes = [evaluate(generate(rng, catalog), catalog) for _ in range(n)]
elapsed = time.perf_counter() - t0
s = summarize(outcomes)

print(f"{n} generated cases (seed {seed}) in {elapsed:.1f} s; verdicts: {s['counts']}")
print("\nagreement matrix (oracle's verdict, by the rule its error names x our verdict):")
rows = sorted({r for r, _ in s["matrix"]})
print(f"  {'oracle':<42} {'we accept':>10} {'we reject':>10}")
for r in rows:
    print(f"  {r:<42} {s['matrix'].get((r, 'accepted'), 0):>10} {s['matrix'].get((r, 'rejected'), 0):>10}")
print("\ndoc-only rejections (Bridge accepts; a documented rule or composition check says no):")
for rule, k in sorted(s["doc_only_rules"].items(), key=lambda kv: -kv[1]):
    print(f"  {rule:<42} {k}")
print(f"\ndisagreements: {len(s['disagreements'])}")
for o in s["disagreements"][:20]:
    print(f"  {o.case.describe()}\n    ours: {list(o.ours)}  oracle: {o.oracle_rule or o.oracle}")
other = {}
for o in outcomes:
    if o.verdict == "out of scope":
        key = (o.oracle or "").splitlines()[0][:110]
        other[key] = other.get(key, 0) + 1
if other:
    print("\nout of scope (the oracle stopped at a check that is not a memory rule, before ours):")
    for msg, k in sorted(other.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {k:>4}  {msg}")
pct = 100.0 * s["agree"] / s["decided"] if s["decided"] else 100.0
print(f"agreement on enforced rules: {s['agree']}/{s['decided']} ({pct:.1f}%)")
