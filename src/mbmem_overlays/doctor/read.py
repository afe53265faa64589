"""Reading logs for the doctor: files, globs, stdin, plain or gzip, in fixed-size blocks.

Only the lines holding a trigger literal come back, so memory stays flat whatever the log size. Only regular
files (and ``-``) are read: a fifo, device, socket or folder named on the command line or matched by a glob is
reported and skipped, never opened for a blocking read (issue 22 #6).
Each line handed on is bounded: a line longer than MAX_LINE is not parsed whole, only in windows
around its trigger literals (issue 15, item 15: no parse step may see unbounded text). A flood of
short trigger lines takes the dense path: one C-level split per block and each distinct line parsed
once (issue 15, item 17: 180 MB of short lines must not collapse the throughput).
"""

from __future__ import annotations

import fcntl
import glob
import gzip
import io
import os
import re
import stat
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from ..core.text import quoted_word

BLOCK = 4 << 20
MAX_CARRY = 4 * BLOCK          # a line still without a newline after this many bytes is cut here
MAX_LINE = 16 << 10            # lines longer than this are parsed in windows around their triggers
WINDOW_BEFORE, WINDOW_AFTER = 256, 2048
MAX_WINDOWS = 32               # windows parsed per long line
SPARSE_HITS = 2000             # more trigger hits than this in one block: dense path
SEEN_LIMIT = 65536             # line shapes remembered for the dense path (then forgotten and restarted)
SEEN_LINE = 512                # only short lines are remembered: memory stays bounded (SEEN_LIMIT x SEEN_LINE)
HELD_RANKS = 8192              # ranks whose first and last memory report are held to the end (8 MiB at most)
SHAPE_PARSES = 32              # in a flood, lines of one shape (digits removed) parsed at most this often per block
HEAD_BYTES = 8 << 20           # context (versions, config dumps, the launch command) is looked for in this head
_DIGITS = b"0123456789"
GZIP_MAGIC = b"\x1f\x8b"
READ_ERRORS = (OSError, EOFError, zlib.error, ValueError)   # ValueError: read on a closed stream
# A gzip member that inflates past this ratio (and this floor) is a bomb, not a log: job logs compress 5-20x, a
# flood of one line shape up to ~50x; 3 MB of zeros inflate to 3 GB (a minute of reading for nothing).
GZIP_RATIO = 100
GZIP_FLOOR = 256 << 20


@dataclass
class Source:
    """One input as the reader saw it."""
    name: str
    bytes_read: int = 0
    problems: list[str] = field(default_factory=list)
    long_lines: int = 0
    gzip: bool = False
    skipped: bool = False       # not a regular file: reported, never read
    compressed: _Counted | None = None   # gzip: the compressed side, counted to bound the inflation ratio
    bomb: bool = False          # gzip: reading stopped at GZIP_RATIO (not a log; the rest is unread)


class _Counted(io.RawIOBase):
    """A read-only stream that counts the bytes read through it (the compressed side of a gzip input)."""

    def __init__(self, raw: BinaryIO) -> None:
        self.raw, self.count = raw, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.raw.read(len(buffer))
        self.count += len(data)
        buffer[:len(data)] = data
        return len(data)


def expand(paths: list[str]) -> list[str]:
    out: list[str] = []
    for p in paths:
        hits = sorted(glob.glob(p)) if p != "-" and any(c in p for c in "*?[") else [p]
        out += hits or [p]
    return out


def non_regular(path: str) -> str | None:
    """What ``path`` is when it is not a regular file (a link to one is one): "a fifo", "a folder", ...; None
    for a regular file, for ``-``, and for a path that cannot be inspected (opening it reports why)."""
    if path == "-":
        return None
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return _kind(mode)


def _kind(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    return ("a folder" if stat.S_ISDIR(mode) else "a fifo (named pipe)" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "not a regular file")


def skipped_problem(path: str, kind: str) -> str:
    return (f"{path}: is {kind}, not a log file; skipped (the doctor reads regular files, and standard input "
            f"as -: `cat -- {quoted_word(path)} | mbmem doctor -`)")


def _open_regular(path: str, src: Source) -> BinaryIO | None:
    """Open ``path`` for reading without ever blocking on it: O_NONBLOCK makes opening a fifo return at once,
    and the opened file itself is checked (a path swapped for a fifo after the check is refused too)."""
    kind = non_regular(path)
    if kind:
        src.problems.append(skipped_problem(path, kind))
        src.skipped = True
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as exc:
        src.problems.append(f"{path}: cannot read ({getattr(exc, 'strerror', None) or exc})")
        return None
    kind = _kind(os.fstat(fd).st_mode)
    if kind:
        os.close(fd)
        src.problems.append(skipped_problem(path, kind))
        src.skipped = True
        return None
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return open(fd, "rb")  # noqa: SIM115 — the stream is returned; scan() closes it


def _stdin() -> BinaryIO | None:
    stream = getattr(sys.stdin, "buffer", None)
    if stream is None or stream.closed:
        return None
    return stream


def open_log(path: str, src: Source) -> BinaryIO | None:
    """The decompressed byte stream, or None with the reason in ``src.problems``."""
    if path == "-":
        raw = _stdin()
        if raw is None:
            src.problems.append("-: standard input is closed; pipe a log in (`cat job.log | mbmem doctor -`) "
                                "or give a file name")
            return None
    else:
        raw = _open_regular(path, src)
        if raw is None:
            return None
    try:
        head = raw.peek(2)[:2] if hasattr(raw, "peek") else b""
    except READ_ERRORS as exc:
        src.problems.append(f"{path}: cannot read ({exc})")
        return None
    if head == GZIP_MAGIC:  # the gzip magic, on files and on stdin alike (issue 15, item 18)
        src.gzip = True
        src.compressed = _Counted(raw)
        return gzip.GzipFile(fileobj=src.compressed, mode="rb")
    return raw


def _pieces(line: bytes, triggers: tuple[bytes, ...], src: Source, folded: tuple[bytes, ...] = ()) -> list[bytes]:
    """A short line whole; a long one as windows around its trigger literals (bounded count)."""
    if len(line) <= MAX_LINE:
        return [line]
    src.long_lines += 1
    starts: list[int] = []
    low = line.lower() if folded else b""
    for text, lits in ((line, triggers), (low, folded)):
        for lit in lits:
            i = text.find(lit)
            while i >= 0 and len(starts) < 4 * MAX_WINDOWS:
                starts.append(i)
                i = text.find(lit, i + WINDOW_AFTER)
    windows: list[tuple[int, int]] = []
    for i in sorted(starts):
        lo, hi = max(0, i - WINDOW_BEFORE), i + WINDOW_AFTER
        if windows and lo <= windows[-1][1]:
            windows[-1] = (windows[-1][0], max(hi, windows[-1][1]))
            if windows[-1][1] - windows[-1][0] > MAX_LINE:   # a run of overlapping hits stays bounded too
                windows[-1] = (windows[-1][0], windows[-1][0] + MAX_LINE)
        else:
            windows.append((lo, hi))
        if len(windows) >= MAX_WINDOWS:
            break
    return [line[a:b] for a, b in windows]


def trigger_lines(stream: BinaryIO, triggers: tuple[bytes, ...], src: Source,
                  head_triggers: tuple[bytes, ...] = (), folded: tuple[bytes, ...] = ()
                  ) -> Iterator[tuple[int, bytes, bytes]]:
    """(line number, bounded line text, the text after it in the block (for wrapped messages)).

    ``head_triggers`` are looked for only in the first HEAD_BYTES (context printed at start-up): every
    literal is one more pass over each block, so the body of a large log is scanned for the failure
    literals alone (issue 15, item 17). ``folded`` literals (lower case) match in any case: one lower-casing
    pass over the block stands for the case variants ("oom" for OOM, "alloc" for ALLOC_FAILED and calloc),
    cheaper than a pass per spelling (issue 23: 1 GB in under 15 s)."""
    carry, lineno = b"", 1
    seen: dict[bytes, int] = {}
    reports = _Reports()
    while True:
        try:
            block = stream.read(BLOCK)
        except READ_ERRORS as exc:
            src.problems.append(f"{src.name}: read failed part-way ({type(exc).__name__}: {exc}); "
                                "diagnosing what was read")
            block = b""
            if not carry:
                break
        src.bytes_read += len(block)
        if src.compressed is not None and src.bytes_read > max(GZIP_FLOOR, GZIP_RATIO * src.compressed.count):
            src.problems.append(f"{src.name}: inflated to more than {GZIP_RATIO}x its compressed size (stopped after "
                                f"{src.bytes_read / 1e6:.0f} MB): a gzip bomb, not a log; diagnosing what was read")
            src.bomb, block = True, b""
        data = carry + block
        cut = data.rfind(b"\n") + 1
        if block and cut == 0 and len(data) < MAX_CARRY:
            carry = data  # one long line: keep reading, bounded by MAX_CARRY
            continue
        work, carry = (data[:cut], data[cut:]) if (cut and block) else (data, b"")
        scan_for = triggers + head_triggers if src.bytes_read - len(block) < HEAD_BYTES else triggers
        present = tuple(lit for lit in scan_for if lit in work)
        low = work.lower() if folded else b""
        present_folded = tuple(lit for lit in folded if lit in low)
        if present or present_folded:
            spans = _spans(work, low, present, present_folded)
            lines = (_dense(work, present, present_folded, seen, reports, lineno, src) if spans is None
                     else _sparse(work, spans, present, present_folded, reports, lineno, src))
            for offset, line, after in lines:
                yield lineno + offset, line, after
        lineno += work.count(b"\n")
        if not block:
            break
    yield from reports.lines()


def _spans(work: bytes, low: bytes, present: tuple[bytes, ...], folded: tuple[bytes, ...]) -> set | None:
    """The (start, end) of every line holding a literal, or None past SPARSE_HITS lines (a flood: dense path).
    Each literal's search resumes after the line it found, so a line costs one step per literal at most.
    Memory reports do not count towards the flood: they are kept per rank (_Reports), whatever their number."""
    spans: set[tuple[int, int]] = set()
    others = 0
    for text, lits in ((work, present), (low, folded)):
        for lit in lits:
            i = text.find(lit)
            while i >= 0:
                start = work.rfind(b"\n", 0, i) + 1
                end = work.find(b"\n", i)
                end = len(work) if end < 0 else end
                if (start, end) not in spans:
                    spans.add((start, end))
                    if work.find(MEMORY_LINE, start, end) < 0 or end - start > SEEN_LINE:
                        others += 1
                        if others > SPARSE_HITS:
                            return None
                i = text.find(lit, end)
    return spans


def _sparse(work: bytes, spans: set, present: tuple[bytes, ...], folded: tuple[bytes, ...], reports: _Reports,
            base: int, src: Source) -> Iterator[tuple[int, bytes, bytes]]:
    pos, offset = 0, 0
    for start, end in sorted(spans):
        offset += work.count(b"\n", pos, start)
        pos = start
        line = work[start:end]
        if reports.keep(base + offset, line):
            continue
        after = work[end + 1:end + 1 + WINDOW_AFTER]
        for piece in _pieces(line, present, src, folded):
            yield offset, piece, after


MEMORY_LINE = b"memory ("
_RANK_TAG = re.compile(rb"\[Rank \d{1,9}\]")
_PREFIX_KEY = re.compile(rb"^\s{0,4}(?:\[(?:rank|default)\d{1,6}\]:|\d{1,6}: )")


class _Reports:
    """Each rank's memory reports: only its first and its last in the whole input are parsed (the run report uses
    the latest; the first tells the earliest iteration), whatever their number. Many ranks print the same shape
    of line, so the flood filter cannot tell them apart; the rank tag does. The two lines per rank are held
    (bounded: HELD_RANKS ranks of lines up to SEEN_LINE bytes) and handed on at the end of the input."""

    def __init__(self) -> None:
        self.by_rank: dict[bytes, list] = {}

    def keep(self, lineno: int, line: bytes) -> bool:
        """True when ``line`` is a memory report now held here (not to be handed on in place)."""
        if MEMORY_LINE not in line or len(line) > SEEN_LINE:
            return False
        m = _RANK_TAG.search(line, 0, 200) or _PREFIX_KEY.match(line)
        key = m.group(0) if m else b""
        first_last = self.by_rank.get(key)
        if first_last is None:
            if len(self.by_rank) >= HELD_RANKS:
                return False
            self.by_rank[key] = [(lineno, line), None]
        else:
            first_last[1] = (lineno, line)
        return True

    def lines(self) -> Iterator[tuple[int, bytes, bytes]]:
        for first, last in self.by_rank.values():
            for lineno, line in (first, last) if last else (first,):
                yield lineno, line, b""


def _dense(work: bytes, present: tuple[bytes, ...], folded: tuple[bytes, ...], seen: dict[bytes, int],
           reports: _Reports, base: int, src: Source) -> Iterator[tuple[int, bytes, bytes]]:
    # A flood: lines of one shape (the line without its digits: "task 17 Killed" and "task 18 Killed" are one
    # shape) are parsed SHAPE_PARSES times per block at most, whatever their count; the work per block is
    # bounded by its number of shapes, and a flood of one template costs a split and a dict lookup per line.
    # Memory reports of many ranks share one shape, so they are kept apart by rank instead (_Reports).
    seen.clear()
    for offset, line in enumerate(work.split(b"\n")):
        if reports.keep(base + offset, line):
            continue
        if len(line) <= SEEN_LINE:
            shape = line.translate(None, _DIGITS)
            count = seen.get(shape, 0)
            if count >= SHAPE_PARSES:
                continue
            if len(seen) >= SEEN_LIMIT:
                seen.clear()
            seen[shape] = count + 1
        if any(lit in line for lit in present) or (folded and any(lit in line.lower() for lit in folded)):
            for piece in _pieces(line, present, src, folded):
                yield offset, piece, b""
