"""FlashInfer adapter: Transformers' experts layout -> `flashinfer.fused_moe.cutlass_fused_moe`.

The call (flashinfer-python 0.6.13, `flashinfer/fused_moe/core.py` and its TVM-FFI binding) takes the input
[T, H], `token_selected_experts` [T, k] int32, `token_final_scales` [T, k] float32 (used as given: out[t] is
sum_j scale[t, j] * expert(x[t]), no normalisation), `fc1_expert_weights` [E, 2I, H] with rows [up | gate]
(its activation reads the linear half at row n and the gate at row I + n), `fc2_expert_weights` [E, H, I],
`output_dtype`, `quant_scales` (None: unquantised) and an optional preallocated `output` [T, H].

So the adapter keeps one copy of `gate_up_proj` with its halves swapped (and, for the transposed layout, both
weights transposed; for interleaved rows, de-interleaved), cached on the module per set of weights and refreshed
when the parameters change. Expert-parallel sentinel slots go to expert 0 with weight 0 (ep_size stays 1); the
routing guard (`selector.guard.sanitize_routing`) first routes bad slots to expert 0 with weight NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import selector.plugins.triton_common.guard  # noqa: F401 - registers the one-launch sanitiser

from selector import layers
from selector.environment import current_environment
from selector.guard import sanitize_routing
from selector.problem import activation_name, has_custom_gate
from selector.weight_cache import DerivedWeights, fingerprint

from selector.plugins.flashinfer_cutlass.state import DISTRIBUTION, INSTALL, MIN_VERSION, record_built

MODULE = "flashinfer.fused_moe"


@dataclass(frozen=True)
class FlashInfer:
    run: Callable  # cutlass_fused_moe
    swiglu: object | None  # ActivationType.Swiglu, None on a build without the argument
    version: str


_FLASHINFER: FlashInfer | None = None
_WEIGHTS: DerivedWeights[tuple[torch.Tensor, torch.Tensor]] = DerivedWeights()  # (fc1 [E, 2I, H] [up | gate], fc2)


def load_flashinfer() -> FlashInfer:
    """Import FlashInfer's fused MoE once; ImportError naming the package, version and offline doc if missing."""
    global _FLASHINFER
    if _FLASHINFER is None:
        import importlib

        try:
            fused_moe = importlib.import_module(MODULE)
            run = fused_moe.cutlass_fused_moe
        except (ImportError, AttributeError) as exc:
            raise ImportError(
                f"experts backend 'flashinfer_cutlass' needs {DISTRIBUTION} >= {MIN_VERSION} with "
                f"{MODULE}.cutlass_fused_moe (and apache-tvm-ffi, ninja, a CUDA toolkit with nvcc); importing it "
                f"failed ({type(exc).__name__}: {exc}). fix: {INSTALL}"
            ) from exc
        activation = getattr(fused_moe, "ActivationType", None)
        root = importlib.import_module(MODULE.split(".")[0])
        _FLASHINFER = FlashInfer(
            run=run,
            swiglu=None if activation is None else activation.Swiglu,
            version=str(getattr(root, "__version__", "unknown")),
        )
    return _FLASHINFER


def forget_loaded() -> None:
    global _FLASHINFER
    _FLASHINFER = None


def refuse_unsupported(module: torch.nn.Module) -> None:
    """ValueError for a layer this adapter has no path for (the dispatch core never sends one: closed world)."""
    act = activation_name(getattr(module, "act_fn", None))
    what = None
    if not getattr(module, "has_gate", True):
        what = "non-gated experts"
    elif has_custom_gate(module):
        what = "a custom gate function"
    elif act != "silu":
        what = f"the activation {act!r}"
    elif getattr(module, "has_bias", False):
        what = "expert biases"
    elif getattr(module, "has_post_expert_norm", False):
        what = "a post-expert norm"
    if what is not None:
        raise ValueError(
            f"experts backend 'flashinfer_cutlass' cannot run {what}: this adapter runs FlashInfer's SiLU-gated "
            "(Swiglu) experts without bias. fix: pick another experts backend for this layer, e.g. grouped_mm."
        )


def kernel_weights(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(fc1 [E, 2I, H] rows [up | gate], fc2 [E, H, I]), contiguous; built once per set of weights."""
    up, down = module.gate_up_proj, module.down_proj
    transposed = bool(getattr(module, "is_transposed", False))
    interleaved = not getattr(module, "is_concatenated", True)

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():  # forward only: the copies carry no gradient
            w1 = up.transpose(1, 2) if transposed else up  # [E, 2I, H]
            w2 = down.transpose(1, 2) if transposed else down  # [E, H, I]
            gate, lin = (w1[:, 0::2], w1[:, 1::2]) if interleaved else w1.chunk(2, dim=1)
            return torch.cat([lin, gate], dim=1).contiguous(), w2.contiguous()

    return _WEIGHTS.get(module, fingerprint((up, down)) + (transposed, interleaved), build)


def _arch(device: torch.device) -> str:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
    else:  # only the fakes of the tests run off CUDA
        major, minor = current_environment().compute_capability(0) or (0, 0)
    return f"{major * 10 + minor}"


def flashinfer_cutlass_experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, H]
    refuse_unsupported(module)
    kernel = load_flashinfer()
    num_tokens = top_k_index.shape[0]
    hidden = hidden_states.shape[-1]
    if num_tokens == 0:
        return hidden_states.new_zeros(0, hidden)
    fc1, fc2 = kernel_weights(module)
    x = hidden_states.to(fc1.dtype).contiguous()
    # bad slots -> expert 0 with weight NaN (selector.guard): the kernel reads no expert out of bounds
    ids, weights = sanitize_routing(module, top_k_index, top_k_weights)
    ids = ids.to(torch.int32)
    weights = weights.float()
    if layers.is_expert_parallel(module):
        sentinel = ids >= module.num_experts
        ids, weights = ids.masked_fill(sentinel, 0), weights.masked_fill(sentinel, 0.0)
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    extra = {} if kernel.swiglu is None else {"activation_type": kernel.swiglu}
    kernel.run(x, ids.contiguous(), weights.contiguous(), fc1, fc2, x.dtype, None, output=out, **extra)
    record_built(_arch(x.device))
    return out.to(hidden_states.dtype)
