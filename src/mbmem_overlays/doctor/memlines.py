"""The per-rank memory lines every Megatron / Bridge job prints, read exactly (pure; no torch, no Bridge).

Formats (shared/reference/runtime-outputs.md; read in the installed sources):

- Megatron-LM ``report_memory`` (megatron/training/utils/common_utils.py): ``[Rank N] (after K iterations)
  memory (MB) | allocated: A | max allocated: B | reserved: C | max reserved: D`` and, with
  ``--log-device-memory-used``, ``| total device memory used: E``. MB is torch bytes / 1024² (MiB); values
  are ``.2f`` in current versions and full float reprs in older ones; old versions print no ``[Rank N]``.
- Bridge 0.6.2 ``training_log`` + ``report_memory`` (bridge/training/utils/train_utils.py :1226-1297):
  ``[Rank R] (after K iterations) memory (GB) | <metric>: <value> | ...``, one ``| name: value`` per entry of
  ``MEMORY_KEYS`` (:258) or of the user's ``logger.memory_keys``. A torch statistic whose name holds
  ``bytes`` is divided by 1e9 (decimal GB), rounded to 5 significant digits and its *metric* name has
  ``bytes`` replaced by ``gigabytes``; any other statistic (``num_alloc_retries`` -> ``mem-alloc-retires``,
  sic; ``allocation.all.current`` -> ``mem-allocated-count``) is printed as torch returns it, an int. So a
  value printed as a Python float is a GB figure and one printed as an int is a count, whatever the user
  named the metric: that is how user-named metrics are read.
- ``Theoretical memory footprints: weight and optimizer=X MB, activation=Y MB, total=Z MB`` (Megatron-LM
  training/theoretical_memory_usage.py; Bridge theoretical_memory_utils.py, NUM_BYTES_IN_MEGABYTE = 1024²).

Several reports may share one line (two processes writing at once), lines carry launcher prefixes
(``3: ``, ``[default0]:``, ``name/0 ``) and timestamps. A report whose numbers are not a real allocator's
(negative, not finite, above 1 PiB, a peak below the current value, reserved below allocated, all zero) is
kept as *unreadable* with the reason, and never used for a verdict or a plot.
"""

from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass, field

MiB = 1 << 20
GB = 10**9
MAX_BYTES = 1 << 50            # 1 PiB on one GPU is a typo or garbage, never a measurement
MAX_COUNT = 10**12
MAX_FIELDS = 64                # "| name: value" pieces read per report
MAX_REPORTS_PER_LINE = 16
RANK_LIMIT = 1 << 20           # a [Rank N] beyond this is not a rank of any real job
MAX_RANKS = 1 << 16            # ranks whose series are kept (memory stays bounded whatever the log)
TOLERANCE = 1e-3               # relative: printed values are rounded (5 significant digits, or .2f MiB)

# "[Rank 3] (after 10 iterations) memory (MB)" with the rank and the iteration optional (older Megatron-LM):
# the literal is found first (str.find), then what precedes it is matched backwards on a bounded window.
ANCHOR = "memory ("
UNITS_SEEN = ("MB)", "GB)")
# Older Megatron-LM wrote the iteration without parentheses ("after 5 iterations memory (MB)").
BEFORE = re.compile(r"(?:\[Rank (\d{1,9})\]\s{0,4})?(?:\(?after (\d{1,12}) iterations?\)?\s{0,4})?\Z")
BEFORE_WINDOW = 64
VALUE = re.compile(r"\s{0,8}(-?(?:\d{1,24}(?:\.\d{0,24})?|\.\d{1,24})(?:[eE][+-]?\d{1,4})?|-?(?i:nan|inf))(?![\w.])")
_PLAIN = frozenset("0123456789.")
THEORY = re.compile(r"Theoretical memory footprints: ")
THEORY_PART = re.compile(r"([A-Za-z][A-Za-z ]{0,40})=(\d{1,15}(?:\.\d{1,6})?) (MB|GB)")

# Field -> what it is. Megatron-LM's names (MiB), Bridge's default metric names (GB / counts).
MEGATRON_LM_NAMES = {"allocated": "allocated", "max allocated": "max_allocated", "reserved": "reserved",
                     "max reserved": "max_reserved", "total device memory used": "device_used"}
BRIDGE_NAMES = {
    "mem-allocated-gigabytes": "allocated", "mem-active-gigabytes": "active",
    "mem-inactive-gigabytes": "inactive", "mem-reserved-gigabytes": "reserved",
    "mem-max-allocated-gigabytes": "max_allocated", "mem-max-active-gigabytes": "max_active",
    "mem-max-inactive-gigabytes": "max_inactive", "mem-max-reserved-gigabytes": "max_reserved",
    "mem-alloc-retires": "alloc_retries", "mem-alloc-retries": "alloc_retries",
    "mem-allocated-count": "alloc_count",
}
BYTE_FIELDS = ("allocated", "max_allocated", "reserved", "max_reserved", "active", "max_active", "inactive",
               "max_inactive", "device_used")
COUNT_FIELDS = ("alloc_retries", "alloc_count", "num_ooms")
# (current, peak) pairs: a peak below its current value is not an allocator's report.
PAIRS = (("allocated", "max_allocated"), ("reserved", "max_reserved"), ("active", "max_active"),
         ("inactive", "max_inactive"))


@dataclass(frozen=True)
class MemoryReport:
    """One printed report of one rank. Bytes are converted from the printed unit; None = not printed."""
    rank: int | None
    iteration: int | None
    where: str                       # file:line
    unit: str                        # "MB" (MiB, Megatron-LM) or "GB" (decimal, Bridge)
    values: dict[str, int] = field(default_factory=dict)        # field -> bytes (or a count)
    printed: dict[str, str] = field(default_factory=dict)       # field -> the value as printed
    inferred: tuple[str, ...] = ()   # user metric names read by their words ("peak_alloc -> max allocated")
    other: tuple[tuple[str, str], ...] = ()                     # metrics we could not place, as printed
    unreadable: str = ""             # why the report is not used ("" = it is)
    line: str = ""

    @property
    def fmt(self) -> str:
        return "Megatron-LM (MB = MiB)" if self.unit == "MB" else "Megatron Bridge (GB = 10^9 bytes)"

    def get(self, name: str) -> int | None:
        return self.values.get(name)

    @property
    def peak_used(self) -> int | None:
        return peak_of(self.values)


def peak_of(values: dict[str, int]) -> int | None:
    """What the caching allocator held at its peak: max reserved, else max allocated (else the current ones)."""
    for name in ("max_reserved", "max_allocated", "reserved", "allocated"):
        if name in values:
            return values[name]
    return None


@dataclass(frozen=True)
class Theoretical:
    """The job's own printed estimate (first pipeline stage, rank 0), in bytes."""
    where: str
    parts: dict[str, int]
    line: str = ""

    @property
    def total(self) -> int | None:
        return self.parts.get("total")


def _number(text: str) -> tuple[str, float] | None:
    raw = text.strip()
    if raw and len(raw) <= 24 and _PLAIN.issuperset(raw) and raw.count(".") <= 1 and raw != ".":
        return raw, float(raw)      # the common case, "36.41" or "54556.0", without the regex
    m = VALUE.match(text)
    if not m:
        return None
    raw = m.group(1)
    try:
        return raw, float(raw)
    except (ValueError, OverflowError):
        return None


def _user_field(name: str, raw: str) -> tuple[str | None, bool]:
    """(field, is a count) for a metric name of the user's ``logger.memory_keys``, by its words: Bridge prints
    a byte statistic as a float (GB) and a count as an int (report_memory), so the printed form decides."""
    words = re.sub(r"[-_. ]+", " ", name.lower())
    is_count = not any(c in raw for c in ".eEnN")         # int repr: a count; float repr: GB
    if "retr" in words or "retire" in words:
        return "alloc_retries", True
    if any(w in ("oom", "ooms") for w in words.split()):
        return "num_ooms", True
    if is_count:
        return ("alloc_count" if "alloc" in words else None), True
    peak = "max" in words or "peak" in words
    for word, base in (("inactive", "inactive"), ("active", "active"), ("reserved", "reserved"),
                       ("segment", "reserved"), ("alloc", "allocated")):
        if word in words:
            return (f"max_{base}" if peak else base), False
    return None, False


def parse_reports(text: str, where: str, rank_hint: int | None) -> list[MemoryReport]:
    """Every memory report on one (bounded) line; ``rank_hint`` is the launcher prefix's rank, used when the
    report carries no ``[Rank N]``."""
    heads = []   # (start of the report's prefix, end of "memory (MB)", unit, rank, iteration)
    i = text.find(ANCHOR)
    while i >= 0 and len(heads) < MAX_REPORTS_PER_LINE:
        unit_end = i + len(ANCHOR) + 3
        if text[i + len(ANCHOR):unit_end] in UNITS_SEEN:
            lo = max(0, i - BEFORE_WINDOW)
            m = BEFORE.search(text, lo, i)
            start = m.start() if m and m.group(0) else i
            heads.append((start, unit_end, text[unit_end - 3:unit_end - 1],
                          m.group(1) if m else None, m.group(2) if m else None))
        i = text.find(ANCHOR, i + 1)
    out = []
    for k, (start, end, unit, rank, iteration) in enumerate(heads):
        stop = heads[k + 1][0] if k + 1 < len(heads) else len(text)
        out.append(_report(unit, int(rank) if rank else rank_hint, int(iteration) if iteration else None,
                           text[end:stop], where, text))
    return out


def _report(unit: str, rank: int | None, iteration: int | None, body: str, where: str, line: str) -> MemoryReport:
    values: dict[str, int] = {}
    printed: dict[str, str] = {}
    inferred, other, problems = [], [], []
    if rank is not None and rank >= RANK_LIMIT:
        problems.append(f"rank {rank} is not a rank of a real job")
    for piece in body.split("|")[1:MAX_FIELDS + 1]:
        name, sep, rest = piece.partition(":")
        name = name.strip()
        if not sep or not name:
            continue
        num = _number(rest)
        if num is None:
            problems.append(f"{name}: {rest.strip()[:24]!r} is not a number")
            continue
        raw, value = num
        if unit == "MB":
            key, count = MEGATRON_LM_NAMES.get(name.lower()), False
        else:
            key = BRIDGE_NAMES.get(name)
            count = key in COUNT_FIELDS if key else False
            if key is None:
                key, count = _user_field(name, raw)
                if key is not None:
                    inferred.append(f"{name} -> {key.replace('_', ' ')}")
        if key is None:
            other.append((name, raw))
            continue
        if not math.isfinite(value) or value < 0:
            problems.append(f"{name}: {raw} is not a memory figure")
            continue
        if count:
            if value != int(value) or value > MAX_COUNT:
                problems.append(f"{name}: {raw} is not a count")
                continue
            values[key] = int(value)
        else:
            nbytes = value * (MiB if unit == "MB" else GB)
            if nbytes > MAX_BYTES:
                problems.append(f"{name}: {raw} {unit} is more than 1 PiB")
                continue
            values[key] = int(round(nbytes))
        printed[key] = raw
    problems += _consistency(values)
    if not problems and not any(k in values for k in ("max_allocated", "max_reserved", "allocated", "reserved")):
        problems.append("no allocated or reserved figure")
    elif not problems and all(values.get(k, 0) == 0 for k in BYTE_FIELDS):
        problems.append("every figure is 0 (the device reported no memory: not a CUDA device, or the line was "
                        "printed before anything was allocated)")
    return MemoryReport(rank, iteration, where, unit, values, printed, tuple(inferred), tuple(other),
                        "; ".join(problems), line)


def _consistency(values: dict[str, int]) -> list[str]:
    out = []

    def below(a: str, b: str) -> bool:  # a < b beyond the printed rounding
        return a in values and b in values and values[a] < values[b] * (1 - TOLERANCE) - 2 * MiB
    for current, peak in PAIRS:
        if below(peak, current):
            out.append(f"{peak.replace('_', ' ')} is below {current} (a peak cannot be)")
    if below("max_reserved", "max_allocated") or below("reserved", "allocated"):
        out.append("reserved is below allocated (the allocator reserves every allocated byte)")
    return out


def parse_theoretical(text: str, where: str) -> Theoretical | None:
    m = THEORY.search(text)
    if not m:
        return None
    parts = {}
    for pm, _ in zip(THEORY_PART.finditer(text, m.end()), range(16)):
        name = "_".join(pm.group(1).strip().lower().split())
        scale = MiB if pm.group(3) == "MB" else 1 << 30     # NUM_BYTES_IN_MEGABYTE / _GIGABYTE (binary)
        parts[name] = int(round(float(pm.group(2)) * scale))
    return Theoretical(where, parts, text.strip()[:400]) if parts else None


@dataclass
class RankSeries:
    """The reports of one rank: the latest is the one used (peaks only grow), the first iteration is kept to
    tell whether the figures can include a whole step with the optimizer state."""
    latest: MemoryReport
    first_iteration: int | None
    reports: int = 1


def pressure(values: dict[str, int]) -> int:
    """How close a report is to its GPU's capacity, without knowing it: the most the device held (the allocator's
    peak, or the device's total use when printed). The higher, the more a rank is at risk."""
    return max(peak_of(values) or 0, values.get("device_used") or 0)


@dataclass
class Dropped:
    """Ranks left out once MAX_RANKS are kept: always the ones with the lowest pressure, so the hottest ranks (and
    with them the verdict and the hot rank) are all kept, whatever order the log prints them in."""
    heap: list = field(default_factory=list)       # (pressure, order, key) of the kept series; stale entries skipped
    order: int = 0
    ranks: bytearray = field(default_factory=bytearray)   # bit per dropped rank, grown on the first drop
    unnamed: int = 0                               # dropped series that name no rank (one per file)
    reports: int = 0                               # reports not kept (of dropped ranks)

    def mark(self, key, dropped: bool) -> None:
        if isinstance(key, int) and 0 <= key < RANK_LIMIT:
            if (key >> 3) >= len(self.ranks):
                if not dropped:
                    return
                self.ranks.extend(bytes((key >> 3) + 1 - len(self.ranks)))
            if dropped:
                self.ranks[key >> 3] |= 1 << (key & 7)
            else:
                self.ranks[key >> 3] &= ~(1 << (key & 7)) & 0xFF
        elif dropped:
            self.unnamed += 1

    def push(self, key, report: MemoryReport, kept: dict) -> None:
        self.order += 1
        heapq.heappush(self.heap, (pressure(report.values), self.order, key))
        if len(self.heap) > 4 * MAX_RANKS:   # updates leave stale entries: rebuild from what is kept
            self.heap = [(pressure(sr.latest.values), i, k) for i, (k, sr) in enumerate(kept.items())]
            heapq.heapify(self.heap)

    def coolest(self, kept: dict):
        """(pressure, key) of the kept series with the lowest pressure."""
        while self.heap:
            value, _, key = self.heap[0]
            sr = kept.get(key)
            if sr is not None and pressure(sr.latest.values) == value:
                return value, key
            heapq.heappop(self.heap)
        return None

    def summary(self) -> dict | None:
        """What was dropped: count, lowest and highest rank; None when nothing was."""
        bits = int.from_bytes(self.ranks, "little")
        count = bits.bit_count()
        if not count and not self.unnamed:
            return None
        first = (bits & -bits).bit_length() - 1 if count else None
        last = bits.bit_length() - 1 if count else None
        return {"ranks": count, "unnamed": self.unnamed, "first_rank": first, "last_rank": last,
                "reports": self.reports, "kept": MAX_RANKS}


def add_report(series: dict, key, report: MemoryReport, dropped: Dropped | None = None) -> bool:
    """Keep ``report`` for ``key`` if it is the latest so far (a higher iteration, or the same/unknown
    iteration printed later). Once ``series`` holds MAX_RANKS keys, a new key replaces the kept series with the
    lowest pressure when its own is higher (``dropped`` records what was left out); False when the report
    was not kept."""
    dropped = dropped if dropped is not None else Dropped()
    seen = series.get(key)
    if seen is None:
        if len(series) >= MAX_RANKS:
            coolest = dropped.coolest(series)
            if coolest is None or pressure(report.values) <= coolest[0]:
                dropped.mark(key, True)
                dropped.reports += 1
                return False
            dropped.reports += series[coolest[1]].reports
            del series[coolest[1]]
            dropped.mark(coolest[1], True)
        series[key] = RankSeries(report, report.iteration)
        dropped.mark(key, False)
        dropped.push(key, report, series)
        return True
    seen.reports += 1
    if report.iteration is not None and (seen.first_iteration is None or report.iteration < seen.first_iteration):
        seen.first_iteration = report.iteration
    if seen.latest.iteration is None or report.iteration is None or report.iteration >= seen.latest.iteration:
        seen.latest = report
        dropped.push(key, report, series)
    return True
