"""Host-side records of a quantised layer: what its launches read from the module, built once per set of weights
(a backend's plan) rather than on every call. A @triton.jit kernel's signature stays flat (Triton binds
scalars and pointers positionally): the launchers unpack these records into the launch arguments."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class WeightFormat:
    """How a layer's expert weights are stored."""

    num_experts: int
    fp4: bool  # e2m1 packed two per byte with UE8M0 group scales; else e4m3 with block scales
    ue8m0: bool  # scales are UE8M0 exponent bytes (else float32)
    block_n: int  # output rows sharing one fp8 weight scale
    block_k: int  # input channels per weight scale and per activation group: the kernels' K tile


@dataclass(frozen=True, slots=True)
class QuantWeights:
    """One projection's stored tensors: w [E, C, K] (fp4: [E, C, K / 2] bytes), its scales, an optional bias [E, C]
    and, with static activation quantisation, one activation scale per expert [E]."""

    w: torch.Tensor
    s: torch.Tensor
    bias: torch.Tensor | None = None
    act_scale: torch.Tensor | None = None


@dataclass(frozen=True, slots=True)
class Epilogue:
    """What a projection's kernel does with its sums: act(gate) * up over concatenated (gate rows first) or
    interleaved channels, or a plain activation ("none": linear). `split_inter` (gated + concatenated): I, where the
    up half's scale rows restart."""

    gated: bool = False
    interleaved: bool = False
    activation: str = "none"
    split_inter: int | None = None


LINEAR = Epilogue()


@dataclass(frozen=True, slots=True)
class Projection:
    """One projection as its launches read it: its tensors, their storage format and the epilogue."""

    weights: QuantWeights
    fmt: WeightFormat
    epilogue: Epilogue = LINEAR


@dataclass(frozen=True, slots=True)
class QuantLayer:
    """A whole quantised layer: the gate_up projection (its epilogue the layer's gate or activation) and the down
    projection (linear), sharing one storage format."""

    up_projection: Projection
    down_projection: Projection

    @property
    def up(self) -> QuantWeights:
        return self.up_projection.weights

    @property
    def down(self) -> QuantWeights:
        return self.down_projection.weights

    @property
    def fmt(self) -> WeightFormat:
        return self.up_projection.fmt

    @property
    def up_epilogue(self) -> Epilogue:
        return self.up_projection.epilogue


def up_epilogue(up: QuantWeights, *, activation: str, gated: bool, interleaved: bool) -> Epilogue:
    """The gate_up epilogue; gated + concatenated channels: I, where the up half's scale rows restart."""
    split = (up.w.shape[1] // 2) if gated and not interleaved else None
    return Epilogue(gated, interleaved, activation, split)


def quant_layer(up: QuantWeights, down: QuantWeights, fmt: WeightFormat, epilogue: Epilogue) -> QuantLayer:
    """The record of a layer from its projections' tensors, their format and the gate_up epilogue."""
    return QuantLayer(Projection(up, fmt, epilogue), Projection(down, fmt, LINEAR))
