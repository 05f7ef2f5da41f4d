"""Measured times per (GPU, experts shape, dtype, mode, token count, backend): the lookup `auto` trusts over estimates.

Pure: it is handed its records and reads no file, socket or environment variable (`selector.tuning_store`
gathers them on this node). A record is one mapping: gpu, E, H, I, k, dtype, mode ("eager" or "graph"),
tokens, backend, time_s. A lookup matches the GPU name and shape exactly and takes the nearest measured token
count (in log scale); a later record for the same key replaces an earlier one; a malformed record is skipped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from selector.presets import PRESETS
from selector.probes import Environment
from selector.types import Problem

Key = tuple[str, int, int, int, int, str, str]  # gpu name, E, H, I, k, dtype, mode
Record = Mapping[str, Any]

MODES = ("eager", "graph")  # plain calls, or replays of a captured CUDA graph
FIELDS = ("gpu", "E", "H", "I", "k", "dtype", "tokens", "backend", "time_s")  # "mode" is optional: eager


def records_from_bench(bench: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Turn `selector bench` JSON into tuning records (selector backends only; eager and graph modes)."""
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


def record_key(r: Record) -> tuple[Any, ...]:
    """What makes two records the same measurement (a later one replaces an earlier one)."""
    return (r["gpu"], r["E"], r["H"], r["I"], r["k"], r["dtype"], r.get("mode", "eager"), r["tokens"], r["backend"])


def is_valid_record(r: object) -> bool:
    """Whether `r` is a record a lookup can use: every field present, a token count and a finite time."""
    if not isinstance(r, Mapping) or any(name not in r for name in FIELDS):
        return False
    try:
        int(r["tokens"])
        seconds = float(r["time_s"])
        hash(record_key(r))
    except (TypeError, ValueError):
        return False
    return math.isfinite(seconds)


def _table_key(r: Record) -> Key:
    return (r["gpu"], r["E"], r["H"], r["I"], r["k"], r["dtype"], r.get("mode", "eager"))


class TuningTable:
    """Records indexed for lookup: {(gpu, shape, dtype, mode): {tokens: {backend: seconds}}}."""

    def __init__(self) -> None:
        self._times: dict[Key, dict[int, dict[str, float]]] = {}

    @classmethod
    def from_records(cls, records: Iterable[Record]) -> TuningTable:
        """A table of `records`, later ones overriding earlier ones; malformed ones are skipped."""
        table = cls()
        for r in records:
            if is_valid_record(r):
                by_tokens = table._times.setdefault(_table_key(r), {})
                by_tokens.setdefault(int(r["tokens"]), {})[r["backend"]] = float(r["time_s"])
        return table

    def __len__(self) -> int:
        return sum(len(by_backend) for by_tokens in self._times.values() for by_backend in by_tokens.values())

    def lookup(self, problem: Problem, env: Environment) -> dict[str, float] | None:
        """{backend: seconds} measured on this GPU for this shape at the nearest token count, if any."""
        if problem.device != "cuda" or problem.device_index >= len(env.gpu.devices) or problem.num_tokens is None:
            return None
        if problem.weight_format != "dense" or problem.has_bias or problem.custom_gate or not problem.gated:
            return None  # measured on plain gated bf16-style layers only
        gpu = env.gpu.devices[problem.device_index].name
        mode = "graph" if problem.cuda_graph else "eager"
        key = (gpu, problem.num_experts, problem.hidden_size, problem.intermediate_size, problem.top_k,
               problem.dtype, mode)
        by_tokens = self._times.get(key)
        if not by_tokens:
            return None
        target = math.log2(max(problem.num_tokens, 1))
        nearest = min(by_tokens, key=lambda t: abs(math.log2(max(t, 1)) - target))
        return dict(by_tokens[nearest])


def measured_for(
    problem: Problem, env: Environment, records: TuningTable | Iterable[Record]
) -> dict[str, float] | None:
    """{backend: seconds} for `problem` on `env`'s GPU from `records` (a table, or records to index), if any."""
    table = records if isinstance(records, TuningTable) else TuningTable.from_records(records)
    return table.lookup(problem, env)
