"""A Megatron-LM job's memory steps in its own flags: the ladder's rungs, the search's layouts and the doctor's
remedies, realized on the job's Bridge-shaped configuration (bridge/megatron_args.py ``load_job``) through the same
engine and planned by the same model as a recipe's, then written back as Megatron-LM flags and environment
(``overlay_flags``) and parsed and validated by megatron-core's own parser and ``validate_args``
(``change_job``) before anything is printed. There is no second ladder: :class:`MegatronTarget` is what
``ladder.recommend`` and ``search.search_validated`` take as ``target``.

A step whose flags megatron-core refuses, that validate_args sets back, or that needs a field Megatron-LM has no
flag for ("no Megatron-LM flag for model.x=...") is refused like a step our rules refuse: the ladder takes the
next option or skips the rung with that reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..bridge.megatron_args import DEFAULT_ARCH, JobChange, MegatronJob, argv_segments, change_job, megatron_parser
from . import model as P
from .costs import COSTS, full_recompute_cost, optimizer_offload_cost
from .steps import Candidate, Rejected, Start, realize, settings, toggles

VALIDATION = "our rules + megatron-core 0.19.2's validate_args on the job's flags"
ENV_FIELD = "env_vars."   # Bridge's cfg.env_vars, exported at launch: for a Megatron-LM job, the environment


@dataclass(frozen=True)
class _Refusal:
    """What steps.explain_rejection reads of a refusal: the cause (here the whole reason, which names the flags or
    the field) and who refused it."""
    field: str
    check: str = "megatron-core"


class MegatronTarget:
    """A Megatron-LM job as the ladder's and the search's ``target``: candidates realized on ``job.config`` with the
    job's environment, their changes turned into the job's flags and validated (``change``), the result kept on the
    engine's report (``report.megatron``) for ``command`` and ``extra``."""

    def __init__(self, job: MegatronJob, *, arch: int | None = None, vocab: int | None = None):
        self.job = job
        self.arch = arch or DEFAULT_ARCH
        self.vocab = vocab
        self.env = dict(job.env)

    @property
    def label(self) -> str:
        return f"Megatron-LM {self.job.form}"

    def start(self, overlays: tuple[str, ...] = (), params: dict | None = None) -> Start:
        """The job as the user's start: nothing locked (every setting is the job's, and a step shows what it
        changes), the overlays given with --overlay kept by every step."""
        return Start(self.label, overlays=tuple(overlays), params=dict(params or {}))

    def changes(self, report: Any, cand: Candidate) -> list[tuple[str, Any]]:
        """[(field or $VAR, new value)] a realized candidate changes on the job (its values, its environment)."""
        out: dict[str, Any] = {}
        for target, _, new in toggles(self.job.config, {}, settings(report, cand)):
            if target.startswith(ENV_FIELD):   # the engine writes an overlay's variables to cfg.env_vars too
                target = "$" + target[len(ENV_FIELD):]
            if target.startswith("$") and self.env.get(target[1:]) == new:
                continue
            out[target] = new
        return list(out.items())

    def change(self, report: Any, cand: Candidate) -> JobChange:
        return change_job(self.job, self.changes(report, cand), arch=self.arch, vocab=self.vocab)

    def env_change(self, env: dict[str, str]) -> JobChange:
        """An environment-only change (the doctor's allocator remedies), validated as the job's arguments with it."""
        return change_job(self.job, [(f"${k}", v) for k, v in env.items()], arch=self.arch, vocab=self.vocab)

    def realize(self, cfg: Any, start: Start, cand: Candidate, world: int, *, catalog: Any,
                validate: bool = True) -> tuple[Any, Any]:
        """steps.realize with the job's environment and our rules (Bridge's validation is not the job's: it runs
        with Megatron-LM, whose validate_args checks the flags), then the flags; raises Rejected."""
        del validate
        work, report = realize(cfg, start, cand, world, catalog=catalog, validate=False, env=self.env)
        change = self.change(report, cand)
        if not change.ok:
            raise Rejected(change.reason, _Refusal(change.reason))
        report.megatron = change
        return work, report

    def verdict(self, report: Any) -> str:
        return VALIDATION

    def command(self, start: Start, cand: Candidate, world: int, report: Any) -> str:
        return report.megatron.text()

    def extra(self, report: Any) -> dict[str, Any]:
        return {"megatron": report.megatron}

    def breakdown(self, cfg: Any, world: int | None = None) -> P.Breakdown:
        """The memory model's most-loaded GPU for a realized config, on the job's GPUs and environment."""
        return P.estimate(*P.from_config(cfg, world or self.job.world_size, arch=self.arch, env=self.env))

    def footprint(self, cfg: Any) -> float:
        return self.breakdown(cfg).footprint


def step_delta(before: JobChange | None, after: JobChange) -> JobChange:
    """What one step adds to the previous one's flags (both cumulative on the job): the flags whose words differ,
    the flags it drops, the environment it changes."""
    parser = megatron_parser()
    old = _by_dest(before.argv if before else (), parser)
    new = _by_dest(after.argv, parser)
    add, change, remove = [], [], []
    for dest, words in new.items():
        if dest not in old:
            add += words
        elif old[dest] != words:
            change.append((words[0].split("=", 1)[0], " ".join(old[dest][1:]), " ".join(words[1:])))
    remove = [words[0].split("=", 1)[0] for dest, words in old.items() if dest not in new]
    env_before = dict(before.env) if before else {}
    env = {k: v for k, v in after.env.items() if env_before.get(k) != v}
    return JobChange(tuple(add), tuple(change), tuple(remove), env, after.argv, after.ok, after.reason, after.check)


def _by_dest(argv, parser) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for dest, words in argv_segments(argv, parser):
        if dest is not None:
            out[dest] = words
    return out


def documented_cost(cand: Candidate, per_stage: int) -> str | None:
    """The throughput cost of the overlays a candidate adds, in the words the ladder's rungs give them
    (memory/costs.py: the same sources), None for a candidate of Bridge fields only."""
    texts = []
    for name in cand.overlays:
        params = cand.params.get(name, {})
        if name == "full_recompute":
            texts.append(full_recompute_cost(str(params.get("method", "uniform")), int(params.get("num_layers", 1) or 1),
                                             per_stage))
        elif name == "optimizer_offload":
            texts.append(optimizer_offload_cost(float(params.get("fraction", 1.0))))
        elif name == "selective_recompute" and set(params.get("modules") or ()) & {"mlp", "moe"}:
            wide = "moe" if "moe" in params["modules"] else "mlp"
            texts.append(COSTS[f"selective_recompute_{wide}"][1])
        elif name in COSTS:
            texts.append(COSTS[name][1])
    return "; ".join(texts) or None


def recommend_job(target: MegatronTarget, capacity: float, margin: float, *, catalog: Any,
                  overlays: tuple[str, ...] = (), params: dict | None = None) -> dict[str, Any]:
    """ladder.recommend on the job's own configuration, every step's flags validated; each accepted step gets the
    flags it adds (``megatron_flags``), the result the job's whole change (``megatron``)."""
    from .ladder import recommend
    rec = recommend(target.job.config, target.job.world_size, capacity, margin, start=target.start(overlays, params),
                    catalog=catalog, validate=False, target=target)
    before = None
    for row in rec["steps"]:
        change = row.pop("megatron", None)
        if change is None:
            continue
        # the baseline's own change is the --overlay flags on the job; each later step, what it adds to the last
        row["megatron_flags"] = (change if before is None else step_delta(before, change)).as_dict()
        before = change
    final = rec.pop("megatron", None)
    rec["megatron"] = final.as_dict() if final is not None else None
    return rec


def search_job(target: MegatronTarget, capacity: float, margin: float, top: int, *, catalog: Any,
               overlays: tuple[str, ...] = (), params: dict | None = None) -> dict[str, Any]:
    """search.search_validated on the job's own configuration, each result's flags validated (``megatron``)."""
    from .search import search_validated
    found = search_validated(target.job.config, target.start(overlays, params), target.job.world_size, capacity,
                             margin, top, catalog=catalog, validate=False, target=target)
    for r in found["results"]:
        r["megatron"] = r["megatron"].as_dict()
    return found


# ----------------------------------------------------------------------------- text
def _gib(b: float) -> str:
    return f"{b / 2**30:6.2f} GiB"


def render_recommendation(rec: dict[str, Any], verbose: bool = False) -> str:
    """The ladder on a Megatron-LM job, the answer first (as ladder.render_recommendation): the job's whole change,
    validated, and the fit verdict where it is not a plain "fits"; then each step with its saving, its cost and the
    flags it adds; the rungs that cannot apply with their reason (a field without a Megatron-LM flag among the
    rejected ones, always shown), the others folded unless ``verbose``."""
    if rec.get("error"):
        return rec["error"]
    text = rec.get("verdict_text", rec.get("fit_verdict"))
    unknown = rec.get("fit") == "unknown"
    final = rec.get("megatron") or {}
    if unknown:
        names = ", ".join(f"{g['name']}={g['value']}" for g in rec.get("unmodelled", []))
        head = f"next command, fit unknown ({names} not modelled"
    else:
        head = "next command" if rec["fits"] else "nothing on the ladder fits; closest"
    lines = [f"{head} (the job's flags; checked: {final.get('check')}):", f"  {rec['command']}"]
    if text and text not in ("fits", "-") and (rec["fits"] or unknown or rec.get("unmodelled")):
        lines.append(f"verdict: {text}")
    lines.append(f"the path (memory-tuning skill, Quick Decision), capacity {rec['capacity_bytes'] / 2**30:.1f} GiB "
                 f"with a {rec['margin']:.0%} margin; each step checked by our rules, its flags by megatron-core "
                 "0.19.2's validate_args:")
    nothing, folded = [], []
    for r in rec["steps"]:
        if "skipped" in r:
            if r.get("kind") == "saves nothing here":
                nothing.append(f"{r['step']} ({r['skipped']})")
            elif verbose or r.get("kind") == "rejected":
                lines.append(f"  - {r['step']:<34} skipped: {r['skipped']}")
            else:
                folded.append(r["step"])
            continue
        saving = ""
        if "saving_bytes" in r:
            saving = (f"  saves {r['saving_bytes'] / 2**30:5.2f} GiB" if r["saving_bytes"] or
                      r["step"] != "expandable_segments" else "  saves fragmentation (outside the plan)")
        mark, fits = {True: ("*", "  FITS"), False: (" ", "")}.get(r["fits"], ("?", "  fit unknown" + (
            " (the modelled part fits)" if r.get("modelled_fits") else "")))
        lines.append(f"  {mark} {r['step']:<34} {_gib(r['total_bytes'])}{saving}{fits}")
        flags = r.get("megatron_flags") or {}
        if r["step"] != "baseline" or not str(flags.get("text", "")).startswith("no change"):
            lines.append(f"      flags: {flags.get('text')}")
        if r.get("cost"):
            lines.append(f"      cost: {r['cost']}")
    if nothing:
        lines.append("  skipped: saves nothing here: " + "; ".join(nothing))
    if folded:
        lines.append(f"  skipped, not applicable here: {', '.join(folded)} (-v: why each)")
    return "\n".join(lines)


def layout_name(r: dict[str, Any]) -> str:
    layout = f"TP{r['tp']} PP{r['pp']}" + (f" VPP{r['vpp']}" if r["vpp"] > 1 else "") + f" CP{r['cp']} DP{r['dp']}"
    return f"{layout}{' SP' if r['sp'] else ''} [{', '.join(r['overlays']) or 'no overlays'}]"


def render_search(found: dict[str, Any], capacity: float, margin: float) -> str:
    """The search on a Megatron-LM job (as cli/plan.py render_search): each validated layout with its saving, its
    cost, its verdict where it is not a plain "fits", and the job's flags."""
    results = found["results"]
    lines = [f"searched {found['evaluated']} layouts x overlay sets in {found['seconds']:.1f} s: {found['candidates']} "
             f"fit {capacity / 2**30:.1f} GiB with a {margin:.0%} margin in the memory model; checked the cheapest "
             f"{found['checked']} with our rules and their Megatron-LM flags with megatron-core 0.19.2's validate_args"]
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
                     + "; try `mbmem recommend --megatron-args` (offload, full recompute) or more GPUs")
        return "\n".join(lines)
    lines.append(f"{len(results)} validated, cheapest first (cost: documented throughput cost, costs.py), each as the "
                 "job's flags:")
    for r in results:
        saving = r.get("saving_bytes")
        saves = "" if saving is None else f"  saves {saving / 2**30:5.1f} GiB"
        lines.append(f"  {r['total_bytes'] / 2**30:6.1f} GiB{saves}  cost ~{r['cost']:.0%}  {layout_name(r)}")
        if r.get("fits_unless") or r.get("fit", "fits") != "fits":
            lines.append(f"    {r.get('verdict_text', r.get('fit_verdict'))}")
        lines.append(f"    {r['command']}")
    return "\n".join(lines)
