"""Tile configurations of the quantised grouped kernels: a tuned table per GPU, else ops' heuristics.

A configuration is ``{"BLOCK_M": 64, "gate_up": {"BLOCK_N": 128, "num_warps": 4, "num_stages": 4, "GROUP_M": 1},
"down": {...}}``; a flat dict (BLOCK_M, BLOCK_N, num_warps, num_stages, GROUP_M) applies to both GEMMs and a
missing key is filled by the heuristics. ``"QUANT_X": "once" | "loop"`` says where the activations are quantised
(dynamic scales): once up front by ``quantize_rows`` (one more launch; the default), or inside the gate_up K loop
(every N tile redoes it; slower in every decode cell tuned on the H200, so only on request). ``"ROUTE": "sorted" |
"pairs"``: pairs sorted by expert into BLOCK_M blocks (the align; at decode one more program of x's quantisation
launch), or one 16-row block per pair (decode: no align; an expert hit twice is read twice).
``"COMBINE": "kernel" | "launch"``: the down kernel adds each token's k slots itself (``kernels._combine_rows``;
the default for pair blocks; never on the TMA path), or a combine launch does (the default for sorted blocks).
``"SWAP": 1`` in a GEMM's config: the weight tile on the MMA's M side and the block's rows on its N side
(``kernels._mma``; on sm_90 a native fp8 wgmma for 16-row blocks, which the H200's decode entries use). BLOCK_K
is not a knob: it is the activation group (the K tile that one activation scale covers). Tables ship as ``configs/<GPU name, spaces as underscores>.json`` in
triton_fused's layout, keyed ``fp8:E=..,H=..,I=..,k=..`` (fp4 likewise) and then by token count; the entry
nearest to T in log scale is used. Written by ``python -m selector.plugins.quant_kernels.tune``.

Tiles tuned on this node (``tune.tune_kernels``, run by ``selector tune`` for shapes without a shipped entry)
go to a user table of the same layout, ``<user cache dir>/selector/quant_kernels/<GPU>.json``
(SELECTOR_QUANT_USER_CONFIG_DIR moves it); for a shape it has, it wins over the shipped table. One that cannot
be read is ignored with a warning.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

from selector.plugins import tile_tables
from selector.plugins.tile_tables import read_table

from selector import settings

CONFIG_DIR = Path(__file__).with_name("configs")
# SPLIT_K: ops.split_k / finish_split; SWAP: 1 = weights on the MMA's M side (kernels._mma; grouped mode)
GEMM_KEYS = ("BLOCK_N", "num_warps", "num_stages", "GROUP_M", "SPLIT_K", "SWAP")
PARTS = ("gate_up", "down")
QUANT_X = (None, "once", "loop")  # encoded as its index (0 = unset: the heuristic picks)
ROUTE = (None, "sorted", "pairs")  # likewise
COMBINE = (None, "launch", "kernel")  # likewise


def shape_key(fp4: bool, num_experts: int, hidden: int, inter: int, top_k: int) -> str:
    return f"{'fp4' if fp4 else 'fp8'}:E={num_experts},H={hidden},I={inter},k={top_k}"


def normalize(config: dict | None) -> dict[str, Any]:
    """Nested form of a flat, nested or partial config (unset keys are absent); ValueError on bad values."""
    config = dict(config or {})
    flat = {k: int(config[k]) for k in GEMM_KEYS if config.get(k)}
    out: dict[str, Any] = {"BLOCK_M": int(config["BLOCK_M"]) if config.get("BLOCK_M") else None}
    for part in PARTS:
        sub = {**flat, **{k: int(v) for k, v in (config.get(part) or {}).items() if k in GEMM_KEYS and v}}
        out[part] = sub
    for name, allowed in (("QUANT_X", QUANT_X), ("ROUTE", ROUTE), ("COMBINE", COMBINE)):
        out[name] = config.get(name) or None
        if out[name] not in allowed:
            raise ValueError(f"quantised experts: config {name}={out[name]!r} must be one of {allowed[1:]}")
    for name, val in [("BLOCK_M", out["BLOCK_M"])] + [(f"{p}.BLOCK_N", out[p].get("BLOCK_N")) for p in PARTS]:
        if val is not None and (val < 16 or val & (val - 1)):
            raise ValueError(f"quantised experts: config {name}={val} must be a power of two >= 16")
    return out


def encode(config: dict | None) -> list[int] | None:
    """The custom op carries a config as ints (0 = unset)."""
    if not config:
        return None
    c = normalize(config)
    knobs = [QUANT_X.index(c["QUANT_X"]), ROUTE.index(c["ROUTE"]), COMBINE.index(c["COMBINE"])]
    return [c["BLOCK_M"] or 0] + [c[p].get(k, 0) for p in PARTS for k in GEMM_KEYS] + knobs


def decode(values: list[int] | None) -> dict | None:
    if not values:
        return None
    n = len(GEMM_KEYS)
    parts = {
        p: {k: v for k, v in zip(GEMM_KEYS, values[1 + i * n : 1 + (i + 1) * n]) if v} for i, p in enumerate(PARTS)
    }
    if len(values) != 1 + len(PARTS) * n + 3:
        raise ValueError(f"quantised experts: an encoded config has {1 + len(PARTS) * n + 3} ints, got {len(values)}")
    extra = values[1 + len(PARTS) * n :]
    knobs = {"QUANT_X": QUANT_X[extra[0]], "ROUTE": ROUTE[extra[1]], "COMBINE": COMBINE[extra[2]]}
    return {"BLOCK_M": values[0] or None, **parts, **knobs}


def table_file(device_name: str, directory: str | None = None) -> Path:
    """Where the table for a GPU name lives (the tuner writes there, load_table reads there)."""
    return Path(directory or CONFIG_DIR) / (device_name.strip().replace(" ", "_").replace("/", "_") + ".json")


@functools.lru_cache(maxsize=8)
def load_table(device_name: str, directory: str | None = None) -> dict[str, dict[int, dict]]:
    return read_table(table_file(device_name, directory), normalize)


def lookup(table: dict[str, dict[int, dict]], key: str, num_tokens: int) -> dict | None:
    """The entry nearest to num_tokens in log scale. An entry tuned with one block per pair (ROUTE "pairs") serves
    no more tokens than it was tuned at: with more, pairs share experts and a pair block re-reads them (its
    COMBINE, chosen for pair blocks, goes with it)."""
    entries = table.get(key)
    if not entries:
        return None
    t = math.log2(max(1, num_tokens))
    tuned_at = min(entries, key=lambda n: (abs(math.log2(max(1, n)) - t), n))
    entry = entries[tuned_at]
    if entry.get("ROUTE") == "pairs" and num_tokens > tuned_at:
        entry = {**entry, "ROUTE": None, "COMBINE": None}  # the default rules decide (a pair block's combine too)
    return entry


def user_config_dir() -> Path:
    """Folder of the tile tables tuned on this node (SELECTOR_QUANT_USER_CONFIG_DIR, else the cache)."""
    return tile_tables.user_table_dir("SELECTOR_QUANT_USER_CONFIG_DIR", "quant_kernels")


def user_table_file(device_name: str, directory: str | Path | None = None) -> Path:
    return table_file(device_name, str(directory or user_config_dir()))


@functools.lru_cache(maxsize=8)
def load_user_table(device_name: str, directory: str | None = None) -> dict[str, dict[int, dict]]:
    """The user table for one GPU name; empty (with a warning) when malformed, silently when absent."""
    return tile_tables.read_user_table(user_table_file(device_name, directory), normalize, "quantised experts")


def write_user_entries(
    device_name: str, key: str, entries: dict[int, dict], tuned_at: list[int], directory: str | Path | None = None
) -> Path:
    """Merge one shape's {token_count: config} into the user table atomically; `tuned_at`: the token counts
    measured. Clears the caches so the tiles take effect in this process."""
    path = user_table_file(device_name, directory)
    normalized = {t: normalize(c) for t, c in entries.items()}
    tile_tables.merge_entries(
        path, key, normalized, tuned_at, {"version": 1, "device": device_name}, "quantised experts"
    )
    clear_caches()
    return path


def clear_caches() -> None:
    load_table.cache_clear()
    load_user_table.cache_clear()
    _tuned.cache_clear()


@functools.lru_cache(maxsize=4096)
def _tuned(device_name: str, key: str, num_tokens: int, user_dir: str) -> dict | None:
    for table in (load_user_table(device_name, user_dir), load_table(device_name)):
        found = lookup(table, key, num_tokens)
        if found is not None:
            return found
    return None


def tuned(device_name: str, key: str, num_tokens: int) -> dict | None:
    """The tuned entry for a call: this node's table, else the shipped one, if either has the shape."""
    return _tuned(device_name, key, num_tokens, str(user_config_dir()))


__all__ = [
    "decode",
    "encode",
    "load_table",
    "load_user_table",
    "lookup",
    "normalize",
    "shape_key",
    "tuned",
    "write_user_entries",
]
