"""Host-side records of a quantised layer: what its launches read from the module, built once per set of weights
(the forward's cached plan) rather than on every call. A @triton.jit kernel's signature stays flat (Triton binds
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
class QuantLayer:
    """A whole quantised layer: both projections' tensors, their storage format and the gate_up epilogue."""

    up: QuantWeights
    down: QuantWeights
    fmt: WeightFormat
    up_epilogue: Epilogue


def quant_layer(w1: torch.Tensor, s1: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, b1: torch.Tensor | None,
                b2: torch.Tensor | None, as1: torch.Tensor | None, as2: torch.Tensor | None, *, num_experts: int,
                activation: str, gated: bool, interleaved: bool, fp4: bool, ue8m0: bool, block_n: int,
                block_k: int) -> QuantLayer:  # fmt: skip
    """The record of a layer given as flat tensors and flags (the custom op's schema, the public ``quant_experts``)."""
    split = (w1.shape[1] // 2) if gated and not interleaved else None
    return QuantLayer(
        QuantWeights(w1, s1, b1, as1),
        QuantWeights(w2, s2, b2, as2),
        WeightFormat(num_experts, fp4, ue8m0, block_n, block_k),
        Epilogue(gated, interleaved, activation, split),
    )
