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
        stream = io.BufferedReader(_Capped(gzip.GzipFile(fileobj=f, mode="rb"), limit, path)) if compressed else f
        try:
            data = _NoClasses(stream).load()
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
        read = stream.raw.count if compressed else size
    return Loaded(data, path, size, read, compressed)
