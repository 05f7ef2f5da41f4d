"""`batched_mm`: gather each (token, slot)'s expert weights and run one batched matmul per projection.

No host synchronisation (CUDA-graph friendly) and fast at a handful of tokens, but it copies one weight
matrix per (token, slot): its memory and time grow with T x k, so "auto" only picks it for decode.
"""

from __future__ import annotations

from collections.abc import Sequence

from selector.plugins.quant_kernels import (
    QUANT_ACTIVATION_QUANT,
    QUANT_WEIGHT_FORMATS,
    check_quantized,
    quantised_forwards,
    quantised_prepare,
)
from selector.probes import Environment

from selector import BackendSpec, Problem, Requirements, hookimpl
from selector.costmodel import ceilings, floor_seconds, tokens, weight_bytes_per_expert
from selector.types import COMPILE_MODES, EVERY_LAYOUT, GRAD_INPUTS


def _load():  # noqa: ANN202
    from selector.plugins.batched_mm.forward import batched_mm_experts_forward

    return batched_mm_experts_forward


def _estimate(problem: Problem, env: Environment) -> float:
    gathered = tokens(problem) * problem.top_k * weight_bytes_per_expert(problem)
    launch = 60e-6 if problem.device == "cuda" else 20e-6
    return launch + 2 * gathered / ceilings(problem, env).bandwidth + 1.2 * floor_seconds(problem, env)


@hookimpl
def selector_backends() -> Sequence[BackendSpec]:
    return [
        BackendSpec(
            name="batched_mm",
            load=_load,
            format_loads=quantised_forwards("batched"),
            prepare=quantised_prepare("batched", "batched_mm"),  # quantised layers: their kernels' plan
            # fp8_block / fp4 experts run through plugins/quant_kernels (one pair per program, no weight copies)
            # every layout of selector.layers: the gate, activation and norm run in torch between the matmuls,
            # sentinel slots compute on expert 0 with weight 0 (quantised experts: not transposed, check_quantized)
            requirements=Requirements(
                weight_formats=frozenset({"dense"}) | QUANT_WEIGHT_FORMATS,
                activation_quant=QUANT_ACTIVATION_QUANT,
                **EVERY_LAYOUT,
            ),
            check=check_quantized,
            description="gather one weight copy per (token, expert) pair, then batched matmuls",
            estimate=_estimate,
            # plain torch ops (gather, bmm): autograd differentiates all of it; quantised experts have no backward
            differentiable=frozenset(GRAD_INPUTS),
            compile_modes=frozenset(COMPILE_MODES),  # plain torch ops (and a custom op) without host syncs
            fullgraph=True,
        )
    ]
