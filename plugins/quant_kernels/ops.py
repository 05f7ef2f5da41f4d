"""Host side of the quantised experts kernels: launches, tile heuristics and the torch custom op.

``quant_experts`` runs a whole layer whose gate is act(gate) * up (or a plain activation) and that has no
post-expert norm: routing (``align`` of the fused backend, grouped mode only), the gate_up GEMM with bias and
gating in its epilogue, the down GEMM with bias and the routing weight in its epilogue, and the fused backend's
deterministic ``combine`` (fixed-order fp32 sum over the k slots; sentinel slots skipped). One torch custom op,
so torch.compile sees one opaque node and there is no host synchronisation (CUDA graphs capture it).

``route`` / ``projection`` are the same pieces one by one, for layers whose gate or norm is torch code.
"""

from __future__ import annotations

import functools
import os

import torch
import triton.language as tl

from selector.plugins.quant_kernels import configs as _configs
from selector.plugins.quant_kernels import kernels as K
from selector.plugins.triton_fused.kernels import _TensorDescriptor as TensorDescriptor  # None: a Triton without TMA
from selector.plugins.triton_fused.kernels import (AlignPlan, _next_pow2, cdiv, combine, launch, max_blocks_for, plan_align,
                                          run_align)

MODES = ("grouped", "batched")


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _target_programs(device: torch.device) -> int:
    if device.type != "cuda":
        return 0  # the interpreter: as few programs as possible
    return 2 * _num_sms(device.index or 0)


# Defaults where a config does not say (configs.py: QUANT_X, ROUTE). x is quantised up front: on the H200 the
# in-loop variant lost in every decode cell tuned (it lengthens each K step of a latency-bound loop). One block
# per pair for a single token (its k experts are distinct, so nothing is read twice; the align launch is saved);
# with more tokens pairs share experts, and a pair block re-reads the expert (Mixtral T=8: 2.3x slower).

# SELECTOR_QUANT_VIA_OP=1: eager calls go through the custom op too (as under torch.compile)
EAGER_BYPASS_OP = os.environ.get("SELECTOR_QUANT_VIA_OP", "0") in ("", "0")
# A diagnostic: SELECTOR_FP8_MAX_IMPRECISE_ACC=32 makes the grouped kernel's fp8 dots promote their sum to fp32
# every 32 inputs (kernels._dot), to measure what the tensor core's reduced-precision accumulation costs.
MAX_IMPRECISE_ACC = int(os.environ.get("SELECTOR_FP8_MAX_IMPRECISE_ACC", "0") or 0)
# SELECTOR_QUANT_ONE_SCALE_ROW=0: gather one weight scale per column even where a tile lies in one scale row (A/B)
ONE_SCALE_ROW = os.environ.get("SELECTOR_QUANT_ONE_SCALE_ROW", "1") != "0"
# With one block per pair (ROUTE "pairs": one token by default) the down GEMM adds the k slots itself unless a config
# says "COMBINE": "launch" (no combine launch; its counters and the output's zeros come with x's quantisation).
# Sorted blocks do so only where a config says "COMBINE": "kernel" (never on the TMA path): at T=8 on the H200 it
# was slower than the launch (Qwen3 / Qwen1.5 graph cells 0.63 -> 0.66-0.67 of bf16, part23: each program counts
# its rows with serial atomics, and the last waits on its reads).
# SELECTOR_QUANT_FUSED_COMBINE=0: the launch always (A/B).
FUSED_COMBINE = os.environ.get("SELECTOR_QUANT_FUSED_COMBINE", "1") != "0"
# Sorted blocks of >= TMA_MIN_BLOCK_M rows (large T) on sm_90+: x quantised straight into block order and both
# projections reading activations and weights through TMA descriptors (use_tma). On the H200 that took the
# T=4096 GEMMs from 420-500 to 550-650 TFLOP/s (benchmarks/quant_fp8_dev.py). SELECTOR_QUANT_TMA=0: off (A/B).
TMA = os.environ.get("SELECTOR_QUANT_TMA", "1") != "0"
# Sorted blocks of up to _SINGLE_ALIGN_MAX pairs (decode) are routed by one more program of x's quantisation launch
# rather than an align launch of their own (``quantize_rows(align=)``). SELECTOR_QUANT_FUSED_ALIGN=0: its own (A/B).
FUSED_ALIGN = os.environ.get("SELECTOR_QUANT_FUSED_ALIGN", "1") != "0"
TMA_MIN_BLOCK_M = 64
TMA_MAX_BOX = 256  # rows of one TMA copy (the hardware's limit per box dimension)


def grouped_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per expert block: close to the mean rows per expert hit (decode: 16, the smallest fp8 dot), at most
    64: with 128 rows the gated tiles spill registers on sm90 unless they shrink to 32 columns."""
    per_expert = num_pairs / max(1, min(num_experts, num_pairs))
    for bm in (16, 32):
        if per_expert <= bm * 1.5:
            return bm
    return 64


# (BLOCK_N, num_warps) per BLOCK_M, widest first, for sm90 (ptxas: no register spills, bf16 activations, 3 stages).
# "wide": gated layers, whose gate_up program holds two accumulators (gate and up) or one 2 x BLOCK_N wide.
_GROUPED_TILES = {
    True: {16: ((128, 8), (64, 4), (32, 4)), 32: ((64, 8), (32, 4)), 64: ((64, 8), (32, 4)), 128: ((32, 8),)},
    False: {16: ((128, 8), (64, 4), (32, 4)), 32: ((64, 4), (32, 4)), 64: ((128, 8), (64, 8)), 128: ((64, 8), (32, 8))},
}
_ROWS_TILES = ((128, 8), (64, 8), (32, 4))


def _pick(options: tuple[tuple[int, int], ...], programs_per_n: int, n_out: int, device: torch.device) -> tuple[int, int]:
    """The widest tile that still gives every SM two programs; the narrowest when none does."""
    target = _target_programs(device)
    if target == 0:  # interpreter: few, wide programs
        bn = max(16, min(64, _next_pow2(n_out)))
        return bn, 4
    for bn, warps in options:
        if programs_per_n * cdiv(n_out, bn) >= target:
            return bn, warps
    return options[-1]


def split_k(mode: str, config: dict | None, routing: tuple, n_out: int, k_dim: int, block_k: int,
            device: torch.device) -> int:  # fmt: skip
    """Shares of K for a linear grouped projection: the config's SPLIT_K, else enough to give every SM two
    programs when few (block, N tile) programs each walk a long K loop (>= 32 steps; each share keeps >= 8)."""
    if mode != "grouped":
        return 1
    asked = _asked_split(config, k_dim, block_k)
    if asked:
        return asked
    target = _target_programs(device)
    steps = cdiv(k_dim, block_k)
    if target == 0 or steps < 32:
        return 1
    programs = _tiles(routing, n_out, device, config or {}, False)[1]
    split = 1
    while programs * split < target and steps // (2 * split) >= 8 and split < 8:
        split *= 2
    return split


def finish_split(mode: str, config: dict | None, k_dim: int, block_k: int) -> int:
    """Shares of K for a projection whose epilogue needs the whole sum (gate, activation, quantised output): only
    where the config asks (SPLIT_K); the kernel's last share to finish adds them (FINISH). Decode: more programs
    for a latency-bound K loop (Qwen gate_up at T=1: 96 programs of 16 K steps)."""
    return max(1, _asked_split(config, k_dim, block_k)) if mode == "grouped" else 1


def _asked_split(config: dict | None, k_dim: int, block_k: int) -> int:
    """The config's SPLIT_K, from 1 to one share per K tile; 0 when it does not say."""
    asked = int((config or {}).get("SPLIT_K") or 0)
    return max(1, min(asked, cdiv(k_dim, block_k))) if asked else 0


def _gemm_config(mode: str, rows: int, n_out: int, device: torch.device, config: dict | None, wide: bool) -> dict:
    """One GEMM's launch parameters: those `config` sets (flat keys), the heuristics for the rest."""
    cfg = {k: v for k, v in (config or {}).items() if v and not isinstance(v, dict)}
    if mode == "grouped":
        bm = cfg.setdefault("BLOCK_M", 16)
        options = _GROUPED_TILES[wide].get(bm, ((64, 8), (32, 4)))
        bn, warps = _pick(options, rows // bm, n_out, device)
        cfg.setdefault("GROUP_M", 8)
    else:
        bn, warps = _pick(_ROWS_TILES, rows, n_out, device)
    cfg.setdefault("BLOCK_N", bn)
    cfg.setdefault("num_warps", warps)
    cfg.setdefault("num_stages", 3)
    return cfg


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16,
              torch.float8_e4m3fn: tl.float8e4nv}  # fmt: skip


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
            dict(BLOCK_R=block_r, BLOCK_K=group, EXACT=K.INTERPRET, ZERO=zero is not None,
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


def _scale_strides(s: torch.Tensor) -> tuple[int, int, int]:
    return s.stride(0), s.stride(1), s.stride(2)


def _launch(
    mode: str,
    a: torch.Tensor,
    w: torch.Tensor,
    s: torch.Tensor,
    act_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    routing: tuple[torch.Tensor, ...],
    topk_w: torch.Tensor | None,
    *,
    num_experts: int,
    n_out: int,
    k_dim: int,
    a_div: int,
    up_offset: int,
    n_split: int,
    split_rows: int,
    block_n_w: int,
    block_k: int,
    gated: bool,
    interleaved: bool,
    act: int,
    fp4: bool,
    ue8m0: bool,
    config: dict | None,
    a_scale: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
    inter_dtype: torch.dtype | None = None,
    finish_split: int = 1,
    combine: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    counts: torch.Tensor | None = None,
    a_sorted: bool = False,
    out_sorted: bool = False,
    num_pairs: int | None = None,
) -> None:
    """`combine` (grouped, linear epilogue): (out [T, N], ids [T * k], k); `out` here is then the kernel's
    [shares, pairs, N] fp32 scratch. `counts`: zeroed int32 counters for FINISH / COMBINE (else torch.zeros).
    `a_sorted`: a in block order, a and w through TMA descriptors; `out_sorted`: rows stored in block order."""
    static = act_scale is not None
    has_bias = bias is not None
    s = s.view(torch.uint8) if ue8m0 and s.dtype != torch.uint8 else s
    common = dict(
        FP4=fp4, UE8M0=ue8m0, STATIC=static, GATED=gated, INTERLEAVED=interleaved and gated, ACT=act,
        HAS_BIAS=has_bias, MUL_W=topk_w is not None, EXACT=K.INTERPRET,
    )  # fmt: skip
    final = combine[0] if combine is not None else out  # what the kernel stores its results to
    strides = (
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), w.stride(2), *_scale_strides(s),
        bias.stride(0) if has_bias else 0, bias.stride(1) if has_bias else 0, final.stride(-2), final.stride(-1),
    )  # fmt: skip
    wide = gated
    if mode == "grouped":
        sorted_rows, block_expert, bm = routing
        num_blocks_m = block_expert.numel()
        cfg = _gemm_config(mode, num_blocks_m * bm, n_out, a.device, {**(config or {}), "BLOCK_M": bm}, wide)
        bn = cfg["BLOCK_N"]
        split = out.shape[0] if out.dim() == 3 else 1  # split K: [shares, pairs, N] fp32 partial sums
        # a tile of stored channels (2 x BLOCK_N interleaved) starts at a multiple of its width: when that width
        # divides the scale block's, the tile lies in one scale row, unless it straddles the up half's start
        # (scale blocks restart there): a gated tile never does; a plain one over [gate | up] can
        tile_c = 2 * bn if gated and interleaved else bn
        straddles = not gated and n_split < w.shape[1] and n_split % tile_c != 0
        one_row = ONE_SCALE_ROW and not fp4 and block_n_w % tile_c == 0 and not straddles
        tiles = num_blocks_m * cdiv(n_out, bn)
        part = count = s  # unused unless the kernel finishes a split K (FINISH) or adds the slots (COMBINE)
        ids, top_k = (combine[1], combine[2]) if combine is not None else (s, 1)
        if finish_split > 1:
            split = finish_split
            part = torch.empty(split * tiles * bm * (tile_c + bn), dtype=torch.float32, device=a.device)
        if combine is not None:
            part = out
            tiles_needed = final.shape[0] * cdiv(n_out, bn)
        else:
            tiles_needed = tiles if finish_split > 1 else 0
        if tiles_needed:
            if counts is None:
                counts = torch.zeros(tiles_needed, dtype=torch.int32, device=a.device)
            elif counts.numel() < tiles_needed:
                raise ValueError(f"quantised experts: {counts.numel()} counters for {tiles_needed} tiles")
            count = counts
        grid = (tiles, split)
        a_s = a_scale if a_scale is not None else s
        o_s = out_scale if out_scale is not None else s
        a_desc = w_desc = s  # unused unless a_sorted
        if a_sorted:
            if tile_c > TMA_MAX_BOX:
                raise ValueError(f"quantised experts: a TMA weight tile holds at most {TMA_MAX_BOX} rows, not {tile_c}")
            a_desc = TensorDescriptor.from_tensor(a, [bm, block_k])
            w_desc = TensorDescriptor.from_tensor(w.view(-1, w.shape[2]), [tile_c, block_k])
        num_valid_pairs = num_pairs if num_pairs is not None else out.shape[-2]
        launch(
            K._grouped_kernel, grid,
            (a, w, s, act_scale if static else s, bias if has_bias else s, final,
             block_expert if sorted_rows is None else sorted_rows, block_expert, topk_w if topk_w is not None else s,
             a_s, o_s, part, count, ids, a_desc, w_desc, w.shape[1], num_valid_pairs, num_experts, n_out, k_dim,
             a_div, num_blocks_m, up_offset,
             n_split, split_rows, block_n_w, top_k, *strides,
             a_s.stride(0) if a_scale is not None else 0, o_s.stride(0) if out_scale is not None else 0,
             out.stride(0) if out.dim() == 3 and combine is None else 0),
            dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=block_k, GROUP_M=cfg["GROUP_M"], **common,
                 A_FP8=a_scale is not None, QUANT_OUT=out_scale is not None,
                 INTER_DTYPE=_TL_DTYPES[inter_dtype or a.dtype], PAIR_BLOCKS=sorted_rows is None, SPLIT_K=split,
                 MAX_IMPRECISE=MAX_IMPRECISE_ACC, ONE_SCALE_ROW=one_row, FINISH=finish_split > 1, PART_W=tile_c,
                 COMBINE=combine is not None, K_PAD=_next_pow2(top_k), TMA=a_sorted,
                 SORTED_OUT=out_sorted, SWAP=bool(cfg.get("SWAP"))),
            cfg["num_warps"], cfg["num_stages"],
        )  # fmt: skip
    else:
        (ids,) = routing
        cfg = _gemm_config(mode, ids.numel(), n_out, a.device, config, wide)
        bn = cfg["BLOCK_N"]
        grid = (ids.numel(), cdiv(n_out, bn))
        launch(
            K._rows_kernel, grid,
            (a, w, s, act_scale if static else s, bias if has_bias else s, out, ids,
             topk_w if topk_w is not None else s,
             num_experts, n_out, k_dim, a_div, up_offset, n_split, split_rows, block_n_w, *strides),
            dict(BLOCK_N=bn, BLOCK_K=block_k, **common), cfg["num_warps"], cfg["num_stages"],
        )  # fmt: skip


def route(mode: str, ids_flat: torch.Tensor, num_experts: int, config: dict | None = None,
          top_k: int | None = None) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """grouped: (sorted_rows, block_expert, BLOCK_M) from the fused backend's align, or (None, ids, 16): one
    block per pair, no align launch (configs.py: ROUTE; by default for one token's `top_k` pairs); batched: (ids,)."""
    routing, plan = route_deferred(mode, ids_flat, num_experts, config, top_k)
    if plan is not None:
        run_align(plan)
    return routing


def route_deferred(mode: str, ids_flat: torch.Tensor, num_experts: int, config: dict | None = None,
                   top_k: int | None = None) -> tuple[tuple[torch.Tensor, ...], AlignPlan | None]:  # fmt: skip
    """``route``'s layout with its align not launched yet: (routing, plan), plan None where there is nothing to
    launch (pairs, batched). The caller runs the plan (``run_align``) or hands it to ``quantize_rows(align=)``."""
    if mode == "batched":
        return (ids_flat,), None
    config = config or {}
    bm = int(config.get("BLOCK_M") or 0)  # nested or flat
    one_token = top_k is not None and ids_flat.numel() == top_k and bm in (0, 16)
    if (config.get("ROUTE") or ("pairs" if one_token else "sorted")) == "pairs":
        return (None, ids_flat, 16), None
    bm = bm or grouped_block_m(ids_flat.numel(), num_experts)
    plan = plan_align(ids_flat, num_experts, bm)
    return (plan.sorted_rows, plan.block_expert, bm), plan


def projection(
    mode: str,
    a: torch.Tensor,  # [rows_a, K] activations (row of pair p: p // a_div)
    w: torch.Tensor,  # [E, C, K] e4m3 or [E, C, K/2] fp4 bytes
    s: torch.Tensor,  # scales
    routing: tuple[torch.Tensor, ...],
    num_pairs: int,
    *,
    num_experts: int,
    a_div: int,
    fp4: bool,
    ue8m0: bool,
    block_n: int,
    block_k: int,
    split_inter: int | None = None,  # gated + concatenated: I (gate and up blocked separately)
    act_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    topk_w: torch.Tensor | None = None,
    gated: bool = False,
    interleaved: bool = False,
    activation: str = "none",
    out_dtype: torch.dtype | None = None,
    config: dict | None = None,
    a_scale: torch.Tensor | None = None,
    quant_out: bool = False,
    combine: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    counts: torch.Tensor | None = None,
    a_sorted: bool = False,
    out_sorted: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One projection for every (token, slot) pair -> [num_pairs, N] (N = I when `gated`, else C); with K split
    (grouped, linear epilogue: config SPLIT_K or the decode heuristic) [shares, num_pairs, N] fp32 partial sums.
    Other epilogues split K only where the config asks (``finish_split``) and still return whole results.

    Sentinel pairs' rows are left unwritten (the combine skips them). `a_scale`: `a` is e4m3 from
    ``quantize_rows``. `quant_out` (grouped mode, BLOCK_N a multiple of block_k): returns (e4m3 out, scales),
    the result rounded to `out_dtype` and quantised per row and block_k channels.
    `combine` (grouped, linear epilogue with the routing weight): (out [T, N], ids [T * k], k): the kernel adds
    each token's k slots into out itself (``kernels._combine_rows``; out must hold zeros where a token has no
    valid slot) and out is returned. `counts`: int32 zeros for the kernel's counters (FINISH / COMBINE; None:
    allocated and zeroed here, one more launch).
    `a_sorted` (sorted routing, fp8 weights, `a_scale` given; see ``use_tma``): `a` holds one row per block slot
    in block order (``quantize_rows(slots=...)``) and the kernel reads it and the weights through TMA descriptors.
    `out_sorted` (sorted routing, no K split): the result has one row per block slot, in block order, the layout
    a following ``a_sorted`` projection reads (padding slots hold finite values, unused blocks' rows nothing).
    """
    c = w.shape[1]
    k_dim = w.shape[2] * (2 if fp4 else 1)
    n_out = c // 2 if gated else c
    inter_dtype = out_dtype or (a.dtype if a_scale is None else torch.bfloat16)
    linear = not (gated or quant_out) and activation == "none"  # partial sums only add up through a linear epilogue
    if combine is not None and not (mode == "grouped" and linear and topk_w is not None and not out_sorted):
        raise ValueError("quantised experts: only a grouped projection with a linear, weighted epilogue whose rows are "
                         "stored per pair (not out_sorted) combines in the kernel")  # fmt: skip
    sorted_route = mode == "grouped" and routing[0] is not None
    if a_sorted and not (sorted_route and a_scale is not None and a.shape[0] == a_scale.shape[0] == routing[0].numel()
                         and use_tma(routing, fp4, a.device, w, tile_rows=block_k)):  # fmt: skip
        raise ValueError("quantised experts: a_sorted needs e4m3 a and its scales in block order and weights TMA can "
                         "read (use_tma)")  # fmt: skip
    split = split_k(mode, config, routing, n_out, k_dim, block_k, a.device) if linear else 1
    finish = 1 if linear else finish_split(mode, config, k_dim, block_k)
    if out_sorted and not (sorted_route and combine is None and split == 1):
        raise ValueError("quantised experts: out_sorted needs sorted blocks and no K split")
    rows_out = routing[0].numel() if out_sorted else num_pairs
    if combine is not None or split > 1:  # fp32 rows per K share, added by the kernel's last arrivals or combine_slots
        out = torch.empty((split, num_pairs, n_out), dtype=torch.float32, device=a.device)
    else:
        out = torch.empty((rows_out, n_out), dtype=torch.float8_e4m3fn if quant_out else inter_dtype, device=a.device)
    out_scale = None
    if quant_out:
        out_scale = torch.empty((rows_out, cdiv(n_out, block_k)), dtype=torch.float32, device=a.device)
    if num_pairs == 0 or n_out == 0:
        return combine[0] if combine is not None else (out, out_scale) if quant_out else out
    if split_inter is not None and not fp4:
        n_split, split_rows = split_inter, cdiv(split_inter, block_n)
    else:
        n_split, split_rows = c, 0
    _launch(
        mode, a, w, s, act_scale, bias, out, routing, topk_w,
        num_experts=num_experts, n_out=n_out, k_dim=k_dim, a_div=a_div, up_offset=c // 2 if gated else 0,
        n_split=n_split, split_rows=split_rows, block_n_w=block_n, block_k=block_k, gated=gated,
        interleaved=interleaved, act=K.ACT_CODE[activation], fp4=fp4, ue8m0=ue8m0, config=config,
        a_scale=a_scale, out_scale=out_scale, inter_dtype=inter_dtype, finish_split=finish, combine=combine,
        counts=counts, a_sorted=a_sorted, out_sorted=out_sorted, num_pairs=num_pairs,
    )  # fmt: skip
    if combine is not None:
        return combine[0]
    return (out, out_scale) if quant_out else out


def quant_experts_impl(
    x: torch.Tensor,
    w1: torch.Tensor,
    s1: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    as1: torch.Tensor | None,
    as2: torch.Tensor | None,
    num_experts: int,
    activation: str,
    gated: bool,
    interleaved: bool,
    fp4: bool,
    ue8m0: bool,
    block_n: int,
    block_k: int,
    mode: str,
    config: dict | None = None,
) -> torch.Tensor:
    t, h = x.shape
    top_k = top_k_index.shape[1]
    out = torch.empty((t, h), dtype=x.dtype, device=x.device)
    if t == 0 or top_k == 0:
        return out.zero_()
    ids = top_k_index.reshape(-1)
    ids = ids if ids.is_contiguous() else ids.contiguous()
    wts = top_k_weights.reshape(-1)
    wts = wts if wts.is_contiguous() else wts.contiguous()
    n_pairs = ids.numel()
    inter_dim = w2.shape[2] * (2 if fp4 else 1)
    cfg = resolve_config(config, x.device, fp4, num_experts, h, inter_dim, t, top_k) if mode == "grouped" else None
    routing, pending = route_deferred(mode, ids, num_experts, cfg or config, top_k)
    common = dict(num_experts=num_experts, fp4=fp4, ue8m0=ue8m0, block_n=block_n, block_k=block_k)
    split = (w1.shape[1] // 2) if gated and not interleaved else None
    up_args = dict(gated=gated, interleaved=interleaved, activation=activation, split_inter=split)
    if cfg is None or as1 is not None:  # batched, or static scales (per expert: x cannot be quantised up front)
        if pending is not None:
            run_align(pending)
        nested = cfg or _configs.normalize(config)  # the op hands batched configs over nested too (configs.decode)
        c1, c2 = nested["gate_up"], nested["down"]
        inter = projection(mode, x, w1, s1, routing, n_pairs, a_div=top_k, act_scale=as1, bias=b1, config=c1,
                           **up_args, **common)  # fmt: skip
        y = projection(mode, inter, w2, s2, routing, n_pairs, a_div=1, act_scale=as2, bias=b2, topk_w=wts, config=c2,
                       **common)  # fmt: skip
        return combine_slots(y, ids, out, top_k, num_experts)
    # grouped, dynamic: x quantised once up front, or (config QUANT_X "loop") inside gate_up's K loop; the gate_up
    # epilogue quantises the intermediate when its tile covers whole groups, else a second quantize_rows does
    bn1, up_tiles = _tiles(routing, inter_dim, x.device, cfg["gate_up"], gated)
    up_cfg = {**cfg["gate_up"], "BLOCK_N": bn1}
    up_counts = up_tiles if finish_split(mode, up_cfg, h, block_k) > 1 else 0
    once = (cfg.get("QUANT_X") or "once") == "once"
    bn2 = _tiles(routing, h, x.device, cfg["down"], False)[0]
    tile_rows = max(2 * bn1 if interleaved else bn1, bn2, block_k)
    tma = once and use_tma(routing, fp4, x.device, w1, w2, tile_rows=tile_rows)
    fused = FUSED_COMBINE and combine_in_kernel(routing, cfg) and not tma
    down_counts = t * cdiv(h, bn2) if fused else 0
    n_counts = up_counts + down_counts
    counts = torch.empty(n_counts, dtype=torch.int32, device=x.device) if n_counts else None
    # a one-program align rides on x's quantisation launch (decode), unless that launch needs its result (TMA)
    ride = pending if pending is not None and pending.single and once and not tma and FUSED_ALIGN else None
    if pending is not None and ride is None:
        run_align(pending)
    if tma:  # x quantised into block order; both projections read it (and their weights) through TMA
        xq, xs = quantize_rows(x, block_k, counts=counts, slots=routing, a_div=top_k)
    elif once:  # x's quantisation also zeroes the counters and out, and may route: no launches of their own
        xq, xs = quantize_rows(x, block_k, zero=out if fused else None, counts=counts, align=ride)
    else:  # QUANT_X "loop": no quantize_rows launch to ride on
        xq, xs = x, None
        if counts is not None:
            counts.zero_()
        if fused:
            out.zero_()
    quant_out = bn1 % block_k == 0
    inter = projection(mode, xq, w1, s1, routing, n_pairs, a_div=top_k, bias=b1, config=up_cfg, a_scale=xs,
                       quant_out=quant_out, out_dtype=x.dtype, counts=counts[:up_counts] if n_counts else None,
                       a_sorted=tma, out_sorted=tma, **up_args, **common)  # fmt: skip
    iq, isc = inter if quant_out else quantize_rows(inter, block_k, slots=routing if tma else None)
    down = dict(a_div=1, bias=b2, topk_w=wts, config=cfg["down"], a_scale=isc, out_dtype=x.dtype, a_sorted=tma,
                **common)  # fmt: skip
    if fused:
        return projection(mode, iq, w2, s2, routing, n_pairs, combine=(out, ids, top_k), counts=counts[up_counts:],
                          **down)  # fmt: skip
    y = projection(mode, iq, w2, s2, routing, n_pairs, **down)
    return combine_slots(y, ids, out, top_k, num_experts)


def combine_in_kernel(routing: tuple, config: dict | None) -> bool:
    """Whether the down kernel adds the slots (COMBINE) rather than a combine launch: the config's "COMBINE" where it
    says, else for pair blocks only. The caller never combines in the kernel on the TMA path (quant_experts_impl)."""
    asked = (config or {}).get("COMBINE")
    return asked == "kernel" if asked else routing[0] is None


def use_tma(routing: tuple, fp4: bool, device: torch.device, *weights: torch.Tensor, tile_rows: int = 0) -> bool:
    """Whether a layer runs its projections through TMA descriptors (``projection(a_sorted=True)``): sorted blocks
    of TMA_MIN_BLOCK_M to TMA_MAX_BOX rows, weight tiles and K tiles of at most TMA_MAX_BOX (`tile_rows`: the
    largest), fp8 weights stored contiguously with rows of a multiple of 16 bytes (TMA's alignment) and fewer than
    2^31 rows in all (int32 coordinates), on sm_90+ (or the interpreter, for the tests), with a Triton that has
    host descriptors."""
    if not TMA or TensorDescriptor is None or fp4 or routing[0] is None:
        return False
    if not TMA_MIN_BLOCK_M <= routing[2] <= TMA_MAX_BOX or tile_rows > TMA_MAX_BOX:
        return False
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (9, 0):
            return False
    elif not K.INTERPRET:
        return False
    return all(w.is_contiguous() and w.shape[2] % 16 == 0 and w.data_ptr() % 16 == 0 and w.shape[0] * w.shape[1] < 2**31
               for w in weights)  # fmt: skip


def _tiles(routing: tuple, n_out: int, device: torch.device, config: dict, wide: bool) -> tuple[int, int]:
    """A grouped projection's (BLOCK_N, number of (block, N tile) programs per K share), as _launch will pick."""
    blocks, bm = routing[1].numel(), routing[2]
    bn = _gemm_config("grouped", blocks * bm, n_out, device, {**config, "BLOCK_M": bm}, wide)["BLOCK_N"]
    return bn, blocks * cdiv(n_out, bn)


def resolve_config(config: dict | None, device: torch.device, fp4: bool, num_experts: int, hidden: int, inter: int,
                   tokens: int, top_k: int) -> dict:  # fmt: skip
    """Nested config of the grouped path: the caller's, else this GPU's tuned table entry, else {} (heuristics)."""
    if config:
        return _configs.normalize(config)
    if device.type == "cuda":
        key = _configs.shape_key(fp4, num_experts, hidden, inter, top_k)
        found = _configs.tuned(_device_name(device.index or 0), key, tokens)
        if found is not None:
            return found
    return _configs.normalize(None)


@functools.cache
def _device_name(device_index: int) -> str:
    return torch.cuda.get_device_name(device_index)


def combine_slots(y: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, top_k: int, num_experts: int) -> torch.Tensor:
    """The fused backend's combine into `out`; under the interpreter through fp32 (its bf16/fp16 cast is wrong)."""
    if K.INTERPRET and out.dtype != torch.float32:
        wide = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        combine(y, ids, wide, top_k, num_experts)
        return out.copy_(wide)
    combine(y, ids, out, top_k, num_experts)
    return out


_encode, _decode = _configs.encode, _configs.decode


@torch.library.custom_op("selector::quant_experts", mutates_args=())
def _quant_experts_op(
    x: torch.Tensor,
    w1: torch.Tensor,
    s1: torch.Tensor,
    w2: torch.Tensor,
    s2: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    b1: torch.Tensor | None,
    b2: torch.Tensor | None,
    as1: torch.Tensor | None,
    as2: torch.Tensor | None,
    num_experts: int,
    activation: str,
    gated: bool,
    interleaved: bool,
    fp4: bool,
    ue8m0: bool,
    block_n: int,
    block_k: int,
    mode: str,
    config: list[int] | None,
) -> torch.Tensor:
    return quant_experts_impl(
        x, w1, s1, w2, s2, top_k_index, top_k_weights, b1, b2, as1, as2, num_experts, activation, gated,
        interleaved, fp4, ue8m0, block_n, block_k, mode, _decode(config),
    )  # fmt: skip


@_quant_experts_op.register_fake
def _(x, w1, s1, w2, s2, top_k_index, top_k_weights, b1, b2, as1, as2, num_experts, activation, gated,
      interleaved, fp4, ue8m0, block_n, block_k, mode, config):  # fmt: skip
    return x.new_empty(x.shape)


def quant_experts(
    x, w1, s1, w2, s2, top_k_index, top_k_weights, b1, b2, as1, as2, *, num_experts, activation, gated,
    interleaved, fp4, ue8m0, block_n, block_k, mode, config=None,
):  # fmt: skip
    """The whole layer through the custom op ``selector::quant_experts`` under torch.compile (see the module
    docstring); in eager mode (and CUDA-graph capture) the same implementation directly: the op's dispatcher and
    its aliasing check cost ~130 us of host time per call on the H200 machine (measured, Qwen3 T=512: 389 us per
    call against 257 us of kernels), as triton_fused found for its own op."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {MODES}")
    # not when autograd records: through the op a backward fails loudly instead of dropping x's gradient
    if EAGER_BYPASS_OP and not torch.compiler.is_compiling() and not (torch.is_grad_enabled() and x.requires_grad):
        return quant_experts_impl(
            x, w1, s1, w2, s2, top_k_index, top_k_weights, b1, b2, as1, as2, num_experts, activation, gated,
            interleaved, fp4, ue8m0, block_n, block_k, mode, config,
        )  # fmt: skip
    return torch.ops.selector.quant_experts(
        x, w1, s1, w2, s2, top_k_index, top_k_weights, b1, b2, as1, as2, num_experts, activation, gated,
        interleaved, fp4, ue8m0, block_n, block_k, mode, _encode(config),
    )  # fmt: skip


__all__ = ["MODES", "combine_in_kernel", "grouped_block_m", "max_blocks_for", "projection", "quant_experts",
           "quant_experts_impl", "route", "route_deferred", "use_tma"]
