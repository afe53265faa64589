"""Which layers each pipeline rank holds, how many microbatches are in flight on it, and which ranks can be the
most loaded (Megatron's pipeline schedules)."""

from __future__ import annotations

import functools

from .inputs import Layout, Shape

HYBRID_SYMBOLS = {"M": "mamba", "*": "attn", "-": "mlp", "E": "moe"}


def layer_kinds(s: Shape) -> tuple[str, ...]:
    if s.layer_kinds:
        return s.layer_kinds
    moe = [round((i + 1) * s.moe_layers / s.layers) - round(i * s.moe_layers / s.layers) for i in range(s.layers)]
    return tuple("attn+moe" if m else "attn+mlp" for m in moe)


def rank_layers(s: Shape, lay: Layout, rank: int) -> dict[str, int]:
    """How many layers of each kind pipeline rank ``rank`` holds (its ``vpp`` interleaved chunks)."""
    return dict(_rank_layers(layer_kinds(s), lay.pp, lay.vpp, rank, lay.chunk_layers))


def rank_chunks(s: Shape, lay: Layout, rank: int) -> tuple[tuple[str, ...], ...]:
    """The layer kinds of each model chunk pipeline rank ``rank`` holds, in order."""
    return _rank_chunks(layer_kinds(s), lay.pp, lay.vpp, rank, lay.chunk_layers)


@functools.lru_cache(maxsize=4096)
def _rank_chunks(kinds: tuple[str, ...], pp: int, vpp: int, rank: int,
                 sizes: tuple[int, ...] = ()) -> tuple[tuple[str, ...], ...]:
    """The layers of each model chunk pipeline rank ``rank`` holds, in order (chunk c sits on rank c % pp).

    ``sizes``: the decoder layers of each chunk in chunk order (Layout.chunk_layers, from a pipeline layout or an
    uneven split); empty: the even split (transformer_block.py get_num_layers_to_build)."""
    chunks = pp * vpp
    if sizes and len(sizes) == chunks:
        bounds = [sum(sizes[:c]) for c in range(chunks + 1)]
    else:
        bounds = [round(c * len(kinds) / chunks) for c in range(chunks + 1)]
    return tuple(kinds[bounds[c]:bounds[c + 1]] for c in range(rank, chunks, pp))


@functools.lru_cache(maxsize=4096)
def _rank_layers(kinds: tuple[str, ...], pp: int, vpp: int, rank: int,
                 sizes: tuple[int, ...] = ()) -> tuple[tuple[str, int], ...]:
    counts: dict[str, int] = {}
    for chunk in _rank_chunks(kinds, pp, vpp, rank, sizes):
        for kind in chunk:
            counts[kind] = counts.get(kind, 0) + 1
    return tuple(counts.items())


def in_flight(lay: Layout, rank: int) -> float:
    """Layer-microbatches of activations alive on pipeline rank ``rank``, in units of 'all this stage's layers'."""
    m = lay.microbatches
    if lay.pp == 1:
        return 1.0
    if lay.vpp > 1:  # interleaved 1F1B: warm-up chunks, each 1/vpp of the stage's layers (Megatron schedules)
        chunks = min((lay.pp - rank - 1) * 2 + (lay.vpp - 1) * lay.pp + 1, m * lay.vpp)
        return chunks / lay.vpp
    return float(min(lay.pp - rank, m))


def _candidate_ranks(s: Shape, lay: Layout) -> list[int]:
    """The ranks that can be the most loaded: the first and last, and any middle rank whose layers differ
    from theirs (an even split of a uniform stack gives middle ranks fewer in-flight microbatches than the
    first and neither embedding nor output layer)."""
    ends = sorted({0, lay.pp - 1})
    seen = {_rank_layers(layer_kinds(s), lay.pp, lay.vpp, r, lay.chunk_layers) for r in ends}
    return ends + [r for r in range(1, lay.pp - 1) if _rank_layers(layer_kinds(s), lay.pp, lay.vpp, r, lay.chunk_layers)
                           not in seen]
