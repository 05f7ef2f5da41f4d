"""Liger adapter: Transformers' experts layout -> `LigerFusedMoEFunction.apply(x, gate_up, down, ids, weights)`.

The kernel (liger-kernel 0.8.5, `liger_kernel/ops/fused_moe.py`) wants `gate_up_proj` [E, 2I, H] with rows
[gate | up] (its up kernel reads gate rows n and up rows I + n and computes silu(gate) * up), `down_proj`
[E, H, I], ids [T, k] int32 and routing weights [T, k] it reads as float32 (no normalisation: out[t] is
sum_j w[t, j] * expert(x[t])). That is the standard layout as it is: the parameters go in without a copy.
Transposed weights are copied once into it, interleaved gate/up rows are de-interleaved once; the copies are
cached on the module (refreshed when the parameters change; not cached while the weights need gradients, so the
copy stays on the autograd tape). Expert-parallel sentinel slots go to expert 0 with weight 0; the routing guard
(`selector.guard.sanitize_routing`) routes bad slots to expert 0 with weight NaN first, so the kernel never reads
an expert out of bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import selector.plugins.triton_common.guard  # noqa: F401 - registers the one-launch sanitiser

from selector import layers
from selector.guard import sanitize_routing
from selector.problem import activation_name, has_custom_gate
from selector.weight_cache import DerivedWeights, fingerprint

from selector.plugins.liger.state import DISTRIBUTION, INSTALL, MIN_VERSION, record_tuned, shape_key

MODULE = "liger_kernel.ops.fused_moe"


@dataclass(frozen=True)
class Liger:
    apply: object  # LigerFusedMoEFunction.apply
    version: str


_LIGER: Liger | None = None
_WEIGHTS: DerivedWeights[tuple[torch.Tensor, torch.Tensor]] = DerivedWeights()  # (gate_up [E, 2I, H], down [E, H, I])


def load_liger() -> Liger:
    """Import the kernel once; ImportError naming the package, the version and the offline doc if missing."""
    global _LIGER
    if _LIGER is None:
        import importlib
        import importlib.metadata

        try:
            ops = importlib.import_module(MODULE)
            function = ops.LigerFusedMoEFunction
        except (ImportError, AttributeError) as exc:
            raise ImportError(
                f"experts backend 'liger' needs {DISTRIBUTION} >= {MIN_VERSION} with {MODULE}."
                f"LigerFusedMoEFunction; importing it failed ({type(exc).__name__}: {exc}). fix: {INSTALL}"
            ) from exc
        try:
            version = importlib.metadata.version(DISTRIBUTION)
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
        _LIGER = Liger(apply=function.apply, version=version)
    return _LIGER


def forget_loaded() -> None:
    global _LIGER
    _LIGER = None


def refuse_unsupported(module: torch.nn.Module) -> None:
    """ValueError for a layer the kernel has no path for (the dispatch core never sends one: closed world)."""
    what = None
    if not getattr(module, "has_gate", True):
        what = "non-gated experts"
    elif has_custom_gate(module):
        what = "a custom gate function"
    elif activation_name(getattr(module, "act_fn", None)) != "silu":
        what = f"the activation {activation_name(getattr(module, 'act_fn', None))!r}"
    elif getattr(module, "has_bias", False):
        what = "expert biases"
    elif getattr(module, "has_post_expert_norm", False):
        what = "a post-expert norm"
    if what is not None:
        raise ValueError(
            f"experts backend 'liger' cannot run {what}: Liger's fused MoE runs SiLU-gated experts without bias "
            "(silu(gate) * up). fix: pick another experts backend for this layer, e.g. grouped_mm or triton_fused."
        )


def kernel_weights(module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2I, H] as [gate | up], down [E, H, I]), contiguous; copies cached once per set of weights."""
    up, down = module.gate_up_proj, module.down_proj
    transposed = bool(getattr(module, "is_transposed", False))
    interleaved = not getattr(module, "is_concatenated", True)
    if not transposed and not interleaved and up.is_contiguous() and down.is_contiguous():
        return up, down  # the kernel's own layout: no copy

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        w1 = up.transpose(1, 2) if transposed else up  # [E, 2I, H]
        w2 = down.transpose(1, 2) if transposed else down  # [E, H, I]
        if interleaved:  # [g0, u0, g1, u1, ...] -> [gate | up]
            w1 = torch.cat([w1[:, 0::2], w1[:, 1::2]], dim=1)
        return w1.contiguous(), w2.contiguous()

    # a kept copy would cut the weights' gradients: keep one only when none is wanted
    cacheable = not (torch.is_grad_enabled() and (up.requires_grad or down.requires_grad))
    return _WEIGHTS.get(module, fingerprint((up, down)) + (transposed, interleaved), build, cache=cacheable)


def liger_experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, H]
    refuse_unsupported(module)
    kernel = load_liger()
    num_tokens = top_k_index.shape[0]
    hidden = hidden_states.shape[-1]
    if num_tokens == 0:
        return hidden_states.new_zeros(0, hidden)
    w1, w2 = kernel_weights(module)
    x = hidden_states.to(w1.dtype)
    # bad slots -> expert 0 with weight NaN (selector.guard): the kernel reads no expert out of bounds
    ids, weights = sanitize_routing(module, top_k_index, top_k_weights)
    ids = ids.to(torch.int32)
    weights = weights.float()
    if layers.is_expert_parallel(module):
        sentinel = ids >= module.num_experts
        ids, weights = ids.masked_fill(sentinel, 0), weights.masked_fill(sentinel, 0.0)
    out = kernel.apply(x, w1, w2, ids.contiguous(), weights.contiguous())
    record_tuned(shape_key(hidden, w2.shape[2]))
    return out.to(hidden_states.dtype)
