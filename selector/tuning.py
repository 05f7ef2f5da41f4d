"""Measured times: the record format every producer and keeper of timings shares, and the lookup `auto` trusts
over estimates.

Pure: it is handed its records and reads no file, socket or environment variable (`selector.tuning_store`
keeps them on disk, the node daemon shares them, `selector tune` and `selector bench` make them).

A record is one flat JSON object, schema `selector.tuning/2`:
- `fingerprint`: `tuning_fingerprint(...)` of the environment it was measured in; a lookup trusts only
  records of the current fingerprint, the others are stale (counted and reported, never used);
- `gpu`: the name of the GPU it ran on (a node may mix GPUs);
- `problem`: `problem_key(problem)`, the layer without its token count (shape, dtype, weight and scale format,
  layout, activation);
- `mode`: "eager" (plain calls back to back) or "graph" (replays of a captured CUDA graph);
- `tokens`: the token count measured (a bucket a model meets);
- `backend`, `time_s` (median over interleaved rounds);
- optional: `spread` (relative: (max - min) / median over the rounds), `rounds`, `first_call_s` (what the first
  call of the shape cost in the measuring process: JIT compiles, autotuning), `measured_at` (Unix time),
  `tool` (what made it).
A later record for the same key (`record_key`) replaces an earlier one; a record that does not validate is
skipped by the table and refused by the store and the daemon (`check_record` says why).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from selector.probes import Environment
from selector.types import Problem

SCHEMA = "selector.tuning/2"
MODES = ("eager", "graph")  # plain calls, or replays of a captured CUDA graph
REQUIRED: dict[str, type | tuple[type, ...]] = {
    "fingerprint": str,
    "gpu": str,
    "problem": str,
    "mode": str,
    "tokens": int,
    "backend": str,
    "time_s": (int, float),
}
OPTIONAL: dict[str, type | tuple[type, ...]] = {
    "spread": (int, float),
    "rounds": int,
    "first_call_s": (int, float),
    "measured_at": (int, float),
    "tool": str,
}
MAX_STRING = 512  # characters in any string field: keys, names, tool
MAX_TOKENS = 1 << 24
MAX_SECONDS = 3600.0

Record = Mapping[str, Any]


@dataclass(frozen=True)
class Measurement:
    """One backend's measured time for a problem at one token count, as the ranking uses it."""

    time_s: float
    spread: float = 0.0  # relative spread over the rounds it was timed in
    first_call_s: float = 0.0  # cost of the first call of the shape in a fresh process (JIT, autotuning)
    tokens: int = 0  # the token count it was measured at (the nearest one to the lookup's)


def problem_key(problem: Problem) -> str:
    """The layer as a tuning key: everything a backend's time depends on except the token count and how it is
    called (mode). Stable text, e.g. `E128-H2048-I768-k8/bfloat16/dense/silu/gated`; a gate other than act_mul
    takes the activation's place with its parameters (`clamped_swiglu(alpha=1.702,limit=7)`), so act_mul layers
    keep the keys they always had."""
    layout = [name for name in ("has_bias", "is_transposed", "interleaved", "custom_gate", "post_expert_norm",
                                "expert_parallel") if getattr(problem, name)]  # fmt: skip
    fmt = problem.weight_format if problem.scale_format is None else f"{problem.weight_format}:{problem.scale_format}"
    if problem.weight_format != "dense":
        fmt += f":{problem.activation_quant}"
    return "/".join([
        f"E{problem.num_experts}-H{problem.hidden_size}-I{problem.intermediate_size}-k{problem.top_k}",
        problem.dtype,
        fmt,
        problem.activation if problem.gate.is_default else problem.gate.label(),
        "+".join(["gated" if problem.gated else "plain", *layout]),
    ])


def mode_of(problem: Problem) -> str:
    return "graph" if problem.cuda_graph else "eager"


def tuning_fingerprint(env: Environment, versions: Mapping[str, str]) -> str:
    """What measured times depend on, hashed: the environment's fingerprint facts (GPU names and compute
    capabilities, driver, CUDA toolkit, package versions), each GPU's memory, and `versions` (selector's and
    each backend plugin's distribution version)."""
    facts = {
        "environment": env.fingerprint_facts(),
        "gpu_memory": [d.memory_total_bytes for d in env.gpu.devices],
        "versions": dict(sorted(versions.items())),
    }
    canonical = json.dumps(facts, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def record_key(r: Record) -> tuple[Any, ...]:
    """What makes two records the same measurement (a later one replaces an earlier one)."""
    return (r["fingerprint"], r["gpu"], r["problem"], r["mode"], int(r["tokens"]), r["backend"])


def check_record(r: object) -> str | None:
    """Why `r` is not a usable record (None when it is): a mapping with every required field of its type,
    bounded strings, a mode of MODES, a positive token count and a finite positive time."""
    if not isinstance(r, Mapping):
        return f"a record is a JSON object, got {type(r).__name__}"
    for fields, required in ((REQUIRED, True), (OPTIONAL, False)):
        for name, kind in fields.items():
            if name not in r:
                if required:
                    return f"missing field {name!r}"
                continue
            value = r[name]
            if isinstance(value, bool) or not isinstance(value, kind):
                return f"field {name!r} is {type(value).__name__}, not {getattr(kind, '__name__', 'a number')}"
            if isinstance(value, str) and (len(value) > MAX_STRING or not value):
                return f"field {name!r} is empty or longer than {MAX_STRING} characters"
            if isinstance(value, float) and not math.isfinite(value):
                return f"field {name!r} is not finite"
    if r["mode"] not in MODES:
        return f"mode {r['mode']!r} is not one of {', '.join(MODES)}"
    if not 1 <= r["tokens"] <= MAX_TOKENS:
        return f"tokens {r['tokens']} outside 1..{MAX_TOKENS}"
    if not 0 < r["time_s"] <= MAX_SECONDS:
        return f"time_s {r['time_s']} outside (0, {MAX_SECONDS:g}]"
    if not 0 <= r.get("spread", 0) < 100 or not 0 <= r.get("first_call_s", 0) <= 24 * MAX_SECONDS:
        return "spread or first_call_s out of range"
    return None


def is_valid_record(r: object) -> bool:
    return check_record(r) is None


def clean_record(r: Record) -> dict[str, Any]:
    """A validated record with only the known fields (ValueError naming the fault otherwise)."""
    reason = check_record(r)
    if reason is not None:
        raise ValueError(f"tuning record refused: {reason}")
    return {name: r[name] for name in (*REQUIRED, *OPTIONAL) if name in r}


def _nearest(tokens: Iterable[int], target: int) -> int:
    goal = math.log2(max(target, 1))
    return min(tokens, key=lambda t: (abs(math.log2(max(t, 1)) - goal), t))


class TuningTable:
    """Records of one fingerprint indexed for lookup: {(gpu, problem key, mode): {tokens: {backend: Measurement}}}.

    Records of another fingerprint are counted as stale and kept out of every lookup.
    """

    def __init__(self, fingerprint: str) -> None:
        self.fingerprint = fingerprint
        self.stale = 0  # records of another environment: reported, never trusted
        self.invalid = 0
        self._times: dict[tuple[str, str, str], dict[int, dict[str, Measurement]]] = {}

    @classmethod
    def from_records(cls, records: Iterable[Record], fingerprint: str) -> TuningTable:
        """A table of `records` measured under `fingerprint`, later ones overriding earlier ones."""
        table = cls(fingerprint)
        for r in records:
            if not is_valid_record(r):
                table.invalid += 1
            elif r["fingerprint"] != fingerprint:
                table.stale += 1
            else:
                by_tokens = table._times.setdefault((r["gpu"], r["problem"], r["mode"]), {})
                by_tokens.setdefault(int(r["tokens"]), {})[r["backend"]] = Measurement(
                    float(r["time_s"]), float(r.get("spread", 0.0)), float(r.get("first_call_s", 0.0)), int(r["tokens"])
                )
        return table

    def __len__(self) -> int:
        return sum(len(by_backend) for by_tokens in self._times.values() for by_backend in by_tokens.values())

    def token_counts(self, gpu: str, problem: Problem) -> list[int]:
        """The token counts measured for `problem` in its mode on `gpu`, ascending."""
        return sorted(self._times.get((gpu, problem_key(problem), mode_of(problem)), {}))

    def lookup(self, gpu: str, problem: Problem) -> dict[str, Measurement] | None:
        """{backend: Measurement} for `problem` in its mode on `gpu` at the measured token count nearest to its
        own (in log scale; an unknown count reads as 512), or None when nothing was measured for it."""
        by_tokens = self._times.get((gpu, problem_key(problem), mode_of(problem)))
        if not by_tokens:
            return None
        return dict(by_tokens[_nearest(by_tokens, problem.num_tokens or 512)])


CPU = "cpu"  # the `gpu` field of records measured on the host's CPU


def gpu_of(problem: Problem, env: Environment) -> str | None:
    """The name of the GPU `problem` runs on ("cpu" for a CPU layer), None for an index the probe did not see."""
    if problem.device == "cpu":
        return CPU
    devices = env.gpu.devices
    if problem.device != "cuda" or not 0 <= problem.device_index < len(devices):
        return None
    return devices[problem.device_index].name


def measured_for(problem: Problem, env: Environment, table: TuningTable) -> dict[str, Measurement] | None:
    """{backend: Measurement} measured for `problem` on its device, if any."""
    gpu = gpu_of(problem, env)
    return None if gpu is None else table.lookup(gpu, problem)
