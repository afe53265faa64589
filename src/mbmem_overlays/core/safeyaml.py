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

The construction is PyYAML's ``SafeLoader`` (no Python objects from tags) reading as OmegaConf's loader reads,
the one Hydra reads config files with: so a file means the same to ``mbmem`` as to train.py (duplicate keys are
an error, ``1e-4`` is a float, a date stays text). ``YamlRefused`` says which
bound was crossed; callers name the file.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

MAX_NODES = 10_000     # expanded; an overlay file has a few dozen
MAX_ALIASES = 100
MAX_DEPTH = 32


class YamlRefused(ValueError):
    """The document crosses a bound (size once aliases are expanded, aliases, depth) or refers to itself."""


class _Bounds:
    """The counting, mixed into the loader class (``_BoundedLoader``)."""

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


class _OmegaConfReading(yaml.SafeLoader):
    """PyYAML's SafeLoader read the way OmegaConf (so Hydra, so train.py) reads a config file
    (omegaconf/_utils.py ``get_yaml_loader``): a duplicate key is an error, ``1e-4`` is a float (YAML 1.2's
    float), and a date stays text. Restated here, not imported: omegaconf's import costs ``mbmem list`` 0.2 s;
    tests/test_hostile_round2.py checks that both read the same documents the same way."""

    allow_duplicates = False   # load(..., duplicates="last"): a later key wins, as PyYAML's own safe_load reads

    def construct_mapping(self, node, deep=False):
        keys = set()
        for key_node, _ in ([] if self.allow_duplicates else node.value):
            if key_node.tag != yaml.resolver.BaseResolver.DEFAULT_SCALAR_TAG:
                continue
            if key_node.value in keys:
                raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                        f"found duplicate key {key_node.value}", key_node.start_mark)
            keys.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


_OmegaConfReading.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"""^(?:
     [-+]?[0-9]+(?:_[0-9]+)*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9]+(?:_[0-9]+)*(?:[eE][-+]?[0-9]+)
    |\.[0-9]+(?:_[0-9]+)*(?:[eE][-+][0-9]+)?
    |[-+]?[0-9]+(?:_[0-9]+)*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))
_OmegaConfReading.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in _OmegaConfReading.yaml_implicit_resolvers.items()}


class _BoundedLoader(_Bounds, _OmegaConfReading):
    pass


def load(text: str, *, max_nodes: int = MAX_NODES, max_aliases: int = MAX_ALIASES, max_depth: int = MAX_DEPTH,
         duplicates: str = "error") -> Any:
    """The one document in ``text`` as plain Python data (SafeLoader's types), within the bounds.

    Raises ``YamlRefused`` for a bound, ``yaml.YAMLError`` for a syntax error, and ``ValueError`` for a scalar
    Python cannot hold (an integer over the int-digit limit)."""
    loader = _BoundedLoader(text)
    loader.allow_duplicates = duplicates == "last"
    loader._start(max_nodes, max_aliases, max_depth)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
