"""Fused Mixture-of-Experts experts layer in Triton.

Computes, for hidden_states x [T, H], routing ids [T, k] and routing weights [T, k]:

    out[t] = sum_j w[t, j] * ( down_e( act(gate_e(x_t) + bg_e) * (up_e(x_t) + bu_e) ) + bd_e ),  e = ids[t, j]

or, with the clamped SwiGLU gate (GPT-OSS), ``(clamp(u, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
``g = min(gate_e(x_t) + bg_e, limit)`` and ``u = up_e(x_t) + bu_e`` in place of ``act(...) * (...)``.

with the weights laid out as a Transformers experts module stores them (see ``fused_experts``). Ids outside
[0, num_experts) are the expert-parallel sentinel: they contribute nothing.

Launches per call (no host synchronisation anywhere, so a call can be captured in a CUDA graph):

1. ``triton_common.align`` (one launch when T*k <= SINGLE_ALIGN_MAX, else three): groups the (token, slot)
   pairs by expert into blocks of BLOCK_M rows. Output sizes depend only on T, k, E and BLOCK_M:
   ``sorted_rows[max_blocks * BLOCK_M]`` (pair index t*k+j, or T*k for a padding slot) and
   ``block_expert[max_blocks]`` (expert of each block, -1 for blocks past the end: those programs exit at once).
2. ``_moe_gemm_kernel`` (gate_up): gathers the block's token rows of x, multiplies with the expert's gate/up
   weights, adds the bias, applies activation and gating in the epilogue, writes intermediate [T*k, I].
3. ``_moe_gemm_kernel`` (down): multiplies the intermediate rows with down_proj, adds the bias, multiplies by
   the routing weight, writes y [T*k, H] (row t*k+j).
4. ``triton_common.combine``: out[t] = sum over j of y[t*k+j] in fixed order, fp32 accumulation (deterministic,
   no atomics); sentinel slots are skipped.

One token (``PAIR_BLOCK_MAX_TOKENS``): two launches of ``_pair_gemm_kernel``, no align and no combine. Each pair
is a block of its own (a router's top-k experts are distinct: no weights are read twice); gate_up's first program
zeroes the down launch's counters and runs the routing guard's checks, and the down launch adds the k slots in
its epilogue: the last slot of a token to arrive sums the fp32 rows in a fixed order (deterministic, no float
atomics); with the down tiles' SPLIT_K each slot is that many programs over runs of K steps, all in that sum. From ``configs.TOKEN_DOWN_MIN_I`` up (K-contiguous down weights) the down launch is
``_token_down_kernel`` instead: one program per output tile, one K loop over the k experts' weights, the
routing weights applied in gate_up's epilogue.

Blocks of ``configs.TMA_MIN_BLOCK_M`` rows or more on sm_90+ (large T) read the weight tiles through TMA
descriptors; the gate_up GEMM then writes the intermediate in block order (padding slots too) and the down GEMM
reads it through a descriptor, without a gather; from SORTED_X_MIN_I up, x is first copied into block order and
read the same way (``part_layout``). Same tiles, same K order: the bits are those of the pointer path.
Where the tile table sets PERSISTENT (``persistent_fits``: sm_90, 16-bit, weights by TMA, concatenated gate/up), the
two GEMMs run ``hopper_gemm``'s persistent warp-specialised kernel (Gluon) instead, on x copied into block order
with each expert padded to half a block only (the align's row grain), where that copy keeps the call within its
temporaries bound (``x_copy_fits``); where the installed Triton does not build that kernel the layer runs
``_moe_gemm_kernel``.
Blocks of ``configs.HALF_TAIL_MIN_BLOCK_M`` rows or more that are at most half full (an expert's last) run as
half-height tiles: half the FLOPs for the padding an expert's tail leaves, the same bits.

Temporaries: intermediate (T*k*I; in block order up to min(T*k, E) * (BLOCK_M - 1) + BLOCK_M - 1 rows more),
y (T*k*H) in the input dtype (in the memory of x's copy in block order, where x is copied), plus int32 routing
buffers (the align's count table, (T*k / 64 + 1) * E_PAD entries, is under 2% of y's bytes at H >= 2048): within
2 * T*k * max(2I, H) * 2 bytes for the tiles the tables and heuristics pick (BLOCK_M 128 only where experts see
about 100 rows or more).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl
from selector.plugins.triton_common.activation import activation as _activation
from selector.plugins.triton_common.activation import gate as _gate
from selector.plugins.triton_common.align import align, guard_args, max_blocks_for, plan_align, run_align
from selector.plugins.triton_common.combine import combine
from selector.plugins.triton_common.guard import check_pairs, check_slots
from selector.plugins.triton_common.schedule import program_tile
from selector.plugins.triton_common.launch import (
    TensorDescriptor,
    cdiv,
    empty,
    launch,
    next_pow2,
    repoison,
    tma_weights,
)
from selector.plugins.triton_common.launch import tma_device as _tma_device

from selector.guard import resolve as resolve_guard

from . import configs as _configs
from . import hopper_gemm
from .records import (
    SUPPORTED_ACTIVATIONS,
    SUPPORTED_DTYPES,
    SUPPORTED_GATES,
    FusedLayer,
    Gemm,
    check_call,
    fused_layer,
    layer_dims,
)

__all__ = [
    "SUPPORTED_ACTIVATIONS",
    "SUPPORTED_DTYPES",
    "SUPPORTED_GATES",
    "FusedLayer",
    "check_call",
    "fused_experts",
    "fused_experts_impl",
    "fused_layer",
    "run_op",
]


# --------------------------------------------------------------------------------------------------------------
# Grouped GEMM over expert blocks (the blocks come from triton_common.align).
# --------------------------------------------------------------------------------------------------------------


# token-count dependent ints are not specialised: one compile per tile config and weight shape, whatever T is
@triton.jit(do_not_specialize=["num_valid", "num_blocks_m"])
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    topk_w_ptr,
    a_desc,
    a_desc_half,
    w_desc,
    num_valid,
    N,
    K,
    a_div,
    num_blocks_m,
    up_offset,
    w_rows,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_bn,
    stride_om,
    stride_on,
    gate_alpha,
    gate_limit,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ACT: tl.constexpr,
    GATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_W: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    A_TMA: tl.constexpr = False,
    W_TMA: tl.constexpr = False,
    OUT_BLOCKED: tl.constexpr = False,
    HALF_TAIL: tl.constexpr = False,
):
    """out[row, n] = epilogue( sum_k A[row // a_div, k] * W[e, n, k] ) for the rows of each expert block.

    N is the number of OUTPUT channels (I for gate_up, H for down). Gated: weight rows n (gate) and
    n + up_offset (up) when concatenated, 2n and 2n+1 when interleaved; the bias is added to both before the
    gate (GATE, ACT: triton_common.activation.gate, with gate_alpha / gate_limit for the clamped SwiGLU). W is
    addressed through (stride_wn, stride_wk), so transposed storage needs no copy.

    TMA (sm_90+, see ``part_layout``): W_TMA reads the weight tiles through w_desc, the weights seen as 2-D with
    `w_rows` rows per expert ([E * N_stored, K]: K-contiguous storage only); A_TMA
    reads A's rows in block order through a_desc (row pid_m * BLOCK_M + i of block pid_m, no gather).
    OUT_BLOCKED stores row i of block pid_m at out row pid_m * BLOCK_M + i (padding slots too, computed from row
    0), instead of at the pair's own row: the down GEMM then reads it with A_TMA.

    HALF_TAIL: a block whose second half holds only padding slots (an expert's last block, at most half full)
    computes a BLOCK_M // 2-row tile (A through a_desc_half), half the FLOPs of a full block. Both GEMMs decide
    from the same sorted rows, so the down GEMM never reads the block-order rows that gate_up skipped.
    """
    pid = tl.program_id(0)
    pid_m, pid_n = program_tile(pid, num_blocks_m, N, BLOCK_N, GROUP_M)

    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    row0 = pid_m * BLOCK_M
    half = False  # Triton makes this a runtime value: the half branch below is compiled whatever HALF_TAIL says,
    # so without HALF_TAIL it is a whole tile on a_desc (never taken), and a_desc_half may be a placeholder
    HALF_M: tl.constexpr = BLOCK_M // 2 if HALF_TAIL else BLOCK_M
    if HALF_TAIL:  # an expert's padding slots come after its pairs: a second half that starts with one is all padding
        half = tl.load(sorted_ptr + row0 + BLOCK_M // 2) >= num_valid
    if half:
        rows_h = tl.load(sorted_ptr + row0 + tl.arange(0, HALF_M))
        _store_tile(
            out_ptr,
            _gemm_tile(
                a_ptr,
                w_ptr,
                bias_ptr,
                topk_w_ptr,
                a_desc_half if HALF_TAIL else a_desc,
                w_desc,
                expert,
                row0,
                rows_h,
                pid_n,
                num_valid,
                N,
                K,
                a_div,
                up_offset,
                w_rows,
                stride_am,
                stride_ak,
                stride_we,
                stride_wn,
                stride_wk,
                stride_be,
                stride_bn,
                gate_alpha,
                gate_limit,
                HALF_M,
                BLOCK_N,
                BLOCK_K,
                GATED,
                INTERLEAVED,
                ACT,
                GATE,
                HAS_BIAS,
                MUL_W,
                EVEN_K,
                EVEN_N,
                DOT_PREC,
                A_TMA,
                W_TMA,
            ),
            rows_h,
            row0,
            pid_n,
            num_valid,
            N,
            stride_om,
            stride_on,
            HALF_M,
            BLOCK_N,
            OUT_BLOCKED,
        )
    else:
        rows = tl.load(sorted_ptr + row0 + tl.arange(0, BLOCK_M))
        _store_tile(
            out_ptr,
            _gemm_tile(
                a_ptr,
                w_ptr,
                bias_ptr,
                topk_w_ptr,
                a_desc,
                w_desc,
                expert,
                row0,
                rows,
                pid_n,
                num_valid,
                N,
                K,
                a_div,
                up_offset,
                w_rows,
                stride_am,
                stride_ak,
                stride_we,
                stride_wn,
                stride_wk,
                stride_be,
                stride_bn,
                gate_alpha,
                gate_limit,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
                GATED,
                INTERLEAVED,
                ACT,
                GATE,
                HAS_BIAS,
                MUL_W,
                EVEN_K,
                EVEN_N,
                DOT_PREC,
                A_TMA,
                W_TMA,
            ),
            rows,
            row0,
            pid_n,
            num_valid,
            N,
            stride_om,
            stride_on,
            BLOCK_M,
            BLOCK_N,
            OUT_BLOCKED,
        )


@triton.jit
def _gemm_tile(
    a_ptr,
    w_ptr,
    bias_ptr,
    topk_w_ptr,
    a_desc,
    w_desc,
    expert,
    row0,
    rows,
    pid_n,
    num_valid,
    N,
    K,
    a_div,
    up_offset,
    w_rows,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_bn,
    gate_alpha,
    gate_limit,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ACT: tl.constexpr,
    GATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_W: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    A_TMA: tl.constexpr,
    W_TMA: tl.constexpr,
):
    """The fp32 epilogue result [BLOCK_M, BLOCK_N] of one tile: the block's pair `rows` (num_valid for a padding
    slot; A_TMA: the block's slots from `row0` in block order) times output channels of tile `pid_n`."""
    w_row0 = expert * w_rows  # int32: tma_fits checks that every row index fits
    expert = expert.to(tl.int64)

    row_ok = rows < num_valid
    # padding slots read row 0 (always in bounds): their results are never stored
    a_rows = tl.where(row_ok, rows // a_div, 0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_base = w_ptr + expert * stride_we
    num_k = tl.cdiv(K, BLOCK_K)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N

    if GATED and INTERLEAVED:
        # channels 2*n0 .. 2*n0 + 2*BLOCK_N - 1 hold (gate, up) pairs: one wide tile, split after the dot
        offs_c = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        c_ok = offs_c < 2 * N
        b_ptrs = w_base + offs_c[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
        for kk in range(0, num_k):
            k_ok = offs_k < K - kk * BLOCK_K
            a = _a_tile(a_ptrs, a_desc, row0, kk * BLOCK_K, k_ok, EVEN_K, A_TMA)
            b = _w_tile(b_ptrs, w_desc, w_row0, pid_n * 2 * BLOCK_N, kk * BLOCK_K, k_ok, c_ok, EVEN_K and EVEN_N, W_TMA)
            acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            bias = tl.load(bias_ptr + expert * stride_be + offs_c * stride_bn, mask=c_ok, other=0.0).to(tl.float32)
            acc = acc + bias[None, :]
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        res = _gate(gate, up, gate_alpha, gate_limit, ACT, GATE)
    elif GATED:
        bg_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        bu_ptrs = bg_ptrs + up_offset * stride_wn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kk in range(0, num_k):
            k_ok = offs_k < K - kk * BLOCK_K
            a = _a_tile(a_ptrs, a_desc, row0, kk * BLOCK_K, k_ok, EVEN_K, A_TMA)
            bg = _w_tile(bg_ptrs, w_desc, w_row0, pid_n * BLOCK_N, kk * BLOCK_K, k_ok, n_ok, EVEN_K and EVEN_N, W_TMA)
            bu = _w_tile(
                bu_ptrs, w_desc, w_row0, up_offset + pid_n * BLOCK_N, kk * BLOCK_K, k_ok, n_ok, EVEN_K and EVEN_N, W_TMA
            )
            acc_g = tl.dot(a, bg, acc_g, input_precision=DOT_PREC)
            acc_u = tl.dot(a, bu, acc_u, input_precision=DOT_PREC)
            a_ptrs += BLOCK_K * stride_ak
            bg_ptrs += BLOCK_K * stride_wk
            bu_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            bias_base = bias_ptr + expert * stride_be
            bg_v = tl.load(bias_base + offs_n * stride_bn, mask=n_ok, other=0.0).to(tl.float32)
            bu_v = tl.load(bias_base + (offs_n + up_offset) * stride_bn, mask=n_ok, other=0.0).to(tl.float32)
            acc_g = acc_g + bg_v[None, :]
            acc_u = acc_u + bu_v[None, :]
        res = _gate(acc_g, acc_u, gate_alpha, gate_limit, ACT, GATE)
    else:
        b_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kk in range(0, num_k):
            k_ok = offs_k < K - kk * BLOCK_K
            a = _a_tile(a_ptrs, a_desc, row0, kk * BLOCK_K, k_ok, EVEN_K, A_TMA)
            b = _w_tile(b_ptrs, w_desc, w_row0, pid_n * BLOCK_N, kk * BLOCK_K, k_ok, n_ok, EVEN_K and EVEN_N, W_TMA)
            acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            bias = tl.load(bias_ptr + expert * stride_be + offs_n * stride_bn, mask=n_ok, other=0.0).to(tl.float32)
            acc = acc + bias[None, :]
        res = _activation(acc, ACT)

    if MUL_W:
        rw = tl.load(topk_w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        res = res * rw[:, None]
    return res


@triton.jit
def _store_tile(
    out_ptr,
    res,
    rows,
    row0,
    pid_n,
    num_valid,
    N,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OUT_BLOCKED: tl.constexpr,
):
    """Writes a tile's result: at the pairs' own rows, or (OUT_BLOCKED) at the block's slots from `row0`, padding
    slots too."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if OUT_BLOCKED:
        out_rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        o_mask = n_ok[None, :]
    else:
        out_rows = rows.to(tl.int64)
        o_mask = (rows < num_valid)[:, None] & n_ok[None, :]
    o_ptrs = out_ptr + out_rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _a_tile(a_ptrs, a_desc, row, k0, k_ok, EVEN_K: tl.constexpr, A_TMA: tl.constexpr):
    """A's [BLOCK_M, BLOCK_K] tile at K offset k0: block rows from `row` through the descriptor (columns past K
    read as zero), else the gathered rows' pointers (masked past K)."""
    if A_TMA:
        return a_desc.load([row, k0])
    if EVEN_K:
        return tl.load(a_ptrs)
    return tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)


@triton.jit
def _w_tile(b_ptrs, w_desc, w_row0, c0, k0, k_ok, c_ok, EVEN: tl.constexpr, W_TMA: tl.constexpr):
    """The weight tile [BLOCK_K, channels] of stored channels c0.. at K offset k0. Through the descriptor
    (K-contiguous weights, [E * channels, K]), channels past the expert's read the next expert's rows (or zeros
    past the last) and K past the end reads zeros: those outputs are never stored."""
    if W_TMA:
        return w_desc.load([w_row0 + c0, k0]).T
    if EVEN:
        return tl.load(b_ptrs)
    return tl.load(b_ptrs, mask=k_ok[:, None] & c_ok[None, :], other=0.0)


# --------------------------------------------------------------------------------------------------------------
# Decode: one block per (token, slot) pair, no align launch, the combine in the down GEMM's epilogue.
# --------------------------------------------------------------------------------------------------------------

# Up to PAIR_BLOCK_MAX_TOKENS tokens (configs.py: the tile tables key on it too) each (token, slot) pair is a block of
# its own: one token's k experts are distinct, so no expert's weights are read twice, and the layer is two launches
# instead of four (no align, no combine).
PAIR_BLOCK_MAX_TOKENS = _configs.PAIR_BLOCK_MAX_TOKENS
PAIR_BLOCK_M = 16  # the smallest tile tl.dot takes: row 0 is the pair's, the other rows are padding


@triton.jit(do_not_specialize=["num_valid", "limit", "tag", "n_counts"])
def _pair_gemm_kernel(
    a_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    ids_ptr,
    topk_w_ptr,
    part_ptr,
    count_ptr,
    flag_ptr,
    host_ptr,
    num_valid,
    num_experts,
    top_k,
    limit,
    tag,
    n_counts,
    N,
    K,
    a_div,
    up_offset,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_bn,
    stride_om,
    stride_on,
    gate_alpha,
    gate_limit,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ACT: tl.constexpr,
    GATE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_W: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FIRST: tl.constexpr,
    COMBINE: tl.constexpr,
    GUARD: tl.constexpr,
    PAIRS_PAD: tl.constexpr,
    COUNTS_PAD: tl.constexpr,
    K_PAD: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """``_moe_gemm_kernel`` at decode: program (p, n, s) computes pair p's output channels of tile n with expert
    ids[p]'s weights (row 0 of a BLOCK_M tile) over the s-th of SPLIT runs of whole K steps (SPLIT > 1: the
    down launch only); a pair whose id is outside [0, num_experts) computes nothing.

    FIRST (the gate_up launch): program (0, 0) also does the align launch's other work: it zeroes the down
    launch's n_counts counters and, with GUARD, checks every pair and records faults (selector.guard).
    COMBINE (the down launch; out is the layer's [T, N] output): each program writes its fp32 row to part
    [pairs * SPLIT, N] (the bias on split 0 only) and counts itself in count[token, n]; the last of the token's
    k * SPLIT programs to arrive (every slot counts, computed or not) adds the computed rows in one fixed-shape
    sum, the same bits whichever arrives last, writes out[token] and sets the counter back to 0. The rows are
    added unrounded (the sorted path rounds each slot's row to the input dtype first), so a token's bits differ
    from the sorted path's by that rounding. With GUARD a token with a bad slot gets a NaN row, as ``combine``
    gives.
    """
    pair = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    if FIRST:
        if (pair == 0) & (pid_n == 0):
            zero = tl.arange(0, COUNTS_PAD)
            tl.store(count_ptr + zero, tl.zeros([COUNTS_PAD], dtype=tl.int32), mask=zero < n_counts)
            if GUARD:
                check_pairs(ids_ptr, topk_w_ptr, num_valid, flag_ptr, host_ptr, limit, tag, PAIRS_PAD)
    expert = tl.load(ids_ptr + pair)
    valid = (expert >= 0) & (expert < num_experts)
    rows = tl.where(tl.arange(0, BLOCK_M) == 0, pair, num_valid)
    # this program's run of K steps: whole steps, so EVEN_K holds for every run (a run may be empty)
    run = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K
    k0 = pid_s * run
    k_len = tl.maximum(tl.minimum(K - k0, run), 0)
    res = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if valid:
        res = _gemm_tile(
            a_ptr + k0 * stride_ak,
            w_ptr + k0 * stride_wk,
            bias_ptr,
            topk_w_ptr,
            a_ptr,
            a_ptr,
            expert.to(tl.int32),
            0,
            rows,
            pid_n,
            num_valid,
            N,
            k_len,
            a_div,
            up_offset,
            0,
            stride_am,
            stride_ak,
            stride_we,
            stride_wn,
            stride_wk,
            stride_be,
            stride_bn,
            gate_alpha,
            gate_limit,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            GATED,
            INTERLEAVED,
            ACT,
            GATE,
            HAS_BIAS and SPLIT == 1,
            MUL_W,
            EVEN_K,
            EVEN_N,
            DOT_PREC,
            False,
            False,
        )
        if HAS_BIAS and SPLIT > 1:
            res = _first_split_bias(
                res, pid_s, pid_n, expert, pair, bias_ptr, topk_w_ptr, N, stride_be, stride_bn, BLOCK_N
            )
    if COMBINE:
        _combine_pair(
            res,
            pair,
            pid_s,
            valid,
            pid_n,
            part_ptr,
            count_ptr,
            ids_ptr,
            topk_w_ptr,
            out_ptr,
            num_experts,
            top_k,
            limit,
            N,
            stride_om,
            stride_on,
            BLOCK_M,
            BLOCK_N,
            K_PAD,
            SPLIT,
            GUARD,
        )
    elif valid:
        _store_tile(out_ptr, res, rows, 0, pid_n, num_valid, N, stride_om, stride_on, BLOCK_M, BLOCK_N, False)


@triton.jit
def _first_split_bias(
    res, pid_s, pid_n, expert, pair, bias_ptr, topk_w_ptr, N, stride_be, stride_bn, BLOCK_N: tl.constexpr
):
    """A down split's tile (already scaled by the routing weight) with the weighted bias added on split 0 only."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_lim = tl.where(pid_s == 0, N, 0)
    b = tl.load(bias_ptr + expert.to(tl.int64) * stride_be + offs_n * stride_bn, mask=offs_n < n_lim, other=0.0)
    return res + (tl.load(topk_w_ptr + pair).to(tl.float32) * b.to(tl.float32))[None, :]


@triton.jit
def _combine_pair(
    res,
    pair,
    pid_s,
    valid,
    pid_n,
    part_ptr,
    count_ptr,
    ids_ptr,
    topk_w_ptr,
    out_ptr,
    num_experts,
    top_k,
    limit,
    N,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    K_PAD: tl.constexpr,
    SPLIT: tl.constexpr,
    GUARD: tl.constexpr,
):
    """``_pair_gemm_kernel``'s COMBINE epilogue for split `pid_s` of pair `pair` (its result in row 0 of `res`)."""
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if valid:
        row_ptrs = part_ptr + (pair * SPLIT + pid_s).to(tl.int64) * N + offs_m[:, None] * 0 + offs_n[None, :]
        tl.store(row_ptrs, res, mask=(offs_m == 0)[:, None] & n_ok[None, :])
    # every warp's stores first, then the counter (acq_rel): the last to count sees every slot's row
    tl.debug_barrier()
    token = pair // top_k
    counter = count_ptr + token * tl.cdiv(N, BLOCK_N) + pid_n
    # a scalar atomic: one thread runs it and Triton hands the old value to the others through shared memory
    if tl.atomic_add(counter, 1) == top_k * SPLIT - 1:
        tl.store(counter, 0)  # every program has counted: the counter is free again (a relaunch needs no zeroing)
        r = tl.arange(0, K_PAD * SPLIT)  # the token's rows: slot r // SPLIT, split r % SPLIT
        r_ok = r < top_k * SPLIT
        e = tl.load(ids_ptr + token * top_k + r // SPLIT, mask=r_ok, other=-1)
        ok = r_ok & (e >= 0) & (e < num_experts)
        v = tl.load(
            part_ptr + (token * top_k * SPLIT + r).to(tl.int64)[:, None] * N + offs_n[None, :],
            mask=ok[:, None] & n_ok[None, :],
            other=0.0,
            cache_modifier=".cg",
        )  # past the L1
        acc = tl.sum(v, axis=0)
        if GUARD:
            j = tl.arange(0, K_PAD)
            j_ok = j < top_k
            slots = token * top_k + j
            e_j = tl.load(ids_ptr + slots, mask=j_ok, other=-1)
            bad_id, bad_w = check_slots(e_j, tl.load(topk_w_ptr + slots, mask=j_ok, other=0.0), j_ok, limit)
            acc = tl.where(tl.max((bad_id | bad_w).to(tl.int32), axis=0) > 0, float("nan"), acc)
        tl.store(
            out_ptr + token.to(tl.int64) * stride_om + offs_n * stride_on, acc.to(out_ptr.dtype.element_ty), mask=n_ok
        )


@triton.jit(do_not_specialize=["limit"])
def _token_down_kernel(
    a_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    ids_ptr,
    topk_w_ptr,
    num_experts,
    top_k,
    limit,
    N,
    K,
    stride_we,
    stride_wn,
    stride_wk,
    stride_be,
    stride_bn,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    GUARD: tl.constexpr,
    K_PAD: tl.constexpr,
):
    """The down projection of one token, k-way sum included: out[n] = sum_j a[j] . W[ids[j], n, :] (+ w[j] *
    bias[ids[j], n]) for output channels of tile program_id(0), the k experts' K ranges read one after another
    as one K loop. `a` [k, K] holds the token's intermediate rows, already scaled by their routing weights (the
    gate_up launch's MUL_W). One program owns each output element and adds in a fixed order: deterministic,
    no atomics, no partial rows. Slots with an id outside [0, num_experts) add nothing; with GUARD a token
    with a bad slot gets a NaN row, as ``combine`` gives."""
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    j = tl.arange(0, K_PAD)
    j_ok = j < top_k
    e_all = tl.load(ids_ptr + j, mask=j_ok, other=-1)
    ok_all = j_ok & (e_all >= 0) & (e_all < num_experts)
    steps = tl.cdiv(K, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for it in range(0, top_k * steps):
        slot = it // steps
        k0 = (it - slot * steps) * BLOCK_K
        pick = j == slot
        rows = tl.sum(tl.where(pick, ok_all.to(tl.int32), 0), axis=0)  # 1: the slot's row is read, 0: none
        expert = tl.sum(tl.where(pick & ok_all, e_all, 0), axis=0).to(tl.int64)  # 0 for a slot that adds nothing
        k_ok = offs_k < K - k0
        a = tl.load(
            a_ptr + slot * K + k0 + offs_m[:, None] * 0 + offs_k[None, :],
            mask=(offs_m < rows)[:, None] & k_ok[None, :],
            other=0.0,
        )
        w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + (k0 + offs_k)[:, None] * stride_wk
        if EVEN_N:
            w = tl.load(w_ptrs, mask=k_ok[:, None], other=0.0)
        else:
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=DOT_PREC)
    res = tl.sum(acc, axis=0)  # row 0 is the token's; the other rows are zeros
    rw = tl.load(topk_w_ptr + j, mask=j_ok, other=0.0).to(tl.float32)
    if HAS_BIAS:
        for slot in tl.static_range(K_PAD):
            e_s = tl.sum(tl.where((j == slot) & ok_all, e_all, 0), axis=0).to(tl.int64)
            w_s = tl.sum(tl.where((j == slot) & ok_all, rw, 0.0), axis=0)
            b = tl.load(bias_ptr + e_s * stride_be + offs_n * stride_bn, mask=n_ok, other=0.0).to(tl.float32)
            res += w_s * b
    if GUARD:
        bad_id, bad_w = check_slots(e_all, rw, j_ok, limit)
        res = tl.where(tl.max((bad_id | bad_w).to(tl.int32), axis=0) > 0, float("nan"), res)
    tl.store(out_ptr + offs_n * stride_on, res.to(out_ptr.dtype.element_ty), mask=n_ok)


# From this intermediate size up, x is also copied into block order so that gate_up reads it by TMA: the copy
# costs T*k*H, the GEMM T*k*H*I (Mixtral's I=14336 gained 3-10%; I <= 2048 nothing, or lost 3-4%).
SORTED_X_MIN_I = 4096


def tma_fits(w: torch.Tensor, block_m: int, cfg: dict, tile_c: int) -> bool:
    """Whether one GEMM's weights `w` [E, channels, K] (K-contiguous: transposed storage keeps pointer loads) can
    come through a TMA descriptor with these tiles: ``launch.tma_weights`` and ``configs.tma_tiles``, on a device
    with TMA."""
    return (
        _configs.tma_tiles(block_m, cfg["BLOCK_K"], tile_c, w.element_size())
        and tma_weights(w)
        and _tma_device(w.device)
    )


def inter_rows_bound(num_pairs: int, num_experts: int) -> int:
    """Rows enough for an intermediate in pair order or in block order for any BLOCK_M up to a TMA box."""
    box = _configs.TMA_MAX_BOX
    return max(num_pairs, max_blocks_for(num_pairs, num_experts, box) * box)


def rows_in_block_order(
    hidden_states: torch.Tensor, sorted_rows: torch.Tensor, num_pairs: int, top_k: int
) -> torch.Tensor:
    """x's row of each slot of the sorted blocks ([sorted_rows.numel(), H]); padding slots and the unused tail
    (never written by the align) read row 0."""
    real = (sorted_rows >= 0) & (sorted_rows < num_pairs)
    src = torch.where(real, sorted_rows // top_k, 0)
    return hidden_states.index_select(0, src)


NO_TMA: dict[str, bool] = {"w_tma": False, "a_tma": False, "out_blocked": False}


def part_layout(
    part: str,
    w: torch.Tensor,
    block_m: int,
    cfg: dict,
    *,
    i_dim: int,
    gated: bool = True,
    interleaved: bool = False,
    transposed: bool = False,
) -> dict[str, bool]:
    """The TMA switches (``_launch_gemm``'s w_tma, a_tma, out_blocked) of one GEMM, "gate_up" or "down", with
    weights `w` as stored and tiles `cfg`: weights by descriptor where ``tma_fits``; the intermediate (rows of
    a multiple of 16 bytes) written in block order and read back by descriptor; from SORTED_X_MIN_I up, x in
    block order read by descriptor too. Transposed storage (N-contiguous) keeps pointer loads. A layer uses them
    only when both GEMMs can (``fused_experts_impl``)."""
    if transposed or block_m < _configs.TMA_MIN_BLOCK_M or (i_dim * w.element_size()) % 16:
        return NO_TMA
    if part == "down":
        tma = tma_fits(w, block_m, cfg, cfg["BLOCK_N"])
        return {"w_tma": tma, "a_tma": tma, "out_blocked": False}
    tile_c = cfg["BLOCK_N"] * (2 if gated and interleaved else 1)
    if not tma_fits(w, block_m, cfg, tile_c):
        return NO_TMA
    x_sorted = i_dim >= SORTED_X_MIN_I  # x's rows are the weights' K: a multiple of 16 bytes already
    return {"w_tma": True, "a_tma": x_sorted, "out_blocked": True}


def persistent_fits(
    hidden_states: torch.Tensor, cfg: dict, *, gated: bool, interleaved: bool, gate: int, tma: bool
) -> bool:
    """Whether a layer's sorted-block GEMMs run through ``hopper_gemm`` (cfg's PERSISTENT asks for it, with
    blocks of ``configs.PERSISTENT_BLOCK_M`` rows): Gluon importable, an sm_90 device (wgmma; Blackwell has
    none), 16-bit inputs, weights through TMA (`tma`, ``part_layout``), gate and up concatenated with the act_mul
    gate (`gate` 0; `gated` False runs the activation alone)."""
    if not (cfg["PERSISTENT"] and tma and hopper_gemm.AVAILABLE and gate == 0 and not (gated and interleaved)):
        return False
    if hidden_states.dtype not in (torch.bfloat16, torch.float16) or hidden_states.device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(hidden_states.device)[0] == 9


def x_copy_fits(num_tokens: int, top_k: int, hidden: int, intermediate: int, rows: int) -> bool:
    """Whether a call that copies x into block order stays within the temporaries every backend auto may pick
    keeps to, 2 * T*k * max(2I, H) elements: the copy (y then takes its memory) and the intermediate, both `rows`
    long (padding included), and the output."""
    need = rows * (hidden + intermediate) + num_tokens * hidden
    return need <= 2 * num_tokens * top_k * max(2 * intermediate, hidden)


def token_down(i_dim: int, stride_wk: int) -> bool:
    """Whether a one-token call runs its down projection through ``_token_down_kernel``: large intermediates
    stored K-contiguous (``configs.TOKEN_DOWN_MIN_I``)."""
    return i_dim >= _configs.TOKEN_DOWN_MIN_I and stride_wk == 1


class Route(NamedTuple):
    """One call's routing as the launches read it: flat ids and routing weights [T*k], the routing guard (None:
    unguarded), the experts' count and k."""

    ids: torch.Tensor
    topk_w: torch.Tensor
    guard: object | None  # a selector.guard.RoutingGuard
    num_experts: int
    top_k: int


class Blocks(NamedTuple):
    """The align's grouping of a call's pairs (triton_common.align): the pair of each block slot, each block's
    expert, BLOCK_M and the number of pairs."""

    sorted_rows: torch.Tensor
    block_expert: torch.Tensor
    block_m: int
    num_valid: int


def _bias_args(bias: torch.Tensor | None, w: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """The kernels' (bias pointer, its strides): the weights stand in for an absent bias (never read)."""
    return (w, 0, 0) if bias is None else (bias, bias.stride(0), bias.stride(1))


def _launch_token_down(
    gemm: Gemm, inter: torch.Tensor, out: torch.Tensor, route: Route, cfg: dict, *, dot_prec: str
) -> None:
    """One ``_token_down_kernel`` launch: the layer's output row `out` [1, n_out] from `inter` [k, k_dim]."""
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    w, guard = gemm.w, route.guard
    bias, stride_be, stride_bn = _bias_args(gemm.bias, w)
    _, _, _, limit, _ = guard_args(guard, route.topk_w, route.ids)
    args = (
        inter,
        w,
        bias,
        out,
        route.ids,
        route.topk_w,
        route.num_experts,
        route.top_k,
        limit,
        gemm.n_out,
        gemm.k_dim,
        w.stride(0),
        gemm.stride_wn,
        gemm.stride_wk,
        stride_be,
        stride_bn,
        out.stride(1),
    )
    consts = dict(
        BLOCK_M=PAIR_BLOCK_M,
        BLOCK_N=bn,
        BLOCK_K=bk,
        HAS_BIAS=gemm.bias is not None,
        EVEN_N=(gemm.n_out % bn == 0),
        DOT_PREC=dot_prec,
        GUARD=guard is not None,
        K_PAD=max(2, next_pow2(route.top_k)),
    )
    launch(_token_down_kernel, (cdiv(gemm.n_out, bn),), args, consts, cfg["num_warps"], cfg["num_stages"])


def _launch_pair_gemm(
    gemm: Gemm,
    a: torch.Tensor,
    out: torch.Tensor,
    route: Route,
    scratch: tuple[torch.Tensor, torch.Tensor],
    cfg: dict,
    *,
    a_div: int,
    dot_prec: str,
    first: bool,
    combine_out: bool,
    mul_w: bool = False,
) -> None:
    """One ``_pair_gemm_kernel`` launch: `first` for gate_up (zeroes the counters; with a RoutingGuard checks the
    routing), `combine_out` for down (out is the layer's output; `scratch` (part, counts): its fp32 rows per pair
    and K split, cfg's SPLIT_K, and the counters); `mul_w`: scale the rows by their routing weights (gate_up ahead
    of ``_token_down_kernel``)."""
    part, counts = scratch
    ids, topk_w = route.ids, route.topk_w
    n_pairs = ids.numel()
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    split = cfg.get("SPLIT_K", 1) if combine_out else 1
    w = gemm.w
    bias, stride_be, stride_bn = _bias_args(gemm.bias, w)
    _, flag, host, limit, tag = guard_args(route.guard, topk_w, ids)
    args = (
        a,
        w,
        bias,
        out,
        ids,
        topk_w,
        part,
        counts,
        flag,
        host,
        n_pairs,
        route.num_experts,
        route.top_k,
        limit,
        tag,
        counts.numel(),
        gemm.n_out,
        gemm.k_dim,
        a_div,
        gemm.up_offset,
        a.stride(0),
        a.stride(1),
        w.stride(0),
        gemm.stride_wn,
        gemm.stride_wk,
        stride_be,
        stride_bn,
        out.stride(0),
        out.stride(1),
        gemm.gate_alpha,
        gemm.gate_limit,
    )
    consts = dict(
        BLOCK_M=PAIR_BLOCK_M,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GATED=gemm.gated,
        INTERLEAVED=gemm.interleaved,
        ACT=gemm.act,
        GATE=gemm.gate,
        HAS_BIAS=gemm.bias is not None,
        MUL_W=combine_out or mul_w,
        EVEN_K=(gemm.k_dim % bk == 0),
        EVEN_N=(gemm.n_out % bn == 0),
        DOT_PREC=dot_prec,
        FIRST=first,
        COMBINE=combine_out,
        GUARD=route.guard is not None,
        PAIRS_PAD=max(16, next_pow2(n_pairs)),
        COUNTS_PAD=max(16, next_pow2(counts.numel())),
        K_PAD=max(2, next_pow2(route.top_k)),
        SPLIT=split,
    )
    grid = (n_pairs, cdiv(gemm.n_out, bn), split)
    launch(_pair_gemm_kernel, grid, args, consts, cfg["num_warps"], cfg["num_stages"])


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs follow torch's float32 matmul setting: "highest" -> exact fp32 FMA dots, else tf32."""
    if dtype != torch.float32:
        return "tf32"  # ignored by Triton for 16-bit operands
    try:
        prec = torch.get_float32_matmul_precision()
    except Exception:  # pragma: no cover - very old/new torch
        prec = "highest"
    return "ieee" if prec == "highest" else "tf32"


def _launch_gemm(
    gemm: Gemm,
    a: torch.Tensor,
    out: torch.Tensor,
    blocks: Blocks,
    topk_w: torch.Tensor | None,
    cfg: dict,
    *,
    a_div: int,
    dot_prec: str,
    tma: Mapping[str, bool] = NO_TMA,
) -> None:
    """One grouped GEMM launch; `topk_w`: scale the rows by their routing weights (the down GEMM). `tma`
    (``part_layout``): `w_tma` weight tiles through a TMA descriptor (``tma_fits`` said yes); `a_tma`: `a` holds
    the rows in block order (the gate_up launch's `out_blocked` output); `out_blocked`: write rows in block
    order, `out` holding ``sorted_rows.numel()`` rows. Blocks of HALF_TAIL_MIN_BLOCK_M rows or more run
    half-empty blocks as half-height tiles (the kernel's HALF_TAIL)."""
    w, block_m = gemm.w, blocks.block_m
    w_tma, a_tma = tma["w_tma"], tma["a_tma"]
    num_blocks_m = blocks.block_expert.numel()
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    half_tail = block_m >= _configs.HALF_TAIL_MIN_BLOCK_M
    a_desc = a_desc_half = w_desc = a  # placeholders, unused without TMA
    if w_tma:
        tile_c = bn * (2 if gemm.interleaved else 1)
        w_desc = TensorDescriptor.from_tensor(w.view(-1, w.shape[2]), [tile_c, bk])
    if a_tma:
        a_desc = TensorDescriptor.from_tensor(a, [block_m, bk])
        if half_tail:
            a_desc_half = TensorDescriptor.from_tensor(a, [block_m // 2, bk])
    bias, stride_be, stride_bn = _bias_args(gemm.bias, w)
    args = (
        a,
        w,
        bias,
        out,
        blocks.sorted_rows,
        blocks.block_expert,
        a if topk_w is None else topk_w,
        a_desc,
        a_desc_half,
        w_desc,
        blocks.num_valid,
        gemm.n_out,
        gemm.k_dim,
        a_div,
        num_blocks_m,
        gemm.up_offset,
        w.shape[1],
        a.stride(0),
        a.stride(1),
        w.stride(0),
        gemm.stride_wn,
        gemm.stride_wk,
        stride_be,
        stride_bn,
        out.stride(0),
        out.stride(1),
        gemm.gate_alpha,
        gemm.gate_limit,
    )
    consts = dict(
        BLOCK_M=block_m,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=cfg["GROUP_M"],
        GATED=gemm.gated,
        INTERLEAVED=gemm.interleaved,
        ACT=gemm.act,
        GATE=gemm.gate,
        HAS_BIAS=gemm.bias is not None,
        MUL_W=topk_w is not None,
        EVEN_K=(gemm.k_dim % bk == 0),
        EVEN_N=(gemm.n_out % bn == 0),
        DOT_PREC=dot_prec,
        A_TMA=a_tma,
        W_TMA=w_tma,
        OUT_BLOCKED=tma["out_blocked"],
        HALF_TAIL=half_tail,
    )
    grid = (num_blocks_m * cdiv(gemm.n_out, bn),)
    launch(_moe_gemm_kernel, grid, args, consts, cfg["num_warps"], cfg["num_stages"])


def _dims(hidden_states, gate_up_proj, down_proj, gated, transposed):  # noqa: ANN001, ANN202
    """(I, gate_up output channels, strides) from the stored layouts (``records.layer_dims``)."""
    return layer_dims(gate_up_proj, down_proj, transposed)


def _flat(t: torch.Tensor) -> torch.Tensor:
    flat = t.reshape(-1)
    return flat if flat.is_contiguous() else flat.contiguous()


def fused_experts_impl(
    layer: FusedLayer,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    config: dict | None = None,
    guard: int = 0,
) -> torch.Tensor:
    """The kernels, without validation and without the custom-op wrapper. `config`: tiles (``configs.normalize``
    form), else this shape's from the tables or the heuristics; `guard`: a selector.guard code (0: off) that the
    align and combine launches check the routing against."""
    t, h = hidden_states.shape
    top_k = top_k_index.shape[1]
    out = empty((t, h), hidden_states.dtype, hidden_states.device, float("nan"))
    if t == 0 or top_k == 0:
        return out.zero_()
    num_experts, up, dn, i_dim = layer.num_experts, layer.up, layer.dn, layer.inter
    if config is None:  # cached and already normalised
        cfg = _configs.layer_config(layer.shape, t, top_k, hidden_states.device)
    else:
        cfg = _configs.normalize(config)
    ids, tw = _flat(top_k_index), _flat(top_k_weights)
    dot_prec = _dot_precision(hidden_states.dtype)
    checks = resolve_guard(guard, ids.device, num_experts)
    route = Route(ids, tw, checks, num_experts, top_k)
    n_pairs = t * top_k
    if t <= PAIR_BLOCK_MAX_TOKENS:  # decode: a block per pair, then the down launch: two launches
        return _one_token(layer, hidden_states, route, cfg, out, dot_prec)
    bm = cfg["BLOCK_M"]
    gu = part_layout(
        "gate_up",
        up.w,
        bm,
        cfg["gate_up"],
        i_dim=i_dim,
        gated=layer.gated,
        interleaved=up.interleaved,
        transposed=layer.transposed,
    )
    dl = part_layout("down", dn.w, bm, cfg["down"], i_dim=i_dim, transposed=layer.transposed)
    if not (gu["w_tma"] and dl["w_tma"]):
        gu = dl = NO_TMA
    persistent = persistent_fits(
        hidden_states, cfg, gated=layer.gated, interleaved=up.interleaved, gate=up.gate, tma=gu["w_tma"]
    ) and x_copy_fits(t, top_k, h, i_dim, hopper_gemm.compact_rows(n_pairs, num_experts))
    routing = plan_align(ids, num_experts, bm, checks, tw, row_grain=hopper_gemm.ROW_GRAIN if persistent else 0)
    run_align(routing)
    blocks = Blocks(routing.sorted_rows, routing.block_expert, bm, n_pairs)
    if persistent:  # None where the installed Triton does not build the Gluon kernel: the Triton kernel below
        y = hopper_gemm.layer_gemms(
            hidden_states,
            up.w,
            up.bias,
            dn.w,
            dn.bias,
            (blocks.sorted_rows, blocks.block_expert, routing.block_row),
            tw,
            num_experts=num_experts,
            top_k=top_k,
            gated=layer.gated,
            act=up.act,
        )
        if y is not None:
            combine(y, ids, out, top_k, num_experts, guard=checks, weights=tw)
            return out

    inter_rows = blocks.sorted_rows.numel() if gu["out_blocked"] else n_pairs
    inter = empty((inter_rows, i_dim), hidden_states.dtype, hidden_states.device, float("nan"))
    x_sorted = gu["a_tma"]
    a1 = rows_in_block_order(hidden_states, blocks.sorted_rows, n_pairs, top_k) if x_sorted else hidden_states
    y = a1[:n_pairs] if x_sorted else empty((n_pairs, h), hidden_states.dtype, hidden_states.device, float("nan"))
    a_div = 1 if x_sorted else top_k
    _launch_gemm(up, a1, inter, blocks, None, cfg["gate_up"], a_div=a_div, dot_prec=dot_prec, tma=gu)
    if x_sorted:
        repoison(y, float("nan"))
    _launch_gemm(dn, inter, y, blocks, tw, cfg["down"], a_div=1, dot_prec=dot_prec, tma=dl)
    combine(y, ids, out, top_k, num_experts, guard=checks, weights=tw)
    return out


def _one_token(
    layer: FusedLayer, hidden_states: torch.Tensor, route: Route, cfg: dict, out: torch.Tensor, dot_prec: str
) -> torch.Tensor:
    """A one-token call: a block per pair (no align, no combine), gate_up then down."""
    up, dn, h, i_dim = layer.up, layer.dn, layer.hidden, layer.inter
    n_pairs, dev = route.ids.numel(), hidden_states.device
    by_token = token_down(i_dim, dn.stride_wk)  # down by output tile (no counters, no fp32 rows), else by pair
    n_counts = 0 if by_token else hidden_states.shape[0] * cdiv(h, cfg["down"]["BLOCK_N"])
    counts = empty(n_counts, torch.int32, dev, 1 << 20)  # zeroed by gate_up
    part = empty((0 if by_token else n_pairs * cfg["down"]["SPLIT_K"], h), torch.float32, dev, float("nan"))
    inter = empty((n_pairs, i_dim), hidden_states.dtype, dev, float("nan"))
    scratch = (part, counts)
    _launch_pair_gemm(
        up,
        hidden_states,
        inter,
        route,
        scratch,
        cfg["gate_up"],
        a_div=route.top_k,
        dot_prec=dot_prec,
        first=True,
        combine_out=False,
        mul_w=by_token,
    )
    if by_token:
        _launch_token_down(dn, inter, out, route, cfg["down"], dot_prec=dot_prec)
        return out
    _launch_pair_gemm(
        dn, inter, out, route, scratch, cfg["down"], a_div=1, dot_prec=dot_prec, first=False, combine_out=True
    )
    return out


# --------------------------------------------------------------------------------------------------------------
# torch custom op (opaque to torch.compile, fullgraph-safe) and the public entry point.
# --------------------------------------------------------------------------------------------------------------


@torch.library.custom_op("selector::triton_fused_experts", mutates_args=())
def _triton_fused_experts_op(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
    activation: str,
    gated: bool,
    interleaved: bool,
    transposed: bool,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    config: list[int] | None,
    guard: int = 0,
    gate: str = "act_mul",
    gate_alpha: float = 1.0,
    gate_limit: float = 0.0,
) -> torch.Tensor:
    # a custom op's schema is flat tensors and scalars: the record is built again from them (checked when first
    # built, by the caller)
    layer = fused_layer(
        gate_up_proj,
        down_proj,
        num_experts=num_experts,
        activation=activation,
        gated=gated,
        interleaved=interleaved,
        transposed=transposed,
        gate_up_bias=gate_up_bias,
        down_bias=down_bias,
        gate=gate,
        gate_alpha=gate_alpha,
        gate_limit=gate_limit,
    )
    cfg = _configs.decode_config(config) if config is not None else None
    return fused_experts_impl(layer, hidden_states, top_k_index, top_k_weights, cfg, guard)


@_triton_fused_experts_op.register_fake
def _triton_fused_experts_fake(
    hidden_states,
    gate_up_proj,
    down_proj,
    top_k_index,
    top_k_weights,
    num_experts,
    activation,
    gated,
    interleaved,
    transposed,
    gate_up_bias,
    down_bias,
    config,
    guard=0,
    gate="act_mul",
    gate_alpha=1.0,
    gate_limit=0.0,
):
    return hidden_states.new_empty(hidden_states.shape)


def run_op(
    layer: FusedLayer,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    config: dict | None = None,
    guard: int = 0,
) -> torch.Tensor:
    """The layer through the custom op ``selector::triton_fused_experts``: opaque to torch.compile, and its
    autograd formula (plugins/triton_fused/backward.py) differentiates every input. The record is unpacked into
    the op's flat schema."""
    up = layer.up
    return torch.ops.selector.triton_fused_experts(
        hidden_states,
        layer.gate_up,
        layer.down,
        top_k_index,
        top_k_weights,
        layer.num_experts,
        layer.activation,
        layer.gated,
        layer.interleaved,
        layer.transposed,
        layer.gate_up_bias,
        layer.down_bias,
        _configs.encode_config(config) if config is not None else None,
        guard,
        layer.gate,
        up.gate_alpha,
        up.gate_limit,
    )


def fused_experts(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    num_experts: int,
    config: dict | None = None,
    guard: int = 0,
    **layout: Any,
) -> torch.Tensor:
    """MoE experts forward: returns [T, H] in hidden_states' dtype (fp32 accumulation).

    `layout`: ``fused_layer``'s keywords: activation ("silu"), gated (True), interleaved, transposed (False),
    gate_up_bias, down_bias (None), gate ("act_mul"), gate_alpha, gate_limit (None).

    Weights as a Transformers experts module stores them:
      gated:     gate_up_proj [E, 2I, H] ([E, H, 2I] if transposed); concatenated (gate rows first, then up)
                 or interleaved (gate0, up0, gate1, up1, ...)
      not gated: gate_up_proj is the up projection [E, I, H] ([E, H, I] if transposed), activation only
      down_proj  [E, H, I] ([E, I, H] if transposed)
      gate_up_bias [E, 2I] (or [E, I] not gated), down_bias [E, H]; both added before activation / weighting.
    ``gate`` (gated experts): "act_mul" is act(gate) * up with ``activation``; "clamped_swiglu" is GPT-OSS's
    (clamp(up, -gate_limit, gate_limit) + 1) * g * sigmoid(gate_alpha * g), g = min(gate, gate_limit).
    Ids outside [0, num_experts) (expert-parallel sentinel) contribute nothing. ``config`` overrides the tile
    configuration (see ``configs.normalize``); by default it comes from the shipped JSON or the heuristics.
    Under torch.compile the call goes through the torch custom op ``selector::triton_fused_experts`` (opaque,
    fullgraph-safe); in eager mode, and while a CUDA graph captures, it calls the same implementation directly,
    unless autograd records (the op carries the backward of plugins/triton_fused/backward.py).
    `guard`: ``selector.guard.guard_code`` of the calling layer (0: no routing guard).
    A layer called many times builds its record once (``fused_layer``) and runs ``fused_experts_impl`` or
    ``run_op``, as the backend's plan does.
    """
    layer = fused_layer(gate_up_proj, down_proj, num_experts=num_experts, **layout)
    check_call(layer, hidden_states, top_k_index, top_k_weights)
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad
        for t in (hidden_states, gate_up_proj, down_proj, top_k_weights, layer.gate_up_bias, layer.down_bias)
    )
    if not torch.compiler.is_compiling() and not grad:
        return fused_experts_impl(layer, hidden_states, top_k_index, top_k_weights, config, guard)
    return run_op(layer, hidden_states, top_k_index, top_k_weights, config, guard)
