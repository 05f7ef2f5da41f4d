"""Element codes and tensor-level quantisation: e4m3 with block scales, e2m1 packed two per byte with UE8M0 group
scales, and the UE8M0 exponent bytes themselves (encode and decode)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from selector.quant.formats import DEFAULT_FP8_BLOCK, E2M1_VALUES, FP4_GROUP, FP4_MAX, FP8_DTYPE, FP8_MAX, QuantFormat

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
