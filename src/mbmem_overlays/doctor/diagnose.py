"""From what the logs show to a verdict, its confidence, ranked remedies and the next command.

Decision table: nvidia-skills/nemo-mbridge-perf-memory-tuning.SKILL.md, Failure Diagnosis and Quick
Decision. Rules of honesty (issue 16):
- a number that was not read is "unknown"; the confidence is "high" only when every number the verdict
  needs was read;
- fragmentation advice (expandable_segments) only when free + reserved-but-unallocated covers the failed
  request; otherwise capacity remedies first;
- expandable_segments does not exist before torch 2.1: there the fragmentation remedy is max_split_size_mb;
- ranks killed by SIGTERM/SIGKILL after another rank's OOM are victims, not headroom;
- the world size comes from the launcher/Slurm lines, never from "the highest rank seen".
"""

from __future__ import annotations

import re
import shlex
from dataclasses import asdict, dataclass, field
from typing import Any

from ..core.text import shown
from ..core.values import ascii_int
from . import command as C
from . import patterns as P
from . import run_report as RR
from .known import CONFIG_FIXES, EXTRA_CONFIG
from .parse import OOM, Event, Findings

GiB = 1 << 30
SCHEMA_VERSION = 3   # 3: the run report (``run``), verdict "reported", kinds oom_unclassified and the run verdicts
# Exit code per verdict (docs/doctor.md, "Exit codes"): a run report is an answer (0), not "nothing found" (3).
EXIT_CODES = {"diagnosed": 0, "reported": 0, "unreadable": 2, "no_oom": 3, "unsure": 4}
# "Barely": after serving the request, free + reserved-but-unallocated would keep less than this share of the
# GPU, while allocated + the request reach NEAR_CAPACITY of it (issue 23 §3: say both, medium confidence).
BARELY = 0.05
NEAR_CAPACITY = 0.90

# Costs as documented (memory/costs.py holds the same numbers with their sources; kept as text here so the
# default doctor never imports the memory layer).
COST = {
    "expandable_segments": "zero throughput cost (memory-tuning skill, Quick Decision 1)",
    "max_split_size_mb": "no model change; may cost some allocator reuse (PyTorch CUDA semantics, memory management)",
    "sequence_parallel": "no extra communication volume (reduce-scatter/all-gather replace all-reduce)",
    "selective_recompute": "small for core_attn; ~16% for mlp on Llama3-70B (activation-recompute skill)",
    "micro_batch": "fewer samples per micro-step: lower GEMM efficiency, same global batch",
    "dist_optimizer": "~1-2% (memory-tuning skill, Parallelism resizing)",
    "full_recompute": "~+33% compute (activation-recompute skill, Full-layer recompute)",
    "cpu_offload": "PCIe transfer per offloaded layer (cpu-offloading skill)",
    "optimizer_offload": "~1.9x step time at 25%, ~4.2x at 100% (cpu-offloading skill, Known Limitations)",
    "precision_aware_optimizer": "no documented throughput cost; bf16 moments are a convergence choice (TE FusedAdam)",
    "megatron_fsdp": "'varies' (memory-tuning skill, Parallelism resizing): weight all-gathers and gradient "
                     "reduce-scatters per layer (megatron-fsdp skill)",
    "fine_grained_offload": "PCIe copies of the offloaded inputs, overlapped with compute; host memory for every "
                            "in-flight microbatch (cpu-offloading skill, Known Limitations)",
}


@dataclass
class Diagnosis:
    kind: str            # fragmentation | capacity | other_processes | nccl | workspace | driver | registration |
    #                      host_oom | configuration | allocator_unknown | oom_unclassified | none | unreadable |
    #                      the run verdicts: healthy | at_risk | fragmenting | over_provisioned
    verdict: str         # diagnosed | reported | unsure | no_oom | unreadable
    summary: str
    confidence: str      # high | medium | low
    next_command: str | None
    command_check: str
    reasons: list[str]
    remedies: list[dict]
    why_not: list[str]
    notes: list[str]
    unknown: list[str]
    evidence: list[str]
    ranks: dict
    rank: int | None = None
    also: list[str] = field(default_factory=list)
    savings: str = ""
    run: dict | None = None          # the run report (run_report.run_json) when the log has memory lines
    run_lines: list[str] = field(default_factory=list)   # its text: the per-rank table and notes
    schema_version: int = SCHEMA_VERSION

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]


def gib(n: float | None) -> str:
    return "unknown" if n is None else f"{n / GiB:.2f} GiB"


def _alloc_in_effect(f) -> str | None:
    """The allocator setting torch read in the job: of the variables the log shows, the one torch 2.14.1 reads first
    (PYTORCH_CUDA_ALLOC_CONF, even empty; core/allocconf.py), so a remedy merges into what was in effect."""
    from ..core import allocconf
    seen = {var: s.value for var, s in f.alloc_conf.items()}
    var = allocconf.var_in_effect(seen)
    return seen[var] if var is not None else None


def at(where: str) -> str:
    return f"[{where}]"


def rank_text(rank: int | None) -> str:
    return f"rank {rank}" if rank is not None else "the failing process (rank not shown in the log)"


@dataclass
class Context:
    """What the log says about the job, with where it says it."""
    torch: tuple[int, int] | None
    torch_where: str
    torch_from_format: str        # "" (the log prints the version), or the range the OOM wording dates: "<= 2.0"
    expandable: bool
    expandable_source: str
    overlays: list[str]
    launch: C.Launch
    world: int | None
    world_where: str
    run_plan: Any = None          # run_plan.RunPlan with --plan on a log with memory lines
    recipe: str | None = None     # --recipe, or the one the log shows

    @property
    def expandable_exists(self) -> bool | None:
        return None if self.torch is None else self.torch >= (2, 1)


def launch_problem(text: str | None) -> str | None:
    """Why the launch command seen in the log may not be reused for a printed command (issue 22 #2b, #9): it
    holds characters a terminal would act on, or a recipe word that is not a recipe name."""
    if not text:
        return None
    if shown(text) != text:
        return "it holds control or bidirectional characters"
    if "${" in text:   # the one rule for values (core/values.py): train.py refuses it, and a shell would expand it
        return "it holds an interpolation (${...}), which train.py refuses in a value"
    try:
        words = shlex.split(text)
    except ValueError:
        words = text.split()
    from ..bridge.recipes import recipe_name_problem
    for w in words:
        key, sep, value = w.partition("=")
        if sep and key.lstrip("+") in ("recipe", "recipe.function") and recipe_name_problem(value) is not None:
            return f"its recipe {value!r} is not a recipe name"
    return None


def _context(f: Findings, recipe: str | None, catalog) -> Context:
    text = f.command.value if f.command else None
    refused = launch_problem(text)
    if refused:
        f.problems.append(f"the launch command in the log [{f.command.where}] is not reused: {refused}")
        text = None
    launch = C.parse_launch(text, f.command.where if text else "", recipe or f.recipe)
    if recipe and launch.kind == "template":
        launch = C.parse_launch(None, "", recipe)
    overlays = [catalog.aliases.get(o, o) if catalog else o for o in C.overlays_in(launch)]  # canonical names
    torch, torch_where, from_format = None, "", ""
    if f.torch_version:
        torch, torch_where = f.torch_version.value, f.torch_version.where
    else:  # the message format itself dates the torch release (ecosystem-notes.md, the PyTorch OOM message)
        # from_format: the release range the wording dates ("<= 2.0", ">= 2.1"), not one release
        for o in f.ooms:
            if o.format.startswith("torch <="):
                torch, torch_where = (2, 0), o.where
                from_format = "<= 1.3" if "cached" in o.format else "<= 2.0"
                break
            if o.format.startswith("torch 2.1") or o.format == "torch >= 2.1":
                torch, torch_where, from_format = (2, 1), o.where, ">= 2.1"
    conf = {var: s for var, s in f.alloc_conf.items()}
    expandable, source = False, ""
    for var, seen in conf.items():
        if "expandable_segments:True" in seen.value.split(","):
            expandable, source = True, f"{var}={seen.value} set in the job's environment {at(seen.where)}"
    if "expandable_segments" in overlays:
        expandable = True
        source = f"overlay +mem=expandable_segments on the launch command {at(launch.where)}" + (
            f"; also {source}" if source else "")
    world = f.world.value if f.world else None
    return Context(torch, torch_where, from_format, expandable, source, overlays, launch, world,
                   f.world.where if f.world else "", recipe=recipe or f.recipe)


# ----------------------------------------------------------------------------- allocator OOM numbers
def other_processes(o: OOM) -> tuple[int | None, str]:
    """Bytes other processes hold on this GPU, and how that was decided. PyTorch lists every process NVML
    reports, itself as "this process" unless a PID namespace (a container) hides it (c10 CUDACachingAllocator)."""
    if not o.processes:
        return None, "no per-process list in the message (NVML unavailable or the line was cut)"
    total = sum(b or 0 for _, b in o.processes)
    if o.self_in_use is not None:
        return total, "every 'Process N' listed is another process"
    if len(o.processes) == 1:
        return 0, f"the only process listed (PID {o.processes[0][0]}) is taken to be this one, seen from a container"
    reserved = (o.allocated + o.reserved_unallocated) if None not in (o.allocated, o.reserved_unallocated) else None
    if reserved is not None:
        own = min(o.processes, key=lambda p: abs((p[1] or 0) - reserved))
        how = f"PID {own[0]} is taken to be this process (closest to PyTorch's {gib(reserved)} reserved)"
    else:
        own = max(o.processes, key=lambda p: p[1] or 0)
        how = f"PID {own[0]} (the largest) is taken to be this process"
    return total - (own[1] or 0), how


def assess(o: OOM, expandable: bool) -> tuple[str, list[str], list[str]]:
    """(fragmentation | capacity | other_processes | unknown, reasons with citations, numbers not read)."""
    missing = [n for n, v in (("the requested size", o.requested), ("the free memory", o.free),
                              ("reserved-but-unallocated", o.reserved_unallocated)) if v is None]
    where = at(o.where)
    who = rank_text(o.rank)
    reasons: list[str] = []
    others, how = other_processes(o)
    if o.allowed is not None:
        reasons.append(f"{who}: the process was limited to {gib(o.allowed)} by set_per_process_memory_fraction {where}")
    if missing and o.requested is not None and o.capacity and o.requested > o.capacity:
        # whatever the cut-off numbers were, no allocator state serves a request above the whole GPU
        return "capacity", reasons + [f"{who}: the {gib(o.requested)} request is more than the GPU's whole "
                                      f"{gib(o.capacity)} capacity {where}"], []
    if missing:
        return "unknown", [f"{who}: the message does not show {', '.join(missing)} {where}"
                           + (" (truncated)" if o.partial else "")] + reasons, missing
    avail = o.free + o.reserved_unallocated
    if expandable:
        reasons.append(f"{who}: OOM with expandable_segments already on: {gib(o.requested)} requested, "
                       f"{gib(o.free)} free + {gib(o.reserved_unallocated)} reserved-but-unallocated {where}")
        if others and others >= GiB and avail + others >= o.requested:
            return "other_processes", reasons + [f"other processes hold {gib(others)} on this GPU ({how}) {where}"], []
        return "capacity", reasons, []
    if avail >= o.requested:
        reasons.append(f"{who}: {gib(o.free)} free + {gib(o.reserved_unallocated)} reserved-but-unallocated = "
                       f"{gib(avail)} >= the {gib(o.requested)} request: the memory exists but is fragmented {where}")
        if o.capacity and o.allocated is not None and avail - o.requested < BARELY * o.capacity \
                and o.allocated + o.requested >= NEAR_CAPACITY * o.capacity:
            reasons.append(f"{who}: but only barely ({gib(avail - o.requested)} would be left) while {gib(o.allocated)} "
                           f"of {gib(o.capacity)} is allocated: fragmentation caused this failure; capacity is next: "
                           f"the next allocation of this size will fail too {where}")
            return "both", reasons, []
        return "fragmentation", reasons, []
    shortfall = o.requested - avail
    reasons.append(f"{who}: {gib(o.free)} free + {gib(o.reserved_unallocated)} reserved-but-unallocated = {gib(avail)} "
                   f"< the {gib(o.requested)} request (short by {gib(shortfall)}): defragmenting cannot serve it {where}")
    if others is not None and others >= GiB and avail + others >= o.requested:
        reasons.append(f"other processes hold {gib(others)} on this GPU ({how}); without them the request fits {where}")
        return "other_processes", reasons, []
    if others:
        reasons.append(f"other processes hold {gib(others)} on this GPU ({how}) {where}")
    return "capacity", reasons, []


# ----------------------------------------------------------------------------- evidence from config values
def _flag(f: Findings, key: str) -> bool | None:
    seen = f.config.get(key)
    if seen is None:
        return None
    v = str(seen.value).lower()
    return True if v in ("true", "1", "yes") else False if v in ("false", "0", "no", "none", "null") else None


def _int(f: Findings, key: str) -> int | None:
    seen = f.config.get(key)
    return ascii_int(str(seen.value), 8) if seen is not None else None


def config_notes(f: Findings, ctx: Context) -> list[str]:
    """Settings in the log that cannot be what the user meant, or that decide the remedies."""
    notes = []
    offload, layers = _flag(f, "cpu_offloading"), _int(f, "cpu_offloading_num_layers")
    if offload and layers == 0:
        s = f.config["cpu_offloading_num_layers"]
        cited = " ".join(dict.fromkeys(at(w) for w in (f.config["cpu_offloading"].where, s.where)))
        notes.append(f"CPU offloading is enabled but cpu_offloading_num_layers is 0: it offloads nothing "
                     f"{cited}; set mem.cpu_offload.num_layers to >= 1 "
                     "(it must stay below num_layers) or drop the overlay")
    rg = f.config.get("recompute_granularity")
    # recompute_modules None is megatron-core's default, ["core_attn"] (TransformerConfig.__post_init__,
    # transformer_config.py:1763-1764): only an empty list recomputes nothing
    if rg and str(rg.value).lower() == "selective" and str(f.config.get("recompute_modules", rg).value) == "[]":
        notes.append(f"recompute_granularity is selective with no recompute_modules: nothing is recomputed {at(rg.where)}")
    tp = f.layout.get("tp")
    if tp and tp > 1 and _flag(f, "sequence_parallel") is False:
        notes.append(f"TP={tp} with sequence_parallel off {at(f.config['sequence_parallel'].where)}: the LayerNorm/"
                     "dropout activations are replicated on every TP rank")
    if _flag(f, "cpu_offloading") and f.layout.get("pp", 1) > 1:
        notes.append(f"CPU offloading with PP={f.layout['pp']} > 1 {at(f.layout_where['pp'])}: megatron-core refuses it")
    return notes


# ----------------------------------------------------------------------------- remedies
def capacity_remedies(f: Findings, ctx: Context) -> list[C.Remedy]:
    """The memory-tuning skill's ladder (Quick Decision 2-7, Failure Diagnosis 'genuine capacity limit'),
    minus what the log shows is already on or cannot work here."""
    out: list[C.Remedy] = []
    have = set(ctx.overlays)
    rg = str(f.config["recompute_granularity"].value).lower() if "recompute_granularity" in f.config else None
    tp, pp, dp = f.layout.get("tp"), f.layout.get("pp"), f.layout.get("dp")
    offload, layers = _flag(f, "cpu_offloading") or "cpu_offload" in have, _int(f, "cpu_offloading_num_layers")
    if offload and layers == 0:  # what the user meant: offload something (the log shows 0 layers)
        out.append(C.Remedy("cpu_offload", "make CPU offloading offload something: num_layers 0 -> 1",
                            overlay="cpu_offload", params={"num_layers": 1}, cost=COST["cpu_offload"]))
    if offload:  # core/rules offload.py cpu_offload_recompute: activation offloading excludes recompute
        rg = "excluded"
    if tp and tp > 1 and _flag(f, "sequence_parallel") is False and "sequence_parallel" not in have:
        out.append(C.Remedy("sequence_parallel", f"turn sequence parallelism on (TP={tp})", overlay="sequence_parallel",
                            cost=COST["sequence_parallel"]))
    if rg not in ("selective", "full", "excluded") and not have & {"selective_recompute", "full_recompute"}:
        out.append(C.Remedy("selective_recompute", "recompute the narrowest module in backward (selective recompute)",
                            overlay="selective_recompute", cost=COST["selective_recompute"]))
    mbs = _int(f, "micro_batch_size")
    if mbs and mbs > 1:
        out.append(C.Remedy("micro_batch", f"halve the micro-batch ({mbs} -> {mbs // 2}); activations scale with it",
                            overrides={"train.micro_batch_size": mbs // 2}, cost=COST["micro_batch"]))
    if _flag(f, "use_distributed_optimizer") is not True and "dist_optimizer" not in have \
            and (dp is None or dp > 1):
        out.append(C.Remedy("dist_optimizer", "shard optimizer state across data-parallel ranks",
                            overlay="dist_optimizer", cost=COST["dist_optimizer"]))
    # issue 31: after the distributed optimizer, halve Adam's moments, then shard gradients and weights too (the
    # memory-tuning skill's Parallelism resizing: FSDP beside the distributed optimizer); activations: module-level
    # offloading before full recompute (it works with PP > 1 and with selective recompute: cpu-offloading skill)
    if _flag(f, "use_precision_aware_optimizer") is not True and "precision_aware_optimizer" not in have:
        out.append(C.Remedy("precision_aware_optimizer", "keep Adam's moments in bf16 (precision-aware optimizer)",
                            overlay="precision_aware_optimizer", cost=COST["precision_aware_optimizer"]))
    if _flag(f, "use_megatron_fsdp") is not True and "megatron_fsdp" not in have and (dp is None or dp > 1):
        out.append(C.Remedy("megatron_fsdp", "shard gradients and weights too across data-parallel ranks (Megatron "
                            "FSDP)", overlay="megatron_fsdp", cost=COST["megatron_fsdp"]))
    if rg not in ("full", "excluded") and _flag(f, "fine_grained_activation_offloading") is not True \
            and "fine_grained_offload" not in have:
        out.append(C.Remedy("fine_grained_offload", "offload the attention's saved inputs to host memory "
                            "(fine-grained activation offloading)", overlay="fine_grained_offload",
                            params={"modules": "[qkv_linear,core_attn,attn_proj]"}, cost=COST["fine_grained_offload"]))
    if rg not in ("full", "excluded") and "full_recompute" not in have:
        out.append(C.Remedy("full_recompute", "recompute whole layers (full recompute)", overlay="full_recompute",
                            remove_overlays=("selective_recompute",), cost=COST["full_recompute"]))
    if pp == 1 and not offload and "cpu_offload" not in have:
        out.append(C.Remedy("cpu_offload", "offload one layer's activations to the CPU (PP=1)", overlay="cpu_offload",
                            cost=COST["cpu_offload"]))
    if _flag(f, "optimizer_cpu_offload") is not True and "optimizer_offload" not in have:
        out.append(C.Remedy("optimizer_offload", "keep optimizer state on the CPU (last resort)",
                            overlay="optimizer_offload", cost=COST["optimizer_offload"]))
    return out


def defrag_remedy(ctx: Context, f: Findings) -> C.Remedy:
    current = _alloc_in_effect(f)
    if ctx.torch is not None and ctx.torch < (1, 10):  # max_split_size_mb arrived in torch 1.10
        return C.Remedy("upgrade_torch", f"torch {ctx.torch[0]}.{ctx.torch[1]} has neither expandable_segments nor "
                        "max_split_size_mb: upgrade torch (>= 2.1 for expandable_segments)", cost="an upgrade",
                        command="pip install 'torch>=2.1'", command_note="an upgrade, not a training command")
    if ctx.expandable_exists is False:
        return C.Remedy("max_split_size_mb", f"torch {ctx.torch[0]}.{ctx.torch[1]} predates expandable_segments "
                        "(torch >= 2.1): stop the allocator splitting large blocks with max_split_size_mb, or upgrade "
                        "torch and use expandable_segments",
                        env=C.merged_alloc_env(current, "max_split_size_mb", "512"), cost=COST["max_split_size_mb"])
    if ctx.launch.kind in ("train.py", "template"):
        return C.Remedy("expandable_segments", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the overlay merges it "
                        "with your other allocator keys)", overlay="expandable_segments",
                        cost=COST["expandable_segments"])
    return C.Remedy("expandable_segments", "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
                    env=C.merged_alloc_env(current, "expandable_segments", "True"), cost=COST["expandable_segments"])


def nccl_remedies(f: Findings, ctx: Context) -> list[C.Remedy]:
    # NCCL environment variables (NCCL docs, Environment Variables): NCCL_BUFFSIZE (4 MiB default per
    # channel and peer), NCCL_NVLS_ENABLE (NVLink SHARP buffers, large on NVSwitch systems), channels.
    nvls = f.nvls is not None
    out = [C.Remedy("nccl_nvls_off", "disable NVLink SHARP: its buffers are the largest NCCL allocation on "
                    "NVSwitch systems", env={"NCCL_NVLS_ENABLE": "0"}, cost="NVLS speeds all-reduce on NVSwitch; "
                    "small-to-moderate collective slowdown"),
           C.Remedy("nccl_buffsize", "halve NCCL's per-channel buffers (NCCL_BUFFSIZE, 4 MiB default)",
                    env={"NCCL_BUFFSIZE": "2097152"}, cost="slightly lower bandwidth on large messages"),
           C.Remedy("fewer_communicators", "create fewer communicators: every process group (TP, PP, DP, CP, EP and "
                    "their combinations) allocates its own NCCL buffers; drop extra groups (e.g. ddp.nccl_ub, "
                    "TP-comm-overlap) or reduce the parallel dimensions that are > 1", cost="depends on the feature")]
    if nvls:
        out[0].action += f" (NVLS is in use {at(f.nvls.where)})"
    else:
        out[0], out[1] = out[1], out[0]
    return out


def registration_remedy(f: Findings, ctx: Context) -> tuple[C.Remedy, list[str]]:
    """NCCL user buffers + expandable segments (memory-tuning skill, Failure Diagnosis; core/rules allocator.py
    expandable_segments_nccl_ub; NeMo's PerfEnvPlugin drops expandable_segments in this case: ecosystem-notes.md)."""
    who = []
    if ctx.expandable:
        who.append(f"expandable_segments was set by: {ctx.expandable_source}")
    else:
        who.append("expandable_segments:True was not seen in the log (it may come from the recipe's env_vars or the "
                   "container's environment)")
    ub = f.config.get("nccl_ub")
    ub_cmd = next((a for a in ctx.launch.args if "nccl_ub" in a or a == "--use-nccl-ub"), None)
    if ub_cmd:
        who.append(f"NCCL user buffers were turned on by `{ub_cmd}` on the launch command {at(ctx.launch.where)}")
    elif ub is not None:
        who.append(f"NCCL user buffers: nccl_ub={ub.value} in the printed config {at(ub.where)} (the recipe's setting)")
    else:
        who.append("ddp.nccl_ub was not printed in the log (the recipe or a launcher default set it)")
    if "expandable_segments" in ctx.overlays:
        r = C.Remedy("drop_expandable", "drop the expandable_segments overlay and keep NCCL user buffers",
                     remove_overlays=("expandable_segments",), cost="fragmentation relief is lost")
    elif ctx.expandable and f.alloc_conf:
        current = _alloc_in_effect(f) or ""
        r = C.Remedy("drop_expandable", "run without expandable_segments:True in PYTORCH_CUDA_ALLOC_CONF and keep NCCL "
                     f"user buffers (remove it where it is set {at(ctx.expandable_source.split('[')[-1].rstrip(']'))})",
                     env=C.alloc_env_without(current, "expandable_segments"), cost="fragmentation relief is lost")
    else:
        r = C.Remedy("nccl_ub_off", "turn NCCL user buffers off", overrides={"ddp.nccl_ub": False},
                     cost="loses the user-buffer communication speed-up")
    return r, who


# ----------------------------------------------------------------------------- the diagnosis
def diagnose(f: Findings, recipe: str | None = None, planner: Any = None, *, capacity: float | None = None,
             margin: float = 0.05, run_planner: Any = None, overlay_dirs: list[str] | None = None,
             replan: str | None = None) -> Diagnosis:
    """``planner``: optional callable (remedies, ctx, findings) -> (remedies with savings, status text,
    full validator) from plan.py, used only with --plan (it imports Bridge). ``run_planner``: optional
    callable (report, ctx, findings, remedies) -> priced remedies, from run_plan.py (--plan). ``capacity``
    (--gpu-memory) and ``margin`` judge the run report; ``overlay_dirs`` (--overlay-dir) is where user
    overlays are found, and printed commands carry it; ``replan`` is this doctor command with --plan, the
    next command of a report that needs the memory model to size its advice."""
    from ..core.catalog import user_dirs
    dirs = [str(d) for d in user_dirs(overlay_dirs)]
    catalog, catalog_error = C.load_catalog(overlay_dirs)
    ctx = _context(f, recipe, catalog)
    report = RR.build(f, capacity, margin)
    priced: dict = {}
    ranks: dict[str, dict] = {}
    for i, o in enumerate(f.ooms):  # several messages of one rank, or without a rank, keep one key each
        key = str(o.rank) if o.rank is not None else "unknown"
        key = key if key not in ranks else f"{key}#{i}"
        ranks[key] = {k: v for k, v in asdict(o).items() if k != "rank"}
    notes = config_notes(f, ctx)
    why_not = _why_not(f)
    victims = _victims(f)
    base = {"why_not": why_not, "notes": notes, "evidence": f.evidence, "ranks": ranks}

    def done(kind, verdict, summary, confidence, reasons, remedies, unknown=(), rank=None, also=(), next_cmd=None,
             check_text=None, want_command=True):
        reasons = list(reasons) + _world_reasons(f, ctx, victims)
        cmd, check, savings = next_cmd, "", ""
        if verdict == "reported":
            validator = None
            if remedies and run_planner is None and any(r.overlay or r.overrides or r.remove_overlays for r in remedies):
                savings = ("not sized: add --plan (imports Megatron Bridge) to put the memory model's new peak on the "
                           "hot rank next to each change and validate its command on the recipe")
        elif remedies and planner is not None:
            remedies, savings, validator = planner(remedies, ctx, f)
        else:
            validator = None
            if remedies and kind in ("capacity", "workspace", "other_processes", "nccl", "driver", "host_oom"):
                savings = ("savings not computed: run `mbmem doctor --plan ...` with Megatron Bridge installed to "
                           "compute what each remedy saves for this recipe and layout")
                name = recipe or f.recipe
                cap = next((o.capacity for o in f.ooms if o.capacity), None) or capacity
                if _megatron_job_only(ctx, f) and replan:
                    savings = (f"savings not computed: `{replan}` plans the job from its own Megatron-LM arguments "
                               f"({_megatron_job_only(ctx, f)}), prices each remedy and prints it as the job's "
                               "flags, validated by megatron-core")
                elif name:  # every word quoted: the recipe and sizes reach a command the user pastes (issue 22 #2b)
                    hint = C.render_tokens(["mbmem", *(a for d in (overlay_dirs or []) for a in ("--overlay-dir", d)),
                                            "recommend", "--recipe", name, "--world-size", str(ctx.world or "<N>"),
                                            "--gpu-memory", f"{cap / GiB:.2f}GiB" if cap else "<SIZE>"])
                    savings += f", or `{hint}`"
        if not want_command:
            pass
        elif remedies and cmd is None and (remedies[0].command or remedies[0].megatron is not None):
            # a Megatron-LM job's remedies carry their own validated flags (None: none could be written)
            cmd, check = remedies[0].command, remedies[0].command_note or (
                "not a training command: nothing to validate" if remedies[0].command else
                f"no remedy could be written as the job's flags: {remedies[0].megatron.get('reason')}")
        elif remedies and cmd is None and planner is None and replan and _megatron_job_only(ctx, f):
            cmd, check = replan, (f"a Megatron-LM job ({_megatron_job_only(ctx, f)}), not a Bridge recipe: --plan "
                                  "prices each remedy on its own arguments and prints the job's flags to change, "
                                  "validated by megatron-core (imports Megatron Bridge)")
        elif remedies and cmd is None and _megatron_job_only(ctx, f):
            # --plan could not read the job: its flags cannot be written or checked, and a train.py command is for a
            # Bridge recipe only
            cmd, check = None, (f"no command: a Megatron-LM job ({_megatron_job_only(ctx, f)}) whose arguments "
                                "megatron-core 0.19.2 does not accept (see savings); the remedies name what to change")
        elif remedies and cmd is None:
            cmd, check = _next_command(ctx, remedies[0], catalog, catalog_error, f, validator, dirs)
        elif cmd:
            check = check_text or "not a training command: nothing to validate"
        # "not first" is advice against remedies for an OOM: none when nothing failed
        fields = base if verdict in ("diagnosed", "unsure") else {**base, "why_not": []}
        return Diagnosis(kind, verdict, summary, confidence, cmd, check, reasons,
                         [_remedy_dict(r, priced.get(id(r))) for r in remedies],
                         unknown=list(unknown), rank=rank, also=list(also), savings=savings, **fields)

    if report is not None and run_planner is not None:
        ctx.run_plan = run_planner(report, ctx, f)
    d = _pick(f, ctx, done, victims, report, priced, replan)
    if report is not None:
        d.run = RR.run_json(report)
        d.run_lines = run_lines(report)
    return d


def _pick(f: Findings, ctx: Context, done, victims, report, priced, replan) -> Diagnosis:
    """The first family that claims the log, in order of how certain its evidence is; then the run report."""
    if f.config_errors:
        return _configuration(f, ctx, done)
    regs = [e for e in f.events if e.family == "registration"]
    if regs:
        remedy, who = registration_remedy(f, ctx)
        e = regs[0]
        return done("registration", "diagnosed", "NCCL user-buffer registration failed: NCCL user buffers and "
                    "expandable segments are incompatible (memory-tuning skill, Failure Diagnosis)",
                    "high" if ctx.expandable else "medium",
                    [f"{rank_text(e.rank)}: {e.detail} failed {at(e.where)}", *who,
                     ("fix: turn one of them off (NeMo's PerfEnvPlugin drops expandable_segments when NCCL user "
                     "buffers are on: ecosystem-notes.md)")],
                    [remedy], rank=e.rank, also=_also(f, "registration"))
    engine = [e for e in f.events if e.family == "engine"]
    if engine and not f.ooms:
        return _engine(f, ctx, done, engine[0])
    device_events = [e for e in f.events if e.family in ("nccl", "workspace", "driver")]
    if f.ooms:
        return _allocator(f, ctx, done, victims)
    if device_events:
        return _device_event(f, ctx, done, device_events)
    host = [e for e in f.events if e.family in ("host_oom", "host_killed", "sigkill")]
    other_failure = [s for s in f.failed_ranks.values() if s.value not in (-9, -15, 137, 143, 0)]
    if host and not any(e.family != "sigkill" for e in host) and other_failure:
        host = []  # SIGKILLed after another rank failed for another reason: victims, not a host OOM
    if host:
        return _host(f, ctx, done, host)
    oom_like = [e for e in f.events if e.family == "oom_like"]
    if oom_like:
        return _oom_like(f, ctx, done, oom_like)
    if report is not None:
        return _run(f, ctx, done, report, priced, replan)
    return _nothing(f, done)


def _nothing(f: Findings, done) -> Diagnosis:
    """No OOM: "high" only for a log that reached the end of training and was read whole (issue 23 §3)."""
    msg = "no CUDA/HIP out-of-memory message, OOM-killer record or known configuration error found"
    cut = f.unreadable or f.incomplete
    if cut:
        d = done("unreadable", "unreadable", msg + f" in what could be read; {cut} input(s) could not be read (whole)"
                 + (f" ({'; '.join(f.problems)})" if f.problems else ""), "low",
                 ["nothing can be ruled out for the part that was not read: exit 2, as for unreadable input"], [])
        return d
    reasons, conf = [], "medium"
    if f.ended is not None and f.bytes_read and not f.long_lines:
        reasons.append(f"the log reached the end of training normally ({f.ended.value}) {at(f.ended.where)}")
        conf = "high"
    elif f.bytes_read:
        reasons.append("the log does not show the end of training (\"after training is done\"): it may still be "
                       "running, be cut, or have stopped for another reason, so an OOM after its last line cannot be "
                       "ruled out")
    if f.long_lines:
        reasons.append("some lines were too long to read whole")
    if f.oom_mentions:
        where, line = f.oom_mentions[0]
        reasons.append(f"{len(f.oom_mentions)} line(s) mention OOM without reporting one, e.g. {at(where)}: {line[:160]}")
        conf = "medium"
    return done("none", "no_oom", msg + (f" ({'; '.join(f.problems)})" if f.problems else ""), conf, reasons, [])


def _oom_like(f: Findings, ctx: Context, done, events: list[Event]) -> Diagnosis:
    """A line says out of memory in a wording no family reads (issue 23 §3): an OOM, unsure, with the numbers
    the line shows."""
    e = events[0]
    sizes = [f"{m.group(1)} {m.group(2)}" for m, _ in zip(re.finditer(P.SIZE, e.line), range(8))]
    reasons = [f"{rank_text(e.rank)}: {e.detail!r} {at(e.where)}: a line that says the job ran out of memory, in a "
               "wording the doctor has no reader for",
               ("numbers on the line: " + ", ".join(sizes)) if sizes else "no sizes on the line"]
    if len(events) > 1:
        reasons.append(f"{len(events) - 1} more such line(s), e.g. {at(events[1].where)}")
    if "OutOfRes" in e.detail or "out of resource" in e.detail.lower():
        reasons.append("a Triton 'out of resource' error is usually a kernel asking for more shared memory per block "
                       "than the GPU has: a smaller block size or num_stages for that kernel, not a memory overlay")
        return done("oom_unclassified", "unsure", "out of resources in a Triton kernel (shared memory, not GPU "
                    "memory, unless the line says otherwise)", "low", reasons, [], rank=e.rank, also=_also(f, "oom_like"))
    remedies = [defrag_remedy(ctx, f)] + capacity_remedies(f, ctx)
    reasons.append("first step: the zero-cost fragmentation fix, then the capacity ladder; the memory lines or the "
                   "full error message would tell which")
    return done("oom_unclassified", "unsure", "out of memory (the line does not show the numbers needed for a "
                "verdict)", "low", reasons, remedies, ["the requested size", "the free memory",
                                                      "reserved-but-unallocated"], e.rank, _also(f, "oom_like"))


def run_lines(rep: RR.RunReport) -> list[str]:
    lines = RR.table(rep)
    for t in rep.theoretical[:2]:
        parts = ", ".join(f"{k.replace('_', ' ')} {rep.size(v)}" for k, v in t.parts.items())
        lines.append(f"the job's own estimate (printed once, for the first pipeline stage): {parts} {at(t.where)}")
    if rep.plan_status:
        lines.append(f"plan: {rep.plan_status}")
    return lines


def _run(f: Findings, ctx: Context, done, rep: RR.RunReport, priced: dict, replan: str | None) -> Diagnosis:
    """No OOM, and memory lines: the run report's verdict, its numbers, and advice in both directions."""
    hot = rep.hot
    reasons = [x.text for x in rep.findings if x.kind == rep.kind][:12]
    also = [f"{x.kind}: {x.text}" for x in rep.findings if x.kind != rep.kind][:8]
    reasons += rep.notes
    unknown = list(rep.unknown)
    if rep.unreadable:
        unknown.append(f"{len(rep.unreadable)} memory report(s) could not be used: {rep.unreadable[0]}")
    summary = {"at_risk": "at risk: a rank is within the margin of its GPU's capacity",
               "fragmenting": "fragmenting: the allocator reserves memory it cannot hand out",
               "over_provisioned": "over-provisioned: every rank has room to spare; memory savings that cost "
                                   "throughput can be given back",
               "healthy": "healthy: no rank is near capacity and the allocator is not fragmenting"
                          if rep.capacity is not None else
                          "healthy as far as the log shows: the allocator is not fragmenting; whether a rank is near "
                          "capacity is unknown without the GPU's capacity (give --gpu-memory)"}[rep.kind]
    summary = f"{summary}; hot rank: {RR.who(hot)}"
    if rep.kind == "at_risk":
        remedies = ([defrag_remedy(ctx, f)] if "fragmenting" in [x.kind for x in rep.findings] and not ctx.expandable
                    else []) + capacity_remedies(f, ctx)
    elif rep.kind == "fragmenting":
        if ctx.expandable:
            reasons.append(f"expandable_segments is already on ({ctx.expandable_source}): the allocator still "
                           "retries or holds unused reserved memory; treat it as capacity pressure")
            remedies = capacity_remedies(f, ctx)
        else:
            remedies = [defrag_remedy(ctx, f)]
    elif rep.kind == "over_provisioned":
        remedies = turn_off_remedies(f, ctx)
        if not remedies:
            reasons.append("nothing that costs throughput is on in what the log shows (no recompute, no offload, "
                           "TP = PP = 1 or not shown): the room is for a larger micro-batch or sequence")
    else:
        remedies = []
    plan = ctx.run_plan
    if plan is not None and remedies:
        results = plan.price(remedies, rep)
        for r, res in zip(remedies, results):
            priced[id(r)] = res
        # the changes validated and predicted to fit, cheapest first by the cost model (memory/cost/ rank_key; a
        # turn-off's cost is negative: the largest gain first), then the others in their documented order
        order = {id(r): i for i, r in enumerate(remedies)}

        def key(r):
            res = priced[id(r)]
            ok = bool(res.get("command") and res.get("fits") and res.get("step_cost"))
            return (0, tuple(res["step_cost"]["rank_key"]), order[id(r)]) if ok else (1, (0.0, 0.0), order[id(r)])
        remedies = sorted(remedies, key=key)
        results = [priced[id(r)] for r in remedies]
        fitting = [(r, res) for r, res in zip(remedies, results) if res.get("command") and res.get("fits")]
        if fitting:
            r, res = fitting[0]
            return done(rep.kind, "reported", summary, rep.confidence, reasons, remedies, unknown, hot.rank, also,
                        next_cmd=res["command"], check_text=res["check"])
        # none is known to fit because the plan does not model something the job sets (memory/plan.py judge): the
        # first whose modelled prediction fits, its verdict said with it
        blind = [(r, res) for r, res in zip(remedies, results) if res.get("command") and res.get("fit") == "unknown"
                 and res.get("predicted_peak_bytes") is not None and rep.capacity is not None
                 and res["predicted_peak_bytes"] <= rep.capacity * (1 - rep.margin)]
        if blind:
            r, res = blind[0]
            return done(rep.kind, "reported", summary, rep.confidence, reasons, remedies, unknown, hot.rank, also,
                        next_cmd=res["command"], check_text=f"{res['check']}; {res['fit_verdict']}")
        return done(rep.kind, "reported", summary, rep.confidence, reasons + [
            "no change was validated and predicted to fit with the margin: see each one's predicted peak"], remedies,
            unknown, hot.rank, also, want_command=False)
    if rep.kind == "over_provisioned" and remedies and replan and ctx.recipe:
        cmd = replan
        return done(rep.kind, "reported", summary, rep.confidence, reasons, remedies, unknown, hot.rank, also,
                    next_cmd=cmd, check_text=("the doctor again with --plan: the memory model sizes each change on the "
                                              "hot rank and the engine validates its train.py command on the recipe "
                                              "(turning memory savings off without a plan can bring the OOM back)"))
    return done(rep.kind, "reported", summary, rep.confidence, reasons, remedies, unknown, hot.rank, also)


def turn_off_remedies(f: Findings, ctx: Context) -> list[C.Remedy]:
    """What an over-provisioned run can afford to turn off or relax, by documented throughput gain, largest
    first (memory/costs.py: the memory-tuning, activation-recompute and cpu-offloading skills)."""
    from ..memory.costs import COSTS, DP_HALVING_COST, TP_DOUBLING_COST
    have = set(ctx.overlays)
    rg = str(f.config["recompute_granularity"].value).lower().strip("'\"") if "recompute_granularity" in f.config else ""
    modules = str(f.config["recompute_modules"].value) if "recompute_modules" in f.config else ""
    out: list[tuple[float, C.Remedy]] = []

    def off(overlay: str, path: str, value) -> dict:
        return ({"remove_overlays": (overlay,)} if overlay in have else {"overrides": {path: value}})
    if "optimizer_offload" in have or _flag(f, "optimizer_cpu_offload"):
        out.append((COSTS["optimizer_offload"][0], C.Remedy(
            "optimizer_offload_off", "keep the optimizer state on the GPU (optimizer CPU offload off)",
            cost=f"gives back {COSTS['optimizer_offload'][1]}",
            **off("optimizer_offload", "optimizer.optimizer_cpu_offload", False))))
    if "full_recompute" in have or rg == "full":
        gain = COSTS["full_recompute"][0] - COSTS["selective_recompute"][0]
        out.append((gain, C.Remedy("full_to_selective", "recompute only the narrowest module instead of whole layers "
                                   "(full -> selective recompute)", overlay="selective_recompute",
                                   remove_overlays=("full_recompute",) if "full_recompute" in have else (),
                                   cost=f"gives back most of {COSTS['full_recompute'][1]}")))
    # A smaller TP or PP (DP doubles): only --plan can say whether it fits; the settings that need the larger
    # size go with it (SP needs TP > 1, VPP needs PP > 1).
    for key, path, dependent, name, what, (gain, text) in (
            ("tp", "model.tensor_model_parallel_size", ("sequence_parallel", "model.sequence_parallel", False),
             "tp_halved", "tensor parallelism (TP {old} -> {new}; DP doubles)", TP_DOUBLING_COST),
            ("pp", "model.pipeline_model_parallel_size", ("vpp", "model.virtual_pipeline_model_parallel_size", None),
             "pp_halved", "pipeline parallelism (PP {old} -> {new}; DP doubles, a smaller pipeline bubble)",
             DP_HALVING_COST)):
        size = f.layout.get(key)
        if size and size > 1 and size % 2 == 0:
            sets: dict[str, Any] = {path: size // 2}
            shown_key, dep_path, dep_value = dependent
            if size // 2 == 1 and (f.layout.get(shown_key) or _flag(f, shown_key)):
                sets[dep_path] = dep_value
            out.append((gain, C.Remedy(name, "halve " + what.format(old=size, new=size // 2), overrides=sets,
                                       cost=f"gives back what the larger size costs: {text}")))
    if "cpu_offload" in have or _flag(f, "cpu_offloading"):
        out.append((COSTS["cpu_offload"][0], C.Remedy(
            "cpu_offload_off", "keep activations on the GPU (activation CPU offload off)",
            cost=f"gives back {COSTS['cpu_offload'][1]}", **off("cpu_offload", "model.cpu_offloading", False))))
    if "selective_recompute" in have or rg == "selective":
        wide = any(label in modules for label in ("mlp", "moe"))
        gain = COSTS["selective_recompute_mlp" if wide else "selective_recompute"][0]
        out.append((gain, C.Remedy("selective_off", "stop recomputing (selective recompute off)",
                                   cost=f"gives back {COSTS['selective_recompute_mlp' if wide else 'selective_recompute'][1]}",
                                   **off("selective_recompute", "model.recompute_granularity", None))))
    return [r for _, r in sorted(out, key=lambda x: -x[0])]



def _remedy_dict(r: C.Remedy, priced: dict | None = None) -> dict:
    d = {"name": r.name, "action": r.action, "cost": r.cost, "saves_bytes": None if r.saves is None else int(r.saves),
         "command": r.command}
    if r.step_cost is not None:   # --plan: the cost model's price (memory/cost/), beside the documented words
        d["step_cost"] = r.step_cost
    if priced:  # --plan on a run report: the memory model's new peak on the hot rank, the validated command
        d.update({k: priced.get(k) for k in ("train_command", "check", "planned_hot_bytes", "predicted_peak_bytes",
                                             "fits")})
        if priced.get("megatron") is not None:   # a Megatron-LM job's change: its own flags (run_plan.py)
            d.update({"megatron": priced["megatron"], "command": priced.get("command")})
        if priced.get("fit") == "unknown":   # the plan does not model something the job sets (plan.py judge)
            d.update({k: priced[k] for k in ("fit", "fit_verdict", "unmodelled")})
        if priced.get("step_cost") is not None:
            d["step_cost"] = priced["step_cost"]
    if r.overlay:
        d["overlay"] = r.overlay
    for k in ("params", "overrides", "env"):
        if getattr(r, k):
            d[k] = getattr(r, k)
    if r.remove_overlays:
        d["remove_overlays"] = list(r.remove_overlays)
    if r.megatron is not None:
        d["megatron"] = r.megatron
    return d


def _megatron_job_only(ctx: Context, f: Findings) -> str:
    """Where the log shows it is a Megatron-LM job's ("its arguments dump [where]", "its launch command [where]"),
    when there is no recipe and no launch command to reuse (a train.py template would be all the doctor could
    print); "" otherwise."""
    if ctx.recipe or ctx.launch.kind != "template":
        return ""
    if f.megatron_args is not None:
        return f"its arguments dump {at(f.megatron_args.where)}"
    if f.command is not None and C.parse_launch(f.command.value).kind == "megatron-lm":
        return f"its launch command {at(f.command.where)}"
    return ""


def _fill_in(ctx: Context) -> str:
    """The words that tell the user to complete a train.py template the log gave no recipe for."""
    if ctx.launch.kind == "template" and "recipe=<recipe>" in ctx.launch.args:
        return "recipe not seen in the log: fill in <recipe>; "
    return ""


def _next_command(ctx: Context, remedy: C.Remedy, catalog, catalog_error, f: Findings, validator,
                  dirs: list[str] | None = None) -> tuple[str, str]:
    tokens, overlays = C.apply_remedy(ctx.launch, remedy, catalog)
    env = C.overlay_dirs_env(overlays, catalog, dirs or [])
    if env and not any(t.startswith(tuple(f"{k}=" for k in env)) for t in tokens):
        tokens = [f"{k}={v}" for k, v in env.items()] + tokens
    text = C.render_tokens(tokens)
    if ctx.launch.kind == "megatron-lm":
        return text, ("not validated: a Megatron-LM command (the doctor validates train.py overlays); "
                      "the flags are megatron-core's argument names")
    if ctx.launch.kind == "other":
        return text, "not validated: the launch command is not train.py, so only environment remedies are applied"
    if not remedy.overlay and not remedy.remove_overlays and not remedy.overrides:
        return text, _fill_in(ctx) + "environment change only: no overlay to validate"
    params = {k: v for k, v in C.params_in(C.parse_launch(text)).items()}
    problems = C.check_catalog(overlays, params, f.layout, catalog) if catalog else [catalog_error or "no catalogue"]
    if problems:
        return text, "NOT VALID: " + "; ".join(problems)
    if validator is not None:
        status = validator(overlays, params, text)
        return text, status
    where = _fill_in(ctx)
    sets = "".join(f"; the override {k}={C._text(v)} is not checked without Bridge" for k, v in remedy.overrides.items())
    return text, (where + "checked against the overlay catalogue (names, parameters, no two overlays writing one "
                  f"field, the layout rules the log shows){sets}; not validated on the recipe's config: add --plan "
                  "with Megatron Bridge installed, or run `mbmem apply --recipe R --overlay ...` before launching")


def _why_not(f: Findings) -> list[str]:
    # The skill's eval: why not VPP, TP=8 or CPU offloading first (memory-tuning skill, A Note on VPP,
    # Measured Results).
    out = []
    pp, vpp, tp = f.layout.get("pp"), f.layout.get("vpp"), f.layout.get("tp")
    if vpp:
        out.append(f"not VPP (VPP={vpp}): VPP is a throughput knob; it barely changes peak memory (VPP 10 used 60.2 GB "
                   "vs 58.8 GB at VPP 5 on Llama3-70B) — memory-tuning skill, A Note on VPP")
    if tp:
        out.append(f"not TP={tp * 2} (TP={tp}): doubling TP cost -28% throughput on Llama3-70B; a last resort")
    if pp and pp > 1:
        out.append(f"not CPU offloading: activation offload is blocked with PP={pp} > 1 (megatron-core); "
                   "optimizer_offload works with any PP but costs ~1.9x-4.2x step time")
    if pp and (f.layout.get("dp") or 0) >= 2:   # at DP 1 a doubled PP needs twice the GPUs: not a trade to weigh
        out.append(f"PP={pp * 2} would fit more easily but halves DP ({f.layout['dp']} -> {f.layout['dp'] // 2}): "
                   "~6% throughput")
    return out


def _victims(f: Findings) -> dict[int, Event]:
    failing = {o.rank for o in f.ooms} | {e.rank for e in f.events if e.family in ("nccl", "workspace", "driver")}
    return {e.rank: e for e in f.events if e.family in ("sigterm", "sigkill") and e.rank is not None
            and e.rank not in failing}


def _world_reasons(f: Findings, ctx: Context, victims: dict[int, Event]) -> list[str]:
    out = []
    failing = sorted({o.rank for o in f.ooms if o.rank is not None})
    if ctx.world and f.ooms:
        out.append(f"world size {ctx.world} {at(ctx.world_where)}; OOM reported by "
                   + (f"rank(s) {', '.join(map(str, failing))}" if failing else "a process whose rank is not shown"))
    elif ctx.world:
        out.append(f"world size {ctx.world} {at(ctx.world_where)}")
    elif f.ooms:
        out.append("world size unknown (no torchrun/Slurm/launcher line in the log)")
    if len(f.runs) > 1:
        others = []
        if f.earlier_failures:
            others.append(f"failure(s) {', '.join(at(w) for w in f.earlier_failures[:4])}"
                          f"{' ...' if len(f.earlier_failures) > 4 else ''}")
        if f.earlier_memory:
            others.append(f"{f.earlier_memory} memory report(s)")
        out.append(f"the log holds {len(f.runs)} starts of the job (an arguments dump each, "
                   f"{', '.join(at(w) for w in f.runs[:4])}{' ...' if len(f.runs) > 4 else ''}): the one from "
                   f"{at(f.run_read)} is read (its arguments, config, launch command, failures and memory lines); "
                   "the other starts' are not" + (f": their {' and '.join(others)} are not this diagnosis's"
                                                  if others else ""))
    if victims and (f.ooms or any(e.family in ("nccl", "workspace", "driver") for e in f.events)):
        ranks = sorted(victims)
        first = victims[ranks[0]]
        out.append(f"rank(s) {', '.join(map(str, ranks[:16]))}{' ...' if len(ranks) > 16 else ''} were stopped by "
                   f"SIGTERM/SIGKILL after the OOM {at(first.where)}: victims of the failure, not ranks with headroom "
                   "(their memory is unknown)")
    return out


def _also(f: Findings, primary: str) -> list[str]:
    names = {"engine": "inference engine memory share error", "nccl": "NCCL out-of-memory", "workspace": "cuBLAS/cuDNN workspace allocation failure",
             "driver": "CUDA driver-level allocation failure", "host_oom": "host OOM-killer record",
             "host_killed": "a process 'Killed' by the shell", "registration": "NCCL buffer registration failure"}
    seen = []
    for e in f.events:
        if e.family in names and e.family != primary and not any(names[e.family] in s for s in seen):
            seen.append(f"{names[e.family]} {at(e.where)}")
    if f.ooms and primary != "allocator":
        seen.append(f"PyTorch allocator OOM {at(f.ooms[0].where)}")
    return seen


def _configuration(f: Findings, ctx: Context, done) -> Diagnosis:
    rule, where, _ = f.config_errors[0]
    diag, fix, overlay = CONFIG_FIXES.get(rule) or next(
        ((v[1], v[2], v[3]) for k, v in EXTRA_CONFIG.items() if v[0] == rule), (rule, "see `mbmem explain`", ""))
    reasons = [f"the job failed at start-up with a known configuration error {at(where)}; fix: {fix}",
               "`mbmem apply`/`train.py run.dry_run=true` catches this before launch"]
    if rule == "expandable_segments_nccl_ub":
        remedy, who = registration_remedy(f, ctx)
        remedies = [remedy]
        reasons += who
    elif overlay:
        name = overlay.split("=", 1)[1]
        remove = ("cpu_offload",) if rule.startswith("cpu_offload") else ()
        remedies = [C.Remedy(name, fix, overlay=name, remove_overlays=remove)]
    else:
        remedies = []
    return done("configuration", "diagnosed", f"configuration error: {diag} (rule {rule})", "high", reasons, remedies,
                also=_also(f, "configuration"))


def _allocator(f: Findings, ctx: Context, done, victims) -> Diagnosis:
    results = [(o, *assess(o, ctx.expandable)) for o in f.ooms]
    kinds = {k for _, k, _, _ in results}
    known = [r for r in results if r[1] != "unknown"]
    reasons: list[str] = []
    unknown = sorted({m for _, _, _, miss in results for m in miss})
    for o, k, rs, _ in results[:8]:
        reasons += rs
    if len(results) > 8:
        reasons.append(f"... and {len(results) - 8} more OOM message(s)")
    if ctx.expandable:
        reasons.append(f"expandable_segments is already on: {ctx.expandable_source}")
    both = "both" in kinds
    if "capacity" in kinds:
        kind = "capacity"
    elif "other_processes" in kinds:
        kind = "other_processes"
    elif "fragmentation" in kinds or both:
        kind = "fragmentation"
    else:
        kind = "allocator_unknown"
    lead = next((r for r in results if r[1] == kind or (kind == "fragmentation" and r[1] == "both")), results[0])[0]
    complete = not unknown
    also = _also(f, "allocator")
    if ctx.expandable_exists is not None:
        reasons.append(f"torch {ctx.torch_from_format + ' (from the message format)' if ctx.torch_from_format else
                                f'{ctx.torch[0]}.{ctx.torch[1]}'} {at(ctx.torch_where)}")
    if kind == "fragmentation":
        remedy = defrag_remedy(ctx, f)
        remedies = [remedy] + capacity_remedies(f, ctx)
        if not ctx.expandable:
            seen = next(iter(f.alloc_conf.items()), None)
            reasons.append(f"{seen[0]}={seen[1].value} {at(seen[1].where)} has no expandable_segments:True" if seen else
                           "no PYTORCH_*ALLOC_CONF setting in the log (the recipe's env_vars or the container may "
                           "still set one)")
        if ctx.expandable_exists is False:
            reasons.append("expandable_segments needs torch >= 2.1, so it is not prescribed here")
        else:
            reasons.append("memory-tuning skill, Quick Decision step 1: zero throughput cost, no model change")
        summary = "allocator fragmentation: free + reserved-but-unallocated memory covers the failed request"
        conf = "high" if complete else "medium"
        if both:
            summary = ("fragmentation caused this failure; capacity is next: free + reserved-but-unallocated covers "
                       "the request only barely, so the next allocation of this size will fail too")
            conf = "medium"
            reasons.append(f"remedies: {remedy.name} first (no model change), then a capacity remedy right after it")
    elif kind == "capacity":
        remedies = capacity_remedies(f, ctx)
        summary = ("genuine capacity limit: the OOM happened with expandable_segments already on" if ctx.expandable
                   else "genuine capacity limit: free + reserved-but-unallocated memory is smaller than the request")
        reasons.append("memory-tuning skill, Failure Diagnosis: genuine capacity limit -> distributed optimizer, "
                       "recompute, or more PP; expandable_segments would not serve this request")
        conf = "high" if complete else "medium"
    elif kind == "other_processes":
        remedies = _other_process_remedies(f, ctx, lead) + capacity_remedies(f, ctx)
        summary = "other processes on the GPU hold the memory the request needed"
        conf = "high" if complete else "medium"
        reasons.append("the remedy is about the other processes, not fragmentation")
    else:
        remedy = defrag_remedy(ctx, f)
        remedies = [remedy] + capacity_remedies(f, ctx)
        summary = ("out of memory, but the message does not show the numbers needed to tell fragmentation from a "
                   "capacity limit (" + ", ".join(unknown) + " unknown)")
        reasons.append(f"first step: {remedy.name}, the skill's zero-cost first step (Quick Decision 1); if the job "
                       "still fails, it is a capacity limit: take the next remedies in order")
        conf = "low"
    reasons = [r for r in reasons if r]
    if ctx.expandable and ctx.expandable_exists is False:
        reasons.append("expandable_segments is set, but this torch predates it: the setting is ignored")
    verdict = "unsure" if conf == "low" else "diagnosed"
    if len(known) < len(results) and known:
        reasons.append(f"{len(results) - len(known)} of {len(results)} OOM message(s) were cut before their numbers; "
                       "the verdict rests on the others")
    return done(kind, verdict, summary, conf, reasons, remedies, unknown, lead.rank, also)


NVIDIA_SMI = "nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv"


def _engine_share(f: Findings, shortfall: float | None, capacity: float | None) -> tuple[str, str, str] | None:
    """(knob, current value, new value) for a colocated inference engine's memory share, if the log shows it.
    The new value gives back the shortfall (plus 2% of the GPU), rounded up to 0.05; else 0.1 less."""
    seen = f.config.get("gpu_memory_utilization") or f.config.get("mem_fraction_static")
    if seen is None:
        return None
    try:
        old = float(seen.value)
    except ValueError:
        return None
    if not 0 < old <= 1:
        return None
    cut = 0.1
    if shortfall and capacity:
        cut = max(0.05, -(-(shortfall / capacity + 0.02) // 0.05) * 0.05)
    new = round(max(0.05, old - cut), 2)
    knob = "gpu_memory_utilization" if "gpu_memory_utilization" in f.config else "mem_fraction_static"
    return knob, seen.value, f"{new:g}"


def _other_process_remedies(f: Findings, ctx: Context, o: OOM | None = None) -> list[C.Remedy]:
    eng = f.inference_engine
    out = []
    shortfall = None
    if o is not None and None not in (o.requested, o.free, o.reserved_unallocated):
        shortfall = max(0, o.requested - o.free - o.reserved_unallocated)
    share = _engine_share(f, shortfall, o.capacity if o is not None else None)
    if share:
        knob, old, new = share
        seen = f.config[knob]
        if f.verl:  # verl's rollout config names the share gpu_memory_utilization for vLLM and SGLang alike
            cmd = f"actor_rollout_ref.rollout.gpu_memory_utilization={new}"
            note = (f"an override for the verl command {at(f.verl.where)} (was {knob}={old} {at(seen.where)}); not an "
                    "overlay, so not validated by the engine")
        else:
            cmd = f"--{knob.replace('_', '-')} {new}"
            note = (f"the inference engine's own option (was {knob}={old} {at(seen.where)}); not an overlay, so not "
                    "validated by the engine")
        out.append(C.Remedy("inference_engine_share", f"lower the colocated inference engine's memory share {knob} "
                            f"{old} -> {new}, or make it sleep/offload (weights and KV cache) before the training step",
                            cost="smaller KV cache for rollouts", command=cmd, command_note=note))
    elif eng or f.memory_saver:
        out.append(C.Remedy("inference_engine_share", "lower the colocated inference engine's memory share "
                            "(gpu_memory_utilization / mem_fraction_static), or make it sleep/offload before the "
                            "training step", cost="smaller KV cache for rollouts", command=NVIDIA_SMI,
                            command_note="lists what holds the GPU; the engine's setting is not in the log"))
    out.append(C.Remedy("other_processes", "stop or move the other processes on this GPU (one training process per "
                        "GPU)", cost="none for training", command=NVIDIA_SMI,
                        command_note="lists the processes holding the GPU; nothing to validate"))
    return out


def _device_event(f: Findings, ctx: Context, done, events: list[Event]) -> Diagnosis:
    order = {"nccl": 0, "workspace": 1, "driver": 2}
    e = min(events, key=lambda x: order[x.family])
    fam = e.family
    also = _also(f, fam)
    unknown = ["the requested size", "the free memory", "reserved-but-unallocated"]
    if fam == "nccl":
        reasons = [f"{rank_text(e.rank)}: NCCL could not allocate device memory for its communicator buffers "
                   f"{at(e.where)}" + (f" ({e.detail} bytes)" if e.detail else ""),
                   ("NCCL allocates outside PyTorch's caching allocator, so expandable_segments does not help; reduce "
                   "NCCL's own buffers or the number of communicators, then leave headroom")]
        return done("nccl", "diagnosed", "NCCL ran out of device memory for communicator buffers", "medium",
                    reasons, nccl_remedies(f, ctx) + capacity_remedies(f, ctx)[:2], unknown, e.rank, also)
    if fam == "workspace":
        reasons = [(f"{rank_text(e.rank)}: {e.detail}: cuBLAS/cuDNN could not allocate its workspace or handle "
                   f"{at(e.where)}"),
                   ("the library allocates when the GPU is already full: the caching allocator holds the memory, so "
                   "this is a capacity problem reported by the library instead of PyTorch's OOM message")]
        rem = capacity_remedies(f, ctx)
        return done("workspace", "diagnosed", "cuBLAS/cuDNN workspace allocation failed: the GPU was full",
                    "medium", reasons, rem, unknown, e.rank, also)
    saver = f.memory_saver or (f.inference_engine if f.inference_engine else None)
    reasons = [(f"{rank_text(e.rank)}: {e.detail} {at(e.where)}: a driver-level allocation (cuMemCreate/cudaMalloc "
               "outside the caching allocator's message) failed")]
    if saver is not None:
        reasons.append(f"a memory-saver / colocated engine is in the log ({saver.value} {at(saver.where)}): the mapping "
                       "failed because the memory it released was taken, or the engine did not release it")
        rem = _other_process_remedies(f, ctx) + capacity_remedies(f, ctx)
        return done("driver", "diagnosed", "CUDA driver-level allocation failed while re-mapping memory (memory saver "
                    "/ colocated inference engine)", "medium", reasons, rem, unknown, e.rank, also)
    if ctx.expandable:
        reasons.append(f"expandable_segments maps memory with cuMemCreate: {ctx.expandable_source}; its growth "
                       "failing means the GPU is full (a capacity limit)")
    rem = capacity_remedies(f, ctx)
    return done("driver", "diagnosed", "CUDA driver-level allocation failed: the device had no memory left",
                "medium" if ctx.expandable else "low", reasons, rem, unknown, e.rank, also)


def _engine_command(f: Findings, knob: str, value: str) -> tuple[str, str]:
    if f.verl:  # verl names the rollout engine's share gpu_memory_utilization for vLLM and SGLang alike
        return (f"actor_rollout_ref.rollout.gpu_memory_utilization={value}",
                f"an override for the verl command {at(f.verl.where)}; not an overlay, so not validated by the engine")
    flag = "--mem-fraction-static" if knob == "mem_fraction_static" else "--gpu-memory-utilization"
    note = "the inference engine's own option; not an overlay, so not validated by the engine"
    if f.engine_command:  # the server command seen in the log, with the one option changed
        text = f.engine_command.value
        changed = re.sub(re.escape(flag) + r"(=|\s+)\S+", lambda m: f"{flag}{m.group(1)}{value}", text, count=1)
        return (changed if changed != text else f"{text} {flag} {value}"), \
            f"the server command {at(f.engine_command.where)} with {flag} changed; {note}"
    return f"{flag} {value}", note


def _engine(f: Findings, ctx: Context, done, e: Event) -> Diagnosis:
    """vLLM/SGLang could not reserve their share (vllm worker: 'Free memory on device ... is less than desired
    GPU memory utilization'; 'No available memory for the cache blocks'; SGLang: 'Not enough memory')."""
    from . import patterns as P
    sglang = "mem-fraction-static" in e.line or (f.inference_engine and "sglang" in f.inference_engine.value.lower())
    knob = "mem_fraction_static" if sglang else "gpu_memory_utilization"
    m = P.ENGINE_FREE.search(e.line)
    if m:
        free, total, wanted = float(m.group(1)), float(m.group(2)), float(m.group(3))
        new = max(0.05, int((free / total - 0.02) / 0.05) * 0.05)   # below what is free, 2% kept, 0.05 steps
        cmd, note = _engine_command(f, knob, f"{new:.2f}")
        reasons = [(f"{rank_text(e.rank)}: the engine wanted {wanted:g} of the GPU but only {free:g} of {total:g} GiB "
                   f"was free at start-up {at(e.where)}: other processes (the colocated trainer?) hold the rest"),
                   (f"{knob} {wanted:g} -> {new:.2f} fits in the free memory; or free the GPU first (offload or put "
                   "the trainer to sleep before the engine starts)")]
        rem = [C.Remedy("inference_engine_share", f"lower {knob} to {new:.2f}", cost="smaller KV cache",
                        command=cmd, command_note=note),
               *_other_process_remedies(f, ctx)[-1:]]
        return done("inference_engine", "diagnosed", "the inference engine's memory share is larger than the free GPU "
                    "memory at its start-up", "high", reasons, rem, rank=e.rank, also=_also(f, "engine"))
    seen = f.config.get(knob)
    value = None
    try:
        value = float(seen.value) if seen else None
    except ValueError:
        pass
    reasons = [(f"{rank_text(e.rank)}: {e.detail} {at(e.where)}: the engine's share holds the weights but leaves no "
               "room for the KV cache")]
    rem = []
    if value is not None and value < 0.95:
        new = min(0.95, round(value + 0.1, 2))
        cmd, note = _engine_command(f, knob, f"{new:g}")
        reasons.append(f"{knob}={seen.value} {at(seen.where)}")
        rem.append(C.Remedy("inference_engine_share", f"raise {knob} {seen.value} -> {new:g} (if the GPU has the "
                            "room), or lower max_model_len / max_num_seqs", cost="less memory for anything colocated",
                            command=cmd, command_note=note))
    rem.append(C.Remedy("engine_smaller_kv", "lower max_model_len or max_num_seqs (fewer KV-cache tokens needed), or "
                        "give the engine more tensor parallelism", cost="shorter context or fewer concurrent sequences",
                        command=NVIDIA_SMI, command_note="shows what else holds the GPU; nothing to validate"))
    return done("inference_engine", "diagnosed", "the inference engine's memory share leaves no room for its KV cache",
                "medium", reasons, rem, rank=e.rank, also=_also(f, "engine"))


# The process's own host allocation failed (no killer involved).
HOST_ALLOC_FAILURES = ("MemoryError", "_ArrayMemoryError", "std::bad_alloc", "[Errno 12] Cannot allocate memory",
                       "DefaultCPUAllocator")


def _host(f: Findings, ctx: Context, done, events: list[Event]) -> Diagnosis:
    confirmed = [e for e in events if e.family == "host_oom"]
    e = (confirmed or events)[0]
    reasons = [f"{rank_text(e.rank)}: {e.detail} {at(e.where)}"]
    remedies = []
    if _flag(f, "optimizer_cpu_offload") or "optimizer_offload" in ctx.overlays:
        remedies.append(C.Remedy("optimizer_offload_fraction", "keep less optimizer state in host memory "
                                 "(optimizer offload fraction 1.0 -> 0.5)", overlay="optimizer_offload",
                                 params={"fraction": 0.5}, cost="more GPU memory for optimizer state"))
    workers = _int(f, "num_workers")
    if workers and workers > 1:  # cfg.dataset.num_workers (megatron/bridge/data/base.py:34, data/loaders.py:326)
        remedies.append(C.Remedy("dataloader_workers", f"halve the dataloader workers per rank ({workers} -> "
                                 f"{workers // 2} {at(f.config['num_workers'].where)}): each is a process with its "
                                 "own copy of the dataset state", overrides={"dataset.num_workers": workers // 2},
                                 cost="slower data loading if the loader was the bottleneck"))
    remedies.append(C.Remedy("host_memory", "give the job the node's memory (Slurm --mem=0), fewer dataloader workers "
                             "per rank, and no other jobs on the node", cost="none"))
    also = _also(f, "host_oom")
    if confirmed and any(a in e.detail for a in HOST_ALLOC_FAILURES):
        reasons.append("the process's own host allocation failed: host RAM, not GPU memory")
        summary, conf = "host out of memory: a host allocation failed (host RAM, not GPU memory)", "high"
    elif confirmed:
        reasons.append("the kernel's OOM killer (or Slurm's cgroup) killed it: host RAM, not GPU memory")
        summary, conf = "host out of memory: the OOM killer ended the process (host RAM, not GPU memory)", "high"
    else:
        reasons.append("SIGKILL / exit 137 / 'Killed' is what the OOM killer sends, but a scheduler or a user can "
                       "send it too; the kernel log would confirm it")
        summary, conf = "probably host out of memory: the process was SIGKILLed (exit 137) with no GPU OOM", "medium"
        check = (f"sacct -j {f.slurm_job} --format=JobID,State,ExitCode,MaxRSS,ReqMem" if f.slurm_job
                 else "dmesg -T | grep -iE 'out of memory|oom-kill|killed process'")
        return done("host_oom", "diagnosed", summary, conf, reasons, remedies, rank=e.rank, also=also, next_cmd=check)
    if remedies[0].overlay or remedies[0].overrides:
        return done("host_oom", "diagnosed", summary, conf, reasons, remedies, rank=e.rank, also=also)
    check = f"sacct -j {f.slurm_job} --format=JobID,State,ExitCode,MaxRSS,ReqMem" if f.slurm_job else None
    d = done("host_oom", "diagnosed", summary, conf, reasons, remedies, rank=e.rank, also=also, next_cmd=check,
             want_command=check is not None)
    if check is None:
        d.command_check = "no command: the log shows no host-memory setting to change; see the remedies"
    return d
