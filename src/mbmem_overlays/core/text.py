"""Text from users, shown safely (issue 22 #9).

Names, values and log excerpts reach the terminal in warnings, ``explain`` and the doctor's evidence. A
control character (an ANSI escape that clears the screen or retitles the window), a bidirectional
override (U+202E makes ``txt.exe`` read as ``exe.txt``) or an invisible format character would be printed
raw. :func:`shown` escapes them, Python-style (``\\x1b``, ``\\u202e``), and leaves all other text as it is.
"""

from __future__ import annotations

import re
import unicodedata

# C0 and C1 controls, DEL, and the Unicode format/separator characters that change how text reads:
# bidi embeddings, overrides and isolates, marks, zero-width characters, line/paragraph separators.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f"
                     "\ufeff\ufff9-\ufffb\ud800-\udfff]")
_UNSAFE_LINE = re.compile("[\n\t]|" + _UNSAFE.pattern)


def _escape(m: re.Match) -> str:
    ch = m.group()
    code = ord(ch)
    if ch == "\n":
        return "\\n"
    if ch == "\t":
        return "\\t"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def shown(text: object, *, one_line: bool = True) -> str:
    """``text`` as it may be printed: unsafe characters escaped (and, with ``one_line``, newlines and tabs
    too, so one value stays one line)."""
    s = text if isinstance(text, str) else str(text)
    s = (_UNSAFE_LINE if one_line else _UNSAFE).sub(_escape, s)
    # Characters of the 'Cf' (format) category not listed above, e.g. tag characters (U+E0000 block).
    if any(ord(c) > 0xFFFF for c in s):
        s = "".join(f"\\U{ord(c):08x}" if ord(c) > 0xFFFF and unicodedata.category(c) in ("Cf", "Co", "Cn")
                    else c for c in s)
    return s


def unsafe_character(text: str) -> str | None:
    """The first character of ``text`` that :func:`shown` would escape (newline and tab excepted), escaped; None
    when there is none. For values that must be refused rather than shown escaped (a value that reaches a
    printed command or a script would otherwise differ from what the user sees)."""
    m = _UNSAFE.search(text)
    if m is not None:
        return _escape(m)
    for c in text:
        if ord(c) > 0xFFFF and unicodedata.category(c) in ("Cf", "Co", "Cn"):
            return f"\\U{ord(c):08x}"
    return None


def quoted_word(word: str) -> str:
    """``word`` as one shell word (``shlex.quote``) for a command we print for pasting, hints included: a user
    value in it (``$(...)``, ``;``, quotes) stays text in the shell (issue 22 #2b)."""
    import shlex
    return shlex.quote(word)


# The most characters one message, fix or error text may have when printed or put in JSON (issue 33 #19): a value
# that expands (a rank list of thousands of GPUs, a log excerpt, a file's field) never makes a many-KB message.
MAX_MESSAGE_CHARS = 1000


def bounded(text: object, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut to ``limit`` characters, saying how many were cut (never raises: a value whose str() fails
    is named by its type)."""
    try:
        s = text if isinstance(text, str) else str(text)
    except Exception:  # an int over the digit limit, a hostile __str__
        return f"<{type(text).__name__}>"
    if len(s) <= limit:
        return s
    return f"{s[:limit]} ... ({len(s) - limit:,} more characters not shown)"


# Where a shell command ends: a pipe, a list operator or a redirection (`torchrun ... 2>&1 | tee run.log`, `... > log
# &`). The words after it belong to another command or name a file; they are never the job's arguments (no training
# script's flag value is one of these words).
_SHELL_OPERATOR = re.compile(r"^(?:\|&?|\|\||&&?|;;?|\d*(?:>>?|<|>&|<&)(?:&?\d+|-)?|&>>?)$|^\d*>>?\S|^&>")


_GLUED_OPERATOR = re.compile(r"^(.*[^;|&])(?:;;?|\|\|?|&&)$")   # `--lr 1e-4; sleep 1`: the operator ends a word


def first_command(words: list[str]) -> list[str]:
    """The words of the first simple command of a split command line (shell operators stay words when a line is
    split: `|`, `|&`, `2>&1`, `>log`, or end one: `1e-4;`)."""
    for k, w in enumerate(words):
        if _SHELL_OPERATOR.match(w):
            return list(words[:k])
        glued = _GLUED_OPERATOR.match(w)
        if glued:
            return [*words[:k], glued.group(1)]
    return list(words)
