"""``mbmem doctor --plan`` on a run's memory lines: the plan against measured, per reporting rank, and each
change of the advice (both directions) realized, validated and sized on the hot rank.

Imports Megatron Bridge (the recipe is built); the default doctor never imports this module.

The configuration is rebuilt from what the log shows, as train.py would build it: the recipe (``--recipe``
or the launch command's), the launch command's overrides and ``--set``, the sizes and settings the log
prints (Megatron-LM's arguments dump, Bridge's configuration summary, ``TP=4``-style lines) where they
differ from the recipe and no overlay of the command sets them, then the command's overlays through the
engine and Bridge's own validation (memory/steps.py ``realize``). Whatever cannot be rebuilt is said.

The memory model gives the peak of every pipeline stage (``stage_breakdowns``, the per-rank form of
memory/model.py ``estimate``). A change's predicted peak on a stage is the *measured* peak plus the plan's
change on that stage: the model's own bias cancels, and the measured fragmentation stays counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..core.values import ascii_int
from . import command as C

GiB = 1 << 30
DEFAULT_ARCH = 9   # compute capability of the GPUs planned when --gpu-arch is not given: H100/H200
SKIP_OVERRIDE_PREFIXES = ("recipe", "run.", "hydra", "mem.", "+")

# What the log prints (parse.py CONFIG_KEYS / layout) -> the Bridge field it is (bridge-config-surface.md §1).
LAYOUT_PATHS = {"tp": ("model.tensor_model_parallel_size",), "pp": ("model.pipeline_model_parallel_size",),
                "vpp": ("model.virtual_pipeline_model_parallel_size",), "cp": ("model.context_parallel_size",),
                "ep": ("model.expert_model_parallel_size",)}
CONFIG_PATHS = {
    "micro_batch_size": ("train.micro_batch_size",), "global_batch_size": ("train.global_batch_size",),
    "seq_length": ("model.seq_length", "dataset.seq_length"), "sequence_parallel": ("model.sequence_parallel",),
    "recompute_granularity": ("model.recompute_granularity",), "recompute_method": ("model.recompute_method",),
    "recompute_num_layers": ("model.recompute_num_layers",),
    "use_distributed_optimizer": ("ddp.use_distributed_optimizer", "optimizer.use_distributed_optimizer"),
    "optimizer_cpu_offload": ("optimizer.optimizer_cpu_offload",),
    "optimizer_offload_fraction": ("optimizer.optimizer_offload_fraction",),
    "cpu_offloading": ("model.cpu_offloading",), "cpu_offloading_num_layers": ("model.cpu_offloading_num_layers",),
}
PLAN_ASSUMPTIONS = (
    "per stage: memory/model.py's terms for each pipeline rank, as its estimate() computes the most loaded one",
    "the plan models allocated memory (max allocated); a change's predicted peak adds the plan's change on that "
    "stage to the measured max reserved, so the measured fragmentation stays counted",
    "each rank's line is compared with the plan of the phases run by its iteration (torch's max allocated only "
    "grows): up to cuda_graph_warmup_steps the eager warm-up and its step, after iteration 1 without the Adam "
    "moments in the forward; the stages' planned peaks are the training peak after capture",
)


def stage_breakdowns(shape, lay, st) -> list:
    """The memory model's peak on every pipeline rank: memory/model.py ``stage_breakdowns`` where the installed
    model has it, else the same built here from its public per-rank terms (``estimate`` keeps only the
    largest)."""
    from ..memory import model as M
    own = getattr(M, "stage_breakdowns", None)
    if own is not None:
        return list(own(shape, lay, st))
    out = []
    for rank in range(lay.pp):
        first, last = rank == 0, rank == lay.pp - 1
        p, g, o = M.model_state(shape, lay, st, first=first, last=last)
        acts = M.stage_activations(shape, lay, st, rank)
        other = M.communication_buffers(shape, lay, st, rank, p)
        step = M.optimizer_step_buffers(shape, lay, st, first, last)
        phases = {"steady 1F1B": (acts.steady, other), "CUDA graph capture": (acts.capture, other),
                  "optimizer step": (0.0, other + step)}
        phase, (a, x) = max(phases.items(), key=lambda kv: sum(kv[1]))
        resident = p + g + o + other + acts.steady + acts.pool if acts.pool else 0.0
        out.append(M.Breakdown(p, g, o, a, x, acts.detail, rank, phase, resident))
    return out


def _log_value(text: str) -> Any:
    """A value printed in the log, only in the plain forms a config field can take (a log is untrusted text that
    reaches printed commands): small integers, booleans, None, simple names, fractions."""
    t = str(text).strip().strip("'\"")
    low = t.lower()
    if low in ("none", "null"):
        return None
    if low in ("true", "false"):
        return low == "true"
    if ascii_int(t, 7) is not None:
        return ascii_int(t, 7)
    if ascii_int(t.replace(".", "", 1), 7) is not None and len(t) <= 8:
        return float(t)
    if t.isidentifier() and t.isascii() and len(t) <= 24:
        return t
    raise ValueError(t)


@dataclasses.dataclass
class RunPlan:
    """The rebuilt configuration and its plan; ``price`` realizes and sizes changes on top of it."""
    cfg: Any                       # the recipe with the user's overrides, before any overlay (what realize takes)
    start: Any
    world: int
    catalog: Any
    base: list                     # Breakdown per stage
    capacity: int | None
    margin: float
    recipe: str
    hot_stage: int | None
    measured: dict                 # stage -> (measured peak used, measured max allocated, the plan of that line)
    arch: int = DEFAULT_ARCH       # the GPUs' compute capability and the job's environment, as from_config reads them
    env: dict | None = None
    base_job: Any = None           # the cost model's job of the configuration the log ran (memory/cost/ job_of)

    def price(self, remedies: list[C.Remedy], rep) -> list[dict]:
        return [self._price(r) for r in remedies]

    def _price(self, r: C.Remedy) -> dict:
        from ..memory import model as M
        got = self._realize(r)
        if isinstance(got, dict):
            return got
        work, out = got
        planned_work = M.from_config(work, self.world, arch=self.arch, env=self.env)
        stages = stage_breakdowns(*planned_work)
        if self.base_job is not None:   # the cost model's price of this change (memory/cost/)
            from ..memory import cost as K
            try:
                out["step_cost"] = K.price(self.base_job, (*planned_work, K.cost_inputs(work)), self.arch).as_dict()
            except (ValueError, TypeError, ArithmeticError, KeyError):   # unpriced, never raised
                pass
        if r.overlay == "expandable_segments":  # not modelled: it returns the reserved-but-unallocated gap
            hot = self.measured.get(self.hot_stage)
            out.update({"planned_hot_bytes": None, "predicted_peak_bytes": None if hot is None else int(hot[1]),
                        "fits": True})
            return out
        predicted = {}
        lines: dict = {}   # iteration -> the candidate's plan of a line printed after it, per stage
        for stage, (peak, _, seen) in self.measured.items():
            if stage is None or stage >= len(stages) or stage >= len(self.base):
                continue
            # the measured peak less the plan of what its line showed (the model's bias and the fragmentation),
            # plus the candidate's peak over the whole run: its training peak, or the same line if that is higher
            whole = stages[stage].footprint
            iteration, base_line = seen if seen is not None else (None, self.base[stage].footprint)
            if iteration is not None:
                if iteration not in lines:
                    lines[iteration] = M.reported_breakdowns(*planned_work, iteration)
                whole = max(whole, lines[iteration][stage].total)
            predicted[stage] = peak - base_line + whole
        hot = self.hot_stage if self.hot_stage in predicted else (max(predicted, key=predicted.get) if predicted else None)
        out["planned_hot_bytes"] = None if hot is None or hot >= len(stages) else int(stages[hot].footprint)
        out["predicted_peak_bytes"] = None if hot is None else int(predicted[hot])
        limit = None if self.capacity is None else self.capacity * (1 - self.margin)
        out["fits"] = None if limit is None or not predicted else all(v <= limit for v in predicted.values())
        # What the changed job sets that the plan does not model: the measured peak holds it, but how the change
        # moves it the plan cannot say, either way, so the fit is the one verdict's "unknown" (memory/plan.py judge)
        from ..memory.coverage import EITHER, gaps, not_modelled
        left_out = tuple(dataclasses.replace(g, moves=EITHER, bound=None) for g in gaps(not_modelled(work)))
        if left_out and predicted and limit is not None:
            worst = max(predicted.values())
            v = M.judge(worst, limit, (), left_out, basis="the measured peak plus the plan's change")
            out.update(fits=v.fits, fit=v.kind, fit_verdict=v.text, unmodelled=[g.as_dict() for g in left_out])
        return out

    def _realize(self, r: C.Remedy) -> dict | tuple:
        """(the realized config, {command, check, ...}) of a remedy on the recipe, or {check: why not}."""
        from ..core.errors import OverlayError
        from ..memory.steps import Rejected, realize, train_command
        if r.env or r.command or not (r.overlay or r.overrides or r.remove_overlays):
            return {"check": "an environment or non-training change: the memory model does not price it"}
        try:
            start, cand, dropped = self._change(r)
        except OverlayError as exc:
            return {"check": f"rejected: {exc}"}
        try:
            work, _ = realize(self.cfg, start, cand, self.world, catalog=self.catalog, validate=True)
        except Rejected as exc:
            return {"check": f"rejected by our rules or Bridge's validation: {exc.reason}"}
        command = train_command(start, cand, self.world)
        check = (f"validated (our rules and Bridge's validation) on recipe {self.recipe} at world size {self.world}; "
                 "a dry run: pasting it validates again (drop run.dry_run=true to train)")
        if dropped:
            check += f"; replaces your {', '.join(dropped)}"
        return work, {"train_command": command, "check": check, "command": command}

    def _change(self, r: C.Remedy):
        """(Start, Candidate, the user's words it replaces) for a remedy: removed overlays leave the start, the
        remedy's overrides replace the user's own word for the same field (a turn-off changes what they chose)."""
        from ..memory.steps import Candidate
        start = self.start
        drop = {self.catalog.aliases.get(o, o) for o in r.remove_overlays}
        overlays = tuple(o for o in start.overlays if o not in drop)
        params = {k: v for k, v in start.params.items() if k in overlays}
        fields = set(r.overrides)
        if r.overlay:
            fields |= set(self.catalog.resolve(r.overlay).set)
        replaced = sorted(p for p in fields if p in start.locked)
        words = tuple(w for w in start.words if w.partition("=")[0].lstrip("+") not in replaced)
        locked = {k: v for k, v in start.locked.items() if k not in replaced}
        start = dataclasses.replace(start, words=words, overlays=overlays, params=params, locked=locked)
        cand = Candidate().plus(r.overlay, params=dict(r.params) or None, sets=dict(r.overrides))
        return start, cand, replaced


@dataclasses.dataclass
class MegatronRunPlan(RunPlan):
    """A Megatron-LM job's run plan: each change realized on the job's configuration and written as the job's own
    flags, validated by megatron-core (memory/megatron.py MegatronTarget); no train.py command."""
    target: Any = None
    prefix: tuple = ()            # the launch command's words up to the script, when the log shows them

    def _realize(self, r: C.Remedy) -> dict | tuple:
        from ..memory.steps import Candidate, Rejected
        if r.command:
            return {"check": "not a change of the job's arguments"}
        if r.env and not (r.overlay or r.overrides):
            change = self.target.env_change(r.env)
            work = None
        elif r.overlay or r.overrides:
            params = {k: C._typed(v) for k, v in r.params.items()}
            cand = Candidate().plus(r.overlay, params=params or None, sets=dict(r.overrides))
            try:
                work, report = self.target.realize(self.cfg, self.start, cand, self.world, catalog=self.catalog)
            except Rejected as exc:
                return {"check": f"not possible for this job: {exc.reason}",
                        "megatron": {"ok": False, "reason": exc.reason, "text": None}}
            change = report.megatron
        else:
            return {"check": "nothing to change in the job's arguments"}
        if not change.ok or change.empty:
            reason = change.reason or "already in effect in the job's arguments"
            return {"check": f"not possible for this job: {reason}", "megatron": {**change.as_dict(), "ok": False,
                                                                                   "reason": reason}}
        command = (change.command(self.prefix) if self.prefix and not any("$" in w for w in change.argv)
                   else change.text())
        out = {"command": command, "check": change.check, "megatron": change.as_dict()}
        if work is None and r.name in ("expandable_segments", "max_split_size_mb"):
            # as RunPlan._price for the overlay: the allocator setting returns the reserved-but-unallocated gap,
            # outside the allocated-memory plan; the measured max allocated stays
            hot = self.measured.get(self.hot_stage)
            out.update(planned_hot_bytes=None, predicted_peak_bytes=None if hot is None else int(hot[1]), fits=True)
        return out if work is None else (work, out)


def make_run_planner(recipe: str | None, sets: list[str], world_size: int | None, overlay_dirs: list[str] | None,
                     margin: float, logs: list[str] | None = None, arch: int | None = None,
                     megatron: tuple | None = None) -> Callable:
    """``arch``: the GPUs' compute capability (--gpu-arch; None: the GPU the recipe is named for, else DEFAULT_ARCH,
    H100/H200; the plan says which: bridge/recipes.py gpu_arch_for). ``megatron``: (the Megatron-LM job the logs'
    arguments give, or None; why not), doctor/megatron_plan.py ``find_job``; without it, the first log's arguments
    dump is read here."""
    def planner(rep, ctx, f) -> RunPlan | None:
        name = recipe or f.recipe
        missing = []
        shown = ctx.world or _world_from_layout(f)
        world = world_size or shown   # --world-size wins, like --recipe and --gpu-memory
        if not name:
            found, why = megatron if megatron is not None else _dump_job(logs or [], world_size, arch, f)
            if found is not None:   # a Megatron-LM job: its own arguments are its configuration
                try:
                    return _plan_megatron(rep, found, world_size, margin, arch)
                except (Exception, SystemExit) as exc:  # noqa: BLE001 — any failure to plan is reported, never raised
                    # (SystemExit: Megatron-LM's validate_args calls exit(); bridge/megatron_args.py turns it into
                    # its refusal, and nothing else may end the doctor silently with exit 0)
                    rep.plan_status = f"not planned: {' '.join(str(exc).split())[:400]}"
                    return None
            if why:
                rep.plan_status = f"not planned: {' '.join(why.split())[:400]}"
                return None
            # Megatron-LM's own memory lines (MB) and no arguments: the job's flags, not a recipe, are what is missing
            missing.append("the job's Megatron-LM arguments (no arguments dump or launch command in it: give the "
                           "log's head, where Megatron-LM prints them, or plan them with `mbmem plan --megatron-args "
                           "FILE`; --recipe for a Bridge recipe)" if any(getattr(r, "unit", "") == "MB"
                                                                      for r in rep.rows)
                           else "the recipe (give --recipe)")
        if not world:
            missing.append("the world size (give --world-size)")
        if missing:
            rep.plan_status = "not planned: the log does not show " + " and ".join(missing)
            return None
        overridden = f"--world-size {world_size}, not the {shown} the log shows" if world_size and shown and \
            shown != world_size else ""
        try:
            planned = _plan(rep, ctx, f, name, world, list(sets), overlay_dirs or [], margin, arch)
        except (Exception, SystemExit) as exc:  # noqa: BLE001 — any failure to plan is reported, never raised
            rep.plan_status = f"not planned: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            planned = None
        if overridden:
            rep.plan_status += f"; world size from {overridden}"
        return planned
    return planner


def iteration_offset(rows) -> tuple[int, bool]:
    """(the iteration the job started after, whether that was read from the lines) for planning a line by the
    iterations since the start (model.reported_phases): Bridge reports after the first two iterations a process
    runs (train_utils.py:1226-1239, log_interval 1), so ranks whose reports are after J and J + 1 with J > 1 started
    after J - 1 (a resumed job). Otherwise the printed iteration is taken as counted from 0: for a resumed job
    that plans a line by at least as many phases as it has run, never fewer."""
    firsts = [r.first_iteration for r in rows if r.first_iteration is not None and r.first_iteration >= 1]
    if not firsts:
        return 0, False
    start = min(firsts)
    if start > 1 and any(r.first_iteration == start and r.iteration == start + 1 for r in rows):
        return start - 1, True
    return 0, False


def _dump_job(paths: list[str], world_size: int | None, arch: int | None, f=None) -> tuple:
    """(the job of the first log's arguments dump, or None; why not) without the launch command
    (doctor/megatron_plan.py find_job also reads one); of a log that holds several starts, the latest start's."""
    from ..bridge.megatron_args import MegatronArgsError, load_job
    from ..memory.coverage import with_coverage
    from .megatron_plan import FoundJob, megatron_dump
    runs = getattr(f, "runs", ())
    dump = megatron_dump(paths, f.run_read if len(runs) > 1 else None)
    if dump is None:
        return None, ""
    try:
        job = with_coverage(load_job(dump[1], world_size=world_size, arch=arch or DEFAULT_ARCH))
    except MegatronArgsError as exc:
        return None, exc.message
    return FoundJob(job, f"the arguments dump of {dump[0]}"), ""


def _plan_megatron(rep, found, world_size: int | None, margin: float, arch: int | None = None):
    """The log's own Megatron-LM arguments, parsed and validated by megatron-core's parser
    (bridge/megatron_args.py), planned and compared line by line like a recipe's job; its changes are priced as
    the job's own flags (MegatronRunPlan)."""
    from ..memory.coverage import flag_texts
    from ..core.catalog import Catalog
    from ..memory.megatron import MegatronTarget
    from ..memory.steps import Start
    job = found.job
    name = f"Megatron-LM {found.source.replace('the ', '', 1)}"
    start = Start(name)
    planned = _compare(rep, job.config, job.config, start, Catalog(), job.world_size, name, [], (), [], margin,
                       arch=arch, env=dict(job.env))
    rep.plan["megatron_args"] = job.as_dict()
    rep.plan["assumptions"] += list(job.assumptions)
    flags = [n for n in job.not_modelled if any(t.startswith(f"{n.flag}=") for t in flag_texts(job))]
    if flags:   # the config fields are named by _compare; the flags outside megatron-core's parser here
        rep.plan_status += ("; NOT MODELLED: " + "; ".join(n.text() for n in flags))
    if job.translated:
        rep.plan_status += "; " + "; ".join(n.text() for n in job.translated)
    if job.unknown:
        rep.plan_status += "; unknown in the arguments: " + ", ".join(n.flag for n in job.unknown[:8])
    if world_size and job.world_from == "given" and job.args.get("world_size") != world_size:
        rep.plan_status += f"; world size from --world-size {world_size}"
    rep.plan_status += "; each change is priced as the job's own flags, validated by megatron-core's validate_args"
    fields = {f.name: getattr(planned, f.name) for f in dataclasses.fields(RunPlan)}
    return MegatronRunPlan(**fields, target=MegatronTarget(job, arch=arch), prefix=found.prefix)


def _world_from_layout(f) -> int | None:
    lay = f.layout
    if all(lay.get(k) for k in ("tp", "pp", "dp")):
        return lay["tp"] * lay["pp"] * lay.get("cp", 1) * lay["dp"]
    return None


def _plan(rep, ctx, f, name: str, world: int, sets: list[str], overlay_dirs: list[str], margin: float,
          arch: int | None = None):
    from ..bridge.overrides import check_overrides, write_all
    from ..bridge.recipes import load_recipe
    from ..bridge.stack import prepare
    from ..core.catalog import Catalog
    from ..core.errors import OverlayError
    from ..core.paths import MISSING, read
    from ..core.values import hydra_text
    from ..memory import model as M
    from ..memory.steps import Candidate, Rejected, Start, realize
    prepare()
    catalog = Catalog(overlay_dirs)
    cfg = load_recipe(name)
    words = [f"{k}={v}" for k, v in C.overrides_in(ctx.launch).items() if not k.startswith(SKIP_OVERRIDE_PREFIXES)]
    words += [s for s in sets if not s.startswith("mem.")]
    overlays = tuple(dict.fromkeys(catalog.resolve(o).name for o in ctx.overlays))
    params: dict[str, dict] = {}
    for key, value in {**C.params_in(ctx.launch), **{s[4:].partition("=")[0]: s.partition("=")[2]
                                                       for s in sets if s.startswith("mem.")}}.items():
        overlay, _, param = key.partition(".")
        params.setdefault(catalog.resolve(overlay).name, {})[param] = C._typed(value)
    changes, problems = check_overrides(cfg, words)
    if problems:
        raise OverlayError(problems)
    write_all(cfg, changes)
    written = {path for path, _, _ in changes}
    owned = {p for o in overlays for p in catalog.resolve(o).set}
    from_log = []
    seen = [(k, (f.layout[k],), f.layout_where.get(k, "")) for k in LAYOUT_PATHS if k in f.layout]
    seen += [(k, (f.config[k].value,), f.config[k].where) for k in CONFIG_PATHS if k in f.config]
    for key, (raw,), where in seen:
        try:
            value = raw if isinstance(raw, int) else _log_value(raw)
        except ValueError:
            continue
        for path in LAYOUT_PATHS.get(key) or CONFIG_PATHS[key]:
            current = read(cfg, path, MISSING)
            if current is MISSING or path in written or path in owned or current == value:
                continue
            if isinstance(current, bool) != isinstance(value, bool):
                continue
            word = f"{path}={hydra_text(value)}"
            more, bad = check_overrides(cfg, [word])
            if bad:
                continue
            write_all(cfg, more)
            words.append(word)
            written.add(path)
            from_log.append(f"{word} [{where}]")
    locked = {}
    for w in words:
        path = w.partition("=")[0].lstrip("+")
        locked[path] = read(cfg, path, None)
    start = Start(name, tuple(words), overlays, params, locked, tuple(overlay_dirs))
    try:
        work, _ = realize(cfg, start, Candidate(), world, catalog=catalog, validate=True)
    except Rejected as exc:
        rep.plan_status = (f"not planned: the configuration rebuilt from the log (recipe {name}, "
                           f"{' '.join(words) or 'no overrides'}, world size {world}) is refused: {exc.reason}")
        return None
    return _compare(rep, cfg, work, start, catalog, world, name, words, overlays, from_log, margin, arch=arch,
                    recipe=name)


def _compare(rep, cfg, work, start, catalog, world: int, name: str, words: list[str], overlays: tuple,
             from_log: list[str], margin: float, arch: int | None = None, env: dict | None = None,
             recipe: str | None = None) -> RunPlan:
    """Each rank's memory line beside the plan of its stage and iteration, for a built configuration.

    ``work`` is the job as it ran (its overlays applied), what the lines are compared with; ``cfg`` is the recipe
    with the user's overrides only, what the returned plan realizes every remedy on (steps.realize): a remedy that
    removes an overlay must start from a config that never had that overlay's fields written, or its settings
    (e.g. optimizer.optimizer_cpu_offload=true) survive the removal and the change is priced as nothing."""
    from ..bridge.recipes import gpu_arch_for
    from ..core.paths import read
    from ..memory import model as M
    gpu = gpu_arch_for(recipe, arch, DEFAULT_ARCH)   # --gpu-arch, else the GPU the recipe is named for, else 9
    arch = gpu["compute_capability"]
    shape, lay, st = M.from_config(work, world, arch=arch, env=env)
    base = stage_breakdowns(shape, lay, st)
    mapping = bool(read(work, "dist.use_tp_pp_dp_mapping", False))
    per_stage, tp_cp = world // lay.pp, lay.tp * lay.cp
    for i, row in enumerate(rep.rows):  # the rebuilt layout names the stages the log alone could not
        if row.stage is None and row.rank is not None and row.rank < world:
            stage = (row.rank // tp_cp) % lay.pp if mapping else row.rank // per_stage
            rep.rows[i] = dataclasses.replace(row, stage=stage)
    planned, errors = [], []
    measured: dict = {}
    reported: dict = {}   # iteration since the start -> the plan of what a line printed after it shows, per stage
    offset, resumed = iteration_offset(rep.rows)
    before_training = []
    for row in rep.rows:
        if row.stage is None or row.stage >= len(base):
            continue
        b = base[row.stage]
        since = None if row.iteration is None else row.iteration - offset
        if since is not None and since < 1:
            before_training.append(str(row.key))   # no training step yet: nothing the plan sizes
            continue
        if since is not None:
            # a line shows the peak so far: after iterations 1..cuda_graph_warmup_steps the run is still eager
            # (no graph pool yet), after iteration 1 without the Adam moments in the forward (model.reported_phases)
            if since not in reported:
                reported[since] = M.reported_breakdowns(shape, lay, st, since)
            b = reported[since][row.stage]
        got = row.get("max_allocated")   # only a peak is compared with a planned peak
        err = None if not got else (b.total - got) / got * 100
        if err is not None:
            errors.append(abs(err))
        planned.append({"rank": row.rank, "label": str(row.key), "stage": row.stage,
                        "planned_peak_bytes": int(b.total), "planned_footprint_bytes": int(b.footprint),
                        "phase": b.phase, "iteration": row.iteration, "measured_max_allocated_bytes": got,
                        "error_percent": None if err is None else round(err, 1)})
        peak = row.peak
        if peak is not None and (row.stage not in measured or peak > measured[row.stage][0]):
            line = None if since is None else (since, b.total)   # the plan of this line, when it has an iteration
            measured[row.stage] = (peak, got or row.get("allocated") or peak, line)
    hot = rep.hot
    rep.planned = planned
    lay_text = (f"TP{lay.tp} PP{lay.pp}" + (f" VPP{lay.vpp}" if lay.vpp > 1 else "") + f" CP{lay.cp} DP{lay.dp}"
                + (f" EP{lay.ep}" if lay.ep > 1 else ""))
    rep.plan = {"recipe": name, "world_size": world, "layout": lay_text, "words": list(words),
                "overlays": list(overlays), "from_log": from_log,
                "assumptions": list(PLAN_ASSUMPTIONS) + ([gpu["assumption"]] if gpu["assumption"] else []),
                "gpu_arch": {k: v for k, v in gpu.items() if k != "assumption"},
                "stages": [{"stage": i, "planned_peak_bytes": int(b.total), "phase": b.phase} for i, b in enumerate(base)]}
    mean = f"; mean |error| {sum(errors) / len(errors):.1f}% over {len(errors)} rank(s)" if errors else ""
    what = name if name.startswith("Megatron-LM ") else f"recipe {name}"    # a Megatron-LM job has no recipe
    rep.plan_status = (f"the memory model on {what} at world size {world} ({lay_text}"
                       + (f"; from the log: {', '.join(from_log)}" if from_log else "") + f"){mean}")
    from ..memory.coverage import gaps, not_modelled
    left_out = gaps(not_modelled(work))
    rep.plan["unmodelled"] = [g.as_dict() for g in left_out]
    if left_out:
        rep.plan_status += ("; NOT MODELLED: " + ", ".join(g.setting for g in left_out)
                            + " (the planned peaks leave it out; a change's fit is unknown)")
    if resumed:
        rep.plan_status += (f"; the job started after iteration {offset} (its ranks first reported after {offset + 1} "
                            f"and {offset + 2}, as Bridge does after the first two iterations it runs): lines are "
                            "planned by the iterations since then")
    if before_training:
        rep.plan_status += (f"; {len(before_training)} line(s) printed before the first training iteration "
                            f"({', '.join(before_training[:8])}) are not compared: no step has run")
    from ..memory.cost import cost_inputs
    base_job = (shape, lay, st, cost_inputs(work))
    return RunPlan(cfg, start, world, catalog, base, rep.capacity, margin, name,
                   None if hot is None else hot.stage, measured, arch, env, base_job)
