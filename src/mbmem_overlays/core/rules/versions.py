"""Which Megatron Bridge / megatron-core versions the rules were read from and checked against (docs/install.md).

One table for every rule: ``SUPPORTED`` pairs each Bridge release with the megatron-core it was checked with
(``bench/agreement.py`` and the rule tests ran on each pair: ``.ci/run``). A rule whose behaviour differs between
the pairs, or that holds on only some of them, has an entry in ``DIFFERENCES`` (its versions and why), so the
rule modules need no change; ``Check.versions`` reads both. ``bridge/stack.py`` compares the installed
versions with ``SUPPORTED`` (importlib.metadata, no Bridge import) and says so in one line when they are outside.
"""

from __future__ import annotations

from dataclasses import dataclass

# megatron-bridge -> the megatron-core it pairs with; the first pair is this repository's pinned stack
# (requirements/stack.lock), the others each have a lock of their own (requirements/stack-<bridge>.lock).
SUPPORTED: dict[str, str] = {
    "0.6.2": "0.19.2",
    "0.6.0": "0.19.0",
}


@dataclass(frozen=True)
class VersionRange:
    """The Bridge releases (of ``SUPPORTED``) on which a rule was checked to hold, and what differs elsewhere."""
    bridge: tuple[str, ...]
    note: str = ""

    def describe(self) -> str:
        pairs = ", ".join(f"Bridge {b} + megatron-core {SUPPORTED[b]}" for b in self.bridge)
        return pairs + (f" ({self.note})" if self.note else "")


ALL = VersionRange(tuple(SUPPORTED))

# rule id -> where it holds, for the rules that differ between the supported pairs (empty: every rule holds on
# every pair; bench/agreement.py on each stack is how a difference is found).
DIFFERENCES: dict[str, VersionRange] = {}


def rule_versions(rule_id: str) -> VersionRange:
    return DIFFERENCES.get(rule_id, ALL)


def checked_against() -> str:
    """``Bridge 0.6.2 + megatron-core 0.19.2, Bridge 0.6.0 + megatron-core 0.19.0``: for one-line messages."""
    return ALL.describe()
