"""What the `liger` declaration and its forward share: the package verdict and the shapes autotuned here.

No torch: `selector doctor` reads this without loading the kernel.
"""

from __future__ import annotations

from selector.probes import Environment, probe_packages

from selector import Availability, Status
from selector.requirements import version_tuple

DISTRIBUTION = "liger-kernel"
MIN_VERSION = "0.8.5"  # the first release measured here with `ops.fused_moe`
OFFLINE_DOC = "docs/offline-kernels.md#liger-kernel"
INSTALL = f"pip install '{DISTRIBUTION}>={MIN_VERSION}' (offline nodes: {OFFLINE_DOC})"

_TUNED: set[tuple[int, int]] = set()


def shape_key(hidden: int, inter: int) -> tuple[int, int]:
    """Liger's autotuner keys its GEMM configs on (H, I)."""
    return (int(hidden), int(inter))


def record_tuned(key: tuple[int, int]) -> None:
    _TUNED.add(key)


def is_tuned(key: tuple[int, int]) -> bool:
    return key in _TUNED


def forget_tuned() -> None:
    _TUNED.clear()


def package_verdict(env: Environment) -> Availability | None:
    """None when liger-kernel >= MIN_VERSION is installed (SELECTOR_PACKAGE_LIGER_KERNEL overrides the probe)."""
    facts = env.package(DISTRIBUTION) or probe_packages((DISTRIBUTION,))[0]
    if facts.version is None:
        return Availability(
            Status.MISSING_PACKAGE,
            f"needs the Python package {DISTRIBUTION!r} >= {MIN_VERSION} (its fused MoE kernels), which is not "
            "installed",
            INSTALL,
            found=f"{DISTRIBUTION}: not found ({facts.source})",
        )
    if version_tuple(facts.version) < version_tuple(MIN_VERSION):
        return Availability(
            Status.PACKAGE_TOO_OLD,
            f"needs {DISTRIBUTION} >= {MIN_VERSION} (liger_kernel.ops.fused_moe); {facts.version} is installed",
            f"pip install -U '{DISTRIBUTION}>={MIN_VERSION}' (offline nodes: {OFFLINE_DOC})",
            found=f"{DISTRIBUTION} {facts.version} ({facts.source})",
        )
    return None
