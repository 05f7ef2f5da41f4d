"""Triton kernels for FP8 (e4m3, block scales) and FP4 (e2m1, UE8M0 group scales) experts.

Not a backend of its own: `batched_mm`, `grouped_mm` and `triton_fused` run quantised experts modules
(selector/quant/) through these kernels. This module stays free of torch and triton imports: the backends' specs import
`check_quantized` when the registry loads, and `selector doctor` must stay fast.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from selector.probes import Environment

from selector.requirements import version_tuple
from selector.types import Availability, ExpertsForward, Problem, Status

QUANT_WEIGHT_FORMATS = frozenset({"fp8_block", "fp4"})
QUANT_ACTIVATION_QUANT = frozenset({"dynamic", "static"})
# Requirements(**QUANT_FORMATS, ...): dense experts, and the quantised ones these kernels run
QUANT_FORMATS: Mapping[str, frozenset[str]] = {
    "weight_formats": frozenset({"dense"}) | QUANT_WEIGHT_FORMATS,
    "activation_quant": QUANT_ACTIVATION_QUANT,
}
MIN_TRITON = "3.0"
MIN_COMPUTE_CAPABILITY = (8, 9)  # e4m3 conversions and tensor-core dots: Ada, Hopper and newer


def quantised_forwards(mode: str) -> Mapping[str, Callable[[], ExpertsForward]]:
    """A backend's `format_loads`: every quantised format runs these kernels in `mode` ("batched" / "grouped")."""

    def load() -> ExpertsForward:
        from functools import partial

        from selector.plugins.quant_kernels.forward import quant_experts_forward

        return partial(quant_experts_forward, mode=mode)

    return {fmt: load for fmt in QUANT_WEIGHT_FORMATS}


def quantised_prepare(mode: str, backend: str) -> Callable[[Any, Problem], Any]:
    """A backend's `prepare` for quantised experts run by these kernels in `mode`: their plan for an fp8 / fp4
    layer, None for a dense one (the backend's own forward runs it)."""

    def prepare(module: Any, problem: Problem) -> Any:
        if problem.weight_format == "dense":
            return None
        from selector.plugins.quant_kernels.forward import prepare_quantised

        return prepare_quantised(module, problem, mode, backend=backend)

    return prepare


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def quantised_backend(mode: str, backend: str) -> Mapping[str, Any]:
    """BackendSpec(**quantised_backend(mode, name), ...): a backend whose quantised experts these kernels run in
    `mode`, with their forwards, their plan and `check_quantized`; dense ones run the backend's own forward."""
    return {
        "format_loads": quantised_forwards(mode),
        "prepare": quantised_prepare(mode, backend),
        "check": check_quantized,
    }


def check_quantized(problem: Problem, env: Environment) -> Availability | None:
    """None for dense problems, or for quantised ones these kernels can run here; else why not and the fix."""
    if problem.weight_format == "dense":
        return None
    if problem.is_transposed:
        return Availability(
            Status.UNSUPPORTED_CONFIG,
            f"runs {problem.weight_format} experts stored [E, out, in] only, not the transposed layout",
            "quantise the experts from the untransposed layout (selector.quant.quantize_experts stores [E, out, in])",
        )
    if problem.weight_format == "fp4" and problem.scale_format not in (None, "ue8m0"):
        return Availability(
            Status.UNSUPPORTED_CONFIG,
            f"runs fp4 experts with UE8M0 (power-of-two) scales only, not {problem.scale_format} scales",
            "re-quantise the experts with scale_format='ue8m0' (selector.quant.quantize_experts)",
        )
    facts = env.package("triton")
    version = facts.version if facts else None
    if version is None:
        return Availability(
            Status.MISSING_PACKAGE,
            f"runs {problem.weight_format} experts through Triton kernels and needs the Python package 'triton'",
            f"pip install 'triton>={MIN_TRITON}'",
            found=f"triton: not found ({facts.source if facts else 'not probed'})",
        )
    if version_tuple(version) < version_tuple(MIN_TRITON):
        return Availability(
            Status.PACKAGE_TOO_OLD,
            f"runs {problem.weight_format} experts through Triton kernels and needs triton >= {MIN_TRITON}; "
            f"{version} is installed",
            f"pip install -U 'triton>={MIN_TRITON}'",
            found=f"triton {version} ({facts.source})",
        )
    if problem.device == "cpu":
        if interpreter_on():
            return None
        return Availability(
            Status.UNSUPPORTED_DEVICE,
            f"runs {problem.weight_format} experts with Triton kernels: on a CPU only through Triton's interpreter "
            "(TRITON_INTERPRET=1, slow, meant for tests)",
            "run the model on a CUDA GPU with compute capability >= 8.9, dequantise the experts "
            "(selector.quant.dequantize_experts / load with dequantize=True), or set TRITON_INTERPRET=1 for tests",
        )
    if problem.device != "cuda":
        return Availability(
            Status.UNSUPPORTED_DEVICE,
            f"runs {problem.weight_format} experts on CUDA GPUs only, not on {problem.device}",
            "move the model to a CUDA GPU, or dequantise the experts",
        )
    cc = env.compute_capability(problem.device_index)
    if cc is not None and cc < MIN_COMPUTE_CAPABILITY:
        name = env.gpu.devices[problem.device_index].name if problem.device_index < len(env.gpu.devices) else "GPU"
        return Availability(
            Status.UNSUPPORTED_HARDWARE,
            f"runs {problem.weight_format} experts with e4m3 tensor-core dots, which need compute capability >= 8.9; "
            f"{name} has {cc[0]}.{cc[1]}",
            "dequantise the experts (load with dequantize=True) and run a bf16 backend on this GPU",
            found=f"{name}, compute capability {cc[0]}.{cc[1]} (from {env.gpu.source})",
        )
    return None


__all__ = [
    "QUANT_ACTIVATION_QUANT",
    "QUANT_FORMATS",
    "QUANT_WEIGHT_FORMATS",
    "check_quantized",
    "interpreter_on",
    "quantised_backend",
    "quantised_forwards",
    "quantised_prepare",
]
