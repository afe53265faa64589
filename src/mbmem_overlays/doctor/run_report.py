"""The run report: what a job's memory lines say about each rank, its pipeline stage, and the run as a whole.

Pure (no torch, no Bridge): the lines are read by memlines.py, the context (layout, world size, capacity) by
parse.py. The plan against measured (``--plan``) is run_plan.py, which imports Bridge.

Rank -> pipeline stage follows megatron-core's RankGenerator (core/parallel_state.py, ``order`` default
"tp-cp-ep-dp-pp", Bridge's initialize.py passes "tp-cp-ep-pp-dp" with ``dist.use_tp_pp_dp_mapping``): a global
rank is tp + cp*TP + dp*TP*CP + pp*TP*CP*DP, so stage = rank // (world / PP); with the tp-pp-dp mapping,
stage = (rank // (TP*CP)) % PP. Only each data-parallel group's rank 0 prints its line (Bridge training_log
``get_rank(group=pg_collection.dp) == 0``; Megatron-LM report_memory ``get_data_parallel_rank() == 0``), so
TP x CP x PP ranks report.

Verdicts (each with its numbers and the line they came from):
- ``at_risk``: some rank's headroom (capacity - max reserved) is under the margin.
- ``fragmenting``: allocator retries (cudaMalloc failed, the cache was flushed and the call retried), or the
  peak reserved far above the peak allocated, or a large inactive-split peak: reserved memory that the
  allocator could not hand out. expandable_segments is the zero-cost fix (memory-tuning skill, Quick
  Decision 1).
- ``over_provisioned``: every rank keeps at least OVER_PROVISIONED of the GPU free.
- ``healthy``: none of these.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from dataclasses import replace as dataclass_replace
from typing import Any

from ..core.values import ascii_int
from . import memlines as ML

GiB = 1 << 30
# A quarter of the GPU free on every rank: room to give back the dearest documented memory savings
# (optimizer offload ~1.9-4.2x step time, full recompute ~+33% compute; costs in memory/costs.py).
OVER_PROVISIONED = 0.25
# Reserved-but-never-allocated at the peak (max reserved - max allocated), or the inactive-split peak, above
# this share of the peak reserved (and at least FRAGMENTATION_FLOOR) is fragmentation worth fixing: healthy
# Megatron runs show a few percent.
FRAGMENTATION = 0.15
FRAGMENTATION_FLOOR = GiB
TABLE_RANKS = 32      # more reporting ranks than this: the text shows one row per pipeline stage


@dataclass(frozen=True)
class RankRow:
    """One reporting rank, from its latest report."""
    key: Any                      # the rank, or "? (file)" when the line names none
    rank: int | None
    stage: int | None
    iteration: int | None
    first_iteration: int | None
    reports: int
    values: dict[str, int]
    where: str
    unit: str
    headroom: int | None          # capacity - max reserved (max allocated when reserved is not printed)
    #                               - what the device holds outside PyTorch's allocator (outside_torch)

    @property
    def early(self) -> bool:
        """Figures after iteration 1: the optimizer state has not yet been held through a whole step."""
        return self.iteration == 1

    def get(self, name: str) -> int | None:
        return self.values.get(name)

    @property
    def gap(self) -> int | None:
        a, r = self.values.get("max_allocated"), self.values.get("max_reserved")
        return None if a is None or r is None else max(0, r - a)

    @property
    def peak(self) -> int | None:
        return ML.peak_of(self.values)

    @property
    def outside_torch(self) -> int | None:
        return outside_torch(self.values)


def outside_torch(values: dict[str, int]) -> int | None:
    """Device memory PyTorch's allocator does not hold (CUDA context, NCCL and cuBLAS buffers, other processes):
    Megatron-LM's ``total device memory used`` (--log-device-memory-used: torch.cuda.device_memory_used(), NVML's
    figure for the whole device, common_utils.py report_memory) minus reserved, both read at the same moment."""
    used, reserved = values.get("device_used"), values.get("reserved")
    return None if used is None or reserved is None else max(0, used - reserved)


def headroom(capacity: int | None, values: dict[str, int]) -> int | None:
    """What is left on the GPU at the allocator's peak: capacity - peak - the memory outside the allocator (when the
    line prints the device's total use), else capacity - peak."""
    peak = ML.peak_of(values)
    if capacity is None or peak is None:
        return None
    return capacity - peak - (outside_torch(values) or 0)


@dataclass(frozen=True)
class Finding:
    kind: str            # at_risk | fragmenting | over_provisioned | healthy
    text: str            # the numbers behind it, with the line [file:line]
    rank: Any = None


@dataclass(frozen=True)
class StageMap:
    """What the log shows of the layout, enough to name each rank's pipeline stage (or why not)."""
    pp: int | None
    per_stage: int | None         # ranks per stage (tp-cp-ep-dp-pp order)
    tp_cp: int | None             # TP x CP (tp-cp-ep-pp-dp order)
    order: str
    expected: int | None          # TP x CP x PP: the ranks that print a memory line
    why: str = ""                 # when stages are unknown: what is missing

    def stage(self, rank: int | None) -> int | None:
        if rank is None or not self.pp:
            return None
        if self.pp == 1:
            return 0
        if self.order == "tp-cp-ep-pp-dp":
            return (rank // self.tp_cp) % self.pp if self.tp_cp else None
        if not self.per_stage:
            return None
        stage = rank // self.per_stage
        return stage if stage < self.pp else None


@dataclass
class RunReport:
    rows: list[RankRow]
    capacity: int | None
    capacity_source: str
    margin: float
    stages: StageMap
    unit: str                                   # display unit: "GB" (all Bridge lines) or "GiB"
    findings: list[Finding] = field(default_factory=list)
    kind: str = "healthy"
    confidence: str = "high"
    notes: list[str] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    theoretical: list = field(default_factory=list)
    planned: list[dict] = field(default_factory=list)     # --plan: per reporting rank
    plan_status: str = ""
    plan: dict = field(default_factory=dict)              # --plan: what was planned, for JSON
    left_out: dict | None = None                          # ranks not kept past memlines.MAX_RANKS (the coolest)

    @property
    def hot(self) -> RankRow | None:
        rows = [r for r in self.rows if r.peak is not None]
        if not rows:
            return None
        if self.capacity is not None:
            return min(rows, key=lambda r: (r.headroom, str(r.key)))
        return max(rows, key=lambda r: (r.peak, str(r.key)))

    def size(self, nbytes: float | None) -> str:
        return fmt_size(nbytes, self.unit)


def fmt_size(nbytes: float | None, unit: str) -> str:
    if nbytes is None:
        return "-"
    return f"{nbytes / 1e9:.5g} GB" if unit == "GB" else f"{nbytes / GiB:.2f} GiB"


def _int(f, key: str) -> int | None:
    seen = f.config.get(key)
    text = str(seen.value) if seen is not None else ""
    return ascii_int(text, 7)


def stage_map(f) -> StageMap:
    """Ranks -> pipeline stages from the layout and world size the log shows (never from the highest rank)."""
    lay = f.layout
    pp, tp, cp, dp = lay.get("pp"), lay.get("tp"), lay.get("cp"), lay.get("dp")
    if getattr(f, "bridge_summary", None) is not None:
        # Bridge's configuration summary prints only values that differ from megatron-core's defaults
        # (config.py log_non_default_values): a size it does not print is megatron-core's default, 1.
        pp, tp, cp = pp or 1, tp or 1, cp or 1
    mapping = str(getattr(f.config.get("use_tp_pp_dp_mapping"), "value", "")).lower() in ("true", "1")
    order = "tp-cp-ep-pp-dp" if mapping else "tp-cp-ep-dp-pp"
    world = f.world.value if f.world else None
    if world is None and None not in (tp, pp, dp):
        world = tp * pp * (cp or 1) * dp
    expected = tp * (cp or 1) * pp if tp and pp else None
    if not pp:
        return StageMap(None, None, None, order, expected, "the pipeline size (PP) is not in the log")
    per_stage = world // pp if world and world % pp == 0 else None
    tp_cp = tp * (cp or 1) if tp else None
    why = ""
    if pp > 1 and order == "tp-cp-ep-dp-pp" and per_stage is None:
        why = "the world size is not in the log (nor TP x CP x DP)"
    elif pp > 1 and order == "tp-cp-ep-pp-dp" and tp_cp is None:
        why = "TP is not in the log"
    return StageMap(pp, per_stage, tp_cp, order, expected, why)


def capacity_of(f, given: float | None) -> tuple[int | None, str]:
    """(bytes per GPU, where it came from): --gpu-memory, an OOM message, torch's device properties or an
    nvidia-smi table, in that order of trust."""
    if given:
        return int(given), "--gpu-memory"
    for o in f.ooms:
        if o.capacity:
            return int(o.capacity), f"the OOM message's total capacity [{o.where}]"
    if f.capacity is not None:
        return int(f.capacity.value), f"{f.capacity.line} [{f.capacity.where}]"
    return None, ""


def build(f, capacity: float | None = None, margin: float = 0.05) -> RunReport | None:
    """The report from the memory lines in ``f`` (None when there are none that can be used)."""
    unreadable = [f"{r.where}: {r.unreadable}" for r in f.memory_unreadable]
    if f.memory_unreadable_count > len(f.memory_unreadable):
        unreadable.append(f"... and {f.memory_unreadable_count - len(f.memory_unreadable)} more unreadable report(s)")
    if not f.memory:
        return None
    cap, source = capacity_of(f, capacity)
    stages = stage_map(f)
    rows = []
    for key, series in _one_process(f).items():
        r = series.latest
        rows.append(RankRow(key, r.rank, stages.stage(r.rank), r.iteration, series.first_iteration, series.reports,
                            dict(r.values), r.where, r.unit, headroom(cap, r.values)))
    rows.sort(key=lambda row: (row.rank is None, row.rank if row.rank is not None else 0, str(row.key)))
    unit = "GB" if all(row.unit == "GB" for row in rows) else "GiB"
    report = RunReport(rows, cap, source, margin, stages, unit, unreadable=unreadable,
                       theoretical=list(f.theoretical), left_out=f.memory_left_out.summary())
    _judge(report, f)
    return report


def _one_process(f) -> dict:
    """The series by rank; in a one-GPU job (world size 1) a report that names no rank is rank 0's."""
    if not (f.world and f.world.value == 1) or all(isinstance(k, int) for k in f.memory):
        return f.memory
    merged: dict = {}
    for key, series in sorted(f.memory.items(), key=lambda kv: (not isinstance(kv[0], int), str(kv[0]))):
        if not isinstance(key, int) and len([k for k in f.memory if isinstance(k, int) and k != 0]) == 0:
            key = 0
        seen = merged.get(key)
        if seen is None:
            merged[key] = series
            continue
        latest = max((seen.latest, series.latest), key=lambda r: -1 if r.iteration is None else r.iteration)
        firsts = [x for x in (seen.first_iteration, series.first_iteration) if x is not None]
        merged[key] = ML.RankSeries(dataclass_replace(latest, rank=0), min(firsts) if firsts else None,
                                    seen.reports + series.reports)
    return merged


def _judge(rep: RunReport, f) -> None:
    hot = rep.hot
    cap = rep.capacity
    out: list[Finding] = []
    s = rep.size
    if cap is not None:
        limit = rep.margin * cap
        for r in rep.rows:
            if r.headroom is not None and r.headroom < limit:
                outside = f" and {s(r.outside_torch)} outside PyTorch's allocator" if r.outside_torch else ""
                out.append(Finding("at_risk", f"{who(r)}: {s(r.peak)} {_peak_name(r)}{outside} of {s(cap)} leaves "
                                   f"{s(r.headroom)} ({r.headroom / cap:.1%}) free, under the {rep.margin:.0%} margin "
                                   f"[{r.where}]", r.key))
    for r in rep.rows:
        retries, gap, inactive, reserved = r.get("alloc_retries"), r.gap, r.get("max_inactive"), r.get("max_reserved")
        if retries:
            out.append(Finding("fragmenting", f"{who(r)}: {retries} allocator retr{'y' if retries == 1 else 'ies'} "
                               "(cudaMalloc failed, the cache was flushed and the call retried: slow, and the step "
                               f"before an OOM) [{r.where}]", r.key))
        if gap is not None and reserved and gap >= max(FRAGMENTATION * reserved, FRAGMENTATION_FLOOR):
            out.append(Finding("fragmenting", f"{who(r)}: max reserved {s(reserved)} is {s(gap)} ({gap / reserved:.0%}) "
                               f"above max allocated {s(r.get('max_allocated'))}: memory reserved but never handed "
                               f"out at the peak [{r.where}]", r.key))
        elif inactive is not None and reserved and inactive >= max(FRAGMENTATION * reserved, FRAGMENTATION_FLOOR):
            out.append(Finding("fragmenting", f"{who(r)}: inactive split blocks peaked at {s(inactive)} "
                               f"({inactive / reserved:.0%} of max reserved {s(reserved)}): free pieces too small "
                               f"to reuse [{r.where}]", r.key))
    judged = [r for r in rep.rows if r.headroom is not None]
    if cap is not None and judged and all(r.headroom >= OVER_PROVISIONED * cap for r in judged):
        out.append(Finding("over_provisioned", f"every reporting rank keeps at least {OVER_PROVISIONED:.0%} of the GPU "
                           f"free: the hot one, {who(hot)}, {s(hot.headroom)} of {s(cap)} "
                           f"({hot.headroom / cap:.0%}) [{hot.where}]", hot.key))
    kinds = [x.kind for x in out]
    rep.kind = next((k for k in ("at_risk", "fragmenting", "over_provisioned") if k in kinds), "healthy")
    if rep.kind == "healthy":
        if cap is None:
            out.append(Finding("healthy", f"the hot rank, {who(hot)}, peaked at {s(hot.peak)} {_peak_name(hot)} "
                               f"[{hot.where}]; headroom unknown: the capacity is not in the log", hot.key))
        else:
            out.append(Finding("healthy", f"the hot rank, {who(hot)}, peaked at {s(hot.peak)} {_peak_name(hot)} of "
                               f"{s(cap)}: {s(hot.headroom)} ({hot.headroom / cap:.0%}) free, above the "
                               f"{rep.margin:.0%} margin; no retries, no large reserved-unallocated gap "
                               f"[{hot.where}]", hot.key))
    rep.findings = out
    _notes(rep, f)


def _peak_name(r: RankRow) -> str:
    return "max reserved" if "max_reserved" in r.values else "max allocated" if "max_allocated" in r.values \
        else "reserved" if "reserved" in r.values else "allocated"


def who(r: RankRow | None) -> str:
    if r is None:
        return "no rank"
    name = f"rank {r.rank}" if r.rank is not None else f"the process in {str(r.key)[3:-1] or 'the log'} (no rank shown)"
    return name + (f" (PP stage {r.stage})" if r.stage is not None else "")


def _notes(rep: RunReport, f) -> None:
    notes, unknown = rep.notes, rep.unknown
    conf = "high"
    if rep.capacity is None:
        unknown.append("the GPU capacity (no OOM message, nvidia-smi table or device properties in the log): headroom "
                       "and the at_risk / over_provisioned verdicts need it; give --gpu-memory, e.g. 80GiB")
        conf = "low"
    else:
        notes.append(f"capacity {rep.size(rep.capacity)} per GPU, from {rep.capacity_source}")
    early = [r for r in rep.rows if r.early]
    if early:
        notes.append(f"{len(early)} rank(s) reported only after iteration 1 ({', '.join(str(r.key) for r in early[:8])}"
                     f"{' ...' if len(early) > 8 else ''}): those peaks do not yet include a whole step with the optimizer "
                     "state alive, so later iterations peak higher (Bridge reports again after the second iteration "
                     "for this reason: train_utils.py training_log)")
        conf = "medium" if conf == "high" else conf
    before = [r for r in rep.rows if r.iteration == 0]
    if before:
        notes.append(f"{len(before)} rank(s) reported only before the first training iteration ("
                     f"{', '.join(str(r.key) for r in before[:8])}{' ...' if len(before) > 8 else ''}): no forward, "
                     "backward or optimizer step has run, so training peaks higher")
        conf = "medium" if conf == "high" else conf
    later = [r for r in rep.rows if r.first_iteration is not None and r.iteration != r.first_iteration]
    if later:
        notes.append(f"figures are each rank's latest report (e.g. {who(later[0])} after iteration {later[0].iteration}, "
                     f"first reported after {later[0].first_iteration}): peaks only grow")
    outside = [r for r in rep.rows if r.outside_torch is not None]
    if outside:
        big = max(outside, key=lambda r: r.outside_torch)
        notes.append(f"the lines print the device's total use (--log-device-memory-used): up to {rep.size(big.outside_torch)} "
                     f"outside PyTorch's allocator ({who(big)}: CUDA context, NCCL and library buffers, other "
                     "processes), counted against the headroom")
    elif not any("device_used" in r.values for r in rep.rows):
        unknown.append("memory outside PyTorch's allocator (CUDA context, NCCL and library buffers): the headroom "
                       "counts only what the allocator reserved; Megatron-LM's --log-device-memory-used prints the "
                       "device's total use")
    if not any("max_reserved" in r.values for r in rep.rows):
        notes.append("no reserved figures were printed: headroom is measured from max allocated, which hides "
                     "fragmentation")
    world = f.world.value if getattr(f, "world", None) is not None else None
    if isinstance(world, int) and world > 0:
        beyond = [r for r in rep.rows if r.rank is not None and r.rank >= world]
        if beyond:
            notes.append(f"{len(beyond)} line(s) name a rank at or beyond the world size {world} the log shows "
                         f"({', '.join(str(r.key) for r in beyond[:8])}{' ...' if len(beyond) > 8 else ''}): from "
                         "another job or a relabelled launcher prefix; they have no pipeline stage")
            conf = "medium" if conf == "high" else conf
    st = rep.stages
    if st.pp and st.pp > 1 and st.why:
        unknown.append(f"which rank is which pipeline stage: {st.why}")
    if st.expected is not None:
        ranks = {r.rank for r in rep.rows if r.rank is not None}
        if len(ranks) < st.expected:
            notes.append(f"{len(ranks)} of the {st.expected} ranks that print a memory line (TP x CP x PP, each data-"
                         "parallel group's rank 0) reported")
        if st.pp and st.pp > 1 and not st.why:
            silent = sorted(set(range(st.pp)) - {r.stage for r in rep.rows if r.stage is not None})
            if silent:
                notes.append(f"PP stage(s) {', '.join(map(str, silent[:16]))} did not report: their memory is unknown")
            hot = rep.hot
            by_stage = stage_peaks(rep)
            if hot is not None and hot.stage is not None and len(by_stage) > 1:
                lo = min(by_stage.items(), key=lambda kv: kv[1])
                # what the layer split decides is what a stage allocates: a stage hot by its reserve alone (it
                # allocates no more than the others) is fragmenting, and moving a layer off it is no remedy
                allocated = stage_peaks(rep, "max_allocated")
                own = allocated.get(hot.stage)
                least = min(allocated.values()) if len(allocated) > 1 else None
                layers = own is not None and least is not None and own - least > 0.05 * own
                notes.append(f"PP stage {hot.stage} is the hot stage ({rep.size(by_stage[hot.stage])} vs "
                             f"{rep.size(lo[1])} on stage {lo[0]})"
                             + (": megatron-core's num_layers_in_first_pipeline_stage / "
                                "account_for_embedding_in_pipeline_split can move a layer off it"
                                if hot.stage == 0 and by_stage[0] - lo[1] > 0.05 * by_stage[0] and layers else
                                f" by its reserve, not its allocations (max allocated {rep.size(own)}, stage "
                                f"{max(allocated, key=allocated.get)} allocates the most): the allocator's "
                                "fragmentation, not the layer split" if own is not None and least is not None
                                and not layers and max(allocated, key=allocated.get) != hot.stage else ""))
    inferred = sorted({i for series in f.memory.values() for i in series.latest.inferred})
    if inferred:
        notes.append("user metric names (logger.memory_keys) read by their words: " + "; ".join(inferred[:8]))
    left_out = f.memory_left_out.summary()
    if left_out:
        notes.append(dropped_note(left_out))
    if rep.unreadable:
        conf = "medium" if conf == "high" else conf
    rep.confidence = conf


def dropped_note(left_out: dict) -> str:
    """What was left out past MAX_RANKS ranks, and why the verdict still stands."""
    ranks = (f"{left_out['ranks']:,} rank(s), ranks {left_out['first_rank']} to {left_out['last_rank']}"
             if left_out["ranks"] else "")
    unnamed = f"{left_out['unnamed']:,} file(s) of lines that name no rank" if left_out["unnamed"] else ""
    return (f"more ranks reported than the {left_out['kept']:,} kept: left out {' and '.join(x for x in (ranks, unnamed) if x)}"
            f" ({left_out['reports']:,} report(s)), those with the lowest peaks; every rank that held more is kept, so "
            "the hot rank and whether a rank is at risk are as with all ranks (fragmentation on a rank left out is "
            "not seen)")


def stage_peaks(rep: RunReport, key: str | None = None) -> dict[int, int]:
    """Each reporting stage's highest peak (``key``: that figure instead, e.g. "max_allocated")."""
    out: dict[int, int] = {}
    for r in rep.rows:
        value = r.peak if key is None else r.get(key)
        if r.stage is not None and value is not None:
            out[r.stage] = max(out.get(r.stage, 0), value)
    return out


# ----------------------------------------------------------------------------- output
def run_json(rep: RunReport) -> dict[str, Any]:
    """The ``run`` object of ``--json`` (schema in docs/doctor.md): every figure in bytes."""
    hot = rep.hot
    return {
        # rank: an int, or null for a line that names none; label: how the text names the row ("? (file)")
        "ranks": [{"rank": r.rank, "label": str(r.key), "stage": r.stage, "iteration": r.iteration,
                   "allocated_bytes": r.get("allocated"), "max_allocated_bytes": r.get("max_allocated"),
                   "reserved_bytes": r.get("reserved"), "max_reserved_bytes": r.get("max_reserved"),
                   "max_inactive_bytes": r.get("max_inactive"), "alloc_retries": r.get("alloc_retries"),
                   "device_used_bytes": r.get("device_used"), "outside_torch_bytes": r.outside_torch,
                   "headroom_bytes": r.headroom, "where": r.where} for r in rep.rows],
        "hot_rank": None if hot is None else hot.rank,
        "hot_label": None if hot is None else str(hot.key),
        "capacity_bytes": rep.capacity,
        "capacity_source": rep.capacity_source,
        "margin": rep.margin,
        "display_unit": rep.unit,
        "verdict": rep.kind,
        "confidence": rep.confidence,
        "findings": [{"kind": x.kind, "rank": x.rank if isinstance(x.rank, int) else None,
                      "label": None if x.rank is None else str(x.rank), "text": x.text} for x in rep.findings],
        "pipeline_stages": rep.stages.pp,
        "stage_order": rep.stages.order,
        "theoretical": [{"where": t.where, **{f"{k}_bytes": v for k, v in t.parts.items()}} for t in rep.theoretical],
        "unreadable": rep.unreadable,
        "ranks_left_out": rep.left_out,   # past MAX_RANKS: {ranks, unnamed, first_rank, last_rank, reports, kept}
        "planned": rep.planned,
        "plan": rep.plan,
        "plan_status": rep.plan_status or None,   # with --plan: what was planned, or why not
    }


def table(rep: RunReport) -> list[str]:
    """Per rank (or per PP stage when more than TABLE_RANKS ranks report), in the log's own unit family."""
    planned = {p["label"]: p for p in rep.planned}
    units = {r.unit for r in rep.rows}
    # The log's own unit and precision, so each figure reads as the log prints it: Bridge's GB (10^9 bytes, 5
    # significant digits), Megatron-LM's MB (MiB, 2 decimals); GiB when a run mixes the two.
    unit = "GB" if units == {"GB"} else "MiB" if units == {"MB"} else "GiB"
    width = 11 if unit != "MiB" else 12
    head = (f"  {'rank':>6} {'stage':>5} {'iter':>7} {'max alloc':>{width}} {'max resv':>{width}} "
            f"{'resv-alloc':>{width}} {'inactive':>{width}} {'retries':>7} {'headroom':>{width}}")
    if planned:
        head += f" {'planned':>{width}} {'error':>7}"
    label = {"GB": "GB, as the log prints them: 10^9 bytes", "MiB": "MiB, as the log prints them: Megatron-LM's "
             "MB are MiB", "GiB": "GiB"}[unit]
    lines = [f"per-rank memory ({label}):", head]

    def num(v: int | None) -> str:
        if v is None:
            return "-"
        return f"{v / 1e9:.5g}" if unit == "GB" else f"{v / ML.MiB:.2f}" if unit == "MiB" else f"{v / GiB:.2f}"

    rows = rep.rows
    grouped = len(rows) > TABLE_RANKS and any(r.stage is not None for r in rows)
    if grouped:
        by: dict[Any, RankRow] = {}
        for r in rows:
            k = r.stage if r.stage is not None else "?"
            if k not in by or (r.peak or 0) > (by[k].peak or 0):
                by[k] = r
        rows = [by[k] for k in sorted(by, key=lambda x: (isinstance(x, str), x if isinstance(x, int) else 0))]
        lines[0] = lines[0][:-1] + f"; one row per PP stage: its hottest of {len(rep.rows)} reporting ranks):"
    hot = rep.hot
    for r in rows:
        name = str(r.rank) if r.rank is not None else "?"
        mark = "*" if hot is not None and r.key == hot.key else " "
        retries = r.get("alloc_retries")
        line = (f" {mark}{name:>6} {'-' if r.stage is None else r.stage:>5} {'-' if r.iteration is None else r.iteration:>7} "
                f"{num(r.get('max_allocated')):>{width}} {num(r.get('max_reserved')):>{width}} {num(r.gap):>{width}} "
                f"{num(r.get('max_inactive')):>{width}} {'-' if retries is None else retries:>7} "
                f"{num(r.headroom):>{width}}")
        p = planned.get(str(r.key))
        if planned:
            line += (f" {num(p['planned_peak_bytes']):>{width}} {p['error_percent']:>+6.1f}%"
                     if p and p.get("error_percent") is not None else f" {'-':>{width}} {'-':>7}")
        lines.append(line)
    if hot is not None:
        lines.append(f"  * hot rank: {who(hot)}")
    return lines
