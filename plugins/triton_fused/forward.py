"""Adapter from a Transformers-style experts module to the fused Triton kernel.

At decode sizes launching four Triton kernels from Python takes longer than running them (on a slow host up
to a few hundred tokens), so up to GRAPH_MAX_TOKENS tokens the call is replayed from a recorded CUDA graph
(selector.graphs: on first use up to 64 tokens, on a shape's second call above);
`SELECTOR_TRITON_FUSED_GRAPHS=0` turns this off. Quantised experts (selector.quant) run the quantised
grouped path of plugins/quant_kernels, which records its own decode graphs (`SELECTOR_QUANT_GRAPHS`).
"""

from __future__ import annotations

import torch
from selector.plugins.triton_fused import backward
from selector.plugins.triton_fused.kernels import fused_experts

from selector import graphs, layers
from selector.dispatch import OPAQUE_WHEN_COMPILED
from selector.guard import guard_code
from selector.problem import activation_name

GRAPH_MAX_TOKENS = graphs.REPEAT_TOKENS  # recorded on first use up to graphs.DECODE_TOKENS, above when repeated
backward.register()  # the op's autograd formula (plugins/triton_fused/backward.py)


def _records_grad(module: torch.nn.Module, hidden: torch.Tensor, weights: torch.Tensor) -> bool:
    if not torch.is_grad_enabled():  # inference: one call, nothing built
        return False
    tensors = (hidden, layers.up_weight(module), module.down_proj, weights, layers.up_bias(module),
               layers.down_bias(module))  # fmt: skip
    return any(t is not None and t.requires_grad for t in tensors)


def _direct(module: torch.nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    up_w = layers.up_weight(module)
    guard = guard_code(module, hidden.device)  # routing checked inside the align / combine launches
    if _records_grad(module, hidden, weights):
        # through the op, whose autograd formula covers every input (fused_experts takes it for hidden only)
        return torch.ops.selector.triton_fused_experts(
            hidden.to(up_w.dtype), up_w, module.down_proj, index, weights, module.num_experts,
            activation_name(module.act_fn), getattr(module, "has_gate", True),
            not getattr(module, "is_concatenated", True), getattr(module, "is_transposed", False),
            layers.up_bias(module), layers.down_bias(module), None, guard,
        ).to(hidden.dtype)  # fmt: skip
    return fused_experts(
        hidden.to(up_w.dtype),
        up_w,
        module.down_proj,
        index,
        weights,
        num_experts=module.num_experts,
        activation=activation_name(module.act_fn),
        gated=getattr(module, "has_gate", True),
        interleaved=not getattr(module, "is_concatenated", True),
        transposed=getattr(module, "is_transposed", False),
        gate_up_bias=layers.up_bias(module),
        down_bias=layers.down_bias(module),
        guard=guard,
    ).to(hidden.dtype)


def _graph_key(module: torch.nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> tuple:
    tensors = [layers.up_weight(module), module.down_proj, layers.up_bias(module), layers.down_bias(module)]
    pointers = tuple(t.data_ptr() if t is not None else 0 for t in tensors)  # new weights -> new graph
    guard = guard_code(module, hidden.device)  # a graph records the guard it was captured with
    return (tuple(hidden.shape), hidden.dtype, tuple(index.shape), index.dtype, weights.dtype, hidden.device, pointers,
            guard)  # fmt: skip


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
