"""The plan a user reads: the memory model applied to a real config, one step per overlay; text and plot."""

from __future__ import annotations

import copy
from typing import Any

from ..core.catalog import Catalog
from ..core.engine import apply_overlay
from . import model as P
from .costs import LADDER


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
