"""A loaded snapshot as checked, typed data: every format PyTorch has written, told apart and named.

Formats (torch/cuda/memory.py ``_snapshot`` docstring, torch/csrc/cuda/Module.cpp ``memorySnapshot``,
torch/cuda/_memory_viz.py ``_block_extra_legacy``):

- a dict with ``segments`` and ``device_traces`` (one list per device; entries with ``action``, ``addr`` or
  ``device_free``, ``size``, ``stream``, and in newer torch ``time_us``, ``frames``, ``pool_id``,
  ``compile_context``, ``user_metadata``), and in newer torch ``allocator_settings`` and ``external_annotations``;
- older blocks carry ``history: [{addr, real_size, frames}]`` instead of ``requested_size``/``frames``;
- ``torch.cuda.memory_snapshot()``: the bare list of segments;
- expandable segments: ``is_expandable`` segments (one per contiguous mapped range) and ``segment_map`` /
  ``segment_unmap`` trace entries.

Validation is one pass over the data, never recursive; anything that is not the documented shape is either
refused (the file is not a snapshot) or counted as a problem and left out, never guessed at.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from ...core.text import shown

ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map",
           "segment_unmap", "oom", "snapshot", "annotate")
ALLOC, FREE_REQUESTED, FREE_COMPLETED, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP, OOM, SNAPSHOT, \
    ANNOTATE = range(len(ACTIONS))
IGNORED = 255                           # malformed or unknown entries: counted, never replayed
CODE = {name: i for i, name in enumerate(ACTIONS)}
CODE["free"] = FREE_COMPLETED           # never written by torch; _memory_viz's merged free_requested+free_completed
STATES = {"active_allocated": "allocated", "active_pending_free": "pending", "active_awaiting_free": "pending",
          "inactive": "inactive"}
MAX_INT = 1 << 63                       # sizes, addresses and streams are int64 in torch
SMALL_SEGMENT = 2 << 20                 # kSmallBuffer: segments of the small pool (requests <= 1 MiB)
MAX_PROBLEMS = 20
MAX_UINT = 1 << 64                      # size_t settings: max_split_size is SIZE_MAX when unset
MAX_KEY = 100                           # an allocator_settings key, as kept
# What analysing costs beyond the loaded objects (the Trace's columns, the replay's per-position totals, the
# blocks re-created at a moment and their layout): charged against the reader's memory budget (load.py), so a
# file whose segments or entries are the same few objects referenced over and over is refused, not expanded.
ENTRY_COST, BLOCK_COST = 320, 480


class MalformedSnapshot(Exception):
    """The object is not a memory snapshot (wrong shape where the reader cannot go on)."""


def shown_value(value: Any, limit: int = 80) -> str:
    """A value from a file, for a message: bounded whatever it is. At most 4 items of a container, 3 levels
    deep, strings cut to ``limit``, an integer past 30 digits by its size (str() of a many-thousand-digit
    integer raises, and a list that holds the same list twice at each level repeats exponentially in repr),
    then escaped (core.text.shown) and cut to ``limit`` characters."""
    text = shown(_bounded(value, 3, limit))
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _bounded(value: Any, level: int, limit: int) -> str:
    t = type(value)
    if t is str:
        return repr(value[:limit]) + ("..." if len(value) > limit else "")
    if t is int:
        return str(value) if value.bit_length() <= 100 else f"<an integer of {value.bit_length():,} bits>"
    if t is float or t is bool or value is None:
        return repr(value)
    if t in (bytes, bytearray):
        return repr(bytes(value[:limit])) + ("..." if len(value) > limit else "")
    if t in (list, tuple, set, frozenset, dict):
        if level <= 0:
            return f"<a {t.__name__} of {len(value):,} items>"
        if t is dict:
            parts = [f"{_bounded(k, level - 1, limit)}: {_bounded(v, level - 1, limit)}"
                     for k, v in islice(value.items(), 4)]
        else:
            parts = [_bounded(v, level - 1, limit) for v in islice(value, 4)]
        if len(value) > 4:
            parts.append(f"... {len(value) - 4:,} more")
        body = ", ".join(parts)
        return {list: "[{}]", tuple: "({})", dict: "{{{}}}"}.get(t, t.__name__ + "({{{}}})").format(body)
    return f"<a {t.__name__}>"


@dataclass(frozen=True)
class Block:
    address: int
    size: int
    requested: int
    state: str            # allocated | pending | inactive
    frames: Any           # the file's frame list (never copied), or ()


@dataclass(frozen=True)
class Segment:
    device: int
    address: int
    total_size: int
    stream: int
    kind: str             # small | large
    pool: tuple | None    # segment_pool_id; (0, 0) is the default pool
    expandable: bool
    blocks: tuple[Block, ...]
    frames: Any = ()


@dataclass
class Trace:
    """One device's trace entries as columns (an entry index is a position in each)."""
    action: bytearray = field(default_factory=bytearray)
    addr: array = field(default_factory=lambda: array("q"))     # device_free for oom entries (as torch stores it)
    size: array = field(default_factory=lambda: array("q"))
    stream: array = field(default_factory=lambda: array("q"))
    time_us: array = field(default_factory=lambda: array("q"))  # 0 where the entry has none
    frames: list = field(default_factory=list)
    pool: list = field(default_factory=list)                    # pool_id where given, else None

    def __len__(self) -> int:
        return len(self.action)


@dataclass(frozen=True)
class Format:
    layout: str                  # snapshot_dict | segment_list
    features: tuple[str, ...]

    @property
    def description(self) -> str:
        head = {"snapshot_dict": "torch.cuda.memory._snapshot() dict (segments + device_traces)",
                "segment_list": "torch.cuda.memory_snapshot() list of segments (no trace)"}[self.layout]
        return head + (f"; {', '.join(self.features)}" if self.features else "")


@dataclass
class Snapshot:
    format: Format
    segments: dict[int, list[Segment]]
    traces: dict[int, Trace]
    allocator_settings: dict[str, Any]
    annotations: int = 0
    problems: list[str] = field(default_factory=list)
    ignored_entries: int = 0

    @property
    def devices(self) -> list[int]:
        return sorted(set(self.segments) | {d for d, t in self.traces.items() if len(t)})

    def note(self, text: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(text)
        elif len(self.problems) == MAX_PROBLEMS:
            self.problems.append("... more problems not shown")


def _int(value: Any) -> int | None:
    return value if type(value) is int and 0 <= value < MAX_INT else None


def _signed(value: Any) -> int | None:
    return value if type(value) is int and -MAX_INT <= value < MAX_INT else None


def _frames(value: Any) -> Any:
    return value if type(value) is list else ()


def _pool(value: Any) -> tuple | None:
    if type(value) is tuple and len(value) == 2 and all(_signed(v) is not None for v in value):
        return value
    return None


def _block(raw: Any, address: int, where: str, features: set[str]) -> Block:
    if type(raw) is not dict:
        raise MalformedSnapshot(f"{where} is a {type(raw).__name__}, not a block (a dict)")
    size = _int(raw.get("size"))
    state = STATES.get(raw.get("state")) if type(raw.get("state")) is str else None
    if size is None or state is None:
        raise MalformedSnapshot(f"{where} has no valid size/state (size {shown_value(raw.get('size'), 40)}, "
                                f"state {shown_value(raw.get('state'), 40)})")
    given = _int(raw.get("address"))
    if "history" in raw and "frames" not in raw:  # older torch: the block's allocations as history entries
        features.add("block history (older torch)")
        history = raw.get("history")
        first = history[0] if type(history) is list and history and type(history[0]) is dict else {}
        requested = _int(first.get("real_size"))
        frames = _frames(first.get("frames"))
    else:
        requested = _int(raw.get("requested_size"))
        frames = _frames(raw.get("frames"))
    if requested is None:
        requested = size if state != "inactive" else 0
    return Block(address if given is None else given, size, requested, state, frames)


def _segment(raw: Any, i: int, features: set[str], snap_problems: list[str]) -> Segment:
    where = f"segments[{i}]"
    if type(raw) is not dict:
        raise MalformedSnapshot(f"{where} is a {type(raw).__name__}, not a segment (a dict)")
    address, total = _int(raw.get("address")), _int(raw.get("total_size"))
    blocks_raw = raw.get("blocks")
    if address is None or total is None or type(blocks_raw) is not list:
        raise MalformedSnapshot(f"{where} lacks a valid address, total_size or blocks list")
    device = raw.get("device", 0)
    if type(device) is not int or not 0 <= device < 1 << 16:
        raise MalformedSnapshot(f"{where}.device is not a device index")
    blocks, cursor = [], address
    for j, b in enumerate(blocks_raw):
        block = _block(b, cursor, f"{where}.blocks[{j}]", features)
        blocks.append(block)
        cursor = block.address + block.size
    covered = sum(b.size for b in blocks)
    if covered != total:
        snap_problems.append(f"{where}: its blocks add up to {covered} bytes, its total_size is {total}")
    expandable = raw.get("is_expandable") is True
    if expandable:
        features.add("expandable segments")
    kind = raw.get("segment_type")
    kind = kind if kind in ("small", "large") else ("small" if total == SMALL_SEGMENT and not expandable else "large")
    stream = _signed(raw.get("stream", 0))
    for key, state in (("allocated_size", "allocated"), ("active_size", None)):
        reported = _int(raw.get(key))
        if reported is None:
            continue
        computed = sum(b.size for b in blocks if (b.state == state if state else b.state != "inactive"))
        if reported != computed:
            snap_problems.append(f"{where}.{key} is {reported}, its blocks say {computed}")
    return Segment(device, address, total, 0 if stream is None else stream, kind, _pool(raw.get("segment_pool_id")),
                   expandable, tuple(blocks), _frames(raw.get("frames")))


def _trace(entries: Any, device: int, snap: Snapshot, features: set[str]) -> Trace:
    t = Trace()
    if type(entries) is not list:
        raise MalformedSnapshot(f"device_traces[{device}] is a {type(entries).__name__}, not a list of entries")
    unknown: dict[str, int] = {}
    timed = framed = 0
    for e in entries:
        code = IGNORED
        addr = size = stream = 0
        when = 0
        frames, pool = (), None
        if type(e) is dict:
            action = e.get("action")
            code = CODE.get(action, IGNORED) if type(action) is str else IGNORED
            if code == IGNORED:
                name = shown_value(action, 40) if type(action) is str else type(action).__name__
                unknown[name] = unknown.get(name, 0) + 1
            else:
                size = _int(e.get("size", 0))
                addr = _int(e.get("device_free" if code == OOM else "addr", 0))
                stream = _signed(e.get("stream", 0))
                if size is None or addr is None or stream is None:
                    code, size, addr, stream = IGNORED, 0, 0, 0
                    unknown["(malformed)"] = unknown.get("(malformed)", 0) + 1
                when = _int(e.get("time_us", 0)) or 0
                timed += "time_us" in e
                frames = _frames(e.get("frames"))
                framed += bool(frames)
                pool = _pool(e.get("pool_id"))
                if "compile_context" in e or "user_metadata" in e:
                    features.add("compile_context/user_metadata")
        else:
            unknown[type(e).__name__] = unknown.get(type(e).__name__, 0) + 1
        t.action.append(code)
        t.addr.append(addr)
        t.size.append(size)
        t.stream.append(stream)
        t.time_us.append(when)
        t.frames.append(frames)
        t.pool.append(pool)
    if timed:
        features.add("time_us")
    if framed:
        features.add("frames")
    if SEGMENT_MAP in t.action or SEGMENT_UNMAP in t.action:
        features.add("expandable segments")
    ignored = sum(unknown.values())
    if ignored:
        snap.ignored_entries += ignored
        shown_kinds = ", ".join(f"{k} x{v}" for k, v in sorted(unknown.items())[:6])
        snap.note(f"device {device}: {ignored} trace entr{'y' if ignored == 1 else 'ies'} not replayed ({shown_kinds})")
    return t


# allocator_settings keys torch writes (torch/csrc/cuda/Module.cpp memorySnapshot) and the type each must have;
# other keys are kept when their value is a plain scalar. max_split_size is a size_t (SIZE_MAX when unset).
_SETTING_TYPES = {"PYTORCH_CUDA_ALLOC_CONF": (str,), "max_split_size": (int,), "expandable_segments": (bool,),
                  "garbage_collection_threshold": (float, int), "pinned_num_register_threads": (int,),
                  "release_lock_on_malloc": (bool,), "pinned_use_host_register": (bool,),
                  "roundup_power2_divisions": (dict,)}


_TYPE_WORDS = {str: "text", int: "an integer", float: "a number", bool: "true/false", dict: "a table"}


def unread_integer(value: Any) -> str | None:
    """What an integer the loader never built stands for (load.py UNREAD_INTEGER: one too wide to read, left as
    text of the same length in the pickle), or None for any other value."""
    from .load import UNREAD_INTEGER
    if type(value) is str and value.startswith(UNREAD_INTEGER):
        return value[len("<mbmem: "):].split(">", 1)[0]
    return None


def _setting_problem(value: Any) -> str | None:
    """Why a scalar from allocator_settings cannot be kept (reported, then left out), or None."""
    wide = unread_integer(value)
    if wide is not None:
        return f"{wide}, past any allocator setting's range: unreadable"
    t = type(value)
    if t is int and not -MAX_INT <= value < MAX_UINT:
        return f"an integer of {value.bit_length():,} bits, outside any allocator setting's range"
    if t is float and not math.isfinite(value):
        return f"{value!r}, not a finite number"
    if t not in (str, int, float, bool) and value is not None:
        return f"a {t.__name__}, not a number, text or true/false"
    return None


def _settings(raw: Any, problems: list[str]) -> dict[str, Any]:
    """allocator_settings, checked: scalars in range (no NaN, no infinity, no integer past 64 bits), the types
    torch writes for the keys it knows, and the roundup table; anything else is a problem and left out, so a
    value from the file can neither break --json nor --against."""
    if raw is None:
        return {}
    if type(raw) is not dict:
        problems.append(f"allocator_settings is a {type(raw).__name__}, not a dict: ignored")
        return {}
    out: dict[str, Any] = {}
    for key, value in islice(raw.items(), 64):
        if type(key) is not str or len(key) > MAX_KEY:
            problems.append(f"allocator_settings: a key {shown_value(key, 40)} that is not a setting name: left out")
            continue
        where = f"allocator_settings.{shown(key)}"
        wanted = _SETTING_TYPES.get(key)
        if unread_integer(value) is not None:
            problems.append(f"{where} is {_setting_problem(value)} (left out)")
            continue
        if wanted is not None and type(value) not in wanted:
            problems.append(f"{where} is {shown_value(value, 40)}, not {' or '.join(_TYPE_WORDS[w] for w in wanted)} "
                            "as torch writes it: left out")
            continue
        if type(value) is dict:
            table: dict[str, Any] = {}
            for k, v in islice(value.items(), 64):
                why = "a key that is not text" if type(k) is not str or len(k) > MAX_KEY else (
                    _setting_problem(v) if unread_integer(v) is not None else
                    "not a number" if type(v) not in (int, float) else _setting_problem(v))
                if why:
                    problems.append(f"{where}[{shown_value(k, 40)}] is " + (
                        f"{why}; left out" if unread_integer(v) is not None else f"{shown_value(v, 40)}: {why}; left out"))
                else:
                    table[k] = v
            out[key] = table
            continue
        why = _setting_problem(value)
        if why:
            problems.append(f"{where} is {why}: left out")
            continue
        out[key] = value if type(value) is not str else value[:1000]
    if len(raw) > 64:
        problems.append(f"allocator_settings holds {len(raw):,} keys; the first 64 were read")
    return out


def _charge(budget: list[int] | None, units: int, cost: int, what: str) -> None:
    """Take ``units * cost`` bytes from the analysis budget; MalformedSnapshot when it runs out."""
    if budget is None:
        return
    budget[0] -= units * cost
    if budget[0] < 0:
        raise MalformedSnapshot(f"its {what} would take more memory to analyse than the reader allows for a file of "
                                "this size (load.py: 12x the pickle plus 64 MiB, loading included); torch writes each "
                                "segment, block and trace entry once, so a file that references the same ones over "
                                "and over is crafted")


def normalize(data: Any, budget: int | None = None) -> Snapshot:
    """The checked snapshot; MalformedSnapshot when ``data`` is not one, or when analysing it would exceed
    ``budget`` bytes (what the loader left of its memory budget: load.Loaded.budget_left)."""
    left = None if budget is None else [budget]
    features: set[str] = set()
    problems: list[str] = []
    if type(data) is list:
        layout, raw_segments, raw_traces, settings, annotations = "segment_list", data, [], None, None
    elif type(data) is dict:
        if "segments" not in data:
            raise MalformedSnapshot("the pickle is a dict without 'segments': not a memory snapshot")
        layout = "snapshot_dict"
        raw_segments, raw_traces = data.get("segments"), data.get("device_traces", [])
        settings, annotations = data.get("allocator_settings"), data.get("external_annotations")
        if type(raw_segments) is not list:
            raise MalformedSnapshot("'segments' is not a list")
        if type(raw_traces) is not list:
            raise MalformedSnapshot("'device_traces' is not a list (one list of entries per device)")
        if settings is not None:
            features.add("allocator_settings")
        if annotations is not None:
            features.add("external_annotations")
        if "host_segments" in data or "host_traces" in data:
            features.add("host (pinned memory) segments: not analysed")
    else:
        raise MalformedSnapshot(f"the pickle holds a {type(data).__name__}, not a memory snapshot (a dict or a list "
                                "of segments)")
    snap = Snapshot(Format(layout, ()), {}, {}, _settings(settings, problems),
                    len(annotations) if type(annotations) is list else 0)
    for i, raw in enumerate(raw_segments):
        blocks = raw.get("blocks") if type(raw) is dict else None
        _charge(left, 1 + (len(blocks) if type(blocks) is list else 0), BLOCK_COST, f"{len(raw_segments):,} segments")
        seg = _segment(raw, i, features, problems)
        snap.segments.setdefault(seg.device, []).append(seg)
    for device, entries in enumerate(raw_traces):
        if type(entries) is list and not entries:
            continue
        _charge(left, len(entries) if type(entries) is list else 0, ENTRY_COST,
                f"{len(entries) if type(entries) is list else 0:,} trace entries on device {device}")
        snap.traces[device] = _trace(entries, device, snap, features)
    if any(b.frames for segs in snap.segments.values() for s in segs for b in s.blocks):
        features.add("frames")
    if layout == "snapshot_dict" and not snap.traces:
        features.add("no trace (history was not recorded)")
    if len(snap.devices) > 1:
        features.add(f"{len(snap.devices)} devices")
    if not snap.devices:
        features.add("empty")
    for text in problems:
        snap.note(text)
    snap.format = Format(layout, tuple(sorted(features)))
    return snap
