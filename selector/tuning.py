"""Measured times per (GPU, experts shape, dtype, token count, backend): what `auto` trusts over estimates.

Sources, later ones overriding earlier: data files shipped in `selector/tuning_data/` (made by
`selector bench` on the named GPU), the user's cache file written by `selector bench --save-tuning`, then
what other processes shared through the node daemon.
A lookup matches the GPU name and shape exactly and takes the nearest measured token count (in log scale).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from selector.probes import Environment
from selector.types import Problem

DATA_DIR = Path(__file__).parent / "tuning_data"
SCHEMA = "selector.tuning/1"

Key = tuple[str, int, int, int, int, str, str]  # gpu name, E, H, I, k, dtype, mode


def user_tuning_path() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("selector")) / "tuning.json"


MODES = ("eager", "graph")  # plain calls, or replays of a captured CUDA graph


def records_from_bench(bench: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Turn `selector bench` JSON into tuning records (selector backends only; eager and graph modes)."""
    from selector.presets import PRESETS

    out = []
    for cell in bench["cells"]:
        if cell["mode"] not in MODES or not cell.get("time_s") or cell["backend"].startswith(("hf:", "auto")):
            continue
        if cell.get("format", "dense") != "dense":  # measured_for serves dense layers only
            continue
        p = PRESETS.get(cell["shape"])
        if p is None:
            continue
        out.append({
            "gpu": bench["device"], "E": p.num_experts, "H": p.hidden_size, "I": p.intermediate_size,
            "k": p.top_k, "dtype": cell["dtype"], "tokens": cell["tokens"], "backend": cell["backend"],
            "mode": cell["mode"], "time_s": cell["time_s"],
        })
    return out


def record_key(r: Mapping[str, Any]) -> tuple[Any, ...]:
    return (r["gpu"], r["E"], r["H"], r["I"], r["k"], r["dtype"], r.get("mode", "eager"), r["tokens"], r["backend"])


def write_records(path: Path, records: Iterable[Mapping[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    existing = read_records(path)
    merged = {record_key(r): r for r in existing}
    for r in records:
        merged[record_key(r)] = dict(r)
    path.write_text(json.dumps({"schema": SCHEMA, "records": list(merged.values())}, indent=1))


def read_records(path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return list(data.get("records", [])) if data.get("schema") == SCHEMA else []


@cache
def _table() -> dict[Key, dict[int, dict[str, float]]]:
    table: dict[Key, dict[int, dict[str, float]]] = {}
    paths = sorted(DATA_DIR.glob("*.json")) + [user_tuning_path()]
    for r in [r for path in paths for r in read_records(path)] + _daemon_records():
        key = (r["gpu"], r["E"], r["H"], r["I"], r["k"], r["dtype"], r.get("mode", "eager"))
        table.setdefault(key, {}).setdefault(int(r["tokens"]), {})[r["backend"]] = float(r["time_s"])
    return table


def _daemon_records() -> list[dict[str, Any]]:
    """Timings other processes of this node shared through the daemon (none when it is not running)."""
    from selector.daemon import request, socket_path

    path = socket_path()
    if not path.exists():
        return []
    try:
        reply = request(path, {"op": "tuning_get"}, timeout=0.5)
    except (OSError, ValueError):
        return []
    return list(reply.get("records", [])) if reply.get("ok") else []


def reload() -> None:
    _table.cache_clear()


def measured_for(problem: Problem, env: Environment) -> dict[str, float] | None:
    """{backend: seconds} measured on this GPU for this shape at the nearest token count, if any."""
    if problem.device != "cuda" or problem.device_index >= len(env.gpu.devices) or problem.num_tokens is None:
        return None
    if problem.weight_format != "dense" or problem.has_bias or problem.custom_gate or not problem.gated:
        return None  # measured on plain gated bf16-style layers only
    gpu = env.gpu.devices[problem.device_index].name
    mode = "graph" if problem.cuda_graph else "eager"
    key = (gpu, problem.num_experts, problem.hidden_size, problem.intermediate_size, problem.top_k, problem.dtype, mode)
    by_tokens = _table().get(key)
    if not by_tokens:
        return None
    target = math.log2(max(problem.num_tokens, 1))
    nearest = min(by_tokens, key=lambda t: abs(math.log2(max(t, 1)) - target))
    return dict(by_tokens[nearest])
