"""`grouped_mm`: sort the (token, slot) pairs by expert, then one grouped GEMM per projection.

Uses torch's grouped GEMM (`torch.nn.functional.grouped_mm`) where it exists for the device and dtype;
elsewhere a loop over experts registered as a custom op, so torch.compile still traces the layer.
"""

from __future__ import annotations

from selector.plugins.adapter import backends_hook
from selector.plugins.quant_kernels import QUANT_FORMATS, quantised_backend
from selector.plugins.torch_common import TRACEABLE
from selector.probes import Environment

from selector import BackendSpec, Problem, Requirements
from selector.costmodel import floor_seconds
from selector.types import EVERY_LAYOUT


def _load():  # noqa: ANN202
    from selector.plugins.grouped_mm.forward import grouped_mm_experts_forward

    return grouped_mm_experts_forward


def estimate_seconds(problem: Problem, env: Environment) -> float:
    """The cost model's time of one forward (triton_fused's training estimate builds on it too)."""
    # Measured on an H200 (perf notes): 1.4x-4x the floor plus ~150 us of sort/gather launches.
    if problem.device == "cuda":
        return 150e-6 + 2.0 * floor_seconds(problem, env)
    return 30e-6 + 1.2 * floor_seconds(problem, env)


SPEC = BackendSpec(
    name="grouped_mm",
    load=_load,
    # fp8_block / fp4 experts run through plugins/quant_kernels (expert-sorted grouped Triton GEMM)
    **quantised_backend("grouped", "grouped_mm"),
    # every layout of selector.layers: the gate, activation and norm run in torch between the GEMMs, sentinels
    # sort to the tail and are zeroed (quantised experts: not transposed, check_quantized)
    requirements=Requirements(packages={"torch": "2.9"}, **QUANT_FORMATS, **EVERY_LAYOUT),
    description="sort by expert, then torch grouped GEMMs (loop fallback as a custom op)",
    estimate=estimate_seconds,
    # torch's grouped GEMM has a derivative and the loop op registers one (forward.py); quantised experts run
    # plugins/quant_kernels, which has no backward
    **TRACEABLE,
)
selector_backends = backends_hook(SPEC)
