"""Epilogue activations and gates of the experts GEMMs, selected by constexpr codes (selector.gates as data)."""

from __future__ import annotations

import triton
import triton.language as tl

# "none": a linear epilogue (the down projection, or an up projection whose activation runs in torch)
ACT_CODE: dict[str, int] = {"none": 0, "silu": 1, "gelu": 2, "gelu_tanh": 3, "relu": 4}
# selector.gates names -> the GATE constexpr of `gate`; 0 (act_mul) compiles to act(gate) * up, as before gates
GATE_CODE: dict[str, int] = {"act_mul": 0, "clamped_swiglu": 1}


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


@triton.jit
def gate(g, u, alpha, limit, ACT: tl.constexpr, GATE: tl.constexpr):
    """The gated epilogue on fp32 gate and up tiles (biases already added). GATE 1 is GPT-OSS's clamped SwiGLU,
    (clamp(u, -limit, limit) + 1) * g * sigmoid(alpha g) with g = min(g, limit); alpha and limit are runtime
    scalars, so one compile serves every layer's values. Else act(g) * u."""
    if GATE == 1:
        gc = tl.minimum(g, limit)
        uc = tl.minimum(tl.maximum(u, -limit), limit)
        y = (uc + 1.0) * (gc / (1.0 + tl.exp(-alpha * gc)))
    else:
        y = activation(g, ACT) * u
    return y
