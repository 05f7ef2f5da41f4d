"""Everything the selector needs to know about this machine, in one record."""

from __future__ import annotations

import os
import platform as _platform
import sys
from typing import Mapping, Sequence

from .facts import Environment
from .gpu import probe_gpus
from .packages import DEFAULT_PACKAGES, probe_packages
from .toolkit import probe_toolkit


def collect_environment(
    environ: Mapping[str, str] | None = None,
    packages: Sequence[str] = DEFAULT_PACKAGES,
) -> Environment:
    """Probe GPUs, the CUDA toolkit and the given packages; never raises."""
    env = os.environ if environ is None else environ
    return Environment(
        gpu=probe_gpus(env),
        toolkit=probe_toolkit(env),
        packages=probe_packages(packages, env),
        python=_platform.python_version(),
        platform=platform_tag(),
    )


def platform_tag() -> str:
    """"linux-x86_64", "darwin-arm64", "win32-amd64"."""
    machine = _platform.machine().lower() or "unknown"
    return f"{sys.platform}-{machine}"
