"""Gather + bmm. Memory: T x k x (weights of one expert) of temporaries."""

from __future__ import annotations

import torch

from selector import layers
from selector.plugins.torch_common.routing import guarded_routing


def _bmm_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    # x [S, in]; weight [S, out, in] (or [S, in, out] transposed)
    if transposed:
        out = torch.bmm(x.unsqueeze(1), weight).squeeze(1)
    else:
        out = torch.bmm(weight, x.unsqueeze(-1)).squeeze(-1)
    return out + bias if bias is not None else out


def batched_mm_experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, H]
    num_tokens, top_k = top_k_index.shape
    transposed = getattr(module, "is_transposed", False)
    up_w = layers.up_weight(module)
    # bad slots -> expert 0 with weight NaN: an out-of-range id would trip a device assert in the gather; every
    # slot is its own bmm batch entry, so the expert a bad slot computes on changes no other slot's bits
    top_k_index, top_k_weights, _ = guarded_routing(module, top_k_index, top_k_weights)
    ids = top_k_index.reshape(-1)  # [S], S = T * k
    weights = top_k_weights.reshape(-1).float()
    if layers.is_expert_parallel(module):
        # sentinel slots compute on expert 0 (in bounds) and are zeroed by their weight
        sentinel = ids >= module.num_experts
        weights = weights.masked_fill(sentinel, 0.0)
        ids = ids.clamp(max=module.num_experts - 1)
    x = hidden_states.to(up_w.dtype).repeat_interleave(top_k, dim=0)  # [S, H]

    up_b, down_b = layers.up_bias(module), layers.down_bias(module)
    h = _bmm_linear(x, up_w[ids], None if up_b is None else up_b[ids], transposed)
    h = layers.activate(module, h)
    h = _bmm_linear(h, module.down_proj[ids], None if down_b is None else down_b[ids], transposed)
    h = layers.post_norm(module, h)
    out = (h.float() * weights.unsqueeze(-1)).view(num_tokens, top_k, h.shape[-1]).sum(dim=1)
    return out.to(hidden_states.dtype)
