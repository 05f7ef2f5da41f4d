"""A whole quantised layer in the kernels: routing, x quantised once, the gate_up and down projections and the
combine, chosen per call from the resolved config (tiles.py); and the torch custom op around it."""

from __future__ import annotations

import dataclasses

import torch
from selector.plugins.quant_kernels import configs as _configs
from selector.plugins.quant_kernels.activation_quant import quantize_rows
from selector.plugins.quant_kernels.projection import Activations, Output, run_projection
from selector.plugins.quant_kernels.records import QuantLayer, QuantWeights, WeightFormat, quant_layer, up_epilogue
from selector.plugins.quant_kernels.routing import combine_slots, route_deferred
from selector.plugins.quant_kernels.tiles import combine_in_kernel, finish_split, grouped_tiles, resolve_config, use_tma
from selector.plugins.triton_common.align import run_align
from selector.plugins.triton_common.launch import cdiv

MODES = ("grouped", "batched")

# Defaults where a config does not say (configs.py: QUANT_X, ROUTE). x is quantised up front: on the H200 the
# in-loop variant lost in every decode cell tuned (it lengthens each K step of a latency-bound loop). One block
# per pair for a single token (its k experts are distinct, so nothing is read twice; the align launch is saved);
# with more tokens pairs share experts, and a pair block re-reads the expert (Mixtral T=8: 2.3x slower).

# With one block per pair (ROUTE "pairs": one token by default) the down GEMM adds the k slots itself unless a config
# says "COMBINE": "launch" (no combine launch; its counters and the output's zeros come with x's quantisation).
# Sorted blocks do so only where a config says "COMBINE": "kernel" (never on the TMA path): at T=8 on the H200 it
# was slower than the launch (Qwen3 / Qwen1.5 graph cells 0.63 -> 0.66-0.67 of bf16: each program counts
# its rows with serial atomics, and the last waits on its reads).
# Sorted blocks of >= TMA_MIN_BLOCK_M rows (large T) on sm_90+: x quantised straight into block order and both
# projections reading activations and weights through TMA descriptors (use_tma). On the H200 that took the
# T=4096 GEMMs from 420-500 to 550-650 TFLOP/s (docs/design/quant_kernels.md).
# Sorted blocks of up to triton_common.align.SINGLE_ALIGN_MAX pairs (decode) are routed by one more program of x's
# quantisation launch rather than an align launch of their own (``quantize_rows(align=)``).


def run_layer(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    layer: QuantLayer,
    mode: str,
    config: dict | None = None,
) -> torch.Tensor:
    """The whole layer in the kernels: [T, H] out in x's dtype."""
    up_proj, down_proj = layer.up_projection, layer.down_projection
    up, down, fmt, epi = up_proj.weights, down_proj.weights, up_proj.fmt, up_proj.epilogue
    num_experts, fp4, block_k = fmt.num_experts, fmt.fp4, fmt.block_k
    gated, interleaved = epi.gated, epi.interleaved
    w1, w2 = up.w, down.w
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
    # batched, or static scales (per expert: x cannot be quantised up front)
    if cfg is None or up.act_scale is not None:
        if pending is not None:
            run_align(pending)
        nested = cfg or _configs.normalize(config)  # the op hands batched configs over nested too (configs.decode)
        c1, c2 = nested["gate_up"], nested["down"]
        inter = run_projection(mode, up_proj, Activations(x, a_div=top_k), routing, n_pairs, config=c1)
        y = run_projection(mode, down_proj, Activations(inter), routing, n_pairs, topk_w=wts, config=c2)
        return combine_slots(y, ids, out, top_k, num_experts)
    # grouped, dynamic: x quantised once up front, or (config QUANT_X "loop") inside gate_up's K loop; the gate_up
    # epilogue quantises the intermediate when its tile covers whole groups, else a second quantize_rows does
    bn1, up_tiles = grouped_tiles(routing, inter_dim, x.device, cfg["gate_up"], gated)
    up_cfg = {**cfg["gate_up"], "BLOCK_N": bn1}
    up_counts = up_tiles if finish_split(mode, up_cfg, h, block_k) > 1 else 0
    once = (cfg.get("QUANT_X") or "once") == "once"
    bn2 = grouped_tiles(routing, h, x.device, cfg["down"], False)[0]
    tile_rows = max(2 * bn1 if interleaved else bn1, bn2, block_k)
    tma = once and use_tma(routing, fp4, x.device, w1, w2, tile_rows=tile_rows)
    fused = combine_in_kernel(routing, cfg) and not tma
    down_counts = t * cdiv(h, bn2) if fused else 0
    n_counts = up_counts + down_counts
    counts = torch.empty(n_counts, dtype=torch.int32, device=x.device) if n_counts else None
    # a one-program align rides on x's quantisation launch (decode), unless that launch needs its result (TMA)
    ride = pending if pending is not None and pending.single and once and not tma else None
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
    up_counts_of = counts[:up_counts] if n_counts else None
    inter = run_projection(
        mode,
        up_proj,
        Activations(xq, xs, top_k, tma),
        routing,
        n_pairs,
        config=up_cfg,
        dest=Output(x.dtype, quant_out, tma, counts=up_counts_of),
    )
    iq, isc = inter if quant_out else quantize_rows(inter, block_k, slots=routing if tma else None)
    if down.act_scale is not None:  # dynamic activations: the down projection has no static scale to read
        down_proj = dataclasses.replace(down_proj, weights=dataclasses.replace(down, act_scale=None))
    src = Activations(iq, isc, 1, tma)
    if fused:
        dest = Output(x.dtype, combine=(out, ids, top_k), counts=counts[up_counts:])
        return run_projection(mode, down_proj, src, routing, n_pairs, topk_w=wts, config=cfg["down"], dest=dest)
    y = run_projection(mode, down_proj, src, routing, n_pairs, topk_w=wts, config=cfg["down"], dest=Output(x.dtype))
    return combine_slots(y, ids, out, top_k, num_experts)


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
    # a custom op's schema is flat tensors and scalars: the records are built again from them
    up, down = QuantWeights(w1, s1, b1, as1), QuantWeights(w2, s2, b2, as2)
    fmt = WeightFormat(num_experts, fp4, ue8m0, block_n, block_k)
    layer = quant_layer(up, down, fmt, up_epilogue(up, activation=activation, gated=gated, interleaved=interleaved))
    return run_layer(x, top_k_index, top_k_weights, layer, mode, _decode(config))


@_quant_experts_op.register_fake
def _(
    x,
    w1,
    s1,
    w2,
    s2,
    top_k_index,
    top_k_weights,
    b1,
    b2,
    as1,
    as2,
    num_experts,
    activation,
    gated,
    interleaved,
    fp4,
    ue8m0,
    block_n,
    block_k,
    mode,
    config,
):
    return x.new_empty(x.shape)


def layer_forward(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    layer: QuantLayer,
    mode: str,
    config: dict | None = None,
) -> torch.Tensor:
    """The whole layer through the custom op ``selector::quant_experts`` under torch.compile (see the module
    docstring); in eager mode (and CUDA-graph capture) the same implementation directly: the op's dispatcher and
    its aliasing check cost ~130 us of host time per call on the H200 machine (measured, Qwen3 T=512: 389 us per
    call against 257 us of kernels), as triton_fused found for its own op."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: expected one of {MODES}")
    # not when autograd records: through the op a backward fails loudly instead of dropping x's gradient
    if not torch.compiler.is_compiling() and not (torch.is_grad_enabled() and x.requires_grad):
        return run_layer(x, top_k_index, top_k_weights, layer, mode, config)
    # a custom op's schema is flat tensors and scalars: the record is unpacked into it
    up, down, fmt, epi = layer.up, layer.down, layer.fmt, layer.up_epilogue
    return torch.ops.selector.quant_experts(
        x,
        up.w,
        up.s,
        down.w,
        down.s,
        top_k_index,
        top_k_weights,
        up.bias,
        down.bias,
        up.act_scale,
        down.act_scale,
        fmt.num_experts,
        epi.activation,
        epi.gated,
        epi.interleaved,
        fmt.fp4,
        fmt.ue8m0,
        fmt.block_n,
        fmt.block_k,
        mode,
        _encode(config),
    )
