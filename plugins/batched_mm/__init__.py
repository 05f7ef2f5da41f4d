"""`batched_mm`: gather each (token, slot)'s expert weights and run one batched matmul per projection.

No host synchronisation (CUDA-graph friendly) and fast at a handful of tokens, but it copies one weight
matrix per (token, slot): its memory and time grow with T x k, so "auto" only picks it for decode.
"""

from __future__ import annotations

from selector.plugins.adapter import backends_hook
from selector.plugins.quant_kernels import QUANT_FORMATS, quantised_backend
from selector.plugins.torch_common import TRACEABLE
from selector.probes import Environment

from selector import BackendSpec, Problem, Requirements
from selector.costmodel import ceilings, floor_seconds, tokens, weight_bytes_per_expert
from selector.types import EVERY_LAYOUT


def _load():  # noqa: ANN202
    from selector.plugins.batched_mm.forward import batched_mm_experts_forward

    return batched_mm_experts_forward


def _estimate(problem: Problem, env: Environment) -> float:
    gathered = tokens(problem) * problem.top_k * weight_bytes_per_expert(problem)
    launch = 60e-6 if problem.device == "cuda" else 20e-6
    return launch + 2 * gathered / ceilings(problem, env).bandwidth + 1.2 * floor_seconds(problem, env)


SPEC = BackendSpec(
    name="batched_mm",
    load=_load,
    # fp8_block / fp4 experts run through plugins/quant_kernels (one pair per program, no weight copies)
    **quantised_backend("batched", "batched_mm"),
    # every layout of selector.layers: the gate, activation and norm run in torch between the matmuls, sentinel
    # slots compute on expert 0 with weight 0 (quantised experts: not transposed, check_quantized)
    requirements=Requirements(**QUANT_FORMATS, **EVERY_LAYOUT),
    description="gather one weight copy per (token, expert) pair, then batched matmuls",
    estimate=_estimate,
    # gather and bmm (quantised experts: the kernels' custom op, which has no backward)
    **TRACEABLE,
)
selector_backends = backends_hook(SPEC)
