"""What the `flashinfer_cutlass` declaration and its forward share: package verdicts and the JIT record.

No torch: `selector doctor` reads this without loading FlashInfer.
"""

from __future__ import annotations

from selector.probes import Environment, probe_packages

from selector import Availability, Status
from selector.requirements import version_tuple

DISTRIBUTION = "flashinfer-python"
MIN_VERSION = "0.6.13"  # the release measured here (`flashinfer.fused_moe.cutlass_fused_moe`)
OFFLINE_DOC = "docs/offline-kernels.md#flashinfer-cutlass-fused-moe"
# what FlashInfer's JIT build and its TVM-FFI binding need beside it (read from its METADATA and imports)
COMPANIONS = {"apache-tvm-ffi": "0.1.6", "ninja": ""}
INSTALL = f"pip install '{DISTRIBUTION}>={MIN_VERSION}' (offline nodes: {OFFLINE_DOC})"

_BUILT: set[str] = set()  # architectures whose fused-MoE module this process has built or loaded


def record_built(arch: str) -> None:
    _BUILT.add(arch)


def is_built(arch: str) -> bool:
    return arch in _BUILT


def forget_built() -> None:
    _BUILT.clear()


def package_verdict(env: Environment) -> Availability | None:
    """None when flashinfer-python and its companions are installed (SELECTOR_PACKAGE_<NAME> overrides)."""
    wanted = {DISTRIBUTION: MIN_VERSION, **COMPANIONS}
    for name, minimum in wanted.items():
        facts = env.package(name) or probe_packages((name,))[0]
        why = "FlashInfer's fused MoE" if name == DISTRIBUTION else "FlashInfer's JIT build and kernel binding"
        need = f"{name} >= {minimum}" if minimum else name
        if facts.version is None:
            return Availability(
                Status.MISSING_PACKAGE,
                f"needs the Python package {name!r}{' >= ' + minimum if minimum else ''} ({why}), which is not "
                "installed",
                f"pip install '{need.replace(' ', '')}' (offline nodes: {OFFLINE_DOC})",
                found=f"{name}: not found ({facts.source})",
            )
        if minimum and version_tuple(facts.version) < version_tuple(minimum):
            return Availability(
                Status.PACKAGE_TOO_OLD,
                f"needs {need}; {facts.version} is installed",
                f"pip install -U '{name}>={minimum}' (offline nodes: {OFFLINE_DOC})",
                found=f"{name} {facts.version} ({facts.source})",
            )
    return None
