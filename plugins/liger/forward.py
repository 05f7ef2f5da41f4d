"""Liger adapter: Transformers' experts layout -> `LigerFusedMoEFunction.apply(x, gate_up, down, ids, weights)`.

The kernel (liger-kernel 0.8.5, `liger_kernel/ops/fused_moe.py`) wants `gate_up_proj` [E, 2I, H] with rows
[gate | up] (its up kernel reads gate rows n and up rows I + n and computes silu(gate) * up), `down_proj`
[E, H, I], ids [T, k] int32 and routing weights [T, k] it reads as float32 (no normalisation: out[t] is
sum_j w[t, j] * expert(x[t])). That is the standard layout as it is: the parameters go in without a copy.
Transposed weights are copied once into it, interleaved gate/up rows are de-interleaved once, at prepare time
(per run while autograd differentiates the weights, so the copy stays on the tape). Expert-parallel sentinel
slots go to expert 0 with weight 0; the routing guard routes bad slots to expert 0 with weight NaN first
(`selector.plugins.adapter.kernel_routing`), so the kernel never reads an expert out of bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from selector.plugins.adapter import (
    KernelPlan,
    Library,
    differentiates_weights,
    forward_of,
    kernel_routing,
    refuse_unless_silu_gated,
    shape_key,
)
from selector.plugins.liger import DISTRIBUTION, INSTALL, MIN_VERSION, SHAPE, TUNED

from selector.types import ExpertsForward, Problem

MODULE = "liger_kernel.ops.fused_moe"
LIGER: Library = Library(
    "liger",
    f"{DISTRIBUTION} >= {MIN_VERSION} with {MODULE}.LigerFusedMoEFunction",
    INSTALL,
    lambda import_module: import_module(MODULE).LigerFusedMoEFunction.apply,
)


def kernel_weights(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H] as [gate | up], down [E, H, I]), contiguous: the parameters themselves where they are
    in that layout already, else copies."""
    up, down = module.gate_up_proj, module.down_proj
    transposed = bool(getattr(module, "is_transposed", False))
    interleaved = not getattr(module, "is_concatenated", True)
    w1 = up.transpose(1, 2) if transposed else up  # [E, 2I, H]
    w2 = down.transpose(1, 2) if transposed else down  # [E, H, I]
    if interleaved:  # [g0, u0, g1, u1, ...] -> [gate | up]
        w1 = torch.cat([w1[:, 0::2], w1[:, 1::2]], dim=1)
    return w1.contiguous(), w2.contiguous()


@dataclass(frozen=True, kw_only=True)
class LigerPlan(KernelPlan):
    apply: object  # LigerFusedMoEFunction.apply

    def launch(self, module: torch.nn.Module, weights: tuple, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
        (w1, w2), (ids, routing) = weights, kernel_routing(module, top_k_index, top_k_weights)
        out = self.apply(hidden_states.to(w1.dtype), w1, w2, ids.contiguous(), routing.contiguous())
        return out.to(hidden_states.dtype)


def prepare(module: torch.nn.Module, problem: Problem) -> KernelPlan:
    """The kernel imported, the layer checked and its weights in Liger's layout, once per weights and call mode."""
    refuse_unless_silu_gated(module, "liger", "Liger's fused MoE runs SiLU-gated experts without bias "
                             "(silu(gate) * up)", "grouped_mm or triton_fused")  # fmt: skip
    return LigerPlan.prepared(module, kernel_weights, differentiates_weights(problem), backend="liger",
                              apply=LIGER.get(), ledger=TUNED, shape=shape_key(problem, SHAPE))  # fmt: skip


liger_experts_forward = forward_of(prepare)


def load() -> ExpertsForward:
    """The forward, the library imported first: a broken install is a load failure auto skips, not a failed call."""
    LIGER.get()
    return liger_experts_forward
