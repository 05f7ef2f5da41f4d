"""What the `triton_kernels` declaration and its forward share: where the library is and the JIT record.

OpenAI's `triton_kernels` (the `matmul_ogs` path GPT-OSS runs) has no PyPI distribution of its own: it is
installed from Triton's repository (`python/triton_kernels`, distribution `triton_kernels`) or found as a copied
tree (e.g. the copy vLLM ships under `vllm/third_party/triton_kernels/`). So the verdict asks the package
metadata first (SELECTOR_PACKAGE_TRITON_KERNELS overrides it; empty means "not installed") and then whether a
top-level `triton_kernels` is importable, without importing it. No torch here.
"""

from __future__ import annotations

import importlib.util

from selector.probes import Environment, package_variable, probe_packages

from selector import Availability, Status

DISTRIBUTION = "triton_kernels"
IMPORT_NAME = "triton_kernels"
OFFLINE_DOC = "docs/offline-kernels.md#openai-triton_kernels"
INSTALL = (
    "install Triton's python/triton_kernels for your triton version (pip install "
    "'git+https://github.com/triton-lang/triton.git@<your triton tag>#subdirectory=python/triton_kernels'), "
    f"or put a copied triton_kernels/ folder on the path (offline nodes: {OFFLINE_DOC})"
)

_COMPILED: set[tuple] = set()  # (E, H, I, k, dtype, layout) this process has run: its Triton JIT is warm


def record_compiled(key: tuple) -> None:
    _COMPILED.add(key)


def is_compiled(key: tuple) -> bool:
    return key in _COMPILED


def forget_compiled() -> None:
    _COMPILED.clear()


def locate() -> str | None:
    """Where a top-level `triton_kernels` would be imported from, or None; never imports it, never raises."""
    try:
        spec = importlib.util.find_spec(IMPORT_NAME)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    return locations[0] if locations else (spec.origin or "a namespace package")


def package_verdict(env: Environment) -> Availability | None:
    """None when triton_kernels is installed (metadata or override) or importable as a copied tree."""
    facts = env.package(DISTRIBUTION) or probe_packages((DISTRIBUTION,))[0]
    if facts.version is not None:
        return None
    where = None if facts.overridden else locate()
    if where is not None:
        return None
    looked = f"{facts.source}" + ("" if facts.overridden else "; no importable top-level triton_kernels")
    return Availability(
        Status.MISSING_PACKAGE,
        "needs OpenAI's triton_kernels library (matmul_ogs, routing), which is neither installed nor importable",
        INSTALL,
        found=f"{DISTRIBUTION}: not found ({looked}; {package_variable(DISTRIBUTION)} overrides the probe)",
    )
