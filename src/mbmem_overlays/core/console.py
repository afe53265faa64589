"""Standard output that cannot be written (issue 22 #9): ``mbmem list | head -0`` (the reader closed the pipe),
``mbmem list > /dev/full`` (the disk is full) or ``mbmem list >&-`` (no stdout at all) used to end in a
traceback, or in Python's "Exception ignored ... BrokenPipeError" at exit. Every entry point answers them the
same way: one line on stderr and exit code ``EXIT_OUTPUT`` (74, ``EX_IOERR`` of sysexits.h).

The other broken surroundings are answered here too, at the stream level, for ``mbmem`` and ``train.py`` alike
(issue 33 #12-#14): an ASCII-only stream (``PYTHONIOENCODING=ascii``, ``LC_ALL=C`` without UTF-8 mode) writes
characters it cannot encode as ``\u2014`` escapes instead of raising ``UnicodeEncodeError``; a closed stderr
(``2>&-``) swallows what was meant for it instead of letting ``print(file=sys.stderr)`` fall back to stdout (Python
sets ``sys.stderr`` to None, and ``print(file=None)`` writes to stdout, into a ``--json`` answer); a closed
descriptor 1 or 2 is held by the null device so a file opened later never takes its number; a deleted working
directory is one line and exit code 2 (``cwd_problem``).
"""

from __future__ import annotations

import errno
import os
import sys


EXIT_OUTPUT = 74  # sysexits.h EX_IOERR; core/report.py re-exports it with the other exit codes

# What a failing write to a pipe, a terminal or a file reports; ENOSPC/EDQUOT/EFBIG: full disk or quota.
_OUTPUT_ERRNOS = {errno.EPIPE, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EBADF}


class _ClosedStdout:
    """Stands in for ``sys.stdout`` when the process started without one (Python then sets it to None and
    ``print`` drops everything silently): the first write is the failure it is."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(errno.EBADF, "standard output is closed")

    def flush(self) -> None:
        return None


class _ClosedStderr:
    """Stands in for ``sys.stderr`` when the process started without one: what is written is dropped (the exit
    code still says what happened); never stdout, which may be a ``--json`` answer."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        return None


def guard_stdout() -> None:
    """Call first, in every entry point: a missing stdout fails on its first use (so a command that prints nothing
    still succeeds); a missing stderr swallows; descriptors 1 and 2 are held; no stream raises on a character its
    encoding lacks."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        if getattr(sys, name) is None:
            _hold_descriptor(fd)
    if sys.stdout is None:
        sys.stdout = _ClosedStdout()
    if sys.stderr is None:
        sys.stderr = _ClosedStderr()
    for stream in (sys.stdout, sys.stderr):
        _escape_unencodable(stream)


def _hold_descriptor(fd: int) -> None:
    """Point a closed descriptor at the null device, so the next file opened does not get its number (a later
    write to "stdout" or a C library's message to fd 2 would land in that file)."""
    try:
        os.fstat(fd)
        return  # open after all (Python found it unusable for another reason): leave it
    except OSError:
        pass
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
        if devnull != fd:
            os.dup2(devnull, fd)
            os.close(devnull)
    except OSError:
        pass


def _escape_unencodable(stream) -> None:
    """Characters the stream's encoding cannot hold are written as backslash escapes (``\u2014``), not raised as
    ``UnicodeEncodeError``; a UTF-8 stream is left as it is."""
    encoding = (getattr(stream, "encoding", None) or "").lower().replace("-", "").replace("_", "")
    if encoding in ("utf8", "utf8sig") or getattr(stream, "errors", None) == "backslashreplace":
        return
    try:
        stream.reconfigure(errors="backslashreplace")
    except (AttributeError, ValueError, OSError):  # not a TextIOWrapper (a test's StringIO, _ClosedStdout)
        pass


# ----------------------------------------------------------------------------- the working directory
CWD_GONE = "the working directory no longer exists (it was deleted or moved while this shell was in it)"
CWD_FIX = "cd to a folder that exists (e.g. cd ~) and run the command again"


def cwd_missing() -> bool:
    """Whether the process's working directory was deleted: ``os.getcwd()`` fails, and with it every relative
    path (``os.path.abspath``, ``Path.resolve``)."""
    try:
        os.getcwd()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


def cwd_problem():
    """The deleted working directory as a usage problem (exit 2), or None when it exists."""
    if not cwd_missing():
        return None
    from .errors import Problem
    return Problem(("environment",), "working directory", None, CWD_GONE, CWD_FIX, check="cwd")


def is_output_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed write to stdout: a broken pipe always (we write to no other pipe); a full disk
    or an I/O error when it names no file (an ``open()`` or ``os.*`` call on a path names it; a write to a
    stream does not, and the files we write turn their own errors into messages, core/outfile.py)."""
    if isinstance(exc, BrokenPipeError):
        return True
    return isinstance(exc, OSError) and exc.errno in _OUTPUT_ERRNOS and exc.filename is None


def output_failed(prog: str, exc: BaseException | None = None) -> int:
    """One line on stderr, stdout pointed at the null device (so the interpreter's final flush cannot fail
    again), and ``EXIT_OUTPUT``."""
    why = "the reader closed the pipe" if isinstance(exc, BrokenPipeError) else (
        os.strerror(exc.errno) if isinstance(exc, OSError) and exc.errno else "it is closed")
    _detach_stdout()
    try:
        print(f"{prog}: cannot write to standard output ({why}); the output is incomplete", file=sys.stderr)
    except (OSError, ValueError, AttributeError):  # stderr is gone too: the exit code still says it
        pass
    return EXIT_OUTPUT


def finish(code: int, prog: str) -> int:
    """``code``, after flushing stdout; a flush that fails is ``output_failed``."""
    try:
        sys.stdout.flush()
    except OSError as exc:
        return output_failed(prog, exc)
    except (ValueError, AttributeError):  # closed by the caller, or no stdout: nothing left to lose
        pass
    return code


def _detach_stdout() -> None:
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a test's StringIO, or _ClosedStdout: nothing buffered below
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, fd)
        os.close(devnull)
    except OSError:
        pass


def run_entry(body, prog: str) -> int:
    """``body()``'s exit code through ``finish``, for an entry point whose body may print and ``sys.exit`` on its
    own (Hydra's ``--help`` prints, then returns or exits 0): a closed or full stdout is ``EXIT_OUTPUT`` there too,
    never a traceback or a 0 with nothing printed (issue 33 #15)."""
    try:
        code = body()
    except SystemExit as exc:
        if exc.code is not None and not isinstance(exc.code, int):
            raise  # a message for Python to print on stderr, exit 1
        code = exc.code or 0
    except OSError as exc:
        if not is_output_error(exc):
            raise
        return output_failed(prog, exc)
    return finish(code, prog)
