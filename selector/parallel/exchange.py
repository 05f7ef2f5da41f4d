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

from selector import guard, layers
from selector.dispatch import run_experts
from selector.parallel.status import (
    COUNTS,
    Agreement,
    ExpertParallelError,
    Statement,
    check_capacity,
    poison_mask,
    run,
)
from selector.validation import validate_inputs, validation_level

# (rows [R, H], local ids [R, k] with the sentinel where not owned, weights [R, k]) -> weighted rows [R, H]
Compute = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

# torch 2.13 names the gather of equal chunks all_gather_single; older releases all_gather_into_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _level(x: torch.Tensor) -> str:
    return validation_level(on_gpu=x.device.type != "cpu")


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
    level: str = "shapes",
) -> int:
    """Experts per rank, after checking the shapes and dtypes of the global routing and the local module.

    The values (ids in [0, E] -- E the global sentinel --, finite weights) are not read here: eager calls count
    them on the device and every rank learns every rank's counts in the status exchange (`Agreement`), so all
    raise together; captured calls poison their rows (`poison_mask`). `level`: "off" checks nothing of the inputs.
    `seen`: the input signatures checked already."""
    if num_experts % world:
        raise ValueError(f"{world} ranks cannot share {num_experts} experts evenly: the group's size must divide E")
    per_rank = num_experts // world
    held, hidden_size, _ = layers.dims(local)
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
        hidden_size=hidden_size,  # the local experts' (a rank whose rows were wider would abort the exchange)
        expert_parallel=True,
        level="off" if level == "off" else "shapes",
        seen=seen,
    )
    return per_rank


def experts_compute(local: torch.nn.Module, implementation: str | None = None) -> Compute:
    """The local experts as an exchange's computation (`run_experts` with the given backend or the module's own)."""

    def compute(rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return run_experts(local, rows, ids, weights, implementation)

    return compute


# --- all_to_all: exact splits, one host sync ------------------------------------------------------------------------


def _route(
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, per_rank: int, world: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(token, local ids, weights, destination of each sent row, rows per destination): every token once to each
    rank owning one of its slots, grouped by rank with tokens ascending. Ids outside [0, E) land on no rank."""
    device = top_k_index.device
    owner = torch.div(top_k_index, per_rank, rounding_mode="floor")  # the sentinel E lands on `world`: no one
    ranks = torch.arange(world, device=device).view(world, 1, 1)
    hits = owner.unsqueeze(0) == ranks  # [world, T, k]
    to_rank, token = hits.any(dim=2).nonzero(as_tuple=True)  # grouped by rank, tokens ascending within a rank
    slot_hits = hits[to_rank, token]  # [S, k]
    local_ids = torch.where(slot_hits, top_k_index[token] - to_rank.unsqueeze(1) * per_rank, per_rank)
    zero = torch.zeros((), dtype=top_k_weights.dtype, device=device)
    send_weights = torch.where(slot_hits, top_k_weights[token], zero)
    return token, local_ids, send_weights, to_rank, torch.bincount(to_rank, minlength=world).to(torch.int64)


def all_to_all_exchange(
    group: dist.ProcessGroup | None,
    per_rank: int,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    compute: Compute,
    agreement: Agreement | None = None,
) -> torch.Tensor:
    """Each token once to every rank owning one of its slots, `compute` there, the rows back, summed in rank order.

    The split sizes travel in the status exchange (`agreement`: the caller's, with its checks, else a plain one
    that checks that the ranks run the same strategy), which raises on every rank alike before any row moves."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if agreement is None:
        agreement = Agreement(group, "all_to_all", per_rank * world, hidden_states)
    plan = agreement.attempt(lambda: _route(top_k_index, top_k_weights, per_rank, world))
    rows = agreement.exchange(plan[4] if plan is not None else None)  # raises on every rank alike
    assert plan is not None  # a rank whose routing failed stated it, and every rank raised
    token, local_ids, send_weights, _, _ = plan
    sends = rows[rank][COUNTS:]
    recvs = [row[COUNTS + rank] for row in rows]
    received = sum(recvs)
    tokens, hidden = hidden_states.shape

    def exchange(rows: torch.Tensor, out_rows: int, out_splits: list[int], in_splits: list[int], what: str):
        out = rows.new_empty((out_rows, *rows.shape[1:]))
        run(dist.all_to_all_single, out, rows.contiguous(), out_splits, in_splits, group=group, what=what)
        return out

    recv_hidden = exchange(hidden_states[token], received, recvs, sends, "all_to_all of hidden rows")
    recv_ids = exchange(local_ids, received, recvs, sends, "all_to_all of expert ids")
    recv_weights = exchange(send_weights, received, recvs, sends, "all_to_all of routing weights")
    if received:
        out_rows = compute(recv_hidden, recv_ids, recv_weights).to(hidden_states.dtype)
    else:  # no token of any rank routed here: nothing to run, the collectives still take part
        out_rows = hidden_states.new_empty((0, hidden))
    back = exchange(out_rows, token.numel(), sends, recvs, "all_to_all of the rows back")
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
    statement: Statement | None = None,
) -> torch.Tensor:
    """The layer's output for this rank's tokens, its experts spread over `group` by all-to-all exchanges.

    Each token goes once to every rank that owns one of its slots, with the local ids of that rank's slots (the
    sentinel elsewhere) and their weights; the owner runs its experts and sends the weighted rows back; the rows
    are added in rank order, so the result does not depend on timing. Token counts may differ between ranks.
    Bad input on any rank (shapes, ids outside [0, E] -- E the global sentinel --, NaN / infinite weights, at every
    validation level but "off") raises the same ExpertsInputError on every rank, before any row moves.
    """
    world = dist.get_world_size(group)
    level = _level(hidden_states)
    agreement = Agreement(group, "all_to_all", num_experts, hidden_states, statement=statement)
    per_rank = agreement.attempt(
        lambda: _check(local, hidden_states, top_k_index, top_k_weights, num_experts, world, seen, level)
    )
    if level != "off":
        agreement.check_values(top_k_index, top_k_weights)
    compute = experts_compute(local, implementation)
    return all_to_all_exchange(group, per_rank or 1, hidden_states, top_k_index, top_k_weights, compute, agreement)


# --- all_to_all_padded: equal splits at a fixed capacity, no host sync ----------------------------------------------


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """[R, n] of any dtype as [R, n * itemsize] uint8, the same memory (a bitcast, no conversion)."""
    return t.contiguous().view(torch.uint8)


def _finite(weights: torch.Tensor, poison: torch.nn.Module | bool) -> torch.Tensor:
    """Where rows are poisoned, the local experts get 0 for a non-finite weight: the poison makes the row NaN on
    every rank alike, while the local call's own checks (a host check of the values at SELECTOR_VALIDATE=full)
    would raise on the owning rank alone and leave the others waiting in the next collective."""
    if poison is False:
        return weights
    return torch.where(torch.isfinite(weights), weights, torch.zeros_like(weights))


def _record(module: torch.nn.Module | bool, index: torch.Tensor, weights: torch.Tensor, num_experts: int) -> None:
    """Count the bad slots of global routing in the device guard's flag (no sync), after the local experts ran: a
    fault recorded before them would make their own call raise now on the ranks whose flag a GPU wrote in time and
    not on the others, which would then wait in the next collective. The next eager call's status exchange reads
    every rank's flag and raises on all of them."""
    if isinstance(module, torch.nn.Module):
        guard.guard_routing(module, index, weights, drop=True, num_experts=num_experts)


def padded_exchange(
    group: dist.ProcessGroup | None,
    per_rank: int,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    compute: Compute,
    capacity: int | None = None,
    *,
    poison: torch.nn.Module | bool = False,
) -> torch.Tensor:
    """Every rank's tokens, padded to `capacity` rows, to every rank in one gather; each rank runs `compute` on its
    experts' share of all of them and sends each source its rows back in one all-to-all of equal splits; the
    returned rows are summed in rank order. Shapes depend on the capacity only: nothing is read back to the host.

    `capacity`: the rows each rank pads to (at least every rank's token count; the same on every rank); None pads
    to this rank's token count, which every rank must then share.
    `poison`: where the values were not proved by a status exchange (captured, compiled, `verify=False`): every
    rank marks the gathered rows with a bad slot (an id outside [0, E], a NaN / infinite weight) alike, sends them
    back as NaN, so the source's output row of such a token is NaN and no other row changes; given the local
    experts module, the device guard records the fault too (`selector.guard`: raised by the next eager call on
    every rank, or `selector.check()`).
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
    run(_all_gather, gathered, row, group=group, what="all_gather of padded rows")
    ends = (hidden * x.element_size(), index.shape[1] * index.element_size())
    g_hidden = gathered[:, : ends[0]].contiguous().view(x.dtype)
    g_index = gathered[:, ends[0] : ends[0] + ends[1]].contiguous().view(index.dtype)
    g_weights = gathered[:, ends[0] + ends[1] :].contiguous().view(weights.dtype)
    # bad ids (outside [0, E]) are owned by no rank here, so they reach no expert
    _, local_ids, local_weights = local_share(g_index, _finite(g_weights, poison), rank, per_rank)
    if world * cap:
        rows = compute(g_hidden, local_ids, local_weights).to(hidden_states.dtype).contiguous()
        if poison is not False:
            rows = rows.masked_fill(poison_mask(g_index, g_weights, per_rank * world), float("nan"))  # rank alike
            _record(poison, g_index, g_weights, per_rank * world)
    else:  # every rank holds no token: the collectives still take part
        rows = hidden_states.new_empty((0, hidden))
    back = torch.empty_like(rows)
    run(dist.all_to_all_single, back, rows, group=group, what="all_to_all of the rows back")  # chunk r to rank r
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
    statement: Statement | None = None,
) -> torch.Tensor:
    """The layer's output for this rank's tokens through the padded exchange (`padded_exchange`), capturable.

    `verify`: first exchange every rank's status (`Agreement`, one host sync): the ranks agree on the capacity and
    the strategy, and bad input on any rank raises the same error on every rank. Skipped where a CUDA graph
    captures or torch.compile traces; there (and with verify=False) bad slots poison their tokens' rows on every
    rank alike and the device guard records them (`_record`). Every rank must pass the same `verify`.
    """
    world = dist.get_world_size(group)
    level = _level(hidden_states)
    if verify and not _capturing(hidden_states):
        agreement = Agreement(
            group, "all_to_all_padded", num_experts, hidden_states, capacity=capacity, statement=statement
        )
        per_rank = agreement.attempt(
            lambda: _check(local, hidden_states, top_k_index, top_k_weights, num_experts, world, seen, level)
        )
        if level != "off":
            agreement.check_values(top_k_index, top_k_weights)
            guard.flags_for(hidden_states.device)  # allocated eagerly: a capture cannot allocate the guard's flag
        agreement.exchange()  # raises on every rank alike
        assert per_rank is not None
        capacity = agreement.capacity
        poison: torch.nn.Module | bool = False  # the exchange proved every rank's values
    else:
        per_rank = _check(local, hidden_states, top_k_index, top_k_weights, num_experts, world, seen, level)
        poison = local if level != "off" else False
    compute = experts_compute(local, implementation)
    return padded_exchange(
        group, per_rank, hidden_states, top_k_index, top_k_weights, compute, capacity, poison=poison
    )


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
    *,
    poison: torch.nn.Module | bool = False,
) -> torch.Tensor:
    """Every rank's share of the same tokens (other ranks' slots as sentinels), summed over the group.

    `poison`: as for `padded_exchange`: the rows of tokens with a bad slot turn NaN (the sum carries any rank's NaN
    to every rank), and given the local experts module the device guard records the fault."""
    _, local_ids, local_weights = local_share(
        top_k_index, _finite(top_k_weights, poison), dist.get_rank(group), per_rank
    )
    if hidden_states.shape[0]:
        out = compute(hidden_states, local_ids, local_weights).to(hidden_states.dtype).contiguous()
        if poison is not False:
            experts = per_rank * dist.get_world_size(group)
            out = out.masked_fill(poison_mask(top_k_index, top_k_weights, experts), float("nan"))
            _record(poison, top_k_index, top_k_weights, experts)
    else:
        out = hidden_states.new_zeros(hidden_states.shape)
    run(dist.all_reduce, out, group=group, what="all_reduce of the experts' shares")
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
    verify: bool = True,
    seen: set[tuple[int, ...]] | None = None,
    statement: Statement | None = None,
) -> torch.Tensor:
    """The layer's output when every rank of `group` holds the same tokens: each rank computes its own experts'
    share of every token (other ranks' slots as sentinels) and `all_reduce` sums the shares.

    `verify`: first exchange every rank's status (`Agreement`: one small gather and a host sync, the only ones of
    the call), so ranks with different token counts or bad input raise the same error on every rank instead of
    aborting in the sum. Skipped where a CUDA graph captures or torch.compile traces; there (and with
    verify=False) bad slots poison their tokens' rows on every rank and the device guard records them.
    """
    world = dist.get_world_size(group)
    level = _level(hidden_states)
    if verify and not _capturing(hidden_states):
        agreement = Agreement(group, "all_reduce", num_experts, hidden_states, statement=statement)
        per_rank = agreement.attempt(
            lambda: _check(local, hidden_states, top_k_index, top_k_weights, num_experts, world, seen, level)
        )
        if level != "off":
            agreement.check_values(top_k_index, top_k_weights)
            guard.flags_for(hidden_states.device)  # allocated eagerly: a capture cannot allocate the guard's flag
        agreement.exchange()  # raises on every rank alike
        assert per_rank is not None
        poison: torch.nn.Module | bool = False
    else:
        per_rank = _check(local, hidden_states, top_k_index, top_k_weights, num_experts, world, seen, level)
        poison = local if level != "off" else False
    compute = experts_compute(local, implementation)
    return all_reduce_exchange(group, per_rank, hidden_states, top_k_index, top_k_weights, compute, poison=poison)


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
    "ExpertParallelError",
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
