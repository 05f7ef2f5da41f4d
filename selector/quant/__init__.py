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
"""

from __future__ import annotations

import copy
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
# chunk of experts quantised at once, to bound temporaries on big layers (DeepSeek-V3: 44M weights per expert)
_CHUNK_ELEMENTS = 1 << 28


def ue8m0_dtype() -> torch.dtype:
    """torch.float8_e8m0fnu where torch has it (>= 2.7), else uint8 holding the same exponent byte."""
    return getattr(torch, "float8_e8m0fnu", torch.uint8)


def is_ue8m0_tensor(t: torch.Tensor) -> bool:
    return t.dtype == torch.uint8 or t.dtype == getattr(torch, "float8_e8m0fnu", None)


def ue8m0_bytes(t: torch.Tensor) -> torch.Tensor:
    """The exponent bytes of a UE8M0 scale tensor (float8_e8m0fnu or uint8), as uint8."""
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def ue8m0_to_float(t: torch.Tensor) -> torch.Tensor:
    """2 ** (byte - 127) as float32 (byte 255 is NaN in e8m0; never written here)."""
    return torch.exp2(ue8m0_bytes(t).to(torch.float32) - 127.0)


def scales_to_float(scale: torch.Tensor) -> torch.Tensor:
    return ue8m0_to_float(scale) if is_ue8m0_tensor(scale) else scale.to(torch.float32)


def _pow2_to_ue8m0(exponent: torch.Tensor) -> torch.Tensor:
    """Integer exponents -> UE8M0 storage (bias 127, clamped to [1, 254])."""
    byte = (exponent + 127).clamp(1, 254).to(torch.uint8)
    dtype = ue8m0_dtype()
    return byte if dtype == torch.uint8 else byte.view(dtype)


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


# ----------------------------------------------------------------------------------------------------------------
# Tensor-level quantisation.
# ----------------------------------------------------------------------------------------------------------------


def _expert_chunks(w: torch.Tensor) -> Iterable[slice]:
    per = max(1, w[0].numel() if w.dim() == 3 else w.numel())
    step = max(1, _CHUNK_ELEMENTS // per) if w.dim() == 3 else 1
    total = w.shape[0] if w.dim() == 3 else 1
    for start in range(0, total, step):
        yield slice(start, min(total, start + step))


def _pad_to(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    pr, pc = rows - x.shape[-2], cols - x.shape[-1]
    return torch.nn.functional.pad(x, (0, pc, 0, pr)) if pr or pc else x


def _quantize_fp8_2(w: torch.Tensor, block: tuple[int, int], scale_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> e4m3 [..., N, K] and scales [..., ceil(N/bn), ceil(K/bk)]."""
    bn, bk = block
    n, k = w.shape[-2:]
    rn, rk = -(-n // bn), -(-k // bk)
    lead = w.shape[:-2]
    x = _pad_to(w.to(torch.float32), rn * bn, rk * bk).reshape(*lead, rn, bn, rk, bk)
    amax = x.abs().amax(dim=(-3, -1))  # [..., rn, rk]
    if scale_format == "ue8m0":
        # the smallest power of two that maps amax into range (as Transformers' Fp8Quantize rounds up)
        ratio = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
        exponent = torch.ceil(torch.log2(ratio)).to(torch.int32)
        exponent = torch.where(amax > 0, exponent, torch.zeros_like(exponent))
        stored = _pow2_to_ue8m0(exponent)
        scale = ue8m0_to_float(stored)
    else:
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        stored = scale
    q = (x / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*lead, rn * bn, rk * bk)[..., :n, :k]
    return q.contiguous(), stored.contiguous()


def quantize_fp8_block(
    weight: torch.Tensor, block_size: tuple[int, int] = DEFAULT_FP8_BLOCK, scale_format: str = "float32"
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 e4m3 with one scale per (bn x bk) block of [..., N, K]: returns (q, scale_inv), w ~= q * scale_inv.

    float32 scales are amax / 448; ue8m0 scales are that rounded up to a power of two. Zero blocks get scale 1.
    """
    if weight.dim() != 3:
        return _quantize_fp8_2(weight, tuple(block_size), scale_format)
    parts = [_quantize_fp8_2(weight[c], tuple(block_size), scale_format) for c in _expert_chunks(weight)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def dequantize_fp8_block(
    q: torch.Tensor, scale: torch.Tensor, block_size: tuple[int, int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """q [..., N, K] e4m3 times its block scales [..., ceil(N/bn), ceil(K/bk)] -> dtype."""
    bn, bk = block_size
    n, k = q.shape[-2:]
    s = scales_to_float(scale)
    s = s.repeat_interleave(bn, dim=-2)[..., :n, :].repeat_interleave(bk, dim=-1)[..., :k]
    return (q.to(torch.float32) * s).to(dtype)


def _round_e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """|v| <= 6 (float32) -> e2m1 codes 0..15, round to nearest, ties to the even code (OCP MX rounding)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=v.device)
    mag = v.abs().clamp(max=FP4_MAX)
    hi = torch.searchsorted(table, mag.contiguous()).clamp(max=7)  # first value >= mag
    lo = (hi - 1).clamp(min=0)
    d_lo, d_hi = mag - table[lo], table[hi] - mag
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (hi % 2 == 0))
    code = torch.where(pick_hi, hi, lo)
    sign = (v < 0) & (code > 0)
    return (code + 8 * sign.long()).to(torch.uint8)


def _quantize_fp4_2(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape[-2:]
    groups = -(-k // FP4_GROUP)
    lead = w.shape[:-2]
    x = _pad_to(w.to(torch.float32), n, groups * FP4_GROUP).reshape(*lead, n, groups, FP4_GROUP)
    amax = x.abs().amax(dim=-1)
    ratio = (amax / FP4_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    exponent = torch.ceil(torch.log2(ratio)).to(torch.int32)
    exponent = torch.where(amax > 0, exponent, torch.zeros_like(exponent))
    stored = _pow2_to_ue8m0(exponent)
    codes = _round_e2m1_codes(x / ue8m0_to_float(stored)[..., None]).reshape(*lead, n, groups * FP4_GROUP)[..., :k]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.view(torch.int8).contiguous(), stored.contiguous()


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """FP4 e2m1, two per int8 byte along K, one UE8M0 scale per 32 inputs: returns (packed [..., N, K/2], scale).

    The scale is the smallest power of two with amax / scale <= 6 (no value saturates); codes round to the
    nearest e2m1 value, ties to even. K must be even.
    """
    if weight.shape[-1] % 2:
        raise ValueError(f"fp4 packs two values per byte along the input dim: it must be even, got {weight.shape[-1]}")
    if weight.dim() != 3:
        return _quantize_fp4_2(weight)
    parts = [_quantize_fp4_2(weight[c]) for c in _expert_chunks(weight)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """int8 [..., N, K/2] -> float32 e2m1 values [..., N, K]."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=packed.device)
    u = packed.contiguous().view(torch.uint8)
    codes = torch.stack([u & 0xF, u >> 4], dim=-1).reshape(*u.shape[:-1], 2 * u.shape[-1])
    return table[codes.long()]


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    v = unpack_fp4(packed)
    s = scales_to_float(scale).repeat_interleave(FP4_GROUP, dim=-1)[..., : v.shape[-1]]
    return (v * s).to(dtype)


def quantize_weight(weight: torch.Tensor, fmt: QuantFormat) -> tuple[torch.Tensor, torch.Tensor]:
    if fmt.weight_format == "fp4":
        return quantize_fp4(weight)
    return quantize_fp8_block(weight, fmt.block_size, fmt.scale_format)


def dequantize_weight(
    q: torch.Tensor, scale: torch.Tensor, fmt: QuantFormat, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    if fmt.weight_format == "fp4":
        return dequantize_fp4(q, scale, dtype)
    return dequantize_fp8_block(q, scale, fmt.block_size, dtype)


# ----------------------------------------------------------------------------------------------------------------
# Experts modules.
# ----------------------------------------------------------------------------------------------------------------


def _up_name(module: torch.nn.Module) -> str:
    return "gate_up_proj" if getattr(module, "has_gate", True) else "up_proj"


def _split_gate_up(module: torch.nn.Module) -> bool:
    """Gated + concatenated: gate and up rows are blocked separately (see the module docstring)."""
    return bool(getattr(module, "has_gate", True)) and bool(getattr(module, "is_concatenated", True))


def is_quantised(module: torch.nn.Module) -> bool:
    """quant_format(module) is not None, without building the format (backends ask on every call)."""
    return getattr(module, "selector_weight_format", "dense") not in (None, "dense")


def quant_format(module: torch.nn.Module) -> QuantFormat | None:
    """The module's QuantFormat, or None for dense experts."""
    if not is_quantised(module):
        return None
    return QuantFormat(
        module.selector_weight_format,
        getattr(module, "selector_scale_format", None) or "float32",
        tuple(getattr(module, "selector_block_size", None) or DEFAULT_FP8_BLOCK),  # type: ignore[arg-type]
        getattr(module, "selector_activation_quant", "dynamic") or "dynamic",
    )


def forget_caches(module: torch.nn.Module) -> None:
    """Drop what the dispatch core and the backends cached about the module's weights (on a format change)."""
    from selector.dispatch import forget_module
    from selector.graphs import forget

    forget_module(module)
    forget(module)


def _set(module: torch.nn.Module, name: str, value: torch.Tensor | None) -> None:
    if name in module._parameters:
        del module._parameters[name]
    if name in module._buffers:
        del module._buffers[name]
    if hasattr(module, name):
        delattr(module, name)
    if value is not None:
        module.register_parameter(name, torch.nn.Parameter(value, requires_grad=False))


def _quantize_projection(w: torch.Tensor, fmt: QuantFormat, split: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, out, in] -> (q, scale); `split` = I blocks gate rows [0, I) and up rows [I, 2I) separately."""
    if split is None or fmt.weight_format == "fp4" or split % fmt.block_size[0] == 0:
        return quantize_weight(w, fmt)
    qg, sg = quantize_weight(w[:, :split], fmt)
    qu, su = quantize_weight(w[:, split:], fmt)
    return torch.cat([qg, qu], dim=1), torch.cat([sg, su], dim=1)


def _dequantize_projection(
    q: torch.Tensor, scale: torch.Tensor, fmt: QuantFormat, split: int | None, dtype: torch.dtype
) -> torch.Tensor:
    if split is None or fmt.weight_format == "fp4" or split % fmt.block_size[0] == 0:
        return dequantize_weight(q, scale, fmt, dtype)
    rows = -(-split // fmt.block_size[0])
    gate = dequantize_weight(q[:, :split], scale[:, :rows], fmt, dtype)
    up = dequantize_weight(q[:, split:], scale[:, rows:], fmt, dtype)
    return torch.cat([gate, up], dim=1)


def _inter_size(module: torch.nn.Module, up: torch.Tensor) -> int:
    return up.shape[1] // 2 if getattr(module, "has_gate", True) else up.shape[1]


def set_quantized(
    module: torch.nn.Module,
    fmt: QuantFormat,
    up_q: torch.Tensor,
    up_scale: torch.Tensor,
    down_q: torch.Tensor,
    down_scale: torch.Tensor,
    compute_dtype: torch.dtype,
    activation_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.nn.Module:
    """Put already quantised projections on a module ([E, out, in] layout) and mark its format."""
    name = _up_name(module)
    _set(module, name, up_q)
    _set(module, f"{name}_scale_inv", up_scale)
    _set(module, "down_proj", down_q)
    _set(module, "down_proj_scale_inv", down_scale)
    static = fmt.activation_quant == "static"
    if static and activation_scales is None:
        raise ValueError(
            "static activation quantisation needs per-expert activation scales: pass activation_scales= "
            "(see calibrate_activation_scales) or use activation_quant='dynamic'"
        )
    # on the weights' device: calibration may have run elsewhere, and the kernels read them beside the weights
    _set(module, "gate_up_proj_activation_scale", activation_scales[0].float().to(up_q.device) if static else None)
    _set(module, "down_proj_activation_scale", activation_scales[1].float().to(up_q.device) if static else None)
    module.is_transposed = False
    module.selector_weight_format = fmt.weight_format
    module.selector_scale_format = fmt.scale_format
    module.selector_block_size = tuple(fmt.block_size)
    module.selector_activation_quant = fmt.activation_quant
    module.selector_compute_dtype = compute_dtype
    # Transformers' FP8Experts attribute names, so its own code reads the module too
    module.block_size = None if fmt.weight_format == "fp4" else list(fmt.block_size)
    module.activation_scheme = fmt.activation_quant
    forget_caches(module)
    return module


@torch.no_grad()
def quantize_experts(
    module: torch.nn.Module,
    weight_format: str = "fp8_block",
    scale_format: str | None = None,
    block_size: Iterable[int] | None = None,
    activation_quant: str = "dynamic",
    activation_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.nn.Module:
    """Quantise a dense experts module in place (weights only; biases stay in the compute dtype).

    weight_format "fp8_block" (scale_format "float32" or "ue8m0", block (128, 128) by default) or "fp4"
    (UE8M0 scales per 32 inputs). activation_quant "static" needs activation_scales = (gate_up [E], down [E]).
    """
    if quant_format(module) is not None:
        raise ValueError("the experts are already quantised; dequantize_experts first")
    fmt = make_format(weight_format, scale_format, block_size, activation_quant)
    name = _up_name(module)
    up, down = getattr(module, name).detach(), module.down_proj.detach()
    compute_dtype = up.dtype
    if getattr(module, "is_transposed", False):
        up, down = up.transpose(1, 2), down.transpose(1, 2)
    split = _inter_size(module, up) if _split_gate_up(module) else None
    up_q, up_s = _quantize_projection(up, fmt, split)
    down_q, down_s = _quantize_projection(down, fmt, None)
    return set_quantized(module, fmt, up_q, up_s, down_q, down_s, compute_dtype, activation_scales)


def dequantized_weights(module: torch.nn.Module, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(up [E, C, H], down [E, H, I]) of a quantised module, dequantised to `dtype`."""
    fmt = quant_format(module)
    if fmt is None:
        raise ValueError("the experts are not quantised")
    name = _up_name(module)
    up_q, up_s = getattr(module, name), getattr(module, f"{name}_scale_inv")
    split = _inter_size(module, up_q) if _split_gate_up(module) else None
    up = _dequantize_projection(up_q, up_s, fmt, split, dtype)
    down = _dequantize_projection(module.down_proj, module.down_proj_scale_inv, fmt, None, dtype)
    return up, down


@torch.no_grad()
def dequantize_experts(module: torch.nn.Module, dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Turn a quantised experts module back into dense experts (in place), in `dtype` or its compute dtype."""
    fmt = quant_format(module)
    if fmt is None:
        return module
    dtype = dtype or getattr(module, "selector_compute_dtype", None) or torch.bfloat16
    up, down = dequantized_weights(module, dtype)
    name = _up_name(module)
    for attr in (f"{name}_scale_inv", "down_proj_scale_inv", "gate_up_proj_activation_scale", "down_proj_activation_scale"):
        _set(module, attr, None)
    _set(module, name, None)
    _set(module, "down_proj", None)
    module.register_parameter(name, torch.nn.Parameter(up))
    module.register_parameter("down_proj", torch.nn.Parameter(down))
    for attr in ("selector_scale_format", "selector_block_size", "selector_activation_quant", "selector_compute_dtype",
                 "block_size", "activation_scheme"):  # fmt: skip
        module.__dict__.pop(attr, None)
    module.selector_weight_format = "dense"
    forget_caches(module)
    return module


def adopt_transformers_experts(module: torch.nn.Module, compute_dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """Mark a Transformers `FP8Experts` module (fp8 or fp4 weights) with the selector_* attributes.

    Reads what Transformers stores: the weight dtype (float8_e4m3fn or int8 for fp4), the scale dtype
    (float32 or e8m0), `block_size` and `activation_scheme`.
    """
    name = _up_name(module)
    weight, scale = getattr(module, name), getattr(module, f"{name}_scale_inv")
    fp4 = weight.dtype in (torch.int8, torch.uint8)
    fmt = make_format(
        "fp4" if fp4 else "fp8_block",
        "ue8m0" if is_ue8m0_tensor(scale) else "float32",
        None if fp4 else (getattr(module, "block_size", None) or DEFAULT_FP8_BLOCK),
        getattr(module, "activation_scheme", "dynamic"),
    )
    module.selector_weight_format = fmt.weight_format
    module.selector_scale_format = fmt.scale_format
    module.selector_block_size = tuple(fmt.block_size)
    module.selector_activation_quant = fmt.activation_quant
    module.selector_compute_dtype = compute_dtype
    module.is_transposed = False
    forget_caches(module)
    return module


# ----------------------------------------------------------------------------------------------------------------
# Activation quantisation as the kernels do it, and a float64 reference.
# ----------------------------------------------------------------------------------------------------------------


def quantize_activations(x: torch.Tensor, group: int, static_scale: torch.Tensor | float | None = None) -> torch.Tensor:
    """What the kernels multiply with: e4m3(x / s) * s per row and `group` channels, in float32 (exactly).

    Dynamic: s = amax / 448 over the group (1 where amax is 0), computed in float32; x / s as x * (1 / s),
    both correctly rounded. Static: s is the given per-tensor scale and values beyond +-448 saturate.
    Both divisions take a tensor divisor: on CUDA torch divides by a Python scalar as a multiplication by its
    rounded reciprocal, one ulp off the correctly rounded quotient the kernels compute, and bf16 inputs sit on
    e4m3 ties often enough that this ulp flips codes (the reference computed on the H200 read 1.7-1.9e-2 from
    the CPU's, where the kernels read 2-3e-3: benchmarks/reference_device_check.py).
    """
    x = x.to(torch.float32)
    rows, k = x.shape
    groups = -(-k // group)
    xp = torch.nn.functional.pad(x, (0, groups * group - k)).reshape(rows, groups, group)
    if static_scale is None:
        amax = xp.abs().amax(dim=-1, keepdim=True)
        s = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    else:
        s = torch.as_tensor(static_scale, dtype=torch.float32, device=x.device).reshape(-1, 1, 1).expand(rows, 1, 1)
    r = torch.ones_like(s) / s
    q = (xp * r).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(torch.float32)
    return (q * s).reshape(rows, groups * group)[:, :k]


def expert_weights(module: torch.nn.Module, expert: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(up [C, H], down [H, I]) of one expert, dequantised (only that expert's slices are touched)."""
    fmt = quant_format(module)
    name = _up_name(module)
    up_q, down_q = getattr(module, name)[expert : expert + 1], module.down_proj[expert : expert + 1]
    if fmt is None:
        up, down = up_q.to(dtype), down_q.to(dtype)
        if getattr(module, "is_transposed", False):
            up, down = up.transpose(1, 2), down.transpose(1, 2)
        return up[0], down[0]
    up_s = getattr(module, f"{name}_scale_inv")[expert : expert + 1]
    down_s = module.down_proj_scale_inv[expert : expert + 1]
    split = _inter_size(module, up_q) if _split_gate_up(module) else None
    up = _dequantize_projection(up_q, up_s, fmt, split, dtype)
    down = _dequantize_projection(down_q, down_s, fmt, None, dtype)
    return up[0], down[0]


@torch.no_grad()
def reference_forward(
    module: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    quantize_activations_as_kernel: bool = True,
    intermediate_dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """float64 forward from the dequantised weights, expert by expert (on `device`, the CPU by default).

    With `quantize_activations_as_kernel` the inputs of both projections are quantised as the kernels do
    (`quantize_activations`, in float32, before the float64 math), so the remaining difference to a kernel is
    its fp32 accumulation order and the rounding of the intermediate to `intermediate_dtype` (default: the
    module's compute dtype), which the reference applies too.
    """
    from selector import layers

    fmt = quant_format(module)
    if fmt is None:
        raise ValueError("reference_forward is for quantised experts")
    inter_dtype = intermediate_dtype or getattr(module, "selector_compute_dtype", None) or hidden_states.dtype
    x = hidden_states.detach().to(device=device, dtype=inter_dtype)
    idx, wts = top_k_index.to(device), top_k_weights.detach().to(device=device, dtype=torch.float64)
    up_b, down_b = layers.up_bias(module), layers.down_bias(module)
    up_b = None if up_b is None else up_b.detach().to(device=device, dtype=torch.float64)
    down_b = None if down_b is None else down_b.detach().to(device=device, dtype=torch.float64)
    static = fmt.activation_quant == "static"
    norm = None
    if getattr(module, "has_post_expert_norm", False):
        norm = copy.deepcopy(module.post_expert_norm).to(device=device, dtype=torch.float64)
    out = torch.zeros(x.shape, dtype=torch.float64, device=device)
    group = fmt.activation_group
    for e in torch.unique(idx[(idx >= 0) & (idx < module.num_experts)]).tolist():
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        up, down = (t.to(device=device, dtype=torch.float64) for t in expert_weights(module, e))
        xe = x[tok]
        if quantize_activations_as_kernel:
            xe = quantize_activations(xe, group, module.gate_up_proj_activation_scale[e].to(device) if static else None)
        h = xe.double() @ up.T
        if up_b is not None:
            h = h + up_b[e]
        h = layers.activate(module, h).to(inter_dtype)
        if quantize_activations_as_kernel:
            h = quantize_activations(h, group, module.down_proj_activation_scale[e].to(device) if static else None)
        y = h.double() @ down.T
        if down_b is not None:
            y = y + down_b[e]
        if norm is not None:
            y = norm(y)
        out.index_add_(0, tok, y * wts[tok, slot, None])
    return out


@torch.no_grad()
def calibrate_activation_scales(
    module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert static activation scales (amax / 448 of each projection's input) from sample tokens.

    Works on a dense module (before quantising) or a quantised one (dequantised weights). Experts that get no
    sample token take the largest scale seen.
    """
    from selector import layers

    if quant_format(module) is not None:
        up, _ = dequantized_weights(module, torch.float32)
    else:
        up = getattr(module, _up_name(module)).detach().float()
        if getattr(module, "is_transposed", False):
            up = up.transpose(1, 2)
    up_b = layers.up_bias(module)
    x = hidden_states.detach().float().to(up.device)
    num_experts = up.shape[0]
    s1 = torch.zeros(num_experts)  # filled from host floats; set_quantized puts them beside the weights
    s2 = torch.zeros(num_experts)
    for e in range(num_experts):
        tok = torch.nonzero((top_k_index == e).any(dim=1), as_tuple=True)[0].to(up.device)
        if tok.numel() == 0:
            continue
        xe = x[tok]
        h = xe @ up[e].T
        if up_b is not None:
            h = h + up_b[e].float()
        h = layers.activate(module, h)
        s1[e] = xe.abs().max().item() / FP8_MAX
        s2[e] = h.abs().max().item() / FP8_MAX
    for s in (s1, s2):
        top = s.max().item()
        s[s == 0] = top if top > 0 else 1.0
    return s1, s2


def weight_bytes(module: torch.nn.Module) -> int:
    """Bytes of the expert weights and their scales as stored (what a decode step reads per expert hit x E)."""
    name = _up_name(module)
    total = 0
    for attr in (name, f"{name}_scale_inv", "down_proj", "down_proj_scale_inv"):
        t = getattr(module, attr, None)
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


def bytes_per_weight(fmt: QuantFormat | None, dense_dtype: torch.dtype = torch.bfloat16) -> float:
    """Bytes per weight element including the scales (fp8 128x128 float32: 1 + 4/16384; fp4: 0.5 + 1/32)."""
    if fmt is None:
        return torch.empty(0, dtype=dense_dtype).element_size()
    bn, bk = fmt.block_size
    scale = 1 if fmt.scale_format == "ue8m0" else 4
    return (0.5 if fmt.weight_format == "fp4" else 1.0) + scale / (bn * bk)


__all__ = [
    "DEFAULT_FP8_BLOCK",
    "FP4_GROUP",
    "FP8_MAX",
    "QuantFormat",
    "adopt_transformers_experts",
    "bytes_per_weight",
    "calibrate_activation_scales",
    "dequantize_experts",
    "dequantize_fp4",
    "dequantize_fp8_block",
    "dequantized_weights",
    "expert_weights",
    "make_format",
    "quant_format",
    "quantize_activations",
    "quantize_experts",
    "quantize_fp4",
    "quantize_fp8_block",
    "reference_forward",
    "set_quantized",
    "unpack_fp4",
    "weight_bytes",
]
