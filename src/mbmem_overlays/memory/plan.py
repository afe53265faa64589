"""A plan as the user reads it: one step per overlay, each with its breakdown, the fit verdict and its
clauses, and the JSON form.

``judge`` is the one fit verdict every command gives (plan, plan --search, plan --megatron-args, recommend,
doctor --plan): over the plan's own uncertainty ranges (memory/ranges.py) and what the job sets that the plan does
not model (memory/coverage.py ``gaps``). A plan that is blind to something that changes memory says "unknown: ...
not modelled", with the range the code allows (the modelled figure as a floor where the feature can only add
memory, as a ceiling where it can only remove memory, else both ends open), unless that range alone decides the
fit; it is never a bare "fits" or "does NOT fit".
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..core.report import EXIT_OK, EXIT_REJECTED, EXIT_UNKNOWN
from .assumptions import ASSUMPTIONS
from .coverage import DOWN, UP, Gap, gaps as read_gaps
from .inputs import Breakdown, Layout

# Verdict.kind
FITS, DOES_NOT_FIT, UNKNOWN, NO_CAPACITY = "fits", "does not fit", "unknown", "-"

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


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB"


@dataclass(frozen=True)
class Verdict:
    """One fit verdict: its kind (FITS, DOES_NOT_FIT, UNKNOWN, or NO_CAPACITY without a capacity), the text the user
    reads, the modelled ranges' "fits unless" clauses, and, where the plan does not model something the job sets
    (``gaps``), the range that leaves for the most-loaded GPU (``low``/``high``, bytes; None: that end is open)."""
    kind: str
    text: str
    clauses: tuple[str, ...] = ()
    footprint: float = 0.0          # the modelled most-loaded GPU (what must fit)
    limit: float | None = None      # capacity less the margin
    low: float | None = None
    high: float | None = None
    gaps: tuple[Gap, ...] = ()
    bounds: tuple[float | None, ...] = ()   # each gap's bound on this breakdown (Gap.size), for the JSON

    @property
    def fits(self) -> bool | None:
        """True or False where the plan can tell; None when the fit is unknown or no capacity was given."""
        return {FITS: True, DOES_NOT_FIT: False}.get(self.kind)

    @property
    def modelled_fits(self) -> bool | None:
        return None if self.limit is None else self.footprint <= self.limit

    @property
    def exit_code(self) -> int:
        """docs/exit-codes.md: 0 fits (or no capacity given), 1 does not fit, 4 unknown (not a rejection)."""
        return {DOES_NOT_FIT: EXIT_REJECTED, UNKNOWN: EXIT_UNKNOWN}.get(self.kind, EXIT_OK)

    @property
    def unmodelled(self) -> str:
        """The settings the plan does not model, as one phrase ("" when it models everything the job sets)."""
        return ", ".join(g.setting for g in self.gaps)

    def short(self) -> str:
        """The verdict in a few words, for a row of a table or a list: the kind, and what is not modelled."""
        if self.kind == UNKNOWN:
            return f"fit unknown: {self.unmodelled} not modelled"
        return self.text

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"fit": None if self.kind == NO_CAPACITY else self.kind,
                             "fit_verdict": UNKNOWN if self.kind == UNKNOWN else self.text,
                             "verdict_text": self.text, "fits_unless": list(self.clauses), "fits": self.fits,
                             "modelled_fits": self.modelled_fits,
                             "unmodelled": [{**g.as_dict(), "bound_bytes": None if b is None else int(b)}
                                            for g, b in zip(self.gaps, self.bounds)]}
        d["fit_range"] = None if not self.gaps else {
            "modelled_bytes": int(self.footprint), "limit_bytes": None if self.limit is None else int(self.limit),
            "low_bytes": None if self.low is None else int(self.low),
            "high_bytes": None if self.high is None else int(self.high),
            "open_ends": [end for end, v in (("low", self.low), ("high", self.high)) if v is None]}
        return d


def judge(footprint: float, limit: float | None, ranges: tuple[Any, ...] = (), unmodelled: Any = (),
          breakdown: Breakdown | None = None, *, basis: str = "the modelled part") -> Verdict:
    """The fit verdict of one most-loaded GPU: ``fit_verdict`` over the plan's ranges, then what the job sets that
    the plan does not model (``unmodelled``: memory/coverage.py Gap records or ``not_modelled`` texts).

    Each gap moves the figure UP, DOWN or EITHER way, by at most its bound on ``breakdown`` where the code gives one.
    That range decides the fit only where it can: what can only lower memory cannot make a plan that fits fail, what
    can only add cannot rescue one that does not, and a bound may keep either on its side of the limit. Otherwise
    the verdict is UNKNOWN, and its text says which end is open. ``basis`` names the figure (the doctor's is the
    measured peak plus the modelled change)."""
    gs = tuple(g if isinstance(g, Gap) else read_gaps((g,))[0] for g in (unmodelled or ()))
    fits = None if limit is None else footprint <= limit
    text, clauses = fit_verdict(fits, ranges, limit)
    if not gs:
        kind = NO_CAPACITY if fits is None else FITS if fits else DOES_NOT_FIT
        return Verdict(kind, text, tuple(clauses), footprint, limit, footprint, footprint)
    bounds = tuple(g.size(breakdown) for g in gs)
    down: float | None = 0.0
    up: float | None = 0.0
    for g in gs:
        d, u = g.reach(breakdown)
        down = None if down is None or d is None else down + d
        up = None if up is None or u is None else up + u
    low = None if down is None else max(0.0, footprint - down)
    high = None if up is None else footprint + up
    moves = {g.moves for g in gs}
    can = ("can only add memory" if moves == {UP} else "can only lower memory" if moves == {DOWN}
           else "can move memory either way")
    names = ", ".join(g.setting for g in gs)
    data = dict(footprint=footprint, limit=limit, low=low, high=high, gaps=gs, bounds=bounds)
    if limit is None:
        return Verdict(NO_CAPACITY, "-", (), **data)
    if fits and high is not None and high <= limit:     # nothing it leaves out can push it past the limit
        how = "which " + (can if up == 0 else f"adds at most {_gib(up)}: {_gib(high)}, within the "
                                              f"{_gib(limit)} limit")
        return Verdict(FITS, f"{text}; not modelled: {names}, {how}", tuple(clauses), **data)
    if not fits and low is not None and low > limit:    # nothing it leaves out can bring it under the limit
        how = "which " + (f"{can}: {basis}, {_gib(footprint)}, is already over the {_gib(limit)} limit" if down == 0
                          else f"saves at most {_gib(down)}: {_gib(low)}, still over the {_gib(limit)} limit")
        return Verdict(DOES_NOT_FIT, f"{text}; not modelled: {names}, {how}", tuple(clauses), **data)
    at = f"{basis}, {_gib(footprint)}, is"
    if low is not None and high is None and low == footprint:
        where = (f"{at} a floor: it fits the {_gib(limit)} limit only if what is not modelled adds less than "
                 f"{_gib(limit - footprint)}")
    elif high is not None and low is None and high == footprint:
        where = (f"{at} a ceiling: it fits the {_gib(limit)} limit only if what is not modelled saves at least "
                 f"{_gib(footprint - limit)}")
    else:
        ends = ("both ends are open" if low is None and high is None
                else f"at least {_gib(low)}, no upper bound from the code" if high is None
                else f"at most {_gib(high)}, no lower bound from the code" if low is None
                else f"between {_gib(low)} and {_gib(high)}")
        where = f"{ends}; {basis} is {_gib(footprint)} against a {_gib(limit)} limit"
    if fits and clauses:
        where += ", and " + text
    it = "they" if len(gs) > 1 else "it"
    return Verdict(UNKNOWN, f"unknown: {names} not modelled ({it} {can}); {where}", tuple(clauses),
                   **data)


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
    # The assumptions (texts of ``assumptions``) that change this job's figure (memory/assumptions.py applying, over
    # every step's inputs): the default text names these; None: every one applies. --json keeps all of them.
    applicable: tuple[str, ...] | None = None

    @property
    def total(self) -> float:
        return self.steps[-1].breakdown.total

    @property
    def limit(self) -> float | None:
        return None if self.capacity is None else self.capacity * (1 - self.margin)

    def fits(self, step: Step) -> bool | None:
        return None if self.capacity is None else step.breakdown.footprint <= self.capacity * (1 - self.margin)

    def gaps(self) -> tuple[Gap, ...]:
        """What the job sets that the plan does not model, with how each can move the figure (coverage.gaps)."""
        return read_gaps(self.not_modelled)

    def judge(self, step: Step | None = None) -> Verdict:
        """The fit verdict of a step (the last by default; only the last carries the plan's ranges): the one verdict
        the commands print and exit by (memory/plan.py ``judge``)."""
        step = step or self.steps[-1]
        ranges = self.ranges if step is self.steps[-1] else ()
        return judge(step.breakdown.footprint, self.limit, ranges, self.gaps(), step.breakdown)

    def verdict(self) -> tuple[str, list[str]]:
        """The last step's verdict text and its "fits unless" clauses: "fits", "fits unless ...", "does NOT fit",
        "unknown: ... not modelled ..." or "-" (``judge``)."""
        v = self.judge()
        return v.text, list(v.clauses)

    def as_dict(self) -> dict[str, Any]:
        steps = []
        for i, s in enumerate(self.steps):
            d = s.as_dict(self.steps[i - 1] if i else None)
            v = self.judge(s)
            d["fits"], d["fit"] = v.fits, v.as_dict()["fit"]
            steps.append(d)
        verdict = self.judge()
        return {"recipe": self.recipe, "world_size": self.world,
                "layout": {k: getattr(self.layout, k) for k in ("tp", "pp", "vpp", "cp", "ep", "sp", "seq", "mbs", "gbs")}
                | {"dp": self.layout.dp, "microbatches": self.layout.microbatches},
                "total_bytes": int(self.total), "capacity_bytes": None if self.capacity is None else int(self.capacity),
                "margin": self.margin,
                "bridge_estimator_bytes": None if self.bridge_estimate is None else int(self.bridge_estimate),
                **verdict.as_dict(),
                "not_modelled": list(self.not_modelled),
                "uncertainty": [r.as_dict() for r in self.ranges],
                "memory_lines": [{"iteration": it, "max_allocated_bytes": [int(v) for v in per_rank]}
                                 for it, per_rank in self.memory_lines],
                "steps": steps, "assumptions": list(self.assumptions),
                "assumptions_applying": [a for a in self.assumptions if self.applies(a)]}

    def applies(self, assumption: str) -> bool:
        """Whether an assumption changes this job's figure: one of the table's that applies here (``applicable``),
        one a range qualifies, or one the job added itself (a Megatron-LM job's own, the GPU it assumes)."""
        return (self.applicable is None or assumption in self.applicable or assumption not in ASSUMPTIONS
                or any(r.assumption == assumption for r in self.ranges))


STEP_NOTES = {"expandable_segments": "no change in allocated memory; removes fragmentation (reserved-but-unallocated)"}
