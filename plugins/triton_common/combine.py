"""Deterministic combine: out[t] = the sum of token t's k slot rows, fixed order, fp32 accumulation, no atomics.
Sentinel slots (ids outside [0, E): expert parallelism) are skipped. With a routing guard (selector.guard) a token
with a bad slot (an id outside [0, E) other than the expert-parallel sentinel, or a NaN / infinite weight) gets
a NaN row instead: the fault shows in that token's output, and in no other token's."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from selector.guard import RoutingGuard

from .launch import cdiv, launch, next_pow2


@triton.jit
def _combine_kernel(
    y_ptr,
    ids_ptr,
    out_ptr,
    H,
    top_k,
    num_experts,
    stride_ym,
    stride_om,
    stride_ys,
    w_ptr,
    limit,
    BLOCK_H: tl.constexpr,
    K_PAD: tl.constexpr,
    SPLIT: tl.constexpr,
    GUARD: tl.constexpr,
):
    """out[t] = sum_j y[t*k + j] over the non-sentinel slots; all k rows loaded at once, fixed-shape fp32 sum.
    SPLIT > 1: y holds that many partial sums per row (split K), at y + s * stride_ys, added in a fixed order."""
    t = tl.program_id(0)
    pid_h = tl.program_id(1)
    offs = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs < H
    j = tl.arange(0, K_PAD)
    j_ok = j < top_k
    rows = t * top_k + j
    e = tl.load(ids_ptr + rows, mask=j_ok, other=-1)
    ok = j_ok & (e >= 0) & (e < num_experts)
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        # the rows are read whatever the ids say (every slot's row exists), so this load does not wait for the
        # ids load; a sentinel slot's unwritten row (any bits, NaN included) is then dropped by the select
        v = tl.load(
            y_ptr + s * stride_ys + rows.to(tl.int64)[:, None] * stride_ym + offs[None, :],
            mask=j_ok[:, None] & h_ok[None, :],
            other=0.0,
        )
        acc += tl.sum(tl.where(ok[:, None], v.to(tl.float32), 0.0), axis=0)
    if GUARD:  # a bad slot poisons its token's row (the align guard counted it)
        w = tl.load(w_ptr + rows, mask=j_ok, other=0.0).to(tl.float32)
        bad = j_ok & ((e < 0) | (e >= limit) | ~(tl.abs(w) < float("inf")))
        acc = tl.where(tl.max(bad.to(tl.int32), axis=0) > 0, float("nan"), acc)
    tl.store(out_ptr + t.to(tl.int64) * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


def combine(
    y: torch.Tensor,
    ids_flat: torch.Tensor,
    out: torch.Tensor,
    top_k: int,
    num_experts: int,
    block_h: int | None = None,
    num_warps: int = 4,
    guard: RoutingGuard | None = None,
    weights: torch.Tensor | None = None,
) -> None:
    """out[t] = the sum of y's rows of token t (y [T*k, H], or [shares, T*k, H] partial sums of a split K).
    `block_h`, `num_warps`: columns per program and its warps (benchmarks sweep them; None: the default below).
    `guard` with the flat routing `weights`: tokens with a bad slot get NaN rows."""
    t, h = out.shape
    split = y.shape[0] if y.dim() == 3 else 1
    k_pad = max(2, next_pow2(top_k))
    # ~8192 elements per program, 4 warps: 3.3-4.1 TB/s on the H200 at Qwen3 / DeepSeek T=4096 (k=8, BLOCK_H 1024),
    # against 1.6-1.8 TB/s for half that tile and 0.5 TB/s with 8 warps (docs/design/quant_kernels.md)
    block_h = block_h or min(max(128, 8192 // k_pad), max(128, next_pow2(h)))
    launch(
        _combine_kernel,
        (t, cdiv(h, block_h)),
        (
            y,
            ids_flat,
            out,
            h,
            top_k,
            num_experts,
            y.stride(-2),
            out.stride(0),
            y.stride(0) if split > 1 else 0,
            ids_flat if guard is None else weights,
            0 if guard is None else num_experts + int(guard.sentinel),
        ),
        dict(BLOCK_H=block_h, K_PAD=k_pad, SPLIT=split, GUARD=guard is not None),
        num_warps,
    )
