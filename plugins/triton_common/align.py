"""Routing on the GPU: group the (token, slot) pairs by expert into BLOCK_M-row blocks, padded per expert.

Output sizes depend only on T*k, E and BLOCK_M: ``sorted_rows[max_blocks * BLOCK_M]`` (pair index t*k+j, or T*k
for a padding slot) and ``block_expert[max_blocks]`` (expert of each block, -1 for blocks past the end: those
programs exit at once). No host synchronisation, so a CUDA graph captures it. One launch when T*k <=
SINGLE_ALIGN_MAX (``_align_kernel``), else three: per-chunk counts (``_align_count_kernel``), their prefix sums
over the chunks (``_align_prefix_kernel``), the scatter (``_align_kernel``, one program per chunk).

With a routing guard (selector.guard) the first launch also checks every pair it reads: ids outside [0, E) (bar
the expert-parallel sentinel) and NaN / infinite weights are counted into the device flag; such pairs are left
out of the blocks as before, and ``combine`` (given the same guard) sets their tokens' rows to NaN.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from selector.guard import RoutingGuard

from .guard import check_pairs, check_slots, record_faults, reported_value
from .launch import cdiv, empty, launch, next_pow2

# Routing up to this many (token, slot) pairs is done by one program in one launch (decode); above it the pairs
# are split into chunks of ALIGN_CHUNK, counted by one launch, prefix-summed by a second and scattered by a third.
# A chunk is one scatter step: each step is a dependent load-rank-store round trip (about 4 us on the H200), so
# a program that scattered 512 pairs took 8 of them.
SINGLE_ALIGN_MAX = 1024
ALIGN_CHUNK = 64
# the prefix pass: one program per PREFIX_E_TILE experts, PREFIX_ELEMS counts per step (a few steps at T*k = 131072)
PREFIX_E_TILE = 16
PREFIX_ELEMS = 4096


@triton.jit(do_not_specialize=["num_pairs", "limit", "tag"])
def _align_count_kernel(
    ids_ptr,
    partial_ptr,
    num_pairs,
    num_experts,
    wts_ptr,
    flag_ptr,
    host_ptr,
    limit,
    tag,
    CHUNK: tl.constexpr,
    E_PAD: tl.constexpr,
    GUARD: tl.constexpr,
):
    """partial[pid, e] = number of pairs of chunk pid routed to expert e (every entry written). GUARD: the chunk's
    pairs are checked too (ids against `limit`, weights finite) and faults recorded (triton_common.guard)."""
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    in_range = offs < num_pairs
    raw = tl.load(ids_ptr + offs, mask=in_range, other=-1)
    ids = raw.to(tl.int32)
    valid = in_range & (ids >= 0) & (ids < num_experts)
    counts = tl.histogram(tl.where(valid, ids, 0), E_PAD, mask=valid)
    tl.store(partial_ptr + pid * E_PAD + tl.arange(0, E_PAD), counts)
    if GUARD:
        w = tl.load(wts_ptr + offs, mask=in_range, other=0.0)
        bad_id, bad_w = check_slots(raw, w, in_range, limit)
        n_ids = tl.sum(bad_id.to(tl.int32), axis=0)
        record_faults(flag_ptr, host_ptr, tag, n_ids, tl.sum(bad_w.to(tl.int32), axis=0), reported_value(raw, bad_id))


@triton.jit(do_not_specialize=["num_chunks"])
def _align_prefix_kernel(partial_ptr, num_chunks, E_PAD: tl.constexpr, E_TILE: tl.constexpr, C_TILE: tl.constexpr):
    """In place over ``_align_count_kernel``'s table: partial[c, e] becomes the number of expert e's pairs in
    chunks before c, and row num_chunks (allocated after the chunks' rows) gets each expert's total. Program pid
    sums the columns of experts pid * E_TILE .. (pid + 1) * E_TILE - 1, C_TILE chunks at a time."""
    e_range = tl.program_id(0) * E_TILE + tl.arange(0, E_TILE)
    running = tl.zeros([E_TILE], dtype=tl.int32)
    for c0 in range(0, num_chunks, C_TILE):
        cidx = c0 + tl.arange(0, C_TILE)
        ptrs = partial_ptr + cidx[:, None] * E_PAD + e_range[None, :]
        c_ok = cidx[:, None] < num_chunks
        part = tl.load(ptrs, mask=c_ok, other=0)
        tl.store(ptrs, tl.cumsum(part, axis=0) - part + running[None, :], mask=c_ok)
        running += tl.sum(part, axis=0)
    tl.store(partial_ptr + num_chunks * E_PAD + e_range, running)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "max_blocks", "limit", "tag"])
def _align_kernel(
    ids_ptr,
    partial_ptr,
    sorted_ptr,
    block_expert_ptr,
    block_row_ptr,
    num_pairs,
    num_experts,
    num_chunks,
    max_blocks,
    wts_ptr,
    flag_ptr,
    host_ptr,
    limit,
    tag,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    E_PAD: tl.constexpr,
    B_TILE: tl.constexpr,
    SINGLE: tl.constexpr,
    GUARD: tl.constexpr,
    ROW_GRAIN: tl.constexpr,
):
    """Scatter pair indices into expert-sorted, BLOCK_M-padded order; write per-block experts and padding.

    SINGLE: one program does everything (counts too). Otherwise program pid scatters chunk pid using the
    prefix counts of ``_align_prefix_kernel``. Inside one expert's group the pairs keep their order (ranks
    come from prefix counts, no atomics), so the layout itself is deterministic. GUARD with SINGLE: the program
    checks the pairs too (with several chunks ``_align_count_kernel`` does).
    """
    if GUARD and SINGLE:
        check_pairs(ids_ptr, wts_ptr, num_pairs, flag_ptr, host_ptr, limit, tag, CHUNK)
    align_program(
        ids_ptr,
        partial_ptr,
        sorted_ptr,
        block_expert_ptr,
        block_row_ptr,
        num_pairs,
        num_experts,
        num_chunks,
        max_blocks,
        tl.program_id(0),
        tl.num_programs(0),
        BLOCK_M,
        CHUNK,
        SUB,
        E_PAD,
        B_TILE,
        SINGLE,
        ROW_GRAIN,
    )


@triton.jit
def align_program(
    ids_ptr,
    partial_ptr,
    sorted_ptr,
    block_expert_ptr,
    block_row_ptr,
    num_pairs,
    num_experts,
    num_chunks,
    max_blocks,
    pid,
    nprog,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    E_PAD: tl.constexpr,
    B_TILE: tl.constexpr,
    SINGLE: tl.constexpr,
    ROW_GRAIN: tl.constexpr,
):
    """The work of ``_align_kernel``'s program `pid` of `nprog`; with SINGLE (pid 0 of 1) also callable from
    another kernel's program, so that the routing rides on a launch the layer makes anyway (the quantised
    experts' x quantisation). ROW_GRAIN > 0: block_row[b] gets block b's first row in a copy of the blocks that
    pads each expert's rows to a multiple of ROW_GRAIN only (a half of BLOCK_M: an expert's last block then
    takes half a block's rows when its second half is all padding), -1 for blocks past the end."""
    e_range = tl.arange(0, E_PAD)
    e_ok = e_range < num_experts

    if SINGLE:
        total = tl.zeros([E_PAD], dtype=tl.int32)
        for s in range(0, num_pairs, CHUNK):
            offs = s + tl.arange(0, CHUNK)
            in_range = offs < num_pairs
            ids = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
            valid = in_range & (ids >= 0) & (ids < num_experts)
            total += tl.histogram(tl.where(valid, ids, 0), E_PAD, mask=valid)
        before = tl.zeros([E_PAD], dtype=tl.int32)
        lo = 0
        hi = num_pairs
    else:  # the prefix pass left this chunk's "pairs before it" in its row and the totals after the last row
        before = tl.load(partial_ptr + pid * E_PAD + e_range)
        total = tl.load(partial_ptr + num_chunks * E_PAD + e_range)
        lo = pid * CHUNK
        hi = tl.minimum(lo + CHUNK, num_pairs)

    padded = tl.where(e_ok, (total + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    pend = tl.cumsum(padded, axis=0)
    pstart = pend - padded
    run = pstart + before

    # Scatter: destination = next free slot of the expert's group + rank among the same expert in this piece.
    i_sub = tl.arange(0, SUB)
    for s in range(lo, hi, SUB):
        offs = s + i_sub
        in_range = offs < hi
        ids = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
        valid = in_range & (ids >= 0) & (ids < num_experts)
        ids_c = tl.where(valid, ids, 0)
        earlier = (ids_c[:, None] == ids_c[None, :]) & valid[None, :] & (i_sub[None, :] < i_sub[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        dest = tl.gather(run, ids_c, 0) + rank
        tl.store(sorted_ptr + dest, offs, mask=valid)
        run += tl.histogram(ids_c, E_PAD, mask=valid)

    # Per-block expert ids and padding slots, spread over the programs (disjoint from the scatter above).
    total_padded = tl.sum(padded, axis=0)
    vend = pstart + total
    if ROW_GRAIN > 0:
        grained = tl.where(e_ok, (total + ROW_GRAIN - 1) // ROW_GRAIN * ROW_GRAIN, 0)
        gstart = tl.cumsum(grained, axis=0) - grained
    m_range = tl.arange(0, BLOCK_M)
    for b0 in range(pid * B_TILE, max_blocks, nprog * B_TILE):
        b = b0 + tl.arange(0, B_TILE)
        b_ok = b < max_blocks
        bstart = b * BLOCK_M
        used = bstart < total_padded
        eb = tl.sum(((pend[None, :] <= bstart[:, None]) & e_ok[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(used, eb, -1), mask=b_ok)
        ve = tl.gather(vend, tl.minimum(eb, E_PAD - 1), 0)
        if ROW_GRAIN > 0:
            eb_c = tl.minimum(eb, E_PAD - 1)
            first_row = tl.gather(gstart, eb_c, 0) + bstart - tl.gather(pstart, eb_c, 0)
            tl.store(block_row_ptr + b, tl.where(used, first_row, -1), mask=b_ok)
        r = bstart[:, None] + m_range[None, :]
        pad_val = tl.zeros([B_TILE, BLOCK_M], dtype=tl.int32) + num_pairs
        tl.store(sorted_ptr + r, pad_val, mask=(used & b_ok)[:, None] & (r >= ve[:, None]))


def max_blocks_for(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the number of BLOCK_M blocks after padding each expert's group (host-known)."""
    padded = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return cdiv(padded, block_m)


class AlignPlan(NamedTuple):
    """What ``align`` fills and how (``run_align`` launches it): `_align_kernel`'s constexprs and warps, and, for
    many pairs, the count table `partial` ([chunks + 1, E_PAD] int32): ``_align_count_kernel`` fills the chunks'
    rows, ``_align_prefix_kernel`` turns them into prefix counts in place and fills the last row with the
    totals. Without it (`single`) one program does it all, and a caller may run that program inside a kernel of
    its own (``align_program``). `block_row` (planned with a row grain): each block's first row in a copy of the
    blocks that pads each expert to that grain only (``align_program``'s ROW_GRAIN)."""

    ids: torch.Tensor
    num_experts: int
    sorted_rows: torch.Tensor
    block_expert: torch.Tensor
    consts: dict
    num_warps: int
    partial: torch.Tensor | None
    guard: RoutingGuard | None = None
    weights: torch.Tensor | None = None  # flat, contiguous: what the guard checks beside the ids
    block_row: torch.Tensor | None = None

    @property
    def single(self) -> bool:
        return self.partial is None

    @property
    def chunks(self) -> int:
        return 1 if self.single else cdiv(self.ids.numel(), self.consts["CHUNK"])


def plan_align(
    top_k_ids_flat: torch.Tensor,
    num_experts: int,
    block_m: int,
    guard: RoutingGuard | None = None,
    weights: torch.Tensor | None = None,
    row_grain: int = 0,
) -> AlignPlan:
    """``align``'s buffers (allocated) and launch parameters, nothing launched. `guard` (with the flat, contiguous
    `weights`): the first launch checks the pairs and records faults (selector.guard). `row_grain` (0: none;
    else block_m // 2): also fill `block_row` (see ``AlignPlan``)."""
    if guard is not None and weights is None:
        raise ValueError("plan_align: a routing guard checks the weights too: pass weights")
    if row_grain not in (0, block_m // 2):
        raise ValueError(f"plan_align: row_grain is 0 or block_m // 2 ({block_m // 2}), got {row_grain}")
    n = top_k_ids_flat.numel()
    dev = top_k_ids_flat.device
    mb = max_blocks_for(n, num_experts, block_m)
    sorted_rows = empty(mb * block_m, torch.int32, dev, 1 << 30)
    block_expert = empty(mb, torch.int32, dev, -1)
    block_row = empty(mb, torch.int32, dev, 1 << 30) if row_grain else None
    e_pad = max(16, next_pow2(num_experts))
    consts = dict(
        BLOCK_M=block_m, E_PAD=e_pad, B_TILE=16 if block_m >= 64 else 32, GUARD=guard is not None, ROW_GRAIN=row_grain
    )
    warps = 8 if e_pad >= 128 else 4
    if n <= SINGLE_ALIGN_MAX:
        chunk = max(16, next_pow2(n))
        consts.update(CHUNK=chunk, SUB=min(64, chunk), SINGLE=True)
        return AlignPlan(
            top_k_ids_flat, num_experts, sorted_rows, block_expert, consts, warps, None, guard, weights, block_row
        )
    # one scatter step per chunk; the count table gets a row of totals after the chunks' rows
    consts.update(CHUNK=ALIGN_CHUNK, SUB=ALIGN_CHUNK, SINGLE=False)
    partial = empty((cdiv(n, ALIGN_CHUNK) + 1) * e_pad, torch.int32, dev, 1 << 20)
    return AlignPlan(
        top_k_ids_flat, num_experts, sorted_rows, block_expert, consts, warps, partial, guard, weights, block_row
    )


def guard_args(guard: RoutingGuard | None, weights: torch.Tensor | None, dummy: torch.Tensor) -> tuple:
    """(weights, flag, host mirror, id limit, layer tag): the guard's runtime arguments, placeholders without one."""
    if guard is None:
        return dummy, dummy, dummy, 0, 0
    return weights, guard.flag, guard.host, guard.num_experts + int(guard.sentinel), guard.tag


def run_align(plan: AlignPlan) -> None:
    """The launches of a plan from ``plan_align``."""
    n, chunks = plan.ids.numel(), plan.chunks
    checks = guard_args(plan.guard, plan.weights, plan.ids)
    if not plan.single:
        e_pad = plan.consts["E_PAD"]
        launch(
            _align_count_kernel,
            (chunks,),
            (plan.ids, plan.partial, n, plan.num_experts, *checks),
            dict(CHUNK=plan.consts["CHUNK"], E_PAD=e_pad, GUARD=plan.guard is not None),
            plan.num_warps,
        )
        launch(
            _align_prefix_kernel,
            (e_pad // PREFIX_E_TILE,),
            (plan.partial, chunks),  # E_PAD >= 16: whole tiles
            dict(E_PAD=e_pad, E_TILE=PREFIX_E_TILE, C_TILE=PREFIX_ELEMS // PREFIX_E_TILE),
            4,
        )
    partial = plan.sorted_rows if plan.single else plan.partial  # unused by the one-program path
    launch(
        _align_kernel,
        (chunks,),
        (
            plan.ids,
            partial,
            plan.sorted_rows,
            plan.block_expert,
            plan.block_expert if plan.block_row is None else plan.block_row,
            n,
            plan.num_experts,
            chunks,
            plan.block_expert.numel(),
            *checks,
        ),
        plan.consts,
        plan.num_warps,
    )


def align(
    top_k_ids_flat: torch.Tensor,
    num_experts: int,
    block_m: int,
    guard: RoutingGuard | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert-sorted, block-padded routing. Returns (sorted_rows [max_blocks*BM] int32, block_expert [max_blocks]).
    Each expert's pairs fill its blocks from the first slot, padding only after them (the quantised down kernel's
    in-kernel combine counts a block's real rows as its first slots). `guard`, `weights`: see ``plan_align``."""
    plan = plan_align(top_k_ids_flat, num_experts, block_m, guard, weights)
    run_align(plan)
    return plan.sorted_rows, plan.block_expert
