"""triton_kernels adapter: Transformers' experts layout -> two `matmul_ogs` calls over ragged expert blocks.

From the library's own definitions (`triton_kernels/matmul_ogs.py`, `routing.py`, the copy vLLM 0.33 ships):
`matmul_ogs(x, w, bias, routing_data, gather_indx=, scatter_indx=, gammas=)` computes, for each expert e, the
rows of x routed to e times `w[e]` ([E, K, N], row- or column-major), adds `bias[e]` ([E, N]), multiplies row p
by `gammas[p]`; with `gather_indx` row p reads x[src_indx[p] // k], with `scatter_indx` the k rows of each token
(`src_indx.view(T, k)`) are summed into its output row. `RoutingData(gate_scal, expt_hist, n_expts_tot,
n_expts_act, expt_data)` carries the expert-sorted routing weights, the per-expert histogram (int32) and the tile
maps `compute_expt_data(hist, E, T * k)` builds on the device.

Here the (token, slot) pairs are sorted by expert with a stable device sort (order[p] = the flat slot at sorted
position p, inverse[flat] = p), which is exactly what the library's own `routing()` produces for its GatherIndx
(src = order, dst = inverse) and ScatterIndx (src = inverse, dst = order). Routing weights are used as given
(float32, no normalisation). Sentinel slots go to expert 0 with weight 0; the routing guard first routes bad
slots to expert 0 with weight NaN (`selector.plugins.adapter.kernel_routing`). The plan holds the weights as
views and the biases as float32 copies, made at prepare time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from selector.plugins.adapter import KernelPlan, Library, forward_of, kernel_routing, shape_key
from selector.plugins.triton_kernels import COMPILED, INSTALL, SHAPE

from selector import layers
from selector.types import ExpertsForward, Problem

MODULES = ("triton_kernels.matmul_ogs", "triton_kernels.routing")


@dataclass(frozen=True)
class TritonKernels:
    matmul_ogs: object
    routing_data: type
    gather_indx: type
    scatter_indx: type
    compute_expt_data: object


def _bind(import_module: Callable) -> TritonKernels:
    ogs, routing = (import_module(name) for name in MODULES)
    return TritonKernels(
        matmul_ogs=ogs.matmul_ogs,
        routing_data=routing.RoutingData,
        gather_indx=routing.GatherIndx,
        scatter_indx=routing.ScatterIndx,
        compute_expt_data=routing.compute_expt_data,
    )


TRITON_KERNELS: Library[TritonKernels] = Library(
    "triton_kernels",
    "OpenAI's triton_kernels with matmul_ogs.matmul_ogs and routing.{RoutingData, GatherIndx, ScatterIndx, "
    "compute_expt_data} (the API of the copy in vLLM 0.33)",
    INSTALL,
    _bind,
)


def refuse_unsupported(module: torch.nn.Module) -> None:
    if getattr(module, "has_post_expert_norm", False):
        raise ValueError(
            "experts backend 'triton_kernels' cannot apply a post-expert norm (the k slots are summed inside the "
            "down GEMM's reduction). fix: pick grouped_mm or eager for this layer."
        )


def kernel_weights(module: torch.nn.Module) -> tuple:
    """(w1 [E, H, N1], w2 [E, I, H]) as views of the parameters ([E, K, N] in the library's terms), and the
    biases (b1 [E, N1], b2 [E, H]) as float32 copies for the GEMM epilogues, or None."""
    up, down = layers.up_weight(module), module.down_proj
    if not getattr(module, "is_transposed", False):
        up, down = up.transpose(1, 2), down.transpose(1, 2)  # column-major W: the library reads stride(-2) == 1
    b1, b2 = layers.up_bias(module), layers.down_bias(module)
    if b1 is None or b2 is None:
        return up, down, None, None
    return up, down, b1.detach().float().contiguous(), b2.detach().float().contiguous()


def sorted_routing(tk: TritonKernels, ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> tuple:
    """(RoutingData, GatherIndx, ScatterIndx) for these top-k ids, built on the device without a host sync."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1).to(torch.int32)
    order = torch.sort(flat, stable=True).indices.to(torch.int32)  # sorted position -> flat slot
    inverse = torch.empty_like(order)
    inverse[order.long()] = torch.arange(order.numel(), device=order.device, dtype=torch.int32)
    hist = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    hist.index_add_(0, flat.long(), torch.ones_like(flat))
    gate_scal = weights.reshape(-1).float()[order.long()]
    expt_data = tk.compute_expt_data(hist, num_experts, flat.numel())
    routing = tk.routing_data(gate_scal, hist, num_experts, top_k, expt_data)
    return routing, tk.gather_indx(src_indx=order, dst_indx=inverse), tk.scatter_indx(src_indx=inverse, dst_indx=order)


@dataclass(frozen=True, kw_only=True)
class TritonKernelsPlan(KernelPlan):
    tk: TritonKernels
    num_experts: int

    def launch(self, module: torch.nn.Module, weights: tuple, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
        (w1, w2, b1, b2), (ids, routing_weights) = weights, kernel_routing(module, top_k_index, top_k_weights)
        routing, gather, scatter = sorted_routing(self.tk, ids, routing_weights, self.num_experts)
        x = hidden_states.to(w1.dtype).contiguous()
        up = self.tk.matmul_ogs(x, w1, b1, routing, gather_indx=gather)  # [T*k, N1], expert-sorted rows
        act = layers.activate(module, up).contiguous()  # [T*k, I]: the module's own gate
        out = self.tk.matmul_ogs(act, w2, b2, routing, scatter_indx=scatter, gammas=routing.gate_scal)  # [T, H]
        return out.to(hidden_states.dtype)


def prepare(module: torch.nn.Module, problem: Problem) -> KernelPlan:
    """The library imported, the layer checked, the weights viewed and the biases converted, once per weights
    and call mode (forward only: nothing differentiates through them)."""
    refuse_unsupported(module)
    return TritonKernelsPlan.prepared(module, kernel_weights, False, backend="triton_kernels", tk=TRITON_KERNELS.get(),
                                      num_experts=int(module.num_experts), ledger=COMPILED,
                                      shape=shape_key(problem, SHAPE))  # fmt: skip


triton_kernels_experts_forward = forward_of(prepare)


def load() -> ExpertsForward:
    """The forward, the library imported first: a broken install is a load failure auto skips, not a failed call."""
    TRITON_KERNELS.get()
    return triton_kernels_experts_forward
