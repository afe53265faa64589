"""Reading job logs for the doctor: OOM messages, configuration errors, allocator settings, layout.

Streams any number of logs (plain or gzip, single- or multi-rank, Slurm output)
in fixed-size blocks: one compiled trigger regex scans each block in C and only
the lines it hits are decoded and parsed, so throughput is high and memory stays
flat whatever the log size. Never imports torch or Megatron Bridge.

Decision table: nvidia-skills/nemo-mbridge-perf-memory-tuning.SKILL.md, Failure
Diagnosis. OOM message formats: ecosystem-notes.md, "The PyTorch OOM message".
Configuration errors: the oracle fragments of core/rules (known.py; bridge-config-surface.md).
"""

from __future__ import annotations

import glob
import gzip
import re
import sys
from dataclasses import dataclass, field
from typing import BinaryIO, Iterator

from ..core.sizes import UNITS
from .known import config_fragments

BLOCK = 4 << 20
MAX_EVIDENCE = 12

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
    triggers, fragments = _triggers(), config_fragments()
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
