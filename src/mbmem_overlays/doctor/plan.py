"""``mbmem doctor --plan``: what each remedy saves for the job in the log, and a full validation of the
next command. Needs Megatron Bridge (the recipe is built); the default doctor never imports this module.

The savings come from the memory model (memory/model.py ``estimate``/``from_config``) on the recipe with
the overrides and overlays the log's launch command shows, at the world size the log shows, and each remedy's step-time cost from the
cost model beside it (memory/cost/: a range with its FLOPs, bytes per link and bubble, ``Remedy.step_cost``);
remedies are then ranked by the numbers: those whose saving covers the failed request's shortfall first,
cheapest first by that cost (memory/cost/ rank_key), then the others by saving.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

from . import command as C

GiB = 1 << 30
SKIP_OVERRIDE_PREFIXES = ("recipe", "run.", "hydra", "mem.", "+")


def make_planner(recipe: str | None, *, megatron: tuple | None = None, arch: int | None = None,
                 overlay_dirs: list[str] | None = None) -> Callable:
    """``megatron``: (the Megatron-LM job the log's arguments give, or None; why not) from
    doctor/megatron_plan.py ``find_job``: for a log without a recipe, that job is priced instead, in its own flags
    (``arch``: the GPUs' compute capability, --gpu-arch; None: the GPU the recipe is named for, else 9;
    ``overlay_dirs``: --overlay-dir)."""
    def planner(remedies: list[C.Remedy], ctx, f) -> tuple[list[C.Remedy], str, Callable | None]:
        name = recipe or f.recipe
        if not name:
            return _megatron_or_unpriced(remedies, ctx, f, megatron, arch, overlay_dirs)
        try:
            from ..bridge.overrides import apply_overrides
            from ..bridge.recipes import gpu_arch_for, load_recipe, world_size_for
            from ..bridge.stack import prepare
            from ..core.engine import apply_overlay, plan_overlays
            from ..core.errors import OverlayError
            from ..memory import cost as K
            from ..memory import model as M
        except ImportError as exc:
            return remedies, f"savings not computed: Megatron Bridge is not importable ({exc})", None
        try:
            prepare()
            cfg = load_recipe(name)
            sets = [f"{k}={v}" for k, v in C.overrides_in(ctx.launch).items()
                    if not k.startswith(SKIP_OVERRIDE_PREFIXES)]
            locked = apply_overrides(cfg, sets) if sets else {}
            world, _ = world_size_for(cfg, ctx.world)
        except Exception as exc:  # noqa: BLE001 — any failure to build the recipe is reported, never raised
            return remedies, f"savings not computed: recipe {name!r} could not be built ({type(exc).__name__}: {exc})", None
        gpu = gpu_arch_for(name, arch)
        base_overlays = list(ctx.overlays)
        base_params = {k: C._typed(v) for k, v in C.params_in(ctx.launch).items()}

        def footprint(overlays: list[str], params: dict, extra_sets: dict) -> tuple[float, tuple] | None:
            """(the most-loaded GPU's footprint, the cost model's job) of the recipe with these changes."""
            work = copy.deepcopy(cfg)
            try:
                if extra_sets:
                    apply_overrides(work, extra_sets)
                apply_overlay(work, overlays, env={}, params=params, world_size=world, locked=locked)
                # read as Bridge's setup will run it (from_config: bridge/as_run.py); the cost model reads the
                # user's overlap settings before Bridge's comm-overlap setup, which it models itself
                shape, lay, st = M.from_config(work, world, arch=gpu["compute_capability"])
                return M.estimate(shape, lay, st).footprint, (shape, lay, st, K.cost_inputs(work))
            except (OverlayError, ValueError, TypeError, AttributeError):
                return None

        planned = footprint(base_overlays, base_params, {})
        for r in remedies:
            if planned is None or r.env or not (r.overlay or r.overrides) or r.overlay == "expandable_segments":
                continue
            overlays = [o for o in base_overlays if o not in r.remove_overlays]
            if r.overlay and r.overlay not in overlays:
                overlays.append(r.overlay)
            params = {**base_params, **{f"{r.overlay}.{k}": C._typed(v) for k, v in r.params.items()}}  # as the validator reads them
            after = footprint(overlays, params, dict(r.overrides))
            r.saves = None if after is None else max(0.0, planned[0] - after[0])
            if after is not None:
                try:
                    r.step_cost = K.price(planned[1], after[1], gpu["compute_capability"]).as_dict()
                except (ValueError, TypeError, ArithmeticError, KeyError):   # unpriced, never raised
                    r.step_cost = None
        shortfall = _shortfall(f)
        ranked = _rank(remedies, shortfall)
        text = (f"savings from the memory model on {name}, world size {world}"
                + (f", GPUs of compute capability {gpu['compute_capability']} ({gpu['platform'].upper()}, from "
                   f"{gpu['from']})" if gpu["platform"] and gpu["from"] != "--gpu-arch"
                   and gpu["compute_capability"] != 9 else "")
                + (f"; the failed request was short by {shortfall / GiB:.2f} GiB" if shortfall else ""))
        left_out = _left_out(cfg, base_overlays, base_params, world, locked)
        if left_out:   # memory/plan.py judge: what the plan does not model makes every remedy's fit unknown
            text += ("; NOT MODELLED: " + ", ".join(g.setting for g in left_out) + " (the savings are the modelled "
                     "part's: what a remedy does to it, and so whether it covers the shortfall, is unknown)")

        base_sets = C.overrides_in(ctx.launch)

        def validator(overlays: list[str], params: dict, command_text: str) -> str:
            new_sets = {k: v for k, v in C.overrides_in(C.parse_launch(command_text)).items()
                        if base_sets.get(k) != v and not k.startswith(SKIP_OVERRIDE_PREFIXES)}
            try:
                work = copy.deepcopy(cfg)
                more = apply_overrides(work, [f"{k}={v}" for k, v in new_sets.items()]) if new_sets else {}
                plan_overlays(work, overlays, env={}, params={k: C._typed(v) for k, v in params.items()},
                              world_size=world, locked={**locked, **more})
            except OverlayError as exc:
                return "NOT VALID (engine, on the recipe): " + "; ".join(p.message for p in exc.problems)
            except Exception as exc:  # noqa: BLE001 — reported as "not validated", never raised
                return f"not validated: the engine stopped with {type(exc).__name__}: {exc}"
            return f"validated by the engine on recipe {name} at world size {world} (Bridge's config)"

        return ranked, text, validator
    return planner


def _megatron_or_unpriced(remedies, ctx, f, megatron, arch, overlay_dirs):
    """A log without a recipe: its Megatron-LM job, when its arguments (dump or launch command) give one, priced in
    its own flags; else the remedies unpriced, saying why."""
    found, why = megatron or (None, "")
    if found is not None:
        from .megatron_plan import price_remedies, status
        try:
            refused, base = price_remedies(found, remedies, arch=arch, overlay_dirs=overlay_dirs)
            shortfall = _shortfall(f)
            # a remedy no flags can make goes last: the first one's validated flags are the next command
            ranked = _rank([r for r in remedies if r not in refused], shortfall) + refused
            return ranked, status(found, base, shortfall, arch), None
        except Exception as exc:  # noqa: BLE001 — any failure to plan the job is reported, never raised
            why = (f"the job's Megatron-LM arguments could not be planned ({type(exc).__name__}: "
                   f"{' '.join(str(exc).split())[:300]})")
    if why:
        return remedies, f"savings not computed: no recipe in the log, and {why}", None
    return remedies, "savings not computed: the recipe is not in the log; give --recipe", None


def _left_out(cfg, overlays: list[str], params: dict, world: int, locked: dict) -> tuple:
    """What the job in the log sets that the memory model does not follow (memory/coverage.py gaps), read as
    Bridge's setup runs it (bridge/as_run.py), as the plan is."""
    from ..bridge.as_run import as_run
    from ..core.engine import apply_overlay
    from ..memory.coverage import gaps, not_modelled
    work = copy.deepcopy(cfg)
    try:
        apply_overlay(work, overlays, env={}, params=params, world_size=world, locked=locked)
    except Exception:  # noqa: BLE001 — the recipe as built is what is read then
        work = cfg
    return gaps(not_modelled(as_run(work, world).config))


def _shortfall(f) -> float | None:
    gaps = [o.requested - o.free - o.reserved_unallocated for o in f.ooms
            if None not in (o.requested, o.free, o.reserved_unallocated)]
    gaps = [g for g in gaps if g > 0]
    return max(gaps) if gaps else None


def _rank(remedies: list[C.Remedy], shortfall: float | None) -> list[C.Remedy]:
    """Remedies the model cannot price keep their place in front; the priced ones: covering the shortfall
    first, cheapest first by the cost model (memory/cost/ rank_key: the middle of the step-time range, then its
    high end; the ladder's order breaks ties), then the rest by saving, largest first; a remedy saving nothing
    last."""
    fixed = [r for r in remedies if r.saves is None]
    priced = [r for r in remedies if r.saves is not None]
    covering = [r for r in priced if shortfall is not None and r.saves >= shortfall]
    order = {id(r): i for i, r in enumerate(covering)}
    covering.sort(key=lambda r: (tuple(r.step_cost["rank_key"]) if r.step_cost else (float("inf"),) * 2,
                                 order[id(r)]))
    rest = sorted((r for r in priced if r not in covering), key=lambda r: -r.saves)
    return fixed + covering + rest
