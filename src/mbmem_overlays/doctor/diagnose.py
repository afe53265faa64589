"""From what the logs show to a diagnosis, its confidence and the next command
(nvidia-skills/nemo-mbridge-perf-memory-tuning.SKILL.md, Failure Diagnosis)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..core.catalog import train_recipe_arg
from .known import CONFIG_FIXES, EXTRA_CONFIG
from .parse import Findings

@dataclass
class Diagnosis:
    kind: str            # fragmentation | capacity | configuration | none | unreadable
    summary: str
    confidence: str      # high | medium | low
    next_command: str | None
    reasons: list[str]
    why_not: list[str]
    evidence: list[str]
    ranks: dict


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / (1 << 30):.2f} GiB"


def diagnose(f: Findings, recipe: str | None = None) -> Diagnosis:
    recipe = recipe or f.recipe or "<recipe>"
    recipe_arg = train_recipe_arg(recipe) if recipe != "<recipe>" else "recipe=<recipe>"
    expandable = any("expandable_segments:True" in v.split(",") for v in f.alloc_conf.values())
    ranks = {str(o.rank if o.rank is not None else "?"): {k: v for k, v in asdict(o).items() if k not in ("rank",)}
             for o in f.ooms}
    why_not = _why_not(f)
    base = f"python train.py {recipe_arg}"
    if f.config_errors:
        rule, where, line = f.config_errors[0]
        diag, fix, overlay = CONFIG_FIXES.get(rule) or next(
            ((v[1], v[2], v[3]) for k, v in EXTRA_CONFIG.items() if v[0] == rule), (rule, "see `mbmem explain`", ""))
        return Diagnosis("configuration", f"configuration error: {diag} (rule {rule})", "high",
                         f"{base} {overlay}".strip() if overlay else None,
                         [f"{where}: the job failed at start-up with a known configuration error; fix: {fix}",
                          "`mbmem apply`/`train.py run.dry_run=true` catches this before launch"],
                         why_not, f.evidence, ranks)
    if not f.ooms:
        msg = "no CUDA/HIP out-of-memory message or known configuration error found"
        kind = "unreadable" if f.unreadable and f.unreadable == len(f.files) and not f.bytes_read else "none"
        return Diagnosis(kind, msg + (f" ({'; '.join(f.problems)})" if f.problems else ""), "high", None, [], [],
                         f.evidence, ranks)
    worst = max(f.ooms, key=lambda o: (o.reserved_unallocated or 0))
    reasons: list[str] = []
    frag_signals = 0
    if worst.reserved_unallocated is not None and worst.requested:
        if worst.reserved_unallocated >= worst.requested:
            frag_signals += 2
            reasons.append(f"rank {worst.rank}: {_gib(worst.reserved_unallocated)} reserved-but-unallocated >= the "
                           f"{_gib(worst.requested)} request: the memory exists but is fragmented")
        elif worst.capacity and worst.reserved_unallocated >= 0.02 * worst.capacity:
            frag_signals += 1
            reasons.append(f"rank {worst.rank}: {_gib(worst.reserved_unallocated)} reserved-but-unallocated "
                           f"({100 * worst.reserved_unallocated / worst.capacity:.1f}% of capacity)")
    oom_ranks = {o.rank for o in f.ooms if o.rank is not None}
    world = max(f.ranks_seen | f.failed_ranks | oom_ranks, default=-1) + 1
    if world > 1 and len(oom_ranks) == 1:
        frag_signals += 1
        reasons.append(f"only rank {next(iter(oom_ranks))} of {world} ranks seen ran out of memory; the others had headroom")
    if expandable:
        return Diagnosis("capacity", "genuine capacity limit: the OOM happened with expandable_segments already set",
                         "high" if not worst.partial else "medium", f"mbmem recommend --recipe {recipe} --world-size "
                         f"{max(world, 1)} --gpu-memory {_gib(worst.capacity).replace(' ', '')}",
                         [f"{f.alloc_where}: PYTORCH_*ALLOC_CONF already has expandable_segments:True",
                          "memory-tuning skill, Failure Diagnosis: 'OOM with expandable_segments already set' -> "
                          "increase PP, use the distributed optimizer, or add recompute", *reasons],
                         why_not, f.evidence, ranks)
    if frag_signals >= 1:
        conf = "high" if frag_signals >= 2 else "medium"
        return Diagnosis("fragmentation", "allocator fragmentation: reserved-but-unallocated memory could have served "
                         "the request", conf, f"{base} +mem=expandable_segments",
                         [*reasons, "expandable_segments:True is not set in the logged environment",
                          "memory-tuning skill, Quick Decision step 1: zero throughput cost, no model change"],
                         why_not, f.evidence, ranks)
    return Diagnosis("capacity", "likely a genuine capacity limit (little reserved-but-unallocated memory)", "medium",
                     f"{base} +mem=expandable_segments",
                     [*reasons, f"rank {worst.rank}: {_gib(worst.allocated)} allocated of {_gib(worst.capacity)}",
                      "expandable_segments is still the first, free step (memory-tuning skill, Quick Decision); "
                      f"if it still OOMs: mbmem recommend --recipe {recipe}"], why_not, f.evidence, ranks)


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
    if pp and f.layout.get("dp"):
        out.append(f"PP={pp * 2} would fit more easily but halves DP ({f.layout['dp']} -> {max(1, f.layout['dp'] // 2)}): "
                   "~6% throughput")
    return out
