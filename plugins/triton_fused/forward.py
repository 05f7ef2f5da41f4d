"""Adapter from a Transformers-style experts module to the fused Triton kernel.

At decode sizes launching four Triton kernels from Python takes longer than running them (on a slow host up
to a few hundred tokens), so up to GRAPH_MAX_TOKENS tokens the call is replayed from a recorded CUDA graph
(selector.graphs: on first use up to 64 tokens, on a shape's second call above);
`SELECTOR_TRITON_FUSED_GRAPHS=0` turns this off. Quantised experts (selector.quant) run the quantised
grouped path of plugins/quant_kernels, which records its own decode graphs (`SELECTOR_QUANT_GRAPHS`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from selector.plugins.triton_fused import backward
from selector.plugins.triton_fused.kernels import fused_experts

from selector import graphs, layers
from selector.dispatch import MODULE_CACHE_PREFIX, OPAQUE_WHEN_COMPILED, grad_inputs
from selector.guard import guard_code
from selector.gates import DEFAULT_GATE, Gate
from selector.problem import activation_name, gate_of

GRAPH_MAX_TOKENS = graphs.REPEAT_TOKENS  # recorded on first use up to graphs.DECODE_TOKENS, above when repeated
backward.register()  # the op's autograd formula (plugins/triton_fused/backward.py)


def _records_grad(module: torch.nn.Module, hidden: torch.Tensor, weights: torch.Tensor) -> bool:
    return bool(grad_inputs(module, hidden, weights))  # () under no_grad: inference builds nothing


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


class _Static(NamedTuple):
    """What a recorded graph bakes in from the module itself, read once per module object, as the selection reads
    a layer's problem (both are read again after `selector.dispatch.forget_module`): its gate, and that gate as a
    small int that a graph key hashes cheaply."""

    owner: int  # id() of the module it was read from: a deep copy carries this __dict__ entry but reads its own
    gate: Gate
    gate_token: int


_STATIC = MODULE_CACHE_PREFIX + "triton_fused_static"  # dropped by forget_module with the module's problem
_GATE_TOKENS: dict[Gate, int] = {}


def _static(module: torch.nn.Module) -> _Static:
    found = module.__dict__.get(_STATIC)
    if found is None or found.owner != id(module):
        gate = _gate(module)
        found = _Static(id(module), gate, _GATE_TOKENS.setdefault(gate, len(_GATE_TOKENS)))
        module.__dict__[_STATIC] = found
    return found


def _direct(module: torch.nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    up_w = layers.up_weight(module)
    guard = guard_code(module, hidden.device)  # routing checked inside the align / combine launches
    gate = _static(module).gate
    if _records_grad(module, hidden, weights):
        # through the op, whose autograd formula covers every input (fused_experts takes it for hidden only)
        return torch.ops.selector.triton_fused_experts(
            hidden.to(up_w.dtype), up_w, module.down_proj, index, weights, module.num_experts,
            activation_name(module.act_fn) if gate.is_default else "silu", getattr(module, "has_gate", True),
            not getattr(module, "is_concatenated", True), getattr(module, "is_transposed", False),
            layers.up_bias(module), layers.down_bias(module), None, guard, gate.name,
            1.0 if gate.alpha is None else float(gate.alpha), 0.0 if gate.limit is None else float(gate.limit),
        ).to(hidden.dtype)  # fmt: skip
    return fused_experts(
        hidden.to(up_w.dtype),
        up_w,
        module.down_proj,
        index,
        weights,
        num_experts=module.num_experts,
        activation=activation_name(getattr(module, "act_fn", None)) if gate.is_default else "silu",
        gated=getattr(module, "has_gate", True),
        interleaved=not getattr(module, "is_concatenated", True),
        transposed=getattr(module, "is_transposed", False),
        gate_up_bias=layers.up_bias(module),
        down_bias=layers.down_bias(module),
        guard=guard,
        gate=gate.name,
        gate_alpha=gate.alpha,
        gate_limit=gate.limit,
    ).to(hidden.dtype)


def _graph_key(module: torch.nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> tuple:
    # read on every replayed call: kept to attribute reads and ints (the gate by its token, shapes as torch.Size)
    up_w, up_b, down_b = layers.up_weight(module), layers.up_bias(module), layers.down_bias(module)
    pointers = (up_w.data_ptr(), layers.down_weight(module).data_ptr(), 0 if up_b is None else up_b.data_ptr(),
                0 if down_b is None else down_b.data_ptr())  # fmt: skip  # new weights -> new graph
    guard = guard_code(module, hidden.device)  # a graph records the guard it was captured with
    return (hidden.shape, hidden.dtype, index.shape, index.dtype, weights.dtype, hidden.device, pointers, guard,
            _static(module).gate_token)  # fmt: skip  # and the gate's parameters, baked into its launches


def triton_fused_experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, H]
    if not graphs.graphs_enabled(hidden_states, GRAPH_MAX_TOKENS, "SELECTOR_TRITON_FUSED_GRAPHS") or _records_grad(
        module, hidden_states, top_k_weights
    ):  # a replayed graph records nothing for autograd
        return _direct(module, hidden_states, top_k_index, top_k_weights)
    key = _graph_key(module, hidden_states, top_k_index, top_k_weights)
    run = lambda h, i, w: _direct(module, h, i, w)  # noqa: E731
    return graphs.replay(module, "triton_fused", key, run, (hidden_states, top_k_index, top_k_weights))


# under torch.compile without autograd the dispatch core runs this eagerly inside its opaque op: the recorded
# graph at small T instead of four launches from Python per call
setattr(triton_fused_experts_forward, OPAQUE_WHEN_COMPILED, True)
