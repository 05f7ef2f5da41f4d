"""`triton_fused`: our fused Triton experts kernel (align by expert on the GPU, gate_up GEMM with the
activation in its epilogue, down GEMM with the routing weight in its epilogue, deterministic combine).
FP8 / FP4 experts take the same structure in plugins/quant_kernels (grouped mode, tuned tiles per GPU).

No host synchronisation, so CUDA graphs capture it; a torch custom op, so torch.compile traces it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from selector.plugins.grouped_mm import estimate_seconds as grouped_mm_estimate
from selector.plugins.quant_kernels import QUANT_FORMATS, QUANT_WEIGHT_FORMATS, check_quantized, quantised_forwards
from selector.probes import Environment

from selector import Availability, BackendSpec, Problem, Requirements, Status, hookimpl
from selector.costmodel import floor_seconds
from selector.gates import ACT_MUL, CLAMPED_SWIGLU
from selector.types import COMPILE_MODES, GRAD_INPUTS, CallSupport, ExpertsPlan

if TYPE_CHECKING:  # the spec is built without importing torch
    import torch

ACTIVATIONS = frozenset({"silu", "gelu", "gelu_tanh", "relu"})
# the gates its gate_up epilogue runs (plugins/triton_common/activation.py): act(gate) * up and GPT-OSS's
GATES = frozenset({ACT_MUL, CLAMPED_SWIGLU})
# what backward.py differentiates (recomputed in torch): act(gate) * up with these activations
BACKWARD_ACTIVATIONS = frozenset({"silu", "gelu", "gelu_tanh", "relu"})


def _load():  # noqa: ANN202
    from selector.plugins.triton_fused.forward import triton_fused_experts_forward

    return triton_fused_experts_forward


def _prepare(module: torch.nn.Module, problem: Problem) -> ExpertsPlan:
    # quantised experts run plugins/quant_kernels' grouped path, its plan read off the module likewise
    if problem.weight_format != "dense":
        from selector.plugins.quant_kernels.forward import prepare_quantised

        return prepare_quantised(module, problem, "grouped", backend="triton_fused")
    from selector.plugins.triton_fused.forward import prepare

    return prepare(module, problem)


def _estimate(problem: Problem, env: Environment) -> float:
    # Four launches (align, two GEMMs, combine) and GEMMs near the floor: see benchmarks/ for the measurements.
    # Quantised experts run plugins/quant_kernels' grouped path with this GPU's tuned tiles (the activations are
    # quantised up front, in a launch that at decode also routes the pairs: about the same launch count).
    if problem.weight_format != "dense":
        return 28e-6 + 1.15 * floor_seconds(problem, env)
    forward = 25e-6 + 1.15 * floor_seconds(problem, env)
    if problem.call.requires_grad:
        # A training step: after the fused forward the backward recomputes the pair rows in torch and runs six of
        # torch's grouped GEMMs (backward.py): grouped_mm's whole step, about three of its forwards, on top. On the
        # H200 a step took 1.21x grouped_mm's at T=512 and 1.12x at T=4096 (Qwen3-30B-A3B, `selector bench --modes
        # train`), so auto trains with grouped_mm wherever that runs, and with this backend only where it is the
        # one differentiable choice left.
        return forward + 3 * grouped_mm_estimate(problem, env)
    return forward


def _check(problem: Problem, env: Environment) -> Availability | None:
    # quantised experts run plugins/quant_kernels' grouped kernels, whose epilogue has act(gate) * up only
    if problem.weight_format != "dense" and problem.gated and not problem.gate.is_default:
        return Availability(
            Status.UNSUPPORTED_CONFIG,
            f"runs gate {problem.gate.label()} for dense experts only; {problem.weight_format} experts run "
            "plugins/quant_kernels' grouped kernels, whose epilogue runs act(gate) * up",
            "pick a torch backend for this layer (grouped_mm, batched_mm or eager), or run it unquantised",
        )
    gate = problem.gate
    if problem.call.requires_grad and (gate.activation not in BACKWARD_ACTIVATIONS or not gate.is_default):
        what = f"gate {gate.label()}" if not gate.is_default else f"the {gate.activation!r} activation"
        return Availability(
            Status.UNSUPPORTED_CONFIG,
            f"has no backward for {what}",
            "run under torch.no_grad(), or pick a differentiable backend such as grouped_mm",
        )
    return check_quantized(problem, env)


def _tune_kernels(problem: Problem, token_counts: Sequence[int], budget_s: float) -> Mapping[str, Any]:
    # quantised experts run plugins/quant_kernels' grouped tiles, which have their own table and search
    if problem.weight_format in QUANT_WEIGHT_FORMATS:
        from selector.plugins.quant_kernels.tune import tune_kernels as tune_quantised

        return tune_quantised(problem, token_counts, budget_s)
    from selector.plugins.triton_fused.tune import tune_kernels

    return tune_kernels(problem, token_counts, budget_s)


@hookimpl
def selector_backends() -> Sequence[BackendSpec]:
    return [
        BackendSpec(
            name="triton_fused",
            load=_load,
            format_loads=quantised_forwards("grouped"),
            prepare=_prepare,  # the module read once per weights and call mode (forward.py, quant_kernels)
            requirements=Requirements(
                devices=frozenset({"cuda"}),
                min_compute_capability=(8, 0),  # fp8 / fp4: 8.9, which check_quantized enforces
                packages={"triton": "3.0"},
                **QUANT_FORMATS,
                activations=ACTIVATIONS,
                non_gated=True,  # act(up) in the epilogue
                bias=True,  # both biases added in the GEMM epilogues
                transposed=True,  # the kernel reads either stride order
                interleaved=True,  # the epilogue pairs [g0, u0, g1, u1, ...] as well as [gate | up]
                expert_parallel=True,  # align drops sentinel ids; the combine skips their slots
                custom_gate=False,  # the gate is fused into the GEMM epilogue: only the gates it declares
                gates=GATES,  # the clamped SwiGLU for dense experts (quantised ones: `_check`)
                post_expert_norm=False,
            ),
            check=_check,
            description="fused Triton kernels: GPU-side align, gate_up+activation, down+routing weight "
            "(fp8 / fp4 experts: plugins/quant_kernels' grouped kernels with tuned tiles)",
            estimate=_estimate,
            first_call_cost="Triton compiles each tile configuration on first use (a few seconds, cached on disk)",
            calls=CallSupport(
                differentiable=frozenset(GRAD_INPUTS),  # backward.py: recomputed in torch, dense experts only
                grad_weight_formats=frozenset({"dense"}),
                compile_modes=frozenset(COMPILE_MODES),  # one opaque custom op under torch.compile, capturable
                fullgraph=True,
            ),
            tune_kernels=_tune_kernels,  # tiles for shapes without a shipped table, into a user tile table
        )
    ]
