"""`triton_kernels`: OpenAI's `triton_kernels.matmul_ogs` ragged grouped GEMMs (GPT-OSS's MoE path).

Two `matmul_ogs` calls per layer: the up projection gathers each (token, slot) row into expert-sorted order
(`GatherIndx`), the gate or activation runs in torch on the sorted rows (any activation, gated or not,
concatenated or interleaved channels), and the down projection multiplies each row by its routing weight
(`gammas`) and sums the k slots of each token (`ScatterIndx`, a grouped reduction in float32). The routing
metadata (`RoutingData`, its histogram and tile maps from `compute_expt_data`) is built from the given top-k
ids with device ops only: no host sync. Weights are read in place: the library takes W as [E, K, N] in either
row- or column-major order, so neither layout is copied; biases run in its epilogue.

Gates: the adapter applies the module's own gate (`_apply_gate`) in torch between the GEMMs, so any gate runs,
GPT-OSS's clamped SwiGLU included (`custom_gate=True`; triton_kernels could also fuse it into the up GEMM,
`FusedActivation(swiglu_fn, (alpha, limit), 2)`, over interleaved channels). A post-expert
norm cannot run (the slots are summed inside the down GEMM's reduction).

First call: Triton JIT-compiles its kernels for each new shape / tile choice (0.8-3.5 s per grid shape on the
H200; in-process record). Its eager calls are host-bound (1.3-1.8 ms at T <= 512: matmul_ogs plans in Python);
`selector bench` captured it in CUDA graphs without error, but capture is not declared until a test proves the
replay right on new routing, and compile is not declared.
Nothing here imports torch.
"""

from __future__ import annotations

import importlib.util

from selector.plugins import adapter
from selector.probes import Environment, package_variable, probe_packages

from dataclasses import replace

from selector import Availability, Problem, Requirements, Status, hub

# OpenAI's `triton_kernels` has no PyPI distribution of its own: it is installed from Triton's repository
# (`python/triton_kernels`, distribution `triton_kernels`) or found as a copied tree (e.g. the copy vLLM ships
# under `vllm/third_party/triton_kernels/`). So the verdict asks the package metadata first
# (SELECTOR_PACKAGE_TRITON_KERNELS overrides it; empty means "not installed") and then whether a top-level
# `triton_kernels` is importable, without importing it.
DISTRIBUTION = "triton_kernels"
IMPORT_NAME = "triton_kernels"
OFFLINE_DOC = "docs/offline-kernels.md#openai-triton_kernels"
INSTALL = (
    "install Triton's python/triton_kernels for your triton version (pip install "
    "'git+https://github.com/triton-lang/triton.git@<your triton tag>#subdirectory=python/triton_kernels'), "
    f"or put a copied triton_kernels/ folder on the path (offline nodes: {OFFLINE_DOC})"
)

REQUIREMENTS = Requirements(
    devices=frozenset({"cuda"}),
    min_compute_capability=(9, 0),  # measured on Hopper; its non-TMA path for Ampere is not checked here
    packages={"triton": "3.6"},  # a triton_kernels tree follows its Triton release (the vLLM 0.33 copy: 3.6)
    dtypes=frozenset({"bfloat16", "float16"}),
    activations=None,  # the module's own activation runs in torch between the two GEMMs
    non_gated=True,
    bias=True,  # matmul_ogs adds [E, N] biases in its epilogue
    transposed=True,  # W [E, K, N] row-major as it is; the standard layout as column-major views
    interleaved=True,  # the module's gate reads interleaved channels itself
    custom_gate=True,  # the module's own _apply_gate runs in torch between the GEMMs: any gate, GPT-OSS's too
    post_expert_norm=False,  # the k slots are summed inside the down GEMM's reduction
    expert_parallel=True,  # sentinel slots go to expert 0 with weight 0
)

JIT_SECONDS = 4.0  # measured on the H200: 0.8-3.5 s per grid shape
HOST_SECONDS = 1.4e-3  # two matmul_ogs calls' Python planning: 1.3-1.8 ms per eager call at T <= 512 on the H200
EFFICIENCY = 1.6  # measured: 1.0-1.1x our time at T = 4096 (DeepSeek-V3, Mixtral), ours 1.3-1.6x the floor

FIRST_CALL_COST = (
    f"Triton JIT-compiles matmul_ogs for each new layer shape (auto counts {JIT_SECONDS:.0f} s, spread over "
    f"{hub.AMORTIZE_VARIABLE} calls, until this process has run the shape)"
)


# the layer facts its Triton JIT compiles per (E, H, I, k, dtype, layout)
SHAPE = ("num_experts", "hidden_size", "intermediate_size", "top_k", "dtype", "gated", "has_bias", "is_transposed")
COMPILED = adapter.FirstCalls(JIT_SECONDS)


def _pending(problem: Problem, env: Environment) -> float:
    return COMPILED.pending(adapter.shape_key(problem, SHAPE))


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


def package_check(problem: Problem, env: Environment) -> Availability | None:
    """None when triton_kernels is installed (metadata or override) or importable as a copied tree."""
    facts = env.package(DISTRIBUTION) or probe_packages((DISTRIBUTION,))[0]
    if facts.version is not None or (not facts.overridden and locate() is not None):
        return None
    looked = f"{facts.source}" + ("" if facts.overridden else "; no importable top-level triton_kernels")
    return Availability(
        Status.MISSING_PACKAGE,
        "needs OpenAI's triton_kernels library (matmul_ogs, routing), which is neither installed nor importable",
        INSTALL,
        found=f"{DISTRIBUTION}: not found ({looked}; {package_variable(DISTRIBUTION)} overrides the probe)",
    )


SPEC = adapter.declare(
    "triton_kernels",
    "selector.plugins.triton_kernels.forward",
    REQUIREMENTS,
    description="OpenAI triton_kernels matmul_ogs (ragged gather/scatter grouped GEMMs, GPT-OSS's path)",
    check=package_check,
    estimate=adapter.steady_estimate(HOST_SECONDS, EFFICIENCY, _pending),
    pending_cost=_pending,
    # Python planning (opt flags, descriptors) around the launches: not traced; no host sync, but capture not
    # verified, and Triton JIT-compiles on the first call of a shape
    calls=replace(adapter.UNTRACED_CALLS, differentiable=frozenset()),  # forward only here
    first_call_cost=FIRST_CALL_COST,
    url="https://github.com/triton-lang/triton/tree/main/python/triton_kernels",
)


selector_backends = adapter.backends_hook(SPEC)


__all__ = ["COMPILED", "DISTRIBUTION", "INSTALL", "OFFLINE_DOC", "SHAPE", "SPEC", "locate", "package_check",
           "selector_backends"]
