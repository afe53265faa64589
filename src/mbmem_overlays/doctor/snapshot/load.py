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
            wide: list[tuple[int, int, int]] = []
            built = scan(raw, budget, wide)
            data = _NoClasses(io.BytesIO(_unread_integers(raw, wide) if wide else raw)).load()
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
# Opcode kinds, most frequent first in a real snapshot (BINGET/LONG_BINGET runs of frame lists, then the dicts of
# trace entries): the scan's dispatch is one table lookup and a short chain of integer comparisons.
(K_GET1, K_GET4, K_MEMO, K_MARK, K_INT, K_SETITEMS, K_DICT, K_STR1, K_LONG1, K_LIST, K_APPEND, K_APPENDS, K_CONST, K_FLOAT,
 K_TUPLE_N, K_SIZED, K_MARKED, K_PUT, K_POP, K_POP_MARK, K_DUP, K_PROTO, K_FRAME, K_STOP, K_TEXT, K_LONG4, K_SET, K_ADDITEMS,
 K_SETITEM, K_CLASS, K_REFUSED, K_BAD) = range(32)
_KIND = [K_BAD] * 256
for _ops, _kind in ((b"h", K_GET1), (b"j", K_GET4), (b"\x94", K_MEMO), (b"(", K_MARK), (b"JKM", K_INT),
                    (b"u", K_SETITEMS), (b"}", K_DICT), (b"\x8c", K_STR1), (b"\x8a", K_LONG1), (b"]", K_LIST),
                    (b"a", K_APPEND), (b"e", K_APPENDS), (b"N\x88\x89)", K_CONST), (b"G", K_FLOAT),
                    (b"\x85\x86\x87", K_TUPLE_N), (b"X\x8dTUBC\x8e\x96", K_SIZED), (b"t\x91ld", K_MARKED),
                    (b"qr", K_PUT), (b"0", K_POP), (b"1", K_POP_MARK), (b"2", K_DUP), (b"\x80", K_PROTO),
                    (b"\x95", K_FRAME), (b".", K_STOP), (b"ILFSVgp", K_TEXT), (b"\x8b", K_LONG4), (b"\x8f", K_SET),
                    (b"\x90", K_ADDITEMS), (b"s", K_SETITEM),
                    # a class or a persistent object: the scan ends, and the unpickler's own refusal
                    # (find_class, persistent_load) names what was asked for; all before it was charged
                    (b"c\x93i\x82\x83\x84PQ", K_CLASS),
                    # calls of what a class opcode fetched, out-of-band buffers: never in a snapshot
                    (b"oRb\x81\x92\x97\x98", K_REFUSED)):
    for _op in _ops:
        _KIND[_op] = _kind
_INT_WIDTH = {0x4A: 4, 0x4B: 1, 0x4D: 2}
# the width of a length prefix (strings, bytes) or of a memo index
_SIZE_WIDTH = {0x58: 4, 0x8D: 8, 0x54: 4, 0x55: 1, 0x42: 4, 0x43: 1, 0x8E: 8, 0x96: 8, 0x71: 1, 0x72: 4}
_RUN_CHUNK = 4096
_REFUSED_NAMES = {0x6F: "OBJ", 0x52: "REDUCE", 0x62: "BUILD", 0x81: "NEWOBJ", 0x92: "NEWOBJ_EX", 0x97: "NEXT_BUFFER",
                  0x98: "READONLY_BUFFER"}


def _run_end(data: bytes, start: int, op: int, width: int) -> int:
    """Where a run of one fixed-width opcode that starts at ``start`` ends: every width-th byte compared in C, a
    growing chunk at a time (the frame lists of a real snapshot are runs of hundreds of memo gets)."""
    count, step, mark = 0, 32, bytes((op,))
    while True:
        chunk = data[start + count * width:start + (count + step) * width:width]
        lead = len(chunk) - len(chunk.lstrip(mark))
        count += lead
        if lead < step:
            return start + count * width
        step = min(step * 4, _RUN_CHUNK)


# An integer past MAX_INT_BYTES is never built: it is read as this text of the same length in the pickle (so no
# frame length changes), and the model names the value it stood for as unreadable (model.py unread_integer), so one
# such value (a 5,000-digit allocator setting) leaves the rest of the file readable (issue 39, a regression of #20).
UNREAD_INTEGER = "<mbmem: an integer of "


def _unread_integers(raw: bytes, wide: list[tuple[int, int, int]]) -> bytes:
    """``raw`` with each integer ``scan`` found too wide, (opcode position, payload position, payload length),
    rewritten as a text opcode of the same length: LONG4 as BINUNICODE (its length field is kept), a text INT/LONG
    as UNICODE (a line)."""
    out = bytearray(raw)
    for at, start, length in wide:
        text = f"{UNREAD_INTEGER}{length:,} bytes>"[:length].ljust(length, ".").encode("ascii")
        out[at] = 0x58 if raw[at] == 0x8B else 0x56   # X (BINUNICODE) / V (UNICODE)
        out[start:start + length] = text
    return bytes(out)


def scan(data: bytes, budget: int, wide: list[tuple[int, int, int]] | None = None) -> int:
    """One pass over the pickle's opcodes before anything is built (the opcodes of pickletools, protocols 0-5),
    simulating the unpickler's stack; the estimated bytes it will build, or RefusedPickle.

    What it bounds: a memo index must be the next one or an earlier one (the C unpickler grows its memo table
    to twice any index it is given: LONG_BINPUT 0xffffffff in a 9-byte file asks for 64 GiB); integers beyond
    MAX_INT_BYTES; what the objects would take in memory, estimated per opcode, against ``budget``; and how
    deep tuples and frozensets nest. The C unpickler builds iteratively, but it hashes each dict key and set
    element as it stores it, and hashing a tuple recurses in C without a recursion check: a tuple nested a
    million deep as a dict key kills the process with SIGSEGV. Lists, dicts and sets cannot be hashed, so their
    nesting costs memory only (charged). An opcode that needs a class ends the scan: the unpickler's own
    find_class/persistent_load refuses it, and names it. Validity (a get of a memo entry never stored, a stack
    that underflows) is the unpickler's to check: it stops at the first invalid opcode, and the scan never
    under-counts what comes before it. Memo gets cost a stack slot each; runs of them are skipped in C."""
    stack: list[int] = []      # per stack item: how deep tuples/frozensets nest in it (0 for scalars and mutables)
    push = stack.append
    marks: list[int] = []
    memo_size = 0
    memo_depth = 0             # the deepest hashable nesting stored in the memo (what a get may push)
    cost = 0
    pos = 0
    kinds = _KIND
    try:
        while cost <= budget:
            op = data[pos]
            k = kinds[op]
            if k == K_GET1 or k == K_GET4:                  # BINGET, LONG_BINGET
                width = 2 if k == K_GET1 else 5
                if data[pos + width] == op:               # a run: skipped in C
                    end = _run_end(data, pos, op, width)
                    count = (end - pos) // width
                    stack.extend([memo_depth] * count)
                    cost += _REF * count
                    pos = end
                else:
                    push(memo_depth)
                    cost += _REF
                    pos += width
                continue
            pos += 1
            if k == K_MEMO:
                memo_size += 1
                if stack[-1] > memo_depth:
                    memo_depth = stack[-1]
                cost += 2 * _REF
            elif k == K_MARK:
                marks.append(len(stack))
            elif k == K_INT:
                pos += _INT_WIDTH[op]
                push(0)
                cost += _INT + _REF
            elif k == K_SETITEMS or k == K_APPENDS or k == K_ADDITEMS:
                m = marks.pop()
                cost += (_PAIR // 2 if k == K_SETITEMS else _ITEM if k == K_APPENDS else _PAIR) * (len(stack) - m)
                del stack[m:]
            elif k == K_DICT or k == K_LIST or k == K_SET:
                push(0)
                cost += (_DICT if k == K_DICT else _LIST if k == K_LIST else _SET) + _REF
            elif k == K_STR1:
                size = data[pos]
                pos += 1 + size
                push(0)
                cost += _STR + size + _REF
            elif k == K_LONG1 or k == K_LONG4:
                width = 1 if k == K_LONG1 else 4
                size = int.from_bytes(data[pos:pos + width], "little", signed=k == K_LONG4)
                if size < 0 or (size > MAX_INT_BYTES and wide is None):
                    raise RefusedPickle(f"it holds an integer of {size:,} bytes; a snapshot's integers fit in 8 (at "
                                        f"most {MAX_INT_BYTES:,} are read)")
                if size > MAX_INT_BYTES:     # never built: read as text naming it (_unread_integers)
                    if pos + width + size > len(data):
                        raise IndexError
                    wide.append((pos - 1, pos + width, size))
                pos += width + size
                push(0)
                cost += _INT + size + _REF
            elif k == K_APPEND or k == K_SETITEM:
                del stack[-1 if k == K_APPEND else -2:]
                cost += _ITEM if k == K_APPEND else _PAIR
            elif k == K_CONST:
                push(1 if op == 0x29 else 0)              # EMPTY_TUPLE is a tuple
                cost += _REF
            elif k == K_FLOAT:
                pos += 8
                push(0)
                cost += _FLOAT + _REF
            elif k == K_TUPLE_N:                           # TUPLE1, TUPLE2, TUPLE3
                count = op - 0x84
                if len(stack) - (marks[-1] if marks else 0) < count:
                    raise RefusedPickle("a tuple opcode needs more on the stack than is there (not a valid pickle)")
                depth = 1 + max(stack[-count:])
                del stack[-count:]
                push(depth)
                cost += _TUPLE + 8 * count + _REF
                if depth > MAX_HASHED_DEPTH:
                    raise RefusedPickle(_too_deep())
            elif k == K_SIZED:
                width = _SIZE_WIDTH[op]
                size = int.from_bytes(data[pos:pos + width], "little")
                pos += width + size
                if pos > len(data):
                    raise RefusedPickle("a string or bytes object runs past the end of the file (truncated)")
                push(0)
                cost += _STR + size + _REF
            elif k == K_MARKED:                            # TUPLE, FROZENSET, LIST, DICT: from the MARK
                m = marks.pop()
                items = len(stack) - m
                depth = 1 + max(stack[m:], default=0) if op in (0x74, 0x91) else 0
                del stack[m:]
                push(depth)
                cost += {0x74: _TUPLE + 8 * items, 0x91: _SET + _PAIR * items, 0x6C: _LIST + _ITEM * items,
                         0x64: _DICT + _PAIR * items // 2}[op] + _REF
                if depth > MAX_HASHED_DEPTH:
                    raise RefusedPickle(_too_deep())
            elif k == K_PUT:                               # BINPUT, LONG_BINPUT
                width = _SIZE_WIDTH[op]
                memo_size = _memo_put(int.from_bytes(data[pos:pos + width], "little"), memo_size)
                pos += width
                if stack[-1] > memo_depth:
                    memo_depth = stack[-1]
                cost += 2 * _REF
            elif k == K_POP:
                if marks and len(stack) == marks[-1]:
                    marks.pop()
                else:
                    stack.pop()
            elif k == K_POP_MARK:
                del stack[marks.pop():]
            elif k == K_DUP:
                push(stack[-1])
                cost += _REF
            elif k == K_PROTO:
                pos += 1
            elif k == K_FRAME:                             # a length prefix only
                pos += 8
            elif k == K_STOP:
                return cost
            elif k == K_TEXT:                              # INT LONG FLOAT STRING UNICODE GET PUT: one line each
                end = data.find(b"\n", pos, pos + MAX_TEXT_ARG)
                if end < 0:
                    raise RefusedPickle("a text opcode's argument has no end within 64 KiB (not a snapshot)")
                arg = data[pos:end]
                pos = end + 1
                if op == 0x67 or op == 0x70:              # GET, PUT
                    if not arg.isdigit() or len(arg) > 12:
                        raise RefusedPickle("a memo index that is not a number (not a valid pickle)")
                    if op == 0x70:
                        memo_size = _memo_put(int(arg), memo_size)
                        memo_depth = max(memo_depth, stack[-1])
                        cost += 2 * _REF
                    else:
                        push(memo_depth)
                        cost += _REF
                    continue
                if op in (0x49, 0x4C) and len(arg) > 3 * MAX_INT_BYTES:
                    if wide is None:
                        raise RefusedPickle(f"it holds an integer of {len(arg):,} digits; a snapshot's integers "
                                            "have at most 19")
                    wide.append((pos - len(arg) - 2, pos - len(arg) - 1, len(arg)))   # never built (as above)
                push(0)
                cost += _STR + 4 * len(arg) + _REF
            elif k == K_CLASS:
                return cost
            elif k == K_REFUSED:
                raise RefusedPickle(_refusal(_REFUSED_NAMES[op]))
            else:
                raise RefusedPickle(f"it holds the byte 0x{op:02x} where an opcode belongs (not a valid pickle)")
    except IndexError:
        raise RefusedPickle("it ends early, or an opcode finds the stack or the MARK it needs missing (truncated, or "
                            "not a valid pickle)") from None
    raise RefusedPickle(f"what it builds would take more than {budget / 2**20:,.0f} MiB in memory (estimated while "
                        f"reading, before building it; the reader allows {BUILD_RATIO}x the pickle's size plus "
                        f"{BUILD_FLOOR >> 20} MiB): a snapshot of this size is far smaller in memory, so the file is "
                        "crafted or corrupted")


def _memo_put(index: int, memo_size: int) -> int:
    if index > memo_size:
        raise RefusedPickle(f"it stores memo entry {index:,} while it has stored {memo_size:,} (a pickler numbers "
                            "them in order; the unpickler would allocate a table that large)")
    return memo_size + (index == memo_size)


def _too_deep() -> str:
    return (f"it nests tuples or frozensets more than {MAX_HASHED_DEPTH} deep; a snapshot nests them at most one deep "
            "(hashing deeper ones could crash the reader)")


def _refusal(opcode: str) -> str:
    if opcode in ("NEXT_BUFFER", "READONLY_BUFFER"):
        return f"it asks for an out-of-band buffer ({opcode}), which a snapshot never holds"
    return (f"it asks to construct a Python object ({opcode}: a class or a callable), which a snapshot never "
            "holds")
