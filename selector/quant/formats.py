"""Quantised formats: what a `QuantFormat` holds, its defaults and limits (the element codes: codes.py)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP4_MAX = 6.0
FP4_GROUP = 32
FP4_ACTIVATION_GROUP = 128
DEFAULT_FP8_BLOCK = (128, 128)
WEIGHT_FORMATS = ("fp8_block", "fp4")
SCALE_FORMATS = ("float32", "ue8m0")
ACTIVATION_QUANT = ("dynamic", "static")
# e2m1 magnitudes by code (bit 3 is the sign)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


@dataclass(frozen=True)
class QuantFormat:
    """How one experts module is quantised."""

    weight_format: str  # "fp8_block" | "fp4"
    scale_format: str  # "float32" | "ue8m0"
    block_size: tuple[int, int]  # (n, k): rows x input channels sharing one scale
    activation_quant: str = "dynamic"

    def __post_init__(self) -> None:
        if self.weight_format not in WEIGHT_FORMATS:
            raise ValueError(f"weight format {self.weight_format!r}: expected one of {WEIGHT_FORMATS}")
        if self.scale_format not in SCALE_FORMATS:
            raise ValueError(f"scale format {self.scale_format!r}: expected one of {SCALE_FORMATS}")
        if self.activation_quant not in ACTIVATION_QUANT:
            raise ValueError(f"activation quantisation {self.activation_quant!r}: expected one of {ACTIVATION_QUANT}")
        bn, bk = self.block_size
        if self.weight_format == "fp4":
            if (bn, bk) != (1, FP4_GROUP):
                raise ValueError(f"fp4 weights use one scale per row and {FP4_GROUP} inputs: block (1, 32), got {self.block_size}")
            if self.scale_format != "ue8m0":
                raise ValueError("fp4 weights take UE8M0 (power-of-two) scales; float32 scales are not supported")
        elif bn < 1 or bk not in (32, 64, 128, 256):
            raise ValueError(
                f"fp8 block size {self.block_size}: the input-channel block must be 32, 64, 128 or 256 "
                "(it is also the activation quantisation group and the kernels' K tile)"
            )

    @property
    def activation_group(self) -> int:
        """Channels per activation scale: the block's k for FP8, 128 for FP4 (DeepSeek-V4 style)."""
        return FP4_ACTIVATION_GROUP if self.weight_format == "fp4" else self.block_size[1]


def make_format(
    weight_format: str,
    scale_format: str | None = None,
    block_size: Iterable[int] | None = None,
    activation_quant: str = "dynamic",
) -> QuantFormat:
    """Fill the defaults: fp8 -> float32 scales, 128x128 blocks; fp4 -> ue8m0, 1x32."""
    aliases = {"fp8": "fp8_block", "float": "float32", "fp32": "float32"}
    weight_format = aliases.get(weight_format, weight_format)
    if scale_format is not None:
        scale_format = aliases.get(scale_format, scale_format)
    if weight_format == "fp4":
        return QuantFormat("fp4", scale_format or "ue8m0", (1, FP4_GROUP), activation_quant)
    block = tuple(int(b) for b in block_size) if block_size is not None else DEFAULT_FP8_BLOCK
    if len(block) != 2:
        raise ValueError(f"block size must be (n, k), got {block}")
    return QuantFormat(weight_format, scale_format or "float32", block, activation_quant)  # type: ignore[arg-type]
