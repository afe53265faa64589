"""The one error users see: every problem at once, each naming who, what, and the fix."""

from __future__ import annotations

import reprlib
from dataclasses import dataclass
from typing import Any

from .text import bounded, shown

MAX_PROBLEMS_SHOWN = 20  # in the text of an error; --json lists all of them

# Values in problems come from user input (YAML files, --set, the API): a 5,000-digit integer makes
# repr() raise (Python's int-to-str digit limit), a recursive YAML anchor or a huge list makes it
# unreadable. Problems show a bounded repr that cannot fail.
_SHORT = reprlib.Repr(maxlevel=3, maxlist=8, maxdict=8, maxstring=120, maxother=120, maxlong=60)


def short_repr(value: Any) -> str:
    """``repr(value)``, bounded in length and guaranteed not to raise."""
    try:
        return _SHORT.repr(value)
    except Exception:  # a hostile __repr__ or an int over the digit limit
        return f"<{type(value).__name__}>"


@dataclass(frozen=True)
class Problem:
    overlays: tuple[str, ...]   # the overlay(s) involved; "recipe" / "override" for non-overlay parties
    field: str                  # the config path or environment variable at issue
    value: Any
    message: str
    fix: str
    source: str = ""            # where the rule comes from (shared/reference file and section, or code line)
    check: str = ""             # the check's id

    def render(self) -> str:
        """The problem as the user reads it. Names, fields and messages carry user text (a file name, an
        override, a YAML value): control and bidirectional characters are escaped here, once for every
        command (issue 22 #9)."""
        who = shown(" + ".join(str(o) for o in self.overlays))
        # the message on one line: a file or folder name with a newline in it must not start a line of its own
        text = (f"[{who}] {shown(bounded(self.field, 200))}={short_repr(self.value)}: {shown(bounded(self.message))}"
                f"\n    fix: {shown(bounded(self.fix, 500))}")  # bounded: one place caps every message (issue 33 #19)
        if self.source:
            text += f"\n    source: {shown(self.source)}"
        return text


class OverlayError(ValueError):
    """Raised before anything is mutated; lists all problems found."""

    def __init__(self, problems: list[Problem]):
        self.problems = list(problems)
        count = len(self.problems)
        head = f"{count} problem{'s' if count != 1 else ''} found; nothing was changed:"
        shown_problems = [p.render() for p in self.problems[:MAX_PROBLEMS_SHOWN]]
        if count > MAX_PROBLEMS_SHOWN:
            shown_problems.append(f"... and {count - MAX_PROBLEMS_SHOWN} more problems (all of them under --json)")
        super().__init__("\n".join([head, *shown_problems]))


class ValidationRejected(OverlayError):
    """The stack's own validation (Bridge's ``runtime_config_update``) rejected the applied config.

    The apply was rolled back (config and environment unchanged); ``report`` still describes what the
    overlays would have changed, and ``report.validation`` holds the rejection."""

    def __init__(self, report, problems: list[Problem]):
        self.report = report
        super().__init__(problems)
