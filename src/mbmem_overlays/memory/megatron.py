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

from ..bridge.megatron_args import (DEFAULT_ARCH, JobChange, MegatronArgsError, MegatronJob, argv_segments, change_job,
                                    changed_config, megatron_parser)
from . import model as P
from .costs import COSTS, full_recompute_cost, optimizer_offload_cost
from .ladder import Wording
from .ladder import render_recommendation as ladder_text
from .search import render_search as search_text
from .steps import Candidate, Rejected, Start, realize, settings, toggles

VALIDATION = "our rules + megatron-core 0.19.2's validate_args on the job's flags"
ENV_FIELD = "env_vars."   # Bridge's cfg.env_vars, exported at launch: for a Megatron-LM job, the environment


@dataclass(frozen=True)
class _Refusal:
    """What steps.explain_rejection reads of a refusal: the cause (here the whole reason, which names the flags or
    the field) and who refused it."""
    field: str
    check: str = "megatron-core"


# megatron-core's OptimizerConfig imports TE's FusedAdam for --use-precision-aware-optimizer and refuses to start
# without it (optimizer_config.py:446-467). A job that runs --transformer-impl local says nothing of TE being on its
# nodes (Megatron-LM's default implementation before TE), so that remedy is not offered to it unasked.
TE_LESS_JOB = ("the precision-aware optimizer needs Transformer Engine's FusedAdam (megatron-core refuses to start "
               "without it), and this job runs --transformer-impl local, without Transformer Engine")


class MegatronTarget:
    """A Megatron-LM job as the ladder's and the search's ``target``: candidates realized on ``job.config`` with the
    job's environment, their changes turned into the job's flags and validated (``change``), the result kept on the
    engine's report (``report.megatron``) for ``command`` and ``extra``."""

    def __init__(self, job: MegatronJob, *, arch: int | None = None, vocab: int | None = None):
        self.job = job
        self.arch = arch or DEFAULT_ARCH
        self.vocab = vocab or job.vocab   # the vocabulary the job was loaded with (the log's, --tokenizer-vocab)
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
        if ("precision_aware_optimizer" in cand.overlays and "precision_aware_optimizer" not in start.overlays
                and str(getattr(self.job.config.model, "transformer_impl", "")) == "local"):
            raise Rejected(TE_LESS_JOB, _Refusal(TE_LESS_JOB))
        work, report = realize(cfg, start, cand, world, catalog=catalog, validate=False, env=self.env)
        change = self.change(report, cand)
        if not change.ok:
            raise Rejected(change.reason, _Refusal(change.reason))
        report.megatron = change
        if change.empty:
            return work, report
        # planned as the printed flags train (bridge/megatron_args.py changed_config): the validated arguments,
        # with what Megatron-LM requires beside the change, rebuilt into the job's configuration
        try:
            return changed_config(self.job, change, self.vocab, self.arch), report
        except MegatronArgsError as exc:
            raise Rejected(f"megatron-core cannot build the changed job: {exc.message}",
                           _Refusal(exc.message)) from None

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
def _flag_lines(r: dict[str, Any], verbose: bool) -> list[str]:
    """A ladder step's own line: the flags it adds (the baseline's, the --overlay flags, unless they change nothing)."""
    flags = r.get("megatron_flags") or {}
    if r["step"] != "baseline" or not str(flags.get("text", "")).startswith("no change"):
        return [f"      flags: {flags.get('text')}"]
    return []


WORDING = Wording(checked=lambda rec: f"the job's flags; checked: {(rec.get('megatron') or {}).get('check')}",
                  path="each step checked by our rules, its flags by megatron-core 0.19.2's validate_args",
                  step_lines=_flag_lines)


def render_recommendation(rec: dict[str, Any], verbose: bool = False) -> str:
    """The ladder on a Megatron-LM job, the answer first (ladder.render_recommendation in the job's words): the job's
    whole change, validated, and the fit verdict where it is not a plain "fits"; then each step with its saving, its
    cost and the flags it adds."""
    return ladder_text(rec, verbose, WORDING)


def render_search(found: dict[str, Any], capacity: float, margin: float) -> str:
    """The search on a Megatron-LM job (search.render_search in the job's words)."""
    return search_text(found, capacity, margin, retry="`mbmem recommend --megatron-args`", each=", each as the job's "
                       "flags", checked_with="our rules and their Megatron-LM flags with megatron-core 0.19.2's "
                       "validate_args")
