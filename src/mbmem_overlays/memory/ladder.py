"""The recommendation ladder: NVIDIA's memory-tuning steps, one at a time, each re-planned and validated.

Every rung proposes a :class:`~.steps.Candidate` on top of the user's own start (recipe, ``--set``
words, overlays); it is realized the way ``train.py`` realizes it (our rules, then Bridge's
validation) before it may become a step, and the one command printed at the end is the last
accepted candidate's, so it has passed both already. Each step is priced for the job by the cost model
(memory/cost/); while no candidate fits the rungs are walked in this order, and at the first rung where one fits,
the cheapest of every candidate that fits, this rung's and the later rungs' (TP doubling aside), is the step.
Order (the documented words in ``costs.py``):

1. expandable segments (memory-tuning skill, Quick Decision 1)
2. sequence parallel at TP > 1, the precondition of 3 (memory-tuning skill, PEFT + SP input re-gather)
3. LoRA input re-gather (Quick Decision 2)
4. selective recompute, the architecture's default label (Quick Decision 3)
5. distributed optimizer (Parallelism resizing, ~1-2%)
5a. bf16 Adam moments (the precision-aware optimizer): a cheap optimizer-state step after the distributed optimizer
5b. Megatron FSDP where DP is large and the distributed optimizer is not enough (Parallelism resizing, "FSDP:
   shards params + grads + optimizer"; megatron-fsdp skill): gradients first (``optim_grads``), then the weights too
   (``optim_grads_params``, NVIDIA's default)
6. selective recompute of ``mlp`` (dense) or ``moe`` (MoE) added to 4 (Quick Decision 6; activation-recompute
   skill, Selective Module Decision Table)
7. PP doubled while DP >= 2 (Quick Decision 5: ~6% per DP halving)
7a. fine-grained activation offloading where activations are the largest component (cpu-offloading skill, Quick
   Decision "activation memory dominates" and Known Limitations: the module-level approach works with PP > 1): the
   fewest modules first, each step saying what the host must hold per GPU and per node
8. activation CPU offload, PP = 1 only, instead of recompute (Quick Decision 7; cpu-offloading skill)
9. full recompute ``block``: the fewest layers per stage that fit, else the most tried (activation-recompute
   skill, Full-layer recompute and Quick Decision Guide 5)
10. full recompute ``uniform``/1, every layer (same)
11. optimizer CPU offload, the smallest documented fraction that fits (cpu-offloading skill, Quick Decision)
12. TP doubled, last resort (Quick Decision 4: -28% on Llama3-70B)

A rung that cannot change memory here is listed under "skipped: saves nothing here" (the distributed optimizer at
DP x CP = 1, a candidate the model prices at no saving), never printed as a step; a rejected one names the field
or overlay that caused it (steps.explain_rejection).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from ..core.catalog import Catalog
from . import cost as K
from .cost import cost_text
from .costs import COSTS, DP_HALVING_COST, TP_DOUBLING_COST, full_recompute_cost, optimizer_offload_cost
from .steps import (Candidate, Rejected, Start, breakdown_of, explain_rejection, realize, settings, toggles,
                    train_command)

RECOMPUTE_OVERLAYS = ("selective_recompute", "full_recompute")
LAST_RESORT = ("TP x2",)   # never ranked ahead of its turn (_later_fitting)
SAVES_NOTHING = "saves nothing here"
MIN_SAVING = 1 << 20   # a candidate the plan prices at less than 1 MiB saved is not a step


@dataclass
class State:
    """The ladder so far: the accepted candidate, its realized config and report; ``arch`` the GPUs' compute
    capability; ``inputs`` the memory model's (Shape, Layout, Settings) of ``cfg`` as Bridge's setup will run it
    (from_config: bridge/as_run.py), read once per accepted step."""
    start: Start
    cand: Candidate
    cfg: Any
    report: Any
    world: int
    arch: int = 9
    env: dict[str, str] | None = None   # the job's environment (a Megatron-LM job's own), None: the recipe's
    inputs: Any = None

    def planned(self):
        if self.inputs is None:
            from . import model as P
            self.inputs = P.from_config(self.cfg, self.world, arch=self.arch, env=self.env)
        return self.inputs


class SavesNothing(str):
    """A rung's reason for not applying that is a zero saving on this configuration (listed apart)."""


# A rung returns candidates to try in order of preference (the first that fits wins; otherwise the one
# that saves most), or a sentence saying why it does not apply here (a SavesNothing when it would save nothing).
Proposal = list[tuple[Candidate, str]] | str


@dataclass(frozen=True)
class Rung:
    label: str
    propose: Callable[[State], Proposal]


def _model(state: State):
    return state.cfg.model


def _is_lora(state: State) -> bool:
    return type(getattr(state.cfg, "peft", None)).__name__ in ("LoRA", "DoRA")


def _own(state: State, overlay: str, fields: tuple[str, ...] = ()) -> str | None:
    """Why the ladder may not change ``overlay``: the user chose it, or set one of the ``fields`` it writes."""
    if overlay in state.start.overlays:
        return f"you chose {overlay} (--overlay); the ladder does not replace it"
    return next(filter(None, (_yours(state, path) for path in fields)), None)


def expandable(state: State) -> Proposal:
    return [(state.cand.plus("expandable_segments"), COSTS["expandable_segments"][1])]


def sequence_parallel(state: State) -> Proposal:
    if _model(state).tensor_model_parallel_size <= 1:
        return "needs TP > 1 (sequence parallel is a no-op at TP=1)"
    return [(state.cand.plus("sequence_parallel"), COSTS["sequence_parallel"][1])]


def lora_regather(state: State) -> Proposal:
    if not _is_lora(state):
        return "not a LoRA recipe"
    return [(state.cand.plus("lora_sp_regather"), COSTS["lora_sp_regather"][1])]


def selective_default(state: State) -> Proposal:
    return [(state.cand.plus("selective_recompute"), COSTS["selective_recompute"][1])]


def dist_optimizer(state: State) -> Proposal:
    """Shards optimizer state over DP x CP / instances (and expert state over expert DP): nothing to shard at 1."""
    from ..core.paths import read
    m = _model(state)
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    dp = state.world // max(1, tp * pp * cp)
    instances = int(read(state.cfg, "ddp.num_distributed_optimizer_instances", 1) or 1)
    experts = getattr(m, "num_moe_experts", None) or 0
    etp = getattr(m, "expert_tensor_parallel_size", None) or tp
    expert_dp = state.world // max(1, pp * (getattr(m, "expert_model_parallel_size", 1) or 1) * etp)
    if dp * cp // instances <= 1 and (not experts or expert_dp // instances <= 1):
        return SavesNothing(f"DP x CP is {dp * cp} (world {state.world} / TP{tp} PP{pp} CP{cp}): the distributed "
                            "optimizer has nothing to shard across")
    return [(state.cand.plus("dist_optimizer"), COSTS["dist_optimizer"][1])]


def _data_parallel_shards(state: State) -> tuple[int, str]:
    """(ranks one optimizer instance shards over, the layout in words): what the distributed optimizer and FSDP
    can split, dense or expert (model.data_parallel_shards)."""
    from . import model as P
    _, lay, st = state.planned()
    dense, expert = P.data_parallel_shards(lay, st)
    return max(dense, expert if getattr(_model(state), "num_moe_experts", None) else 1), f"DP x CP is {lay.dp * lay.cp}"


def bf16_moments(state: State) -> Proposal:
    """The precision-aware optimizer with bf16 moments: half of Adam's state at no documented throughput cost."""
    from . import model as P
    taken = _own(state, "precision_aware_optimizer", ("optimizer.use_precision_aware_optimizer",
                                                      "optimizer.exp_avg_dtype", "optimizer.exp_avg_sq_dtype"))
    if taken:
        return taken
    st = state.planned()[2]
    if st.lora_rank:
        return SavesNothing("LoRA trains only the adapters: their optimizer state is negligible")
    if st.precision_aware and st.state_bytes <= P.BF16:
        return SavesNothing("the Adam moments are already 2 bytes or less")
    return [(state.cand.plus("precision_aware_optimizer"), COSTS["precision_aware_optimizer"][1])]


def megatron_fsdp(state: State) -> Proposal:
    """Megatron FSDP: the gradients sharded too (optim_grads), then the weights (optim_grads_params)."""
    taken = _own(state, "megatron_fsdp", ("ddp.use_megatron_fsdp", "dist.use_megatron_fsdp",
                                          "ddp.data_parallel_sharding_strategy"))
    if taken:
        return taken
    shards, layout = _data_parallel_shards(state)
    if shards <= 1:
        return SavesNothing(f"{layout}: Megatron FSDP has no data-parallel ranks to shard across")
    return [(state.cand.plus("megatron_fsdp", params={"strategy": s}),
             f"strategy {s} over {shards} ranks: {COSTS['megatron_fsdp'][1]}") for s in ("optim_grads",
                                                                                      "optim_grads_params")]


def fine_grained_offload(state: State) -> Proposal:
    """Module-level activation offloading, where activations are the largest component: the fewest modules that
    keep an activation here first (model.levers.layer_offload_terms), fraction 1."""
    from . import levers
    from . import model as P
    taken = _own(state, "fine_grained_offload", ("model.fine_grained_activation_offloading",))
    if taken:
        return taken
    shape, lay, st = state.planned()
    b = P.estimate(shape, lay, st)
    largest = max(("parameters", "gradients", "optimizer", "activations"), key=lambda k: getattr(b, k))
    if largest != "activations":
        return (f"activations ({b.activations / 2**30:.1f} GiB) are not the largest component ({largest}, "
                f"{getattr(b, largest) / 2**30:.1f} GiB): offloading them is not the next step")
    options = _offload_module_sets(shape, lay, st)
    if not options:
        return SavesNothing("no module megatron-core can offload keeps an activation in this configuration")
    out = []
    for modules in options:
        trial = replace(st, fine_grained_offload=levers.FineGrainedOffload(modules, graph_modules=tuple(
            st.graph_scopes)))
        host = max(levers.offloaded_activations(shape, lay, trial, r).host_per_gpu for r in range(lay.pp))
        out.append((state.cand.plus("fine_grained_offload", params={"modules": list(modules), "fraction": 1.0}),
                    f"{levers.host_memory_text(host, state.world)}; {COSTS['fine_grained_offload'][1]}"))
    return out


def _offload_module_sets(shape, lay, st) -> list[tuple[str, ...]]:
    """Growing sets of offload_modules that remove something here: the attention's largest saved tensors first,
    then its input, then the MoE expert inputs (megatron-core's labels; attn_proj only with core_attn)."""
    from . import levers
    from . import model as P
    moe = any("moe" in k for k in P.layer_kinds(shape))
    ladder = [("core_attn",), ("core_attn", "attn_proj"), ("qkv_linear", "core_attn", "attn_proj")]
    if moe:
        inside = () if "moe" in (st.modules if st.recompute == "selective" else ()) else ("expert_fc1", "moe_act")
        ladder.append(("qkv_linear", "core_attn", "attn_proj", "mlp_norm", *inside))
    out, seen = [], 0.0
    for modules in ladder:
        trial = replace(st, fine_grained_offload=levers.FineGrainedOffload(modules))
        removed = max(levers.offloaded_activations(shape, lay, trial, r).gpu_removed for r in range(lay.pp))
        if removed > seen + MIN_SAVING:
            out.append(modules)
            seen = removed
    return out


def selective_wide(state: State) -> Proposal:
    """``mlp`` (dense) or ``moe`` (MoE) added to the selective modules in effect."""
    m = _model(state)
    label = "moe" if (getattr(m, "num_moe_experts", None) or 0) else "mlp"
    if "modules" in state.start.params.get("selective_recompute", {}):
        return "you chose the modules yourself (mem.selective_recompute.modules)"
    if "model.recompute_modules" in state.start.locked:
        return "you set model.recompute_modules yourself"
    current = list(m.recompute_modules or []) if m.recompute_granularity == "selective" else []
    if label in current:
        return f"{label} is already recomputed"
    modules = [*current, label]
    return [(state.cand.plus("selective_recompute", params={"modules": modules}),
             COSTS[f"selective_recompute_{label}"][1])]


def _yours(state: State, path: str) -> str | None:
    return f"you set {path} yourself" if path in state.start.locked else None


def pipeline_doubling(state: State) -> Proposal:
    if _yours(state, "model.pipeline_model_parallel_size"):
        return _yours(state, "model.pipeline_model_parallel_size")
    m = _model(state)
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    dp = state.world // max(1, tp * pp * cp)
    if dp < 2:
        return f"DP is {dp}: no data parallelism left to trade for pipeline stages"
    new_pp = pp * 2
    if m.num_layers % new_pp:
        return f"{m.num_layers} layers do not split into {new_pp} pipeline stages"
    sets: dict[str, Any] = {"model.pipeline_model_parallel_size": new_pp}
    vpp = m.virtual_pipeline_model_parallel_size
    if vpp and (m.num_layers // new_pp) % vpp:
        sets["model.virtual_pipeline_model_parallel_size"] = None
    return [(state.cand.plus(sets=sets), f"PP {pp} -> {new_pp}, DP {dp} -> {dp // 2}: {DP_HALVING_COST[1]}")]


def cpu_offload(state: State) -> Proposal:
    """Activation offload replaces recompute (megatron-core refuses the two together); fewest layers first."""
    mine = next((r for r in (_own(state, o) for o in RECOMPUTE_OVERLAYS) if r), None)
    if mine:
        return mine + " and activation offload cannot be combined with recompute"
    layers = _model(state).num_layers
    counts = sorted({n for n in (1, layers // 4, layers // 2, layers - 1) if 1 <= n < layers})
    return [(state.cand.plus("cpu_offload", params={"num_layers": n}, drop=RECOMPUTE_OVERLAYS),
             f"{n} of {layers} layers: {COSTS['cpu_offload'][1]}") for n in counts]


def _full_recompute(state: State, options: list[tuple[str, int]]) -> Proposal:
    mine = _own(state, "selective_recompute")
    if mine:
        return mine
    per_stage = _layers_per_stage(state)
    return [(state.cand.plus("full_recompute", params={"method": method, "num_layers": n},
                             drop=("selective_recompute", "cpu_offload")),
             full_recompute_cost(method, n, per_stage)) for method, n in options]


def _layers_per_stage(state: State) -> int:
    m = _model(state)
    return max(1, m.num_layers // m.pipeline_model_parallel_size)


def full_recompute_block(state: State) -> Proposal:
    """Full recompute of the first n layers of each model chunk (``block``): the fewest of 1/4, 1/2, 3/4 and all
    but one of a chunk's layers that fit, else the most of them (megatron-core applies n to each virtual-pipeline
    chunk, recompute.py checkpointed_forward, so n stays within a chunk)."""
    m = _model(state)
    chunk = max(1, _layers_per_stage(state) // (m.virtual_pipeline_model_parallel_size or 1))
    blocks = sorted({n for n in (chunk // 4, chunk // 2, 3 * chunk // 4, chunk - 1) if 1 <= n < chunk})
    if not blocks:
        return f"a {chunk}-layer chunk has no part to checkpoint short of all of it (the uniform rung does that)"
    return _full_recompute(state, [("block", n) for n in blocks])


def full_recompute_uniform(state: State) -> Proposal:
    """Full recompute of every layer, one at a time (``uniform``/1): the most full recompute saves."""
    return _full_recompute(state, [("uniform", 1)])


def optimizer_offload(state: State) -> Proposal:
    taken = _own(state, "optimizer_offload", ("optimizer.optimizer_cpu_offload", "optimizer.optimizer_offload_fraction"))
    if taken:
        return taken
    # HybridDeviceOptimizer needs the distributed optimizer (cpu-offloading skill, Compatibility: Optimizer offloading)
    on = bool(state.cfg.optimizer.use_distributed_optimizer)
    with_dist = state.cand if on else state.cand.plus("dist_optimizer")
    return [(with_dist.plus("optimizer_offload", params={"fraction": f}), optimizer_offload_cost(f))
            for f in (0.25, 0.5, 1.0)]


def tensor_doubling(state: State) -> Proposal:
    if _yours(state, "model.tensor_model_parallel_size"):
        return _yours(state, "model.tensor_model_parallel_size")
    tp = _model(state).tensor_model_parallel_size
    return [(state.cand.plus("sequence_parallel", sets={"model.tensor_model_parallel_size": tp * 2}),
             f"TP {tp} -> {tp * 2}: {TP_DOUBLING_COST[1]}; last resort")]


LADDER_RUNGS = (
    Rung("expandable_segments", expandable),
    Rung("sequence_parallel", sequence_parallel),
    Rung("lora_sp_regather", lora_regather),
    Rung("selective_recompute", selective_default),
    Rung("dist_optimizer", dist_optimizer),
    Rung("precision_aware_optimizer", bf16_moments),
    Rung("megatron_fsdp", megatron_fsdp),
    Rung("selective_recompute (wider)", selective_wide),
    Rung("PP x2 (DP /2)", pipeline_doubling),
    Rung("fine_grained_offload", fine_grained_offload),
    Rung("cpu_offload", cpu_offload),
    Rung("full_recompute block", full_recompute_block),
    Rung("full_recompute uniform", full_recompute_uniform),
    Rung("optimizer_offload", optimizer_offload),
    Rung("TP x2", tensor_doubling),
)


def _label(rung: Rung, before: Candidate, after: Candidate) -> str:
    """The step as the user reads it: what was added and with which parameters."""
    if rung.label == "selective_recompute (wider)":
        return "selective_recompute " + ",".join(after.params["selective_recompute"]["modules"])
    overlay = rung.label.split(" ")[0]
    if after.params.get(overlay) and (overlay not in before.overlays
                                      or after.params[overlay] != before.params.get(overlay)):
        return f"{overlay} " + " ".join(f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}"
                                        for k, v in after.params[overlay].items())
    return rung.label


def _shown(value: Any) -> Any:
    """A config value for JSON and text (torch dtypes and enums as their repr)."""
    return value if isinstance(value, (type(None), bool, int, float, str, list, dict)) else repr(value)


def _cost(before_cfg: Any, after_cfg: Any, world: int, arch: int | None) -> dict[str, Any]:
    """The cost model's price of one step (memory/cost/ Cost.as_dict: range, FLOPs, bytes per link, bubble)."""
    return K.price(K.job_of(before_cfg, world, arch=arch), K.job_of(after_cfg, world, arch=arch), arch).as_dict()


def _cheapest(options: list[dict]) -> list[dict]:
    """Options ordered by their cost (memory/cost/ rank_key: the middle of the range, then its high end), then by
    the memory they leave."""
    return sorted(options, key=lambda o: (tuple(o["cost"]["rank_key"]), o["total"]))


def recommend(cfg: Any, world: int, capacity: float, margin: float = 0.05, locked: dict | None = None,
              recipe: str = "<recipe>", *, start: Start | None = None, catalog: Catalog | None = None,
              validate: bool = True, arch: int | None = None, target: Any = None) -> dict[str, Any]:
    """The memory-tuning skill's ladder, step by step, until the plan fits.

    ``cfg`` is the recipe with the user's overrides written; ``start`` carries the user's --set words and
    overlays (``recipe``/``locked`` are the short form when there are none). Every accepted step has passed
    our rules and, with ``validate``, Bridge's validation; the returned ``command`` is the last one's. Each realized
    config is planned as Bridge's setup will run it (from_config: bridge/as_run.py), set up once.

    Each step carries its ``cost`` from the cost model (memory/cost/, on GPUs of compute capability ``arch``;
    None: 9, or the target's) and the documented words (``documented``). The rungs are walked in the skill's order
    while no candidate fits; once one does, every candidate of that rung and of the later rungs that fits on its own
    is priced and the cheapest is the step (``alternatives``: the others that fit, with their cost).

    ``target``: a job that is not launched as a recipe (memory/megatron.py ``MegatronTarget``, a Megatron-LM job's
    own arguments): its ``realize`` replaces steps.realize (and refuses what its own validator refuses), its
    ``verdict`` words each step's validation, its ``command`` is the printed command and its ``extra`` adds its
    fields to each accepted step and to the result."""
    start = start or Start(recipe, locked=dict(locked or {}))
    catalog = catalog or Catalog(list(start.overlay_dirs))
    arch = arch if arch is not None else (9 if target is None else target.arch)
    env = None if target is None else target.env
    do = realize if target is None else target.realize
    verdict_of = _verdict if target is None else target.verdict

    def plan_of(realized: Any, world: int) -> Any:
        """The most-loaded GPU of a realized config on the job's GPUs and environment."""
        return breakdown_of(realized, world, arch=arch, env=env) if target is None else target.breakdown(realized, world)
    limit = capacity * (1 - margin)
    base = Candidate()
    try:
        work, report = do(cfg, start, base, world, catalog=catalog, validate=validate)
    except Rejected as exc:
        return {"capacity_bytes": int(capacity), "margin": margin, "fits": False, "steps": [],
                "error": f"your starting point is rejected: {exc.reason}", "command": None}
    state = State(start, base, work, report, world, arch, env)
    probes: dict = {}   # explain_rejection's realized probes, shared by the rungs
    first = plan_of(work, world)
    total = first.footprint
    rows: list[dict[str, Any]] = [{"step": "baseline", "overlays": list(start.overlays), "total_bytes": int(total),
                                   **_fit(work, first, limit), "validation": verdict_of(report), "breakdown": first,
                                   **({} if target is None else target.extra(report))}]
    seen: dict[tuple, str] = {}
    accepted: list[tuple[dict, Candidate, Candidate]] = []   # (row, candidate before the step, after it)
    for index, rung in enumerate(LADDER_RUNGS):
        if rung.label != "expandable_segments" and total <= limit:
            break  # expandable segments always comes first (free; fragmentation is invisible to any plan)
        proposal = rung.propose(state)
        if isinstance(proposal, str):
            rows.append({"step": rung.label, "skipped": str(proposal),
                         "kind": SAVES_NOTHING if isinstance(proposal, SavesNothing) else "not applicable"})
            continue
        options, reasons = [], []
        for cand, words in proposal:
            try:
                cfg2, report2 = do(cfg, start, cand, world, catalog=catalog, validate=validate)
            except Rejected as exc:
                reasons.append(explain_rejection(cfg, start, cand, world, exc, catalog=catalog, validate=validate,
                                                 cache=probes))
                continue
            b = plan_of(cfg2, world)
            options.append({"rung": rung, "cand": cand, "words": words, "cfg": cfg2, "report": report2,
                            "total": b.footprint, "breakdown": b, "cost": _cost(state.cfg, cfg2, world, arch)})
        if not options:
            rows.append({"step": rung.label, "skipped": f"rejected: {reasons[0]}", "kind": "rejected"})
            continue
        fitting = [o for o in options if o["total"] <= limit]
        alternatives: list[dict] = []
        if fitting and rung.label != "expandable_segments":
            # the steps that fit, this rung's and every later rung's, each on its own: the cheapest is the step
            pool = _cheapest(fitting + _later_fitting(cfg, state, index, limit, catalog, arch, do, plan_of))
            best = None
            for option in pool:
                if option.get("unvalidated") and validate:
                    try:
                        option["cfg"], option["report"] = do(cfg, start, option["cand"], world, catalog=catalog,
                                                             validate=True)
                    except Rejected:
                        continue
                best = option
                break
            best = best or _cheapest(fitting)[0]
            alternatives = [o for o in pool if o is not best]
        else:
            best = min(options, key=lambda o: o["total"])   # none fits: the one that saves most
        cand, cfg2, report2, new_total, b = best["cand"], best["cfg"], best["report"], best["total"], best["breakdown"]
        changed = toggles(cfg, settings(state.report, state.cand), settings(report2, cand))
        key = tuple((t, repr(new)) for t, _, new in changed)
        label = _label(best["rung"], state.cand, cand)
        if not changed:
            rows.append({"step": label, "skipped": "already in effect in this config (changes nothing)",
                         "kind": "already in effect"})
            continue
        if key in seen:
            rows.append({"step": label, "skipped": f"same change as {seen[key]}", "kind": "duplicate"})
            continue
        seen[key] = label
        saving = total - new_total
        if rung.label != "expandable_segments" and saving < MIN_SAVING:
            rows.append({"step": label, "skipped": f"the plan prices it at {saving / 2**30:+.2f} GiB on this "
                                                   "configuration", "kind": SAVES_NOTHING})
            continue
        row = {"step": label, "overlays": list(dict.fromkeys([*start.overlays, *cand.overlays])),
               "changes": [{"target": t, "old": _shown(o), "new": _shown(n)} for t, o, n in changed],
               "total_bytes": int(new_total), "saving_bytes": int(saving), "cost": best["cost"],
               "documented": best["words"], **_fit(cfg2, b, limit), "validation": verdict_of(report2),
               "breakdown": b, **({} if target is None else target.extra(report2))}
        if alternatives:
            row["alternatives"] = [{"step": _label(o["rung"], state.cand, o["cand"]), "total_bytes": int(o["total"]),
                                    "cost": o["cost"], "documented": o["words"]} for o in alternatives]
        rows.append(row)
        accepted.append((row, state.cand, cand))
        state = State(start, cand, cfg2, report2, world, arch, env)
        total = new_total
    if total <= limit:
        state, total = _drop_unneeded(cfg, state, total, accepted, limit, catalog, validate, do, plan_of)
    from . import model as P
    from .coverage import gaps, not_modelled
    from .ranges import uncertainty
    shape, lay, st = state.planned()
    ranges = uncertainty(shape, lay, st)
    # The ladder climbs on the modelled part (it stops where that fits); the verdict says what it leaves out.
    fit = P.judge(total, limit, ranges, gaps(not_modelled(state.cfg)), P.estimate(shape, lay, st))
    return {"capacity_bytes": int(capacity), "margin": margin, "steps": rows, **fit.as_dict(),
            "exit_code": fit.exit_code, "uncertainty": [r.as_dict() for r in ranges],
            "overlays": list(dict.fromkeys([*start.overlays, *state.cand.overlays])),
            "validation": verdict_of(state.report),
            "command": train_command(start, state.cand, world) if target is None else
            target.command(start, state.cand, world, state.report),
            **({} if target is None else target.extra(state.report))}


def _without_step(final: Candidate, before: Candidate, after: Candidate) -> Candidate | None:
    """``final`` without what one step added (``before`` -> ``after``): its overlays and their parameters, the
    fields it set restored to what they were before it; None where a later step changed the same overlay or field
    (or the step dropped an overlay), so that taking the step out would also undo part of a later one."""
    if any(o not in after.overlays for o in before.overlays):
        return None
    added = [o for o in after.overlays if o not in before.overlays]
    if any(o not in final.overlays or final.params.get(o) != after.params.get(o) for o in added):
        return None
    params = {k: v for k, v in final.params.items() if k not in added}
    for o in before.overlays:
        if after.params.get(o) != before.params.get(o):
            if final.params.get(o) != after.params.get(o):
                return None
            params.pop(o, None)
            if o in before.params:
                params[o] = before.params[o]
    sets = dict(final.sets)
    for key in set(after.sets) | set(before.sets):
        if after.sets.get(key, _UNSET) == before.sets.get(key, _UNSET):
            continue
        if final.sets.get(key, _UNSET) != after.sets.get(key, _UNSET):
            return None
        sets.pop(key, None)
        if key in before.sets:
            sets[key] = before.sets[key]
    trial = Candidate(tuple(o for o in final.overlays if o not in added), params, sets)
    return None if trial == final else trial


_UNSET = object()


def _drop_unneeded(cfg: Any, state: State, total: float, accepted: list[tuple[dict, Candidate, Candidate]], limit: float,
                   catalog: Catalog, validate: bool, do: Callable, plan_of: Callable) -> tuple[State, float]:
    """The fitting end of the walk without the steps it no longer needs. The ladder climbs while nothing fits, so an
    early step that saved little (selective recompute where fused attention keeps almost nothing to recompute) stays
    in the command after a later step made the job fit on its own: its cost would be paid for nothing (the
    memory-tuning skill's point that recompute and offload a fitting job no longer needs cost throughput). Each
    accepted step, dearest first (its cost's rank_key), is taken out of the final candidate; where the job still
    passes our rules (and Bridge's validation, with ``validate``) and fits, it stays out, and its row says so
    (``dropped``). expandable_segments is free and stays."""
    steps = [a for a in accepted if a[0]["step"] != "expandable_segments" and a[0].get("cost")]
    for row, before, after in sorted(steps, key=lambda a: tuple(a[0]["cost"]["rank_key"]), reverse=True):
        trial = _without_step(state.cand, before, after)
        if trial is None:
            continue
        try:
            cfg2, report2 = do(cfg, state.start, trial, state.world, catalog=catalog, validate=validate)
        except Rejected:
            continue
        b = plan_of(cfg2, state.world)
        if b.footprint > limit:
            continue
        row["dropped"] = {"total_bytes": int(b.footprint),
                          "reason": f"the job fits without it ({b.footprint / 2**30:.2f} GiB), so its cost is not paid"}
        state = State(state.start, trial, cfg2, report2, state.world, state.arch, state.env)
        total = b.footprint
    return state, total


def _fit(cfg: Any, b: Any, limit: float) -> dict[str, Any]:
    """A step's fit (memory/plan.py judge, without the plan's ranges): "fits" True/False, or None where a feature
    that changes memory is not modelled and the fit is unknown; "modelled_fits": the modelled part alone."""
    from . import model as P
    from .coverage import gaps, not_modelled
    v = P.judge(b.footprint, limit, (), gaps(not_modelled(cfg)), b)
    return {"fits": v.fits, "fit": v.kind, "modelled_fits": v.modelled_fits}


def _later_fitting(cfg: Any, state: State, index: int, limit: float, catalog: Catalog, arch: int | None,
                   do: Callable = realize, plan_of: Callable = breakdown_of) -> list[dict]:
    """Every candidate of the rungs after ``index`` that fits on its own from ``state``, priced; realized by our
    rules only (the one chosen is validated with Bridge before it becomes the step). TP doubling stays the last
    resort it is on the skill's ladder and is not offered ahead of its turn: the cost model prices a TP change below
    what NVIDIA measured (bench/cost_accuracy.py, the TP8 row: +12% at most against +38%; what it lacks is named
    there), so its price cannot rank it ahead of a step the skill puts first."""
    out = []
    for rung in LADDER_RUNGS[index + 1:]:
        if rung.label in LAST_RESORT:
            continue
        proposal = rung.propose(state)
        if isinstance(proposal, str):
            continue
        for cand, words in proposal:
            try:
                cfg2, report2 = do(cfg, state.start, cand, state.world, catalog=catalog, validate=False)
            except Rejected:
                continue
            b = plan_of(cfg2, state.world)
            if b.footprint <= limit:
                out.append({"rung": rung, "cand": cand, "words": words, "cfg": cfg2, "report": report2,
                            "total": b.footprint, "breakdown": b, "cost": _cost(state.cfg, cfg2, state.world, arch),
                            "unvalidated": True})
    return out


def _verdict(report: Any) -> str:
    v = report.validation
    return "our rules only (Bridge's validation not run)" if v is None else v.verdict


@dataclass(frozen=True)
class Wording:
    """What the ladder's text says of how its steps were checked and what the command is: a Bridge recipe's
    (``BRIDGE``), or a job launched otherwise (memory/megatron.py: the Megatron-LM job's flags)."""
    checked: Callable[[dict[str, Any]], str]     # the result -> how the printed command was checked
    path: str                                     # how each step was checked, in the path's title
    command_notes: tuple[str, ...] = ()           # printed under the command
    step_lines: Callable[[dict[str, Any], bool], list[str]] | None = None   # (step row, verbose) -> its own lines
    folded_hint: str = "-v: why each"


def _bridge_step_lines(r: dict[str, Any], verbose: bool) -> list[str]:
    if verbose and r.get("changes"):
        return ["      sets: " + ", ".join(f"{c['target']}={c['new']!r}" for c in r["changes"])]
    return []


BRIDGE = Wording(checked=lambda rec: f"validated: {rec['validation']}", path="each step validated (our rules + Bridge)",
                 command_notes=("  (a dry run: it validates again; drop run.dry_run=true on a GPU node to train)",),
                 step_lines=_bridge_step_lines, folded_hint="-v: why each, and every step's fields")


def render_recommendation(rec: dict[str, Any], verbose: bool = False, wording: Wording = BRIDGE) -> str:
    """The ladder as the user reads it, the answer first: the one validated command (and the fit verdict where it
    is not a plain "fits": "fits unless ...", "unknown: ... not modelled"); then each step with its saving and cost,
    and the rungs that would save nothing here in one list ("skipped: saves nothing here"). ``verbose`` (-v): every
    other skipped rung with its reason and each step's fields, which the default folds into one line; ``wording``:
    how the command and the steps were checked (a Bridge recipe's by default)."""
    if rec.get("error"):
        return rec["error"]
    text = rec.get("verdict_text", rec.get("fit_verdict"))
    unknown = rec.get("fit") == "unknown"
    if unknown:
        names = ", ".join(f"{g['name']}={g['value']}" for g in rec.get("unmodelled", []))
        head = f"next command, fit unknown ({names} not modelled; "
    else:
        head = "next command (" if rec["fits"] else "nothing on the ladder fits; closest ("
    lines = [f"{head}{wording.checked(rec)}):", f"  {rec['command']}", *wording.command_notes]
    if text and text not in ("fits", "-") and (rec["fits"] or unknown or rec.get("unmodelled")):
        lines.append(f"verdict: {text}")
    lines.append(f"the path (memory-tuning skill, Quick Decision), capacity {rec['capacity_bytes'] / 2**30:.1f} GiB "
                 f"with a {rec['margin']:.0%} margin; {wording.path}:")
    nothing, folded = [], []
    for r in rec["steps"]:
        if "skipped" in r:
            if r.get("kind") == SAVES_NOTHING:
                nothing.append(f"{r['step']} ({r['skipped']})")
            elif verbose or r.get("kind") == "rejected":
                lines.append(f"  - {r['step']:<34} skipped: {r['skipped']}")
            else:
                folded.append(r["step"])
            continue
        if "saving_bytes" not in r:
            saving = ""
        elif r["saving_bytes"] or r["step"] != "expandable_segments":
            saving = f"  saves {r['saving_bytes'] / 2**30:5.2f} GiB"
        else:  # the one step whose effect, fragmentation, is outside the allocated-memory plan
            saving = "  saves fragmentation (reserved, not allocated: outside the plan)"
        mark, fits = {True: ("*", "  FITS"), False: (" ", "")}.get(r["fits"], ("?", "  fit unknown" + (
            " (the modelled part fits)" if r.get("modelled_fits") else "")))
        if r.get("dropped"):
            mark, fits = "-", "  dropped at the end"
        lines.append(f"  {mark} {r['step']:<34} {r['total_bytes'] / 2**30:6.2f} GiB{saving}{fits}")
        if r.get("dropped"):
            lines.append(f"      dropped: {r['dropped']['reason']}")
        if wording.step_lines is not None:
            lines += wording.step_lines(r, verbose)
        if r.get("cost"):
            lines.append(f"      cost: {cost_text(r['cost'])}")
            if r.get("documented"):
                lines.append(f"      documented: {r['documented']}")
            if r.get("alternatives"):
                lines.append("      also fits: " + "; ".join(f"{a['step']} ({cost_text(a['cost'])})"
                                                       for a in r["alternatives"][:4]))
    if nothing:
        lines.append("  skipped: saves nothing here: " + "; ".join(nothing))
    if folded:
        lines.append(f"  skipped, not applicable here: {', '.join(folded)} ({wording.folded_hint})")
    return "\n".join(lines)
