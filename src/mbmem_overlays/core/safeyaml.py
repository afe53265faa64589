"""YAML from users, read with bounds: the one loader for every file a user hands us (issue 22 #1).

A 399-byte file of nested aliases ("billion laughs": nine anchors of nine aliases each) parses in
microseconds into a graph of shared nodes, and then every walk over it (our checks, Hydra/OmegaConf's
copy, ``json.dumps``) expands it to 9^9 nodes. So the graph is measured while PyYAML composes it, before
any Python object exists: each node counts once, and each alias counts as the whole subtree it names
(memoized, so measuring is linear in the file). A file is refused as soon as it crosses a bound:

- ``max_nodes``: the expanded size, aliases counted in full;
- ``max_aliases``: alias references (an overlay needs a handful, if any);
- ``max_depth``: nesting, before Python's recursion limit (PyYAML composes recursively);
- an alias to a node that contains it (``&a [*a]``) is refused outright: it has no finite expansion.

The construction is OmegaConf's loader (``omegaconf._utils.get_yaml_loader``, a PyYAML ``SafeLoader``: no
Python objects from tags), the one Hydra reads config files with: so a file means the same to ``mbmem`` as to
train.py (duplicate keys are an error, ``1e-4`` is a float, a date stays text). ``YamlRefused`` says which
bound was crossed; callers name the file.
"""

from __future__ import annotations

import functools
from typing import Any

import yaml

MAX_NODES = 10_000     # expanded; an overlay file has a few dozen
MAX_ALIASES = 100
MAX_DEPTH = 32


class YamlRefused(ValueError):
    """The document crosses a bound (size once aliases are expanded, aliases, depth) or refers to itself."""


class _Bounds:
    """Counting mixed into OmegaConf's loader class (see ``_loader_class``)."""

    def _start(self, max_nodes: int, max_aliases: int, max_depth: int):
        self._limits = (max_nodes, max_aliases, max_depth)
        self._expanded = 0
        self._aliases = 0
        self._depth = 0
        self._sizes: dict[int, int] = {}   # id(node) -> expanded size, for every node composed completely

    def _grow(self, by: int) -> None:
        self._expanded += by
        if self._expanded > self._limits[0]:
            raise YamlRefused(f"expands to more than {self._limits[0]} nodes once its aliases (*name) are "
                              "followed (an alias bomb, or far larger than any overlay)")

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > self._limits[1]:
                raise YamlRefused(f"has more than {self._limits[1]} aliases (*name)")
            mark = self.peek_event().start_mark
            node = super().compose_node(parent, index)
            size = self._sizes.get(id(node))
            if size is None:  # still being composed: the alias sits inside the node it names
                raise YamlRefused(f"refers to itself through a YAML anchor (line {mark.line + 1}: an alias inside "
                                  "the node it names)")
            self._grow(size)
            return node
        self._depth += 1
        if self._depth > self._limits[2]:
            raise YamlRefused(f"is nested deeper than {self._limits[2]} levels")
        before = self._expanded
        self._grow(1)
        node = super().compose_node(parent, index)
        self._depth -= 1
        self._sizes[id(node)] = self._expanded - before
        return node


@functools.cache
def _loader_class() -> type:
    from omegaconf._utils import get_yaml_loader  # omegaconf comes with Hydra; imported only when a file is read
    return type("BoundedOmegaConfLoader", (_Bounds, get_yaml_loader()), {})


def load(text: str, *, max_nodes: int = MAX_NODES, max_aliases: int = MAX_ALIASES, max_depth: int = MAX_DEPTH) -> Any:
    """The one document in ``text`` as plain Python data (SafeLoader's types), within the bounds.

    Raises ``YamlRefused`` for a bound, ``yaml.YAMLError`` for a syntax error, and ``ValueError`` for a scalar
    Python cannot hold (an integer over the int-digit limit)."""
    loader = _loader_class()(text)
    loader._start(max_nodes, max_aliases, max_depth)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
