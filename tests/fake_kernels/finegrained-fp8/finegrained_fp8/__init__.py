"""FAKE `kernels-community/finegrained-fp8` for CPU tests in tests/test_gpu_kernels_real.py: plain torch, the three entry
points Transformers 5.17 calls, with their signatures (matmul_2d, matmul_batched, matmul_grouped). Activations are
quantised per row and 128-wide group to e4m3 (dynamic, amax / 448) and weights dequantised with their block scales
by selector.quant's own helpers, products summed in float32. Says nothing about the real kernel's speed or numerics."""

from __future__ import annotations

import torch

from selector.quant import dequantize_fp8_block, quantize_activations


def _quantised(a: torch.Tensor, group: int) -> torch.Tensor:
    return quantize_activations(a, group)


def _dequantised(b: torch.Tensor, bs: torch.Tensor, block_size: list[int]) -> torch.Tensor:
    return dequantize_fp8_block(b, bs, tuple(block_size))


def matmul_2d(A, B, Bs, block_size, output_dtype=None, activation_scale=None):  # noqa: ANN001, ANN201
    return (_quantised(A, block_size[1]) @ _dequantised(B, Bs, block_size).T).to(output_dtype or A.dtype)


def matmul_batched(A, B, Bs, expert_ids, block_size, output_dtype=None):  # noqa: ANN001, ANN201
    """Row j through expert expert_ids[j]; rows of a sentinel expert (>= E) are left as garbage (as the real one)."""
    out = torch.full((A.shape[0], B.shape[1]), float("nan"))
    aq = _quantised(A, block_size[1])
    for j, e in enumerate(expert_ids.tolist()):
        if 0 <= e < B.shape[0]:
            out[j] = aq[j] @ _dequantised(B[e], Bs[e], block_size).T
    return out.to(output_dtype or A.dtype)


def matmul_grouped(A, B, Bs, offsets, tokens_per_expert, block_size, output_dtype=None):  # noqa: ANN001, ANN201
    """Rows sorted by expert; offsets[e] is the end row of expert e (inclusive cumsum); rows past the last are
    left as garbage."""
    out = torch.full((A.shape[0], B.shape[1]), float("nan"))
    aq = _quantised(A, block_size[1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = aq[start:end] @ _dequantised(B[e], Bs[e], block_size).T
        start = end
    return out.to(output_dtype or A.dtype)
