"""The grouped GEMM over expert blocks for Hopper, written in Gluon: persistent and warp-specialised.

Same contract as ``kernels._moe_gemm_kernel`` on its TMA path (A's rows in block order, weights K-contiguous,
one expert per BLOCK_M-row block from ``triton_common.align``), for the large-T calls where that kernel's tiles
pay their prologue and epilogue on every tile. Here one program per SM walks its share of the tiles:

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
releases, so ``AVAILABLE`` is False where it cannot be imported, and a compile failure falls back to the Triton
kernel (``kernels.fused_experts_impl``).
"""

from __future__ import annotations

import warnings

import torch
from selector.plugins.triton_common.activation import activation as _triton_activation

from . import configs as _configs

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    AVAILABLE = True
except Exception:  # pragma: no cover - a Triton without Gluon's Hopper API
    AVAILABLE = False

__all__ = ["AVAILABLE", "launch_grouped_gemm", "tiles"]

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
    def _loader(a_desc, a_half_desc, w_desc, a_bufs, w_bufs, ready, empty, sorted_ptr, block_expert_ptr,
                num_valid, max_blocks, N, K, up_offset, w_rows, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                BLOCK_K: gl.constexpr, STAGES: gl.constexpr, GROUP_M: gl.constexpr, GATED: gl.constexpr):  # fmt: skip
        """The loader warp: every K step of every tile of this program, in order, into ring stage p % STAGES."""
        num_blocks = _used_blocks(block_expert_ptr, max_blocks, 1)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        num_k = gl.cdiv(K, BLOCK_K)
        w_bytes: gl.constexpr = w_desc.block_type.nbytes * (2 if GATED else 1)
        p = 0
        for tile in range(gl.program_id(0), num_blocks * num_pid_n, gl.num_programs(0)):
            pid_m, pid_n = _tile_coords(tile, num_blocks, num_pid_n, GROUP_M)
            row0 = pid_m * BLOCK_M
            half = _is_half(sorted_ptr, row0, num_valid, BLOCK_M)
            w_row = gl.load(block_expert_ptr + pid_m) * w_rows + pid_n * BLOCK_N
            for kk in range(num_k):
                s = p % STAGES
                mbarrier.wait(empty.index(s), ((p // STAGES) & 1) ^ 1)  # a fresh barrier passes phase 1
                bar = ready.index(s)
                k = kk * BLOCK_K
                if half:
                    mbarrier.expect(bar, a_half_desc.block_type.nbytes + w_bytes)
                    _tma_load(a_half_desc, [row0, k], bar, a_bufs.index(s).slice(0, BLOCK_M // 2))
                else:
                    mbarrier.expect(bar, a_desc.block_type.nbytes + w_bytes)
                    _tma_load(a_desc, [row0, k], bar, a_bufs.index(s))
                w_buf = w_bufs.index(s)
                _tma_load(w_desc, [w_row, k], bar, w_buf.slice(0, BLOCK_N))
                if GATED:
                    _tma_load(w_desc, [w_row + up_offset, k], bar, w_buf.slice(BLOCK_N, BLOCK_N))
                p += 1

    @gluon.jit
    def _k_loop(a_bufs, w_bufs, ready, empty, turn, p, num_k, ROLE: gl.constexpr, TILE_M: gl.constexpr,
                W_TILE: gl.constexpr, STAGES: gl.constexpr):  # fmt: skip
        """One tile's K loop from ring position p: one wgmma group per step over all W_TILE weight rows of the
        stage (gate and up together when gated: A is read from shared memory once for both), the step before
        released as soon as its group is done. Hands the turn to the other consumer once its last group is
        issued. Returns the fp32 accumulator [TILE_M, W_TILE]."""
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, W_TILE, 16])  # fmt: skip
        acc = gl.zeros([TILE_M, W_TILE], gl.float32, layout)
        for kk in range(num_k):
            s = p % STAGES
            mbarrier.wait(ready.index(s), (p // STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s).slice(0, TILE_M), w_bufs.index(s).permute((1, 0)), acc,
                                is_async=True)  # fmt: skip
            acc = warpgroup_mma_wait(1, deps=(acc,))
            mbarrier.arrive(empty.index((p + STAGES - 1) % STAGES), count=1, pred=kk > 0)
            p += 1
        mbarrier.arrive(turn.index(1 - ROLE), count=1)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((p + STAGES - 1) % STAGES), count=1)
        return acc

    @gluon.jit
    def _epilogue(acc, out_ptr, bias_ptr, sorted_ptr, topk_w_ptr, expert, row0, pid_n, num_valid, N,
                  up_offset, stride_om, stride_be, TILE_M: gl.constexpr, BLOCK_N: gl.constexpr, GATED: gl.constexpr,
                  ACT: gl.constexpr, HAS_BIAS: gl.constexpr, MUL_W: gl.constexpr,
                  OUT_BLOCKED: gl.constexpr):  # fmt: skip
        """Bias, activation (act(gate) * up when gated: the accumulator's first BLOCK_N columns are gate's, the
        next up's), routing weight; stores the tile at the block's slots (OUT_BLOCKED, padding slots too) or at
        the pairs' own rows."""
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
            out_rows = (row0 + offs_m).to(gl.int64)
            row_ok = offs_m >= 0
        else:
            rows = gl.load(sorted_ptr + row0 + offs_m)
            out_rows = rows.to(gl.int64)
            row_ok = rows < num_valid
        mask = gl.expand_dims(row_ok, 1) & gl.expand_dims(offs_n < N, 0)
        ptrs = out_ptr + gl.expand_dims(out_rows * stride_om, 1) + gl.expand_dims(offs_n, 0)
        gl.store(ptrs, res, mask=mask)

    @gluon.jit
    def _tile(a_bufs, w_bufs, ready, empty, turn, p, num_k, out_ptr, bias_ptr, sorted_ptr, topk_w_ptr, expert, row0,
              pid_n, num_valid, N, up_offset, stride_om, stride_be, ROLE: gl.constexpr, TILE_M: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, GATED: gl.constexpr, ACT: gl.constexpr,
              HAS_BIAS: gl.constexpr, MUL_W: gl.constexpr, OUT_BLOCKED: gl.constexpr):  # fmt: skip
        """One tile of TILE_M rows (a whole block, or the first half of an expert's last block)."""
        W_TILE: gl.constexpr = BLOCK_N * (2 if GATED else 1)
        acc = _k_loop(a_bufs, w_bufs, ready, empty, turn, p, num_k, ROLE, TILE_M, W_TILE, STAGES)
        _epilogue(acc, out_ptr, bias_ptr, sorted_ptr, topk_w_ptr, expert, row0, pid_n, num_valid, N, up_offset,
                  stride_om, stride_be, TILE_M, BLOCK_N, GATED, ACT, HAS_BIAS, MUL_W, OUT_BLOCKED)  # fmt: skip

    @gluon.jit
    def _consumer(a_bufs, w_bufs, ready, empty, turn, out_ptr, bias_ptr, sorted_ptr, block_expert_ptr, topk_w_ptr,
                  num_valid, max_blocks, N, K, up_offset, stride_om, stride_be, ROLE: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, STAGES: gl.constexpr,
                  GROUP_M: gl.constexpr, GATED: gl.constexpr, ACT: gl.constexpr, HAS_BIAS: gl.constexpr,
                  MUL_W: gl.constexpr, OUT_BLOCKED: gl.constexpr):  # fmt: skip
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
                mbarrier.wait(turn.index(ROLE), (((j + 1) // 2) - 1) & 1, pred=j > 0)
                p = j * num_k
                if _is_half(sorted_ptr, row0, num_valid, BLOCK_M):
                    _tile(a_bufs, w_bufs, ready, empty, turn, p, num_k, out_ptr, bias_ptr, sorted_ptr, topk_w_ptr,
                          expert, row0, pid_n, num_valid, N, up_offset, stride_om, stride_be, ROLE, HALF_M, BLOCK_N,
                          STAGES, GATED, ACT, HAS_BIAS, MUL_W, OUT_BLOCKED)  # fmt: skip
                else:
                    _tile(a_bufs, w_bufs, ready, empty, turn, p, num_k, out_ptr, bias_ptr, sorted_ptr, topk_w_ptr,
                          expert, row0, pid_n, num_valid, N, up_offset, stride_om, stride_be, ROLE, BLOCK_M, BLOCK_N,
                          STAGES, GATED, ACT, HAS_BIAS, MUL_W, OUT_BLOCKED)  # fmt: skip
            j += 1

    @gluon.jit
    def _grouped_gemm_kernel(a_desc, a_half_desc, w_desc, out_ptr, bias_ptr, sorted_ptr, block_expert_ptr,
                             topk_w_ptr, num_valid, max_blocks, N, K, up_offset, w_rows, stride_om, stride_be,
                             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                             STAGES: gl.constexpr, GROUP_M: gl.constexpr, GATED: gl.constexpr, ACT: gl.constexpr,
                             HAS_BIAS: gl.constexpr, MUL_W: gl.constexpr, OUT_BLOCKED: gl.constexpr):  # fmt: skip
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
                (_consumer, (a_bufs, w_bufs, ready, empty, turn, out_ptr, bias_ptr, sorted_ptr, block_expert_ptr,
                             topk_w_ptr, num_valid, max_blocks, N, K, up_offset, stride_om, stride_be, 0, BLOCK_M,
                             BLOCK_N, BLOCK_K, STAGES, GROUP_M, GATED, ACT, HAS_BIAS, MUL_W, OUT_BLOCKED)),
                (_consumer, (a_bufs, w_bufs, ready, empty, turn, out_ptr, bias_ptr, sorted_ptr, block_expert_ptr,
                             topk_w_ptr, num_valid, max_blocks, N, K, up_offset, stride_om, stride_be, 1, BLOCK_M,
                             BLOCK_N, BLOCK_K, STAGES, GROUP_M, GATED, ACT, HAS_BIAS, MUL_W, OUT_BLOCKED)),
                (_loader, (a_desc, a_half_desc, w_desc, a_bufs, w_bufs, ready, empty, sorted_ptr, block_expert_ptr,
                           num_valid, max_blocks, N, K, up_offset, w_rows, BLOCK_M, BLOCK_N, BLOCK_K, STAGES,
                           GROUP_M, GATED)),
            ],
            [_CONSUMER_WARPS, 1],
            [_CONSUMER_REGS, _LOADER_REGS],  # the first consumer (the default partition) gets what is left
        )  # fmt: skip


# The tiles, one set for every shape: a consumer's fp32 accumulator is 128 rows by 128 columns (gate and up
# 64 each when gated), 128 of its 232 registers; five ring stages of 32 KB and the epilogue's staging take about
# 180 KB of shared memory. On the H200 4 to 6 stages and GROUP_M 4 to 16 measured within the rounds' spread.
_TILES = {"gate_up": {"BLOCK_N": 64, "BLOCK_K": 64, "num_stages": 5, "GROUP_M": 4},
          "down": {"BLOCK_N": 128, "BLOCK_K": 64, "num_stages": 5, "GROUP_M": 4}}  # fmt: skip


def tiles(part: str, gated: bool) -> dict[str, int]:
    """The kernel's tiles for one GEMM, "gate_up" or "down" (a gate_up that is not gated takes down's width)."""
    return _TILES["down" if part == "down" or not gated else "gate_up"]


# compile keys (the kernel's constexprs and dtypes) that compiled here, and those that failed: a failure is a
# Triton whose Gluon differs from the one this kernel was written for, and the caller runs the Triton kernel
_COMPILED: set[tuple] = set()
_FAILED: set[tuple] = set()


def _smem_layout(block: list[int], dtype: torch.dtype):
    return gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def launch_grouped_gemm(a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor,
                        sorted_rows: torch.Tensor, block_expert: torch.Tensor, topk_w: torch.Tensor | None, *,
                        num_valid: int, n_out: int, block_m: int, gated: bool, act: int, up_offset: int,
                        out_blocked: bool) -> bool:  # fmt: skip
    """One grouped GEMM: `a` [rows in block order, K] (16-bit, K-contiguous), `w` [E, channels, K] contiguous;
    gated: gate channels n and up channels n + up_offset, `out` gets act(gate) * up; `topk_w` given: rows scaled
    by their routing weights (the down projection). `out_blocked`: `out` has a row per block slot, else per
    pair (rows t*k+j). Blocks of `block_m` rows (``configs.PERSISTENT_BLOCK_M``).

    Returns False, having launched nothing, when this kernel does not compile with the installed Triton (warned
    once per compile key); the caller then runs the Triton kernel. A key that compiled before raises as usual."""
    cfg = tiles("gate_up" if out_blocked else "down", gated)
    bn, bk, stages = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_stages"]
    has_bias = bias is not None
    if has_bias and bias.stride(1) != 1:  # the epilogue reads a bias row as contiguous channels
        bias = bias.contiguous()
    consts = dict(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, GROUP_M=cfg["GROUP_M"], GATED=gated,
                  ACT=act, HAS_BIAS=has_bias, MUL_W=topk_w is not None, OUT_BLOCKED=out_blocked)  # fmt: skip
    key = (*consts.values(), a.dtype, out.dtype)
    if key in _FAILED:
        return False
    a_desc = TensorDescriptor.from_tensor(a, [block_m, bk], _smem_layout([block_m, bk], a.dtype))
    a_half_desc = TensorDescriptor.from_tensor(a, [block_m // 2, bk], _smem_layout([block_m // 2, bk], a.dtype))
    w_desc = TensorDescriptor.from_tensor(w.view(-1, w.shape[2]), [bn, bk], _smem_layout([bn, bk], w.dtype))
    max_blocks = block_expert.numel()
    grid = (max(1, min(_configs._num_sms(a.device.index), max_blocks * -(-n_out // bn))),)
    args = (a_desc, a_half_desc, w_desc, out, bias if has_bias else w, sorted_rows, block_expert,
            topk_w if topk_w is not None else a, num_valid, max_blocks, n_out, a.shape[1], up_offset, w.shape[1],
            out.stride(0), bias.stride(0) if has_bias else 0)  # fmt: skip
    try:
        _grouped_gemm_kernel[grid](*args, **consts, num_warps=CONSUMER_WARPS)
    except Exception as exc:  # compile errors come as several types (CompilationError, RuntimeError, ...)
        if key in _COMPILED:
            raise
        _FAILED.add(key)
        warnings.warn(f"triton_fused: the persistent Hopper GEMM did not compile with this Triton "
                      f"({type(exc).__name__}: {str(exc)[:200]}); running the Triton kernel instead",
                      RuntimeWarning, stacklevel=2)  # fmt: skip
        return False
    _COMPILED.add(key)
    return True
