"""The routing guard the torch backends' forwards run first."""

from __future__ import annotations

import torch

from selector.guard import guard_routing


def guarded_routing(
    module: torch.nn.Module, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, drop: bool = False
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """`selector.guard.guard_routing` (ids and weights any backend can run, and whether the guard ran), on CUDA
    tensors through the one-launch Triton sanitiser (registered when its module is imported; dense CPU runs need
    no Triton)."""
    if top_k_index.is_cuda:
        import selector.plugins.triton_common.guard  # noqa: F401
    return guard_routing(module, top_k_index, top_k_weights, drop=drop)
