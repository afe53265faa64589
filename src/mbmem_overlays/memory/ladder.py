"""The recommendation ladder: NVIDIA's memory-tuning steps, one at a time, each re-planned and validated."""

from __future__ import annotations

import copy
from typing import Any

from ..core.catalog import train_recipe_arg
from ..core.engine import apply_overlay
from ..core.errors import OverlayError
from ..core.paths import write
from . import model as P
from .costs import COSTS, DP_HALVING_COST, TP_DOUBLING_COST


def recommend(cfg: Any, world: int, capacity: float, margin: float = 0.05, locked: dict | None = None,
              recipe: str = "<recipe>") -> dict[str, Any]:
    """The memory-tuning skill's ladder, step by step, until the plan fits (Quick Decision 1-7)."""
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
