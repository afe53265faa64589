"""``mbmem plan`` and ``mbmem recommend``: the plan model (plan.py) applied to real configs."""

from __future__ import annotations

import copy
import itertools
import json
import math
import re
import sys
from dataclasses import replace
from typing import Any

from . import plan as P
from .catalog import train_recipe_arg

# The order steps are shown in: the memory-tuning skill's Quick Decision ladder.
LADDER = ("expandable_segments", "lora_sp_regather", "selective_recompute", "dist_optimizer", "full_recompute",
          "cpu_offload", "optimizer_offload", "sequence_parallel")

# Documented throughput costs (fraction of step time), with their sources.
COSTS = {
    "expandable_segments": (0.0, "zero throughput cost (memory-tuning skill, Expandable segments)"),
    "lora_sp_regather": (0.04, "0.3-7% (memory-tuning skill, LoRA + SP input re-gather: -6.74% on Qwen3-8B)"),
    "selective_recompute": (0.02, "core_attn: small; mlp ~16% on Llama3-70B (activation-recompute skill)"),
    "dist_optimizer": (0.015, "~1-2% (memory-tuning skill, Parallelism resizing)"),
    "full_recompute": (0.33, "replays every layer's forward (~+1/3 compute; activation-recompute skill)"),
    "cpu_offload": (0.10, "PCIe transfer per offloaded layer (cpu-offloading skill; not measured there)"),
    "optimizer_offload": (0.9, "~1.9x step time at 25%, ~4.2x at 100% (cpu-offloading skill)"),
    "sequence_parallel": (0.0, "replaces all-reduce by reduce-scatter/all-gather of the same volume"),
}
TP_DOUBLING_COST = (0.28, "doubling TP: -28% on Llama3-70B (memory-tuning skill, Measured Results)")
DP_HALVING_COST = (0.06, "PP up at the cost of DP: ~6% per halving (memory-tuning skill)")

SIZE = re.compile(r"^\s*([\d.]+)\s*([KMGT]i?B|B)?\s*$", re.I)


def parse_size(text: str) -> float:
    m = SIZE.match(text)
    if not m:
        raise ValueError(f"cannot read memory size {text!r}; write e.g. 80GiB, 80GB or 85899345920")
    from .doctor import UNITS
    return float(m.group(1)) * UNITS[(m.group(2) or "B").lower()]


def gib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**30:6.2f}"


def bridge_estimate(cfg: Any, world: int) -> float | None:
    """Bridge's own estimator for the same config (it needs data_parallel_size set)."""
    try:
        from megatron.bridge.training.utils.theoretical_memory_utils import estimate_training_memory
        work = copy.deepcopy(cfg)
        m = work.model
        work.data_parallel_size = max(1, world // (m.tensor_model_parallel_size * m.pipeline_model_parallel_size
                                                   * m.context_parallel_size))
        dp = work.data_parallel_size
        mbs = work.train.micro_batch_size
        return float(estimate_training_memory(work, num_microbatches=max(1, work.train.global_batch_size // (mbs * dp)))
                     .total_memory_bytes)
    except Exception:  # noqa: BLE001 — the comparison is informative only
        return None


def build_plan(cfg: Any, overlays: list[str], *, world: int, recipe: str, params: dict | None = None,
               capacity: float | None = None, margin: float = 0.05, locked: dict | None = None,
               catalog: Any = None) -> P.Plan:
    """Baseline, then one step per overlay (in ladder order), each validated by the engine."""
    from .catalog import Catalog
    from .engine import apply_overlay
    catalog = catalog or Catalog()
    names = sorted({catalog.resolve(n).name for n in overlays},
                   key=lambda n: LADDER.index(n) if n in LADDER else len(LADDER))
    apply_overlay(copy.deepcopy(cfg), names, env={}, params=params, world_size=world, locked=locked,
                  catalog=catalog)  # all at once
    steps = [P.Step("baseline", P.estimate(*P.from_config(cfg, world)))]
    work = copy.deepcopy(cfg)
    applied: list[str] = []
    for name in names:
        applied.append(name)
        work = copy.deepcopy(cfg)
        apply_overlay(work, applied, env={}, params={k: v for k, v in (params or {}).items()
                                                     if k.split(".")[0] in applied or k in applied}, world_size=world,
                      locked=locked, catalog=catalog)
        steps.append(P.Step(name, P.estimate(*P.from_config(work, world)), P.STEP_NOTES.get(name, "")))
    return P.Plan(recipe, world, P.from_config(work, world)[1], tuple(steps), capacity, margin,
                  bridge_estimate(work, world))


def render_plan(plan: P.Plan) -> str:
    lay = plan.layout
    lines = [f"memory plan: {plan.recipe}, world size {plan.world}: TP{lay.tp} PP{lay.pp}"
             + (f" VPP{lay.vpp}" if lay.vpp > 1 else "") + f" CP{lay.cp} DP{lay.dp}"
             + (f" EP{lay.ep}" if lay.ep > 1 else "") + f", SP {'on' if lay.sp else 'off'}, seq {lay.seq}, "
             f"MBS {lay.mbs}, GBS {lay.gbs} ({lay.microbatches} microbatches)",
             "most-loaded GPU, GiB:",
             f"  {'step':<22}{'params':>8}{'grads':>8}{'optim':>8}{'activ':>8}{'other':>8}{'total':>9}{'delta':>8}  fits"]
    prev = None
    for s in plan.steps:
        b = s.breakdown
        delta = "" if prev is None else f"{(b.total - prev.breakdown.total) / 2**30:+8.2f}"
        fits = {None: "-", True: "yes", False: "NO"}[plan.fits(s)]
        lines.append(f"  {('+ ' if prev else '') + s.name:<22}{gib(b.parameters):>8}{gib(b.gradients):>8}"
                     f"{gib(b.optimizer):>8}{gib(b.activations):>8}{gib(b.other):>8}{gib(b.total):>9}{delta:>8}  {fits}"
                     + (f"   ({s.note})" if s.note else ""))
        prev = s
    last = plan.steps[-1].breakdown
    lines.append(f"peak of the last step: pipeline rank {last.rank}, {last.phase}"
                 + "".join(f"; {name} {value / 2**30:.2f} GiB" for name, value in last.detail if value))
    if last.resident > last.total:
        lines.append(f"with CUDA graphs the steady state holds {last.resident / 2**30:.2f} GiB (allocated tensors "
                     "plus the graphs' pool); whether it fits is judged on that")
    if plan.capacity:
        lines.append(f"capacity {plan.capacity / 2**30:.1f} GiB with a {plan.margin:.0%} margin -> "
                     f"{'fits' if plan.fits(plan.steps[-1]) else 'does NOT fit'}")
    if plan.bridge_estimate:
        lines.append(f"Bridge's estimate_training_memory for the final config: {plan.bridge_estimate / 2**30:.2f} GiB "
                     "(ignores recompute, offload, SP, LoRA and precision)")
    lines.append("assumptions:")
    lines += [f"  - {a}" for a in plan.assumptions]
    return "\n".join(lines)


def plot_plan(plan: P.Plan, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [s.name for s in plan.steps]
    parts = ("parameters", "gradients", "optimizer", "activations", "other")
    colors = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3")
    fig, ax = plt.subplots(figsize=(max(6, 1.4 * len(names) + 2), 4.8))
    bottom = [0.0] * len(names)
    for part, color in zip(parts, colors):
        vals = [getattr(s.breakdown, part) / 2**30 for s in plan.steps]
        ax.bar(names, vals, bottom=bottom, label=part, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:.1f}", ha="center", va="bottom", fontsize=9)
    if plan.capacity:
        cap = plan.capacity / 2**30
        ax.axhline(cap, color="black", linestyle="--", linewidth=1)
        ax.axhline(cap * (1 - plan.margin), color="gray", linestyle=":", linewidth=1)
        ax.text(-0.45, cap, f"capacity {cap:.0f} GiB", va="bottom", ha="left", fontsize=9)
    ax.set_ylabel("GiB on the most-loaded GPU")
    lay = plan.layout
    ax.set_title(f"{plan.recipe}: TP{lay.tp} PP{lay.pp} VPP{lay.vpp} CP{lay.cp} DP{lay.dp}, world {plan.world}", fontsize=10)
    top = max(bottom + [plan.capacity / 2**30 if plan.capacity else 0])
    ax.set_ylim(0, top * 1.12)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    plt.setp(ax.get_xticklabels(), rotation=20, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- search
def _divisors(n: int, cap: int) -> list[int]:
    return [d for d in (1, 2, 4, 8, 16) if d <= cap and n % d == 0]


def search(cfg: Any, world: int, capacity: float, margin: float = 0.05, top: int = 5) -> tuple[list[dict], int, float]:
    """Enumerate TP x PP x VPP x CP x DP x overlay sets our rules accept; keep those that fit; rank by cost."""
    import time
    from .rules import REGATHER_SURFACES
    shape, base_lay, base_st = P.from_config(cfg, world)
    lora = base_st.lora_rank > 0
    options = ["expandable_segments", "selective_recompute", "dist_optimizer", "full_recompute", "cpu_offload"]
    if lora:
        options.append("lora_sp_regather")
    t0 = time.perf_counter()
    evaluated = 0
    found: list[dict] = []
    for tp in _divisors(shape.groups, 8):
        for pp in _divisors(shape.layers, 16):
            for cp in (1, 2):
                if world % (tp * pp * cp):
                    continue
                for vpp in ([1] + [v for v in (2, 4, 5) if (shape.layers // pp) % v == 0] if pp > 1 else [1]):
                    for k in range(len(options) + 1):
                        for combo in itertools.combinations(options, k):
                            s = set(combo)
                            # our rules, on the dataclasses (the top results are re-checked by the engine)
                            if {"selective_recompute", "full_recompute"} <= s or \
                               ("cpu_offload" in s and (pp > 1 or s & {"selective_recompute", "full_recompute"})):
                                continue
                            if "lora_sp_regather" in s and tp == 1:
                                continue
                            evaluated += 1
                            lay = replace(base_lay, tp=tp, pp=pp, vpp=vpp, cp=cp, sp=tp > 1)
                            st = replace(base_st, dist_optimizer=base_st.dist_optimizer or "dist_optimizer" in s,
                                         recompute="full" if "full_recompute" in s else
                                         "selective" if "selective_recompute" in s else base_st.recompute,
                                         modules=("core_attn",) if "selective_recompute" in s else base_st.modules,
                                         recompute_method="uniform", recompute_layers=1,
                                         cpu_offload_layers=(shape.layers // 2) if "cpu_offload" in s else 0,
                                         lora_regather=REGATHER_SURFACES if "lora_sp_regather" in s else ())
                            total = P.estimate(shape, lay, st).footprint  # what must fit
                            if total > capacity * (1 - margin):
                                continue
                            cost = sum(COSTS[o][0] for o in s)
                            if tp > base_lay.tp:
                                cost += TP_DOUBLING_COST[0] * math.log2(tp / base_lay.tp)
                            if lay.dp < base_lay.dp:
                                cost += DP_HALVING_COST[0] * math.log2(base_lay.dp / lay.dp)
                            found.append({"tp": tp, "pp": pp, "vpp": vpp, "cp": cp, "dp": lay.dp, "overlays": sorted(s),
                                          "total_bytes": int(total), "cost": round(cost, 3)})
    elapsed = time.perf_counter() - t0
    found.sort(key=lambda r: (r["cost"], r["total_bytes"]))
    return found[:top], evaluated, elapsed


def command_for(recipe: str, row: dict, world: int) -> str:
    sets = [f"model.tensor_model_parallel_size={row['tp']}", f"model.pipeline_model_parallel_size={row['pp']}",
            f"model.virtual_pipeline_model_parallel_size={row['vpp'] if row['vpp'] > 1 else 'null'}",
            f"model.context_parallel_size={row['cp']}"]
    if row["tp"] > 1:
        sets.append("model.sequence_parallel=true")
    mem = f" '+mem=[{','.join(row['overlays'])}]'" if row["overlays"] else ""
    return f"python train.py {train_recipe_arg(recipe)}{mem} {' '.join(sets)} run.world_size={world}"


# ----------------------------------------------------------------------------- CLI
def _recipe_and_overrides(args):
    from . import bridge
    from .cli import split_sets
    overrides, params = split_sets(args.set)
    cfg = bridge.load_recipe(args.recipe)
    locked = bridge.apply_overrides(cfg, overrides)
    return cfg, locked, params


def cmd_plan(args) -> int:
    from .cli import _csv
    cfg, locked, params = _recipe_and_overrides(args)
    capacity = parse_size(args.gpu_memory) if args.gpu_memory else None
    if args.search:
        if capacity is None:
            print("mbmem plan --search needs --gpu-memory (e.g. 80GiB)", file=sys.stderr)
            return 2
        rows, n, secs = search(cfg, args.world_size, capacity, args.margin, args.top)
        if args.json:
            print(json.dumps({"evaluated": n, "seconds": secs, "results": rows}, indent=2))
            return 0 if rows else 1
        print(f"searched {n} layouts x overlay sets in {secs:.2f} s; {len(rows)} best that fit "
              f"{capacity / 2**30:.0f} GiB with a {args.margin:.0%} margin, cheapest first:")
        for r in rows:
            print(f"  {r['total_bytes'] / 2**30:6.1f} GiB  cost ~{r['cost']:.0%}  TP{r['tp']} PP{r['pp']} VPP{r['vpp']} "
                  f"CP{r['cp']} DP{r['dp']}  [{', '.join(r['overlays'])}]\n    {command_for(args.recipe, r, args.world_size)}")
        return 0 if rows else 1
    plan = build_plan(cfg, _csv(args.overlay), world=args.world_size, recipe=args.recipe, params=params,
                      capacity=capacity, margin=args.margin, locked=locked)
    if args.plot:
        plot_plan(plan, args.plot)
    if args.json:
        print(json.dumps(plan.as_dict(), indent=2))
    else:
        print(render_plan(plan))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0 if plan.fits(plan.steps[-1]) is not False else 1


def register(sub) -> None:
    p = sub.add_parser("plan", help="per-GPU memory before and after each overlay (and --search for layouts)")
    p.add_argument("--recipe", required=True, help="recipes/ name or Bridge recipe function")
    p.add_argument("--overlay", "-O", action="append", default=[])
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--gpu-memory", help="capacity per GPU, e.g. 80GiB")
    p.add_argument("--margin", type=float, default=0.05, help="headroom kept free (fraction of capacity)")
    p.add_argument("--plot", metavar="PNG")
    p.add_argument("--json", action="store_true")
    p.add_argument("--search", action="store_true", help="enumerate layouts and overlay sets that fit")
    p.add_argument("--top", type=int, default=5)
    p.set_defaults(fn=cmd_plan)


# ----------------------------------------------------------------------------- recommend
def recommend(cfg: Any, world: int, capacity: float, margin: float = 0.05, locked: dict | None = None,
              recipe: str = "<recipe>") -> dict[str, Any]:
    """The memory-tuning skill's ladder, step by step, until the plan fits (Quick Decision 1-7)."""
    from .engine import apply_overlay, write
    from .errors import OverlayError
    limit = capacity * (1 - margin)
    overlays: list[str] = []
    sets: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []

    def current(extra_overlays=(), extra_sets=None):
        work = copy.deepcopy(cfg)
        for path, value in {**sets, **(extra_sets or {})}.items():
            write(work, path, value)
        apply_overlay(work, [*overlays, *extra_overlays], env={}, world_size=world, locked=locked)
        return work, P.estimate(*P.from_config(work, world)).footprint

    _, total = current()
    rows.append({"step": "baseline", "total_bytes": int(total), "fits": total <= limit})
    m = cfg.model
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    vpp = m.virtual_pipeline_model_parallel_size
    dp = world // max(1, tp * pp * cp)
    candidates: list[tuple[str, list[str], dict[str, Any], str]] = [
        ("expandable_segments", ["expandable_segments"], {}, COSTS["expandable_segments"][1]),
        ("lora_sp_regather", ["lora_sp_regather"], {}, COSTS["lora_sp_regather"][1]),
        ("selective_recompute", ["selective_recompute"], {}, COSTS["selective_recompute"][1]),
        ("dist_optimizer", ["dist_optimizer"], {}, COSTS["dist_optimizer"][1]),
    ]
    if dp >= 2 and m.num_layers % (pp * 2) == 0:
        new_pp = pp * 2
        pp_sets: dict[str, Any] = {"model.pipeline_model_parallel_size": new_pp}
        if vpp and (m.num_layers // new_pp) % vpp:
            pp_sets["model.virtual_pipeline_model_parallel_size"] = None
        candidates.append((f"PP {pp} -> {new_pp} (DP {dp} -> {dp // 2})", [], pp_sets, DP_HALVING_COST[1]))
    candidates.append(("cpu_offload", ["cpu_offload"], {}, COSTS["cpu_offload"][1]))
    candidates.append((f"TP {tp} -> {tp * 2}", [], {"model.tensor_model_parallel_size": tp * 2,
                                                   "model.sequence_parallel": True}, TP_DOUBLING_COST[1] + "; last resort"))
    done = False
    for label, more, more_sets, cost in candidates:
        # Expandable segments always comes first (free; fragmentation is invisible to any plan); after it,
        # stop at the first step that fits.
        if done or (label != "expandable_segments" and rows[-1].get("fits")):
            break
        if more and more[0] in overlays:
            continue
        if label == "dist_optimizer" and cfg.optimizer.use_distributed_optimizer:
            rows.append({"step": label, "skipped": "already on in this recipe"})
            continue
        if label == "lora_sp_regather" and type(getattr(cfg, "peft", None)).__name__ != "LoRA":
            rows.append({"step": label, "skipped": "not a LoRA recipe"})
            continue
        try:
            _, new_total = current(more, more_sets)
        except OverlayError as exc:
            rows.append({"step": label, "skipped": "; ".join(p.message.split(". ")[0] for p in exc.problems[:2])})
            continue
        before = next(r["total_bytes"] for r in reversed(rows) if "total_bytes" in r)
        if label == "lora_sp_regather" and before - new_total <= 0:
            rows.append({"step": label, "skipped": "no LoRA adapter would re-gather here"})
            continue
        if label not in ("expandable_segments",) and before - new_total <= 0:
            rows.append({"step": label, "skipped": "saves nothing at this layout"})
            continue
        overlays += more
        sets.update(more_sets)
        rows.append({"step": label, "total_bytes": int(new_total), "saving_bytes": int(before - new_total),
                     "cost": cost, "fits": new_total <= limit})
        done = new_total <= limit and label != "expandable_segments"
    set_args = " ".join(f"{k}={'null' if v is None else str(v).lower() if isinstance(v, bool) else v}"
                        for k, v in sets.items())
    mem = f" '+mem=[{','.join(overlays)}]'" if overlays else ""
    fits = any(r.get("fits") for r in rows)
    return {"capacity_bytes": int(capacity), "margin": margin, "steps": rows, "fits": fits,
            "command": f"python train.py {train_recipe_arg(recipe)}{mem} {set_args} run.world_size={world}".replace("  ", " ").strip()}


def render_recommendation(rec: dict[str, Any]) -> str:
    lines = [f"recommended path (memory-tuning skill, Quick Decision), capacity {rec['capacity_bytes'] / 2**30:.0f} GiB "
             f"with a {rec['margin']:.0%} margin:"]
    for r in rec["steps"]:
        if "skipped" in r:
            lines.append(f"  - {r['step']:<28} skipped: {r['skipped']}")
        else:
            saving = f"  saves {r['saving_bytes'] / 2**30:5.2f} GiB" if "saving_bytes" in r else ""
            cost = f"  cost: {r['cost']}" if r.get("cost") else ""
            lines.append(f"  {'*' if r['fits'] else ' '} {r['step']:<28} {r['total_bytes'] / 2**30:6.2f} GiB{saving}"
                         f"{'  FITS' if r['fits'] else ''}{cost}")
    lines.append(("next command: " if rec["fits"] else "nothing on the ladder fits; closest: ") + rec["command"])
    return "\n".join(lines)


def cmd_recommend(args) -> int:
    cfg, locked, _ = _recipe_and_overrides(args)
    rec = recommend(cfg, args.world_size, parse_size(args.gpu_memory), args.margin, locked, args.recipe)
    print(json.dumps(rec, indent=2) if args.json else render_recommendation(rec))
    return 0 if rec["fits"] else 1


def register_recommend(sub) -> None:
    p = sub.add_parser("recommend", help="walk NVIDIA's memory ladder until the plan fits")
    p.add_argument("--recipe", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--gpu-memory", required=True, help="e.g. 80GiB")
    p.add_argument("--margin", type=float, default=0.05)
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_recommend)
