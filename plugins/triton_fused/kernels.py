"""Fused Mixture-of-Experts experts layer in Triton.

Computes, for hidden_states x [T, H], routing ids [T, k] and routing weights [T, k]:

    out[t] = sum_j w[t, j] * ( down_e( act(gate_e(x_t) + bg_e) * (up_e(x_t) + bu_e) ) + bd_e ),  e = ids[t, j]

with the weights laid out as a Transformers experts module stores them (see ``fused_experts``). Ids outside
[0, num_experts) are the expert-parallel sentinel: they contribute nothing.

Launches per call (no host synchronisation anywhere, so a call can be captured in a CUDA graph):

1. ``_align_kernel`` (one launch when T*k <= _SINGLE_ALIGN_MAX, else ``_align_count_kernel`` + ``_align_kernel``):
   groups the (token, slot) pairs by expert into blocks of BLOCK_M rows. Output sizes depend only on
   T, k, E and BLOCK_M: ``sorted_rows[max_blocks * BLOCK_M]`` (pair index t*k+j, or T*k for a padding slot) and
   ``block_expert[max_blocks]`` (expert of each block, -1 for blocks past the end: those programs exit at once).
2. ``_moe_gemm_kernel`` (gate_up): gathers the block's token rows of x, multiplies with the expert's gate/up
   weights, adds the bias, applies activation and gating in the epilogue, writes intermediate [T*k, I].
3. ``_moe_gemm_kernel`` (down): multiplies the intermediate rows with down_proj, adds the bias, multiplies by
   the routing weight, writes y [T*k, H] (row t*k+j).
4. ``_combine_kernel``: out[t] = sum over j of y[t*k+j] in fixed order, fp32 accumulation (deterministic,
   no atomics); sentinel slots are skipped.

Temporaries: intermediate (T*k*I) and y (T*k*H) in the input dtype plus a few small int32 buffers, within
2 * T*k * max(2I, H) * 2 bytes.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import configs as _configs

try:  # host-side TMA descriptors (Triton >= 3.4), keyed by the fast launch path
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except ImportError:  # pragma: no cover
    _TensorDescriptor = None

__all__ = [
    "SUPPORTED_ACTIVATIONS",
    "SUPPORTED_DTYPES",
    "fused_experts",
    "fused_experts_impl",
]

SUPPORTED_ACTIVATIONS: frozenset[str] = frozenset({"silu", "gelu", "gelu_tanh", "relu"})
SUPPORTED_DTYPES: frozenset[torch.dtype] = frozenset({torch.bfloat16, torch.float16, torch.float32})

_ACT_CODE = {"silu": 1, "gelu": 2, "gelu_tanh": 3, "relu": 4}

# Routing up to this many (token, slot) pairs is done by one program in one launch (decode); above it
# the pairs are split into chunks of _ALIGN_CHUNK, counted by one launch and scattered by a second.
_SINGLE_ALIGN_MAX = 1024
_ALIGN_CHUNK = 512

# Tests set this to fill every buffer with garbage (NaN / out-of-range ids) before the kernels run, so that
# any element a kernel fails to write shows up in the result. Costs extra fill launches: off by default.
_POISON = False


def _empty(shape, dtype: torch.dtype, device: torch.device, poison) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if _POISON:
        t.fill_(poison)
    return t


# --------------------------------------------------------------------------------------------------------------
# Align: group (token, slot) pairs by expert into BLOCK_M-row blocks.
# --------------------------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_pairs"])
def _align_count_kernel(
    ids_ptr,
    partial_ptr,
    num_pairs,
    num_experts,
    CHUNK: tl.constexpr,
    E_PAD: tl.constexpr,
):
    """partial[pid, e] = number of pairs of chunk pid routed to expert e (every entry written)."""
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    in_range = offs < num_pairs
    ids = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    valid = in_range & (ids >= 0) & (ids < num_experts)
    counts = tl.histogram(tl.where(valid, ids, 0), E_PAD, mask=valid)
    tl.store(partial_ptr + pid * E_PAD + tl.arange(0, E_PAD), counts)


@triton.jit(do_not_specialize=["num_pairs", "num_chunks", "max_blocks"])
def _align_kernel(
    ids_ptr,
    partial_ptr,
    sorted_ptr,
    block_expert_ptr,
    num_pairs,
    num_experts,
    num_chunks,
    max_blocks,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
    SUB: tl.constexpr,
    E_PAD: tl.constexpr,
    NCH_SUB: tl.constexpr,
    B_TILE: tl.constexpr,
    SINGLE: tl.constexpr,
):
    """Scatter pair indices into expert-sorted, BLOCK_M-padded order; write per-block experts and padding.

    SINGLE: one program does everything (counts too). Otherwise program pid scatters chunk pid using the
    per-chunk counts of ``_align_count_kernel``. Inside one expert's group the pairs keep their order (ranks
    come from prefix counts, no atomics), so the layout itself is deterministic.
    """
    align_program(ids_ptr, partial_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_experts, num_chunks,
                  max_blocks, tl.program_id(0), tl.num_programs(0), BLOCK_M, CHUNK, SUB, E_PAD, NCH_SUB, B_TILE,
                  SINGLE)  # fmt: skip


@triton.jit
def align_program(ids_ptr, partial_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_experts, num_chunks, max_blocks,
                  pid, nprog, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr, E_PAD: tl.constexpr,
                  NCH_SUB: tl.constexpr, B_TILE: tl.constexpr, SINGLE: tl.constexpr):  # fmt: skip
    """The work of ``_align_kernel``'s program `pid` of `nprog`; with SINGLE (pid 0 of 1) also callable from
    another kernel's program, so that the routing rides on a launch the layer makes anyway (the quantised
    experts' x quantisation)."""
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
    else:
        total = tl.zeros([E_PAD], dtype=tl.int32)
        before = tl.zeros([E_PAD], dtype=tl.int32)
        for c0 in range(0, num_chunks, NCH_SUB):
            cidx = c0 + tl.arange(0, NCH_SUB)
            part = tl.load(
                partial_ptr + cidx[:, None] * E_PAD + e_range[None, :], mask=cidx[:, None] < num_chunks, other=0
            )
            total += tl.sum(part, axis=0)
            before += tl.sum(tl.where(cidx[:, None] < pid, part, 0), axis=0)
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
    m_range = tl.arange(0, BLOCK_M)
    for b0 in range(pid * B_TILE, max_blocks, nprog * B_TILE):
        b = b0 + tl.arange(0, B_TILE)
        b_ok = b < max_blocks
        bstart = b * BLOCK_M
        used = bstart < total_padded
        eb = tl.sum(((pend[None, :] <= bstart[:, None]) & e_ok[None, :]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(used, eb, -1), mask=b_ok)
        ve = tl.gather(vend, tl.minimum(eb, E_PAD - 1), 0)
        r = bstart[:, None] + m_range[None, :]
        pad_val = tl.zeros([B_TILE, BLOCK_M], dtype=tl.int32) + num_pairs
        tl.store(sorted_ptr + r, pad_val, mask=(used & b_ok)[:, None] & (r >= ve[:, None]))


# --------------------------------------------------------------------------------------------------------------
# Grouped GEMM over expert blocks.
# --------------------------------------------------------------------------------------------------------------


@triton.jit
def _activation(x, ACT: tl.constexpr):
    if ACT == 1:  # silu
        y = x / (1.0 + tl.exp(-x))
    elif ACT == 2:  # gelu (erf)
        y = 0.5 * x * (1.0 + tl.math.erf(x * 0.7071067811865476))
    elif ACT == 3:  # gelu, tanh approximation; tanh(z) = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        y = x / (1.0 + tl.exp(-2.0 * z))
    elif ACT == 4:  # relu
        y = tl.maximum(x, 0.0)
    else:
        y = x
    return y


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
    num_valid,
    N,
    K,
    a_div,
    num_blocks_m,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    GATED: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ACT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_W: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """out[row, n] = epilogue( sum_k A[row // a_div, k] * W[e, n, k] ) for the rows of each expert block.

    N is the number of OUTPUT channels (I for gate_up, H for down). Gated: weight rows n (gate) and
    n + up_offset (up) when concatenated, 2n and 2n+1 when interleaved. W is addressed through
    (stride_wn, stride_wk), so transposed storage needs no copy.
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_blocks_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    expert = tl.load(block_expert_ptr + pid_m)
    if expert < 0:
        return
    expert = expert.to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + offs_m)
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
            if EVEN_K and EVEN_N:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_ok = offs_k < K - kk * BLOCK_K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & c_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            bias = tl.load(bias_ptr + expert * stride_be + offs_c * stride_bn, mask=c_ok, other=0.0).to(tl.float32)
            acc = acc + bias[None, :]
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
        res = _activation(gate, ACT) * up
    elif GATED:
        bg_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        bu_ptrs = bg_ptrs + up_offset * stride_wn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kk in range(0, num_k):
            if EVEN_K and EVEN_N:
                a = tl.load(a_ptrs)
                bg = tl.load(bg_ptrs)
                bu = tl.load(bu_ptrs)
            else:
                k_ok = offs_k < K - kk * BLOCK_K
                b_ok = k_ok[:, None] & n_ok[None, :]
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                bg = tl.load(bg_ptrs, mask=b_ok, other=0.0)
                bu = tl.load(bu_ptrs, mask=b_ok, other=0.0)
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
        res = _activation(acc_g, ACT) * acc_u
    else:
        b_ptrs = w_base + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for kk in range(0, num_k):
            if EVEN_K and EVEN_N:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                k_ok = offs_k < K - kk * BLOCK_K
                a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
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

    out_rows = rows.to(tl.int64)
    o_ptrs = out_ptr + out_rows[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(o_ptrs, res.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


# --------------------------------------------------------------------------------------------------------------
# Deterministic combine over the k slots.
# --------------------------------------------------------------------------------------------------------------


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
    BLOCK_H: tl.constexpr,
    K_PAD: tl.constexpr,
    SPLIT: tl.constexpr,
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
    tl.store(out_ptr + t.to(tl.int64) * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=h_ok)


# --------------------------------------------------------------------------------------------------------------
# Host side.
# --------------------------------------------------------------------------------------------------------------


_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
# Launch through a cache of compiled kernels keyed by everything Triton specialises on (constexprs, launch
# options, argument dtypes, 16-byte pointer alignment, ints ==1 / %16 / 32-bit), skipping the JIT's own
# dispatch. Off with SELECTOR_TRITON_FUSED_FAST_LAUNCH=0 (then every launch goes through kernel[grid](...)).
_EAGER_BYPASS_OP = os.environ.get("SELECTOR_TRITON_FUSED_VIA_OP", "0") in ("", "0")
_FAST_LAUNCH = os.environ.get("SELECTOR_TRITON_FUSED_FAST_LAUNCH", "1") != "0"
_LAUNCH_CACHE: dict = {}


def _spec(a):
    if type(a) is int:  # most arguments (sizes, strides): the cheapest test first
        return a == 1, a & 15 == 0, -(1 << 31) <= a < (1 << 31)
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() & 15 == 0
    if _TensorDescriptor is not None and isinstance(a, _TensorDescriptor):  # what Triton specialises a TMA one on
        return "desc", a.base.dtype, tuple(a.block_shape), a.padding
    return a


def launch(fn, grid, args: tuple, consts: dict, num_warps: int, num_stages: int = 3) -> None:
    """fn[grid](*args, **consts): runtime arguments positional, every constexpr in `consts` (the quantised
    kernels launch through here too). Repeated launches skip Triton's own argument dispatch (tens of us; TMA
    descriptors too: the compiled kernel's launcher encodes them)."""
    if _INTERPRET or not _FAST_LAUNCH or torch.compiler.is_compiling():  # Dynamo cannot trace data_ptr()
        fn[grid](*args, **consts, num_warps=num_warps, num_stages=num_stages)
        return
    dev = args[0].device
    key = (fn, dev.index, num_warps, num_stages, *consts.values(), *map(_spec, args))
    kernel = _LAUNCH_CACHE.get(key)
    if kernel is None:
        kernel = fn[grid](*args, **consts, num_warps=num_warps, num_stages=num_stages)
        if kernel is not None and hasattr(kernel, "__getitem__"):
            _LAUNCH_CACHE[key] = kernel
        return
    names = fn.arg_names[len(args) :]  # the constexprs, declared after the runtime arguments, in order
    grid3 = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    kernel[grid3](*args, *[consts[n] for n in names], stream=torch.cuda.current_stream(dev).cuda_stream)


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Host-side ceil division: triton.cdiv is a constexpr function, whose wrapper costs microseconds per call."""
    return -(-a // b)


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs follow torch's float32 matmul setting: "highest" -> exact fp32 FMA dots, else tf32."""
    if dtype != torch.float32:
        return "tf32"  # ignored by Triton for 16-bit operands
    try:
        prec = torch.get_float32_matmul_precision()
    except Exception:  # pragma: no cover - very old/new torch
        prec = "highest"
    return "ieee" if prec == "highest" else "tf32"


def max_blocks_for(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the number of BLOCK_M blocks after padding each expert's group (host-known)."""
    padded = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    return cdiv(padded, block_m)


class AlignPlan(NamedTuple):
    """What ``align`` fills and how (``run_align`` launches it): `_align_kernel`'s constexprs and warps, and, for
    many pairs, the per-chunk counts `partial` that ``_align_count_kernel`` fills first. Without them (`single`)
    one program does it all, and a caller may run that program inside a kernel of its own (``align_program``)."""

    ids: torch.Tensor
    num_experts: int
    sorted_rows: torch.Tensor
    block_expert: torch.Tensor
    consts: dict
    num_warps: int
    partial: torch.Tensor | None

    @property
    def single(self) -> bool:
        return self.partial is None

    @property
    def chunks(self) -> int:
        return 1 if self.single else cdiv(self.ids.numel(), self.consts["CHUNK"])


def plan_align(top_k_ids_flat: torch.Tensor, num_experts: int, block_m: int) -> AlignPlan:
    """``align``'s buffers (allocated) and launch parameters, nothing launched."""
    n = top_k_ids_flat.numel()
    dev = top_k_ids_flat.device
    mb = max_blocks_for(n, num_experts, block_m)
    sorted_rows = _empty(mb * block_m, torch.int32, dev, 1 << 30)
    block_expert = _empty(mb, torch.int32, dev, -1)
    e_pad = max(16, _next_pow2(num_experts))
    consts = dict(BLOCK_M=block_m, E_PAD=e_pad, NCH_SUB=16, B_TILE=16 if block_m >= 64 else 32)
    warps = 8 if e_pad >= 128 else 4
    if n <= _SINGLE_ALIGN_MAX:
        chunk = max(16, _next_pow2(n))
        consts.update(CHUNK=chunk, SUB=min(64, chunk), SINGLE=True)
        return AlignPlan(top_k_ids_flat, num_experts, sorted_rows, block_expert, consts, warps, None)
    # up to ~256 chunks of >= 512 pairs: the scatter loop is latency bound, ~4 us per 64-pair step (run 3:
    # 134 us with 64 chunks of 2048 at T*k = 131072; ~40 us with chunks of 512), while each program also
    # reads the whole [chunks, E] count table. The 256-chunk setting itself is not measured yet.
    chunk = max(_ALIGN_CHUNK, _next_pow2(cdiv(n, 256)))
    consts.update(CHUNK=chunk, SUB=64, NCH_SUB=16 if e_pad <= 256 else 8, SINGLE=False)
    partial = _empty(cdiv(n, chunk) * e_pad, torch.int32, dev, 1 << 20)
    return AlignPlan(top_k_ids_flat, num_experts, sorted_rows, block_expert, consts, warps, partial)


def run_align(plan: AlignPlan) -> None:
    """The launches of a plan from ``plan_align``."""
    n, chunks = plan.ids.numel(), plan.chunks
    if not plan.single:
        launch(
            _align_count_kernel, (chunks,), (plan.ids, plan.partial, n, plan.num_experts),
            dict(CHUNK=plan.consts["CHUNK"], E_PAD=plan.consts["E_PAD"]), plan.num_warps,
        )  # fmt: skip
    partial = plan.sorted_rows if plan.single else plan.partial  # unused by the one-program path
    launch(
        _align_kernel, (chunks,),
        (plan.ids, partial, plan.sorted_rows, plan.block_expert, n, plan.num_experts, chunks,
         plan.block_expert.numel()),
        plan.consts, plan.num_warps,
    )  # fmt: skip


def align(top_k_ids_flat: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert-sorted, block-padded routing. Returns (sorted_rows [max_blocks*BM] int32, block_expert [max_blocks]).
    Each expert's pairs fill its blocks from the first slot, padding only after them (the quantised down kernel's
    in-kernel combine counts a block's real rows as its first slots)."""
    plan = plan_align(top_k_ids_flat, num_experts, block_m)
    run_align(plan)
    return plan.sorted_rows, plan.block_expert


def _launch_gemm(
    a, w, bias, out, sorted_rows, block_expert, topk_w, *, num_valid, n_out, k_dim, a_div, block_m,
    stride_wn, stride_wk, up_offset, gated, interleaved, act, mul_w, cfg, dot_prec,
):  # fmt: skip
    num_blocks_m = block_expert.numel()
    bn, bk = cfg["BLOCK_N"], cfg["BLOCK_K"]
    grid = (num_blocks_m * cdiv(n_out, bn),)
    has_bias = bias is not None
    launch(
        _moe_gemm_kernel, grid,
        (a, w, bias if has_bias else w, out, sorted_rows, block_expert, topk_w if mul_w else a,
         num_valid, n_out, k_dim, a_div, num_blocks_m, up_offset,
         a.stride(0), a.stride(1), w.stride(0), stride_wn, stride_wk,
         bias.stride(0) if has_bias else 0, bias.stride(1) if has_bias else 0,
         out.stride(0), out.stride(1)),
        dict(BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], GATED=gated, INTERLEAVED=interleaved,
             ACT=act, HAS_BIAS=has_bias, MUL_W=mul_w, EVEN_K=(k_dim % bk == 0), EVEN_N=(n_out % bn == 0),
             DOT_PREC=dot_prec),
        cfg["num_warps"], cfg["num_stages"],
    )  # fmt: skip


def combine(y: torch.Tensor, ids_flat: torch.Tensor, out: torch.Tensor, top_k: int, num_experts: int,
            block_h: int | None = None, num_warps: int = 4) -> None:  # fmt: skip
    """out[t] = the sum of y's rows of token t (y [T*k, H], or [shares, T*k, H] partial sums of a split K).
    `block_h`, `num_warps`: columns per program and its warps (benchmarks sweep them; None: the default below)."""
    t, h = out.shape
    split = y.shape[0] if y.dim() == 3 else 1
    k_pad = max(2, _next_pow2(top_k))
    # ~8192 elements per program, 4 warps: 3.3-4.1 TB/s on the H200 at Qwen3 / DeepSeek T=4096 (k=8, BLOCK_H 1024),
    # against 1.6-1.8 TB/s for half that tile and 0.5 TB/s with 8 warps (benchmarks/quant_profile.py --micro)
    block_h = block_h or min(max(128, 8192 // k_pad), max(128, _next_pow2(h)))
    launch(
        _combine_kernel, (t, cdiv(h, block_h)),
        (y, ids_flat, out, h, top_k, num_experts, y.stride(-2), out.stride(0), y.stride(0) if split > 1 else 0),
        dict(BLOCK_H=block_h, K_PAD=k_pad, SPLIT=split), num_warps,
    )  # fmt: skip


def _dims(hidden_states, gate_up_proj, down_proj, gated, transposed):
    """(I, gate_up output channels, strides) from the stored layouts."""
    if transposed:  # gate_up [E, H, C], down [E, I, H]
        c1 = gate_up_proj.shape[2]
        s1n, s1k = gate_up_proj.stride(2), gate_up_proj.stride(1)
        i_dim = down_proj.shape[1]
        s2n, s2k = down_proj.stride(2), down_proj.stride(1)
    else:  # gate_up [E, C, H], down [E, H, I]
        c1 = gate_up_proj.shape[1]
        s1n, s1k = gate_up_proj.stride(1), gate_up_proj.stride(2)
        i_dim = down_proj.shape[2]
        s2n, s2k = down_proj.stride(1), down_proj.stride(2)
    return i_dim, c1, (s1n, s1k), (s2n, s2k)


def _validate(hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, num_experts, activation,
              gated, transposed, gate_up_bias, down_bias):  # fmt: skip
    if activation not in SUPPORTED_ACTIVATIONS:
        raise ValueError(
            f"triton_fused: activation {activation!r} is not supported; supported: {sorted(SUPPORTED_ACTIVATIONS)}"
        )
    if hidden_states.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"triton_fused: dtype {hidden_states.dtype} is not supported; supported: bf16, fp16, fp32")
    if hidden_states.dim() != 2:
        raise ValueError(f"triton_fused: hidden_states must be [T, H], got shape {tuple(hidden_states.shape)}")
    for name, w in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if w.dim() != 3:
            raise ValueError(f"triton_fused: {name} must be 3-D [E, ., .], got shape {tuple(w.shape)}")
        if w.dtype != hidden_states.dtype:
            raise ValueError(f"triton_fused: {name} dtype {w.dtype} differs from hidden_states {hidden_states.dtype}")
        if w.shape[0] != num_experts:
            raise ValueError(f"triton_fused: {name} has {w.shape[0]} experts, num_experts={num_experts}")
        if w.device != hidden_states.device:
            raise ValueError(f"triton_fused: {name} is on {w.device}, hidden_states on {hidden_states.device}")
    t, h = hidden_states.shape
    i_dim, c1, _, _ = _dims(hidden_states, gate_up_proj, down_proj, gated, transposed)
    want_c1 = 2 * i_dim if gated else i_dim
    k_in = gate_up_proj.shape[1] if transposed else gate_up_proj.shape[2]
    h_out = down_proj.shape[2] if transposed else down_proj.shape[1]
    if c1 != want_c1 or k_in != h or h_out != h:
        raise ValueError(
            "triton_fused: weight shapes do not fit: hidden_states "
            f"{tuple(hidden_states.shape)}, gate_up_proj {tuple(gate_up_proj.shape)}, down_proj {tuple(down_proj.shape)}"
            f" (gated={gated}, transposed={transposed})"
        )
    if top_k_index.dim() != 2 or top_k_index.shape[0] != t or top_k_weights.shape != top_k_index.shape:
        raise ValueError(
            f"triton_fused: top_k_index {tuple(top_k_index.shape)} and top_k_weights {tuple(top_k_weights.shape)}"
            f" must both be [T={t}, k]"
        )
    if top_k_index.dtype.is_floating_point or top_k_index.dtype == torch.bool:
        raise ValueError(f"triton_fused: top_k_index must be an integer tensor, got {top_k_index.dtype}")
    if gate_up_bias is not None and tuple(gate_up_bias.shape) != (num_experts, c1):
        raise ValueError(f"triton_fused: gate_up_bias must be [{num_experts}, {c1}], got {tuple(gate_up_bias.shape)}")
    if down_bias is not None and tuple(down_bias.shape) != (num_experts, h):
        raise ValueError(f"triton_fused: down_bias must be [{num_experts}, {h}], got {tuple(down_bias.shape)}")


def fused_experts_impl(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    num_experts: int,
    activation: str = "silu",
    gated: bool = True,
    interleaved: bool = False,
    transposed: bool = False,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """The kernels, without validation and without the custom-op wrapper."""
    t, h = hidden_states.shape
    top_k = top_k_index.shape[1]
    out = _empty((t, h), hidden_states.dtype, hidden_states.device, float("nan"))
    if t == 0 or top_k == 0:
        return out.zero_()
    i_dim, _, (s1n, s1k), (s2n, s2k) = _dims(hidden_states, gate_up_proj, down_proj, gated, transposed)
    if config is None:  # cached and already normalised
        cfg = _configs.get_config(
            num_experts, h, i_dim, t, top_k, hidden_states.dtype, gated=gated, device=hidden_states.device
        )
    else:
        cfg = _configs.normalize(config)
    bm = cfg["BLOCK_M"]
    n_pairs = t * top_k
    ids = top_k_index.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    tw = top_k_weights.reshape(-1)
    if not tw.is_contiguous():
        tw = tw.contiguous()
    dot_prec = _dot_precision(hidden_states.dtype)

    sorted_rows, block_expert = align(ids, num_experts, bm)

    inter = _empty((n_pairs, i_dim), hidden_states.dtype, hidden_states.device, float("nan"))
    _launch_gemm(
        hidden_states, gate_up_proj, gate_up_bias, inter, sorted_rows, block_expert, None,
        num_valid=n_pairs, n_out=i_dim, k_dim=h, a_div=top_k, block_m=bm, stride_wn=s1n, stride_wk=s1k,
        up_offset=i_dim, gated=gated, interleaved=interleaved and gated, act=_ACT_CODE[activation], mul_w=False,
        cfg=cfg["gate_up"], dot_prec=dot_prec,
    )  # fmt: skip
    y = _empty((n_pairs, h), hidden_states.dtype, hidden_states.device, float("nan"))
    _launch_gemm(
        inter, down_proj, down_bias, y, sorted_rows, block_expert, tw,
        num_valid=n_pairs, n_out=h, k_dim=i_dim, a_div=1, block_m=bm, stride_wn=s2n, stride_wk=s2k,
        up_offset=0, gated=False, interleaved=False, act=0, mul_w=True, cfg=cfg["down"], dot_prec=dot_prec,
    )  # fmt: skip
    combine(y, ids, out, top_k, num_experts)
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
) -> torch.Tensor:
    cfg = _configs.decode_config(config) if config is not None else None
    return fused_experts_impl(
        hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, num_experts, activation, gated,
        interleaved, transposed, gate_up_bias, down_bias, cfg,
    )  # fmt: skip


@_triton_fused_experts_op.register_fake
def _triton_fused_experts_fake(
    hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, num_experts, activation, gated,
    interleaved, transposed, gate_up_bias, down_bias, config,
):  # fmt: skip
    return hidden_states.new_empty(hidden_states.shape)


def fused_experts(
    hidden_states: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    num_experts: int,
    activation: str = "silu",
    gated: bool = True,
    interleaved: bool = False,
    transposed: bool = False,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """MoE experts forward: returns [T, H] in hidden_states' dtype (fp32 accumulation).

    Weights as a Transformers experts module stores them:
      gated:     gate_up_proj [E, 2I, H] ([E, H, 2I] if transposed); concatenated (gate rows first, then up)
                 or interleaved (gate0, up0, gate1, up1, ...)
      not gated: gate_up_proj is the up projection [E, I, H] ([E, H, I] if transposed), activation only
      down_proj  [E, H, I] ([E, I, H] if transposed)
      gate_up_bias [E, 2I] (or [E, I] not gated), down_bias [E, H]; both added before activation / weighting.
    Ids outside [0, num_experts) (expert-parallel sentinel) contribute nothing. ``config`` overrides the tile
    configuration (see ``configs.normalize``); by default it comes from the shipped JSON or the heuristics.
    Under torch.compile the call goes through the torch custom op ``selector::triton_fused_experts`` (opaque,
    fullgraph-safe); in eager mode it calls the same implementation directly unless _EAGER_BYPASS_OP is False
    (env SELECTOR_TRITON_FUSED_VIA_OP=1).
    """
    _validate(
        hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, num_experts, activation, gated,
        transposed, gate_up_bias, down_bias,
    )  # fmt: skip
    grad = torch.is_grad_enabled() and hidden_states.requires_grad  # the op makes a backward fail loudly
    if _EAGER_BYPASS_OP and not torch.compiler.is_compiling() and not grad:
        # Eager (and CUDA-graph capture): the op's dispatcher costs ~50 us of host time per call on the H200
        # machine (measured), more than the whole decode step; the op only matters to torch.compile.
        return fused_experts_impl(
            hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, num_experts, activation, gated,
            interleaved, transposed, gate_up_bias, down_bias, config,
        )  # fmt: skip
    return torch.ops.selector.triton_fused_experts(
        hidden_states, gate_up_proj, down_proj, top_k_index, top_k_weights, num_experts, activation, gated,
        interleaved, transposed, gate_up_bias, down_bias,
        _configs.encode_config(config) if config is not None else None,
    )  # fmt: skip
