"""The grouped GEMM over expert blocks for Hopper, written in Gluon: persistent and warp-specialised.

The blocks are ``triton_common.align``'s (one expert per BLOCK_M-row block, weights K-contiguous), for the
large-T calls where ``kernels._moe_gemm_kernel``'s tiles pay their prologue and epilogue on every tile. A is read
by TMA from a copy in block order that pads each expert to half a block only (``layer_gemms``: x's rows, then the
intermediate; block b from the align's block_row[b]). Here one program per SM walks its share of the tiles:

- a loader warp streams A's and the weights' K steps through a ring of STAGES shared-memory stages by TMA,
  running ahead across tiles (the next tile's loads overlap this tile's epilogue);
- two consumer warpgroups take the tiles in turn (ping-pong): one runs its K loop of wgmma while the other
  finishes the epilogue of the tile before. A turn barrier hands the K loop from one to the other, so both
  read the ring in the order the loader fills it.

Blocks whose second half holds only padding slots (an expert's last block) run as half-height tiles, as in the
Triton kernel. The K order and the fp32 accumulation per tile are those of the Triton kernel: on the H200 every
case checked gave its bits exactly. The layer takes this kernel where its tile table says PERSISTENT
(``kernels.persistent_fits``); what it gained and where it lost: docs/design/triton_fused.md.

Gluon is Triton's experimental tile language (``triton.experimental.gluon``); its API moves between Triton
releases, so ``AVAILABLE`` is False where it cannot be imported, and where either GEMM does not compile the layer
runs the Triton kernel (``kernels.fused_experts_impl``).
"""

from __future__ import annotations

import functools
import warnings

import torch
import triton
import triton.language as tl
from selector.plugins.triton_common.activation import activation as _triton_activation
from selector.plugins.triton_common.launch import cdiv, empty, launch, repoison

from . import configs as _configs

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    AVAILABLE = True
except Exception:  # pragma: no cover - a Triton without Gluon's Hopper API
    AVAILABLE = False

__all__ = ["AVAILABLE", "ROW_GRAIN", "compact_rows", "layer_gemms", "rows_in_compact_order", "tiles"]

CONSUMER_WARPS = 4  # one warpgroup per consumer: wgmma's unit


if AVAILABLE:
    _CONSUMER_WARPS = gl.constexpr(CONSUMER_WARPS)
    # the TMA load's name: async_load from Triton 3.7 on (the old name raises there), before it the long one
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _LOADER_REGS = gl.constexpr(40)  # registers per thread of the loader warp (it holds only scalars)
    _CONSUMER_REGS = gl.constexpr(232)  # the second consumer's; the first (default partition) gets what is left

    # the epilogue activations of triton_common.activation, compiled as Gluon (same codes, same formulas)
    _act = gluon.jit(_triton_activation.fn)

    @gluon.jit
    def _used_blocks(block_expert_ptr, max_blocks, WARPS: gl.constexpr):
        """How many blocks the align filled (they come first; the rest hold -1)."""
        layout: gl.constexpr = gl.BlockedLayout([4], [32], [WARPS], [0])
        chunk: gl.constexpr = 4 * 32 * WARPS
        used = 0
        for b0 in range(0, max_blocks, chunk):
            offs = b0 + gl.arange(0, chunk, layout)
            e = gl.load(block_expert_ptr + offs, mask=offs < max_blocks, other=-1)
            used += gl.sum((e >= 0).to(gl.int32), axis=0)
        return used

    @gluon.jit
    def _tile_coords(tile, num_blocks, num_pid_n, GROUP_M: gl.constexpr):
        """(block, output tile) of a tile id: GROUP_M blocks share a column sweep, so a weight tile is read by
        the blocks of its expert at about the same time (from the L2 after the first)."""
        in_group = GROUP_M * num_pid_n
        first_m = (tile // in_group) * GROUP_M
        size_m = gl.minimum(num_blocks - first_m, GROUP_M)
        pid_m = first_m + (tile % in_group) % size_m
        pid_n = (tile % in_group) // size_m
        return pid_m, pid_n

    @gluon.jit
    def _is_half(sorted_ptr, row0, num_valid, BLOCK_M: gl.constexpr):
        # an expert's padding slots come after its pairs: a second half that starts with one is all padding
        return gl.load(sorted_ptr + row0 + BLOCK_M // 2) >= num_valid

    @gluon.jit
    def _loader(
        a_desc,
        a_half_desc,
        w_desc,
        a_bufs,
        w_bufs,
        ready,
        empty,
        sorted_ptr,
        block_expert_ptr,
        block_row_ptr,
        num_valid,
        max_blocks,
        N,
        K,
        up_offset,
        w_rows,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        STAGES: gl.constexpr,
        GROUP_M: gl.constexpr,
        GATED: gl.constexpr,
    ):
        """The loader warp: every K step of every tile of this program, in order, into ring stage p % STAGES."""
        num_blocks = _used_blocks(block_expert_ptr, max_blocks, 1)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        num_k = gl.cdiv(K, BLOCK_K)
        w_bytes: gl.constexpr = w_desc.block_type.nbytes * (2 if GATED else 1)
        p = 0
        for tile in range(gl.program_id(0), num_blocks * num_pid_n, gl.num_programs(0)):
            pid_m, pid_n = _tile_coords(tile, num_blocks, num_pid_n, GROUP_M)
            half = _is_half(sorted_ptr, pid_m * BLOCK_M, num_valid, BLOCK_M)
            a_row = gl.load(block_row_ptr + pid_m)  # the block's first row in A (experts padded to half blocks)
            w_row = gl.load(block_expert_ptr + pid_m) * w_rows + pid_n * BLOCK_N
            for kk in range(num_k):
                s = p % STAGES
                mbarrier.wait(empty.index(s), ((p // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
                bar = ready.index(s)
                k = kk * BLOCK_K
                if half:
                    mbarrier.expect(bar, a_half_desc.block_type.nbytes + w_bytes)
                    _tma_load(a_half_desc, [a_row, k], bar, a_bufs.index(s).slice(0, BLOCK_M // 2))
                else:
                    mbarrier.expect(bar, a_desc.block_type.nbytes + w_bytes)
                    _tma_load(a_desc, [a_row, k], bar, a_bufs.index(s))
                w_buf = w_bufs.index(s)
                _tma_load(w_desc, [w_row, k], bar, w_buf.slice(0, BLOCK_N))
                if GATED:
                    _tma_load(w_desc, [w_row + up_offset, k], bar, w_buf.slice(BLOCK_N, BLOCK_N))
                p += 1

    @gluon.jit
    def _k_loop(
        a_bufs,
        w_bufs,
        ready,
        empty,
        turn,
        p,
        num_k,
        ROLE: gl.constexpr,
        TILE_M: gl.constexpr,
        W_TILE: gl.constexpr,
        STAGES: gl.constexpr,
    ):
        """One tile's K loop from ring position p: one wgmma group per step over all W_TILE weight rows of the
        stage (gate and up together when gated: A is read from shared memory once for both), the step before
        released as soon as its group is done. Hands the turn to the other consumer once its last group is
        issued. Returns the fp32 accumulator [TILE_M, W_TILE]."""
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, W_TILE, 16]
        )
        acc = gl.zeros([TILE_M, W_TILE], gl.float32, layout)
        for kk in range(num_k):
            s = p % STAGES
            mbarrier.wait(ready.index(s), (p // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s).slice(0, TILE_M), w_bufs.index(s).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))
            mbarrier.arrive(empty.index((p + STAGES - 1) % STAGES), count=1, pred=kk > 0)
            p += 1
        mbarrier.arrive(turn.index(1 - ROLE), count=1)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((p + STAGES - 1) % STAGES), count=1)
        return acc

    @gluon.jit
    def _epilogue(
        acc,
        out_ptr,
        bias_ptr,
        sorted_ptr,
        topk_w_ptr,
        expert,
        row0,
        a_row,
        pid_n,
        num_valid,
        N,
        up_offset,
        stride_om,
        stride_be,
        TILE_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        GATED: gl.constexpr,
        ACT: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        MUL_W: gl.constexpr,
        OUT_BLOCKED: gl.constexpr,
    ):
        """Bias, activation (act(gate) * up when gated: the accumulator's first BLOCK_N columns are gate's, the
        next up's), routing weight; stores the tile at A's rows of the block (OUT_BLOCKED, padding slots too: the
        next GEMM reads it as its A) or at the pairs' own rows. row0: the block's first slot in sorted_ptr."""
        if GATED:  # column c and c + BLOCK_N sit in the same thread of the wgmma layout: a split in registers
            acc, acc_u = acc.reshape([TILE_M, 2, BLOCK_N]).permute((0, 2, 1)).split()
        else:
            acc_u = acc
        layout: gl.constexpr = acc.type.layout
        offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, layout))
        n_ok = offs_n < N
        if HAS_BIAS:
            b_base = bias_ptr + expert.to(gl.int64) * stride_be
            acc = acc + gl.expand_dims(gl.load(b_base + offs_n, mask=n_ok, other=0.0).to(gl.float32), 0)
            if GATED:
                b_u = gl.load(b_base + up_offset + offs_n, mask=n_ok, other=0.0).to(gl.float32)
                acc_u = acc_u + gl.expand_dims(b_u, 0)
        if GATED:
            res = _act(acc, ACT) * acc_u
        else:
            res = _act(acc, ACT)
        if MUL_W:
            offs_m = gl.arange(0, TILE_M, gl.SliceLayout(1, layout))
            rows = gl.load(sorted_ptr + row0 + offs_m)
            rw = gl.load(topk_w_ptr + rows, mask=rows < num_valid, other=0.0).to(gl.float32)
            res = res * gl.expand_dims(rw, 1)
        # through shared memory into rows of 16-byte pieces: the wgmma layout gives each thread 2 adjacent columns
        tpw_n: gl.constexpr = BLOCK_N // 8
        store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // tpw_n, tpw_n], [4, 1], [1, 0])
        res = gl.convert_layout(res.to(out_ptr.dtype.element_ty), store_layout)
        offs_m = gl.arange(0, TILE_M, gl.SliceLayout(1, store_layout))
        offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(0, store_layout))
        if OUT_BLOCKED:
            out_rows = (a_row + offs_m).to(gl.int64)
            row_ok = offs_m >= 0
        else:
            rows = gl.load(sorted_ptr + row0 + offs_m)
            out_rows = rows.to(gl.int64)
            row_ok = rows < num_valid
        mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(offs_n < N, 0)
        ptrs = out_ptr + gl.expand_dims(out_rows * stride_om, 1) + gl.expand_dims(offs_n, 0)
        gl.store(ptrs, res, mask=mask)

    @gluon.jit
    def _tile(
        a_bufs,
        w_bufs,
        ready,
        empty,
        turn,
        p,
        num_k,
        out_ptr,
        bias_ptr,
        sorted_ptr,
        topk_w_ptr,
        expert,
        row0,
        a_row,
        pid_n,
        num_valid,
        N,
        up_offset,
        stride_om,
        stride_be,
        ROLE: gl.constexpr,
        TILE_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        GATED: gl.constexpr,
        ACT: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        MUL_W: gl.constexpr,
        OUT_BLOCKED: gl.constexpr,
    ):
        """One tile of TILE_M rows (a whole block, or the first half of an expert's last block)."""
        W_TILE: gl.constexpr = BLOCK_N * (2 if GATED else 1)
        acc = _k_loop(a_bufs, w_bufs, ready, empty, turn, p, num_k, ROLE, TILE_M, W_TILE, STAGES)
        _epilogue(
            acc,
            out_ptr,
            bias_ptr,
            sorted_ptr,
            topk_w_ptr,
            expert,
            row0,
            a_row,
            pid_n,
            num_valid,
            N,
            up_offset,
            stride_om,
            stride_be,
            TILE_M,
            BLOCK_N,
            GATED,
            ACT,
            HAS_BIAS,
            MUL_W,
            OUT_BLOCKED,
        )

    @gluon.jit
    def _consumer(
        a_bufs,
        w_bufs,
        ready,
        empty,
        turn,
        out_ptr,
        bias_ptr,
        sorted_ptr,
        block_expert_ptr,
        block_row_ptr,
        topk_w_ptr,
        num_valid,
        max_blocks,
        N,
        K,
        up_offset,
        stride_om,
        stride_be,
        ROLE: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        STAGES: gl.constexpr,
        GROUP_M: gl.constexpr,
        GATED: gl.constexpr,
        ACT: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        MUL_W: gl.constexpr,
        OUT_BLOCKED: gl.constexpr,
    ):
        """Consumer ROLE (0 or 1) takes this program's tiles j with j % 2 == ROLE. Tile j's K loop starts once
        the other consumer has issued tile j - 1's (its (j + 1) // 2-th hand-over on turn[ROLE]), so the ring
        is read in fill order and a stage's barrier is never two phases behind its reader."""
        HALF_M: gl.constexpr = BLOCK_M // 2
        num_blocks = _used_blocks(block_expert_ptr, max_blocks, 4)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        num_k = gl.cdiv(K, BLOCK_K)
        j = 0
        for tile in range(gl.program_id(0), num_blocks * num_pid_n, gl.num_programs(0)):
            if j % 2 == ROLE:
                pid_m, pid_n = _tile_coords(tile, num_blocks, num_pid_n, GROUP_M)
                row0 = pid_m * BLOCK_M
                expert = gl.load(block_expert_ptr + pid_m)
                a_row = gl.load(block_row_ptr + pid_m)
                mbarrier.wait(turn.index(ROLE), (((j + 1) // 2) - 1) & 1, pred=j > 0)
                p = j * num_k
                if _is_half(sorted_ptr, row0, num_valid, BLOCK_M):
                    _tile(
                        a_bufs,
                        w_bufs,
                        ready,
                        empty,
                        turn,
                        p,
                        num_k,
                        out_ptr,
                        bias_ptr,
                        sorted_ptr,
                        topk_w_ptr,
                        expert,
                        row0,
                        a_row,
                        pid_n,
                        num_valid,
                        N,
                        up_offset,
                        stride_om,
                        stride_be,
                        ROLE,
                        HALF_M,
                        BLOCK_N,
                        STAGES,
                        GATED,
                        ACT,
                        HAS_BIAS,
                        MUL_W,
                        OUT_BLOCKED,
                    )
                else:
                    _tile(
                        a_bufs,
                        w_bufs,
                        ready,
                        empty,
                        turn,
                        p,
                        num_k,
                        out_ptr,
                        bias_ptr,
                        sorted_ptr,
                        topk_w_ptr,
                        expert,
                        row0,
                        a_row,
                        pid_n,
                        num_valid,
                        N,
                        up_offset,
                        stride_om,
                        stride_be,
                        ROLE,
                        BLOCK_M,
                        BLOCK_N,
                        STAGES,
                        GATED,
                        ACT,
                        HAS_BIAS,
                        MUL_W,
                        OUT_BLOCKED,
                    )
            j += 1

    @gluon.jit
    def _grouped_gemm_kernel(
        a_desc,
        a_half_desc,
        w_desc,
        out_ptr,
        bias_ptr,
        sorted_ptr,
        block_expert_ptr,
        block_row_ptr,
        topk_w_ptr,
        num_valid,
        max_blocks,
        N,
        K,
        up_offset,
        w_rows,
        stride_om,
        stride_be,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        STAGES: gl.constexpr,
        GROUP_M: gl.constexpr,
        GATED: gl.constexpr,
        ACT: gl.constexpr,
        HAS_BIAS: gl.constexpr,
        MUL_W: gl.constexpr,
        OUT_BLOCKED: gl.constexpr,
    ):
        """out = epilogue(A[block rows] @ W[expert]^T) for every (block, output tile); see the module docstring.
        W is seen as [E * w_rows, K]; gated: gate rows from n, up rows from n + up_offset of the expert's."""
        w_tile: gl.constexpr = BLOCK_N * (2 if GATED else 1)
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, w_tile, BLOCK_K], w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        for i in gl.static_range(2):
            mbarrier.init(turn.index(i), count=1)
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (
                        a_bufs,
                        w_bufs,
                        ready,
                        empty,
                        turn,
                        out_ptr,
                        bias_ptr,
                        sorted_ptr,
                        block_expert_ptr,
                        block_row_ptr,
                        topk_w_ptr,
                        num_valid,
                        max_blocks,
                        N,
                        K,
                        up_offset,
                        stride_om,
                        stride_be,
                        0,
                        BLOCK_M,
                        BLOCK_N,
                        BLOCK_K,
                        STAGES,
                        GROUP_M,
                        GATED,
                        ACT,
                        HAS_BIAS,
                        MUL_W,
                        OUT_BLOCKED,
                    ),
                ),
                (
                    _consumer,
                    (
                        a_bufs,
                        w_bufs,
                        ready,
                        empty,
                        turn,
                        out_ptr,
                        bias_ptr,
                        sorted_ptr,
                        block_expert_ptr,
                        block_row_ptr,
                        topk_w_ptr,
                        num_valid,
                        max_blocks,
                        N,
                        K,
                        up_offset,
                        stride_om,
                        stride_be,
                        1,
                        BLOCK_M,
                        BLOCK_N,
                        BLOCK_K,
                        STAGES,
                        GROUP_M,
                        GATED,
                        ACT,
                        HAS_BIAS,
                        MUL_W,
                        OUT_BLOCKED,
                    ),
                ),
                (
                    _loader,
                    (
                        a_desc,
                        a_half_desc,
                        w_desc,
                        a_bufs,
                        w_bufs,
                        ready,
                        empty,
                        sorted_ptr,
                        block_expert_ptr,
                        block_row_ptr,
                        num_valid,
                        max_blocks,
                        N,
                        K,
                        up_offset,
                        w_rows,
                        BLOCK_M,
                        BLOCK_N,
                        BLOCK_K,
                        STAGES,
                        GROUP_M,
                        GATED,
                    ),
                ),
            ],
            [_CONSUMER_WARPS, 1],
            [_CONSUMER_REGS, _LOADER_REGS],  # the first consumer (the default partition) gets what is left
        )


# The tiles, one set for every shape: a consumer's fp32 accumulator is 128 rows by 128 columns (gate and up
# 64 each when gated), 128 of its 232 registers; five ring stages of 32 KB and the epilogue's staging take about
# 180 KB of shared memory. On the H200 4 to 6 stages and GROUP_M 4 to 16 measured within the rounds' spread.
_TILES = {
    "gate_up": {"BLOCK_N": 64, "BLOCK_K": 64, "num_stages": 5, "GROUP_M": 4},
    "down": {"BLOCK_N": 128, "BLOCK_K": 64, "num_stages": 5, "GROUP_M": 4},
}


def tiles(part: str, gated: bool) -> dict[str, int]:
    """The kernel's tiles for one GEMM, "gate_up" or "down" (a gate_up that is not gated takes down's width)."""
    return _TILES["down" if part == "down" or not gated else "gate_up"]


# compile keys (the kernel's constexprs and dtypes) that compiled here, and those that failed: a failure is a
# Triton whose Gluon differs from the one this kernel was written for, and the caller runs the Triton kernel
_COMPILED: set[tuple] = set()
_FAILED: set[tuple] = set()


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple[int, int], dtype: torch.dtype):
    """The descriptors' swizzled layout (cached: building one costs about 10 us of host time per call)."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


# The copies this kernel reads as A (x's rows, then the intermediate) pad each expert's rows to half a block, not to
# a whole one: an expert's last block whose second half is padding alone runs as a half-height tile anyway, so its
# second half need not exist in memory. Per expert up to ROW_GRAIN - 1 rows of padding instead of BLOCK_M - 1: at
# 128 experts and 256 pairs each, 1.22x the pairs' rows instead of 1.48x.
ROW_GRAIN = _configs.PERSISTENT_BLOCK_M // 2
_COPY_COLUMNS = 128  # columns of x per program of the copy


def compact_rows(num_pairs: int, num_experts: int) -> int:
    """Rows of the copies (x's, the intermediate's) for `num_pairs` (token, slot) pairs over `num_experts`: every
    pair and at most ROW_GRAIN - 1 rows of padding per expert that has any."""
    return num_pairs + min(num_pairs, num_experts) * (ROW_GRAIN - 1)


@triton.jit
def _copy_rows_kernel(
    x_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    block_row_ptr,
    num_valid,
    top_k,
    H,
    stride_x,
    stride_o,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """out[block_row[b] + m] = x[sorted[b * BLOCK_M + m] // top_k] for the slots of block b that have rows in the
    copy (the first half only where the second holds padding alone); a padding slot copies row 0, blocks past the
    end nothing. Program (b, j): columns [j * BLOCK_H, (j + 1) * BLOCK_H)."""
    b = tl.program_id(0)
    if tl.load(block_expert_ptr + b) >= 0:
        m = tl.arange(0, BLOCK_M)
        src = tl.load(sorted_ptr + b * BLOCK_M + m)
        half = tl.load(sorted_ptr + b * BLOCK_M + BLOCK_M // 2) >= num_valid
        m_ok = m < tl.where(half, BLOCK_M // 2, BLOCK_M)
        rows = (tl.where(src < num_valid, src, 0) // top_k).to(tl.int64)
        dst = (tl.load(block_row_ptr + b) + m).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = m_ok[:, None] & (h < H)[None, :]
        v = tl.load(x_ptr + rows[:, None] * stride_x + h[None, :], mask=mask)
        tl.store(out_ptr + dst[:, None] * stride_o + h[None, :], v, mask=mask)


def rows_in_compact_order(
    x: torch.Tensor, rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor], *, num_experts: int, top_k: int
) -> torch.Tensor:
    """x's row of each slot of the sorted blocks, block b from row block_row[b] on; `rows`: (sorted_rows,
    block_expert, block_row) of ``triton_common.align`` with a row grain of ROW_GRAIN. Returns
    [compact_rows(T*k, E), H]; rows past the last block's are not written."""
    sorted_rows, block_expert, block_row = rows
    num_pairs = x.shape[0] * top_k
    out = empty((compact_rows(num_pairs, num_experts), x.shape[1]), x.dtype, x.device, float("nan"))
    grid = (block_expert.numel(), cdiv(x.shape[1], _COPY_COLUMNS))
    launch(
        _copy_rows_kernel,
        grid,
        (x, out, sorted_rows, block_expert, block_row, num_pairs, top_k, x.shape[1], x.stride(0), out.stride(0)),
        dict(BLOCK_M=sorted_rows.numel() // block_expert.numel(), BLOCK_H=_COPY_COLUMNS),
        4,
    )
    return out


def _compile_key(part: str, block_m: int, gated: bool, act: int, has_bias: bool, dtype: torch.dtype) -> tuple:
    """(constexprs, key) of one GEMM's kernel: "gate_up" writes the intermediate, "down" scales by the routing
    weights and writes the pairs' rows."""
    cfg = tiles(part, gated)
    down = part == "down"
    consts = dict(
        BLOCK_M=block_m,
        BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"],
        STAGES=cfg["num_stages"],
        GROUP_M=cfg["GROUP_M"],
        GATED=gated and not down,
        ACT=0 if down else act,
        HAS_BIAS=has_bias,
        MUL_W=down,
        OUT_BLOCKED=not down,
    )
    return consts, (*consts.values(), dtype)


def _launch(
    compiled: tuple[dict, tuple],
    a: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    topk_w: torch.Tensor | None,
    *,
    num_valid: int,
    n_out: int,
    up_offset: int,
) -> bool:
    """One GEMM (see ``layer_gemms``) with the kernel of `compiled` (``_compile_key``); False, having launched
    nothing, when it does not compile here (warned once per compile key). A key that compiled before raises as
    usual."""
    consts, key = compiled
    if key in _FAILED:
        return False
    sorted_rows, block_expert, block_row = rows
    if bias is not None and bias.stride(1) != 1:  # the epilogue reads a bias row as contiguous channels
        bias = bias.contiguous()
    block_m, bn, bk = consts["BLOCK_M"], consts["BLOCK_N"], consts["BLOCK_K"]
    a_desc = TensorDescriptor.from_tensor(a, [block_m, bk], _smem_layout((block_m, bk), a.dtype))
    a_half_desc = TensorDescriptor.from_tensor(a, [block_m // 2, bk], _smem_layout((block_m // 2, bk), a.dtype))
    w_desc = TensorDescriptor.from_tensor(w.view(-1, w.shape[2]), [bn, bk], _smem_layout((bn, bk), w.dtype))
    max_blocks = block_expert.numel()
    grid = (max(1, min(_configs._num_sms(a.device.index), max_blocks * -(-n_out // bn))),)
    args = (
        a_desc,
        a_half_desc,
        w_desc,
        out,
        bias if bias is not None else w,
        sorted_rows,
        block_expert,
        block_row,
        topk_w if topk_w is not None else a,
        num_valid,
        max_blocks,
        n_out,
        a.shape[1],
        up_offset,
        w.shape[1],
        out.stride(0),
        bias.stride(0) if bias is not None else 0,
    )
    try:  # through triton_common's launch cache: the JIT's own dispatch costs about 100 us of host time
        launch(_grouped_gemm_kernel, grid, args, consts, CONSUMER_WARPS)
    except Exception as exc:  # compile errors come as several types (CompilationError, RuntimeError, ...)
        if key in _COMPILED:
            raise
        _FAILED.add(key)
        warnings.warn(
            f"triton_fused: the persistent Hopper GEMM did not compile with this Triton "
            f"({type(exc).__name__}: {str(exc)[:200]}); running the Triton kernel instead",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    _COMPILED.add(key)
    return True


def layer_gemms(
    x: torch.Tensor,
    gate_up_proj: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_proj: torch.Tensor,
    down_bias: torch.Tensor | None,
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    topk_w: torch.Tensor,
    *,
    num_experts: int,
    top_k: int,
    gated: bool,
    act: int,
) -> torch.Tensor | None:
    """Both GEMMs of a layer: y [T*k, H], row t*k+j holding pair (t, j)'s down row times its routing weight (rows
    of dropped pairs unwritten), for ``triton_common.combine``. Weights [E, channels, K] contiguous (gate_up_proj
    [E, 2I, H] concatenated when `gated`, else [E, I, H]); `rows`: (sorted_rows, block_expert, block_row) of
    ``triton_common.align`` over blocks of ``configs.PERSISTENT_BLOCK_M`` rows with a row grain of ROW_GRAIN.

    x's rows are copied into the blocks' order first (``rows_in_compact_order``; y then takes that copy's memory),
    the intermediate is written and read in the same order. Returns None when either GEMM's kernel does not
    compile with the installed Triton: nothing is launched then, except on the down GEMM's first failure, whose
    gate_up work is thrown away; the caller runs the Triton kernel instead."""
    sorted_rows, block_expert, _ = rows
    block_m = sorted_rows.numel() // block_expert.numel()
    gate_up = _compile_key("gate_up", block_m, gated, act, gate_up_bias is not None, x.dtype)
    down = _compile_key("down", block_m, gated, act, down_bias is not None, x.dtype)
    if gate_up[1] in _FAILED or down[1] in _FAILED:
        return None
    n_pairs = topk_w.numel()
    i_dim = down_proj.shape[2]
    a = rows_in_compact_order(x, rows, num_experts=num_experts, top_k=top_k)
    inter = empty((a.shape[0], i_dim), x.dtype, x.device, float("nan"))
    if not _launch(
        gate_up, a, gate_up_proj, gate_up_bias, inter, rows, None, num_valid=n_pairs, n_out=i_dim, up_offset=i_dim
    ):
        return None
    y = a[:n_pairs]  # gate_up has read the copy (a launch earlier on the same stream)
    repoison(y, float("nan"))
    if not _launch(
        down, inter, down_proj, down_bias, y, rows, topk_w, num_valid=n_pairs, n_out=down_proj.shape[1], up_offset=0
    ):
        return None
    return y
