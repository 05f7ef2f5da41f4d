"""Triton kernels for quantised experts: FP8 e4m3 block-scaled and FP4 e2m1 (UE8M0 group scales) weights.

Activations are quantised to e4m3 per row and per K tile (= the activation group): dynamic (scale =
amax / 448) or static (the expert's stored scale). The grouped path with dynamic scales quantises them once,
up front (``_quant_rows_kernel``), and its gate_up epilogue can quantise the intermediate (``QUANT_OUT``); the
row kernel and static scales quantise inside the K loop. Each K tile contributes
dot(a_q, w_q) * a_scale[row] * w_scale[col]  to an fp32 accumulator, so the fp8 dot's own accumulation never
spans more than one tile (as DeepGEMM promotes every 128 channels).

- ``_grouped_kernel``: a grouped GEMM over expert blocks of BLOCK_M rows, as built by ``triton_common.align``
  (pair indices sorted by expert, padded per expert). Tensor-core fp8 ``tl.dot``. At large T (``TMA``) the
  activations are stored in that block order and both operands come through TMA descriptors.
- ``_rows_kernel``: one (token, slot) pair per program, no sorting: a GEMV over the pair's expert (sums
  on CUDA cores). For decode, where a handful of pairs each hit a different expert.

Weights: FP8 ``[E, N, K]`` e4m3 with scales ``[E, rows, ceil(K / BLOCK_K)]`` (float32 or UE8M0 bytes); the
scale row of output channel c is ``c // bn`` below ``n_split`` and ``split_rows + (c - n_split) // bn`` from
there (gate and up blocked separately). FP4 ``[E, N, K / 2]`` bytes (element 2j low nibble) with one UE8M0
exponent per 32 inputs ``[E, N, ceil(K / 32)]``.

FP4 in the tensor-core kernel: e2m1 values are exact in e4m3; each row's four group scales inside a 128-wide
K tile are folded into the values relative to the largest one, w8 = e2m1 * 2^(e_g - e_max + 6) (<= 384,
exact while the exponents of one row's groups in a tile differ by <= 14), and 2^(e_max - 6) is the column
scale. The row kernel dequantises FP4 exactly in fp32.

Epilogues: optional bias, gating act(gate) * up (concatenated or interleaved channels) or a plain activation,
multiplication by the routing weight; rows are written at their pair index (row t*k + j).

Under TRITON_INTERPRET=1 (CPU tests) Triton's interpreter narrows floats (fp32 -> e4m3, bf16, fp16) without
carrying a mantissa round-up into the exponent (7.9 -> 4.0 in e4m3, 1.999 -> 1.0 in bf16) and without ties to
even; the kernels then round onto the target grid in fp32 first (``EXACT``), which makes the cast exact and the
result the RNE value the GPU's cvt.rn gives.
"""

from __future__ import annotations

import triton
import triton.language as tl
from selector.plugins.triton_common.activation import activation as _activation
from selector.plugins.triton_common.align import align_program
from selector.plugins.triton_common.schedule import program_tile

# --------------------------------------------------------------------------------------------------------------
# Element helpers.
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _round_e4m3(x):
    """x in [-448, 448] (fp32) rounded to the nearest e4m3 value, ties to even, still fp32."""
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)  # keep 3 mantissa bits
    sub = (x + 24576.0) - 24576.0  # below 2^-6 the e4m3 grid is 2^-9: fp32's ulp at 1.5 * 2^14
    return tl.where(tl.abs(x) < 0.015625, sub, normal)


@triton.jit
def _to_e4m3(x, EXACT: tl.constexpr):
    x = tl.minimum(tl.maximum(x, -448.0), 448.0)
    if EXACT:
        x = _round_e4m3(x)
    return x.to(tl.float8e4nv)


@triton.jit
def _round_for_store(x, dtype: tl.constexpr, EXACT: tl.constexpr):
    """x (fp32) ready to be cast to the output dtype; in the interpreter pre-rounded (RNE) so the cast is exact."""
    if EXACT and dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    elif EXACT and dtype == tl.float16:
        bits = x.to(tl.int32, bitcast=True)
        normal = ((bits + 0xFFF + ((bits >> 13) & 1)) & -8192).to(tl.float32, bitcast=True)
        sub = (x + 0.75) - 0.75  # below 2^-14 the fp16 grid is 2^-24: fp32's ulp at 0.75
        x = tl.where(tl.abs(x) < 6.103515625e-05, sub, normal)
    return x.to(dtype)


@triton.jit
def _recip(x, EXACT: tl.constexpr):
    if EXACT:
        r = 1.0 / x  # numpy: correctly rounded
    else:
        r = tl.div_rn(tl.full(x.shape, 1.0, tl.float32), x)
    return r


@triton.jit
def _scale_div448(amax, EXACT: tl.constexpr):
    if EXACT:
        s = amax / 448.0
    else:
        s = tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
    return tl.where(amax > 0, s, 1.0)


@triton.jit
def _pow2(e):
    """UE8M0 byte (int32, bias 127) -> 2^(e - 127) in fp32 (byte 0 reads as 0)."""
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(nib):
    """e2m1 code (int32 0..15) -> fp32 value: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa."""
    e = (nib >> 1) & 3
    m = nib & 1
    normal = ((e + 126) << 23) | (m << 22)
    sub = tl.where(m == 1, 126 << 23, 0)
    bits = tl.where(e == 0, sub, normal) | ((nib & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _dot(a, b, MAX_IMPRECISE: tl.constexpr):
    """fp32 dot; MAX_IMPRECISE > 0 promotes the fp8 tensor-core sum to fp32 every that many inputs (sm_90's
    default, kept at 0 here, accumulates a whole dot at the tensor core's reduced precision)."""
    if MAX_IMPRECISE > 0:
        d = tl.dot(a, b, max_num_imprecise_acc=MAX_IMPRECISE)
    else:
        d = tl.dot(a, b)
    return d


@triton.jit
def _scaled(d, sa, ws, ONE_ROW: tl.constexpr):
    """A K tile's dot times its row scales sa [BM] and weight scales ws ([BN], or one scalar when ONE_ROW)."""
    if ONE_ROW:
        r = d * (sa * ws)[:, None]
    else:  # the scales' product first: where ws takes few values (PAIRED: two) the compiler keeps a few products
        r = d * (sa[:, None] * ws[None, :])  # per thread and one multiply per element, not two
    return r


@triton.jit
def _mma(acc, aq, b, sa, ws, MAX_IMPRECISE: tl.constexpr, ONE_ROW: tl.constexpr, SWAP: tl.constexpr):
    """acc + one K tile's scaled dot of aq [BM, BK] and b [BK, BNC]. SWAP: acc is [BNC, BM], the product taken
    as b^T aq^T, so the weight tile is the MMA's M side and the block's rows its N side (decode: on sm_90 a
    native fp8 wgmma with 16 token columns, where [16, BK] x [BK, BNC] is an mma.sync on operands widened to f16)."""
    if SWAP:
        d = _dot(tl.trans(b), tl.trans(aq), MAX_IMPRECISE)
        if ONE_ROW:
            acc += d * (sa * ws)[None, :]
        else:
            acc += d * ws[:, None] * sa[None, :]
    else:
        acc += _scaled(_dot(aq, b, MAX_IMPRECISE), sa, ws, ONE_ROW)
    return acc


@triton.jit
def _quant_rows(a, static_s, BM: tl.constexpr, STATIC: tl.constexpr, EXACT: tl.constexpr):
    """a [BM, BK] fp32 -> (e4m3 [BM, BK], scale [BM]) per row."""
    if STATIC:
        s = tl.zeros([BM], dtype=tl.float32) + static_s
    else:
        s = _scale_div448(tl.max(tl.abs(a), axis=1), EXACT)
    q = _to_e4m3(a * _recip(s, EXACT)[:, None], EXACT)
    return q, s


@triton.jit
def _fp8_col_scale(
    s_base, offs_c, c_ok, kb, n_split, split_rows, bn, stride_sn, stride_sk, UE8M0: tl.constexpr, ONE_ROW: tl.constexpr
):
    """The weight scale of each column in offs_c at K block kb; ONE_ROW: the whole tile lies in one scale row
    (its width divides the block's), so one scalar load serves it instead of a gather per column."""
    if ONE_ROW:
        c0 = tl.min(offs_c, axis=0)
        srow = tl.where(c0 < n_split, c0 // bn, split_rows + (c0 - n_split) // bn)
        ptrs = s_base + srow * stride_sn + kb * stride_sk
        if UE8M0:
            ws = _pow2(tl.load(ptrs).to(tl.int32) & 255)
        else:
            ws = tl.load(ptrs).to(tl.float32)
    else:
        srow = tl.where(offs_c < n_split, offs_c // bn, split_rows + (offs_c - n_split) // bn)
        ptrs = s_base + srow * stride_sn + kb * stride_sk
        if UE8M0:
            ws = _pow2(tl.load(ptrs, mask=c_ok, other=127).to(tl.int32) & 255)
        else:
            ws = tl.load(ptrs, mask=c_ok, other=1.0).to(tl.float32)
    return ws


@triton.jit
def _fp4_tile(
    w_base, s_base, offs_c, c_ok, k0, K, stride_wn, stride_wk, stride_sn, stride_sk, BK: tl.constexpr, BNC: tl.constexpr
):
    """FP4 weights of channels offs_c [BNC] and inputs [k0, k0 + BK): their e2m1 values [BNC, BK] (two a byte,
    low nibble first) and the UE8M0 exponents [BNC, BK // 32] of their 32-input groups, unscaled."""
    G: tl.constexpr = BK // 32
    offs_b = k0 // 2 + tl.arange(0, BK // 2)
    p = (
        tl.load(
            w_base + offs_c[:, None] * stride_wn + offs_b[None, :] * stride_wk,
            mask=c_ok[:, None] & (offs_b[None, :] < K // 2),
            other=0,
        ).to(tl.int32)
        & 255
    )
    v = tl.reshape(tl.join(_e2m1(p & 15), _e2m1(p >> 4)), (BNC, BK))
    offs_g = k0 // 32 + tl.arange(0, G)
    eg = (
        tl.load(
            s_base + offs_c[:, None] * stride_sn + offs_g[None, :] * stride_sk,
            mask=c_ok[:, None] & (offs_g[None, :] < (K + 31) // 32),
            other=0,
        ).to(tl.int32)
        & 255
    )
    return v, eg


@triton.jit
def _w_tile_dot(
    w_base,
    s_base,
    offs_c,
    c_ok,
    k0,
    K,
    n_split,
    split_rows,
    bn,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    BK: tl.constexpr,
    BNC: tl.constexpr,
    FP4: tl.constexpr,
    UE8M0: tl.constexpr,
    EXACT: tl.constexpr,
    ONE_ROW: tl.constexpr = False,
    w_desc=None,
    desc_row=0,
    TMA: tl.constexpr = False,
):
    """The weight tile of channels offs_c [BNC] and inputs [k0, k0 + BK) as e4m3 [BK, BNC], and its column scale
    ([BNC], or a scalar when ONE_ROW). TMA (fp8): the tile comes through w_desc, the weights seen as [E * C, K],
    from row desc_row (= the expert's first row + offs_c[0]); rows past the expert's are never stored."""
    if FP4:
        G: tl.constexpr = BK // 32
        v, eg = _fp4_tile(w_base, s_base, offs_c, c_ok, k0, K, stride_wn, stride_wk, stride_sn, stride_sk, BK, BNC)
        emax = tl.max(eg, axis=1)
        shift = tl.minimum(tl.maximum(eg - emax[:, None] + 6, -126), 6)
        mult = ((shift + 127) << 23).to(tl.float32, bitcast=True)
        v = tl.reshape(tl.reshape(v, (BNC, G, 32)) * mult[:, :, None], (BNC, BK))
        b = tl.trans(_to_e4m3(v, EXACT))
        ws = _pow2(emax) * 0.015625
    else:
        if TMA:
            b = w_desc.load([desc_row, k0]).T
        else:
            offs_k = k0 + tl.arange(0, BK)
            b = tl.load(
                w_base + offs_k[:, None] * stride_wk + offs_c[None, :] * stride_wn,
                mask=(offs_k[:, None] < K) & c_ok[None, :],
                other=0.0,
            )
        ws = _fp8_col_scale(
            s_base, offs_c, c_ok, k0 // BK, n_split, split_rows, bn, stride_sn, stride_sk, UE8M0, ONE_ROW
        )
    return b, ws


@triton.jit
def _w_tile_f32(
    w_base,
    s_base,
    offs_c,
    c_ok,
    k0,
    K,
    n_split,
    split_rows,
    bn,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    BK: tl.constexpr,
    BNC: tl.constexpr,
    FP4: tl.constexpr,
    UE8M0: tl.constexpr,
):
    """The weight tile [BNC, BK] in fp32 and its column scale (FP4: exact values x scale, column scale 1)."""
    if FP4:
        G: tl.constexpr = BK // 32
        v, eg = _fp4_tile(w_base, s_base, offs_c, c_ok, k0, K, stride_wn, stride_wk, stride_sn, stride_sk, BK, BNC)
        w = tl.reshape(tl.reshape(v, (BNC, G, 32)) * _pow2(eg)[:, :, None], (BNC, BK))
        ws = tl.full([BNC], 1.0, tl.float32)
    else:
        offs_k = k0 + tl.arange(0, BK)
        w = tl.load(
            w_base + offs_c[:, None] * stride_wn + offs_k[None, :] * stride_wk,
            mask=c_ok[:, None] & (offs_k[None, :] < K),
            other=0.0,
        ).to(tl.float32)
        ws = _fp8_col_scale(s_base, offs_c, c_ok, k0 // BK, n_split, split_rows, bn, stride_sn, stride_sk, UE8M0, False)
    return w, ws


# --------------------------------------------------------------------------------------------------------------
# Grouped GEMM over expert blocks (tensor cores).
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _combine_rows(
    res,
    rows,
    row_ok,
    slot0,
    offs_n,
    n_ok,
    pid_n,
    num_pid_n,
    part_ptr,
    count_ptr,
    ids_ptr,
    sorted_ptr,
    out_ptr,
    num_pairs,
    num_experts,
    N,
    top_k,
    stride_om,
    stride_on,
    BLOCK_N: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_PAD: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
    EXACT: tl.constexpr,
):
    """The grouped kernel's COMBINE epilogue: res [BLOCK_M, BLOCK_N] holds the block's results, row m for pair
    rows[m] where row_ok (a pair block: row 0 only; a sorted block: its real rows come first, as align pads only the
    end of an expert's last block, so they are slots slot0 .. slot0 + n_real - 1). The rows are stored (fp32, one
    slice per K share), then counted one by one with a scalar atomic per (token, N tile): a tensor atomic's
    returned values reach only the threads that issued it on Tritons before 3.5 (triton-lang/triton#7402), and at
    decode a block holds one or two real rows. The last of a token's valid slots x shares to count adds them (share
    order, then one fixed-shape sum over the slots: the same bits whoever arrives last) and writes out[token]."""
    share = tl.program_id(1).to(tl.int64) * num_pairs * N
    tl.store(
        part_ptr + share + rows.to(tl.int64)[:, None] * N + offs_n[None, :], res, mask=row_ok[:, None] & n_ok[None, :]
    )
    # every warp's stores first, then acq_rel: the rows are visible before they count, and the last to count sees all
    tl.debug_barrier()
    j = tl.arange(0, K_PAD)
    for m in range(tl.sum(row_ok.to(tl.int32), axis=0)):
        if PAIR_BLOCKS:
            pair = slot0
        else:
            pair = tl.load(sorted_ptr + slot0 + m)
        token = pair // top_k
        e = tl.load(ids_ptr + token * top_k + j, mask=j < top_k, other=-1)
        ok = (j < top_k) & (e >= 0) & (e < num_experts)
        if tl.atomic_add(count_ptr + token * num_pid_n + pid_n, 1) == tl.sum(ok.to(tl.int32), axis=0) * SPLIT_K - 1:
            slots = (token * top_k + j).to(tl.int64)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            # share order, the slots in one fixed-shape sum: the same bits whoever is last
            for sh in tl.static_range(SPLIT_K):
                ptrs = part_ptr + sh * num_pairs * N + slots[:, None] * N + offs_n[None, :]
                v = tl.load(ptrs, mask=ok[:, None] & n_ok[None, :], other=0.0, cache_modifier=".cg")
                acc += tl.sum(v, axis=0)
            o_ptrs = out_ptr + token.to(tl.int64) * stride_om + offs_n * stride_on
            tl.store(o_ptrs, _round_for_store(acc, out_ptr.dtype.element_ty, EXACT), mask=n_ok)


@triton.jit
def _grouped_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    as_ptr,
    bias_ptr,
    out_ptr,
    sorted_ptr,
    block_expert_ptr,
    topk_w_ptr,
    a_s_ptr,
    out_s_ptr,
    part_ptr,
    count_ptr,
    ids_ptr,
    a_desc,
    w_desc,
    w_rows,
    num_valid,
    num_experts,
    N,
    K,
    a_div,
    num_blocks_m,
    up_offset,
    n_split,
    split_rows,
    bn,
    top_k,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_sk,
    stride_be,
    stride_bn,
    stride_om,
    stride_on,
    stride_asm,
    stride_osm,
    stride_os,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FP4: tl.constexpr,
    UE8M0: tl.constexpr,
    STATIC: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_W: tl.constexpr,
    EXACT: tl.constexpr,
    A_FP8: tl.constexpr,
    QUANT_OUT: tl.constexpr,
    INTER_DTYPE: tl.constexpr,
    PAIR_BLOCKS: tl.constexpr,
    SPLIT_K: tl.constexpr,
    MAX_IMPRECISE: tl.constexpr,
    ONE_SCALE_ROW: tl.constexpr,
    FINISH: tl.constexpr,
    PART_W: tl.constexpr,
    COMBINE: tl.constexpr,
    K_PAD: tl.constexpr,
    TMA: tl.constexpr,
    SORTED_OUT: tl.constexpr,
    SWAP: tl.constexpr,
    PAIRED: tl.constexpr,
):
    """out[row, n] = epilogue(sum over K tiles of dot(q(A[row // a_div]), W8[e]) * sa * sw) for each expert block.

    PAIR_BLOCKS (decode): no align; block p holds pair p alone (its other rows are padding) and
    block_expert_ptr is the pairs' expert ids. Pairs sharing an expert read its weights once each.

    N is the number of OUTPUT channels (I when GATED, else the stored rows).
    A_FP8: A is already e4m3 with one scale per row and K tile at a_s_ptr (``quantize_rows``): the tile goes
    straight from memory to the dot, with no quantisation work in the K loop (which otherwise serialises it).
    QUANT_OUT: the epilogue rounds its result to INTER_DTYPE (as a stored intermediate would be), quantises it
    per row and BLOCK_K channels (BLOCK_N is a multiple of BLOCK_K) and writes e4m3 to out, scales to out_s.
    SPLIT_K: program_id(1) sums its share of the K tiles. Linear epilogues (no gate, no activation, no
    QUANT_OUT) write that partial sum (fp32; bias from share 0 only) to out + program_id(1) * stride_os, and the
    combine adds the shares. At decode a long K loop over few programs is latency bound (Mixtral's down: K=14336).
    FINISH (any other epilogue): each share writes its fp32 sums (PART_W columns, then, gated over concatenated
    channels, the up half's BLOCK_N) to
    part_ptr and counts itself in count_ptr[tile] (zeroed by the caller); the last one to arrive adds every
    share in share order (the same bits whichever arrives last) and runs the epilogue alone. Only the real rows
    are written and read (a pair block's one row of 16; padding rows finish from zeros).
    ONE_SCALE_ROW (fp8): every weight tile lies within one scale row (the tile width divides the block's), so
    each K step loads one weight scale, not one per column.
    COMBINE (linear epilogue): the combine happens here, not in a launch of its own (``_combine_rows``). Each pair
    writes its fp32 result (one per K share) to part_ptr [SPLIT_K, num_valid, N] and counts itself in
    count_ptr[token, N tile] (zeroed by ``_quant_rows_kernel``); the last of the token's valid slots x shares to
    arrive adds them (share order, then one sum over the slots) and writes out[token]. ids_ptr: the pairs' expert
    ids (top_k per token); a token with no valid slot keeps the zeros written up front. Pair blocks, and sorted
    blocks where a config asks (their rows are counted one at a time; align puts a block's real rows first).
    TMA (sorted blocks, A_FP8, fp8 weights): A holds one row per block slot, in block order (``quantize_rows``
    with ``slots``), and its tiles and the weights' come through TMA descriptors (a_desc [slots, K], w_desc
    [E * w_rows, K]): no gather in the K loop, and the copy engine fills shared memory.
    SORTED_OUT: rows are stored in block order (slot pid_m * BLOCK_M + m, padding slots included), the layout
    the next TMA projection reads.
    SWAP (``_mma``): the K loop accumulates the transposed tile (weights on the MMA's M side); the epilogue sees
    the same [BLOCK_M, N] tile.
    PAIRED (TMA, gated, concatenated gate | up): w_desc sees the weights as [2E, C / 2, K] and one box [2, BLOCK_N,
    BLOCK_K] holds a tile's gate rows and its up rows, so each K step is one dot of 2 x BLOCK_N columns instead of
    two of BLOCK_N (a narrow fp8 wgmma waits on shared-memory reads); the epilogue splits the columns.
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = program_tile(pid, num_blocks_m, N, BLOCK_N, GROUP_M)

    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if (expert < 0) | (expert >= num_experts):  # a block past the used ones, or a sentinel pair
        return

    offs_m = tl.arange(0, BLOCK_M)
    if PAIR_BLOCKS:
        rows = tl.where(offs_m == 0, pid_m, num_valid)
        first = pid_m
    else:
        rows = tl.load(sorted_ptr + pid_m * BLOCK_M + offs_m)
        first = tl.load(sorted_ptr + pid_m * BLOCK_M)
    row_ok = rows < num_valid
    # padding slots read the block's first row (always a real pair): finite values, stored only in block order
    # (SORTED_OUT)
    if TMA:  # A (and its scales) in block order
        a_rows = (pid_m * BLOCK_M + offs_m).to(tl.int64)
    else:
        a_rows = (tl.where(row_ok, rows, first) // a_div).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + a_rows[:, None] * stride_am
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    static_s = 1.0
    if STATIC:
        static_s = tl.load(as_ptr + expert).to(tl.float32)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    W: tl.constexpr = 2 * BLOCK_N if GATED and (INTERLEAVED or PAIRED) else BLOCK_N  # stored channels of one tile
    if GATED and INTERLEAVED:
        offs_c = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        c_ok = offs_c < 2 * N
    elif PAIRED:  # the tile's gate channels, then its up channels
        half = tl.arange(0, 2 * BLOCK_N) // BLOCK_N
        offs_c = pid_n * BLOCK_N + tl.arange(0, 2 * BLOCK_N) % BLOCK_N
        c_ok = offs_c < N
        offs_c += half * up_offset
    else:
        offs_c = offs_n
        c_ok = n_ok
    if SWAP:
        acc = tl.zeros([W, BLOCK_M], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, W], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)

    a_s_base = a_s_ptr + a_rows * stride_asm
    if SPLIT_K > 1:
        k_share = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_lo = tl.program_id(1) * k_share
        k_hi = tl.minimum(K, k_lo + k_share)
    else:  # the unsplit loop exactly as before split K existed
        k_lo = 0
        k_hi = K
    w_row0 = (expert * w_rows).to(tl.int32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if TMA:
            aq = a_desc.load([pid_m * BLOCK_M, k0])
            sa = tl.load(a_s_base + k0 // BLOCK_K)
        elif A_FP8:
            aq = tl.load(a_base + (k0 + offs_k)[None, :] * stride_ak, mask=(k0 + offs_k)[None, :] < K, other=0.0)
            sa = tl.load(a_s_base + k0 // BLOCK_K)
        elif PAIR_BLOCKS:  # every row of a pair block reads the pair's row: quantise it once, then broadcast
            a1 = tl.load(
                a_ptr + (first // a_div).to(tl.int64) * stride_am + (k0 + offs_k) * stride_ak,
                mask=(k0 + offs_k) < K,
                other=0.0,
            )
            aq1, sa1 = _quant_rows(a1.to(tl.float32)[None, :], static_s, 1, STATIC, EXACT)
            aq = tl.broadcast_to(aq1, (BLOCK_M, BLOCK_K))
            sa = tl.broadcast_to(sa1, (BLOCK_M,))
        else:
            a = tl.load(a_base + (k0 + offs_k)[None, :] * stride_ak, mask=(k0 + offs_k)[None, :] < K, other=0.0)
            aq, sa = _quant_rows(a.to(tl.float32), static_s, BLOCK_M, STATIC, EXACT)
        if PAIRED:
            b = tl.reshape(w_desc.load([2 * expert.to(tl.int32), pid_n * BLOCK_N, k0]), (W, BLOCK_K)).T
            if ONE_SCALE_ROW:  # one scale per half
                ws_g = _fp8_col_scale(
                    s_base, offs_n, n_ok, k0 // BLOCK_K, n_split, split_rows, bn, stride_sn, stride_sk, UE8M0, True
                )
                ws_u = _fp8_col_scale(
                    s_base,
                    offs_n + up_offset,
                    n_ok,
                    k0 // BLOCK_K,
                    n_split,
                    split_rows,
                    bn,
                    stride_sn,
                    stride_sk,
                    UE8M0,
                    True,
                )
                ws = tl.where(half == 0, ws_g, ws_u)
            else:
                ws = _fp8_col_scale(
                    s_base, offs_c, c_ok, k0 // BLOCK_K, n_split, split_rows, bn, stride_sn, stride_sk, UE8M0, False
                )
            acc = _mma(acc, aq, b, sa, ws, MAX_IMPRECISE, False, SWAP)
        else:
            b, ws = _w_tile_dot(
                w_base,
                s_base,
                offs_c,
                c_ok,
                k0,
                K,
                n_split,
                split_rows,
                bn,
                stride_wn,
                stride_wk,
                stride_sn,
                stride_sk,
                BLOCK_K,
                W,
                FP4,
                UE8M0,
                EXACT,
                ONE_SCALE_ROW,
                w_desc,
                w_row0 + pid_n * W,
                TMA,
            )
            acc = _mma(acc, aq, b, sa, ws, MAX_IMPRECISE, ONE_SCALE_ROW, SWAP)
        if GATED and not INTERLEAVED and not PAIRED:
            bu, wsu = _w_tile_dot(
                w_base,
                s_base,
                offs_n + up_offset,
                n_ok,
                k0,
                K,
                n_split,
                split_rows,
                bn,
                stride_wn,
                stride_wk,
                stride_sn,
                stride_sk,
                BLOCK_K,
                BLOCK_N,
                FP4,
                UE8M0,
                EXACT,
                ONE_SCALE_ROW,
                w_desc,
                w_row0 + up_offset + pid_n * BLOCK_N,
                TMA,
            )
            acc_u = _mma(acc_u, aq, bu, sa, wsu, MAX_IMPRECISE, ONE_SCALE_ROW, SWAP)
    if SWAP:  # back to [BLOCK_M, channels] for the epilogue (one register transpose per program)
        acc = tl.trans(acc)
        acc_u = tl.trans(acc_u)

    if FINISH:
        tile = pid_m * num_pid_n + pid_n
        row_w: tl.constexpr = PART_W + BLOCK_N
        part = part_ptr + (tile.to(tl.int64) * BLOCK_M + offs_m[:, None]) * row_w
        share = (num_blocks_m * num_pid_n).to(tl.int64) * BLOCK_M * row_w
        cols_a = tl.arange(0, PART_W)[None, :]
        cols_u = PART_W + tl.arange(0, BLOCK_N)[None, :]
        # only the block's real rows travel (a pair block: 1 of 16); padding rows finish as zeros (finite)
        real = row_ok[:, None]
        tl.store(part + tl.program_id(1) * share + cols_a, acc, mask=real)
        if GATED and not INTERLEAVED and not PAIRED:
            tl.store(part + tl.program_id(1) * share + cols_u, acc_u, mask=real)
        # every warp's stores first (older Tritons put no barrier before a scalar atomic), then acq_rel: this
        # share's sums are visible before it is counted, and the last one to count sees every share's
        tl.debug_barrier()
        if tl.atomic_add(count_ptr + tile, 1) != SPLIT_K - 1:
            return
        # other SMs wrote them: read past this SM's L1
        acc = tl.load(part + cols_a, mask=real, other=0.0, cache_modifier=".cg")
        for sh in tl.static_range(1, SPLIT_K):
            acc += tl.load(part + sh * share + cols_a, mask=real, other=0.0, cache_modifier=".cg")
        if GATED and not INTERLEAVED and not PAIRED:
            acc_u = tl.load(part + cols_u, mask=real, other=0.0, cache_modifier=".cg")
            for sh in tl.static_range(1, SPLIT_K):
                acc_u += tl.load(part + sh * share + cols_u, mask=real, other=0.0, cache_modifier=".cg")

    bias_base = bias_ptr + expert * stride_be
    if GATED and INTERLEAVED:
        if HAS_BIAS:
            acc += tl.load(bias_base + offs_c * stride_bn, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        res = _activation(gate, ACT) * up
    elif GATED and PAIRED:
        if HAS_BIAS:
            acc += tl.load(bias_base + offs_c * stride_bn, mask=c_ok, other=0.0).to(tl.float32)[None, :]
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
        res = _activation(gate, ACT) * up
    elif GATED:
        if HAS_BIAS:
            acc += tl.load(bias_base + offs_n * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            acc_u += tl.load(bias_base + (offs_n + up_offset) * stride_bn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        res = _activation(acc, ACT) * acc_u
    else:
        if HAS_BIAS:
            bias = tl.load(bias_base + offs_n * stride_bn, mask=n_ok, other=0.0).to(tl.float32)
            if SPLIT_K > 1 and not FINISH:  # the bias once, in share 0
                bias = bias * (tl.program_id(1) == 0).to(tl.float32)
            acc += bias[None, :]
        res = _activation(acc, ACT)
    if MUL_W:
        res = res * tl.load(topk_w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    if COMBINE:
        _combine_rows(
            res,
            rows,
            row_ok,
            pid_m if PAIR_BLOCKS else pid_m * BLOCK_M,
            offs_n,
            n_ok,
            pid_n,
            num_pid_n,
            part_ptr,
            count_ptr,
            ids_ptr,
            sorted_ptr,
            out_ptr,
            num_valid,
            num_experts,
            N,
            top_k,
            stride_om,
            stride_on,
            BLOCK_N,
            SPLIT_K,
            K_PAD,
            PAIR_BLOCKS,
            EXACT,
        )
        return
    if SORTED_OUT:  # every slot of the block, padding too (finite: its A rows are zeros)
        o_rows = (pid_m * BLOCK_M + offs_m).to(tl.int64)
        o_ok = offs_m >= 0
    else:
        o_rows = rows.to(tl.int64)
        o_ok = row_ok
    o_ptrs = out_ptr + tl.program_id(1).to(tl.int64) * stride_os
    o_ptrs = o_ptrs + o_rows[:, None] * stride_om + offs_n[None, :] * stride_on
    o_mask = o_ok[:, None] & n_ok[None, :]
    if QUANT_OUT:
        G: tl.constexpr = BLOCK_N // BLOCK_K
        r = tl.where(n_ok[None, :], _round_for_store(res, INTER_DTYPE, EXACT).to(tl.float32), 0.0)
        r3 = tl.reshape(r, (BLOCK_M, G, BLOCK_K))
        so = _scale_div448(tl.max(tl.abs(r3), axis=2), EXACT)  # [BLOCK_M, G]
        q = tl.reshape(_to_e4m3(r3 * _recip(so, EXACT)[:, :, None], EXACT), (BLOCK_M, BLOCK_N))
        tl.store(o_ptrs, q, mask=o_mask)
        offs_g = pid_n * G + tl.arange(0, G)
        s_ptrs = out_s_ptr + o_rows[:, None] * stride_osm + offs_g[None, :]
        tl.store(s_ptrs, so, mask=o_ok[:, None] & (offs_g * BLOCK_K < N)[None, :])
    else:
        tl.store(o_ptrs, _round_for_store(res, out_ptr.dtype.element_ty, EXACT), mask=o_mask)


@triton.jit
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    zero_ptr,
    count_ptr,
    sorted_ptr,
    block_expert_ptr,
    ids_ptr,
    num_rows,
    K,
    num_counts,
    num_valid,
    num_experts,
    max_blocks,
    stride_xm,
    stride_qm,
    stride_sm,
    stride_zm,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EXACT: tl.constexpr,
    ZERO: tl.constexpr,
    COUNTS: tl.constexpr,
    SLOTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    ALIGN: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    E_PAD: tl.constexpr,
    B_TILE: tl.constexpr,
):
    """q[r, k] = e4m3(x[r, k] / s[r, k // BLOCK_K]), s = amax / 448 of each row's BLOCK_K-wide group (dynamic).
    SLOTS: row r of x (already in block order) is slot r of the align layout's blocks (BLOCK_M rows each); the
    slots of unused blocks (block expert < 0, never read) are left unwritten (token rows go to block order
    through ``_gather_rows_kernel``).
    Also clears what the layer's later kernels count or add into, saving them launches of their own: ZERO, a
    tensor shaped like x (zero_ptr); COUNTS, num_counts int32 at count_ptr. ALIGN (not with SLOTS): the grid's
    last row of programs has no rows to quantise, and its program (last, 0) routes the layer's num_valid pairs
    (expert ids at ids_ptr) into sorted_ptr / block_expert_ptr, as the one-program align launch
    would (``align_program``; CHUNK, SUB, E_PAD, B_TILE as ``plan_align`` sets them), beside the quantisation."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    r_ok = offs_r < num_rows
    rows = offs_r.to(tl.int64)
    if SLOTS:
        r_ok = r_ok & (tl.load(block_expert_ptr + offs_r // BLOCK_M, mask=r_ok, other=-1) >= 0)
    mask = r_ok[:, None] & (offs_k < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
    q, s = _quant_rows(x, 1.0, BLOCK_R, False, EXACT)
    tl.store(q_ptr + rows[:, None] * stride_qm + offs_k[None, :], q, mask=mask)
    tl.store(s_ptr + rows * stride_sm + tl.program_id(1), s, mask=r_ok)
    if ZERO:
        z_ptrs = zero_ptr + rows[:, None] * stride_zm + offs_k[None, :]
        tl.store(z_ptrs, tl.zeros([BLOCK_R, BLOCK_K], tl.float32).to(zero_ptr.dtype.element_ty), mask=mask)
    if COUNTS:  # 1024-wide slices, dealt out over every program
        pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        step = tl.num_programs(0) * tl.num_programs(1) * 1024
        for c0 in range(pid * 1024, num_counts, step):
            offs_c = c0 + tl.arange(0, 1024)
            tl.store(count_ptr + offs_c, tl.zeros([1024], tl.int32), mask=offs_c < num_counts)
    if ALIGN:
        if (tl.program_id(0) == tl.num_programs(0) - 1) & (tl.program_id(1) == 0):
            align_program(
                ids_ptr,
                sorted_ptr,
                sorted_ptr,
                block_expert_ptr,
                block_expert_ptr,
                num_valid,
                num_experts,
                1,
                max_blocks,
                0,
                1,
                BLOCK_M,
                CHUNK,
                SUB,
                E_PAD,
                B_TILE,
                True,
                0,
            )


@triton.jit
def _gather_rows_kernel(
    q_ptr,
    s_ptr,
    out_q_ptr,
    out_s_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_slots,
    num_valid,
    a_div,
    K,
    G,
    stride_qm,
    stride_sm,
    stride_oqm,
    stride_osm,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """Quantised token rows into block order: slot r gets row sorted[r] // a_div of q (bytes) and of its scales s,
    a padding slot (sorted[r] >= num_valid) zeros and scale 1; the slots of unused blocks (block expert < 0,
    never read) are left unwritten. Program (i, j): BLOCK_R slots, bytes [j * BLOCK_C, (j + 1) * BLOCK_C) of
    their rows, and program j == 0 their G scales."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < num_slots
    r_ok = r_ok & (tl.load(block_expert_ptr + offs_r // BLOCK_M, mask=r_ok, other=-1) >= 0)
    src = tl.load(sorted_ptr + offs_r, mask=r_ok, other=num_valid)
    real = r_ok & (src < num_valid)
    rows = (tl.where(real, src, 0) // a_div).to(tl.int64)
    slots = offs_r.to(tl.int64)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = offs_c < K
    v = tl.load(q_ptr + rows[:, None] * stride_qm + offs_c[None, :], mask=real[:, None] & c_ok[None, :], other=0)
    tl.store(out_q_ptr + slots[:, None] * stride_oqm + offs_c[None, :], v, mask=r_ok[:, None] & c_ok[None, :])
    if tl.program_id(1) == 0:
        offs_g = tl.arange(0, BLOCK_G)
        g_ok = offs_g < G
        sc = tl.load(s_ptr + rows[:, None] * stride_sm + offs_g[None, :], mask=real[:, None] & g_ok[None, :], other=1.0)
        tl.store(out_s_ptr + slots[:, None] * stride_osm + offs_g[None, :], sc, mask=r_ok[:, None] & g_ok[None, :])


# --------------------------------------------------------------------------------------------------------------
# One (token, slot) pair per program (no sorting; CUDA-core sums).
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _rows_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    as_ptr,
    bias_ptr,
    out_ptr,
    ids_ptr,
    topk_w_ptr,
    num_experts,
    N,
    K,
    a_div,
    up_offset,
    n_split,
    split_rows,
    bn,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_sk,
    stride_be,
    stride_bn,
    stride_om,
    stride_on,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP4: tl.constexpr,
    UE8M0: tl.constexpr,
    STATIC: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_W: tl.constexpr,
    EXACT: tl.constexpr,
):
    """out[row, n] for one pair row = program_id(0); sentinel rows (expert outside [0, E)) are left unwritten."""
    row = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(ids_ptr + row).to(tl.int64)
    if (expert < 0) | (expert >= num_experts):
        return
    offs_k = tl.arange(0, BLOCK_K)
    a_base = a_ptr + (row // a_div).to(tl.int64) * stride_am
    w_base = w_ptr + expert * stride_we
    s_base = s_ptr + expert * stride_se
    static_s = 1.0
    if STATIC:
        static_s = tl.load(as_ptr + expert).to(tl.float32)

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    if GATED and INTERLEAVED:
        offs_c = pid_n * 2 * BLOCK_N + tl.arange(0, 2 * BLOCK_N)
        c_ok = offs_c < 2 * N
        acc = tl.zeros([2 * BLOCK_N], dtype=tl.float32)
    else:
        offs_c = offs_n
        c_ok = n_ok
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)

    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_base + (k0 + offs_k) * stride_ak, mask=(k0 + offs_k) < K, other=0.0).to(tl.float32)
        aq2, sa2 = _quant_rows(a[None, :], static_s, 1, STATIC, EXACT)
        aq = tl.reshape(aq2.to(tl.float32), (BLOCK_K,))
        sa = tl.sum(sa2, axis=0)
        if GATED and INTERLEAVED:
            w, ws = _w_tile_f32(
                w_base,
                s_base,
                offs_c,
                c_ok,
                k0,
                K,
                n_split,
                split_rows,
                bn,
                stride_wn,
                stride_wk,
                stride_sn,
                stride_sk,
                BLOCK_K,
                2 * BLOCK_N,
                FP4,
                UE8M0,
            )
            acc += tl.sum(w * aq[None, :], axis=1) * ws * sa
        else:
            w, ws = _w_tile_f32(
                w_base,
                s_base,
                offs_c,
                c_ok,
                k0,
                K,
                n_split,
                split_rows,
                bn,
                stride_wn,
                stride_wk,
                stride_sn,
                stride_sk,
                BLOCK_K,
                BLOCK_N,
                FP4,
                UE8M0,
            )
            acc += tl.sum(w * aq[None, :], axis=1) * ws * sa
            if GATED:
                wu, wsu = _w_tile_f32(
                    w_base,
                    s_base,
                    offs_n + up_offset,
                    n_ok,
                    k0,
                    K,
                    n_split,
                    split_rows,
                    bn,
                    stride_wn,
                    stride_wk,
                    stride_sn,
                    stride_sk,
                    BLOCK_K,
                    BLOCK_N,
                    FP4,
                    UE8M0,
                )
                acc_u += tl.sum(wu * aq[None, :], axis=1) * wsu * sa

    bias_base = bias_ptr + expert * stride_be
    if GATED and INTERLEAVED:
        if HAS_BIAS:
            acc += tl.load(bias_base + offs_c * stride_bn, mask=c_ok, other=0.0).to(tl.float32)
        gate, up = tl.split(tl.reshape(acc, (BLOCK_N, 2)))
        res = _activation(gate, ACT) * up
    elif GATED:
        if HAS_BIAS:
            acc += tl.load(bias_base + offs_n * stride_bn, mask=n_ok, other=0.0).to(tl.float32)
            acc_u += tl.load(bias_base + (offs_n + up_offset) * stride_bn, mask=n_ok, other=0.0).to(tl.float32)
        res = _activation(acc, ACT) * acc_u
    else:
        if HAS_BIAS:
            acc += tl.load(bias_base + offs_n * stride_bn, mask=n_ok, other=0.0).to(tl.float32)
        res = _activation(acc, ACT)
    if MUL_W:
        res = res * tl.load(topk_w_ptr + row).to(tl.float32)
    o_ptrs = out_ptr + row.to(tl.int64) * stride_om + offs_n * stride_on
    tl.store(o_ptrs, _round_for_store(res, out_ptr.dtype.element_ty, EXACT), mask=n_ok)
