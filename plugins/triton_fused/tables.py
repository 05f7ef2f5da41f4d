"""Where the fused kernel's tile tables live and how a shape is keyed in them, without torch: `configs` looks
tiles up through these, and `selector doctor --model` asks `table_source` whether a shape is covered."""

from __future__ import annotations

import json
from pathlib import Path

from selector.plugins import tile_tables

from selector import settings

CONFIG_DIR = Path(__file__).with_name("configs")


def shape_key(num_experts: int, hidden: int, intermediate: int, top_k: int) -> str:
    return f"E={num_experts},H={hidden},I={intermediate},k={top_k}"


def layout_key(key: str, *, transposed: bool = False, interleaved: bool = False) -> str:
    """The table key of a shape in a weight layout other than the plain one (``...,k=4,transposed,interleaved``):
    such layers look up their own entry first and fall back to the plain layout's tiles of the same shape
    (valid for every layout: the kernel reads the same tile sizes in either stride order), then the heuristics.
    The gate is not part of the key: the epilogue's cost is small next to the GEMM the tiles are for."""
    return key + "".join(f",{name}" for name, on in (("transposed", transposed), ("interleaved", interleaved)) if on)


def config_file_name(device_name: str) -> str:
    return device_name.strip().replace(" ", "_").replace("/", "_") + ".json"


def shipped_dir() -> Path:
    """The shipped tables (SELECTOR_TRITON_FUSED_CONFIG_DIR replaces them)."""
    chosen = settings.get("SELECTOR_TRITON_FUSED_CONFIG_DIR")
    return Path(chosen) if chosen else CONFIG_DIR


def user_dir() -> Path:
    """The tables tuned on this node (SELECTOR_TRITON_FUSED_USER_CONFIG_DIR, else the user cache)."""
    return tile_tables.user_table_dir("SELECTOR_TRITON_FUSED_USER_CONFIG_DIR", "triton_fused")


def lookup_keys(
    num_experts: int, hidden: int, intermediate: int, top_k: int, *, transposed: bool = False, interleaved: bool = False
) -> tuple[str, ...]:
    """The keys a layer's tiles are looked up by, in order: its own layout's, then the plain layout's."""
    key = shape_key(num_experts, hidden, intermediate, top_k)
    return tuple(dict.fromkeys((layout_key(key, transposed=transposed, interleaved=interleaved), key)))


def _keys_in(path: Path) -> set[str]:
    """The shapes a table file holds tiles for (none when it is missing or unreadable)."""
    try:
        configs = json.loads(path.read_text()).get("configs")
    except (OSError, ValueError, AttributeError):
        return set()
    return {k for k, v in configs.items() if isinstance(v, dict) and v} if isinstance(configs, dict) else set()


def table_source(device_name: str, keys: tuple[str, ...]) -> str | None:
    """"tuned" (this node's table) or "table" (the shipped one) where a table for `device_name` holds one of `keys`
    (`lookup_keys`), in the order the kernel reads them; None where neither does (the heuristics)."""
    name = config_file_name(device_name)
    for source, folder in (("tuned", user_dir()), ("table", shipped_dir())):
        if _keys_in(folder / name) & set(keys):
            return source
    return None
