"""Tile configurations for the fused experts kernels.

A configuration is a dict::

    {"BLOCK_M": 64,                       # rows per expert block (shared by both GEMMs: the align step uses it)
     "gate_up": {"BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4},
     "down":    {"BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4}}

For the gated gate_up GEMM, BLOCK_N counts intermediate channels: each program reads 2*BLOCK_N weight rows
(gate and up). A flat dict (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, num_warps, num_stages) applies to both.
The down GEMM's SPLIT_K (a power of two, default 1; gate_up's must be 1) is read at one token only, where the
down projection runs as pair blocks: each (pair, tile) splits its K steps over that many programs, whose rows
the last arriver adds (``kernels._pair_gemm_kernel``).

Tuned configurations ship as JSON in ``configs/<GPU name with spaces as underscores>.json``::

    {"version": 1, "device": "NVIDIA H200", "dtype": "bfloat16",
     "configs": {"E=128,H=2048,I=768,k=8": {"1": {...}, "64": {...}, "4096": {...}}}}

The entry whose token count is nearest to T (in log scale) is used; shapes or dtypes without an entry get
``default_config``. The directory can be overridden with SELECTOR_TRITON_FUSED_CONFIG_DIR.

Tiles tuned on this node (``tune.tune_kernels``, run by ``selector tune``) go to a user table of the same
format, ``<user cache dir>/selector/triton_fused/<GPU>.json`` (SELECTOR_TRITON_FUSED_USER_CONFIG_DIR moves
it); its document also lists, per shape, which token counts were measured (``"tuned"``) rather than filled in
with the heuristics. For a shape it has, the user table wins over the shipped one. A user table that cannot be
read is ignored with a warning: a broken cache file must never stop a model from running.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from selector.plugins import tile_tables
from selector.plugins.tile_tables import Table, read_table
# the keys, file names and folders live in tables.py (no torch); tune.py and the tests read them from here too
from selector.plugins.triton_fused.tables import (
    CONFIG_DIR,
    config_file_name,
    layout_key,
    lookup_keys,
    shape_key,
    shipped_dir,
    user_dir,
)
from selector.plugins.triton_fused.nearest import Layer, nearest_cell, sibling_table


_GEMM_KEYS = ("BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages", "SPLIT_K")
_SMEM_BUDGET = 200 * 1024  # bytes of shared memory we let the pipeline use (H100/H200 allow 227 KB)


# ---------------------------------------------------------------------------------------------------------------
# normalise / encode (the custom op carries a config as a list of ints)
# ---------------------------------------------------------------------------------------------------------------


def normalize(config: dict[str, Any]) -> dict[str, Any]:
    """Full nested form of a (possibly flat or partial) config; raises ValueError on bad values."""
    if not isinstance(config, dict):
        raise ValueError(f"triton_fused: config must be a dict, got {type(config).__name__}")
    flat = {k: config[k] for k in _GEMM_KEYS if k in config}
    out: dict[str, Any] = {"BLOCK_M": int(config.get("BLOCK_M", 64)), "PERSISTENT": int(config.get("PERSISTENT", 0))}
    for part in ("gate_up", "down"):
        sub = dict(DEFAULT_GEMM)
        sub.update(flat)
        sub.update(config.get(part, {}) or {})
        out[part] = {k: int(sub[k]) for k in _GEMM_KEYS}
    for name, val in (("BLOCK_M", out["BLOCK_M"]),) + tuple(
        (f"{p}.{k}", out[p][k]) for p in ("gate_up", "down") for k in ("BLOCK_N", "BLOCK_K")
    ):
        if val < 16 or val & (val - 1):
            raise ValueError(f"triton_fused: config {name}={val} must be a power of two >= 16")
    for p in ("gate_up", "down"):
        split = out[p]["SPLIT_K"]
        if split < 1 or split & (split - 1) or (p == "gate_up" and split != 1):
            raise ValueError(
                f"triton_fused: config {p}.SPLIT_K={split}: the down GEMM's is a power of two, gate_up's is 1"
            )
        bad_pipe = out[p]["num_warps"] not in (1, 2, 4, 8, 16) or out[p]["num_stages"] < 1
        if bad_pipe or out[p]["GROUP_M"] < 1:
            raise ValueError(f"triton_fused: bad config {p}={out[p]}")
    if out["PERSISTENT"] not in (0, 1) or (out["PERSISTENT"] and out["BLOCK_M"] != PERSISTENT_BLOCK_M):
        raise ValueError(
            f"triton_fused: config PERSISTENT={out['PERSISTENT']} is 0 or 1, with BLOCK_M "
            f"{PERSISTENT_BLOCK_M} (got {out['BLOCK_M']})"
        )
    return out


DEFAULT_GEMM = {"BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3, "SPLIT_K": 1}

# PERSISTENT: 1 runs a layer's sorted-block GEMMs through plugins/triton_fused/hopper_gemm.py (Gluon, sm_90) where
# it can (``kernels.persistent_fits``), else the Triton kernel. Its consumers are one warpgroup each, wgmma's M is
# 64 rows: whole blocks of 128 rows, half blocks of 64.
PERSISTENT_BLOCK_M = 128

# TMA (kernels.part_layout). Measured on the H200 (docs/design/triton_fused.md): blocks of 128 rows ran 7-13%
# faster through TMA, blocks of 64 (Qwen at T=512) 20-30% slower, so smaller blocks keep pointer loads. A box has
# at most 256 elements a side; its contiguous side (BLOCK_K) ran at 128 bytes on the H200, wider is untested.
TMA_MIN_BLOCK_M = 128
TMA_MAX_BOX = 256
TMA_MAX_INNER_BYTES = 128

# From this BLOCK_M up, a block at most half full (an expert's last) runs as a half-height tile (the kernel's
# HALF_TAIL). Measured on the H200 (docs/design/triton_fused.md): 4-10% faster where padding is a fifth of the
# rows or more (Qwen and GPT-OSS at T=512 with 64-row blocks, at T=4096 with 128), the same bits; smaller blocks
# are weight bound.
HALF_TAIL_MIN_BLOCK_M = 64

# One token: from this intermediate size up (K-contiguous down weights), the down projection runs as one K loop
# over the k experts per output tile (kernels._token_down_kernel) instead of a program per (slot, tile) with the
# k-way sum in its epilogue. Measured on the H200 (docs/design/triton_fused.md): Mixtral (I=14336) and DeepSeek-V3
# (I=2048) 5-6% faster per layer, the Qwen shapes (I=768, 1408) and GPT-OSS's transposed weights slower.
TOKEN_DOWN_MIN_I = 2048

# Up to this many tokens a layer runs as pair blocks (kernels._pair_gemm_kernel: no align, no combine), its tiles
# chosen as such.
PAIR_BLOCK_MAX_TOKENS = 1


def tma_tiles(block_m: int, block_k: int, tile_c: int, elem: int) -> bool:
    """Whether a GEMM's tiles (BLOCK_M rows, BLOCK_K, `tile_c` weight channels per program, `elem` bytes) are
    ones the TMA path reads: the tuner offers blocks of TMA_MIN_BLOCK_M rows only such tiles, since a layer runs
    TMA only when both of its GEMMs' tiles fit it."""
    return (
        TMA_MIN_BLOCK_M <= block_m <= TMA_MAX_BOX
        and max(tile_c, block_k) <= TMA_MAX_BOX
        and block_k * elem <= TMA_MAX_INNER_BYTES
    )


def encode_config(config: dict[str, Any]) -> list[int]:
    c = normalize(config)
    return [c["BLOCK_M"]] + [c[p][k] for p in ("gate_up", "down") for k in _GEMM_KEYS] + [c["PERSISTENT"]]


def decode_config(values: list[int]) -> dict[str, Any]:
    v = [int(x) for x in values]
    n = len(_GEMM_KEYS)
    if len(v) != 2 + 2 * n:
        raise ValueError(f"triton_fused: encoded config has {len(v)} values, expected {2 + 2 * n}")
    return {
        "BLOCK_M": v[0],
        "gate_up": dict(zip(_GEMM_KEYS, v[1 : 1 + n])),
        "down": dict(zip(_GEMM_KEYS, v[1 + n : 1 + 2 * n])),
        "PERSISTENT": v[1 + 2 * n],
    }


# ---------------------------------------------------------------------------------------------------------------
# heuristics
# ---------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _num_sms(device_index: int | None) -> int:
    try:
        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(device_index or 0).multi_processor_count
    except Exception:
        pass
    return 132


def _cap_stages(stages: int, block_m: int, block_n: int, block_k: int, n_b: int, elem: int) -> int:
    per_stage = (block_m * block_k + n_b * block_n * block_k) * elem
    return max(2, min(stages, _SMEM_BUDGET // per_stage))


def default_config(
    num_experts: int,
    hidden: int,
    intermediate: int,
    num_tokens: int,
    top_k: int,
    dtype: torch.dtype = torch.bfloat16,
    *,
    gated: bool = True,
    num_sms: int = 132,
) -> dict[str, Any]:
    """Heuristic tiles: small BLOCK_M and narrow N tiles (many programs) when weights dominate, wgmma-sized
    tiles when the GEMMs are compute bound."""
    elem = 4 if dtype == torch.float32 else 2
    n_pairs = max(1, num_tokens * top_k)
    active = max(1, min(num_experts, n_pairs))
    per_expert = n_pairs / active
    if per_expert <= 16:
        bm = 16
    elif per_expert <= 32:
        bm = 32
    elif per_expert <= 96:
        bm = 64
    else:
        bm = 128
    est_blocks = active * math.ceil(per_expert / bm)
    cfg: dict[str, Any] = {"BLOCK_M": bm}
    n_b1 = 2 if gated else 1
    if bm <= 32:
        bk = 128 if elem == 2 else 64
        for part, n_out, n_b in (("gate_up", intermediate, n_b1), ("down", hidden, 1)):
            choices = (64, 32, 16) if n_b == 2 else (128, 64, 32, 16)
            bn = choices[-1]
            for cand in choices:
                if est_blocks * math.ceil(n_out / cand) >= 2 * num_sms:
                    bn = cand
                    break
            cfg[part] = {
                "BLOCK_N": bn,
                "BLOCK_K": bk,
                "GROUP_M": 1,
                "num_warps": 4,
                "num_stages": _cap_stages(4, bm, bn, bk, n_b, elem),
            }
        if num_tokens <= 1 and intermediate >= TOKEN_DOWN_MIN_I:  # one K loop of k * I per output tile
            bk = 256 if elem == 2 else 128
            cfg["down"] = {
                "BLOCK_N": 32,
                "BLOCK_K": bk,
                "GROUP_M": 1,
                "num_warps": 4,
                "num_stages": _cap_stages(4, bm, 32, bk, 1, elem),
            }
    else:
        warps = 8 if bm == 128 else 4
        bk = 64 if elem == 2 else 32
        bn1 = 64 if gated else 128
        cfg["gate_up"] = {
            "BLOCK_N": bn1,
            "BLOCK_K": bk,
            "GROUP_M": 8,
            "num_warps": warps,
            "num_stages": _cap_stages(4, bm, bn1, bk, n_b1, elem),
        }
        cfg["down"] = {
            "BLOCK_N": 128,
            "BLOCK_K": bk,
            "GROUP_M": 8,
            "num_warps": warps,
            "num_stages": _cap_stages(4, bm, 128, bk, 1, elem),
        }
    return cfg


# ---------------------------------------------------------------------------------------------------------------
# shipped / tuned tables
# ---------------------------------------------------------------------------------------------------------------


def _config_dir() -> Path:
    return shipped_dir()


@functools.lru_cache(maxsize=16)
def load_table(device_name: str, directory: str | None = None) -> dict[str, dict[int, dict[str, Any]]]:
    """{shape_key: {token_count: config}} for one GPU name; empty when there is no (readable) file."""
    path = Path(directory) if directory else _config_dir()
    return read_table(path / config_file_name(device_name), normalize)


@functools.lru_cache(maxsize=16)
def _device_name(device_index: int | None) -> str | None:
    try:
        if torch.cuda.is_available():
            return torch.cuda.get_device_name(device_index or 0)
    except Exception:
        pass
    return None


def lookup(table: dict[str, dict[int, dict[str, Any]]], key: str, num_tokens: int) -> dict[str, Any] | None:
    entries = table.get(key)
    return entry_for(entries, num_tokens) if entries else None


def entry_for(entries: Mapping[int, dict[str, Any]], num_tokens: int) -> dict[str, Any]:
    """One shape's entry whose token count is nearest to `num_tokens` in log scale (the smaller on a tie)."""
    t = max(1, num_tokens)
    return entries[min(entries, key=lambda n: (abs(math.log2(max(1, n)) - math.log2(t)), n))]


# ---------------------------------------------------------------------------------------------------------------
# the user table (tiles tuned on this node)
# ---------------------------------------------------------------------------------------------------------------


def user_config_dir() -> Path:
    """Folder of the tile tables tuned on this node (SELECTOR_TRITON_FUSED_USER_CONFIG_DIR, else the cache)."""
    return user_dir()


def user_table_path(device_name: str, directory: str | Path | None = None) -> Path:
    return Path(directory or user_config_dir()) / config_file_name(device_name)


@functools.lru_cache(maxsize=16)
def load_user_table(device_name: str, directory: str | None = None) -> dict[str, dict[int, dict[str, Any]]]:
    """The user table for one GPU name; empty (with a warning) when it is malformed, silently when absent."""
    return tile_tables.read_user_table(user_table_path(device_name, directory), normalize, "triton_fused")


def user_tuned_tokens(device_name: str, key: str, directory: str | None = None) -> frozenset[int]:
    """Token counts of `key` that the user table holds measured tiles for (not filled in with defaults)."""
    return tile_tables.tuned_tokens(user_table_path(device_name, directory), key)


def shipped_has(device_name: str, key: str) -> bool:
    """Whether the shipped (or SELECTOR_TRITON_FUSED_CONFIG_DIR) table has tiles for this shape."""
    return bool(load_table(device_name, str(_config_dir())).get(key))


def write_user_entries(
    device_name: str,
    key: str,
    entries: Mapping[int, Mapping[str, Any]],
    tuned: Sequence[int],
    *,
    dtype: str = "bfloat16",
    directory: str | Path | None = None,
) -> Path:
    """Merge one shape's entries ({token_count: config}) into the user table, atomically (a reader sees the old
    file or the new one, never half of one); `tuned` names the token counts that were measured. Clears the
    caches so the new tiles take effect in this process. Returns the file's path."""
    path = user_table_path(device_name, directory)
    entries = {t: normalize(dict(cfg)) for t, cfg in entries.items()}
    header = {"version": 1, "device": device_name, "dtype": dtype}
    tile_tables.merge_entries(path, key, entries, tuned, header, "triton_fused")
    clear_caches()
    return path


def clear_caches() -> None:
    """Forget every table read and config chosen, so changed files take effect in this process."""
    load_table.cache_clear()
    load_user_table.cache_clear()
    _table_headers.cache_clear()
    _get_config_cached.cache_clear()


class LayerShape(NamedTuple):
    """What a layer's tiles are looked up by, besides the call's token count and k (hashable: the cache key)."""

    num_experts: int
    hidden: int
    intermediate: int
    dtype: torch.dtype
    gated: bool = True
    transposed: bool = False
    interleaved: bool = False


@functools.lru_cache(maxsize=16)
def _capability(device_index: int | None) -> tuple[int, int]:
    try:
        return torch.cuda.get_device_capability(device_index or 0)
    except Exception:
        return (0, 0)


@functools.lru_cache(maxsize=16)
def _table_headers(directory: str) -> dict[str, dict[str, Any]]:
    """{GPU name: its table's header} for every shipped table in `directory`."""
    headers = {}
    for path in sorted(Path(directory).glob("*.json")):
        try:
            doc = tile_tables.read_document(path)
        except ValueError:
            continue
        if isinstance(doc.get("device"), str):
            headers[doc["device"]] = {k: v for k, v in doc.items() if k not in ("configs", "tuned")}
    return headers


def nearest_tables(device_index: int | None, dirs: tuple[str, str]) -> tuple[Table, ...]:
    """The tables the nearest-cell heuristic reads on this GPU: this node's and the shipped one for this GPU, else
    the shipped table of the GPU of the same architecture nearest in SM count (``nearest.sibling_table``)."""
    name = _device_name(device_index)
    own = tuple(t for t in (load_user_table(name, dirs[1]), load_table(name, dirs[0])) if t) if name else ()
    if own:
        return own
    sibling = sibling_table(_table_headers(dirs[0]), _capability(device_index), _num_sms(device_index))
    return (load_table(sibling, dirs[0]),) if sibling else ()


def nearest_config(shape: LayerShape, num_tokens: int, top_k: int, tables: tuple[Table, ...]) -> dict[str, Any] | None:
    """The configuration of the tabled cell nearest to this layer and token count (plugins/triton_fused/nearest.py)."""
    layer = Layer(shape.num_experts, shape.hidden, shape.intermediate, top_k, shape.transposed, shape.interleaved)
    found = nearest_cell(
        tables, layer, num_tokens, pair_max_tokens=PAIR_BLOCK_MAX_TOKENS, token_down_min_i=TOKEN_DOWN_MIN_I
    )
    return None if found is None else dict(found[2])


def _tabled(shape: LayerShape) -> bool:
    """Whether tables hold tiles of this kind of layer (gated, 16-bit)."""
    return shape.gated and shape.dtype in (torch.bfloat16, torch.float16)


def _held_entries(shape: LayerShape, top_k: int, device_index: int | None, dirs: tuple[str, str]
                  ) -> tuple[str, dict[int, dict[str, Any]]] | None:  # fmt: skip
    """("tuned" or "table", {token_count: config}) of the table entry that holds this layer on this GPU, in the
    order the lookup reads them: this layout's key before the plain layout's, this node's table before the shipped
    one; None where neither holds it (or the layer has no tables: not gated 16-bit)."""
    name = _device_name(device_index)
    if not name or not _tabled(shape):
        return None
    keys = lookup_keys(shape.num_experts, shape.hidden, shape.intermediate, top_k,
                       transposed=shape.transposed, interleaved=shape.interleaved)  # fmt: skip
    tables = (("tuned", load_user_table(name, dirs[1])), ("table", load_table(name, dirs[0])))
    for key in keys:  # this layout's tiles, else the plain layout's of the shape
        for source, table in tables:
            if table.get(key):
                return source, table[key]
    return None


@functools.lru_cache(maxsize=4096)
def _get_config_cached(
    shape: LayerShape, num_tokens: int, top_k: int, device: tuple[str, int | None], dirs: tuple[str, str]
) -> dict[str, Any]:
    num_experts, hidden, intermediate, dtype, gated, _, _ = shape
    device_type, device_index = device
    num_sms = 132
    if device_type == "cuda":
        num_sms = _num_sms(device_index)
        held = _held_entries(shape, top_k, device_index, dirs)
        if held is not None:
            return entry_for(held[1], num_tokens)
        if _tabled(shape) and (cfg := nearest_config(shape, num_tokens, top_k, nearest_tables(device_index, dirs))):
            return cfg
    return normalize(
        default_config(num_experts, hidden, intermediate, num_tokens, top_k, dtype, gated=gated, num_sms=num_sms)
    )


def tile_source(shape: LayerShape, top_k: int, device: torch.device) -> str:
    """Where a layer's tiles come from on `device`, as `layer_config` reads them: "tuned" (this node's table),
    "table" (the shipped one for this GPU), "nearest" (neither holds the shape: the nearest tabled cell's,
    `nearest_config`), "heuristic" (no table to borrow from: `default_config`), "" off CUDA (no tables there)."""
    if device.type != "cuda":
        return ""
    dirs = (str(_config_dir()), str(user_config_dir()))
    held = _held_entries(shape, top_k, device.index, dirs)
    if held is not None:
        return held[0]
    return "nearest" if _tabled(shape) and any(nearest_tables(device.index, dirs)) else "heuristic"


def layer_config(shape: LayerShape, num_tokens: int, top_k: int, device: torch.device) -> dict[str, Any]:
    """``get_config`` for a layer's record (`shape`): the tile config of one call."""
    return _get_config_cached(
        shape, num_tokens, top_k, (device.type, device.index), (str(_config_dir()), str(user_config_dir()))
    )


def get_config(
    num_experts: int,
    hidden: int,
    intermediate: int,
    num_tokens: int,
    top_k: int,
    dtype: torch.dtype = torch.bfloat16,
    *,
    gated: bool = True,
    device: torch.device | str | None = None,
    transposed: bool = False,
    interleaved: bool = False,
) -> dict[str, Any]:
    """The tile config for one call: this node's tuned table, else the shipped table for this GPU, if either has
    the shape in this layout (`layout_key`), then the same for the plain layout of the shape; else the
    heuristics."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    shape = LayerShape(num_experts, hidden, intermediate, dtype, gated, transposed, interleaved)
    return layer_config(shape, num_tokens, top_k, dev)
