"""Test helpers, from the package's own testing module (what plugin authors use too)."""

from selector.testing import (  # noqa: F401
    TOLERANCE,
    Layout,
    clamped_swiglu,
    make_experts,
    random_routing,
    reference_experts,
    relative_error,
)


def same_rows(a, b) -> bool:  # noqa: ANN001
    """Bit for bit on a GPU. In the Triton interpreter within float32 rounding: its dot is numpy's matmul, whose
    OpenBLAS kernel (chosen per CPU) rounds a row differently by its place in the tile and the tile's height."""
    import torch

    if a.is_cuda:
        return torch.equal(a, b)
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5)
