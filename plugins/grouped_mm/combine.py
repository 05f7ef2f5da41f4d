"""grouped_mm's combine on a GPU: out[t] = sum over token t's k slots of weight * its row of the expert-sorted
output, in one Triton launch (plus a small one that inverts the sort), instead of the torch tail (weight gather,
fp32 product, scatter back, sum, cast: five launches and three full passes over the [T*k, H] rows).

A slot whose id lies outside [0, E) (the expert-parallel sentinel, or a slot the routing guard dropped) was in no
matmul: its row was never written, and it contributes 0 * weight, which is 0 for a finite weight and NaN for the
NaN the guard gives a bad slot; that is how a faulty token's row turns NaN while no other row changes, with no
pass over the output on a clean call.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - grouped_mm runs without Triton (the torch tail)
    triton = None

INVERT_BLOCK = 1024

if triton is not None:
    from selector.plugins.triton_common.launch import cdiv, launch, next_pow2

    @triton.jit(do_not_specialize=["n"])
    def _invert_kernel(order_ptr, inv_ptr, n, BLOCK: tl.constexpr):
        """inv[order[i]] = i: where each (token, slot) pair's row sits in the expert-sorted rows."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        dest = tl.load(order_ptr + offs, mask=ok, other=0)
        tl.store(inv_ptr + dest, offs, mask=ok)

    @triton.jit
    def _weighted_combine_kernel(h_ptr, inv_ptr, ids_ptr, w_ptr, out_ptr, H, top_k, num_experts, stride_h, stride_o,
                                 BLOCK_H: tl.constexpr, K_PAD: tl.constexpr):  # fmt: skip
        """out[t, block] = sum_j w[t, j] * h[inv[t*k + j], block] in fp32; rows of ids outside [0, E) read as 0."""
        t = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = offs < H
        j = tl.arange(0, K_PAD)
        j_ok = j < top_k
        slots = t.to(tl.int64) * top_k + j
        e = tl.load(ids_ptr + slots, mask=j_ok, other=-1)
        w = tl.load(w_ptr + slots, mask=j_ok, other=0.0).to(tl.float32)
        row = tl.load(inv_ptr + slots, mask=j_ok, other=0).to(tl.int64)
        ok = j_ok & (e >= 0) & (e < num_experts)
        v = tl.load(h_ptr + row[:, None] * stride_h + offs[None, :], mask=ok[:, None] & h_ok[None, :], other=0.0)
        acc = tl.sum(v.to(tl.float32) * w[:, None], axis=0)
        tl.store(out_ptr + t.to(tl.int64) * stride_o + offs, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


def available(h: torch.Tensor, weights: torch.Tensor) -> bool:
    """Whether the Triton combine can stand in for the torch tail: eager CUDA without autograd through it (the
    kernel has no backward) and not while torch.compile traces (inductor fuses the torch tail itself)."""
    if triton is None or not h.is_cuda or torch.compiler.is_compiling():
        return False
    return not (torch.is_grad_enabled() and (h.requires_grad or weights.requires_grad))


def weighted_combine(h: torch.Tensor, order: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                     num_tokens: int, num_experts: int, dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """[T, H] in `dtype`: h [T*k, H] rows sorted by expert (`order` the sort's permutation), ids and weights [T*k]
    in (token, slot) order."""
    n, hidden = h.shape[0], h.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=dtype, device=h.device)
    if num_tokens == 0 or n == 0:
        return out.zero_()
    top_k = n // num_tokens
    h = h if h.stride(1) == 1 else h.contiguous()
    order = order.contiguous()
    ids, weights = ids.contiguous(), weights.contiguous()
    inv = torch.empty(n, dtype=torch.int32, device=h.device)
    block = min(INVERT_BLOCK, max(16, next_pow2(n)))
    launch(_invert_kernel, (cdiv(n, block),), (order, inv, n), dict(BLOCK=block), 1 if block <= 128 else 4)
    k_pad = max(2, next_pow2(top_k))
    block_h = min(max(128, 8192 // k_pad), max(128, next_pow2(hidden)))
    launch(
        _weighted_combine_kernel, (num_tokens, cdiv(hidden, block_h)),
        (h, inv, ids, weights, out, hidden, top_k, num_experts, h.stride(0), out.stride(0)),
        dict(BLOCK_H=block_h, K_PAD=k_pad), 4,
    )  # fmt: skip
    return out
