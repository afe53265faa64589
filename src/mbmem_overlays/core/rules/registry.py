"""How rules are declared: checks (every documented rule) and resolvers (overlay logic YAML can't express).

A check is a function of the prospective ``View`` named after the rule it enforces. It yields
``Problem``s (errors), plain strings (warnings) or ``"note: ..."`` strings. Checks look at the final
state, not at which overlay was named, so a rule holds whether an overlay, the recipe or a user
override set the field; problems name whoever set each field (``view.parties``).

Each check declares:
- ``reads``: the config paths (and ``$VARS`` of the environment) it looks at; ``mbmem explain`` lists
  a rule under every overlay that sets one of them, and a test checks the list is complete.
- ``enforced_by``: who else enforces the rule: ``megatron-core``/``bridge`` (our verdict must agree with
  ``runtime_config_update``; ``oracle`` holds a fragment of their error message), ``runtime`` (the
  stack fails later, at model or optimizer build), ``docs`` (only NVIDIA's skill texts state it; we
  are deliberately stricter — see ``doc_only_checks``), or ``silent`` (the stack silently changes or
  ignores the setting; the check only warns or notes, so the user sees it).
- ``source``: the file and section under shared/reference/ (and upstream code lines) it comes from.
The Bridge / megatron-core versions each rule was checked against are one table for all rules (``versions.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..errors import Problem

ENFORCERS = ("megatron-core", "bridge", "runtime", "docs", "silent")


@dataclass(frozen=True)
class Check:
    id: str
    enforced_by: str
    source: str
    fn: Callable
    reads: tuple[str, ...]
    oracle: tuple[str, ...] = ()  # fragments of the error Bridge/megatron-core raise for this rule

    @property
    def summary(self) -> str:
        """What the rule checks: the first line of the check function's docstring."""
        return (self.fn.__doc__ or "").strip().splitlines()[0]

    @property
    def versions(self):
        """The Bridge / megatron-core releases the rule was checked against (one table for all: versions.py)."""
        from .versions import rule_versions
        return rule_versions(self.id)

    @property
    def topic(self) -> str:
        return self.fn.__module__.rsplit(".", 1)[-1]

    def __call__(self, view) -> Iterator:
        yield from self.fn(view, self)

    def problem(self, parties, field, value, message, fix) -> Problem:
        return Problem(tuple(parties), field, value, message, fix, self.source, self.id)


@dataclass(frozen=True)
class Resolver:
    overlay: str
    fn: Callable
    writes: tuple[str, ...]   # config paths / $VARS it may claim, besides the overlay's YAML ``set``/``env``

    @property
    def doc(self) -> str:
        return (self.fn.__doc__ or "").strip()

    def __call__(self, view, params):
        return self.fn(view, params)


CHECKS: list[Check] = []
RESOLVERS: dict[str, Resolver] = {}


def check(*, enforced_by: str, source: str, reads: tuple[str, ...], oracle: str | tuple[str, ...] = ()):
    """Register the decorated function as the check whose id is the function's name."""
    if enforced_by not in ENFORCERS:
        raise ValueError(f"enforced_by must be one of {ENFORCERS}, not {enforced_by!r}")

    def register(fn):
        cid = fn.__name__
        if enforced_by in ("megatron-core", "bridge") and not oracle:
            raise ValueError(f"check {cid}: a rule enforced by {enforced_by} needs the fragment of its error (oracle=)")
        if any(c.id == cid for c in CHECKS):
            raise ValueError(f"check {cid} is defined twice")
        CHECKS.append(Check(cid, enforced_by, source, fn, tuple(reads),
                            (oracle,) if isinstance(oracle, str) else tuple(oracle)))
        return fn
    return register


def resolver(overlay: str, *, writes: tuple[str, ...]):
    """Register the decorated function as ``overlay``'s resolver: (view, params) -> (fields, env)."""
    def register(fn):
        RESOLVERS[overlay] = Resolver(overlay, fn, tuple(writes))
        return fn
    return register


def both_on(view, c: Check, first: str, second: str, message: str, fix: str) -> Iterator[Problem]:
    """The body of a rule of the form 'these two boolean fields cannot both be on'."""
    if view.get(first) and view.get(second):
        yield c.problem(view.parties(first, second), second, True, message, fix)


def doc_only_checks() -> dict[str, str]:
    """Rules where we are stricter than Bridge's validation, with their sources."""
    return {c.id: c.source for c in CHECKS if c.enforced_by in ("docs", "runtime")}


def markdown_table() -> str:
    """README's rules table, made from the checks themselves (tests/test_fidelity.py keeps README in step)."""
    rows = ["| rule | topic | enforced by | what it checks | source |", "|---|---|---|---|---|"]
    for c in sorted(CHECKS, key=lambda c: (c.topic, c.id)):
        cells = [f"`{c.id}`", c.topic, c.enforced_by, c.summary, c.source]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows)
