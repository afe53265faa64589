"""Agreement of our verdicts with Bridge's own validation over generated configurations.

Usage: .venv/bin/python bench/agreement.py [N=2000] [SEED=0]
Prints the agreement matrix (the oracle's rule x our verdict), the rules where we are deliberately stricter,
every disagreement (missing rules included), the rules no case triggered, and last:
`agreement: A/B (P%) over N cases; unexplained Bridge rejections: K`.
A counts cases where we agree with Bridge or are stricter by a documented rule; B counts every case with a
verdict on both sides (all N except those where Bridge's validation could not finish on this host or the
recipe refused the settings, both printed); K counts Bridge rejections that no rule of ours names.
"""

import random
import sys
import time

from mbmem_overlays.bridge.differential import evaluate, generate, summarize
from mbmem_overlays.bridge.stack import prepare
from mbmem_overlays.core.catalog import Catalog

n = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
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
print(f"  {'oracle':<46} {'we accept':>10} {'we reject':>10}")
for r in rows:
    print(f"  {r:<46} {s['matrix'].get((r, 'accepted'), 0):>10} {s['matrix'].get((r, 'rejected'), 0):>10}")
print("\nstricter than Bridge (Bridge accepts; a documented, runtime or composition rule says no):")
for rule, k in sorted(s["stricter_rules"].items(), key=lambda kv: -kv[1]):
    print(f"  {rule:<46} {k}")
print(f"\ndisagreements: {len(s['disagreements'])}")
for o in s["disagreements"][:25]:
    print(f"  {o.case.describe()}\n    ours: {list(o.ours)}  oracle: {o.oracle_rule or (o.oracle or '')[:300]}")
unexplained: dict[str, int] = {}
for o in s["unexplained"]:
    key = (o.oracle or "").splitlines()[0][:140]
    unexplained[key] = unexplained.get(key, 0) + 1
if unexplained:
    print("\nunexplained Bridge rejections (no rule of ours names them), by message:")
    for msg, k in sorted(unexplained.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {k:>4}  {msg}")
incomplete = [o for o in outcomes if o.verdict == "incomplete"]
if incomplete:
    print(f"\nincomplete: {len(incomplete)} cases where Bridge's validation stopped at a Transformer Engine check")
print(f"\nrules no case triggered: {', '.join(s['never_triggered']) or 'none'}")
print(f"enforced rules no case triggered: {', '.join(s['never_triggered_enforced']) or 'none'}")
pct = 100.0 * s["agree"] / s["decided"] if s["decided"] else 100.0
print(f"agreement: {s['agree']}/{s['decided']} ({pct:.1f}%) over {n} cases; "
      f"unexplained Bridge rejections: {len(s['unexplained'])}")
