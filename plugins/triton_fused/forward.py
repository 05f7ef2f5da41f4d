"""Adapter from a Transformers-style experts module to the fused Triton kernel."""

from __future__ import annotations

import torch

from plugins.triton_fused.kernels import fused_experts
from selector import layers
from selector.problem import activation_name


def triton_fused_experts_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,  # [T, H]
    top_k_index: torch.Tensor,  # [T, k]
    top_k_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, H]
    up_w = layers.up_weight(module)
    return fused_experts(
        hidden_states.to(up_w.dtype),
        up_w,
        module.down_proj,
        top_k_index,
        top_k_weights,
        num_experts=module.num_experts,
        activation=activation_name(module.act_fn),
        gated=getattr(module, "has_gate", True),
        interleaved=not getattr(module, "is_concatenated", True),
        transposed=getattr(module, "is_transposed", False),
        gate_up_bias=layers.up_bias(module),
        down_bias=layers.down_bias(module),
    ).to(hidden_states.dtype)
