"""Dynamic e4m3 quantisation of activation rows (``quantize_rows``), in one launch that can also zero the
layer's later buffers, route the pairs (a one-program align) or write the rows in block order (TMA)."""

from __future__ import annotations

import torch
from selector.plugins.quant_kernels import kernels as K
from selector.plugins.triton_common.align import AlignPlan, run_align
from selector.plugins.triton_common.launch import INTERPRET, cdiv, launch


def quantize_rows(x: torch.Tensor, group: int, block_r: int | None = None, num_warps: int = 4,
                  zero: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                  slots: tuple | None = None, a_div: int = 0,
                  align: AlignPlan | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Dynamic e4m3 quantisation of x [R, K] per row and `group` channels -> (q [R, K], scales [R, ceil(K / group)]).
    `block_r`, `num_warps`: rows per program and its warps (benchmarks sweep them; None: the default below; with
    `align`, at least the align program's warps).
    The same launch fills `zero` (shaped like x, its last dim contiguous) and `counts` (int32) with zeros.
    `slots` (a sorted routing from ``route``): one row per block slot, in block order, for a TMA projection
    (``projection(a_sorted=True)``); with `a_div` > 0 x holds token rows and slot r quantises x[sorted[r] // a_div]
    (zeros for padding), else x is already in block order. Slots of unused blocks are left unwritten.
    `align` (a one-program plan from ``plan_align``, not with `slots`): one more program in the same launch fills
    its routing buffers, the launch ``run_align`` would make (decode: one kernel boundary fewer per layer)."""
    x = x if x.stride(1) == 1 else x.contiguous()  # the kernel walks columns with stride 1
    rows, k = x.shape
    sorted_rows = block_expert = None
    bm = num_valid = 0
    if slots is not None:
        sorted_rows, block_expert, bm = slots
        if sorted_rows is None or zero is not None:
            raise ValueError("quantize_rows: slots need a sorted routing, and cannot zero a tensor")
        num_valid = rows * a_div if a_div else 0  # x: tokens, each the row of a_div consecutive pairs
        if num_valid > sorted_rows.numel():
            raise ValueError(f"quantize_rows: {num_valid} pairs do not fit {sorted_rows.numel()} slots (a_div?)")
        if not a_div and rows != sorted_rows.numel():
            raise ValueError(f"quantize_rows: x in block order must have {sorted_rows.numel()} rows, got {rows}")
        rows = sorted_rows.numel()
    q = torch.empty((rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((rows, cdiv(k, group)), dtype=torch.float32, device=x.device)
    if zero is not None and (zero.shape != x.shape or zero.stride(1) != 1):
        raise ValueError(f"quantize_rows: zero must be shaped like x {list(x.shape)} with contiguous rows")
    if counts is not None and (counts.dtype != torch.int32 or not counts.is_contiguous()):
        raise ValueError("quantize_rows: counts must be contiguous int32")
    if align is not None:
        if slots is not None or not align.single:
            raise ValueError("quantize_rows: align needs a one-program plan (plan_align) and no slots")
        ids, num_valid, num_experts = align.ids, align.ids.numel(), align.num_experts
        sorted_rows, block_expert, bm = align.sorted_rows, align.block_expert, align.consts["BLOCK_M"]
        max_blocks = block_expert.numel()
        num_warps = max(num_warps, align.num_warps)
    if rows and s.shape[1]:
        block_r = block_r or (16 if rows <= 4096 else 64)
        consts = align.consts if align is not None else dict(CHUNK=1, SUB=1, E_PAD=1, B_TILE=1)
        launch(
            K._quant_rows_kernel, (cdiv(rows, block_r) + (align is not None), s.shape[1]),
            (x, q, s, zero if zero is not None else q, counts if counts is not None else s,
             sorted_rows if sorted_rows is not None else s, block_expert if block_expert is not None else s,
             ids if align is not None else s, rows, k, counts.numel() if counts is not None else 0, num_valid,
             max(1, a_div), num_experts if align is not None else 0, max_blocks if align is not None else 0,
             x.stride(0), q.stride(0), s.stride(0), zero.stride(0) if zero is not None else 0),
            dict(BLOCK_R=block_r, BLOCK_K=group, EXACT=INTERPRET, ZERO=zero is not None,
                 COUNTS=counts is not None and counts.numel() > 0, SLOTS=slots is not None,
                 GATHER=slots is not None and a_div > 0, BLOCK_M=max(1, bm), ALIGN=align is not None,
                 CHUNK=consts["CHUNK"], SUB=consts["SUB"], E_PAD=consts["E_PAD"], B_TILE=consts["B_TILE"]),
            num_warps,
        )  # fmt: skip
    else:
        if counts is not None:
            counts.zero_()
        if align is not None:
            run_align(align)
    return q, s
