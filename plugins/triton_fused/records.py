"""Host-side records of a dense fused layer: what its launches read, built and checked once per set of weights
(a backend's plan, or one ``fused_experts`` call) rather than spelled out as loose arguments on every launch. A
@triton.jit kernel's signature and the custom op's schema stay flat (Triton and torch bind them positionally):
the launchers unpack these records into their arguments."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from selector.plugins.triton_common.activation import ACT_CODE, GATE_CODE

from .configs import LayerShape

SUPPORTED_ACTIVATIONS: frozenset[str] = frozenset({"silu", "gelu", "gelu_tanh", "relu"})
SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset({torch.bfloat16, torch.float16, torch.float32})
SUPPORTED_GATES: frozenset[str] = frozenset(GATE_CODE)  # selector.gates names the gated epilogue runs


@dataclass(frozen=True, slots=True)
class Gemm:
    """One of the layer's two GEMMs as its launches read it: weights [E, channels, K] as stored (addressed through
    the strides of their output channels and of K, so transposed storage needs no copy), the bias [E, channels],
    and the epilogue: gated (gate rows, then up rows from `up_offset`, or interleaved), the activation and gate
    codes of triton_common.activation with the clamped SwiGLU's alpha and limit."""

    w: torch.Tensor
    bias: torch.Tensor | None
    n_out: int  # output channels: I for gate_up, H for down
    k_dim: int
    stride_wn: int
    stride_wk: int
    up_offset: int = 0
    gated: bool = False
    interleaved: bool = False
    act: int = 0
    gate: int = 0
    gate_alpha: float = 1.0
    gate_limit: float = 0.0


@dataclass(frozen=True, slots=True)
class FusedLayer:
    """A whole dense layer: its tensors and flags as ``fused_experts`` takes them, and the two GEMMs' records.

    Weights as a Transformers experts module stores them: gate_up [E, 2I, H] ([E, H, 2I] transposed; [E, I, H]
    not gated), down [E, H, I] ([E, I, H] transposed), biases [E, 2I] (or [E, I]) and [E, H]."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None
    down_bias: torch.Tensor | None
    num_experts: int
    activation: str
    gated: bool
    interleaved: bool  # as given; the epilogue pairs channels only when gated too
    transposed: bool
    gate: str
    gate_alpha: float | None
    gate_limit: float | None
    up: Gemm
    dn: Gemm
    shape: LayerShape  # what the tile configuration is looked up by

    @property
    def hidden(self) -> int:
        return self.dn.n_out

    @property
    def inter(self) -> int:
        return self.up.n_out

    @property
    def dtype(self) -> torch.dtype:
        return self.gate_up.dtype


def layer_dims(gate_up: torch.Tensor, down: torch.Tensor, transposed: bool) -> tuple[int, int, tuple, tuple]:
    """(I, gate_up output channels, gate_up's (channel, K) strides, down's) from the stored layouts."""
    if transposed:  # gate_up [E, H, C], down [E, I, H]
        return down.shape[1], gate_up.shape[2], (gate_up.stride(2), gate_up.stride(1)), (down.stride(2), down.stride(1))
    # gate_up [E, C, H], down [E, H, I]
    return down.shape[2], gate_up.shape[1], (gate_up.stride(1), gate_up.stride(2)), (down.stride(1), down.stride(2))


def fused_layer(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    *,
    num_experts: int,
    activation: str = "silu",
    gated: bool = True,
    interleaved: bool = False,
    transposed: bool = False,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    gate: str = "act_mul",
    gate_alpha: float | None = None,
    gate_limit: float | None = None,
) -> FusedLayer:
    """The record of a layer, its weights checked once (shapes, dtypes, devices, biases, gate and activation);
    raises ValueError naming what does not fit."""
    _check_gate(gate, gate_alpha, gate_limit, gated)
    if activation not in SUPPORTED_ACTIVATIONS and (gate == "act_mul" or not gated):
        raise ValueError(
            f"triton_fused: activation {activation!r} is not supported; supported: {sorted(SUPPORTED_ACTIVATIONS)}"
        )
    if gate_up.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"triton_fused: dtype {gate_up.dtype} is not supported; supported: bf16, fp16, fp32")
    for name, w in (("gate_up_proj", gate_up), ("down_proj", down)):
        if w.dim() != 3:
            raise ValueError(f"triton_fused: {name} must be 3-D [E, ., .], got shape {tuple(w.shape)}")
        if w.dtype != gate_up.dtype:
            raise ValueError(f"triton_fused: {name} dtype {w.dtype} differs from gate_up_proj {gate_up.dtype}")
        if w.shape[0] != num_experts:
            raise ValueError(f"triton_fused: {name} has {w.shape[0]} experts, num_experts={num_experts}")
        if w.device != gate_up.device:
            raise ValueError(f"triton_fused: {name} is on {w.device}, gate_up_proj on {gate_up.device}")
    i_dim, c1, (s1n, s1k), (s2n, s2k) = layer_dims(gate_up, down, transposed)
    h = gate_up.shape[1] if transposed else gate_up.shape[2]
    h_out = down.shape[2] if transposed else down.shape[1]
    if c1 != (2 * i_dim if gated else i_dim) or h_out != h:
        raise ValueError(
            f"triton_fused: weight shapes do not fit: gate_up_proj {tuple(gate_up.shape)}, down_proj "
            f"{tuple(down.shape)} (gated={gated}, transposed={transposed})"
        )
    if gate_up_bias is not None and tuple(gate_up_bias.shape) != (num_experts, c1):
        raise ValueError(f"triton_fused: gate_up_bias must be [{num_experts}, {c1}], got {tuple(gate_up_bias.shape)}")
    if down_bias is not None and tuple(down_bias.shape) != (num_experts, h):
        raise ValueError(f"triton_fused: down_bias must be [{num_experts}, {h}], got {tuple(down_bias.shape)}")
    pairs = interleaved and gated
    gate_code = GATE_CODE[gate] if gated else 0
    up = Gemm(
        gate_up,
        gate_up_bias,
        i_dim,
        h,
        s1n,
        s1k,
        up_offset=i_dim,
        gated=gated,
        interleaved=pairs,
        act=ACT_CODE[activation] if gate_code == 0 else 0,  # the clamped SwiGLU brings its own activation
        gate=gate_code,
        gate_alpha=1.0 if gate_alpha is None else float(gate_alpha),
        gate_limit=0.0 if gate_limit is None else float(gate_limit),
    )
    dn = Gemm(down, down_bias, h, i_dim, s2n, s2k)
    shape = LayerShape(num_experts, h, i_dim, gate_up.dtype, gated, transposed, pairs)
    return FusedLayer(
        gate_up,
        down,
        gate_up_bias,
        down_bias,
        num_experts,
        activation,
        gated,
        interleaved,
        transposed,
        gate,
        gate_alpha,
        gate_limit,
        up,
        dn,
        shape,
    )


def check_call(
    layer: FusedLayer, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> None:
    """One call's inputs against the layer (the dispatch core checks these itself before a plan runs)."""
    if hidden_states.dtype != layer.dtype:
        raise ValueError(
            f"triton_fused: gate_up_proj dtype {layer.dtype} differs from hidden_states {hidden_states.dtype}"
        )
    if hidden_states.dim() != 2:
        raise ValueError(f"triton_fused: hidden_states must be [T, H], got shape {tuple(hidden_states.shape)}")
    if layer.gate_up.device != hidden_states.device:
        raise ValueError(
            f"triton_fused: gate_up_proj is on {layer.gate_up.device}, hidden_states on {hidden_states.device}"
        )
    t, h = hidden_states.shape
    if h != layer.hidden:
        raise ValueError(
            "triton_fused: weight shapes do not fit: hidden_states "
            f"{tuple(hidden_states.shape)}, gate_up_proj {tuple(layer.gate_up.shape)}, down_proj "
            f"{tuple(layer.down.shape)} (gated={layer.gated}, transposed={layer.transposed})"
        )
    if top_k_index.dim() != 2 or top_k_index.shape[0] != t or top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"triton_fused: top_k_index {tuple(top_k_index.shape)} and top_k_weights {tuple(top_k_weights.shape)}"
            f" must both be [T={t}, k]"
        )
    if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
        raise ValueError(f"triton_fused: top_k_index must be an integer tensor, got {top_k_index.dtype}")


def _check_gate(gate: str, gate_alpha: float | None, gate_limit: float | None, gated: bool) -> None:
    if gate not in SUPPORTED_GATES:
        raise ValueError(f"triton_fused: gate {gate!r} is not supported; supported: {sorted(SUPPORTED_GATES)}")
    if gate == "act_mul":
        return
    if not gated:
        raise ValueError(f"triton_fused: gate {gate!r} needs gated experts (gate_up_proj holds gate and up)")
    for name, value in (("gate_alpha", gate_alpha), ("gate_limit", gate_limit)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"triton_fused: gate {gate!r} needs a finite number {name}, got {value!r}")
