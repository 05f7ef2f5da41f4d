"""Dynamic e4m3 quantisation of activation rows (``quantize_rows``), in one launch that can also zero the
layer's later buffers, route the pairs (a one-program align) or write the rows in block order (TMA); token rows
go to block order as one quantisation per token and a byte gather (``gather_rows``)."""

from __future__ import annotations

import torch
from selector.plugins.quant_kernels import kernels as K
from selector.plugins.triton_common.align import AlignPlan, run_align
from selector.plugins.triton_common.launch import INTERPRET, cdiv, launch, next_pow2


def quantize_rows(
    x: torch.Tensor,
    group: int,
    block_r: int | None = None,
    num_warps: int = 4,
    zero: torch.Tensor | None = None,
    counts: torch.Tensor | None = None,
    slots: tuple | None = None,
    a_div: int = 0,
    align: AlignPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic e4m3 quantisation of x [R, K] per row and `group` channels -> (q [R, K], scales [R, ceil(K / group)]).
    `block_r`, `num_warps`: rows per program and its warps (benchmarks sweep them; None: the default below; with
    `align`, at least the align program's warps).
    The same launch fills `zero` (shaped like x, its last dim contiguous) and `counts` (int32) with zeros.
    `slots` (a sorted routing from ``route``): one row per block slot, in block order, for a TMA projection
    (``run_projection`` with ``Activations(sorted=True)``); with `a_div` > 0 x holds token rows and slot r gets
    x[sorted[r] // a_div]
    quantised (zeros for padding; each token quantised once, then gathered), else x is already in block order.
    Slots of unused blocks are left unwritten.
    `align` (a one-program plan from ``plan_align``, not with `slots`): one more program in the same launch fills
    its routing buffers, the launch ``run_align`` would make (decode: one kernel boundary fewer per layer)."""
    x = x if x.stride(1) == 1 else x.contiguous()  # the kernel walks columns with stride 1
    rows, k = x.shape
    sorted_rows = block_expert = None
    bm = num_valid = 0
    if align is not None and (slots is not None or not align.single):
        raise ValueError("quantize_rows: align needs a one-program plan (plan_align) and no slots")
    if slots is not None:
        sorted_rows, block_expert, bm = slots
        if sorted_rows is None or zero is not None:
            raise ValueError("quantize_rows: slots need a sorted routing, and cannot zero a tensor")
        num_valid = rows * a_div if a_div else 0  # x: tokens, each the row of a_div consecutive pairs
        if num_valid > sorted_rows.numel():
            raise ValueError(f"quantize_rows: {num_valid} pairs do not fit {sorted_rows.numel()} slots (a_div?)")
        if not a_div and rows != sorted_rows.numel():
            raise ValueError(f"quantize_rows: x in block order must have {sorted_rows.numel()} rows, got {rows}")
        if a_div:  # a token's row fills k slots: quantised once, then its bytes copied (half the bytes of bf16)
            q_tok, s_tok = quantize_rows(x, group, block_r, num_warps, counts=counts)
            return gather_rows(q_tok, s_tok, slots, a_div)
        rows = sorted_rows.numel()
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((rows, cdiv(k, group)), dtype=torch.float32, device=x.device)
    if zero is not None and (zero.shape != x.shape or zero.stride(1) != 1):
        raise ValueError(f"quantize_rows: zero must be shaped like x {list(x.shape)} with contiguous rows")
    if counts is not None and (counts.dtype != torch.int32 or not counts.is_contiguous()):
        raise ValueError("quantize_rows: counts must be contiguous int32")
    if align is not None:
        ids, num_valid, num_experts = align.ids, align.ids.numel(), align.num_experts
        sorted_rows, block_expert, bm = align.sorted_rows, align.block_expert, align.consts["BLOCK_M"]
        max_blocks = block_expert.numel()
        num_warps = max(num_warps, align.num_warps)
    if rows and s.shape[1]:
        block_r = block_r or (16 if rows <= 4096 else 64)
        consts = align.consts if align is not None else dict(CHUNK=1, SUB=1, E_PAD=1, B_TILE=1)
        launch(
            K._quant_rows_kernel,
            (cdiv(rows, block_r) + (align is not None), s.shape[1]),
            (
                x,
                q,
                s,
                zero if zero is not None else q,
                counts if counts is not None else s,
                sorted_rows if sorted_rows is not None else s,
                block_expert if block_expert is not None else s,
                ids if align is not None else s,
                rows,
                k,
                counts.numel() if counts is not None else 0,
                num_valid,
                num_experts if align is not None else 0,
                max_blocks if align is not None else 0,
                x.stride(0),
                q.stride(0),
                s.stride(0),
                zero.stride(0) if zero is not None else 0,
            ),
            dict(
                BLOCK_R=block_r,
                BLOCK_K=group,
                EXACT=INTERPRET,
                ZERO=zero is not None,
                COUNTS=counts is not None and counts.numel() > 0,
                SLOTS=slots is not None,
                BLOCK_M=max(1, bm),
                ALIGN=align is not None,
                CHUNK=consts["CHUNK"],
                SUB=consts["SUB"],
                E_PAD=consts["E_PAD"],
                B_TILE=consts["B_TILE"],
            ),
            num_warps,
        )
    else:
        if counts is not None:
            counts.zero_()
        if align is not None:
            run_align(align)
    return q, s


def gather_rows(q: torch.Tensor, s: torch.Tensor, slots: tuple, a_div: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantised token rows (q [T, K] e4m3, s [T, G]) in block order: slot r holds row sorted[r] // a_div, a
    padding slot zeros with scale 1; slots of unused blocks are left unwritten. `slots`: (sorted_rows,
    block_expert, BLOCK_M) of a sorted routing."""
    sorted_rows, block_expert, bm = slots
    n_slots, k = sorted_rows.numel(), q.shape[1]
    out_q = torch.empty((n_slots, k), dtype=q.dtype, device=q.device)
    out_s = torch.empty((n_slots, s.shape[1]), dtype=s.dtype, device=s.device)
    if n_slots and k:
        block_c = min(1024, next_pow2(k))
        launch(
            K._gather_rows_kernel,
            (cdiv(n_slots, 16), cdiv(k, block_c)),
            (
                q.view(torch.uint8),
                s,
                out_q.view(torch.uint8),
                out_s,
                sorted_rows,
                block_expert,
                n_slots,
                q.shape[0] * a_div,
                a_div,
                k,
                s.shape[1],
                q.stride(0),
                s.stride(0),
                out_q.stride(0),
                out_s.stride(0),
            ),
            dict(BLOCK_R=16, BLOCK_C=block_c, BLOCK_G=next_pow2(s.shape[1]), BLOCK_M=bm),
            4,
        )
    return out_q, out_s
