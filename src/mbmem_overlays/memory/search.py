"""Layout search: TP x PP x VPP x CP x DP x overlay sets that fit, cheapest first (documented costs)."""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import replace
from typing import Any

from ..core.catalog import train_recipe_arg
from ..core.rules import REGATHER_SURFACES
from . import model as P
from .costs import COSTS, DP_HALVING_COST, TP_DOUBLING_COST


def _divisors(n: int, cap: int) -> list[int]:
    return [d for d in (1, 2, 4, 8, 16) if d <= cap and n % d == 0]


def search(cfg: Any, world: int, capacity: float, margin: float = 0.05, top: int = 5) -> tuple[list[dict], int, float]:
    """Enumerate TP x PP x VPP x CP x DP x overlay sets our rules accept; keep those that fit; rank by cost."""
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
