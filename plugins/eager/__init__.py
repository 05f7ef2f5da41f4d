"""`eager`: a plain loop over the experts that received tokens. Runs everywhere, every layout; the reference."""

from __future__ import annotations

from selector.plugins.adapter import backends_hook
from selector.probes import Environment

from selector import BackendSpec, Problem, Requirements
from selector.costmodel import experts_hit, floor_seconds
from selector.types import EVERY_LAYOUT, GRAD_INPUTS, CallSupport

ALL_GRAD_INPUTS = frozenset(GRAD_INPUTS)


def _load():  # noqa: ANN202 - returns the forward function
    from selector.plugins.eager.forward import eager_experts_forward

    return eager_experts_forward


def _estimate(problem: Problem, env: Environment) -> float:
    # Each expert hit costs about ten small kernel launches on a GPU; on a CPU the loop is near the floor.
    per_expert = 80e-6 if problem.device == "cuda" else 5e-6
    return experts_hit(problem) * per_expert + 1.5 * floor_seconds(problem, env)


SPEC = BackendSpec(
    name="eager",
    load=_load,
    # the reference: every layout of selector.layers (biases, transposed, interleaved, non-gated, the module's own
    # gate, post-expert norm, expert-parallel sentinels skipped)
    requirements=Requirements(**EVERY_LAYOUT),
    description="loop over the experts hit; one matmul pair per expert",
    estimate=_estimate,
    calls=CallSupport(
        cuda_graphs=False,  # the set of experts hit is read on the host
        compile_auto=False,  # ... which breaks a torch.compile graph
        compile_modes=frozenset({"default", "max-autotune-no-cudagraphs"}),  # runs around its graph break
        fullgraph=False,  # the host-side loop over the experts hit is a graph break
        differentiable=ALL_GRAD_INPUTS,  # plain torch ops: autograd differentiates all of it
    ),
)
selector_backends = backends_hook(SPEC)
