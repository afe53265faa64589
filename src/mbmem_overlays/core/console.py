"""Standard output that cannot be written (issue 22 #9): ``mbmem list | head -0`` (the reader closed the pipe),
``mbmem list > /dev/full`` (the disk is full) or ``mbmem list >&-`` (no stdout at all) used to end in a
traceback, or in Python's "Exception ignored ... BrokenPipeError" at exit. Every entry point answers them the
same way: one line on stderr and exit code ``EXIT_OUTPUT`` (74, ``EX_IOERR`` of sysexits.h).
"""

from __future__ import annotations

import errno
import os
import sys

from .report import EXIT_OUTPUT

# What a failing write to a pipe, a terminal or a file reports; ENOSPC/EDQUOT/EFBIG: full disk or quota.
_OUTPUT_ERRNOS = {errno.EPIPE, errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EBADF}


class _ClosedStdout:
    """Stands in for ``sys.stdout`` when the process started without one (Python then sets it to None and
    ``print`` drops everything silently): the first write is the failure it is."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(errno.EBADF, "standard output is closed")

    def flush(self) -> None:
        return None


def guard_stdout() -> None:
    """Call first: a missing stdout fails on its first use, so a command that prints nothing still succeeds."""
    if sys.stdout is None:
        sys.stdout = _ClosedStdout()


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
