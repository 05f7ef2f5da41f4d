"""Environment variables that replace what the probes would find.

They let a CPU-only machine (CI, a laptop) pretend to be a GPU host, and let a
user correct a probe that got something wrong. A variable that is set but
empty means "absent" (no GPU, no toolkit, not installed), not "unset".
"""

from __future__ import annotations

import re
from typing import Mapping

OVERRIDE_VARIABLES: dict[str, str] = {
    "SELECTOR_GPUS": (
        'GPUs to assume instead of asking NVML: "" for none, or comma-separated '
        'NAME:MAJOR.MINOR[:MEMORY_GIB], e.g. "NVIDIA H200:9.0:141"'
    ),
    "SELECTOR_DRIVER_VERSION": 'NVIDIA driver version to assume, e.g. "580.95.05" ("" = none)',
    "SELECTOR_DRIVER_CUDA_VERSION": (
        'highest CUDA version the driver supports, e.g. "13.0" ("" = unknown)'
    ),
    "SELECTOR_CUDA_TOOLKIT": 'CUDA toolkit root to inspect instead of searching ("" = no toolkit)',
    "SELECTOR_NVCC_VERSION": (
        'nvcc version to assume instead of running nvcc, e.g. "12.4" ("" = no nvcc)'
    ),
    "SELECTOR_PACKAGE_<NAME>": (
        "version to assume for a Python distribution; NAME upper-cased with '-' and '.' "
        'as \'_\', e.g. SELECTOR_PACKAGE_NVIDIA_CUTLASS_DSL=4.4.2 ("" = not installed)'
    ),
    "SELECTOR_TORCH_CUDA": 'CUDA version torch was built for, e.g. "13.0" ("" = CPU build)',
}

_MAJOR_MINOR = re.compile(r"(\d+)\.(\d+)")
_DRIVER_VERSION = re.compile(r"\d+(\.\d+)*")
# Loose PEP 440 shape: starts with a digit (optionally an epoch), no spaces.
_PACKAGE_VERSION = re.compile(r"(\d+!)?\d[0-9A-Za-z.+_-]*")


def overridden_source(variable: str) -> str:
    return f"{variable} (overridden)"


def read_override(environ: Mapping[str, str], variable: str) -> str | None:
    """The override's value with spaces trimmed, or None when it is not set."""
    value = environ.get(variable)
    return None if value is None else value.strip()


def package_variable(name: str) -> str:
    """SELECTOR_PACKAGE_<NAME> for a distribution name ("nvidia-cutlass-dsl")."""
    return "SELECTOR_PACKAGE_" + re.sub(r"[-.]", "_", name).upper()


def parse_major_minor(text: str) -> tuple[int, int] | None:
    """"12.4" -> (12, 4); anything else -> None."""
    match = _MAJOR_MINOR.fullmatch(text.strip())
    return None if match is None else (int(match.group(1)), int(match.group(2)))


def is_driver_version(text: str) -> bool:
    return _DRIVER_VERSION.fullmatch(text) is not None


def is_package_version(text: str) -> bool:
    return _PACKAGE_VERSION.fullmatch(text) is not None
