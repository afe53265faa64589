"""A plan as the user reads it: one step per overlay, each with its breakdown, the fit verdict and its
clauses, and the JSON form."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .assumptions import ASSUMPTIONS
from .inputs import Breakdown, Layout

def fit_verdict(fits: bool | None, ranges: tuple[Any, ...], limit: float | None) -> tuple[str, list[str]]:
    """The fit verdict and its clauses, over memory/ranges.py Ranges: "fits", "fits unless <clause>; or <clause>" (a range whose high end passes
    the fit limit; an open range says how large its unknown may grow), "does NOT fit" (with the low-end clause of
    a range that would make it fit), or "-" without a capacity."""
    if fits is None or limit is None:
        return "-", []
    if not fits:
        rescue = [f"{r.if_low}: {r.low / 2**30:.1f} GiB" for r in ranges if r.if_low and r.low <= limit]
        return "does NOT fit" + (f" ({'; '.join(rescue)})" if rescue else ""), []
    clauses = []
    for r in ranges:
        if r.high is None and r.per_unit > 0:
            clauses.append(f"{r.unless} than {math.floor((limit - r.low) / r.per_unit):,} {r.unit}s")
        elif r.high is not None and r.high > limit and r.unless:
            clauses.append(f"{r.unless} ({r.high / 2**30:.1f} GiB)")
    return ("fits unless " + "; or ".join(clauses) if clauses else "fits"), clauses


@dataclass(frozen=True)
class Step:
    name: str                 # "baseline" or the overlay added at this step
    breakdown: Breakdown
    note: str = ""
    # the step's price against the step before it (memory/cost/ Cost.as_dict: range, FLOPs, bytes per link, bubble)
    cost: dict | None = None

    def as_dict(self, previous: "Step | None") -> dict[str, Any]:
        d = {"name": self.name, **{k: int(v) for k, v in self.breakdown.as_dict().items()}}
        d["total_bytes"] = d.pop("total")
        d["delta_bytes"] = 0 if previous is None else int(self.breakdown.total - previous.breakdown.total)
        d["peak_rank"], d["peak_phase"] = self.breakdown.rank, self.breakdown.phase
        d["detail_bytes"] = {k: int(v) for k, v in self.breakdown.detail}
        if self.breakdown.resident:
            d["resident_bytes"] = int(self.breakdown.resident)
        if self.note:
            d["note"] = self.note
        if self.cost is not None:
            d["cost"] = self.cost
        return d


@dataclass(frozen=True)
class Plan:
    recipe: str
    world: int
    layout: Layout
    steps: tuple[Step, ...]
    capacity: float | None
    margin: float
    bridge_estimate: float | None
    assumptions: tuple[str, ...] = ASSUMPTIONS
    ranges: tuple[Any, ...] = ()      # memory/ranges.py Range: where the last step's peak could move
    # What the job's memory lines will show: (iteration, max allocated per pipeline rank), for the iterations Bridge
    # reports after (REPORTED_ITERATIONS; reported_breakdowns), so a log can be held against the plan line by line
    memory_lines: tuple[tuple[int, tuple[float, ...]], ...] = ()
    # Memory-relevant fields set in the configuration that the model does not follow ("field=value: why",
    # memory/coverage.py not_modelled): named in the verdict and the JSON, never ignored silently
    not_modelled: tuple[str, ...] = ()

    @property
    def total(self) -> float:
        return self.steps[-1].breakdown.total

    @property
    def limit(self) -> float | None:
        return None if self.capacity is None else self.capacity * (1 - self.margin)

    def fits(self, step: Step) -> bool | None:
        return None if self.capacity is None else step.breakdown.footprint <= self.capacity * (1 - self.margin)

    def verdict(self) -> tuple[str, list[str]]:
        """The last step's fit verdict: "fits", "fits unless ...", "does NOT fit" or "-" (memory/ranges.py), then
        "; not modelled: field=value, ..." when the configuration sets fields the model does not follow."""
        verdict, clauses = fit_verdict(self.fits(self.steps[-1]), self.ranges, self.limit)
        if self.not_modelled:
            verdict += "; not modelled: " + ", ".join(n.split(":")[0] for n in self.not_modelled)
        return verdict, clauses

    def as_dict(self) -> dict[str, Any]:
        steps = []
        for i, s in enumerate(self.steps):
            d = s.as_dict(self.steps[i - 1] if i else None)
            d["fits"] = self.fits(s)
            steps.append(d)
        return {"recipe": self.recipe, "world_size": self.world,
                "layout": {k: getattr(self.layout, k) for k in ("tp", "pp", "vpp", "cp", "ep", "sp", "seq", "mbs", "gbs")}
                | {"dp": self.layout.dp, "microbatches": self.layout.microbatches},
                "total_bytes": int(self.total), "capacity_bytes": None if self.capacity is None else int(self.capacity),
                "margin": self.margin, "fits": self.fits(self.steps[-1]),
                "bridge_estimator_bytes": None if self.bridge_estimate is None else int(self.bridge_estimate),
                "fit_verdict": self.verdict()[0], "fits_unless": self.verdict()[1],
                "not_modelled": list(self.not_modelled),
                "uncertainty": [r.as_dict() for r in self.ranges],
                "memory_lines": [{"iteration": it, "max_allocated_bytes": [int(v) for v in per_rank]}
                                 for it, per_rank in self.memory_lines],
                "steps": steps, "assumptions": list(self.assumptions)}


STEP_NOTES = {"expandable_segments": "no change in allocated memory; removes fragmentation (reserved-but-unallocated)"}
