"""Rough time estimates that order the runnable backends when nothing better is known.

Each estimate is built from the layer's physical floor (bytes over bandwidth, FLOPs over peak) times an
efficiency a backend reaches, plus a fixed host/launch cost. The numbers come from the measurements in
benchmarks/ (see perf notes); measured tuning results, when present, replace them.
"""

from __future__ import annotations

from dataclasses import dataclass

from selector.probes import Environment
from selector.types import Problem

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_WEIGHT_BYTES = {"dense": None, "fp8_block": 1.0, "fp4": 0.5}
TYPICAL_TOKENS = 512  # what "unknown token count" is ranked as


@dataclass(frozen=True)
class Ceilings:
    bandwidth: float  # bytes/s, device copy (read + write)
    peak: float  # FLOP/s for the layer's dtype


# Measured on an H200 (see benchmarks/README.md); other GPUs scale from the datasheet class.
_GPU_CEILINGS = {
    "H200": Ceilings(4.25e12, 782e12),
    "H100": Ceilings(3.0e12, 700e12),
    "A100": Ceilings(1.6e12, 280e12),
}
_CPU = Ceilings(20e9, 0.5e12)


def ceilings(problem: Problem, env: Environment) -> Ceilings:
    if problem.device != "cuda":
        return _CPU
    devices = env.gpu.devices
    name = devices[problem.device_index].name if problem.device_index < len(devices) else ""
    for key, value in _GPU_CEILINGS.items():
        if key in name:
            base = value
            break
    else:
        base = Ceilings(2.0e12, 300e12)
    if problem.dtype == "float32":
        return Ceilings(base.bandwidth, base.peak / 8)  # tf32 at best
    return base


def tokens(problem: Problem) -> int:
    return TYPICAL_TOKENS if problem.num_tokens is None else problem.num_tokens


def experts_hit(problem: Problem) -> float:
    """Expected distinct experts hit by T tokens with uniform top-k routing."""
    pairs = tokens(problem) * problem.top_k
    e = problem.num_experts
    return e * (1.0 - (1.0 - 1.0 / e) ** pairs) if e else 0.0


def weight_bytes_per_expert(problem: Problem) -> float:
    per = _WEIGHT_BYTES.get(problem.weight_format) or _BYTES.get(problem.dtype, 2)
    factor = 3 if problem.gated else 2
    return factor * problem.hidden_size * problem.intermediate_size * per


def flops(problem: Problem) -> float:
    factor = 3 if problem.gated else 2
    return 2.0 * tokens(problem) * problem.top_k * factor * problem.hidden_size * problem.intermediate_size


def floor_seconds(problem: Problem, env: Environment) -> float:
    """max(bytes / bandwidth, FLOPs / peak), the time no backend beats."""
    c = ceilings(problem, env)
    act = _BYTES.get(problem.dtype, 2)
    moved = experts_hit(problem) * weight_bytes_per_expert(problem) + 2 * tokens(problem) * problem.hidden_size * act
    return max(moved / c.bandwidth, flops(problem) / c.peak)
