"""Measured times: the record format every producer and keeper of timings shares, and the lookup `auto` trusts
over estimates.

Pure: it is handed its records and reads no file, socket or environment variable (`selector.tuning_store`
keeps them on disk, the node daemon shares them, `selector tune` and `selector bench` make them).

A record is one flat JSON object, schema `selector.tuning/2`:
- `fingerprint`: `backend_fingerprint(...)` of what its backend's speed depends on where it was measured (the
  GPUs, driver, CUDA, torch, Triton, the backend's own distribution and the packages it declares); a lookup
  trusts a record only under its backend's current fingerprint (`Fingerprints`), the others are stale (counted
  and reported, never used). So installing or upgrading one plugin stales that plugin's records only. Records of
  the older format carry `legacy_fingerprint(...)`, one hash of the whole environment and every plugin's version:
  they are trusted only when it equals this process's (measured here, with these very plugins), else stale;
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
skipped by the table and refused by the store and the daemon (`check_record` says why). `TuningRecord` is one
record as a typed value, validated when made (docs/plugins.md shows a plugin writing its own); keys outside the
format are dropped by the store (`unknown_keys` names them, `selector store import` warns of each).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from selector.probes import Environment, normalize_package_name
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
    return "graph" if problem.call.cuda_graph else "eager"


def _hash(facts: Mapping[str, Any]) -> str:
    canonical = json.dumps(facts, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()[:32]


def legacy_fingerprint(env: Environment, versions: Mapping[str, str]) -> str:
    """The older single fingerprint of every record, kept to recognise records of that format: the environment's
    fingerprint facts (GPU names and compute capabilities, driver, CUDA toolkit, every probed package's version),
    each GPU's memory, and `versions` (selector's and every loaded plugin's distribution, `plugin_versions`)."""
    return _hash({
        "environment": env.fingerprint_facts(),
        "gpu_memory": [d.memory_total_bytes for d in env.gpu.devices],
        "versions": dict(sorted(versions.items())),
    })


COMMON_PACKAGES = ("torch", "triton")  # what every backend's speed depends on besides the machine


def backend_facts(env: Environment, distribution: str, packages: Iterable[str] = (),
                  installed: Mapping[str, str | None] | None = None) -> dict[str, Any]:
    """What one backend's measured times depend on: the GPUs (name, compute capability, memory; each kind once,
    so the order and count of visible GPUs do not matter), the driver and the CUDA it supports, nvcc, torch
    (with its CUDA build) and Triton, `distribution` ("name version" of the backend's package: selector's for a
    built-in) and the versions of `packages` (what its `Requirements.packages` declares). A package the probes
    did not look at is read from `installed` (name -> version, None when not installed)."""
    gpus = {(d.name, tuple(d.compute_capability), d.memory_total_bytes) for d in env.gpu.devices}
    versions: dict[str, Any] = {}
    for name in sorted({normalize_package_name(p) for p in (*COMMON_PACKAGES, *packages)}):
        facts = env.package(name)
        if facts is not None:
            versions[name] = {"version": facts.version, "detail": dict(sorted(facts.detail.items()))}
        else:
            versions[name] = {"version": (installed or {}).get(name)}
    tk = env.toolkit
    return {
        "gpus": [{"name": n, "compute_capability": list(cc), "memory_total_bytes": m}
                 for n, cc, m in sorted(gpus, key=lambda g: (g[0], g[1], g[2] or 0))],
        "driver_version": env.gpu.driver_version,
        "driver_cuda_version": env.gpu.driver_cuda_version,
        "nvcc_version": None if tk.nvcc_version is None else list(tk.nvcc_version),
        "packages": versions,
        "distribution": distribution,
    }


def backend_fingerprint(facts: Mapping[str, Any]) -> str:
    """The fingerprint a record of a backend carries: `backend_facts(...)` hashed."""
    return _hash({"record_fingerprint": 1, **facts})  # the tag keeps it apart from any legacy fingerprint


@dataclass(frozen=True)
class Fingerprints:
    """The fingerprint a record of each backend must carry to be trusted here.

    `by_backend`: backend name -> its current fingerprint (a backend not listed, e.g. a plugin not installed or
    blocked here, has none: its records are neither used nor called stale). `legacy`: this process's
    fingerprint in the older whole-environment format; a record carrying it was measured here with these very
    plugins, so it is as good as a current one (and the store rewrites it to its backend's fingerprint).
    `default`: one fingerprint for every backend not listed (`uniform`: a fixed fingerprint, e.g. in tests).
    """

    by_backend: Mapping[str, str] = field(default_factory=dict)
    legacy: str | None = None
    default: str | None = None

    @classmethod
    def uniform(cls, fingerprint: str) -> Fingerprints:
        return cls(default=fingerprint)

    def of(self, backend: str) -> str | None:
        """The fingerprint a new record of `backend` carries here, None for a backend unknown here."""
        return self.by_backend.get(backend, self.default)

    def knows(self, backend: str) -> bool:
        return self.of(backend) is not None

    def trusts(self, backend: str, fingerprint: str) -> bool:
        """Whether a record of `backend` carrying `fingerprint` was measured under what its speed depends on now."""
        if not self.knows(backend):
            return False
        return fingerprint == self.of(backend) or (self.legacy is not None and fingerprint == self.legacy)

    def is_stale(self, backend: str, fingerprint: str) -> bool:
        """A record of a backend known here measured under other facts (never trusted, safe to delete)."""
        return self.knows(backend) and not self.trusts(backend, fingerprint)

    def accepted(self) -> list[str]:
        """Every fingerprint a trusted record may carry (what to ask a store or the daemon for), sorted."""
        found = {*self.by_backend.values(), self.legacy, self.default}
        return sorted(f for f in found if f is not None)

    def to_dict(self) -> dict[str, Any]:
        return {"by_backend": dict(sorted(self.by_backend.items())), "legacy": self.legacy, "default": self.default}


def fingerprints_of(env: Environment, origins: Mapping[str, tuple[str, Sequence[str]]], versions: Mapping[str, str],
                    installed: Mapping[str, str | None] | None = None) -> Fingerprints:
    """Each backend's current fingerprint in `env`, and the legacy one. `origins`: backend name -> (its
    distribution, "name version": selector's own for a built-in; the packages its requirements declare);
    `versions`: selector's and every loaded plugin's distribution (`plugin_versions`, for the legacy one);
    `installed`: versions of declared packages the probes did not look at."""
    by_backend = {name: backend_fingerprint(backend_facts(env, distribution, packages, installed))
                  for name, (distribution, packages) in origins.items()}
    return Fingerprints(by_backend, legacy=legacy_fingerprint(env, versions))


def as_fingerprints(fingerprints: Fingerprints | str) -> Fingerprints:
    """`fingerprints` as a Fingerprints (a plain string: one fingerprint for every backend)."""
    return fingerprints if isinstance(fingerprints, Fingerprints) else Fingerprints.uniform(fingerprints)


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


def unknown_keys(r: Mapping[str, Any]) -> list[str]:
    """The keys of `r` that are no field of the record format (a misspelt `time_ms`, say), sorted: the store keeps
    only the known fields, so these would be lost."""
    return sorted(str(k) for k in r if k not in REQUIRED and k not in OPTIONAL)


@dataclass(frozen=True, kw_only=True)
class TuningRecord:
    """One measured time in the record format (schema `selector.tuning/2`) that `selector bench`, `selector tune`,
    the node daemon and `selector store export|import` share, validated when it is made (ValueError naming the
    fault). A plugin that measures its own kernel builds one with `for_problem` and hands `to_dict()` to the
    store (`selector.tuning_store.save_records`) or to an export file (`selector.tuning_store.write_export`).

    `fingerprint`: its backend's current fingerprint here (`selector.tuning_store.current_fingerprints().of(name)`);
    `gpu`: the GPU's name, "cpu" on the host (`gpu_of`); `problem`: `problem_key(problem)`; `mode`: "eager" or
    "graph" (CUDA-graph replays); `tokens`: the token count measured; `time_s`: the median seconds per call;
    `spread`: (max - min) / median over the rounds; `rounds`; `first_call_s`: the first call's seconds in a fresh
    process (JIT, autotuning); `measured_at`: Unix time; `tool`: what measured it.
    """

    fingerprint: str
    gpu: str
    problem: str
    mode: str
    tokens: int
    backend: str
    time_s: float
    spread: float | None = None
    rounds: int | None = None
    first_call_s: float | None = None
    measured_at: float | None = None
    tool: str | None = None

    def __post_init__(self) -> None:
        reason = check_record(self.to_dict())
        if reason is not None:
            raise ValueError(f"tuning record refused: {reason}")

    def to_dict(self) -> dict[str, Any]:
        """The record as the store, the daemon and export files keep it (optional fields only where set)."""
        return {name: getattr(self, name) for name in (*REQUIRED, *OPTIONAL) if getattr(self, name) is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TuningRecord:
        """A record read back (an export file's, a store's); ValueError naming an unknown key or the fault."""
        unknown = unknown_keys(data)
        if unknown:
            raise ValueError(f"tuning record refused: unknown key{'s' * (len(unknown) > 1)} "
                             f"{', '.join(map(repr, unknown))} "
                             f"(known: {', '.join((*REQUIRED, *OPTIONAL))})")
        missing = [name for name in REQUIRED if name not in data]
        if missing:
            raise ValueError(f"tuning record refused: missing field {missing[0]!r}")
        return cls(**data)

    @classmethod
    def for_problem(
        cls,
        problem: Problem,
        *,
        backend: str,
        tokens: int,
        time_s: float,
        fingerprint: str,
        gpu: str,
        **optional: Any,
    ) -> TuningRecord:
        """The record of `backend`'s time for `problem` at `tokens` tokens: its key and mode read off the problem
        (`problem_key`, `mode_of`); `optional`: spread, rounds, first_call_s, measured_at, tool."""
        return cls(fingerprint=fingerprint, gpu=gpu, problem=problem_key(problem), mode=mode_of(problem),
                   tokens=tokens, backend=backend, time_s=time_s, **optional)


def _nearest(tokens: Iterable[int], target: int) -> int:
    goal = math.log2(max(target, 1))
    return min(tokens, key=lambda t: (abs(math.log2(max(t, 1)) - goal), t))


class TuningTable:
    """Trusted records indexed for lookup: {(gpu, problem key, mode): {tokens: {backend: Measurement}}}.

    A record is trusted under its backend's current fingerprint (`Fingerprints.trusts`); the others are counted
    (stale: its backend's facts changed; `unknown`: its backend is not loaded here) and kept out of every lookup.
    """

    def __init__(self, fingerprints: Fingerprints | str) -> None:
        self.fingerprints = as_fingerprints(fingerprints)
        self.stale = 0  # records measured under other facts than their backend's now: reported, never trusted
        self.stale_by_backend: dict[str, int] = {}
        self.unknown = 0  # records of backends not loaded here
        self.legacy = 0  # trusted records of the older whole-environment format (proven current)
        self.invalid = 0
        self._times: dict[tuple[str, str, str], dict[int, dict[str, Measurement]]] = {}

    @classmethod
    def from_records(cls, records: Iterable[Record], fingerprints: Fingerprints | str) -> TuningTable:
        """A table of the trusted ones of `records` (a plain string: one fingerprint for every backend), later
        ones overriding earlier ones."""
        table = cls(fingerprints)
        fps = table.fingerprints
        for r in records:
            if not is_valid_record(r):
                table.invalid += 1
            elif not fps.knows(r["backend"]):
                table.unknown += 1
            elif not fps.trusts(r["backend"], r["fingerprint"]):
                table.stale += 1
                table.stale_by_backend[r["backend"]] = table.stale_by_backend.get(r["backend"], 0) + 1
            else:
                table.legacy += r["fingerprint"] != fps.of(r["backend"])
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
