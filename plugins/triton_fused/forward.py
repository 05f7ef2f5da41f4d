"""Adapter from a Transformers-style experts module to the fused Triton kernel.

At decode sizes the kernels take tens of microseconds but launching four Triton kernels from Python takes
longer, so for small token counts the call is recorded once in a CUDA graph per (module, shape) and
replayed: inputs are copied into the graph's buffers, the graph replays, the output is cloned out.
`SELECTOR_TRITON_FUSED_GRAPHS=0` turns this off; it is never used while torch.compile traces or while a
caller captures its own graph (then the plain launches are recorded into the caller's graph).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch

from plugins.triton_fused.kernels import fused_experts
from selector import layers
from selector.problem import activation_name

GRAPH_MAX_TOKENS = 64  # above this the launches are a small share of the time
GRAPHS_PER_MODULE = 8  # least recently used graphs beyond this are dropped
_POOL: Any = None  # one memory pool for all graphs: they replay one after another on one stream


def _direct(module: torch.nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    up_w = layers.up_weight(module)
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
    ).to(hidden.dtype)


def _graphs_enabled(hidden: torch.Tensor) -> bool:
    return (
        hidden.is_cuda
        and 0 < hidden.shape[0] <= GRAPH_MAX_TOKENS
        and os.environ.get("SELECTOR_TRITON_FUSED_GRAPHS", "1") != "0"
        and not torch.compiler.is_compiling()
        and not torch.cuda.is_current_stream_capturing()
    )


class _Recorded:
    """One captured call: static input buffers, the graph, its output buffer."""

    def __init__(self, module: torch.nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor):
        global _POOL
        if _POOL is None:
            _POOL = torch.cuda.graph_pool_handle()
        self.inputs = (hidden.clone(), index.clone(), weights.clone())
        side = torch.cuda.Stream(device=hidden.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up compiles the kernels outside the capture
            _direct(module, *self.inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=_POOL):
            self.output = _direct(module, *self.inputs)

    def __call__(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        for buffer, value in zip(self.inputs, (hidden, index, weights)):
            buffer.copy_(value)
        self.graph.replay()
        return self.output.clone()


def _graph_key(module: torch.nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> tuple:
    tensors = [layers.up_weight(module), module.down_proj, layers.up_bias(module), layers.down_bias(module)]
    pointers = tuple(t.data_ptr() if t is not None else 0 for t in tensors)  # new weights -> new graph
    return (tuple(hidden.shape), hidden.dtype, tuple(index.shape), index.dtype, weights.dtype, hidden.device, pointers)


def triton_fused_experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, H]
    if not _graphs_enabled(hidden_states):
        return _direct(module, hidden_states, top_k_index, top_k_weights)
    graphs: OrderedDict[tuple, _Recorded] = module.__dict__.setdefault("_selector_graphs", OrderedDict())
    key = _graph_key(module, hidden_states, top_k_index, top_k_weights)
    recorded = graphs.get(key)
    if recorded is None:
        recorded = graphs[key] = _Recorded(module, hidden_states, top_k_index, top_k_weights)
        while len(graphs) > GRAPHS_PER_MODULE:
            graphs.popitem(last=False)
    graphs.move_to_end(key)
    return recorded(hidden_states, top_k_index, top_k_weights)
