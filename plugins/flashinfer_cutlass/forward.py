"""FlashInfer adapter: Transformers' experts layout -> `flashinfer.fused_moe.cutlass_fused_moe`.

The call (flashinfer-python 0.6.13, `flashinfer/fused_moe/core.py` and its TVM-FFI binding) takes the input
[T, H], `token_selected_experts` [T, k] int32, `token_final_scales` [T, k] float32 (used as given: out[t] is
sum_j scale[t, j] * expert(x[t]), no normalisation), `fc1_expert_weights` [E, 2I, H] with rows [up | gate]
(its activation reads the linear half at row n and the gate at row I + n), `fc2_expert_weights` [E, H, I],
`output_dtype`, `quant_scales` (None: unquantised) and an optional preallocated `output` [T, H].

So the plan holds one copy of `gate_up_proj` with its halves swapped (and, for the transposed layout, both
weights transposed; for interleaved rows, de-interleaved), made at prepare time. Expert-parallel sentinel slots
go to expert 0 with weight 0 (ep_size stays 1); the routing guard first routes bad slots to expert 0 with
weight NaN (`selector.plugins.adapter.kernel_routing`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from selector.plugins.adapter import KernelPlan, Library, forward_of, kernel_routing, refuse_unless_silu_gated
from selector.plugins.flashinfer_cutlass import BUILT, DISTRIBUTION, INSTALL, MIN_VERSION

from selector.environment import current_environment
from selector.types import ExpertsForward, Problem

MODULE = "flashinfer.fused_moe"


@dataclass(frozen=True)
class FlashInfer:
    run: Callable  # cutlass_fused_moe
    swiglu: object | None  # ActivationType.Swiglu, None on a build without the argument


def _bind(import_module: Callable) -> FlashInfer:
    fused_moe = import_module(MODULE)
    activation = getattr(fused_moe, "ActivationType", None)
    return FlashInfer(run=fused_moe.cutlass_fused_moe, swiglu=None if activation is None else activation.Swiglu)


FLASHINFER: Library[FlashInfer] = Library(
    "flashinfer_cutlass",
    f"{DISTRIBUTION} >= {MIN_VERSION} with {MODULE}.cutlass_fused_moe (and apache-tvm-ffi, ninja, a CUDA toolkit "
    "with nvcc)",
    INSTALL,
    _bind,
)


def kernel_weights(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(fc1 [E, 2I, H] rows [up | gate], fc2 [E, H, I]), contiguous copies."""
    up, down = module.gate_up_proj, module.down_proj
    transposed = bool(getattr(module, "is_transposed", False))
    interleaved = not getattr(module, "is_concatenated", True)
    w1 = up.transpose(1, 2) if transposed else up  # [E, 2I, H]
    w2 = down.transpose(1, 2) if transposed else down  # [E, H, I]
    gate, lin = (w1[:, 0::2], w1[:, 1::2]) if interleaved else w1.chunk(2, dim=1)
    return torch.cat([lin, gate], dim=1).contiguous(), w2.contiguous()


def arch(device: torch.device) -> str:
    """The device's compute capability as FlashInfer names its builds ("90"); the probe facts' off CUDA."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
    else:  # only the fakes of the tests run off CUDA
        major, minor = current_environment().compute_capability(0) or (0, 0)
    return f"{major * 10 + minor}"


@dataclass(frozen=True, kw_only=True)
class FlashInferPlan(KernelPlan):
    kernel: FlashInfer

    def launch(self, module: torch.nn.Module, weights: tuple, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
        (fc1, fc2), (ids, routing) = weights, kernel_routing(module, top_k_index, top_k_weights)
        x = hidden_states.to(fc1.dtype).contiguous()
        out = torch.empty(x.shape[0], fc2.shape[1], dtype=x.dtype, device=x.device)
        extra = {} if self.kernel.swiglu is None else {"activation_type": self.kernel.swiglu}
        self.kernel.run(x, ids.contiguous(), routing.contiguous(), fc1, fc2, x.dtype, None, output=out, **extra)
        return out.to(hidden_states.dtype)


def prepare(module: torch.nn.Module, problem: Problem) -> KernelPlan:
    """The library imported, the layer checked and fc1 reordered, once per weights and call mode (forward only:
    the copies carry no gradient)."""
    refuse_unless_silu_gated(module, "flashinfer_cutlass", "this adapter runs FlashInfer's SiLU-gated (Swiglu) "
                             "experts without bias", "grouped_mm")  # fmt: skip
    return FlashInferPlan.prepared(module, kernel_weights, False, backend="flashinfer_cutlass",
                                   kernel=FLASHINFER.get(), ledger=BUILT, shape=arch(module.gate_up_proj.device))


flashinfer_cutlass_experts_forward = forward_of(prepare)


def load() -> ExpertsForward:
    """The forward, the library imported first: a broken install is a load failure auto skips, not a failed call."""
    FLASHINFER.get()
    return flashinfer_cutlass_experts_forward
