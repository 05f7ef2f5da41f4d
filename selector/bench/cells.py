"""What `selector bench` measures: one cell per (shape, tokens, dtype, weight format, backend, mode), and a run."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

DEFAULT_TOKENS = (1, 8, 64, 512, 4096, 16384)
DEFAULT_PRESETS = ("qwen1.5-moe-a2.7b", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v3")
FORMATS: dict[str, tuple[str, str] | None] = {  # --formats name: (weight format, scale format) to quantise to
    "dense": None,
    "fp8-f32": ("fp8_block", "float32"),
    "fp8-ue8m0": ("fp8_block", "ue8m0"),
    "fp4": ("fp4", "ue8m0"),
}
PEER_PREFIX = "hf:"  # Transformers' own backends are listed as hf:eager, hf:batched_mm, hf:grouped_mm
SCHEMA = "selector.bench/2"  # /2: times are medians of interleaved rounds, with their spread
WITHIN = 0.05  # choice quality: auto within 5% of the fastest backend of the same run
TRAIN = "train"  # the mode whose sample is a training step: forward under autograd, then the backward
MODES = ("eager", "graph", "compile", TRAIN)


@dataclass
class Cell:
    shape: str
    tokens: int
    dtype: str
    backend: str
    mode: str
    format: str = "dense"  # a FORMATS name
    time_s: float | None = None
    floor_s: float | None = None
    tflops: float | None = None
    gbps: float | None = None
    extra_memory_bytes: int | None = None
    rel_error: float | None = None
    # train mode: the largest of grad_rel_errors, each gradient's error against float64 from the definition, of a
    # training step on the cell's sample rows (the first up to 32 tokens) run alone
    grad_rel_error: float | None = None
    grad_rel_errors: dict[str, float] | None = None
    skipped: str | None = None
    vs_best_peer: float | None = None  # best peer time / this time: > 1 means faster than Transformers
    auto_pick: bool = False  # the backend selector's "auto" picks for this cell
    picked: str | None = None  # for the "auto" row: the backend it ran
    spread: float | None = None  # (max - min) / median over the interleaved rounds
    rounds: int | None = None

    @property
    def ratio(self) -> float | None:
        return self.time_s / self.floor_s if self.time_s and self.floor_s else None


@dataclass
class BenchResult:
    device: str
    ceilings: dict[str, float]
    command: str
    cells: list[Cell] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    # a result that merges several runs (`selector bench --merge / --resume`): each run's command and ceilings, in
    # order; empty for a single run (command and ceilings above are then its own)
    runs: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = {
            "schema": SCHEMA,
            "device": self.device,
            "ceilings": self.ceilings,
            "command": self.command,
            "cells": [{**asdict(c), "time_over_floor": c.ratio} for c in self.cells],
            "environment": self.environment,
            "choice_quality": choice_quality(self.cells),
        }
        if self.runs:
            data["runs"] = self.runs
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchResult:
        """A result as `to_dict` wrote it (keys a newer writer added are ignored); ValueError when it is not one."""
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            found = data.get("schema") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not a {SCHEMA} result (schema {found!r})")
        names = {f.name for f in fields(Cell)}
        cells = [Cell(**{k: v for k, v in c.items() if k in names}) for c in data.get("cells", [])]
        return cls(
            device=data["device"],
            ceilings=dict(data["ceilings"]),
            command=data.get("command", ""),
            cells=cells,
            environment=dict(data.get("environment") or {}),
            runs=list(data.get("runs") or []),
        )

    def merged_into(self, older: BenchResult) -> BenchResult:
        """This run's rows (shape, T, dtype, mode, format) in place of the same rows of `older`, whose other rows
        stay: each row's backends still come from one run, timed together."""
        mine = {row_of(c) for c in self.cells}
        cells = [c for c in older.cells if row_of(c) not in mine] + list(self.cells)
        runs = (older.runs or [{"command": older.command, "ceilings": older.ceilings}]) + [
            {"command": self.command, "ceilings": self.ceilings}
        ]
        return BenchResult(
            device=self.device,
            ceilings=self.ceilings,
            command=self.command,
            cells=cells,
            environment=self.environment,
            runs=runs,
        )


def row_of(cell: Cell) -> tuple[str, int, str, str, str]:
    """The row of the table a cell belongs to: its backends are timed together in one run."""
    return cell.shape, cell.tokens, cell.dtype, cell.mode, cell.format


def measured_rows(result: BenchResult, dtype: str, modes: Iterable[str]) -> set[tuple[str, str, int]]:
    """(shape, format, tokens) that `result` holds a row for in each of `modes` (a skipped row counts: graph mode
    above its token limit is recorded as skipped), in `dtype`: what a resumed run need not measure again."""
    have = {row_of(c) for c in result.cells}
    wanted = tuple(modes)
    return {
        (c.shape, c.format, c.tokens)
        for c in result.cells
        if c.dtype == dtype and all((c.shape, c.tokens, dtype, m, c.format) in have for m in wanted)
    }


def choice_quality(cells: list[Cell], within: float = WITHIN, worst: int = 10) -> dict[str, Any]:
    """How close `auto`'s choice came to the fastest selector backend timed in the same interleaved run, per
    (shape, T, mode, format): the picked backend's time / the fastest's (`ratio`: the choice), and the `auto` row's
    own time / the fastest's (`auto_ratio`: the choice plus the dispatch path, e.g. its own graph replay at small T),
    which was fastest, the larger of the two spreads; the share of cells whose choice is within `within`, and the
    `worst` cells (ratio above 1 + within), slowest first."""
    auto: dict[tuple[str, int, str, str, str], Cell] = {}
    backends: dict[tuple[str, int, str, str, str], dict[str, Cell]] = {}
    for c in cells:
        if not c.time_s:
            continue
        key = (c.shape, c.tokens, c.mode, c.format, c.dtype)
        if c.backend == "auto":
            auto[key] = c
        elif not c.backend.startswith(PEER_PREFIX):
            backends.setdefault(key, {})[c.backend] = c
    rows = []
    for key, a in auto.items():
        timed = backends.get(key)
        if not timed or not a.time_s:
            continue
        best = min(timed.values(), key=lambda c: c.time_s or 0.0)
        pick = timed.get(a.picked or "")
        pick_s = pick.time_s if pick is not None else a.time_s
        rows.append(
            {
                "shape": key[0],
                "tokens": key[1],
                "mode": key[2],
                "format": key[3],
                "dtype": key[4],
                "picked": a.picked,
                "pick_s": pick_s,
                "auto_s": a.time_s,
                "fastest": best.backend,
                "fastest_s": best.time_s,
                "ratio": pick_s / best.time_s,
                "auto_ratio": a.time_s / best.time_s,
                "spread": max(pick.spread or 0.0 if pick else 0.0, best.spread or 0.0),
            }
        )
    close = sum(1 for r in rows if r["ratio"] <= 1 + within)
    auto_close = sum(1 for r in rows if r["auto_ratio"] <= 1 + within)
    slow = sorted((r for r in rows if r["ratio"] > 1 + within), key=lambda r: -r["ratio"])
    return {
        "within": within,
        "cells": len(rows),
        "within_count": close,
        "share_within": close / len(rows) if rows else None,
        "auto_share_within": auto_close / len(rows) if rows else None,
        "worst": slow[:worst],
        "rows": rows,
    }
