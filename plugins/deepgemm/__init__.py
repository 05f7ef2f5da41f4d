"""`deepgemm`: expert matmuls through DeepGEMM's M-grouped contiguous GEMMs, from the kernel hub.

The kernel (`kernels-community/deep-gemm`, pinned in `selector.hub.PINS`) is loaded at the first forward and
JIT-compiles its GEMMs with the system nvcc, so beyond a Hopper/Blackwell GPU it needs a full CUDA toolkit:
nvcc >= 12.3 on Hopper, >= 12.9 on Blackwell (a runtime-only install has no nvcc and is rejected). It runs
bf16 experts and FP8 block-quantised experts (dynamic per-row activation scales only); FP4 experts need
Blackwell. On Blackwell DeepGEMM reads UE8M0 scales only, so a checkpoint with float32 block scales is
refused there (it would be silently rounded to powers of two).

Nothing here imports torch: declaring and judging the backend stays cheap for `selector doctor`.
"""

from __future__ import annotations

from dataclasses import replace

from selector.plugins import adapter
from selector.probes import Environment

from selector import Availability, Problem, Requirements, Status, ToolkitRule, hub
from selector.costmodel import floor_seconds
from selector.types import EVERY_LAYOUT, CallSupport

KERNEL = hub.PINS["deep-gemm"]
HOPPER = ToolkitRule(min_cc=(9, 0), max_cc=(10, 0), nvcc=(12, 3), family="Hopper")
BLACKWELL = ToolkitRule(min_cc=(10, 0), max_cc=None, nvcc=(12, 9), family="Blackwell")

REQUIREMENTS = Requirements(
    devices=frozenset({"cuda"}),
    min_compute_capability=(9, 0),
    # DeepGEMM ships SM90 and SM100 kernels only (Transformers' own gate says the same): not Ada, not SM120.
    max_compute_capability=(11, 0),
    toolkit=(HOPPER, BLACKWELL),
    packages={"kernels": hub.KERNELS_MIN_VERSION},
    dtypes=frozenset({"bfloat16"}),  # quantised experts report their compute dtype (selector.quant)
    weight_formats=frozenset({"dense", "fp8_block", "fp4"}),
    scale_formats=frozenset({"float32", "ue8m0"}),
    activation_quant=frozenset({"dynamic"}),
    # The activation (and any custom gate, bias, post-expert norm) runs in torch between the two GEMMs;
    # transposed [E, K, N] weights take the NN kernels; sentinels sort past every block, their rows zeroed.
    **EVERY_LAYOUT,
)

FIRST_CALL_COST = (
    f"downloads {KERNEL} on first use unless cached or local; JIT-compiles each layer shape's GEMMs with nvcc "
    "on its first call (DeepGEMM caches builds on disk; 5-12 s per layer shape measured on the H200: auto counts 12 s, spread "
    "over SELECTOR_JIT_AMORTIZE_CALLS calls, until this process has run the shape)"
)


def _gpu(problem: Problem, env: Environment) -> tuple[str, tuple[int, int]] | None:
    cc = env.compute_capability(problem.device_index)
    if cc is None:
        return None
    return env.gpu.devices[problem.device_index].name, cc


def machine_check(problem: Problem, env: Environment) -> Availability | None:
    """FP4 experts have no Hopper kernel."""
    gpu = _gpu(problem, env)
    if gpu and problem.weight_format == "fp4" and gpu[1] < (10, 0):
        name, cc = gpu
        return Availability(
            Status.UNSUPPORTED_HARDWARE,
            f"DeepGEMM runs FP4 experts on Blackwell only (compute capability >= 10.0); {name} has {cc[0]}.{cc[1]}",
            "use an FP8 or bf16 checkpoint on this GPU, or pick grouped_mm",
            found=f"{name}, compute capability {cc[0]}.{cc[1]} (from {env.gpu.source})",
        )
    return None


def config_check(problem: Problem, env: Environment) -> Availability | None:
    """On Blackwell, UE8M0 scales only."""
    gpu = _gpu(problem, env)
    if gpu and gpu[1] >= (10, 0) and problem.weight_format != "dense" and problem.scale_format == "float32":
        name, cc = gpu
        return Availability(
            Status.UNSUPPORTED_CONFIG,
            f"DeepGEMM has no float32 block-scale path on Blackwell ({name}, compute capability {cc[0]}.{cc[1]}): "
            "rounding these float32 scales to UE8M0 would silently corrupt the output",
            "use a checkpoint quantised with UE8M0 scales (scale_fmt='ue8m0'), or pick grouped_mm or batched_mm, "
            "which read float32 block scales",
        )
    return None


# Measured on the H200 (benchmarks/results/h200/deepgemm.json, DeepGEMM 0.1.5, nvcc 13.0): the first call of a
# layer shape JIT-compiles its two GEMMs in 5-6 s (bf16) or 11-12 s (FP8); a token count that picks other tiles
# later adds ~7 s. DeepGEMM keeps its builds on disk across processes, which this in-process record does not see.
JIT_SECONDS = 12.0
SHAPE = ("num_experts", "hidden_size", "intermediate_size", "gated", "is_transposed", "weight_format", "scale_format")
COMPILED = adapter.FirstCalls(JIT_SECONDS)  # layer shapes this process has run


def problem_key(problem: Problem) -> tuple:
    """The ledger key of a layer (dense experts have no scale format)."""
    dense = problem.weight_format == "dense"
    return adapter.shape_key(replace(problem, scale_format=None) if dense else problem, SHAPE)


def forget_compiled() -> None:
    COMPILED.forget()


def _estimate(problem: Problem, env: Environment) -> float:
    """Fitted to the H200 cells of benchmarks/results/h200/deepgemm.json (Qwen3-30B-A3B and DeepSeek-V3, bf16
    and FP8, T = 1 to 16384): ~1.1 ms per call of host-side launches around the two GEMMs (eager; the layout,
    activation quantisation, gate and combine run as ~40 torch ops), plus about twice the floor (the M padding
    to 128 rows per expert, and those passes). The fit is within ~25% of every cell, over-estimating bf16 at
    T=4096. Plus the JIT and download still ahead, spread over SELECTOR_JIT_AMORTIZE_CALLS calls. Measured
    tuning records replace the steady part; the JIT still ahead is added to them the same way."""
    return 1.1e-3 + 2.0 * floor_seconds(problem, env) + _pending(problem, env) / hub.amortize_calls()


def _pending(problem: Problem, env: Environment) -> float:
    """Seconds of JIT and download still ahead in this process before `problem` runs at steady speed."""
    return COMPILED.pending(problem_key(problem)) + hub.pending_download_seconds(KERNEL, env)


SPEC = adapter.declare(
    "deepgemm",
    "selector.plugins.deepgemm.forward",
    REQUIREMENTS,
    description=f"DeepGEMM M-grouped GEMMs from {KERNEL} (bf16, FP8; FP4 on Blackwell)",
    check=hub.kernel_check(KERNEL, machine=machine_check, config=config_check),
    estimate=_estimate,
    pending_cost=_pending,
    calls=CallSupport(
        compile_auto=False,  # an opaque hub kernel: torch.compile breaks the graph around it
        compile_modes=frozenset({"default", "max-autotune-no-cudagraphs"}),  # around its graph break, no capture
        fullgraph=False,
        cuda_graphs=False,  # its JIT compiles on first call of a shape: not capturable cold; not verified warm
        differentiable=frozenset(),  # forward-only grouped GEMMs
    ),
    first_call_cost=FIRST_CALL_COST,
    url="https://huggingface.co/kernels-community/deep-gemm",
)


selector_backends = adapter.backends_hook(SPEC)


__all__ = ["COMPILED", "KERNEL", "SPEC", "forget_compiled", "problem_key", "selector_backends"]
