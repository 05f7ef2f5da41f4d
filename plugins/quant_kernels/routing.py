"""Routing for the quantised paths: pairs grouped by expert (``triton_common.align``), one block per pair, or
one pair per program (batched); and the deterministic combine of each token's slots."""

from __future__ import annotations

import torch
from selector.plugins.quant_kernels.tiles import grouped_block_m
from selector.plugins.triton_common.align import AlignPlan, plan_align, run_align
from selector.plugins.triton_common.combine import combine
from selector.plugins.triton_common.launch import INTERPRET


def route(
    mode: str, ids_flat: torch.Tensor, num_experts: int, config: dict | None = None, top_k: int | None = None
) -> tuple[torch.Tensor, ...]:
    """grouped: (sorted_rows, block_expert, BLOCK_M) from the fused backend's align, or (None, ids, 16): one
    block per pair, no align launch (configs.py: ROUTE; by default for one token's `top_k` pairs); batched: (ids,)."""
    routing, plan = route_deferred(mode, ids_flat, num_experts, config, top_k)
    if plan is not None:
        run_align(plan)
    return routing


def route_deferred(
    mode: str, ids_flat: torch.Tensor, num_experts: int, config: dict | None = None, top_k: int | None = None
) -> tuple[tuple[torch.Tensor, ...], AlignPlan | None]:
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


def combine_slots(y: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, top_k: int, num_experts: int) -> torch.Tensor:
    """The fused backend's combine into `out`; under the interpreter through fp32 (its bf16/fp16 cast is wrong)."""
    if INTERPRET and out.dtype != torch.float32:
        wide = torch.empty(out.shape, dtype=torch.float32, device=out.device)
        combine(y, ids, wide, top_k, num_experts)
        return out.copy_(wide)
    combine(y, ids, out, top_k, num_experts)
    return out
