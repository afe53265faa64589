"""``mbmem check-stack``: do the rules agree with the installed Bridge and megatron-core?

Runs the agreement cases of ``bench/agreement.py`` (bridge/differential.py: generated recipes, layouts and
overlays; our verdict against Bridge's own ``runtime_config_update`` on the same config) on whatever stack this
Python has: a supported release, another release, or a container's git checkout. Prints the agreement and every
disagreement with its rule and field. Exit codes (docs/exit-codes.md): 0 every decided case agrees, 1 at least
one disagreement or unexplained Bridge rejection, 3 no case could be decided here, 2 usage, 69 no stack.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from typing import Any

from ..core.report import EXIT_INCOMPLETE, EXIT_OK, EXIT_REJECTED, SCHEMA_VERSION, json_text
from ..core.text import shown
from ..core.values import parse_count
from .common import count_arg

MAX_CASES = 20_000
# Only used to say up front how long the run will take. A case (a recipe copy, the engine, Bridge's validation)
# took 0.32-0.38 s on this 2-core host while it was shared (bench/agreement.py 200 0: 64 s on Bridge 0.6.0, 76 s on
# 0.6.2); importing Bridge takes 15-30 s on an idle host (stack-on-cpu.md, "Timings").
IMPORT_SECONDS = 40
SECONDS_PER_CASE = 0.35
SHOWN_DISAGREEMENTS = 50  # in text; --json lists all


def seed_arg(text: str) -> int:
    number, why = parse_count(text, minimum=0, maximum=2**32 - 1)
    if number is None:
        raise argparse.ArgumentTypeError(why)
    return number


def register(sub) -> None:
    p = sub.add_parser("check-stack",
                       help="run the rule agreement cases against the installed Bridge and megatron-core")
    p.add_argument("--cases", type=count_arg(MAX_CASES), default=200,
                   help=f"number of generated cases (default 200, at most {MAX_CASES:,})")
    p.add_argument("--seed", type=seed_arg, default=0,
                   help="seed of the case generator (default 0; the same seed draws the same cases)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(fn=run)


def estimate_seconds(cases: int) -> float:
    return IMPORT_SECONDS + SECONDS_PER_CASE * cases


def _fields(outcome, enforced: dict[str, Any], catalog) -> list[str]:
    """The fields behind a disagreement: where we flagged an enforced rule, the fields our problems name; where
    Bridge named a rule we did not flag, the fields that rule reads."""
    from ..bridge.differential import base_config
    from ..core.engine import plan_overlays
    from ..core.errors import OverlayError
    fields: list[str] = []
    ours = [c for c in outcome.ours if c in enforced]
    if ours:
        case = outcome.case
        try:
            plan_overlays(base_config(case), case.overlays, env=dict(case.env), params=dict(case.params),
                          world_size=case.world_size, catalog=catalog)
        except OverlayError as exc:
            fields += [p.field for p in exc.problems if p.check in ours]
    if outcome.oracle_rule and outcome.oracle_rule not in outcome.ours:
        fields += list(enforced[outcome.oracle_rule].reads)
    return list(dict.fromkeys(str(f) for f in fields))


def _last_line(text: str) -> str:
    """An error's last non-empty line (a recipe refusal is 'N problems found ...' and then the problem)."""
    return next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")


def _disagreement(outcome, enforced, catalog) -> dict[str, Any]:
    if outcome.oracle is None:
        kind = "we reject, Bridge accepts"
    elif outcome.oracle_rule is None:
        kind = "Bridge rejects with a message no rule names (a missing rule)"
    else:
        kind = "Bridge rejects, we accept" if outcome.oracle_rule not in outcome.ours else "different rules"
    rules = sorted({*(c for c in outcome.ours if c in enforced), *([outcome.oracle_rule] if outcome.oracle_rule else [])})
    return {"case": outcome.case.describe(), "kind": kind, "rules": rules,
            "fields": _fields(outcome, enforced, catalog), "ours": list(outcome.ours),
            "oracle_rule": outcome.oracle_rule, "oracle": (outcome.oracle or "").splitlines()[0][:400] or None}


def run(args) -> int:
    from ..bridge.stack import installed, prepare, progress
    from ..core.rules.versions import SUPPORTED, checked_against
    seed = args.seed
    stack = installed()
    eta = estimate_seconds(args.cases)
    if not stack.missing:
        print(f"mbmem check-stack: {args.cases} cases (seed {seed}) against {stack.describe()}; about "
              f"{eta / 60:.0f} min ({IMPORT_SECONDS} s to import Bridge, then about {SECONDS_PER_CASE} s a case "
              f"on one CPU core)", file=sys.stderr, flush=True)
    prepare()  # StackError (exit 69) when there is no stack to check or it does not import
    from ..bridge.differential import Outcome, evaluate, generate, summarize
    from ..core import rules
    from ..core.catalog import Catalog
    catalog, rng = Catalog(), random.Random(seed)
    outcomes = []
    start = time.monotonic()
    with progress(f"evaluating {args.cases} cases"):
        for _ in range(args.cases):
            case = generate(rng, catalog)
            try:
                outcomes.append(evaluate(case, catalog))
            except Exception as exc:  # noqa: BLE001  an unknown stack may fail anywhere: counted, shown, never raised
                outcomes.append(Outcome(case, "error", detail=f"{type(exc).__name__}: {exc}".splitlines()[0][:300]))
    elapsed = time.monotonic() - start
    s = summarize(outcomes)
    enforced = {c.id: c for c in rules.CHECKS if c.enforced_by in ("megatron-core", "bridge")}
    # A Bridge rejection no rule names is a disagreement even where two overlays' claims made the case "stricter".
    shown_cases = s["disagreements"] + [o for o in s["unexplained"] if o.verdict != "disagree"]
    disagreements = [_disagreement(o, enforced, catalog) for o in shown_cases]
    failed = Counter(f"{o.case.recipe}: {_last_line(o.detail)}" for o in outcomes if o.verdict in ("unbuildable", "error"))
    incomplete = Counter(o.detail for o in outcomes if o.verdict == "incomplete")
    pct = 100.0 * s["agree"] / s["decided"] if s["decided"] else None
    code = (EXIT_INCOMPLETE if not s["decided"] else EXIT_REJECTED if disagreements or s["unexplained"] else EXIT_OK)
    result = {
        "schema_version": SCHEMA_VERSION, "ok": code == EXIT_OK, "exit_code": code,
        "installed": {"megatron-bridge": stack.bridge, "megatron-core": stack.core, "torch": stack.torch},
        "supported": stack.supported,
        "checked_against": [{"megatron-bridge": b, "megatron-core": c} for b, c in SUPPORTED.items()],
        "cases": args.cases, "seed": seed, "seconds": round(elapsed, 1), "counts": s["counts"],
        "agree": s["agree"], "decided": s["decided"], "agreement_percent": None if pct is None else round(pct, 2),
        "disagreements": disagreements, "unexplained": len(s["unexplained"]),
        "stricter_rules": s["stricter_rules"], "incomplete": dict(incomplete), "unbuildable": dict(failed),
        "enforced_rules_not_triggered": s["never_triggered_enforced"],
    }
    if args.json:
        print(json_text(result))
        return code
    status = "a supported pair" if stack.supported else f"outside the pairs the rules were checked against ({checked_against()})"
    lines = [f"stack: {stack.describe()} (torch {stack.torch or 'version unknown'}): {status}",
             f"{args.cases} cases (seed {seed}) in {elapsed:.0f} s; verdicts: "
             + ", ".join(f"{k} {v}" for k, v in sorted(s["counts"].items()))]
    lines.append(f"disagreements: {len(disagreements)}")
    for d in disagreements[:SHOWN_DISAGREEMENTS]:
        lines.append(f"  rule {', '.join(d['rules']) or '(none of ours)'}; field {', '.join(d['fields']) or '?'}: "
                     f"{d['kind']}")
        lines.append(f"    case: {d['case']}")
        if d["oracle"]:
            lines.append(f"    Bridge: {d['oracle']}")
    if len(disagreements) > SHOWN_DISAGREEMENTS:
        lines.append(f"  ... and {len(disagreements) - SHOWN_DISAGREEMENTS} more (--json lists all)")
    if failed:
        lines.append(f"not compared: {sum(failed.values())} cases whose recipe did not build or whose check failed here:")
        lines += [f"  {k:>4}  {why[:200]}" for why, k in failed.most_common(10)]
    if incomplete:
        lines.append(f"incomplete: {sum(incomplete.values())} cases where Bridge's validation stopped at a check "
                     f"that needs Transformer Engine (not compared)")
    if s["never_triggered_enforced"]:
        lines.append(f"enforced rules no case reached (more --cases reach more): {', '.join(s['never_triggered_enforced'])}")
    lines.append(f"agreement: {s['agree']}/{s['decided']} ({pct:.1f}%)" if pct is not None else
                 "agreement: no case could be compared on this host (every case was incomplete or not built)")
    print(shown("\n".join(lines), one_line=False))
    return code
