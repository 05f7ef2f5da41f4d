"""Plain, frozen records of what the probes found.

Facts are values: they can be compared, written to JSON with ``to_dict`` and
read back with ``from_dict`` without loss, so a cached tuning result can be
tied to the machine it was measured on.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

# Bumped when the layout written by Environment.to_dict changes incompatibly.
SCHEMA_VERSION = 1


def normalize_package_name(name: str) -> str:
    """PEP 503 form, so "PyYAML", "pyyaml" and "Py_YAML" name one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _pair(value: Any) -> tuple[int, int]:
    major, minor = value
    return int(major), int(minor)


def _optional_pair(value: Any) -> tuple[int, int] | None:
    return None if value is None else _pair(value)


@dataclass(frozen=True)
class GpuDevice:
    index: int  # CUDA index as the process sees it (after CUDA_VISIBLE_DEVICES)
    name: str
    compute_capability: tuple[int, int]
    memory_total_bytes: int | None = None
    memory_free_bytes: int | None = None
    uuid: str | None = None
    nvml_index: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "name": self.name,
            "compute_capability": list(self.compute_capability),
            "memory_total_bytes": self.memory_total_bytes,
            "memory_free_bytes": self.memory_free_bytes,
            "uuid": self.uuid,
            "nvml_index": self.nvml_index,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "GpuDevice":
        return cls(
            index=int(data["index"]),
            name=str(data["name"]),
            compute_capability=_pair(data["compute_capability"]),
            memory_total_bytes=data.get("memory_total_bytes"),
            memory_free_bytes=data.get("memory_free_bytes"),
            uuid=data.get("uuid"),
            nvml_index=data.get("nvml_index"),
        )


@dataclass(frozen=True)
class GpuFacts:
    devices: tuple[GpuDevice, ...]
    driver_version: str | None
    driver_cuda_version: str | None  # highest CUDA the driver supports, "13.0"
    source: str
    overridden: bool = False
    # Why there are no devices, or a note on how they were numbered. Check
    # ``available`` (not ``problem``) to decide whether a GPU can be used.
    problem: str | None = None

    @property
    def available(self) -> bool:
        return bool(self.devices)

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": [device.to_dict() for device in self.devices],
            "driver_version": self.driver_version,
            "driver_cuda_version": self.driver_cuda_version,
            "source": self.source,
            "overridden": self.overridden,
            "problem": self.problem,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "GpuFacts":
        return cls(
            devices=tuple(GpuDevice.from_dict(d) for d in data.get("devices", ())),
            driver_version=data.get("driver_version"),
            driver_cuda_version=data.get("driver_cuda_version"),
            source=str(data["source"]),
            overridden=bool(data.get("overridden", False)),
            problem=data.get("problem"),
        )


@dataclass(frozen=True)
class ToolkitFacts:
    root: str | None
    found_by: str | None
    nvcc_path: str | None
    nvcc_version: tuple[int, int] | None
    runtime_only: bool  # a toolkit directory without bin/nvcc
    searched: tuple[str, ...]  # one line per search rule tried
    warnings: tuple[str, ...] = ()
    overridden: bool = False
    problem: str | None = None

    @property
    def usable_for_jit(self) -> bool:
        # A version is only recorded once nvcc answered (or was overridden).
        return self.nvcc_version is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "root": self.root,
            "found_by": self.found_by,
            "nvcc_path": self.nvcc_path,
            "nvcc_version": None if self.nvcc_version is None else list(self.nvcc_version),
            "runtime_only": self.runtime_only,
            "searched": list(self.searched),
            "warnings": list(self.warnings),
            "overridden": self.overridden,
            "problem": self.problem,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ToolkitFacts":
        return cls(
            root=data.get("root"),
            found_by=data.get("found_by"),
            nvcc_path=data.get("nvcc_path"),
            nvcc_version=_optional_pair(data.get("nvcc_version")),
            runtime_only=bool(data.get("runtime_only", False)),
            searched=tuple(str(s) for s in data.get("searched", ())),
            warnings=tuple(str(w) for w in data.get("warnings", ())),
            overridden=bool(data.get("overridden", False)),
            problem=data.get("problem"),
        )


@dataclass(frozen=True)
class PackageFacts:
    name: str  # distribution name as asked for, e.g. "nvidia-cutlass-dsl"
    version: str | None  # None = not installed
    source: str
    overridden: bool = False
    # torch: {"cuda": "13.0"}, or {"cuda": ""} for a CPU build.
    detail: dict[str, str] = field(default_factory=dict)
    problem: str | None = None  # e.g. a malformed override; not set for "not installed"

    @property
    def installed(self) -> bool:
        return self.version is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "version": self.version,
            "source": self.source,
            "overridden": self.overridden,
            "detail": dict(sorted(self.detail.items())),
            "problem": self.problem,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "PackageFacts":
        return cls(
            name=str(data["name"]),
            version=data.get("version"),
            source=str(data["source"]),
            overridden=bool(data.get("overridden", False)),
            detail={str(k): str(v) for k, v in dict(data.get("detail") or {}).items()},
            problem=data.get("problem"),
        )


@dataclass(frozen=True)
class Environment:
    gpu: GpuFacts
    toolkit: ToolkitFacts
    packages: tuple[PackageFacts, ...]
    python: str  # "3.11.7"
    platform: str  # "linux-x86_64"

    def package(self, name: str) -> PackageFacts | None:
        wanted = normalize_package_name(name)
        for facts in self.packages:
            if normalize_package_name(facts.name) == wanted:
                return facts
        return None

    def package_version(self, name: str) -> str | None:
        facts = self.package(name)
        return None if facts is None else facts.version

    def compute_capability(self, device_index: int = 0) -> tuple[int, int] | None:
        for device in self.gpu.devices:
            if device.index == device_index:
                return device.compute_capability
        return None

    @property
    def problems(self) -> tuple[str, ...]:
        """Every problem found, prefixed by where it was found (for reports)."""
        found = []
        if self.gpu.problem:
            found.append(f"gpu: {self.gpu.problem}")
        if self.toolkit.problem:
            found.append(f"toolkit: {self.toolkit.problem}")
        found.extend(f"package {p.name}: {p.problem}" for p in self.packages if p.problem)
        return tuple(found)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "gpu": self.gpu.to_dict(),
            "toolkit": self.toolkit.to_dict(),
            "packages": [p.to_dict() for p in self.packages],
            "python": self.python,
            "platform": self.platform,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "Environment":
        schema = data.get("schema_version", SCHEMA_VERSION)
        if schema != SCHEMA_VERSION:
            raise ValueError(f"environment schema_version {schema!r} is not {SCHEMA_VERSION}")
        return cls(
            gpu=GpuFacts.from_dict(data["gpu"]),
            toolkit=ToolkitFacts.from_dict(data["toolkit"]),
            packages=tuple(PackageFacts.from_dict(p) for p in data.get("packages", ())),
            python=str(data["python"]),
            platform=str(data["platform"]),
        )

    def fingerprint_facts(self) -> dict[str, Any]:
        """The facts a kernel choice or a tuning result depends on.

        Left out on purpose: free memory, UUIDs and NVML numbering (they differ
        between identical machines), sources and problems (how a fact was
        learnt does not change it).
        """
        return {
            "gpus": [
                {"name": d.name, "compute_capability": list(d.compute_capability)}
                for d in self.gpu.devices
            ],
            "driver_version": self.gpu.driver_version,
            "driver_cuda_version": self.gpu.driver_cuda_version,
            "nvcc_version": (
                None if self.toolkit.nvcc_version is None else list(self.toolkit.nvcc_version)
            ),
            "packages": {
                normalize_package_name(p.name): {
                    "version": p.version,
                    "detail": dict(sorted(p.detail.items())),
                }
                for p in sorted(self.packages, key=lambda p: normalize_package_name(p.name))
            },
        }

    def fingerprint(self) -> str:
        canonical = json.dumps(
            self.fingerprint_facts(), sort_keys=True, separators=(",", ":"), ensure_ascii=True
        )
        return hashlib.sha256(canonical.encode("utf-8")).hexdigest()
