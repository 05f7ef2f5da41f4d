"""One quantised projection for every (token, slot) pair: the grouped (expert blocks, tensor-core fp8 dots) and
batched (one pair per program) launchers of plugins/quant_kernels/kernels.py."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton.language as tl
from selector.plugins.quant_kernels import kernels as K
from selector.plugins.quant_kernels.records import Projection
from selector.plugins.quant_kernels.tiles import TMA_MAX_BOX, finish_split, gemm_config, split_k, use_tma
from selector.plugins.triton_common.activation import ACT_CODE
from selector.plugins.triton_common.launch import INTERPRET, TensorDescriptor, cdiv, launch, next_pow2

_TL_DTYPES = {
    torch.float32: tl.float32,
    torch.bfloat16: tl.bfloat16,
    torch.float16: tl.float16,
    torch.float8_e4m3fn: tl.float8e4nv,
}


def _scale_strides(s: torch.Tensor) -> tuple[int, int, int]:
    return s.stride(0), s.stride(1), s.stride(2)


def _launch(
    mode: str,
    proj: Projection,
    src: Activations,
    out: torch.Tensor,
    routing: tuple[torch.Tensor, ...],
    topk_w: torch.Tensor | None,
    *,
    config: dict | None,
    dest: Output,
    out_scale: torch.Tensor | None,
    inter_dtype: torch.dtype | None,
    finish_split: int,
    num_pairs: int,
) -> None:
    """One launch of the grouped or batched kernel. `dest.combine` (grouped, linear epilogue): (out [T, N], ids
    [T * k], k); `out` here is then the kernel's [shares, pairs, N] fp32 scratch. `dest.counts`: zeroed int32
    counters for FINISH / COMBINE (else torch.zeros). `src.sorted`: a in block order, a and w through TMA
    descriptors; `dest.sorted`: rows stored in block order."""
    # The kernels' signatures stay flat (Triton's rule): the records are unpacked into their arguments here.
    weights, fmt, epilogue = proj.weights, proj.fmt, proj.epilogue
    a, a_div, a_scale, a_sorted = src.a, src.a_div, src.scale, src.sorted
    combine, counts, out_sorted = dest.combine, dest.counts, dest.sorted
    w, s, bias, act_scale = weights.w, weights.s, weights.bias, weights.act_scale
    num_experts, fp4, ue8m0, block_n_w, block_k = fmt.num_experts, fmt.fp4, fmt.ue8m0, fmt.block_n, fmt.block_k
    gated, interleaved, act = epilogue.gated, epilogue.interleaved, ACT_CODE[epilogue.activation]
    c = w.shape[1]
    k_dim = w.shape[2] * (2 if fp4 else 1)
    n_out = c // 2 if gated else c
    up_offset = c // 2 if gated else 0
    if epilogue.split_inter is not None and not fp4:
        n_split, split_rows = epilogue.split_inter, cdiv(epilogue.split_inter, block_n_w)
    else:
        n_split, split_rows = c, 0
    static = act_scale is not None
    has_bias = bias is not None
    s = s.view(torch.uint8) if ue8m0 and s.dtype != torch.uint8 else s
    common = dict(
        FP4=fp4,
        UE8M0=ue8m0,
        STATIC=static,
        GATED=gated,
        INTERLEAVED=interleaved and gated,
        ACT=act,
        HAS_BIAS=has_bias,
        MUL_W=topk_w is not None,
        EXACT=INTERPRET,
    )
    final = combine[0] if combine is not None else out  # what the kernel stores its results to
    strides = (
        a.stride(0),
        a.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        *_scale_strides(s),
        bias.stride(0) if has_bias else 0,
        bias.stride(1) if has_bias else 0,
        final.stride(-2),
        final.stride(-1),
    )
    wide = gated
    if mode == "grouped":
        sorted_rows, block_expert, bm = routing
        num_blocks_m = block_expert.numel()
        cfg = gemm_config(mode, num_blocks_m * bm, n_out, a.device, {**(config or {}), "BLOCK_M": bm}, wide)
        bn = cfg["BLOCK_N"]
        split = out.shape[0] if out.dim() == 3 else 1  # split K: [shares, pairs, N] fp32 partial sums
        # a tile of stored channels (2 x BLOCK_N interleaved) starts at a multiple of its width: when that width
        # divides the scale block's, the tile lies in one scale row, unless it straddles the up half's start
        # (scale blocks restart there): a gated tile never does; a plain one over [gate | up] can
        # through TMA a concatenated gate_up tile is one box of its gate rows and its up rows (PAIRED): one dot
        paired = a_sorted and gated and not interleaved
        tile_c = 2 * bn if gated and (interleaved or paired) else bn
        straddles = not gated and n_split < w.shape[1] and n_split % tile_c != 0
        one_row = not fp4 and block_n_w % (bn if paired else tile_c) == 0 and not straddles
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
            if paired:  # [2E, C / 2, K]: an expert's gate half, then its up half
                w_desc = TensorDescriptor.from_tensor(w.view(2 * w.shape[0], c // 2, w.shape[2]), [2, bn, block_k])
            else:
                w_desc = TensorDescriptor.from_tensor(w.view(-1, w.shape[2]), [tile_c, block_k])
        num_valid_pairs = num_pairs
        # MAX_IMPRECISE=0: the fp8 dots keep the tensor core's own accumulation within each K tile
        launch(
            K._grouped_kernel,
            grid,
            (
                a,
                w,
                s,
                act_scale if static else s,
                bias if has_bias else s,
                final,
                block_expert if sorted_rows is None else sorted_rows,
                block_expert,
                topk_w if topk_w is not None else s,
                a_s,
                o_s,
                part,
                count,
                ids,
                a_desc,
                w_desc,
                w.shape[1],
                num_valid_pairs,
                num_experts,
                n_out,
                k_dim,
                a_div,
                num_blocks_m,
                up_offset,
                n_split,
                split_rows,
                block_n_w,
                top_k,
                *strides,
                a_s.stride(0) if a_scale is not None else 0,
                o_s.stride(0) if out_scale is not None else 0,
                out.stride(0) if out.dim() == 3 and combine is None else 0,
            ),
            dict(
                BLOCK_M=bm,
                BLOCK_N=bn,
                BLOCK_K=block_k,
                GROUP_M=cfg["GROUP_M"],
                **common,
                A_FP8=a_scale is not None,
                QUANT_OUT=out_scale is not None,
                INTER_DTYPE=_TL_DTYPES[inter_dtype or a.dtype],
                PAIR_BLOCKS=sorted_rows is None,
                SPLIT_K=split,
                MAX_IMPRECISE=0,
                ONE_SCALE_ROW=one_row,
                FINISH=finish_split > 1,
                PART_W=tile_c,
                COMBINE=combine is not None,
                K_PAD=next_pow2(top_k),
                TMA=a_sorted,
                SORTED_OUT=out_sorted,
                SWAP=bool(cfg.get("SWAP")),
                PAIRED=paired,
            ),
            cfg["num_warps"],
            cfg["num_stages"],
        )
    else:
        (ids,) = routing
        cfg = gemm_config(mode, ids.numel(), n_out, a.device, config, wide)
        bn = cfg["BLOCK_N"]
        grid = (ids.numel(), cdiv(n_out, bn))
        launch(
            K._rows_kernel,
            grid,
            (
                a,
                w,
                s,
                act_scale if static else s,
                bias if has_bias else s,
                out,
                ids,
                topk_w if topk_w is not None else s,
                num_experts,
                n_out,
                k_dim,
                a_div,
                up_offset,
                n_split,
                split_rows,
                block_n_w,
                *strides,
            ),
            dict(BLOCK_N=bn, BLOCK_K=block_k, **common),
            cfg["num_warps"],
            cfg["num_stages"],
        )


@dataclass(frozen=True, slots=True)
class Activations:
    """A projection's input: `a` [rows, K], pair p reading row p // `a_div`; e4m3 with its per-group `scale`
    (``quantize_rows``), else in the compute dtype; `sorted`: one row per block slot in block order (sorted routing,
    fp8 weights, a `scale`; see ``use_tma``), read with the weights through TMA descriptors."""

    a: torch.Tensor
    scale: torch.Tensor | None = None
    a_div: int = 1
    sorted: bool = False


@dataclass(frozen=True, slots=True)
class Output:
    """What a projection returns. `dtype`: its rows' (default: the input's, bfloat16 for e4m3 input);
    `quantised` (grouped mode, BLOCK_N a multiple of block_k): (e4m3 rows, scales), rounded to `dtype` and quantised
    per row and block_k channels; `sorted` (sorted routing, no K split): one row per block slot in block order, the
    layout a following `Activations(sorted=True)` reads (padding slots hold finite values, unused blocks' rows
    nothing); `combine` (grouped, linear epilogue with the routing weight): (out [T, N], ids [T * k], k): the kernel
    adds each token's k slots into out itself (``kernels._combine_rows``; out must hold zeros where a token has no
    valid slot) and out is returned; `counts`: int32 zeros for the kernel's counters (FINISH / COMBINE; None:
    allocated and zeroed here, one more launch)."""

    dtype: torch.dtype | None = None
    quantised: bool = False
    sorted: bool = False
    combine: tuple[torch.Tensor, torch.Tensor, int] | None = None
    counts: torch.Tensor | None = None


PLAIN = Output()


def run_projection(
    mode: str,
    proj: Projection,
    src: Activations,
    routing: tuple[torch.Tensor, ...],
    num_pairs: int,
    *,
    topk_w: torch.Tensor | None = None,
    config: dict | None = None,
    dest: Output = PLAIN,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One projection for every (token, slot) pair -> [num_pairs, N] (N = I when gated, else C); with K split
    (grouped, linear epilogue: config SPLIT_K or the decode heuristic) [shares, num_pairs, N] fp32 partial sums.
    Other epilogues split K only where the config asks (``finish_split``) and still return whole results.
    Sentinel pairs' rows are left unwritten (the combine skips them). `topk_w`: each row times its routing
    weight; `dest`: see ``Output``."""
    a, a_scale = src.a, src.scale
    w, fp4, block_k = proj.weights.w, proj.fmt.fp4, proj.fmt.block_k
    gated, activation = proj.epilogue.gated, proj.epilogue.activation
    combine, quant_out = dest.combine, dest.quantised
    c = w.shape[1]
    k_dim = w.shape[2] * (2 if fp4 else 1)
    n_out = c // 2 if gated else c
    inter_dtype = dest.dtype or (a.dtype if a_scale is None else torch.bfloat16)
    linear = not (gated or quant_out) and activation == "none"  # partial sums only add up through a linear epilogue
    if combine is not None and not (mode == "grouped" and linear and topk_w is not None and not dest.sorted):
        raise ValueError(
            "quantised experts: only a grouped projection with a linear, weighted epilogue whose rows are "
            "stored per pair (not out_sorted) combines in the kernel"
        )
    sorted_route = mode == "grouped" and routing[0] is not None
    if src.sorted and not (
        sorted_route
        and a_scale is not None
        and a.shape[0] == a_scale.shape[0] == routing[0].numel()
        and use_tma(routing, fp4, a.device, w, tile_rows=block_k)
    ):
        raise ValueError(
            "quantised experts: a_sorted needs e4m3 a and its scales in block order and weights TMA can read (use_tma)"
        )
    split = split_k(mode, config, routing, n_out, k_dim, block_k, a.device) if linear else 1
    finish = 1 if linear else finish_split(mode, config, k_dim, block_k)
    if dest.sorted and not (sorted_route and combine is None and split == 1):
        raise ValueError("quantised experts: out_sorted needs sorted blocks and no K split")
    rows_out = routing[0].numel() if dest.sorted else num_pairs
    if combine is not None or split > 1:  # fp32 rows per K share, added by the kernel's last arrivals or combine_slots
        out = torch.empty((split, num_pairs, n_out), dtype=torch.float32, device=a.device)
    else:
        out = torch.empty((rows_out, n_out), dtype=torch.float8_e4m3fn if quant_out else inter_dtype, device=a.device)
    out_scale = None
    if quant_out:
        out_scale = torch.empty((rows_out, cdiv(n_out, block_k)), dtype=torch.float32, device=a.device)
    if num_pairs == 0 or n_out == 0:
        return combine[0] if combine is not None else (out, out_scale) if quant_out else out
    _launch(
        mode,
        proj,
        src,
        out,
        routing,
        topk_w,
        config=config,
        dest=dest,
        out_scale=out_scale,
        inter_dtype=inter_dtype,
        finish_split=finish,
        num_pairs=num_pairs,
    )
    if combine is not None:
        return combine[0]
    return (out, out_scale) if quant_out else out
