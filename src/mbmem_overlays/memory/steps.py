"""The plan a user reads: the memory model applied to a real config, one step per overlay; text and plot.

Also what the ladder (``ladder.py``) and the layout search (``search.py``) share: a :class:`Candidate`
(overlays, their parameters, Bridge fields) on top of the user's own :class:`Start` (recipe, ``--set``
words, overlays), realized exactly as ``train.py`` would (overrides, then the engine, then Bridge's
validation), and the ``train.py`` command that reproduces it.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
import textwrap
from dataclasses import dataclass, field
from typing import Any

from ..bridge.as_run import as_run
from ..bridge.recipes import build_notes
from ..core.catalog import Catalog, train_recipe_arg
from ..core.engine import apply_overlay
from ..core.errors import OverlayError
from ..core.paths import read
from ..core.values import hydra_text
from . import model as P
from .costs import LADDER
from .assumptions import ASSUMPTIONS, BY_TEXT, applying
from .levers import step_note
from .coverage import not_modelled
from .ranges import uncertainty


def gib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**30:6.2f}"


# ----------------------------------------------------------------------------- what the user started from
@dataclass(frozen=True)
class Start:
    """The user's own choices, which every printed command keeps."""
    recipe: str                                   # as given to --recipe
    words: tuple[str, ...] = ()                   # the --set words, verbatim and in order
    overlays: tuple[str, ...] = ()                # canonical names from --overlay
    params: dict[str, dict[str, Any]] = field(default_factory=dict)   # {overlay: {param: value}} from mem.<o>.<p>=v
    locked: dict[str, Any] = field(default_factory=dict)              # the Bridge fields the user set
    overlay_dirs: tuple[str, ...] = ()            # --overlay-dir: train.py finds them through MBMEM_OVERLAY_DIRS


@dataclass(frozen=True)
class Candidate:
    """What the ladder or the search adds to the user's start: overlays, their parameters, Bridge fields."""
    overlays: tuple[str, ...] = ()
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    sets: dict[str, Any] = field(default_factory=dict)

    def plus(self, overlay: str | None = None, *, params: dict[str, Any] | None = None,
             sets: dict[str, Any] | None = None, drop: tuple[str, ...] = ()) -> Candidate:
        names = tuple(n for n in self.overlays if n not in drop)
        if overlay and overlay not in names:
            names += (overlay,)
        new_params = {k: v for k, v in self.params.items() if k in names}
        if overlay and params:
            new_params[overlay] = {**new_params.get(overlay, {}), **params}
        return Candidate(names, new_params, {**self.sets, **(sets or {})})


class Rejected(Exception):
    """A candidate that our rules or Bridge's validation refuse; ``reason`` is one line for the user and
    ``problem`` the first Problem behind it (None when there is none)."""

    def __init__(self, reason: str, problem: Any = None):
        super().__init__(reason)
        self.reason = reason
        self.problem = problem


def launch_env() -> dict[str, str]:
    """The environment an overlay is checked against, as ``mbmem apply`` and ``train.py`` read it: this process's
    (variables the user exported win over cfg.env_vars, as at launch). A copy: what an overlay sets is planned,
    never exported here."""
    return dict(os.environ)


def first_line(exc: OverlayError) -> str:
    """The first problem of an OverlayError, its message only (the fix is for a user's own command)."""
    problems = getattr(exc, "problems", None) or []
    text = problems[0].message if problems else str(exc)
    more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
    return " ".join(text.split()) + more


def realize(cfg: Any, start: Start, cand: Candidate, world: int, *, catalog: Catalog,
            validate: bool = True, env: dict[str, str] | None = None) -> tuple[Any, Any]:
    """(config, engine report) of ``cand`` on top of ``start``, built the way train.py builds it: the
    candidate's Bridge fields as overrides (locked, like the user's), then every overlay through the
    engine at once, then Bridge's own validation (``api.apply_overlay(validate=True)``).

    ``cfg`` is the recipe with the user's overrides already written; ``env`` the environment the overlays are
    checked against (None: this process's, as at launch; a Megatron-LM job's own). Raises :class:`Rejected`."""
    from ..api import apply_overlay as api_apply_overlay
    from ..bridge.overrides import apply_overrides
    clash = sorted(set(cand.sets) & set(start.locked))
    if clash:
        raise Rejected(f"you set {', '.join(clash)} yourself")
    work = copy.deepcopy(cfg)
    names = list(dict.fromkeys([*start.overlays, *cand.overlays]))
    params = {n: {**start.params.get(n, {}), **cand.params.get(n, {})} for n in names
              if start.params.get(n) or cand.params.get(n)}
    try:
        locked = {**start.locked, **(apply_overrides(work, dict(cand.sets)) if cand.sets else {})}
        report = api_apply_overlay(work, names, env=launch_env() if env is None else dict(env), params=params,
                                   world_size=world, locked=locked, validate=validate, catalog=catalog)
    except OverlayError as exc:  # our rules, or (engine >= ValidationRejected) Bridge's validation
        raise Rejected(first_line(exc), next(iter(getattr(exc, "problems", None) or []), None)) from None
    v = report.validation
    if v is not None and not v.ok:  # an engine that returns Bridge's rejection instead of raising it
        raise Rejected(" ".join(str(v.error or v.verdict).split()))
    return work, report


# The engine's wording for a Bridge rejection names every overlay applied, whichever caused it.
_BRIDGE_PREFIX = re.compile(r"^Bridge's own validation rejected the config with .*? applied: ")


def explain_rejection(cfg: Any, start: Start, cand: Candidate, world: int, exc: Rejected, *, catalog: Catalog,
                      validate: bool = True, cache: dict | None = None) -> str:
    """The rejection as "<what caused it>: <why>", the cause being what the candidate adds without which it
    passes: a field it sets (checked alone on the user's start, e.g. model.context_parallel_size=2 with a LoRA
    recipe), else an overlay it adds. Our own rules already name their field; Bridge's validation names none,
    so the candidate is bisected (each check is one realize, ~20 ms; ``cache`` keeps them across candidates)."""
    problem = exc.problem
    if problem is not None and getattr(problem, "check", "") != "bridge" and getattr(problem, "field", ""):
        field = str(problem.field)
        text = exc.reason if exc.reason.startswith(field) else f"{field}: {exc.reason}"
        return text
    why = _BRIDGE_PREFIX.sub("", exc.reason)
    cache = {} if cache is None else cache

    def rejected(probe: Candidate) -> bool:
        key = (probe.overlays, repr(sorted(probe.params.items())), repr(sorted(probe.sets.items())))
        if key not in cache:
            try:
                realize(cfg, start, probe, world, catalog=catalog, validate=validate)
                cache[key] = False
            except Rejected:
                cache[key] = True
        return cache[key]

    causes = [f"{k}={hydra_text(v)}" for k, v in cand.sets.items() if rejected(Candidate(sets={k: v}))]
    if not causes:
        added = [o for o in cand.overlays if o not in start.overlays]
        causes = [f"+mem={o}" for o in added if not rejected(cand.plus(drop=(o,)))]
    if not causes:
        causes = [f"{k}={hydra_text(v)}" for k, v in cand.sets.items()] or [f"+mem={o}" for o in cand.overlays]
    return f"{' with '.join(causes)}: {why}" if causes else why


def breakdown_of(cfg: Any, world: int, *, arch: int = 9, env: dict[str, str] | None = None) -> P.Breakdown:
    """The memory model's most-loaded GPU for a realized config, read as Bridge's setup will run it
    (from_config: bridge/as_run.py)."""
    return P.estimate(*P.from_config(cfg, world, arch=arch, env=env))


def settings(report: Any, cand: Candidate) -> dict[str, Any]:
    """Every field (and ``$VAR``) a realized candidate sets, with the value it sets."""
    out = {c.target: c.new for c in report.changes}
    out.update(cand.sets)
    return out


def toggles(cfg: Any, before: dict[str, Any], after: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """What moving from one realized candidate to the next changes: [(field or $VAR, old, new)]."""
    out = []
    for target in dict.fromkeys([*before, *after]):
        base = None if target.startswith("$") else read(cfg, target, None)
        old, new = before.get(target, base), after.get(target, base)
        if old != new:
            out.append((target, old, new))
    return out


def train_command(start: Start, cand: Candidate, world: int) -> str:
    """The ``train.py`` command (README "train.py (Hydra)") that builds exactly what ``realize`` checked:
    the user's recipe and --set words first, verbatim, then the candidate; a dry run, so pasting it
    validates again before anything launches (drop ``run.dry_run=true`` to train)."""
    names = list(dict.fromkeys([*start.overlays, *cand.overlays]))
    words = ["python", "train.py", train_recipe_arg(start.recipe), *start.words,
             *(f"{path}={hydra_text(v)}" for path, v in cand.sets.items())]
    if names:
        words.append(f"+mem=[{','.join(names)}]")
    words += [f"mem.{o}.{p}={hydra_text(v)}" for o, ps in cand.params.items() if o in names for p, v in ps.items()]
    words += [f"run.world_size={world}", "run.dry_run=true"]
    command = " ".join(shlex.quote(w) for w in words)
    if start.overlay_dirs:
        dirs = os.pathsep.join(os.path.abspath(d) for d in start.overlay_dirs)
        command = f"MBMEM_OVERLAY_DIRS={shlex.quote(dirs)} {command}"
    return command


# ----------------------------------------------------------------------------- the per-overlay plan
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
               catalog: Any = None, arch: int = 9, env: dict[str, str] | None = None) -> P.Plan:
    """Baseline, then one step per overlay (in ladder order), each validated by the engine; ``arch`` and ``env``:
    the GPUs' compute capability and the job's environment, as from_config reads them. A job given with its own
    environment (``env``: a Megatron-LM job's exported variables, its YAML's ENV_VARS) is also the environment the
    overlay rules check; without one, this process's (launch_env)."""
    catalog = catalog or Catalog()
    names = sorted({catalog.resolve(n).name for n in overlays},
                   key=lambda n: LADDER.index(n) if n in LADDER else len(LADDER))
    rules_env = launch_env() if env is None else dict(env)
    apply_overlay(copy.deepcopy(cfg), names, env=rules_env, params=params, world_size=world, locked=locked,
                  catalog=catalog)  # all at once
    from . import cost as K
    # Each step is planned as Bridge's setup will run it (bridge/as_run.py): set up once, read by every reader below
    run = as_run(cfg, world, env)
    inputs = [P.from_config(run.config, world, arch=arch, env=env)]   # each step's (shape, layout, settings)
    steps = [P.Step("baseline", P.estimate(*inputs[0]))]
    previous = (*inputs[0], K.cost_inputs(cfg))   # the cost model's job before each step (cost/inputs.py reads the
    # user's comm_overlap and the DDP fields before Bridge's CommOverlapConfig.setup, as it models that setup itself)
    applied: list[str] = []
    for name in names:
        applied.append(name)
        work = copy.deepcopy(cfg)
        apply_overlay(work, applied, env=rules_env, params={k: v for k, v in (params or {}).items()
                                                     if k.split(".")[0] in applied or k in applied}, world_size=world,
                      locked=locked, catalog=catalog)
        run = as_run(work, world, env)
        shape, lay, st = P.from_config(run.config, world, arch=arch, env=env)
        inputs.append((shape, lay, st))
        b = P.estimate(shape, lay, st)
        note = P.STEP_NOTES.get(name) or step_note(name, shape, lay, st, steps[-1].breakdown.total - b.total)
        job = (shape, lay, st, K.cost_inputs(work))
        steps.append(P.Step(name, b, note, K.price(previous, job, arch).as_dict()))
        previous = job
    shape, lay, st = inputs[-1]
    setup = tuple(f"Bridge's setup of this config: {n}" for n in run.refused)
    return P.Plan(recipe, world, lay, tuple(steps), capacity, margin, bridge_estimate(run.config, world),
                  # the table's, what answered for the host at the recipe's build, what Bridge's setup refused
                  assumptions=ASSUMPTIONS + build_notes(cfg) + setup,
                  ranges=uncertainty(shape, lay, st, steps[-1].breakdown), memory_lines=P.memory_lines(shape, lay, st),
                  not_modelled=not_modelled(run.config), applicable=applying(inputs))


def layout_text(lay: P.Layout) -> str:
    return (f"TP{lay.tp} PP{lay.pp}" + (f" VPP{lay.vpp}" if lay.vpp > 1 else "") + f" CP{lay.cp} DP{lay.dp}"
            + (f" EP{lay.ep}" if lay.ep > 1 else ""))


FIT_MARK = {P.FITS: "yes", P.DOES_NOT_FIT: "NO", P.UNKNOWN: "?", P.NO_CAPACITY: "-"}


def render_plan(plan: P.Plan, verbose: bool = False) -> str:
    """The plan as the user reads it: the table, the verdict, the peak's location, what is not modelled and where
    the plan is unsure, the memory lines to expect, and the assumptions that change this job's figure in one line
    each. ``verbose`` (--assumptions, -v): also Bridge's own estimate and every assumption in full."""
    lay = plan.layout
    lines = [f"memory plan: {plan.recipe}, world size {plan.world}: {layout_text(lay)}"
             f", SP {'on' if lay.sp else 'off'}, seq {lay.seq}, "
             f"MBS {lay.mbs}, GBS {lay.gbs} ({lay.microbatches} microbatches)",
             "most-loaded GPU, GiB:",
             f"  {'step':<22}{'params':>8}{'grads':>8}{'optim':>8}{'activ':>8}{'other':>8}{'total':>9}{'delta':>8}  fits"]
    prev = None
    verdict = plan.judge()
    for s in plan.steps:
        b = s.breakdown
        delta = "" if prev is None else f"{(b.total - prev.breakdown.total) / 2**30:+8.2f}"
        fits = FIT_MARK[verdict.kind if s is plan.steps[-1] else plan.judge(s).kind]
        if s is plan.steps[-1] and verdict.clauses and verdict.kind == P.FITS:
            fits += "*"
        lines.append(f"  {('+ ' if prev else '') + s.name:<22}{gib(b.parameters):>8}{gib(b.gradients):>8}"
                     f"{gib(b.optimizer):>8}{gib(b.activations):>8}{gib(b.other):>8}{gib(b.total):>9}{delta:>8}  {fits}"
                     + (f"   ({s.note})" if s.note else ""))
        prev = s
    priced = [s for s in plan.steps if s.cost]
    if priced:
        lines.append("what each step costs the job's step time (cost model, docs/cost-model.md):")
        lines += [f"  + {s.name:<20} {s.cost['text']}" for s in priced]
    last = plan.steps[-1].breakdown
    lines.append(f"peak of the last step: pipeline rank {last.rank}, {last.phase}"
                 + "".join(f"; {name} {value / 2**30:.2f} GiB" for name, value in last.detail if value))
    if last.resident > last.total:
        lines.append(f"with CUDA graphs the steady state holds {last.resident / 2**30:.2f} GiB (allocated tensors "
                     "plus the graphs' pool); whether it fits is judged on that")
    if plan.capacity:
        lines.append(f"capacity {plan.capacity / 2**30:.1f} GiB with a {plan.margin:.0%} margin -> "
                     + ("* " if verdict.clauses and verdict.kind == P.FITS else "") + verdict.text)
    if plan.not_modelled:
        lines.append("not modelled (set in the configuration, not followed by the plan):")
        lines += [f"  - {n} ({g.how()})" for n, g in zip(plan.not_modelled, plan.gaps())]
    lines += render_ranges(plan.ranges)
    lines += render_memory_lines(plan)
    if verbose and plan.bridge_estimate:
        lines.append(f"Bridge's estimate_training_memory for the final config: {plan.bridge_estimate / 2**30:.2f} GiB "
                     "(ignores recompute, offload, SP, LoRA and precision)")
    lines += render_assumptions(plan, verbose)
    return "\n".join(lines)


def render_assumptions(plan: P.Plan, verbose: bool = False) -> list[str]:
    """The assumptions that change this job's figure, one line each (a table entry's summary; the job's own in
    full); ``verbose``: every assumption in full, those that apply here marked."""
    table = [a for a in plan.assumptions if a in BY_TEXT]
    if verbose:
        out = [f"assumptions (all {len(plan.assumptions)}, in full; * changes this job's figure, - does not apply "
               "here):"]
        return out + [f"  {'*' if plan.applies(a) else '-'} {a}" for a in plan.assumptions]
    shown = [a for a in plan.assumptions if plan.applies(a)]
    out = [f"assumptions that change this figure ({len([a for a in table if plan.applies(a)])} of "
           f"{len(table)}; all in full, with their sources: --assumptions):"]
    return out + [f"  - {BY_TEXT[a].summary if a in BY_TEXT else a}" for a in shown]


def render_memory_lines(plan: P.Plan) -> list[str]:
    """What the job's own memory lines will show (GB = 10^9 bytes, as Bridge prints them), for `mbmem doctor`."""
    if not plan.memory_lines:
        return []
    parts = []
    for iteration, per_rank in plan.memory_lines:
        hot = max(range(len(per_rank)), key=per_rank.__getitem__)
        if len(per_rank) == 1:
            spread = ""
        elif len(per_rank) <= 8:   # each stage, as `mbmem doctor --plan` lists them
            spread = " (pipeline ranks " + ", ".join(f"{v / 1e9:.2f}" for v in per_rank) + ")"
        else:
            spread = f" (pipeline ranks {min(per_rank) / 1e9:.2f} .. {per_rank[hot] / 1e9:.2f})"
        parts.append(f"after iteration {iteration} {per_rank[hot] / 1e9:.2f} GB on pipeline rank {hot}{spread}")
    return ["memory lines to expect in the job's log (mem-max-allocated, GB = 10^9 bytes; `mbmem doctor --plan` "
            "compares them): " + "; ".join(parts)]


def render_ranges(ranges) -> list[str]:
    """One line per uncertainty range: the component, the most-loaded GPU's footprint at both ends, why."""
    if not ranges:
        return []
    out = ["uncertain (the plan's own assumptions; most-loaded GPU at each end):"]
    for r in ranges:
        high = f"{r.high / 2**30:.2f} GiB" if r.high is not None else \
            f"+{r.per_unit * 1000 / 2**30:.3f} GiB per 1,000 {r.unit}s"
        out.append(f"  - {r.component}: {r.low / 2**30:.2f} GiB .. {high}: {r.reason}")
    return out


# ----------------------------------------------------------------------------- the plot
# One colour and one hatch per component, so the stack reads in greyscale too (matplotlib's tab10 colours).
COMPONENTS = (("parameters", "#1f77b4", ""), ("gradients", "#ff7f0e", "//"), ("optimizer", "#2ca02c", "\\\\"),
              ("activations", "#d62728", ".."), ("other", "#9467bd", "xx"))
PLOT_SUFFIXES = (".png", ".pdf", ".svg")


def draw_bars(rows: list[tuple[str, P.Breakdown]], *, title: str, capacity: float | None, margin: float):
    """Horizontal stacked bars, one per row: names on the y axis (long ones wrapped, so they never overlap),
    each bar's total and verdict at its end, the capacity and the margin line in the legend. Returns the figure."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    n = len(rows)
    limit = capacity * (1 - margin) if capacity else None
    totals = [b.footprint / 2**30 for _, b in rows]
    right = max(totals + [capacity / 2**30 if capacity else 0.0]) * 1.3
    # "outside lower center" keeps the legend below the axes at any row count (constrained layout)
    fig, ax = plt.subplots(figsize=(10, 1.9 + 0.62 * n), layout="constrained")
    ys = list(range(n))[::-1]  # the first row on top
    left = [0.0] * n
    for part, color, hatch in COMPONENTS:
        vals = [getattr(b, part) / 2**30 for _, b in rows]
        ax.barh(ys, vals, left=left, height=0.6, color=color, hatch=hatch, edgecolor="white", linewidth=0.6,
                label=part)
        for y, x0, v in zip(ys, left, vals):
            if v >= 0.06 * right:  # a value label only where the segment is wide enough to hold it
                ax.text(x0 + v / 2, y, f"{v:.1f}", ha="center", va="center", fontsize=8, color="white",
                        fontweight="bold", zorder=4, bbox={"facecolor": color, "edgecolor": "none", "pad": 2.0})
        left = [a + b for a, b in zip(left, vals)]
    if capacity:
        ax.axvline(capacity / 2**30, color="black", linestyle="--", linewidth=1.2, zorder=1,
                   label=f"GPU capacity {capacity / 2**30:.1f} GiB")
        ax.axvline(limit / 2**30, color="grey", linestyle=":", linewidth=1.2, zorder=1,
                   label=f"fit limit {limit / 2**30:.1f} GiB ({margin:.0%} margin)")
    for y, (_, b), total in zip(ys, rows, totals):
        if b.resident > b.total:  # CUDA graphs: the pool the allocator keeps beside the tensors
            ax.barh(y, (b.resident - b.total) / 2**30, left=b.total / 2**30, height=0.6, fill=False,
                    edgecolor="grey", linestyle="--", label="_graph pool")
        verdict = "" if limit is None else ("  fits" if b.footprint <= limit else "  does not fit")
        color = "black" if limit is None else ("#1a7f37" if b.footprint <= limit else "#b3261e")
        # a white box, so the capacity lines never run through the text
        ax.text(total + right * 0.012, y, f"{total:.1f} GiB{verdict}", va="center", ha="left", fontsize=9,
                color=color, zorder=3, bbox={"facecolor": "white", "edgecolor": "none", "pad": 1.5})
    ax.set_yticks(ys, [textwrap.fill(name, 34) for name, _ in rows], fontsize=9)
    ax.set_xlim(0, right)
    ax.set_ylim(-0.6, n - 0.4)
    ax.set_xlabel("GiB on the most-loaded GPU (memory model)")
    ax.set_title(textwrap.fill(title, 90), fontsize=10)
    fig.legend(fontsize=8, loc="outside lower center", ncol=4, frameon=False)
    return fig


def plan_figure(plan: P.Plan):
    """The plan's steps as bars (``draw_bars``): baseline, then each overlay. Returns the figure."""
    rows = [(("+ " if i else "") + s.name, s.breakdown) for i, s in enumerate(plan.steps)]
    return draw_bars(rows, title=f"{plan.recipe}: {layout_text(plan.layout)}, world size {plan.world}",
                     capacity=plan.capacity, margin=plan.margin)
