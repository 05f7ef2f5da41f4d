"""Reading the per-GPU tile tables the Triton kernels ship (`configs/<GPU name>.json`; no torch here).

File layout: {"configs": {shape_key: {token_count: config}}, ...}. Each kernel family brings its own
`normalize` (which keys a config has, their defaults); an entry it rejects is skipped, not fatal.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

Table = dict[str, dict[int, dict[str, Any]]]


def read_table(path: Path, normalize: Callable[[Any], dict[str, Any]]) -> Table:
    """{shape_key: {token_count: normalized config}}; empty when the file is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    table: Table = {}
    for key, per_t in (data.get("configs") or {}).items():
        entries = {}
        for t, cfg in per_t.items():
            try:
                entries[int(t)] = normalize(cfg)
            except (ValueError, TypeError):
                continue
        if entries:
            table[key] = entries
    return table
