"""Dispatch and combine of an expert-parallel layer over torch.distributed collectives (gloo or nccl).

Each forward takes this rank's local experts (an experts module holding E / world experts, ids 0..E/world-1,
marked expert-parallel so the id E/world is a sentinel that contributes nothing) and the global routing of this
rank's tokens, and returns this rank's output. The local experts run through `selector.dispatch.run_experts`, so
`auto` or a named backend picks the local kernel, for a problem that is expert-parallel.

The exchanges themselves (`*_exchange`) take the local computation as a function, so the benchmark can time the
dispatch and combine alone with a computation that does nothing.

Forward only: the collectives of `torch.distributed` carry no gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from selector import layers
from selector.dispatch import run_experts
from selector.validation import validate_inputs

# (rows [R, H], local ids [R, k] with the sentinel where not owned, weights [R, k]) -> weighted rows [R, H]
Compute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# torch 2.13 names the gather of equal chunks all_gather_single; older releases all_gather_into_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def local_share(
    index: torch.Tensor, weights: torch.Tensor, rank: int, per_rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(owned [T,k] bool, local ids with the sentinel `per_rank` where not owned, weights zeroed where not owned)."""
    first = rank * per_rank
    owned = (index >= first) & (index < first + per_rank)
    local = torch.where(owned, index - first, torch.full_like(index, per_rank))
    return owned, local, torch.where(owned, weights, torch.zeros_like(weights))


def _check(
    local: torch.nn.Module,
    hidden: torch.Tensor,
    index: torch.Tensor,
    weights: torch.Tensor,
    num_experts: int,
    world: int,
    seen: set[tuple[int, ...]] | None = None,
) -> int:
    """Experts per rank, after checking the global routing (ids in [0, E) or the sentinel E) and the local module.

    `seen`: the input shapes whose values were checked already (the GPU default checks values once per shape)."""
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
        hidden,
        index,
        weights,
        num_experts=num_experts,
        hidden_size=hidden.shape[-1] if hidden.dim() == 2 else -1,
        expert_parallel=True,
        seen=seen,
    )
    return per_rank


def experts_compute(local: torch.nn.Module, implementation: str | None = None) -> Compute:
    """The local experts as an exchange's computation (`run_experts` with the given backend or the module's own)."""

    def compute(rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return run_experts(local, rows, ids, weights, implementation)

    return compute


# --- all_to_all: exact splits, one host sync ------------------------------------------------------------------------


def all_to_all_exchange(
    group: dist.ProcessGroup | None,
    per_rank: int,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    compute: Compute,
) -> torch.Tensor:
    """Each token once to every rank owning one of its slots, `compute` there, the rows back, summed in rank order."""
    world = dist.get_world_size(group)
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
    sends, recvs = send_counts.tolist(), recv_counts.tolist()  # the one host sync of the layer
    received = sum(recvs)

    def exchange(rows: torch.Tensor, out_rows: int, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        out = rows.new_empty((out_rows, *rows.shape[1:]))
        dist.all_to_all_single(out, rows.contiguous(), out_splits, in_splits, group=group)
        return out

    recv_hidden = exchange(hidden_states[token], received, recvs, sends)
    recv_ids = exchange(local_ids, received, recvs, sends)
    recv_weights = exchange(send_weights, received, recvs, sends)
    if received:
        rows = compute(recv_hidden, recv_ids, recv_weights).to(hidden_states.dtype)
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


def all_to_all_forward(
    local: torch.nn.Module,
    group: dist.ProcessGroup | None,
    num_experts: int,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    implementation: str | None = None,
    *,
    seen: set[tuple[int, ...]] | None = None,
) -> torch.Tensor:
    """The layer's output for this rank's tokens, its experts spread over `group` by all-to-all exchanges.

    Each token goes once to every rank that owns one of its slots, with the local ids of that rank's slots (the
    sentinel elsewhere) and their weights; the owner runs its experts and sends the weighted rows back; the rows
    are added in rank order, so the result does not depend on timing. Token counts may differ between ranks.
    """
    per_rank = _check(local, hidden_states, top_k_index, top_k_weights, num_experts, dist.get_world_size(group), seen)
    compute = experts_compute(local, implementation)
    return all_to_all_exchange(group, per_rank, hidden_states, top_k_index, top_k_weights, compute)


# --- all_to_all_padded: equal splits at a fixed capacity, no host sync ----------------------------------------------


def check_capacity(group: dist.ProcessGroup | None, tokens: int, capacity: int | None, device: torch.device) -> int:
    """The capacity every rank pads to, after one exchange of (tokens, capacity) that proves the ranks agree.

    Raises ValueError on every rank alike (each sees every rank's numbers), so no rank is left waiting in a
    collective: equal splits of unequal buffers would read past them on nccl. One host sync: call it outside
    CUDA graphs and torch.compile, on every rank alike.
    """
    world = dist.get_world_size(group)
    mine = torch.tensor([tokens, -1 if capacity is None else capacity], dtype=torch.int64, device=device)
    every = mine.new_empty(world * 2)
    _all_gather(every, mine, group=group)
    pairs = every.view(world, 2).tolist()
    counts, capacities = [p[0] for p in pairs], [p[1] for p in pairs]
    if len(set(capacities)) > 1:
        raise ValueError(f"the ranks of the group pad to different capacities {capacities} (-1: none given): every "
                         "rank must pass the same capacity")
    if capacity is None:
        if len(set(counts)) > 1:
            raise ValueError(f"all_to_all_padded without a capacity needs the same token count on every rank, the "
                             f"ranks hold {counts}: pass capacity=max tokens per rank, or use all_to_all")
        return tokens
    if max(counts) > capacity:
        raise ValueError(f"a rank holds more tokens than the capacity {capacity} of all_to_all_padded: the ranks hold "
                         f"{counts}; pass a capacity of at least {max(counts)}")
    return capacity


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[R, n] of any dtype as [R, n * itemsize] uint8, the same memory (a bitcast, no conversion)."""
    return t.contiguous().view(torch.uint8)


def padded_exchange(
    group: dist.ProcessGroup | None,
    per_rank: int,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    compute: Compute,
    capacity: int | None = None,
) -> torch.Tensor:
    """Every rank's tokens, padded to `capacity` rows, to every rank in one gather; each rank runs `compute` on its
    experts' share of all of them and sends each source its rows back in one all-to-all of equal splits; the
    returned rows are summed in rank order. Shapes depend on the capacity only: nothing is read back to the host.

    `capacity`: the rows each rank pads to (at least every rank's token count; the same on every rank); None pads
    to this rank's token count, which every rank must then share.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    tokens, hidden = hidden_states.shape
    cap = tokens if capacity is None else capacity
    if tokens > cap:
        raise ValueError(f"{tokens} tokens do not fit the capacity {cap} of all_to_all_padded")
    pad = cap - tokens
    index, weights = top_k_index, top_k_weights
    x = hidden_states
    if pad:  # pad rows route every slot to the global sentinel: no rank computes them
        x = torch.cat([x, x.new_zeros((pad, hidden))])
        index = torch.cat([index, index.new_full((pad, index.shape[1]), per_rank * world)])
        weights = torch.cat([weights, weights.new_zeros((pad, weights.shape[1]))])
    # one row of bytes per token (hidden, ids, weights, each in its own dtype): one collective instead of three
    row = torch.cat([_as_bytes(x), _as_bytes(index), _as_bytes(weights)], dim=1)
    gathered = row.new_empty((world * cap, row.shape[1]))
    _all_gather(gathered, row, group=group)
    ends = (hidden * x.element_size(), index.shape[1] * index.element_size())
    g_hidden = gathered[:, : ends[0]].contiguous().view(x.dtype)
    g_index = gathered[:, ends[0] : ends[0] + ends[1]].contiguous().view(index.dtype)
    g_weights = gathered[:, ends[0] + ends[1] :].contiguous().view(weights.dtype)
    _, local_ids, local_weights = local_share(g_index, g_weights, rank, per_rank)
    if world * cap:
        rows = compute(g_hidden, local_ids, local_weights).to(hidden_states.dtype).contiguous()
    else:  # every rank holds no token: the collectives still take part
        rows = hidden_states.new_empty((0, hidden))
    back = torch.empty_like(rows)
    dist.all_to_all_single(back, rows, group=group)  # chunk r (rank r's tokens) to rank r
    return back.view(world, cap, hidden).sum(dim=0)[:tokens]


def all_to_all_padded_forward(
    local: torch.nn.Module,
    group: dist.ProcessGroup | None,
    num_experts: int,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    implementation: str | None = None,
    *,
    capacity: int | None = None,
    verify: bool = True,
    seen: set[tuple[int, ...]] | None = None,
) -> torch.Tensor:
    """The layer's output for this rank's tokens through the padded exchange (`padded_exchange`), capturable.

    `verify`: first prove that the ranks agree on the capacity (`check_capacity`, one host sync), skipped where a
    CUDA graph captures or torch.compile traces. Every rank must pass the same `verify`.
    """
    per_rank = _check(local, hidden_states, top_k_index, top_k_weights, num_experts, dist.get_world_size(group), seen)
    if verify and not _capturing(hidden_states):
        capacity = check_capacity(group, hidden_states.shape[0], capacity, hidden_states.device)
    compute = experts_compute(local, implementation)
    return padded_exchange(group, per_rank, hidden_states, top_k_index, top_k_weights, compute, capacity)


def _capturing(x: torch.Tensor) -> bool:
    return torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing())


# --- all_reduce: replicated tokens ----------------------------------------------------------------------------------


def all_reduce_exchange(
    group: dist.ProcessGroup | None,
    per_rank: int,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    compute: Compute,
) -> torch.Tensor:
    """Every rank's share of the same tokens (other ranks' slots as sentinels), summed over the group."""
    _, local_ids, local_weights = local_share(top_k_index, top_k_weights, dist.get_rank(group), per_rank)
    if hidden_states.shape[0]:
        out = compute(hidden_states, local_ids, local_weights).to(hidden_states.dtype).contiguous()
    else:
        out = hidden_states.new_zeros(hidden_states.shape)
    dist.all_reduce(out, group=group)
    return out


def all_reduce_forward(
    local: torch.nn.Module,
    group: dist.ProcessGroup | None,
    num_experts: int,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    implementation: str | None = None,
    *,
    seen: set[tuple[int, ...]] | None = None,
) -> torch.Tensor:
    """The layer's output when every rank of `group` holds the same tokens: each rank computes its own experts'
    share of every token (other ranks' slots as sentinels) and `all_reduce` sums the shares."""
    per_rank = _check(local, hidden_states, top_k_index, top_k_weights, num_experts, dist.get_world_size(group), seen)
    compute = experts_compute(local, implementation)
    return all_reduce_exchange(group, per_rank, hidden_states, top_k_index, top_k_weights, compute)


FORWARDS = {
    "all_to_all": all_to_all_forward,
    "all_to_all_padded": all_to_all_padded_forward,
    "all_reduce": all_reduce_forward,
}
EXCHANGES = {"all_to_all": all_to_all_exchange, "all_to_all_padded": padded_exchange, "all_reduce": all_reduce_exchange}

__all__ = [
    "EXCHANGES",
    "FORWARDS",
    "Compute",
    "all_reduce_exchange",
    "all_reduce_forward",
    "all_to_all_exchange",
    "all_to_all_forward",
    "all_to_all_padded_forward",
    "check_capacity",
    "experts_compute",
    "local_share",
    "padded_exchange",
]
