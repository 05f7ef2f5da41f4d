"""`flashinfer_cutlass`: FlashInfer's CUTLASS fused MoE (`flashinfer.fused_moe.cutlass_fused_moe`), bf16/fp16.

One call runs the whole layer: routing permutation, grouped GEMM 1 with the fused gated activation, grouped GEMM
2 and the weighted sum over the k slots. Its GEMM 1 weight is [E, 2I, H] with rows [up | gate] (the reverse of
Transformers' [gate | up]: its activation reads the linear half first, read from `cutlass_fused_moe_kernels.cuh`),
so the adapter's plan holds one reordered copy of `gate_up_proj` per set of weights (one more copy of the up
weights in memory). SiLU-gated experts only (`ActivationType.Swiglu`); hidden and intermediate sizes
must be multiples of 8 (TMA's 16-byte alignment).

First-call cost: the SM90 / SM100 module is built with the node's nvcc on first use: 182 objects (every dtype
pair its binding links, bf16 x bf16 being one of them); on the H200 machine with flashinfer-python 0.6.13 and nvcc
13.0, 14 jobs on its 16 host cores built 30 of them in 490 s, about 45 minutes for the whole. FlashInfer keeps the
build on disk, which this in-process record does not see, so the backend needs a full CUDA toolkit and ninja.
`auto` counts 45 minutes, spread over SELECTOR_JIT_AMORTIZE_CALLS calls, until this process has run it.
flashinfer-python 0.6.13 does not import beside nvidia-cutlass-dsl 4.4.2 (SonicMoE's pin): its package
`__init__` loads CuTe-DSL kernels that need a newer cutlass-dsl (AttributeError `OperandMajorMode`), which the
adapter reports as the ImportError; without cutlass-dsl installed it imports.

Graphs and compile: no host sync on its run path, but capture is not verified and the first call builds with
nvcc, so it is declared not capturable and not for torch.compile. Forward only (no backward).
Nothing here imports torch.
"""

from __future__ import annotations

from selector.plugins import adapter
from selector.probes import Environment, probe_packages

from dataclasses import replace

from selector import Availability, Problem, Requirements, Status, ToolkitRule, hub
from selector.requirements import version_tuple

DISTRIBUTION = "flashinfer-python"
MIN_VERSION = "0.6.13"  # the release measured here (`flashinfer.fused_moe.cutlass_fused_moe`)
OFFLINE_DOC = "docs/offline-kernels.md#flashinfer-cutlass-fused-moe"
# FlashInfer, then what its JIT build and its TVM-FFI binding need beside it (read from its METADATA and imports)
PACKAGES = (
    adapter.Package(DISTRIBUTION, MIN_VERSION, "FlashInfer's fused MoE", OFFLINE_DOC),
    adapter.Package("apache-tvm-ffi", "0.1.6", "FlashInfer's JIT build and kernel binding", OFFLINE_DOC),
    adapter.Package("ninja", "", "FlashInfer's JIT build and kernel binding", OFFLINE_DOC),
)
INSTALL = PACKAGES[0].install()
# Not needed by the fused MoE, but where installed FlashInfer's package __init__ imports its CuTe-DSL kernels,
# which 0.6.13 writes for this version or newer (older: AttributeError at import, seen with 4.4.2)
CUTLASS_DSL, CUTLASS_DSL_MIN = "nvidia-cutlass-dsl", "4.5.0"

HOPPER = ToolkitRule(min_cc=(9, 0), max_cc=(10, 0), nvcc=(12, 3), family="Hopper")
BLACKWELL = ToolkitRule(min_cc=(10, 0), max_cc=None, nvcc=(12, 8), family="Blackwell")
ALIGNMENT = 8  # elements: 128-bit TMA alignment of bf16/fp16 rows

REQUIREMENTS = Requirements(
    devices=frozenset({"cuda"}),
    min_compute_capability=(9, 0),  # modules for sm90 and sm100/103/110/120; Ada's sm89 module not enabled here
    toolkit=(HOPPER, BLACKWELL),
    dtypes=frozenset({"bfloat16", "float16"}),
    activations=frozenset({"silu"}),  # ActivationType.Swiglu
    transposed=True,  # copied once into [E, 2I, H] / [E, H, I]
    interleaved=True,  # reordered once into [up | gate] like the concatenated layout
    expert_parallel=True,  # sentinel slots go to expert 0 with weight 0 (ep_size stays 1)
)

JIT_SECONDS = 2700.0  # H200 machine, 14 build jobs: 30 of 182 objects in 490 s
BUILT = adapter.FirstCalls(JIT_SECONDS)  # architectures whose fused-MoE module this process has built or loaded
HOST_SECONDS = 0.06e-3  # one fused launch sequence from Python
EFFICIENCY = 1.5  # a guess until measured beside ours: a CUTLASS grouped GEMM pair with fused epilogues

FIRST_CALL_COST = (
    "builds FlashInfer's CUTLASS fused-MoE module with nvcc on first use (182 objects, about 45 minutes cold on "
    f"the H200 machine's 16 cores; FlashInfer caches the build on disk): auto counts {JIT_SECONDS:.0f} s, spread over {hub.AMORTIZE_VARIABLE} calls, until this "
    "process has run it"
)


def arch_of(problem: Problem, env: Environment) -> str | None:
    cc = env.compute_capability(problem.device_index)
    return None if cc is None else f"{cc[0] * 10 + cc[1]}"


def _pending(problem: Problem, env: Environment) -> float:
    arch = arch_of(problem, env)
    return JIT_SECONDS if arch is None else BUILT.pending(arch)


def package_check(env: Environment) -> Availability | None:
    """None when FlashInfer and its companions are installed (SELECTOR_PACKAGE_<NAME> overrides the probes) and
    no nvidia-cutlass-dsl its import rejects is."""
    verdict = adapter.package_verdict(PACKAGES, env)
    if verdict is not None:
        return verdict
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


def _check(problem: Problem, env: Environment) -> Availability | None:
    verdict = package_check(env)
    if verdict is not None:
        return verdict
    odd = [f"{name} {size}" for name, size in (("hidden size", problem.hidden_size),
                                               ("intermediate size", problem.intermediate_size))
           if size % ALIGNMENT]  # fmt: skip
    if odd:
        return Availability(
            Status.UNSUPPORTED_CONFIG,
            f"FlashInfer's CUTLASS fused MoE needs hidden and intermediate sizes that are multiples of {ALIGNMENT} "
            f"(TMA alignment); this layer has {', '.join(odd)}",
            "pick another experts backend for this layer, e.g. grouped_mm or triton_fused",
        )
    return None


SPEC = adapter.declare(
    "flashinfer_cutlass",
    "selector.plugins.flashinfer_cutlass.forward",
    REQUIREMENTS,
    description="FlashInfer CUTLASS fused MoE (grouped GEMMs with fused SwiGLU and combine)",
    check=_check,
    estimate=adapter.steady_estimate(HOST_SECONDS, EFFICIENCY, _pending),
    pending_cost=_pending,
    # an opaque TVM-FFI call that builds with nvcc on first use; capture not verified; forward only
    calls=replace(adapter.UNTRACED_CALLS, differentiable=frozenset()),
    first_call_cost=FIRST_CALL_COST,
    url="https://github.com/flashinfer-ai/flashinfer",
)


selector_backends = adapter.backends_hook(SPEC)


__all__ = ["BUILT", "DISTRIBUTION", "INSTALL", "MIN_VERSION", "OFFLINE_DOC", "SPEC", "arch_of", "selector_backends"]
