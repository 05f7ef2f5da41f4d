"""Quantised expert weights: FP8 (e4m3) with block scales and FP4 (e2m1) with UE8M0 group scales.

A quantised experts module is an ordinary Transformers-style experts module whose projections hold quantised
data, with the names Transformers' `FP8Experts` uses, plus `selector_*` attributes the ranking reads:

    gate_up_proj (or up_proj)       fp8: float8_e4m3fn [E, C, H]        fp4: int8 [E, C, H // 2]
    gate_up_proj_scale_inv          fp8: [E, rows, ceil(H / bk)]        fp4: [E, C, ceil(H / 32)]
    down_proj                       fp8: float8_e4m3fn [E, H, I]        fp4: int8 [E, H, I // 2]
    down_proj_scale_inv             fp8: [E, ceil(H / bn), ceil(I / bk)] fp4: [E, H, ceil(I / 32)]
    gate_up_proj_activation_scale   [E] float32, only with static activation quantisation (x_q = x / scale)
    down_proj_activation_scale      [E] float32, idem
    selector_weight_format          "fp8_block" | "fp4"
    selector_scale_format           "float32" | "ue8m0"
    selector_block_size             (bn, bk): fp8 (128, 128) by default; fp4 (1, 32)
    selector_activation_quant       "dynamic" | "static"
    selector_compute_dtype          the dtype activations and the intermediate run in (bf16 usually)

C is 2I for gated experts, I otherwise. Layout is always [E, out, in] (`is_transposed` False: a transposed
module is transposed when quantised). Scales are multipliers (`weight_scale_inv` in DeepSeek's naming:
w = q * scale). UE8M0 scales are stored as `torch.float8_e8m0fnu` (the same byte as a uint8 exponent with
bias 127; uint8 is accepted everywhere). FP4 packs two e2m1 codes per byte along the input dim, element 2j
in the low nibble, 2j+1 in the high one (Transformers' and DeepSeek-V4's order).

Gated, concatenated experts block gate and up separately: the gate_up scale grid is the gate's grid
[ceil(I / bn), .] followed by the up's, as DeepSeek checkpoints store `gate_proj` and `up_proj`. With I a
multiple of bn (every real model) that is the same as blocking the concatenated rows. Interleaved gate/up
(GPT-OSS style) and non-gated experts block their stored rows as they are.

Activations are quantised to e4m3 inside the kernels, per token and per group of `activation_group(fmt)`
channels (the block's k for FP8, 128 for FP4): scale = amax / 448 (1 where amax is 0), x_q = RNE(clamp(x /
scale)). Static quantisation divides by the expert's stored scale instead (and saturates at +-448).
`reference_forward` does the same in float64 from the dequantised weights: it is what the tests compare with.

Modules: ``formats`` (QuantFormat and its limits), ``codes`` (e4m3 / e2m1 / UE8M0 encode and decode of tensors),
``experts`` (quantise / dequantise an experts module in place), ``reference`` (activation quantisation as the
kernels do it and the float64 reference forward). This package re-exports their public names.
"""

from __future__ import annotations

from selector.quant.codes import (
                                  dequantize_fp4,
                                  dequantize_fp8_block,
                                  dequantize_weight,
                                  is_ue8m0_tensor,
                                  quantize_fp4,
                                  quantize_fp8_block,
                                  quantize_weight,
                                  scales_to_float,
                                  ue8m0_bytes,
                                  ue8m0_dtype,
                                  ue8m0_to_float,
                                  unpack_fp4,
)
from selector.quant.experts import (
                                  adopt_transformers_experts,
                                  bytes_per_weight,
                                  dequantize_experts,
                                  dequantized_weights,
                                  forget_caches,
                                  is_quantised,
                                  quant_format,
                                  quantize_experts,
                                  set_quantized,
                                  weight_bytes,
)
from selector.quant.formats import (
                                  ACTIVATION_QUANT,
                                  DEFAULT_FP8_BLOCK,
                                  E2M1_VALUES,
                                  FP4_ACTIVATION_GROUP,
                                  FP4_GROUP,
                                  FP4_MAX,
                                  FP8_DTYPE,
                                  FP8_MAX,
                                  SCALE_FORMATS,
                                  WEIGHT_FORMATS,
                                  QuantFormat,
                                  make_format,
)
from selector.quant.reference import (
                                  calibrate_activation_scales,
                                  expert_weights,
                                  quantize_activations,
                                  reference_forward,
)

__all__ = [
    "ACTIVATION_QUANT",
    "DEFAULT_FP8_BLOCK",
    "E2M1_VALUES",
    "FP4_ACTIVATION_GROUP",
    "FP4_GROUP",
    "FP4_MAX",
    "FP8_DTYPE",
    "FP8_MAX",
    "SCALE_FORMATS",
    "WEIGHT_FORMATS",
    "adopt_transformers_experts",
    "bytes_per_weight",
    "calibrate_activation_scales",
    "dequantize_experts",
    "dequantize_fp4",
    "dequantize_fp8_block",
    "dequantize_weight",
    "dequantized_weights",
    "expert_weights",
    "forget_caches",
    "is_quantised",
    "is_ue8m0_tensor",
    "make_format",
    "quant_format",
    "QuantFormat",
    "quantize_activations",
    "quantize_experts",
    "quantize_fp4",
    "quantize_fp8_block",
    "quantize_weight",
    "reference_forward",
    "scales_to_float",
    "set_quantized",
    "ue8m0_bytes",
    "ue8m0_dtype",
    "ue8m0_to_float",
    "unpack_fp4",
    "weight_bytes",
]
