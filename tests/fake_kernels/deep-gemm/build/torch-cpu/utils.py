"""FAKE deep_gemm.utils: per-row FP8 activation quantisation, as DeepGEMM documents it (torch only)."""

from __future__ import annotations

import torch


def ceil_to_ue8m0(x: torch.Tensor) -> torch.Tensor:
    """Round positive float32 scales up to a power of two."""
    return torch.exp2(torch.ceil(torch.log2(x.float())))


def pack_ue8m0_to_int(x: torch.Tensor) -> torch.Tensor:
    """float32 powers of two [..., n] (n % 4 == 0) -> their exponent bytes packed four to an int32 [..., n/4]."""
    assert x.dtype == torch.float32 and x.shape[-1] % 4 == 0
    bits = x.contiguous().view(torch.int32)
    # rows the kernel left uncomputed are NaN (see __init__); every finite scale must be a power of two
    assert (bits[torch.isfinite(x)] & ((1 << 23) - 1) == 0).all(), "UE8M0 scales must be powers of two"
    return (bits >> 23).to(torch.uint8).view(torch.int32)


def per_token_cast_to_fp8(x: torch.Tensor, use_ue8m0: bool, gran_k: int = 128, use_packed_ue8m0: bool = False):
    """x [M, K] -> (FP8 e4m3 [M, K], scales [M, ceil(K / gran_k)]); scales float32, or packed UE8M0 int32."""
    assert x.dim() == 2
    m, n = x.shape
    padded = -(-n // gran_k) * gran_k
    view = torch.nn.functional.pad(x.float(), (0, padded - n)).view(m, padded // gran_k, gran_k)
    sf = view.abs().amax(dim=2).clamp(min=1e-4) / 448.0
    if use_ue8m0:
        sf = ceil_to_ue8m0(sf)
    q = (view / sf.unsqueeze(2)).to(torch.float8_e4m3fn).view(m, padded)[:, :n].contiguous()
    return q, pack_ue8m0_to_int(sf) if use_packed_ue8m0 else sf
