"""Mega MoE adapter: prepare FP4 weights once, keep one symmetric buffer per (group, shape), call the kernel.

Module convention (Transformers' FP8/FP4 experts): `gate_up_proj` int8-packed FP4 [E_local, 2I, H/2] with
`gate_up_proj_scale_inv` UE8M0 [E_local, 2I, H/32]; `down_proj` [E_local, H, I/2] with `down_proj_scale_inv`
[E_local, H, I/32]. The kernel's weight layout (interleaved gate/up, packed scales transposed for UTCCP) is
built at prepare time and held by the plan beside the parameters, which stay as they are, so switching to
another backend later still works (at the price of a second copy of the expert weights).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from selector.plugins.adapter import KernelPlan, forward_of
from selector.plugins.deepgemm.forward import DeepGemm, load_deepgemm

from selector import layers
from selector.guard import sanitize_routing
from selector.types import ExpertsForward, Problem

MEGA_SYMBOLS = (
    "transform_sf_into_required_layout",
    "transform_weights_for_mega_moe",
    "get_symm_buffer_for_mega_moe",
    "fp8_fp4_mega_moe",
)
# symmetric buffers by group name, then shape: allocating one is a collective, so layers of a group share it
_BUFFERS: dict[str, dict[tuple[int, ...], object]] = {}


def destroy_buffers() -> None:
    """Free every symmetric buffer; call it on every rank before destroying the process groups."""
    for per_group in _BUFFERS.values():
        for buffer in per_group.values():
            buffer.destroy()
    _BUFFERS.clear()


def process_group(module: torch.nn.Module):  # noqa: ANN201
    """The module's EP group, or a world of one; ValueError when neither exists."""
    group = getattr(module, "selector_process_group", None)
    if group is not None:
        return group
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1:
        return dist.group.WORLD
    if layers.is_expert_parallel(module) or (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "experts backend 'deepgemm_megamoe' with expert parallelism (EP size > 1) needs its EP process group: "
            "set module.selector_process_group to it. fix: or pick deepgemm."
        )
    raise ValueError(
        "experts backend 'deepgemm_megamoe' rendezvous its symmetric buffer over a torch.distributed process "
        "group and none is initialised. fix: torch.distributed.init_process_group (a world of one is enough on a "
        "single GPU), or pick deepgemm."
    )


def _check_weights(module: torch.nn.Module, problem: Problem) -> None:
    if "hidden_states" in problem.call.grad_inputs:
        raise ValueError("experts backend 'deepgemm_megamoe' has no backward. fix: run under torch.no_grad().")
    if module.gate_up_proj.dtype != torch.int8:
        raise ValueError(
            f"experts backend 'deepgemm_megamoe' runs FP4 expert weights (int8-packed), got {module.gate_up_proj.dtype}. "
            "fix: load an FP4 checkpoint, or pick deepgemm for FP8 experts."
        )
    for name in ("gate_up_proj_scale_inv", "down_proj_scale_inv"):
        scale = getattr(module, name, None)
        if scale is None or scale.dtype != torch.float8_e8m0fnu:
            got = "none" if scale is None else scale.dtype
            raise ValueError(
                f"experts backend 'deepgemm_megamoe' reads UE8M0 scales (float8_e8m0fnu), {name} is {got}. "
                "fix: use a checkpoint quantised with UE8M0 scales, or pick grouped_mm."
            )


def kernel_weights(module: torch.nn.Module, dg_module: object) -> tuple[tuple, tuple]:
    """((w1, sf1), (w2, sf2)) in the kernel's layout."""
    experts, two_inter = module.gate_up_proj.shape[:2]
    inter, hidden = two_inter // 2, module.down_proj.shape[1]
    if hidden % 128 or inter % 128:
        raise ValueError(f"Mega MoE needs hidden and intermediate sizes divisible by 128, got {hidden} and {inter}")
    to_layout = dg_module.transform_sf_into_required_layout
    sf1 = to_layout(module.gate_up_proj_scale_inv.float(), two_inter, hidden, recipe=(1, 32), num_groups=experts)
    sf2 = to_layout(module.down_proj_scale_inv.float(), hidden, inter, recipe=(1, 32), num_groups=experts)
    return dg_module.transform_weights_for_mega_moe(
        (module.gate_up_proj.contiguous(), sf1), (module.down_proj.contiguous(), sf2)
    )


def _buffer(dg_module: object, group, hidden: int, top_k: int, experts: int, inter: int, tokens: int):  # noqa: ANN001,ANN202
    per_group = _BUFFERS.setdefault(str(getattr(group, "group_name", id(group))), {})
    key = (hidden, top_k, experts, inter)
    buffer = per_group.get(key)
    if buffer is None or buffer.num_max_tokens_per_rank < tokens:
        if buffer is not None:  # a larger batch: free the old one once no rank reads it
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            torch.distributed.barrier(group=group)
            buffer.destroy()
        buffer = dg_module.get_symm_buffer_for_mega_moe(
            group, num_experts=experts, num_max_tokens_per_rank=tokens, num_topk=top_k, hidden=hidden,
            intermediate_hidden=inter,
        )
        per_group[key] = buffer
    return buffer


@dataclass(frozen=True, kw_only=True)
class MegaMoEPlan(KernelPlan):
    dg: DeepGemm

    def launch(self, module: torch.nn.Module, weights: tuple, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
               top_k_weights: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """top_k_index: global expert ids."""
        group = process_group(module)  # read per call: the module's group may be set after the first forward
        (w1, sf1), (w2, sf2) = weights
        (num_tokens, top_k), hidden = top_k_index.shape, hidden_states.shape[-1]
        experts = module.gate_up_proj.shape[0] * group.size()
        inter = module.gate_up_proj.shape[1] // 2
        dg = self.dg
        buffer = _buffer(dg.module, group, hidden, top_k, experts, inter, num_tokens)

        x, x_sf = dg.per_token_cast_to_fp8(hidden_states.to(torch.bfloat16), use_ue8m0=True, gran_k=32,
                                           use_packed_ue8m0=True)  # fmt: skip
        sentinel = module.num_experts if group.size() == 1 else experts
        # the routing guard over the ids the kernel reads (global across the group): a bad id -> expert 0 with
        # weight NaN (the kernel's weighted sum turns that token's row NaN; it would read any other id as an expert
        # or a rank), recorded and raised at the next call or selector.check(); the sentinel stays a sentinel
        if top_k_index.is_cuda:  # the one-launch Triton sanitiser (registered on import)
            import selector.plugins.triton_common.guard  # noqa: F401
        top_k_index, top_k_weights = sanitize_routing(module, top_k_index, top_k_weights, num_experts=sentinel)
        ids = top_k_index.to(torch.int64)
        ids = ids.masked_fill(ids >= sentinel, -1)  # the kernel skips -1 slots
        buffer.x[:num_tokens].copy_(x)
        buffer.x_sf[:num_tokens].copy_(x_sf)
        buffer.topk_idx[:num_tokens].copy_(ids)
        buffer.topk_weights[:num_tokens].copy_(top_k_weights)
        y = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=hidden_states.device)
        clamp = getattr(getattr(module, "config", None), "swiglu_limit", None)
        dg.module.fp8_fp4_mega_moe(y, (w1, sf1), (w2, sf2), buffer, activation_clamp=clamp)
        return y.to(hidden_states.dtype)


def prepare(module: torch.nn.Module, problem: Problem) -> KernelPlan:
    """The weights and the group checked, the kernel loaded and the weights in its layout, once per weights and
    call mode."""
    _check_weights(module, problem)
    process_group(module)
    dg = load_deepgemm(MEGA_SYMBOLS)
    convert = functools.partial(kernel_weights, dg_module=dg.module)
    return MegaMoEPlan.prepared(module, convert, False, backend="deepgemm_megamoe", dg=dg)


megamoe_experts_forward = forward_of(prepare)


def load() -> ExpertsForward:
    return megamoe_experts_forward
