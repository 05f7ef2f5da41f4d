"""Dispatch and combine of an expert-parallel layer over torch.distributed collectives (gloo or nccl).

Both functions take this rank's local experts (an experts module holding E / world experts, ids 0..E/world-1,
marked expert-parallel so the id E/world is a sentinel that contributes nothing) and the global routing of this
rank's tokens, and return this rank's output. The local experts run through `selector.dispatch.run_experts`, so
`auto` or a named backend picks the local kernel, for a problem that is expert-parallel.

Forward only: the collectives of `torch.distributed` carry no gradient.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from selector import layers
from selector.dispatch import run_experts
from selector.validation import validate_inputs


def _local_share(
    index: torch.Tensor, weights: torch.Tensor, rank: int, per_rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(owned [T,k] bool, local ids with the sentinel `per_rank` where not owned, weights zeroed where not owned)."""
    first = rank * per_rank
    owned = (index >= first) & (index < first + per_rank)
    local = torch.where(owned, index - first, torch.full_like(index, per_rank))
    return owned, local, torch.where(owned, weights, torch.zeros_like(weights))


def _check(
    local: torch.nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, num_experts: int,
    world: int,
) -> int:  # fmt: skip
    """Experts per rank, after checking the global routing (ids in [0, E) or the sentinel E) and the local module."""
    if num_experts % world:
        raise ValueError(f"{world} ranks cannot share {num_experts} experts evenly: the group's size must divide E")
    per_rank = num_experts // world
    held = layers.dims(local)[0]
    if held != per_rank:
        raise ValueError(
            f"the local experts module holds {held} experts; with {num_experts} experts over {world} ranks each "
            f"rank holds {per_rank}"
        )
    if not layers.is_expert_parallel(local):
        raise ValueError("the local experts module must be marked expert-parallel (module._is_expert_parallel = True)")
    validate_inputs(
        hidden, index, weights, num_experts=num_experts, hidden_size=hidden.shape[-1] if hidden.dim() == 2 else -1,
        expert_parallel=True,
    )  # fmt: skip
    return per_rank


def all_to_all_forward(
    local: torch.nn.Module,
    group: dist.ProcessGroup | None,
    num_experts: int,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    implementation: str | None = None,
) -> torch.Tensor:
    """The layer's output for this rank's tokens, its experts spread over `group` by all-to-all exchanges.

    Each token goes once to every rank that owns one of its slots, with the local ids of that rank's slots (the
    sentinel elsewhere) and their weights; the owner runs its experts and sends the weighted rows back; the rows
    are added in rank order, so the result does not depend on timing. Token counts may differ between ranks.
    """
    world = dist.get_world_size(group)
    per_rank = _check(local, hidden_states, top_k_index, top_k_weights, num_experts, world)
    tokens, hidden = hidden_states.shape
    device = hidden_states.device
    owner = torch.div(top_k_index, per_rank, rounding_mode="floor")  # the sentinel E lands on `world`: no one
    ranks = torch.arange(world, device=device).view(world, 1, 1)
    hits = owner.unsqueeze(0) == ranks  # [world, T, k]
    to_rank, token = hits.any(dim=2).nonzero(as_tuple=True)  # grouped by rank, tokens ascending within a rank
    slot_hits = hits[to_rank, token]  # [S, k]
    local_ids = torch.where(slot_hits, top_k_index[token] - to_rank.unsqueeze(1) * per_rank, per_rank)
    zero = torch.zeros((), dtype=top_k_weights.dtype, device=device)
    send_weights = torch.where(slot_hits, top_k_weights[token], zero)
    send_counts = torch.bincount(to_rank, minlength=world).to(torch.int64)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    sends, recvs = send_counts.tolist(), recv_counts.tolist()
    received = sum(recvs)

    def exchange(rows: torch.Tensor, out_rows: int, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        out = rows.new_empty((out_rows, *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    recv_hidden = exchange(hidden_states[token], received, recvs, sends)
    recv_ids = exchange(local_ids, received, recvs, sends)
    recv_weights = exchange(send_weights, received, recvs, sends)
    if received:
        rows = run_experts(local, recv_hidden, recv_ids, recv_weights, implementation).to(hidden_states.dtype)
    else:  # no token of any rank routed here: nothing to run, the collectives still take part
        rows = hidden_states.new_empty((0, hidden))
    back = exchange(rows, token.numel(), sends, recvs)
    out = hidden_states.new_zeros((tokens, hidden))
    start = 0
    for count in sends:  # rank order: each token appears at most once per rank, so each step is a plain add
        if count:
            out[token[start : start + count]] += back[start : start + count]
        start += count
    return out


def all_reduce_forward(
    local: torch.nn.Module,
    group: dist.ProcessGroup | None,
    num_experts: int,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    implementation: str | None = None,
) -> torch.Tensor:
    """The layer's output when every rank of `group` holds the same tokens: each rank computes its own experts'
    share of every token (other ranks' slots as sentinels) and `all_reduce` sums the shares."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    per_rank = _check(local, hidden_states, top_k_index, top_k_weights, num_experts, world)
    _, local_ids, local_weights = _local_share(top_k_index, top_k_weights, rank, per_rank)
    if hidden_states.shape[0]:
        out = run_experts(local, hidden_states, local_ids, local_weights, implementation).to(hidden_states.dtype)
        out = out.contiguous()
    else:
        out = hidden_states.new_zeros(hidden_states.shape)
    dist.all_reduce(out, group=group)
    return out


FORWARDS = {"all_to_all": all_to_all_forward, "all_reduce": all_reduce_forward}

__all__ = ["FORWARDS", "all_reduce_forward", "all_to_all_forward"]
