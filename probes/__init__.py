"""Fast, side-effect-free probes of the machine: GPUs, CUDA toolkit, packages.

Probes never import torch, never initialise CUDA and never raise: whatever
goes wrong is reported in a fact's `problem`. See OVERRIDE_VARIABLES for the
environment variables that replace what a probe would find.
"""

from .environment import collect_environment, platform_tag
from .facts import (
    Environment,
    GpuDevice,
    GpuFacts,
    PackageFacts,
    ToolkitFacts,
    normalize_package_name,
)
from .gpu import probe_gpus
from .overrides import OVERRIDE_VARIABLES, package_variable
from .packages import DEFAULT_PACKAGES, probe_packages
from .toolkit import probe_toolkit

__all__ = [
    "DEFAULT_PACKAGES",
    "Environment",
    "GpuDevice",
    "GpuFacts",
    "OVERRIDE_VARIABLES",
    "PackageFacts",
    "ToolkitFacts",
    "collect_environment",
    "normalize_package_name",
    "package_variable",
    "platform_tag",
    "probe_gpus",
    "probe_packages",
    "probe_toolkit",
]
