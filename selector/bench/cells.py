"""What `selector bench` measures: one cell per (shape, tokens, dtype, weight format, backend, mode), and a run."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
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
SCHEMA = "selector.bench/1"


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
    skipped: str | None = None
    vs_best_peer: float | None = None  # best peer time / this time: > 1 means faster than Transformers
    auto_pick: bool = False  # the backend selector's "auto" picks for this cell
    picked: str | None = None  # for the "auto" row: the backend it ran

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

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "device": self.device,
            "ceilings": self.ceilings,
            "command": self.command,
            "cells": [{**asdict(c), "time_over_floor": c.ratio} for c in self.cells],
            "environment": self.environment,
        }
