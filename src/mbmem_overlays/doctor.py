"""The OOM doctor: from a failed job's logs to a diagnosis and the next command.

Streams any number of logs (plain or gzip, single- or multi-rank, Slurm output)
in fixed-size blocks: one compiled trigger regex scans each block in C and only
the lines it hits are decoded and parsed, so throughput is high and memory stays
flat whatever the log size. Never imports torch or Megatron Bridge.

Decision table: nvidia-skills/nemo-mbridge-perf-memory-tuning.SKILL.md, Failure
Diagnosis. OOM message formats: ecosystem-notes.md, "The PyTorch OOM message".
Configuration errors: the oracle fragments of rules.py (bridge-config-surface.md).
"""

from __future__ import annotations

import glob
import gzip
import io
import json
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO, Iterator

from . import rules
from .catalog import train_recipe_arg
from .report import section

BLOCK = 4 << 20
MAX_EVIDENCE = 12
UNITS = {"bytes": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
         "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}

_SIZE = r"([\d.]+)\s*(bytes|[KMGT]iB|[KMG]B)"
# Current format (torch >= 2.1; "capacty" typo in ~2.1), CUDA or HIP (ecosystem-notes.md).
OOM_NEW = re.compile(
    r"(?P<dev>CUDA|HIP) out of memory\. Tried to allocate " + _SIZE.replace("(", "(?P<req>", 1).replace(r"\s*(", r"\s*(?P<req_u>", 1)
    + r"\. GPU (?P<gpu>\d+) has a total capac(?:i)?ty of " + r"(?P<tot>[\d.]+)\s*(?P<tot_u>bytes|[KMGT]iB)"
    + r" of which (?P<free>[\d.]+)\s*(?P<free_u>bytes|[KMGT]iB) is free\."
    + r"(?:.*?Of the allocated memory (?P<alloc>[\d.]+)\s*(?P<alloc_u>bytes|[KMGT]iB) is allocated by PyTorch, "
    + r"(?:with (?P<priv>[\d.]+)\s*(?P<priv_u>bytes|[KMGT]iB) allocated in private pools.*?, )?"
    + r"and (?P<ru>[\d.]+)\s*(?P<ru_u>bytes|[KMGT]iB) is reserved by PyTorch but unallocated)?")
# torch <= 2.0: "(GPU 0; 79.15 GiB total capacity; 70.1 GiB already allocated; 1.2 GiB free; 75.0 GiB reserved in total by PyTorch)"
OOM_OLD = re.compile(
    r"(?P<dev>CUDA|HIP) out of memory\. Tried to allocate (?P<req>[\d.]+)\s*(?P<req_u>bytes|[KMGT]iB) \(GPU (?P<gpu>\d+); "
    r"(?P<tot>[\d.]+)\s*(?P<tot_u>bytes|[KMGT]iB) total capacity; (?P<alloc>[\d.]+)\s*(?P<alloc_u>bytes|[KMGT]iB) already allocated; "
    r"(?P<free>[\d.]+)\s*(?P<free_u>bytes|[KMGT]iB) free; (?:(?P<allowed>[\d.]+)\s*(?P<allowed_u>bytes|[KMGT]iB) allowed; )?"
    r"(?P<res>[\d.]+)\s*(?P<res_u>bytes|[KMGT]iB) reserved in total by PyTorch")
OOM_ANY = re.compile(r"(CUDA|HIP) out of memory|OutOfMemoryError")
RANK = re.compile(r"^\s*(?:\[(?:rank|default)(\d+)\]:|(\d+): )")
RANK_PREFIXES = re.compile(rb"\[(?:rank|default)(\d+)\]:")
ALLOC_SET = re.compile(r"(?:^|[\s'\"])(?:export\s+)?(PYTORCH_(?:CUDA_|HIP_)?ALLOC_CONF)\s*[=:]\s*['\"]?([^'\"\s]*)")
LAYOUT = {
    "tp": re.compile(r"\b(?:tensor_model_parallel_size|TP)\s*[=:]\s*(\d+)"),
    "pp": re.compile(r"\b(?:pipeline_model_parallel_size|PP)\s*[=:]\s*(\d+)"),
    "vpp": re.compile(r"\b(?:virtual_pipeline_model_parallel_size|VPP)\s*[=:]\s*(\d+)"),
    "dp": re.compile(r"\b(?:data_parallel_size|DP)\s*[=:]\s*(\d+)"),
}
RECIPE = re.compile(r"(?:--recipe[= ]|recipe=)([\w.]+)")
TORCHRUN_RANK = re.compile(r"^\s*rank\s*:\s*(\d+)")

CONFIG_FIXES = {  # rule id -> (diagnosis, fix, overlay command fragment)
    "cpu_offload_pipeline": ("activation CPU offloading with PP>1", "set model.pipeline_model_parallel_size=1, or offload "
                             "optimizer state instead", "+mem=optimizer_offload"),
    "cpu_offload_recompute": ("activation CPU offloading combined with recompute", "use one of them", "+mem=selective_recompute"),
    "cpu_offload_cuda_graphs": ("activation CPU offloading with CUDA graphs", "set model.cuda_graph_impl=none, or offload "
                                "optimizer state instead", "+mem=optimizer_offload"),
    "cpu_offload_num_layers": ("cpu_offloading_num_layers out of range", "use 1 <= mem.cpu_offload.num_layers < num_layers", ""),
    "expandable_segments_nccl_ub": ("NCCL user buffers with expandable segments (torch<2.11)",
                                    "remove expandable_segments:True from PYTORCH_CUDA_ALLOC_CONF or set ddp.nccl_ub=false", ""),
    "precision_aware_optimizer_needs_dist_opt": ("precision-aware optimizer without the distributed optimizer",
                                                 "enable the distributed optimizer", "+mem=dist_optimizer"),
}
EXTRA_CONFIG = {  # errors raised outside validate(), with their fix
    "Setting NCCL_GRAPH_REGISTER=0 to avoid illegal memory access": (
        "expandable_segments_cuda_graphs", "CUDA graphs with expandable segments need NCCL_GRAPH_REGISTER=0",
        "export NCCL_GRAPH_REGISTER=0 (+mem=expandable_segments sets it)", "+mem=expandable_segments"),
}


def _config_fragments() -> dict[str, str]:
    table = {frag: c.id for c in rules.CHECKS for frag in c.oracle}
    table.update({frag: v[0] for frag, v in EXTRA_CONFIG.items()})
    return table


def _triggers() -> tuple[bytes, ...]:
    """Literals that any interesting line contains. bytes.find scans at memchr speed; a regex
    alternation of the same patterns ran ~10x slower (Python's re cannot prefilter alternations)."""
    literals = {b"out of memory", b"OutOfMemoryError", b"ALLOC_CONF", b"parallel_size", b"P=", b"P: ", b"P:",
                b"recipe", b"rank ", b"exitcode", b"NCCL_GRAPH_REGISTER"}
    # Configuration errors are raised as ValueError/AssertionError/RuntimeError lines: "Error" finds them all,
    # and the fragments are matched on those lines only.
    literals.add(b"Error")
    return tuple(sorted(literals))


def to_bytes(value: str | None, unit: str | None) -> int | None:
    if value is None or unit is None:
        return None
    return int(float(value) * UNITS[unit.lower()])


@dataclass
class OOM:
    rank: int | None
    where: str
    requested: int | None = None
    capacity: int | None = None
    free: int | None = None
    allocated: int | None = None
    reserved_unallocated: int | None = None
    private_pools: int | None = None
    device: str = "CUDA"
    partial: bool = False


@dataclass
class Findings:
    files: list[str] = field(default_factory=list)
    ooms: list[OOM] = field(default_factory=list)
    config_errors: list[tuple[str, str, str]] = field(default_factory=list)   # (rule id, where, line)
    alloc_conf: dict[str, str] = field(default_factory=dict)                  # var -> value seen
    alloc_where: str = ""
    layout: dict[str, int] = field(default_factory=dict)
    recipe: str | None = None
    ranks_seen: set[int] = field(default_factory=set)
    failed_ranks: set[int] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)                        # unreadable / binary / empty inputs
    bytes_read: int = 0
    unreadable: int = 0                                                       # files we could not read as logs
    evidence: list[str] = field(default_factory=list)

    def cite(self, where: str, line: str) -> None:
        if len(self.evidence) < MAX_EVIDENCE:
            self.evidence.append(f"{where}: {line.strip()[:300]}")


def _open(path: str) -> BinaryIO:
    if path == "-":
        return sys.stdin.buffer
    f = open(path, "rb")
    if f.peek(2)[:2] == b"\x1f\x8b" if hasattr(f, "peek") else False:
        f.close()
        return gzip.open(path, "rb")
    return f


def expand(paths: list[str]) -> list[str]:
    out: list[str] = []
    for p in paths:
        hits = sorted(glob.glob(p)) if p != "-" and any(c in p for c in "*?[") else [p]
        out += hits or [p]
    return out


def _lines(stream: BinaryIO, triggers: tuple[bytes, ...], findings: Findings) -> Iterator[tuple[int, bytes]]:
    """(line number, line) for the lines holding a trigger literal; reads fixed-size blocks."""
    carry, lineno = b"", 1
    while True:
        block = stream.read(BLOCK)
        if not block and not carry:
            break
        findings.bytes_read += len(block)
        data = carry + block
        cut = data.rfind(b"\n") + 1
        if block and cut == 0 and len(data) < BLOCK * 4:
            carry = data  # one very long line: keep reading (bounded)
            continue
        work, carry = (data[:cut], data[cut:]) if (cut and block) else (data, b"")
        findings.ranks_seen.update(int(r) for r in set(RANK_PREFIXES.findall(work)))
        spans: set[tuple[int, int]] = set()
        for lit in triggers:
            i = work.find(lit)
            while i >= 0:
                start = work.rfind(b"\n", 0, i) + 1
                end = work.find(b"\n", i)
                end = len(work) if end < 0 else end
                spans.add((start, end))
                i = work.find(lit, end)
        pos = 0
        for start, end in sorted(spans):
            lineno += work.count(b"\n", pos, start)
            pos = start
            yield lineno, work[start:end]
        lineno += work.count(b"\n", pos)
        if not block:
            break


def scan(paths: list[str]) -> Findings:
    findings = Findings()
    triggers, fragments = _triggers(), _config_fragments()
    for path in expand(paths):
        findings.files.append(path)
        try:
            stream = _open(path)
        except OSError as exc:
            findings.problems.append(f"{path}: cannot read ({exc.strerror or exc})")
            findings.unreadable += 1
            continue
        try:
            head = stream.peek(8192)[:8192] if hasattr(stream, "peek") else b""
            # Logs carry no NUL bytes at their start (a crashed node can leave NULs at the end, which is fine).
            if head.count(b"\0") >= 8:
                findings.unreadable += 1
                findings.problems.append(f"{path}: looks like a binary file, not a log (NUL bytes); skipped")
                continue
            before = findings.bytes_read
            for lineno, raw in _lines(stream, triggers, findings):
                _parse_line(raw.decode("utf-8", errors="replace"), f"{path}:{lineno}", findings, fragments)
            if findings.bytes_read == before:
                findings.problems.append(f"{path}: empty")
        except (OSError, EOFError, gzip.BadGzipFile) as exc:
            findings.problems.append(f"{path}: read failed part-way ({exc}); diagnosing what was read")
        finally:
            if stream is not sys.stdin.buffer:
                stream.close()
    return findings


def _parse_line(line: str, where: str, f: Findings, fragments: dict[str, str]) -> None:
    m = RANK.match(line)
    rank = int(m.group(1) or m.group(2)) if m else None
    if rank is not None:
        f.ranks_seen.add(rank)
    if OOM_ANY.search(line):
        _parse_oom(line, where, rank, f)
    for frag, rule in fragments.items():
        if frag in line:
            if not any(r == rule for r, _, _ in f.config_errors):
                f.config_errors.append((rule, where, line.strip()))
                f.cite(where, line)
            break
    if "ALLOC_CONF" in line and "try setting PYTORCH" not in line and "If reserved but unallocated" not in line:
        for var, value in ALLOC_SET.findall(line):
            if value:
                f.alloc_conf[var] = value
                f.alloc_where = where
                f.cite(where, line)
    for key, rx in LAYOUT.items():
        lm = rx.search(line)
        if lm and key not in f.layout:
            f.layout[key] = int(lm.group(1))
    rm = RECIPE.search(line)
    if rm and not f.recipe:
        f.recipe = rm.group(1)
    tm = TORCHRUN_RANK.match(line)
    if tm:
        f.failed_ranks.add(int(tm.group(1)))


def _parse_oom(line: str, where: str, rank: int | None, f: Findings) -> None:
    m = OOM_NEW.search(line)
    if m:
        oom = OOM(rank, where, to_bytes(m["req"], m["req_u"]), to_bytes(m["tot"], m["tot_u"]),
                  to_bytes(m["free"], m["free_u"]), to_bytes(m["alloc"], m["alloc_u"]),
                  to_bytes(m["ru"], m["ru_u"]), to_bytes(m["priv"], m["priv_u"]), m["dev"],
                  partial=m["ru"] is None)
    elif (m := OOM_OLD.search(line)):
        alloc, res = to_bytes(m["alloc"], m["alloc_u"]), to_bytes(m["res"], m["res_u"])
        oom = OOM(rank, where, to_bytes(m["req"], m["req_u"]), to_bytes(m["tot"], m["tot_u"]),
                  to_bytes(m["free"], m["free_u"]), alloc, max(0, res - alloc), None, m["dev"])
    else:
        if "Tried to allocate" not in line and "out of memory" not in line:
            return  # e.g. "torch.OutOfMemoryError" alone on a traceback line: the message line follows
        oom = OOM(rank, where, partial=True,
                  device="HIP" if "HIP" in line else "CUDA")
        rm = re.search(r"Tried to allocate " + _SIZE, line)
        if rm:
            oom.requested = to_bytes(rm.group(1), rm.group(2))
    key = (oom.rank, oom.requested, oom.reserved_unallocated)
    if not any((o.rank, o.requested, o.reserved_unallocated) == key for o in f.ooms):
        f.ooms.append(oom)
        f.cite(where, line)


# ----------------------------------------------------------------------------- diagnosis
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
            ((v[1], v[2], v[3]) for k, v in EXTRA_CONFIG.items() if v[0] == rule), (rule, f"see `mbmem explain`", ""))
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


def render(d: Diagnosis, f: Findings) -> str:
    lines = [f"diagnosis: {d.summary}", f"confidence: {d.confidence}"]
    if d.next_command:
        lines.append(f"next command: {d.next_command}")
    lines += section("why", d.reasons) + section("not first", d.why_not)
    lines += section("evidence", d.evidence, marker="") + section("inputs", f.problems, marker="!")
    lines.append(f"read {f.bytes_read / 1e6:.1f} MB from {len(f.files)} file(s); {len(f.ooms)} OOM message(s) on "
                 f"{len({o.rank for o in f.ooms})} rank(s)")
    return "\n".join(lines)


def cmd_doctor(args) -> int:
    findings = scan(args.logs)
    d = diagnose(findings, args.recipe)
    if args.json:
        print(json.dumps({**asdict(d), "files": findings.files, "problems": findings.problems,
                          "bytes_read": findings.bytes_read}, indent=2, default=repr))
    else:
        print(render(d, findings))
    return {"none": 3, "unreadable": 2}.get(d.kind, 0)


def register(sub) -> None:
    p = sub.add_parser("doctor", help="diagnose an OOM or configuration failure from job logs")
    p.add_argument("logs", nargs="+", help="log files, globs, or - for stdin (gzip is detected)")
    p.add_argument("--recipe", help="recipe name for the suggested command (else taken from the log)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_doctor)
