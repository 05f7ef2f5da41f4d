"""From a Transformers-style experts module to the fused Triton kernel: the backend's plan.

``prepare(module, problem)`` reads the module once (weights, biases, layout flags, gate, guard code, whether
autograd records) into a ``FusedPlan`` whose ``run`` launches the kernels and nothing else. At decode sizes
launching four Triton kernels from Python takes longer than running them, so the plan lets the dispatch core
replay it from recorded CUDA graphs up to graphs.REPEAT_TOKENS tokens (selector.graphs: on first use up to
graphs.DECODE_TOKENS, above on a shape's second call); `SELECTOR_TRITON_FUSED_GRAPHS=0` turns this off. Quantised
experts (selector.quant) run plugins/quant_kernels' grouped path (its own plan, `SELECTOR_QUANT_GRAPHS`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from selector.plugins.triton_fused import backward
from selector.plugins.triton_fused.configs import tile_source
from selector.plugins.triton_fused.kernels import FusedLayer, fused_experts_impl, fused_layer, run_op

from selector import graphs, layers
from selector.dispatch import OPAQUE_WHEN_COMPILED, grad_inputs
from selector.gates import DEFAULT_GATE, Gate
from selector.guard import guard_code
from selector.problem import activation_name, gate_of
from selector.types import ExpertsPlan, GraphPolicy, Problem

GRAPH_MAX_TOKENS = graphs.REPEAT_TOKENS  # recorded on first use up to graphs.DECODE_TOKENS, above when repeated
GRAPHS = GraphPolicy(GRAPH_MAX_TOKENS, "SELECTOR_TRITON_FUSED_GRAPHS")
backward.register()  # the op's autograd formula (plugins/triton_fused/backward.py)


@dataclass(frozen=True, kw_only=True)
class FusedPlan(ExpertsPlan):
    """One dense layer for one kind of call: its record (weights checked once), the routing guard's code, and
    whether the launches go through the custom op (autograd records, or torch.compile traces this call)."""

    layer: FusedLayer
    guard: int
    through_op: bool

    def run(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        x = hidden_states.to(self.layer.dtype)
        if self.through_op:  # the op's autograd formula covers every input; under tracing it is one opaque node
            out = run_op(self.layer, x, top_k_index, top_k_weights, None, self.guard)
        else:
            out = fused_experts_impl(self.layer, x, top_k_index, top_k_weights, None, self.guard)
        return out.to(hidden_states.dtype)


def _gate(module: torch.nn.Module) -> Gate:
    """The gate the epilogue runs: the module's recognised gate (selector.gates). The selection never sends a
    custom Python gate here; a direct call with one is refused rather than computed as act(gate) * up."""
    if not getattr(module, "has_gate", True):
        return DEFAULT_GATE
    gate = gate_of(module)
    if gate is None:
        raise ValueError(
            f"triton_fused: {type(module).__name__}._apply_gate is not a gate of selector.gates, so the fused "
            "epilogue cannot run it; declare it (selector.experts(gate=selector.Gate(...))) or pick a torch backend"
        )
    return gate


def module_layer(module: torch.nn.Module) -> FusedLayer:
    """The module's dense layer record, its weights checked once."""
    gate = _gate(module)
    return fused_layer(
        layers.up_weight(module),
        layers.down_weight(module),
        num_experts=int(module.num_experts),
        activation=activation_name(getattr(module, "act_fn", None)) if gate.is_default else "silu",
        gated=bool(getattr(module, "has_gate", True)),
        interleaved=not getattr(module, "is_concatenated", True),
        transposed=bool(getattr(module, "is_transposed", False)),
        gate_up_bias=layers.up_bias(module),
        down_bias=layers.down_bias(module),
        gate=gate.name,
        gate_alpha=gate.alpha,
        gate_limit=gate.limit,
    )


def _plan(module: torch.nn.Module, records_grad: bool, top_k: int | None = None) -> FusedPlan:
    layer = module_layer(module)
    return FusedPlan(
        backend="triton_fused",
        graphs=None if records_grad else GRAPHS,  # a replayed graph records nothing for autograd
        # under torch.compile without autograd the core runs the plan eagerly inside its opaque op: the recorded
        # graph at small T instead of four launches from Python per call
        opaque_when_compiled=True,
        layer=layer,
        guard=guard_code(module, layer.gate_up.device),  # routing checked inside the align / combine launches
        # the op where autograd needs its formula or this very call is traced; an eager run inside the core's
        # opaque op (a compiled model's call) launches directly: the op's dispatch costs host time per call
        through_op=records_grad or torch.compiler.is_compiling(),
        # where the tiles come from for this layer on its GPU (the core tells the user once about heuristic ones)
        tiles="" if top_k is None else tile_source(layer.shape, top_k, layer.gate_up.device),
    )


def prepare(module: torch.nn.Module, problem: Problem) -> FusedPlan:
    """The backend's plan for a dense layer and one kind of call (`problem`: whether autograd records)."""
    return _plan(module, problem.call.requires_grad, problem.top_k)


def triton_fused_experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, H]
    """The backend as a plain forward (direct callers, and what torch.compile traces): the plan, prepared for this
    call and run, without graph replay (the dispatch core replays plans)."""
    records_grad = bool(grad_inputs(module, hidden_states, top_k_weights))  # () under no_grad
    return _plan(module, records_grad).run(hidden_states, top_k_index, top_k_weights)


# under torch.compile without autograd the dispatch core runs this forward's backend eagerly inside its opaque op
setattr(triton_fused_experts_forward, OPAQUE_WHEN_COMPILED, True)
