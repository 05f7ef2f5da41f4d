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
(float32, no normalisation). Sentinel slots go to expert 0 with weight 0; the routing guard
(`selector.guard.sanitize_routing`) first routes bad slots to expert 0 with weight NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import selector.plugins.triton_common.guard  # noqa: F401 - registers the one-launch sanitiser

from selector import layers
from selector.guard import sanitize_routing
from selector.problem import dtype_name
from selector.weight_cache import DerivedWeights, fingerprint

from selector.plugins.triton_kernels.state import INSTALL, record_compiled

MODULES = ("triton_kernels.matmul_ogs", "triton_kernels.routing")


@dataclass(frozen=True)
class TritonKernels:
    matmul_ogs: object
    routing_data: type
    gather_indx: type
    scatter_indx: type
    compute_expt_data: object


_TK: TritonKernels | None = None
_BIASES: DerivedWeights[tuple[torch.Tensor, torch.Tensor]] = DerivedWeights()  # float32 (b1, b2)


def load_triton_kernels() -> TritonKernels:
    """Import the library once; ImportError naming it, how to install it and the offline doc if missing."""
    global _TK
    if _TK is None:
        import importlib

        try:
            ogs, routing = (importlib.import_module(name) for name in MODULES)
            _TK = TritonKernels(
                matmul_ogs=ogs.matmul_ogs,
                routing_data=routing.RoutingData,
                gather_indx=routing.GatherIndx,
                scatter_indx=routing.ScatterIndx,
                compute_expt_data=routing.compute_expt_data,
            )
        except (ImportError, AttributeError) as exc:
            raise ImportError(
                "experts backend 'triton_kernels' needs OpenAI's triton_kernels with matmul_ogs.matmul_ogs and "
                "routing.{RoutingData, GatherIndx, ScatterIndx, compute_expt_data} (the API of the copy in vLLM "
                f"0.33); importing it failed ({type(exc).__name__}: {exc}). fix: {INSTALL}"
            ) from exc
    return _TK


def forget_loaded() -> None:
    global _TK
    _TK = None


def refuse_unsupported(module: torch.nn.Module) -> None:
    if getattr(module, "has_post_expert_norm", False):
        raise ValueError(
            "experts backend 'triton_kernels' cannot apply a post-expert norm (the k slots are summed inside the "
            "down GEMM's reduction). fix: pick grouped_mm or eager for this layer."
        )


def kernel_weights(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(w1 [E, H, N1], w2 [E, I, H]) as views of the parameters: [E, K, N] in the library's terms."""
    up, down = layers.up_weight(module), module.down_proj
    if getattr(module, "is_transposed", False):
        return up, down
    return up.transpose(1, 2), down.transpose(1, 2)  # column-major W: the library reads stride(-2) == 1


def kernel_biases(module: torch.nn.Module) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """float32 biases for the GEMM epilogues, converted once per set of weights."""
    b1, b2 = layers.up_bias(module), layers.down_bias(module)
    if b1 is None or b2 is None:
        return None, None
    return _BIASES.get(module, fingerprint((b1, b2)),
                       lambda: (b1.detach().float().contiguous(), b2.detach().float().contiguous()))  # fmt: skip


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


def triton_kernels_experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, H]
    refuse_unsupported(module)
    tk = load_triton_kernels()
    num_tokens, top_k = top_k_index.shape
    hidden = hidden_states.shape[-1]
    if num_tokens == 0:
        return hidden_states.new_zeros(0, hidden)
    num_experts = int(module.num_experts)
    w1, w2 = kernel_weights(module)
    b1, b2 = kernel_biases(module)
    x = hidden_states.to(w1.dtype).contiguous()
    # bad slots -> expert 0 with weight NaN (selector.guard): the kernels read no expert out of bounds
    ids, weights = sanitize_routing(module, top_k_index, top_k_weights)
    ids = ids.to(torch.int32)
    weights = weights.float()
    if layers.is_expert_parallel(module):
        sentinel = ids >= num_experts
        ids, weights = ids.masked_fill(sentinel, 0), weights.masked_fill(sentinel, 0.0)
    routing, gather, scatter = sorted_routing(tk, ids, weights, num_experts)
    up = tk.matmul_ogs(x, w1, b1, routing, gather_indx=gather)  # [T*k, N1], expert-sorted rows
    act = layers.activate(module, up).contiguous()  # [T*k, I]
    out = tk.matmul_ogs(act, w2, b2, routing, scatter_indx=scatter, gammas=routing.gate_scal)  # [T, H]
    e, h, i = layers.dims(module)
    record_compiled((e, h, i, top_k, dtype_name(w1.dtype), bool(getattr(module, "has_gate", True)),
                     b1 is not None, bool(getattr(module, "is_transposed", False))))  # fmt: skip
    return out.to(hidden_states.dtype)
