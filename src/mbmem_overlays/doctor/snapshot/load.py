"""Reading a snapshot file safely: a pickle that may construct nothing, bounded in size, plain or gzip.

A PyTorch memory snapshot is ``pickle.dump(torch.cuda.memory._snapshot())`` (Bridge's ``_oom_observer`` and
scheduled dump, torch's ``_dump_snapshot``): only dicts, lists, str, int, float, bool, None and tuples. Every
pickle opcode that can run code needs a callable, and a callable can only come from ``find_class`` (GLOBAL,
STACK_GLOBAL, INST, and the copyreg extension codes EXT1/2/4) or from ``persistent_load`` (PERSID, BINPERSID):
REDUCE, BUILD, OBJ, NEWOBJ and NEWOBJ_EX then have nothing to call. The unpickler below refuses both, so
nothing from a file ever runs. CPython's C unpickler is iterative (deep nesting costs memory, not recursion),
and the size of what is read is capped before and while reading (a gzip bomb stops at the cap).
"""

from __future__ import annotations

import gzip
import io
import os
import pickle
import stat
import zlib
from dataclasses import dataclass
from typing import Any

from ...core.text import shown

GZIP_MAGIC = b"\x1f\x8b"
PROTO = 0x80                  # pickle protocol >= 2 starts with PROTO <version>; torch writes protocol 4 or 5
SNIFF_BYTES = 4096
SUFFIXES = (".pickle", ".pkl", ".pickle.gz", ".pkl.gz")
DEFAULT_MAX_BYTES = 2 << 30   # decompressed; reading takes about 4x this in memory (bench/snapshot_read.py)
MAX_BYTES_ENV = "MBMEM_SNAPSHOT_MAX_BYTES"


class SnapshotError(Exception):
    """The file cannot be read as a snapshot (missing, too large, refused, truncated, not a pickle)."""


class RefusedPickle(pickle.UnpicklingError):
    """The pickle asked for something a snapshot never holds (a class or a persistent object)."""


class _NoClasses(pickle.Unpickler):
    """An unpickler that admits no class and no persistent id: only the built-in containers and scalars."""

    def find_class(self, module: str, name: str):  # noqa: D401 — pickle's hook
        raise RefusedPickle(f"it asks to load the Python object {shown(module)}.{shown(name)}")

    def persistent_load(self, pid: Any):
        raise RefusedPickle("it refers to a persistent object (a persistent id)")


class _Capped(io.RawIOBase):
    """A decompressed stream that fails once more than ``limit`` bytes came out of it."""

    def __init__(self, stream, limit: int, name: str):
        self.stream, self.limit, self.name, self.count = stream, limit, name, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        data = self.stream.read(len(buffer))
        self.count += len(data)
        if self.count > self.limit:
            raise SnapshotError(too_large(self.name, self.count, self.limit, decompressed=True))
        buffer[:len(data)] = data
        return len(data)


@dataclass(frozen=True)
class Loaded:
    data: Any
    path: str
    file_bytes: int        # on disk
    pickle_bytes: int      # decompressed (the pickle itself)
    gzip: bool
    budget_left: int | None = None   # bytes the analysis may still take (the build budget less what was built)


def max_bytes() -> int:
    """The size cap: MBMEM_SNAPSHOT_MAX_BYTES (80GiB, 4GB, bytes) or 2 GiB."""
    raw = os.environ.get(MAX_BYTES_ENV)
    if not raw:
        return DEFAULT_MAX_BYTES
    from ...core.sizes import parse_size
    try:
        return int(parse_size(raw))
    except ValueError as exc:
        raise SnapshotError(f"{MAX_BYTES_ENV}={shown(raw)}: {exc}") from None


def too_large(name: str, size: int, limit: int, *, decompressed: bool = False) -> str:
    what = "decompresses to more than" if decompressed else f"is {size / 2**30:.2f} GiB, above"
    return (f"{shown(name)} {what} the {limit / 2**30:.2f} GiB the doctor reads (reading takes about 4x the "
            f"pickle's size in memory); to read it anyway, export {MAX_BYTES_ENV}=<size>, e.g. "
            f"{MAX_BYTES_ENV}={max(2 * limit, size) / 2**30:.0f}GiB")


def _open_regular(path: str):
    """The file opened for reading, or SnapshotError; never blocks on a fifo or a device."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise SnapshotError(f"{shown(path)}: cannot read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise SnapshotError(f"{shown(path)} is not a regular file (a folder, fifo, socket or device)")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise SnapshotError(f"{shown(path)}: cannot read ({exc.strerror or exc})") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced by a fifo between stat and open
        os.close(fd)
        raise SnapshotError(f"{shown(path)} is not a regular file")
    return os.fdopen(fd, "rb")


def _pickle_head(head: bytes) -> bytes:
    """The first bytes of the pickle inside ``head`` (decompressed when it is gzip)."""
    if head[:2] != GZIP_MAGIC:
        return head[:2]
    try:
        return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(head, 2)
    except zlib.error:
        return b""


def looks_like_snapshot(path: str) -> bool:
    """True for a regular file that holds a pickle (protocol >= 2) or a gzipped one, or that is named like a
    snapshot (*.pickle, *.pkl, and .gz of them: then the reader says clearly what is wrong with it). Reads at most
    4 KiB; False for anything that is not a regular file, without opening it."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
        with _open_regular(path) as f:
            head = f.read(SNIFF_BYTES)
    except (OSError, SnapshotError, ValueError):
        return False
    pk = _pickle_head(head)
    if len(pk) >= 2 and pk[0] == PROTO and 2 <= pk[1] <= 5:
        return True
    return path.lower().endswith(SUFFIXES)


def load(path: str, limit: int | None = None) -> Loaded:
    """The snapshot's object, loaded with :class:`_NoClasses`; SnapshotError with a clear message otherwise."""
    limit = max_bytes() if limit is None else limit
    f = _open_regular(path)
    with f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(SNIFF_BYTES)
        f.seek(0)
        compressed = head[:2] == GZIP_MAGIC
        if not compressed and size > limit:
            raise SnapshotError(too_large(path, size, limit))
        pk = _pickle_head(head)
        if not (len(pk) >= 1 and pk[0] == PROTO):
            raise SnapshotError(f"{shown(path)} is not a pickle (a memory snapshot is written with pickle.dump; "
                                "this file starts with other bytes)" + (" inside its gzip" if compressed else ""))
        try:
            raw = (io.BufferedReader(_Capped(gzip.GzipFile(fileobj=f, mode="rb"), limit, path)) if compressed
                   else f).read(limit + 1)
            if len(raw) > limit:   # a plain file that grew since its size was checked
                raise SnapshotError(too_large(path, len(raw), limit))
            budget = BUILD_RATIO * len(raw) + BUILD_FLOOR
            built = scan(raw, budget)
            data = _NoClasses(io.BytesIO(raw)).load()
        except RefusedPickle as exc:
            raise SnapshotError(f"{shown(path)} was refused: {exc}. A memory snapshot holds only dicts, lists, "
                                "strings and numbers; nothing from the file was run") from None
        except SnapshotError:
            raise
        except MemoryError:
            raise SnapshotError(f"{shown(path)}: not enough memory to read it (reading takes about 4x the pickle's "
                                "size); read it on a machine with more memory") from None
        except (EOFError, pickle.UnpicklingError) as exc:
            raise SnapshotError(f"{shown(path)} is truncated or not a valid pickle ({shown(type(exc).__name__)}: "
                                f"{shown(str(exc)[:200])}); a snapshot cut short while it was written cannot be "
                                "read") from None
        except (OSError, zlib.error) as exc:  # gzip.BadGzipFile is an OSError
            raise SnapshotError(f"{shown(path)}: cannot read ({shown(type(exc).__name__)}: "
                                f"{shown(str(exc)[:200])})") from None
        except Exception as exc:  # noqa: BLE001 — any other failure inside the unpickler is a bad file
            raise SnapshotError(f"{shown(path)} is not a valid pickle ({shown(type(exc).__name__)}: "
                                f"{shown(str(exc)[:200])})") from None
        read = len(raw)
        del raw
    return Loaded(data, path, size, read, compressed, budget - built)


# ----------------------------------------------------------------------------- what the pickle may build
MAX_HASHED_DEPTH = 100      # tuples and frozensets inside each other; a snapshot's deepest is pool_id: one level
MAX_INT_BYTES = 1024        # a snapshot's integers are int64 (LONG1 of at most 9 bytes); 1 KiB stays below
                            # Python's int<->str limit (4,300 digits), so every integer read can be printed
MAX_TEXT_ARG = 1 << 16      # a text-protocol argument (INT, FLOAT, STRING, GET ...): one short line
BUILD_RATIO = 12            # the unpickler may build at most this many times the pickle's bytes (estimated) ...
BUILD_FLOOR = 64 << 20      # ... plus this much, so no small file is refused for its figures
# Estimated bytes per object (sys.getsizeof on CPython 3.11-3.13): what the scan charges for each opcode.
_REF, _DICT, _PAIR, _LIST, _ITEM, _TUPLE, _SET, _STR, _INT, _FLOAT = 8, 64, 48, 56, 9, 40, 216, 49, 36, 24
# Opcodes that fetch a class or a persistent object: the scan stops there and the unpickler's own refusal
# (find_class, persistent_load) names what was asked for; everything before it was scanned and charged.
_CLASS_OPS = {ord(c) for c in ("c", "\x93", "i", "\x82", "\x83", "\x84", "P", "Q")}
# Opcodes that call what a class op fetched, or need out-of-band buffers: never in a snapshot.
_REFUSED_OPS = {ord(c): name for c, name in (
    ("o", "OBJ"), ("R", "REDUCE"), ("b", "BUILD"), ("\x81", "NEWOBJ"), ("\x92", "NEWOBJ_EX"),
    ("\x97", "NEXT_BUFFER"), ("\x98", "READONLY_BUFFER"))}
_GET_WIDTH = {0x68: 2, 0x6A: 5}   # BINGET, LONG_BINGET: opcode and index
_GET_BYTE = {0x68: b"h", 0x6A: b"j"}
_RUN_CHUNK = 4096
# opcode -> width of its length prefix (strings and bytes) or of its argument (fixed-size scalars)
_SIZED = {0x58: 4, 0x8C: 1, 0x8D: 8, 0x54: 4, 0x55: 1, 0x42: 4, 0x43: 1, 0x8E: 8, 0x96: 8}   # X, \x8c, \x8d, T, U, B, C
_FIXED = {0x4A: 4, 0x4B: 1, 0x4D: 2, 0x47: 8}                                            # BININT, BININT1, 2, BINFLOAT
_LINE = {0x49: "INT", 0x4C: "LONG", 0x46: "FLOAT", 0x53: "STRING", 0x56: "UNICODE"}


def scan(data: bytes, budget: int) -> int:
    """One pass over the pickle's opcodes before anything is built (the opcodes of pickletools, protocols 0-5),
    simulating the unpickler's stack; the estimated bytes it will build, or RefusedPickle.

    What it bounds: every opcode that needs a class or a buffer is refused; a memo index must be the next one
    or an earlier one (the C unpickler grows its memo table to twice any index it is given: LONG_BINPUT
    0xffffffff in a 9-byte file asks for 64 GiB); integers beyond MAX_INT_BYTES; what the objects would take
    in memory, estimated per opcode, against ``budget``; and how deep tuples and frozensets nest. The C
    unpickler builds iteratively, but it hashes each dict key and set element as it stores it, and hashing a
    tuple recurses in C without a recursion check: a tuple nested a million deep as a dict key kills the
    process with SIGSEGV. Lists, dicts and sets cannot be hashed, so their nesting costs memory only (charged).
    References (memo gets) are charged a stack slot each; a run of them, the bulk of a real snapshot's frame
    lists, is skipped with one regular-expression match."""
    n = len(data)
    stack: list[int] = []      # per stack item: how deep tuples/frozensets nest in it (0 for scalars and mutables)
    marks: list[int] = []
    memo_size = 0
    memo_depth = 0             # the deepest hashable nesting stored in the memo (what a get may push)
    cost = 0
    pos = 0

    def pop_mark() -> list[int]:
        if not marks:
            raise RefusedPickle("an opcode needs a MARK that is not there (not a valid pickle)")
        m = marks.pop()
        items = stack[m:]
        del stack[m:]
        return items

    def top(k: int) -> None:
        if len(stack) - (marks[-1] if marks else 0) < k:
            raise RefusedPickle("an opcode needs more on the stack than is there (not a valid pickle)")

    while True:
        if pos >= n:
            raise RefusedPickle("it ends before its STOP opcode (truncated)")
        op = data[pos]
        pos += 1
        if op == 0x6A or op == 0x68:                  # LONG_BINGET, BINGET: a run of them at once
            width, start = _GET_WIDTH[op], pos - 1
            count, step, mark = 0, 32, _GET_BYTE[op]
            while True:   # the run's length: every width-th byte from its start, in C, a growing chunk at a time
                chunk = data[start + count * width:start + (count + step) * width:width]
                lead = len(chunk) - len(chunk.lstrip(mark))
                count += lead
                if lead < step:
                    break
                step = min(step * 4, _RUN_CHUNK)
            end = start + count * width
            if end > n:
                raise RefusedPickle("it ends inside an opcode (truncated)")
            if not memo_size:
                raise RefusedPickle("it reads the memo before storing anything in it (not a valid pickle)")
            stack.extend([memo_depth] * count)
            cost += _REF * count
            pos = end
        elif op == 0x94:                              # MEMOIZE
            top(1)
            memo_size += 1
            memo_depth = max(memo_depth, stack[-1])
            cost += 2 * _REF
        elif op == 0x28:                              # MARK
            marks.append(len(stack))
        elif op in _SIZED:
            width = _SIZED[op]
            if pos + width > n:
                raise RefusedPickle("it ends inside an opcode (truncated)")
            size = int.from_bytes(data[pos:pos + width], "little")
            pos += width + size
            if pos > n:
                raise RefusedPickle("a string or bytes object runs past the end of the file (truncated)")
            stack.append(0)
            cost += _STR + size + _REF
        elif op == 0x75 or op == 0x65 or op == 0x90:  # SETITEMS, APPENDS, ADDITEMS
            items = pop_mark()
            if not stack:
                raise RefusedPickle("it adds items to nothing (not a valid pickle)")
            if op == 0x75:
                if len(items) % 2:
                    raise RefusedPickle("SETITEMS with an odd number of items (not a valid pickle)")
                cost += _PAIR * (len(items) // 2)
            else:
                cost += (_ITEM if op == 0x65 else _PAIR) * len(items)
        elif op in _FIXED:
            pos += _FIXED[op]
            stack.append(0)
            cost += _INT + _REF
        elif op == 0x8A or op == 0x8B:                # LONG1, LONG4
            width = 1 if op == 0x8A else 4
            size = int.from_bytes(data[pos:pos + width], "little", signed=op == 0x8B)
            if not 0 <= size <= MAX_INT_BYTES:
                raise RefusedPickle(f"it holds an integer of {size:,} bytes; a snapshot's integers fit in 8 (at most "
                                    f"{MAX_INT_BYTES:,} are read)")
            pos += width + size
            stack.append(0)
            cost += _INT + size + _REF
        elif op == 0x7D or op == 0x5D or op == 0x8F:  # EMPTY_DICT, EMPTY_LIST, EMPTY_SET
            stack.append(0)
            cost += (_DICT if op == 0x7D else _LIST if op == 0x5D else _SET) + _REF
        elif op in (0x4E, 0x88, 0x89, 0x29):          # NONE, NEWTRUE, NEWFALSE, EMPTY_TUPLE
            stack.append(0 if op != 0x29 else 1)
            cost += _REF
        elif op in (0x85, 0x86, 0x87):                # TUPLE1, TUPLE2, TUPLE3
            k = op - 0x84
            top(k)
            depth = 1 + max(stack[-k:])
            del stack[-k:]
            stack.append(depth)
            cost += _TUPLE + 8 * k + _REF
            if depth > MAX_HASHED_DEPTH:
                raise RefusedPickle(f"it nests tuples more than {MAX_HASHED_DEPTH} deep; a snapshot nests them "
                                    "at most one deep (hashing deeper ones could crash the reader)")
        elif op in (0x74, 0x91, 0x6C, 0x64):          # TUPLE, FROZENSET, LIST, DICT (from the MARK)
            items = pop_mark()
            if op == 0x64 and len(items) % 2:
                raise RefusedPickle("DICT with an odd number of items (not a valid pickle)")
            hashed = op in (0x74, 0x91)
            depth = 1 + max(items, default=0) if hashed else 0
            stack.append(depth)
            cost += {0x74: _TUPLE + 8 * len(items), 0x91: _SET + _PAIR * len(items), 0x6C: _LIST + _ITEM * len(items),
                     0x64: _DICT + _PAIR * len(items) // 2}[op] + _REF
            if depth > MAX_HASHED_DEPTH:
                raise RefusedPickle(f"it nests tuples or frozensets more than {MAX_HASHED_DEPTH} deep; a snapshot "
                                    "nests them at most one deep (hashing deeper ones could crash the reader)")
        elif op == 0x71 or op == 0x72:                # BINPUT, LONG_BINPUT
            width = 1 if op == 0x71 else 4
            index = int.from_bytes(data[pos:pos + width], "little")
            pos += width
            top(1)
            if index > memo_size:
                raise RefusedPickle(f"it stores memo entry {index:,} while it has stored {memo_size:,} (a pickler "
                                    "numbers them in order; this would make the unpickler allocate a table that "
                                    "large)")
            memo_size += index == memo_size
            memo_depth = max(memo_depth, stack[-1])
            cost += 2 * _REF
        elif op == 0x61 or op == 0x73:                # APPEND, SETITEM
            k = 1 if op == 0x61 else 2
            top(k + 1)
            del stack[-k:]
            cost += _ITEM if op == 0x61 else _PAIR
        elif op == 0x30:                              # POP
            if marks and len(stack) == marks[-1]:
                marks.pop()
            elif stack:
                stack.pop()
            else:
                raise RefusedPickle("POP on an empty stack (not a valid pickle)")
        elif op == 0x31:                              # POP_MARK
            pop_mark()
        elif op == 0x32:                              # DUP
            top(1)
            stack.append(stack[-1])
            cost += _REF
        elif op == 0x80:                              # PROTO
            pos += 1
        elif op == 0x95:                              # FRAME: a length prefix only
            pos += 8
        elif op == 0x2E:                              # STOP
            if len(stack) != 1 or marks:
                raise RefusedPickle("its STOP leaves the stack unbalanced (not a valid pickle)")
            return cost
        elif op in _LINE or op in (0x67, 0x70):       # text protocol: INT LONG FLOAT STRING UNICODE, GET, PUT
            end = data.find(b"\n", pos, pos + MAX_TEXT_ARG)
            if end < 0:
                raise RefusedPickle("a text opcode's argument has no end within 64 KiB (not a snapshot)")
            arg = data[pos:end]
            pos = end + 1
            if op in (0x67, 0x70):
                if not arg.isdigit() or len(arg) > 12:
                    raise RefusedPickle("a memo index that is not a number (not a valid pickle)")
                index = int(arg)
                if op == 0x70:
                    top(1)
                    if index > memo_size:
                        raise RefusedPickle(f"it stores memo entry {index:,} while it has stored {memo_size:,}")
                    memo_size += index == memo_size
                    memo_depth = max(memo_depth, stack[-1])
                    cost += 2 * _REF
                else:
                    stack.append(memo_depth)
                    cost += _REF
                continue
            if op in (0x49, 0x4C) and len(arg) > 3 * MAX_INT_BYTES:
                raise RefusedPickle(f"it holds an integer of {len(arg):,} digits; a snapshot's integers have at most 19")
            stack.append(0)
            cost += _STR + 4 * len(arg) + _REF
        elif op in _CLASS_OPS:
            return cost
        elif op in _REFUSED_OPS:
            raise RefusedPickle(_refusal(_REFUSED_OPS[op]))
        else:
            raise RefusedPickle(f"it holds the byte 0x{op:02x} where an opcode belongs (not a valid pickle)")
        if cost > budget:
            raise RefusedPickle(f"what it builds would take more than {budget / 2**20:,.0f} MiB in memory "
                                f"(estimated while reading, before building it; the reader allows {BUILD_RATIO}x the "
                                f"pickle's size plus {BUILD_FLOOR >> 20} MiB): a snapshot of this size is far smaller "
                                "in memory, so the file is crafted or corrupted")


def _refusal(opcode: str) -> str:
    if opcode in ("NEXT_BUFFER", "READONLY_BUFFER"):
        return f"it asks for an out-of-band buffer ({opcode}), which a snapshot never holds"
    return (f"it asks to construct a Python object ({opcode}: a class or a callable), which a snapshot never "
            "holds")
