"""``mbmem doctor SNAPSHOT --plan --recipe R``: the memory model's plan beside what the snapshot shows.

The only part of the snapshot reader that imports Megatron Bridge (to build the recipe) and the memory model
(memory/model.py ``from_config`` and ``estimate``). The plan is for the most-loaded GPU (the first or last
pipeline rank at its peak phase); the snapshot is one rank at its OOM or peak, grouped into the same
components (sites.py ``plan_component``). The plan counts allocated memory only, as the snapshot does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from .analyze import Moment, gib

COMPONENTS = (("parameters+gradients", ("parameters", "gradients")), ("optimizer", ("optimizer",)),
              ("activations", ("activations",)), ("other", ("other",)))


@dataclass(frozen=True)
class PlanComparison:
    lines: tuple[str, ...]
    data: dict[str, Any] | None
    validator: Any = None       # (overlays, params, command text) -> status text; None when the recipe did not build


def compare_plan(recipe: str, overrides: list[str], params: dict[str, Any], world: int | None,
                 moment: Moment | None, arch: int | None = None) -> PlanComparison:
    """``arch``: the GPUs' compute capability (--gpu-arch; None: the GPU the recipe is named for, else 9)."""
    try:
        from ...bridge.overrides import apply_overrides
        from ...bridge.recipes import gpu_arch_for, load_recipe, world_size_for
        from ...bridge.stack import prepare
        from ...core.engine import plan_overlays
        from ...core.errors import OverlayError
        from ...memory import model as model_
    except ImportError as exc:
        return PlanComparison((f"plan: not computed, Megatron Bridge is not importable ({exc})",), None)
    try:
        prepare()
        cfg = load_recipe(recipe)
        locked = apply_overrides(cfg, overrides) if overrides else {}
        world, assumed = world_size_for(cfg, world)
        gpu = gpu_arch_for(recipe, arch)
        # read as Bridge's setup will run it (from_config: bridge/as_run.py)
        plan = model_.estimate(*model_.from_config(cfg, world, arch=gpu["compute_capability"]))
    except Exception as exc:  # noqa: BLE001 — a recipe that does not build is reported, never raised
        return PlanComparison((f"plan: not computed, recipe {recipe!r} could not be built "
                               f"({type(exc).__name__}: {str(exc)[:300]})",), None)

    def validator(overlays: list[str], command_params: dict, text: str) -> tuple[str, bool]:
        """(status, whether the last overlay changes nothing in this config)."""
        try:
            report, _, _ = plan_overlays(copy.deepcopy(cfg), overlays, env={},
                                         params={**params, **{k: _value(v) for k, v in command_params.items()}},
                                         world_size=world, locked=locked)
        except OverlayError as exc:
            return "NOT VALID (engine, on the recipe): " + "; ".join(p.message for p in exc.problems), False
        except Exception as exc:  # noqa: BLE001 — reported as "not validated", never raised
            return f"not validated: the engine stopped with {type(exc).__name__}: {exc}", False
        no_op = bool(overlays) and not any(c.overlay == overlays[-1] for c in report.changes)
        return f"validated by the engine on recipe {recipe} at world size {world} (Bridge's config)", no_op

    seen = moment.components if moment else {}
    rows = []
    for name, fields in COMPONENTS:
        planned = int(sum(getattr(plan, f) for f in fields))
        rows.append({"component": name, "plan_bytes": planned, "snapshot_bytes": int(seen.get(name, 0)),
                     "difference_bytes": int(seen.get(name, 0)) - planned})
    total_seen = moment.totals.allocated if moment else 0
    rows.append({"component": "total", "plan_bytes": int(plan.total), "snapshot_bytes": total_seen,
                 "difference_bytes": total_seen - int(plan.total)})
    where = "at the OOM" if moment and moment.kind == "oom" else "at its peak"
    lines = [f"plan (memory model, recipe {recipe}, world size {world}{' assumed: TP*PP*CP' if assumed else ''}; "
             f"pipeline rank {plan.rank}, {plan.phase}) beside the snapshot {where}:",
             f"  {'component':<22} {'plan':>11} {'snapshot':>11} {'snapshot-plan':>14}"]
    lines += [f"  {r['component']:<22} {gib(r['plan_bytes']):>11} {gib(r['snapshot_bytes']):>11} "
              f"{('+' if r['difference_bytes'] >= 0 else '-') + gib(abs(r['difference_bytes'])):>14}" for r in rows]
    lines.append("  (the snapshot is one rank; the plan is the most-loaded one. Categories come from the stacks: "
                 "see the category list above for what 'other' holds)")
    data = {"recipe": recipe, "world_size": world, "world_size_assumed": assumed, "plan_rank": plan.rank,
            "plan_phase": plan.phase, "components": rows,
            "gpu_arch": {k: v for k, v in gpu.items() if k != "assumption"}}
    return PlanComparison(tuple(lines), data, validator)


def _value(text: Any) -> Any:
    """A parameter value from the command text, typed as Hydra reads it."""
    if not isinstance(text, str):
        return text
    from ...core.values import parse_value
    return parse_value(text)
