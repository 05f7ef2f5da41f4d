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
# Not needed by the fused MoE, but where installed FlashInfer's package __init__ imports its CuTe-DSL kernels,
# which 0.6.13 writes for this version or newer (older: AttributeError at import, seen with 4.4.2)
CUTLASS_DSL, CUTLASS_DSL_MIN = "nvidia-cutlass-dsl", "4.5.0"
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
    dsl = env.package(CUTLASS_DSL) or probe_packages((CUTLASS_DSL,))[0]
    if dsl.version is not None and version_tuple(dsl.version) < version_tuple(CUTLASS_DSL_MIN):
        return Availability(
            Status.PACKAGE_TOO_OLD,
            f"{DISTRIBUTION} imports CuTe-DSL kernels that need {CUTLASS_DSL} >= {CUTLASS_DSL_MIN} where it is "
            f"installed; {dsl.version} is (it fails at import)",
            f"pip install -U '{CUTLASS_DSL}>={CUTLASS_DSL_MIN}', or run FlashInfer in an environment without "
            f"{CUTLASS_DSL} (SonicMoE pins an older one)",
            found=f"{CUTLASS_DSL} {dsl.version} ({dsl.source})",
        )
    return None
