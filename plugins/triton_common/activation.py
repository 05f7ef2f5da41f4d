"""Epilogue activations of the experts GEMMs, selected by a constexpr code."""

from __future__ import annotations

import triton
import triton.language as tl

# "none": a linear epilogue (the down projection, or an up projection whose activation runs in torch)
ACT_CODE: dict[str, int] = {"none": 0, "silu": 1, "gelu": 2, "gelu_tanh": 3, "relu": 4}


@triton.jit
def activation(x, ACT: tl.constexpr):
    if ACT == 1:  # silu
        y = x / (1.0 + tl.exp(-x))
    elif ACT == 2:  # gelu (erf)
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 3:  # gelu, tanh approximation; tanh(z) = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        y = x / (1.0 + tl.exp(-2.0 * z))
    elif ACT == 4:  # relu
        y = tl.maximum(x, 0.0)
    else:
        y = x
    return y
