"""The tile heuristic for layers no table holds: the tiles of the nearest (shape, token count) a table does hold.

A shipped table is the search's answer for the public shapes on one GPU; the tiles that win depend on how many
rows each expert's GEMMs see, how many rows there are in all (how many programs fill the GPU) and the two GEMMs'
sizes, far more than on the shape's name. So a layer no table holds borrows the configuration of the tabled cell
nearest to it in those four quantities (log scale, rows per expert counted twice: it decides BLOCK_M), among cells
that run the same kernels (one token or sorted blocks; at one token, the down projection as a K loop over the
experts or as pair blocks). Same weight layout first. A GPU without a table of its own borrows the table of the GPU
of the same compute capability major whose SM count is nearest. Without torch: configs.py reads the tables.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

# rows per expert, rows in all, hidden size, intermediate size (log2 each)
FEATURE_WEIGHTS = (2.0, 1.0, 1.0, 1.0)
OTHER_LAYOUT = 0.5  # distance added for a cell of another weight layout (transposed / interleaved)

Table = Mapping[str, Mapping[int, Mapping[str, Any]]]


class Layer(NamedTuple):
    """What the nearest cell is chosen by: a layer's sizes and weight layout."""

    num_experts: int
    hidden: int
    intermediate: int
    top_k: int
    transposed: bool = False
    interleaved: bool = False


def parse_key(key: str) -> Layer | None:
    """The layer of a table key (``E=..,H=..,I=..,k=..[,transposed][,interleaved]``), None when malformed."""
    parts = key.split(",")
    try:
        sizes = dict(p.split("=", 1) for p in parts[:4])
        layer = Layer(int(sizes["E"]), int(sizes["H"]), int(sizes["I"]), int(sizes["k"]),
                      "transposed" in parts[4:], "interleaved" in parts[4:])  # fmt: skip
    except (KeyError, ValueError):
        return None
    return layer if min(layer[:4]) >= 1 else None


def features(layer: Layer, tokens: int) -> tuple[float, float, float, float]:
    pairs = max(1, tokens) * layer.top_k
    per_expert = pairs / min(layer.num_experts, pairs)
    return (math.log2(per_expert), math.log2(pairs), math.log2(layer.hidden), math.log2(layer.intermediate))


def kernels_of(layer: Layer, tokens: int, pair_max_tokens: int, token_down_min_i: int) -> tuple[bool, bool]:
    """Which kernels a call runs, as far as its tiles go: (one-token pair blocks, down as one K loop per token)."""
    pair = tokens <= pair_max_tokens
    return pair, pair and layer.intermediate >= token_down_min_i and not layer.transposed


def distance(a: Layer, ta: int, b: Layer, tb: int) -> float:
    fa, fb = features(a, ta), features(b, tb)
    far = sum(w * abs(x - y) for w, x, y in zip(FEATURE_WEIGHTS, fa, fb))
    return far + (OTHER_LAYOUT if (a.transposed, a.interleaved) != (b.transposed, b.interleaved) else 0.0)


def nearest_cell(
    tables: Iterable[Table], layer: Layer, tokens: int, *, pair_max_tokens: int, token_down_min_i: int
) -> tuple[str, int, Mapping[str, Any]] | None:
    """(table key, token count, configuration) of the tabled cell nearest to `layer` at `tokens` among those that
    run the same kernels; None when no table holds one. The first table wins a tie (pass this node's first)."""
    kind = kernels_of(layer, tokens, pair_max_tokens, token_down_min_i)
    best: tuple[float, str, int, Mapping[str, Any]] | None = None
    for table in tables:
        for key, per_t in table.items():
            other = parse_key(key)
            if other is None:
                continue
            for t, cfg in per_t.items():
                if kernels_of(other, t, pair_max_tokens, token_down_min_i) != kind:
                    continue
                d = distance(layer, tokens, other, t)
                if best is None or d < best[0]:
                    best = (d, key, t, cfg)
    return None if best is None else best[1:]


def sibling_table(headers: Mapping[str, Mapping[str, Any]], capability: tuple[int, int], num_sms: int) -> str | None:
    """The table (its name in `headers`: name -> the file's header) of the GPU of the same compute capability
    major whose SM count is nearest to `num_sms`; None when no table names that capability."""
    same = [
        (abs(int(h.get("num_sms", 0)) - num_sms), name)
        for name, h in headers.items()
        if isinstance(h.get("capability"), list) and h["capability"][:1] == [capability[0]]
    ]
    return min(same)[1] if same else None
