"""The one way any command writes a file the user named (``-o``, ``--plot``, ``--html``, JSON files).

Issue 22 #5: a plot once wrote through a symbolic link and a script silently replaced a file. Every output
path is checked the same way before any work (so a refused path costs nothing) and again just before the
write: only a regular file in an existing, writable folder; never a link, device, fifo or folder; an
existing file only with ``force`` (``--force``). The write is atomic: a temporary file in the same folder,
then a rename (``force``) or a hard link that fails if the name was taken meanwhile (no ``force``), so a
half-written or clobbered file never shows.
"""

from __future__ import annotations

import os
import shlex
import stat
import tempfile
from pathlib import Path

from .errors import OverlayError, Problem


def _problem(option: str, path: str, why: str, fix: str, who: str) -> Problem:
    return Problem((who,), option, path, why, fix, check="output_file")


def output_problems(path: str | None, option: str, *, force: bool = False, suffixes: tuple[str, ...] = (),
                    who: str = "argument") -> list[Problem]:
    """Why ``path`` cannot be written by this command (empty: it can). ``suffixes`` lists the endings the
    format is chosen by (e.g. ``(".png", ".svg")``), when it is."""
    if path is None:
        return []
    if not isinstance(path, str) or not path or "\x00" in path:
        return [_problem(option, str(path), "is not a file name", "give a file path", who)]
    target = Path(path)
    if suffixes and target.suffix.lower() not in suffixes:
        return [_problem(option, path, f"cannot tell the format of {path!r} from its name",
                         f"end the file name with one of {', '.join(suffixes)}", who)]
    folder = target.parent
    try:
        folder_ok, folder_exists = folder.is_dir(), folder.exists()
    except OSError as exc:  # a name too long for the filesystem, a loop of links
        return [_problem(option, path, f"cannot inspect its folder: {exc.strerror}", "choose another path", who)]
    if not folder_ok:
        return [_problem(option, path, f"the folder {str(folder)!r} does not exist" if not folder_exists
                         else f"{str(folder)!r} is not a folder",
                         f"create it first (mkdir -p {shlex.quote(str(folder))}) or choose another path", who)]
    try:
        st = target.lstat()
    except FileNotFoundError:
        st = None
    except OSError as exc:
        return [_problem(option, path, f"cannot inspect it: {exc.strerror}", "choose another path", who)]
    if st is not None and stat.S_ISLNK(st.st_mode):
        return [_problem(option, path, "is a symbolic link; mbmem never writes through links",
                         "remove the link or choose another path", who)]
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = ("a folder" if stat.S_ISDIR(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode)
                or stat.S_ISBLK(st.st_mode) else "a fifo" if stat.S_ISFIFO(st.st_mode)
                else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
        return [_problem(option, path, f"is {kind}; mbmem only writes regular files", "choose a file path", who)]
    if st is not None and not force:
        return [_problem(option, path, "exists already", "add --force to replace it, or choose another path", who)]
    if not os.access(folder, os.W_OK | os.X_OK):
        return [_problem(option, path, f"the folder {str(folder)!r} is not writable", "choose another path", who)]
    return []


def figure_bytes(fig, path: str, dpi: int = 120) -> bytes:
    """A matplotlib figure rendered in memory, in the format ``path``'s suffix names (.png, .pdf, .svg), and
    closed: pictures reach a file only through :func:`write_output`, never through ``savefig(path)``, which
    follows links (issue 22 #5)."""
    import io

    import matplotlib.pyplot as plt
    buffer = io.BytesIO()
    try:
        fig.savefig(buffer, format=Path(path).suffix.lstrip(".").lower(), dpi=dpi)
    finally:
        plt.close(fig)
    return buffer.getvalue()


def _link_new(tmp: str, target: Path, payload: bytes, mode: int) -> None:
    """Give the finished temporary file the name ``target`` only if nobody holds it: a hard link fails with
    FileExistsError otherwise. Where the filesystem has no hard links, create the name exclusively
    (O_EXCL | O_NOFOLLOW) and write it there: still never a clobber, though no longer all at once."""
    try:
        os.link(tmp, target)
    except FileExistsError:
        raise
    except OSError:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
    os.unlink(tmp)


def write_output(path: str, data: str | bytes, option: str, *, force: bool = False, mode: int = 0o644,
                 suffixes: tuple[str, ...] = (), who: str = "argument") -> None:
    """Write ``data`` to ``path`` atomically after :func:`output_problems`; raises ``OverlayError`` (nothing
    written) when the path is refused, before or at the moment of writing."""
    problems = output_problems(path, option, force=force, suffixes=suffixes, who=who)
    if problems:
        raise OverlayError(problems)
    target = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    try:
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    except OSError as exc:
        raise OverlayError([_problem(option, path, f"cannot write in its folder: {exc.strerror}",
                                     "choose another path", who)]) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fchmod(f.fileno(), mode)
        problems = output_problems(path, option, force=force, suffixes=suffixes, who=who)  # replaced meanwhile?
        if problems:
            raise OverlayError(problems)
        if force:
            os.replace(tmp, target)   # rename replaces a link or file at the name, never follows it
        else:
            _link_new(tmp, target, payload, mode)
    except FileExistsError:
        Path(tmp).unlink(missing_ok=True)
        raise OverlayError([_problem(option, path, "exists already", "add --force to replace it", who)]) from None
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise OverlayError([_problem(option, path, f"cannot write it: {exc.strerror}", "choose another path",
                                     who)]) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
