"""The recommendation ladder: NVIDIA's memory-tuning steps, one at a time, each re-planned and validated.

Every rung proposes a :class:`~.steps.Candidate` on top of the user's own start (recipe, ``--set``
words, overlays); it is realized the way ``train.py`` realizes it (our rules, then Bridge's
validation) before it may become a step, and the one command printed at the end is the last
accepted candidate's, so it has passed both already. Order (sources in ``costs.py``):

1. expandable segments (memory-tuning skill, Quick Decision 1)
2. sequence parallel at TP > 1, the precondition of 3 (memory-tuning skill, PEFT + SP input re-gather)
3. LoRA input re-gather (Quick Decision 2)
4. selective recompute, the architecture's default label (Quick Decision 3)
5. distributed optimizer (Parallelism resizing, ~1-2%)
6. selective recompute of ``mlp`` (dense) or ``moe`` (MoE) added to 4 (Quick Decision 6; activation-recompute
   skill, Selective Module Decision Table)
7. PP doubled while DP >= 2 (Quick Decision 5: ~6% per DP halving)
8. activation CPU offload, PP = 1 only, instead of recompute (Quick Decision 7; cpu-offloading skill)
9. full recompute, the fewest layers that fit (activation-recompute skill, Quick Decision Guide 5)
10. optimizer CPU offload, the smallest documented fraction that fits (cpu-offloading skill, Quick Decision)
11. TP doubled, last resort (Quick Decision 4: -28% on Llama3-70B)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..core.catalog import Catalog
from .costs import COSTS, DP_HALVING_COST, TP_DOUBLING_COST, full_recompute_cost, optimizer_offload_cost
from .steps import Candidate, Rejected, Start, breakdown_of, realize, settings, toggles, train_command

RECOMPUTE_OVERLAYS = ("selective_recompute", "full_recompute")


@dataclass
class State:
    """The ladder so far: the accepted candidate, its realized config and report."""
    start: Start
    cand: Candidate
    cfg: Any
    report: Any
    world: int


# A rung returns candidates to try in order of preference (the first that fits wins; otherwise the one
# that saves most), or a sentence saying why it does not apply here.
Proposal = list[tuple[Candidate, str]] | str


@dataclass(frozen=True)
class Rung:
    label: str
    propose: Callable[[State], Proposal]


def _model(state: State):
    return state.cfg.model


def _is_lora(state: State) -> bool:
    return type(getattr(state.cfg, "peft", None)).__name__ in ("LoRA", "DoRA")


def _own(state: State, overlay: str) -> str | None:
    """Why the ladder may not change ``overlay``: the user chose it, or set one of its parameters."""
    if overlay in state.start.overlays:
        return f"you chose {overlay} (--overlay); the ladder does not replace it"
    return None


def expandable(state: State) -> Proposal:
    return [(state.cand.plus("expandable_segments"), COSTS["expandable_segments"][1])]


def sequence_parallel(state: State) -> Proposal:
    if _model(state).tensor_model_parallel_size <= 1:
        return "needs TP > 1 (sequence parallel is a no-op at TP=1)"
    return [(state.cand.plus("sequence_parallel"), COSTS["sequence_parallel"][1])]


def lora_regather(state: State) -> Proposal:
    if not _is_lora(state):
        return "not a LoRA recipe"
    return [(state.cand.plus("lora_sp_regather"), COSTS["lora_sp_regather"][1])]


def selective_default(state: State) -> Proposal:
    return [(state.cand.plus("selective_recompute"), COSTS["selective_recompute"][1])]


def dist_optimizer(state: State) -> Proposal:
    return [(state.cand.plus("dist_optimizer"), COSTS["dist_optimizer"][1])]


def selective_wide(state: State) -> Proposal:
    """``mlp`` (dense) or ``moe`` (MoE) added to the selective modules in effect."""
    m = _model(state)
    label = "moe" if (getattr(m, "num_moe_experts", None) or 0) else "mlp"
    if "modules" in state.start.params.get("selective_recompute", {}):
        return "you chose the modules yourself (mem.selective_recompute.modules)"
    if "model.recompute_modules" in state.start.locked:
        return "you set model.recompute_modules yourself"
    current = list(m.recompute_modules or []) if m.recompute_granularity == "selective" else []
    if label in current:
        return f"{label} is already recomputed"
    modules = [*current, label]
    return [(state.cand.plus("selective_recompute", params={"modules": modules}),
             COSTS[f"selective_recompute_{label}"][1])]


def _yours(state: State, path: str) -> str | None:
    return f"you set {path} yourself" if path in state.start.locked else None


def pipeline_doubling(state: State) -> Proposal:
    if _yours(state, "model.pipeline_model_parallel_size"):
        return _yours(state, "model.pipeline_model_parallel_size")
    m = _model(state)
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    dp = state.world // max(1, tp * pp * cp)
    if dp < 2:
        return f"DP is {dp}: no data parallelism left to trade for pipeline stages"
    new_pp = pp * 2
    if m.num_layers % new_pp:
        return f"{m.num_layers} layers do not split into {new_pp} pipeline stages"
    sets: dict[str, Any] = {"model.pipeline_model_parallel_size": new_pp}
    vpp = m.virtual_pipeline_model_parallel_size
    if vpp and (m.num_layers // new_pp) % vpp:
        sets["model.virtual_pipeline_model_parallel_size"] = None
    return [(state.cand.plus(sets=sets), f"PP {pp} -> {new_pp}, DP {dp} -> {dp // 2}: {DP_HALVING_COST[1]}")]


def cpu_offload(state: State) -> Proposal:
    """Activation offload replaces recompute (megatron-core refuses the two together); fewest layers first."""
    mine = next((r for r in (_own(state, o) for o in RECOMPUTE_OVERLAYS) if r), None)
    if mine:
        return mine + " and activation offload cannot be combined with recompute"
    layers = _model(state).num_layers
    counts = sorted({n for n in (1, layers // 4, layers // 2, layers - 1) if 1 <= n < layers})
    return [(state.cand.plus("cpu_offload", params={"num_layers": n}, drop=RECOMPUTE_OVERLAYS),
             f"{n} of {layers} layers: {COSTS['cpu_offload'][1]}") for n in counts]


def full_recompute(state: State) -> Proposal:
    """Full recompute instead of selective: ``block`` of a few layers per stage first, ``uniform``/1 last."""
    mine = _own(state, "selective_recompute")
    if mine:
        return mine
    m = _model(state)
    per_stage = max(1, m.num_layers // m.pipeline_model_parallel_size)
    blocks = sorted({n for n in (per_stage // 4, per_stage // 2) if 1 <= n < per_stage})
    options = [("block", n) for n in blocks] + [("uniform", 1)]
    return [(state.cand.plus("full_recompute", params={"method": method, "num_layers": n},
                             drop=("selective_recompute", "cpu_offload")),
             full_recompute_cost(method, n, per_stage)) for method, n in options]


def optimizer_offload(state: State) -> Proposal:
    # HybridDeviceOptimizer needs the distributed optimizer (cpu-offloading skill, Compatibility: Optimizer offloading)
    on = bool(state.cfg.optimizer.use_distributed_optimizer)
    with_dist = state.cand if on else state.cand.plus("dist_optimizer")
    return [(with_dist.plus("optimizer_offload", params={"fraction": f}), optimizer_offload_cost(f))
            for f in (0.25, 0.5, 1.0)]


def tensor_doubling(state: State) -> Proposal:
    if _yours(state, "model.tensor_model_parallel_size"):
        return _yours(state, "model.tensor_model_parallel_size")
    tp = _model(state).tensor_model_parallel_size
    return [(state.cand.plus("sequence_parallel", sets={"model.tensor_model_parallel_size": tp * 2}),
             f"TP {tp} -> {tp * 2}: {TP_DOUBLING_COST[1]}; last resort")]


LADDER_RUNGS = (
    Rung("expandable_segments", expandable),
    Rung("sequence_parallel", sequence_parallel),
    Rung("lora_sp_regather", lora_regather),
    Rung("selective_recompute", selective_default),
    Rung("dist_optimizer", dist_optimizer),
    Rung("selective_recompute (wider)", selective_wide),
    Rung("PP x2 (DP /2)", pipeline_doubling),
    Rung("cpu_offload", cpu_offload),
    Rung("full_recompute", full_recompute),
    Rung("optimizer_offload", optimizer_offload),
    Rung("TP x2", tensor_doubling),
)


def _label(rung: Rung, before: Candidate, after: Candidate) -> str:
    """The step as the user reads it: what was added and with which parameters."""
    if rung.label == "selective_recompute (wider)":
        return "selective_recompute " + ",".join(after.params["selective_recompute"]["modules"])
    if after.params.get(rung.label) and rung.label not in before.overlays:
        return f"{rung.label} " + " ".join(f"{k}={v}" for k, v in after.params[rung.label].items())
    return rung.label


def _shown(value: Any) -> Any:
    """A config value for JSON and text (torch dtypes and enums as their repr)."""
    return value if isinstance(value, (type(None), bool, int, float, str, list, dict)) else repr(value)


def recommend(cfg: Any, world: int, capacity: float, margin: float = 0.05, locked: dict | None = None,
              recipe: str = "<recipe>", *, start: Start | None = None, catalog: Catalog | None = None,
              validate: bool = True) -> dict[str, Any]:
    """The memory-tuning skill's ladder, step by step, until the plan fits.

    ``cfg`` is the recipe with the user's overrides written; ``start`` carries the user's --set words and
    overlays (``recipe``/``locked`` are the short form when there are none). Every accepted step has passed
    our rules and, with ``validate``, Bridge's validation; the returned ``command`` is the last one's."""
    start = start or Start(recipe, locked=dict(locked or {}))
    catalog = catalog or Catalog(list(start.overlay_dirs))
    limit = capacity * (1 - margin)
    base = Candidate()
    try:
        work, report = realize(cfg, start, base, world, catalog=catalog, validate=validate)
    except Rejected as exc:
        return {"capacity_bytes": int(capacity), "margin": margin, "fits": False, "steps": [],
                "error": f"your starting point is rejected: {exc.reason}", "command": None}
    state = State(start, base, work, report, world)
    first = breakdown_of(work, world)
    total = first.footprint
    rows: list[dict[str, Any]] = [{"step": "baseline", "overlays": list(start.overlays), "total_bytes": int(total),
                                   "fits": total <= limit, "validation": _verdict(report), "breakdown": first}]
    seen: dict[tuple, str] = {}
    for rung in LADDER_RUNGS:
        if rung.label != "expandable_segments" and total <= limit:
            break  # expandable segments always comes first (free; fragmentation is invisible to any plan)
        proposal = rung.propose(state)
        if isinstance(proposal, str):
            rows.append({"step": rung.label, "skipped": proposal})
            continue
        best, reasons = None, []
        for cand, cost in proposal:
            try:
                cfg2, report2 = realize(cfg, start, cand, world, catalog=catalog, validate=validate)
            except Rejected as exc:
                reasons.append(exc.reason)
                continue
            b = breakdown_of(cfg2, world)
            new_total = b.footprint
            option = (cand, cost, cfg2, report2, new_total, b)
            if best is None or new_total < best[4]:
                best = option
            if new_total <= limit:
                best = option
                break
        if best is None:
            rows.append({"step": rung.label, "skipped": f"rejected: {reasons[0]}"})
            continue
        cand, cost, cfg2, report2, new_total, b = best
        changed = toggles(cfg, settings(state.report, state.cand), settings(report2, cand))
        key = tuple((t, repr(new)) for t, _, new in changed)
        label = _label(rung, state.cand, cand)
        if not changed:
            rows.append({"step": label, "skipped": "already in effect in this config (changes nothing)"})
            continue
        if key in seen:
            rows.append({"step": label, "skipped": f"same change as {seen[key]}"})
            continue
        seen[key] = label
        saving = total - new_total
        if rung.label != "expandable_segments" and saving <= 0:
            rows.append({"step": label, "skipped": f"saves nothing at this layout ({saving / 2**30:+.2f} GiB modelled)"})
            continue
        rows.append({"step": label, "overlays": list(dict.fromkeys([*start.overlays, *cand.overlays])),
                     "changes": [{"target": t, "old": _shown(o), "new": _shown(n)} for t, o, n in changed],
                     "total_bytes": int(new_total), "saving_bytes": int(saving), "cost": cost,
                     "fits": new_total <= limit, "validation": _verdict(report2), "breakdown": b})
        state = State(start, cand, cfg2, report2, world)
        total = new_total
    return {"capacity_bytes": int(capacity), "margin": margin, "steps": rows, "fits": total <= limit,
            "overlays": list(dict.fromkeys([*start.overlays, *state.cand.overlays])),
            "validation": _verdict(state.report), "command": train_command(start, state.cand, world)}


def _verdict(report: Any) -> str:
    v = report.validation
    return "our rules only (Bridge's validation not run)" if v is None else v.verdict


def render_recommendation(rec: dict[str, Any]) -> str:
    if rec.get("error"):
        return rec["error"]
    lines = [f"recommended path (memory-tuning skill, Quick Decision), capacity {rec['capacity_bytes'] / 2**30:.1f} GiB "
             f"with a {rec['margin']:.0%} margin; each step validated (our rules + Bridge):"]
    for r in rec["steps"]:
        if "skipped" in r:
            lines.append(f"  - {r['step']:<34} skipped: {r['skipped']}")
            continue
        saving = f"  saves {r['saving_bytes'] / 2**30:5.2f} GiB" if "saving_bytes" in r else ""
        lines.append(f"  {'*' if r['fits'] else ' '} {r['step']:<34} {r['total_bytes'] / 2**30:6.2f} GiB{saving}"
                     f"{'  FITS' if r['fits'] else ''}")
        if r.get("changes"):
            lines.append("      sets: " + ", ".join(f"{c['target']}={c['new']!r}" for c in r["changes"]))
        if r.get("cost"):
            lines.append(f"      cost: {r['cost']}")
    lines.append(("next command (validated: " if rec["fits"] else "nothing on the ladder fits; closest (validated: ")
                 + f"{rec['validation']}):")
    lines.append(f"  {rec['command']}")
    lines.append("  (a dry run: it validates again; drop run.dry_run=true on a GPU node to train)")
    return "\n".join(lines)
