"""Layout search: TP x PP x VPP x CP x DP x overlay sets that fit, cheapest first (the cost model, memory/cost/).

Two passes. ``search`` enumerates on the memory model's dataclasses alone (tens of thousands of plans per
second), with the rules that decide most combinations written out on the dataclasses. ``search_validated``
then realizes the cheapest ones (by the step-time cost of going from the user's configuration to each,
memory/cost/ rank_key), one by one, exactly as ``train.py`` would (the user's overrides and
overlays, our engine, Bridge's validation), drops what is refused or no longer fits once applied, and
keeps going until ``top`` have passed; each result carries the command that reproduces it, its saving against
the user's own configuration and the fit verdict. An overlay set is not offered when one of its overlays saves
nothing on that layout (the same set without it has the same footprint and costs less: the distributed optimizer at
DP x CP = 1, say), and a rejection names the field or overlay that caused it (steps.explain_rejection).
"""

from __future__ import annotations

import copy
import itertools
import math
import time
from collections import Counter
from dataclasses import replace
from typing import Any

from ..bridge.as_run import as_run
from ..core.catalog import Catalog
from ..core.engine import apply_overlay
from ..core.errors import OverlayError
from ..core.rules import REGATHER_SURFACES
from . import cost as K
from . import levers
from . import model as P
from .coverage import UP, gaps, not_modelled
from .ranges import uncertainty
from .steps import (Candidate, Rejected, Start, explain_rejection, first_line, launch_env, realize,
                    train_command)

# The Bridge fields a layout sets; a field the user set with --set is pinned to the user's value.
LAYOUT_FIELDS = {"tp": "model.tensor_model_parallel_size", "pp": "model.pipeline_model_parallel_size",
                 "vpp": "model.virtual_pipeline_model_parallel_size", "cp": "model.context_parallel_size"}
SP_FIELD = "model.sequence_parallel"
# expandable_segments is not an option but part of every result: it is free and changes no modelled byte
# (memory-tuning skill, Quick Decision 1), so two results that differ only in it would be the same layout.
ALWAYS = ("expandable_segments",)
OPTIONS = ("selective_recompute", "dist_optimizer", "full_recompute", "cpu_offload", "optimizer_offload",
           "precision_aware_optimizer", "megatron_fsdp", "fine_grained_offload")
RECOMPUTE = {"selective_recompute", "full_recompute"}
MIN_SAVING = 1 << 20   # an overlay whose removal changes the footprint by less saves nothing on that layout


def _divisors(n: int, cap: int) -> list[int]:
    return [d for d in (1, 2, 4, 8, 16) if d <= cap and n % d == 0]


def _choices(values: list[int], field: str, locked: dict[str, Any]) -> list[int]:
    """The values to try for one layout dimension: the user's own, when they set it."""
    if field in locked:
        return [locked[field] or 1]
    return values


def _refused(s: set[str], pp: int, tp: int, dist: bool) -> bool:
    """The rules that decide most combinations, on the dataclasses (the engine and Bridge re-check every
    result): one recompute granularity; activation offload only at PP=1 and without recompute
    (cpu-offloading skill, Compatibility); re-gather needs TP>1; optimizer offload needs the distributed optimizer
    (same section), which Megatron FSDP and the precision-aware optimizer's overlay turn on (FSDP with
    dist_optimizer is FSDP alone); layer and fine-grained activation offload exclude each other (transformer_config.py
    __post_init__)."""
    if RECOMPUTE <= s or ("cpu_offload" in s and (pp > 1 or s & RECOMPUTE)):
        return True
    if "lora_sp_regather" in s and tp == 1:
        return True
    if {"megatron_fsdp", "dist_optimizer"} <= s or {"cpu_offload", "fine_grained_offload"} <= s:
        return True
    # the precision-aware optimizer's overlay turns the distributed optimizer on itself
    dist = dist or bool(s & {"dist_optimizer", "megatron_fsdp", "precision_aware_optimizer"})
    return "optimizer_offload" in s and not dist


def search(cfg: Any, world: int, capacity: float, margin: float = 0.05, top: int | None = 5, *,
           locked: dict[str, Any] | None = None, fixed: tuple[str, ...] = (),
           arch: int | None = None, priced: bool = True) -> tuple[list[dict], int, float]:
    """Enumerate TP x PP x VPP x CP x DP x overlay sets; keep those the model says fit; rank by cost.

    ``cfg`` already carries the user's overrides and overlays (``fixed``: those overlays, never varied);
    ``locked`` pins the layout fields the user set; ``arch``: the GPUs' compute capability (memory/cost/gpus.py;
    None: 9). Each row's ``cost_range`` is (low, high), the step-time cost of going from ``cfg`` to it (cost
    model, memory/cost/), and rows are ranked by it (memory/cost/ rank_key), then by memory; with ``priced``
    the rows returned carry ``cost``, the cost with its parts (memory/cost/ Cost.as_dict). ``top=None`` returns
    every row. The config is set up as Bridge runs it once (from_config: bridge/as_run.py); every candidate is a
    variation of the dataclasses read from it."""
    locked = locked or {}
    shape, base_lay, base_st = P.from_config(cfg, world, arch=9 if arch is None else arch)
    ci = K.cost_inputs(cfg)
    own = (shape, base_lay, base_st, ci)
    options = [o for o in OPTIONS if o not in fixed]
    if base_st.lora_rank > 0 and "lora_sp_regather" not in fixed:
        options.append("lora_sp_regather")
    t0 = time.perf_counter()
    evaluated = 0
    found: list[dict] = []
    for tp in _choices(_divisors(shape.groups, 8), LAYOUT_FIELDS["tp"], locked):
        sp = bool(locked[SP_FIELD]) if SP_FIELD in locked else tp > 1
        for pp in _choices(_divisors(shape.layers, 16), LAYOUT_FIELDS["pp"], locked):
            for cp in _choices([1, 2], LAYOUT_FIELDS["cp"], locked):
                if world % (tp * pp * cp):
                    continue
                vpps = [1] + [v for v in (2, 4, 5) if (shape.layers // pp) % v == 0] if pp > 1 else [1]
                for vpp in _choices(vpps, LAYOUT_FIELDS["vpp"], locked):
                    footprints: dict[frozenset, float] = {}   # this layout's overlay sets, evaluated so far
                    for k in range(len(options) + 1):
                        for combo in itertools.combinations(options, k):
                            s = set(combo)
                            if _refused(s | set(fixed), pp, tp, base_st.dist_optimizer):
                                continue
                            evaluated += 1
                            lay = replace(base_lay, tp=tp, pp=pp, vpp=vpp, cp=cp, sp=sp and tp > 1)
                            st = _settings(base_st, s, shape)
                            total = P.estimate(shape, lay, st).footprint  # what must fit
                            footprints[frozenset(s)] = total
                            if total > capacity * (1 - margin):
                                continue
                            if any(footprints.get(frozenset(s - {o}), math.inf) <= total + MIN_SAVING for o in s):
                                continue  # an overlay in it saves nothing here: the smaller set is offered
                            low, high = K.cost_range(own, (shape, lay, st, ci), arch)
                            found.append({"tp": tp, "pp": pp, "vpp": vpp, "cp": cp, "dp": lay.dp, "sp": lay.sp,
                                          "overlays": sorted(s), "total_bytes": int(total),
                                          "cost_range": (round(low, 4), round(high, 4)),
                                          "_job": (shape, lay, st, ci)})
    elapsed = time.perf_counter() - t0
    found.sort(key=lambda r: (K.rank_key(*r["cost_range"]), r["total_bytes"]))
    shown = found if top is None else found[:top]
    for i, row in enumerate(found):   # the cost with its parts, for the rows returned (the others only ranked)
        job = row.pop("_job")
        if priced and i < len(shown):
            row["cost"] = K.price(own, job, arch).as_dict()
    return shown, evaluated, elapsed


def _settings(base: P.Settings, s: set[str], shape: P.Shape) -> P.Settings:
    """The model's settings with the overlays in ``s`` on top (the parameters ``candidate_for`` passes)."""
    base = levers.search_settings(base, s, shape)
    return replace(base, dist_optimizer=base.dist_optimizer or "dist_optimizer" in s,
                   recompute="full" if "full_recompute" in s else "selective" if "selective_recompute" in s
                   else base.recompute,
                   modules=("core_attn",) if "selective_recompute" in s else base.modules,
                   recompute_method="uniform" if "full_recompute" in s else base.recompute_method,
                   recompute_layers=1 if "full_recompute" in s else base.recompute_layers,
                   cpu_offload_layers=(shape.layers // 2) if "cpu_offload" in s else base.cpu_offload_layers,
                   optimizer_offload=1.0 if "optimizer_offload" in s else base.optimizer_offload,
                   lora_regather=REGATHER_SURFACES if "lora_sp_regather" in s else base.lora_regather)


def candidate_for(row: dict, locked: dict[str, Any], layers: int, moe: bool = False) -> Candidate:
    """The overlays, parameters and layout fields of one search row (the user's fields are left alone); ``moe``:
    the model has MoE layers (the offload modules include theirs)."""
    values = {"tp": row["tp"], "pp": row["pp"], "vpp": row["vpp"] if row["vpp"] > 1 else None, "cp": row["cp"]}
    sets = {path: values[k] for k, path in LAYOUT_FIELDS.items() if path not in locked}
    if SP_FIELD not in locked:
        sets[SP_FIELD] = row["tp"] > 1
    params = {}
    if "cpu_offload" in row["overlays"]:
        params["cpu_offload"] = {"num_layers": layers // 2}
    if "full_recompute" in row["overlays"]:
        params["full_recompute"] = {"method": "uniform", "num_layers": 1}
    if "optimizer_offload" in row["overlays"]:
        params["optimizer_offload"] = {"fraction": 1.0}
    if "megatron_fsdp" in row["overlays"]:
        params["megatron_fsdp"] = {"strategy": levers.SEARCH_FSDP_STRATEGY}
    if "fine_grained_offload" in row["overlays"]:
        params["fine_grained_offload"] = {"modules": list(levers.search_offload_modules(moe)),
                                          "fraction": 1.0}
    return Candidate(tuple(dict.fromkeys([*ALWAYS, *row["overlays"]])), params, sets)


def search_validated(cfg: Any, start: Start, world: int, capacity: float, margin: float = 0.05, top: int = 5, *,
                     catalog: Catalog | None = None, validate: bool = True, max_checks: int = 200,
                     arch: int | None = None, target: Any = None) -> dict[str, Any]:
    """``search``, then each row realized and validated, cheapest first, until ``top`` pass.

    Returns {"results", "evaluated", "seconds", "checked", "dropped", "dropped_reasons"}; a result has its
    applied total (the memory model on the realized config), the validation verdict and its command.
    ``target``: a job that is not launched as a recipe (memory/megatron.py ``MegatronTarget``): it realizes and
    validates each row, and its command and fields replace the train.py command (as in ladder.recommend)."""
    catalog = catalog or Catalog(list(start.overlay_dirs))
    arch = arch if arch is not None else (9 if target is None else target.arch)
    env = None if target is None else target.env
    do = realize if target is None else target.realize

    def as_planned(realized: Any) -> tuple[Any, tuple]:
        """(the config as Bridge's setup runs it, the plan's inputs read from it) on the job's GPUs and environment."""
        run = as_run(realized, world, env)
        return run, P.from_config(run.config, world, arch=arch, env=env)
    mine = copy.deepcopy(cfg)
    try:  # the user's overlays, for the model's starting settings (the layout is checked per row below)
        apply_overlay(mine, list(start.overlays), env=launch_env() if target is None else dict(target.env),
                      params=start.params, locked=start.locked, catalog=catalog)
    except OverlayError as exc:
        raise Rejected(f"your overlays are rejected on this recipe: {first_line(exc)}") from None
    rows, evaluated, seconds = search(mine, world, capacity, margin, None, locked=start.locked, fixed=start.overlays,
                                      arch=arch, priced=False)
    mine_job = K.job_of(mine, world, arch=arch)
    limit = capacity * (1 - margin)
    mine_run, mine_inputs = as_planned(mine)
    own = P.estimate(*mine_inputs).footprint   # the user's configuration as planned: what each result saves
    probes: dict = {}
    results: list[dict[str, Any]] = []
    dropped: Counter[str] = Counter()
    checked = 0
    t0 = time.perf_counter()
    for row in rows:
        if len(results) >= top or checked >= max_checks:
            break
        checked += 1
        cand = candidate_for(row, start.locked, cfg.model.num_layers,
                             bool(getattr(cfg.model, "num_moe_experts", None)))
        try:
            work, report = do(cfg, start, cand, world, catalog=catalog, validate=validate)
        except Rejected as exc:
            dropped[explain_rejection(cfg, start, cand, world, exc, catalog=catalog, validate=validate,
                                      cache=probes)] += 1
            continue
        run, (shape, lay, st) = as_planned(work)   # set up once (bridge/as_run.py), read by each reader below
        b = P.estimate(shape, lay, st)
        if b.footprint > limit:
            dropped["does not fit once the overlays resolve their parameters (memory model on the applied config)"] += 1
            continue
        v = report.validation
        fit = P.judge(b.footprint, limit, uncertainty(shape, lay, st, b), gaps(not_modelled(run.config)), b)
        # the cost of the applied config against the user's own (the overlays' resolved parameters included)
        cost = K.price(mine_job, K.job_of(work, world, arch=arch), arch).as_dict()
        results.append({**row, "cost": cost, "overlays": list(dict.fromkeys([*start.overlays, *cand.overlays])),
                        "total_bytes": int(b.footprint), "modelled_bytes": row["total_bytes"],
                        "saving_bytes": int(own - b.footprint), **fit.as_dict(),
                        "validation": ("our rules only" if v is None else v.verdict) if target is None else
                        target.verdict(report),
                        "command": train_command(start, cand, world) if target is None else
                        target.command(start, cand, world, report), "breakdown": b,
                        **({} if target is None else target.extra(report))})
    # What the user's own configuration sets that the plan does not model: with nothing found, whether any layout
    # could fit is unknown unless what is left out can only add memory (every layout was over the limit already).
    mine_gaps = gaps(not_modelled(mine_run.config))
    if results:
        fit = "unknown" if any(r["fit"] == "unknown" for r in results) else "fits"
    else:
        fit = "does not fit" if all(g.moves == UP for g in mine_gaps) else "unknown"
    return {"results": results, "evaluated": evaluated, "seconds": seconds + (time.perf_counter() - t0),
            "candidates": len(rows), "checked": checked, "dropped": sum(dropped.values()),
            "dropped_reasons": [{"reason": r, "count": n} for r, n in dropped.most_common()],
            "fit": fit, "unmodelled": [g.as_dict() for g in mine_gaps]}


def layout_name(r: dict[str, Any]) -> str:
    """A search result's layout and overlays as the user reads them: "TP2 PP1 CP1 DP4 SP [overlays]"."""
    layout = f"TP{r['tp']} PP{r['pp']}" + (f" VPP{r['vpp']}" if r["vpp"] > 1 else "") + f" CP{r['cp']} DP{r['dp']}"
    return f"{layout}{' SP' if r['sp'] else ''} [{', '.join(r['overlays']) or 'no overlays'}]"


def render_search(found: dict[str, Any], capacity: float, margin: float, *,
                  checked_with: str = "our rules and Bridge's validation", retry: str = "`mbmem recommend`",
                  each: str = "") -> str:
    """``search_validated``'s result as the user reads it: how many layouts were searched and checked, why some
    were dropped, then each validated layout with its saving, its cost, its verdict where it is not a plain "fits",
    and its command. ``checked_with``/``retry``/``each``: the words of a job launched otherwise (memory/megatron.py:
    its flags checked by megatron-core)."""
    from .cost import cost_text
    results = found["results"]
    lines = [f"searched {found['evaluated']} layouts x overlay sets in {found['seconds']:.1f} s: {found['candidates']} "
             f"fit {capacity / 2**30:.1f} GiB with a {margin:.0%} margin in the memory model; checked the cheapest "
             f"{found['checked']} with {checked_with}"]
    if found["dropped"]:
        lines.append(f"dropped {found['dropped']} that were rejected or did not fit once applied:")
        lines += [f"  {d['count']:>3} x {d['reason']}" for d in found["dropped_reasons"][:5]]
    unknown = found.get("fit") == "unknown" or any(r.get("fit") == "unknown" for r in results)
    if unknown:
        names = ", ".join(f"{g['name']}={g['value']}" for g in found.get("unmodelled", [])) or "a feature"
        lines.append(f"fit unknown: {names} not modelled; each layout below fits in the modelled part only "
                     "(its verdict says which end of its range is open)")
    if not results:
        lines.append("no validated layout fits" + (" in the modelled part" if unknown else "")
                     + f"; try {retry} (offload, full recompute) or more GPUs")
        return "\n".join(lines)
    lines.append(f"{len(results)} validated, cheapest first (cost: step time against your configuration, "
                 f"memory/cost/ — docs/cost-model.md){each}:")
    for r in results:
        saving = r.get("saving_bytes")
        saves = "" if saving is None else f"  saves {saving / 2**30:5.1f} GiB"
        lines.append(f"  {r['total_bytes'] / 2**30:6.1f} GiB{saves}  {layout_name(r)}")
        lines.append(f"    cost: {cost_text(r.get('cost'))}")
        if r.get("fits_unless") or r.get("fit", "fits") != "fits":
            lines.append(f"    {r.get('verdict_text', r.get('fit_verdict'))}")
        lines.append(f"    {r['command']}")
    return "\n".join(lines)
