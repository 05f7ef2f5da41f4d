"""Every rank's state of one expert-parallel call, exchanged in the collective each eager call makes first, so that
every rank raises the same error on the same call: a rank whose input is bad, or that failed before its first
collective, still takes part in that collective with its failure stated, instead of raising alone and leaving its
peers waiting in a collective that never completes.

The status exchange is one `all_gather` of a fixed-size int64 vector per rank, the same for every strategy (so a
rank that runs another strategy is told, not paired with a collective of another kind):

    strategy, captured strategy, num_experts, hidden size, tokens, capacity, failure,    # stated on the host
    bad ids, one bad id, non-finite weights, pending guard faults,           # counted on the device, no sync
    the rows this rank sends to each rank (all_to_all; zeros elsewhere)      # world words

`all_to_all` sends its split sizes in it (it replaces the count exchange, so no extra round trip);
`all_to_all_padded` proves its capacity with it (the gather it made anyway); `all_reduce`, which has no fixed-size
collective of its own before the sum, adds it as its one extra collective on eager calls. Reading the gathered
words is the one host sync of an eager call. Every rank then walks the same rows through the same checks
(`Agreement.settle`), so every rank raises the same error class with the same message (the rank that saw a problem
on its own host adds what it saw); the checks, in order: strategies and expert counts agree; no rank failed before
the exchange; the token counts fit the strategy; no rank holds a bad id (outside [0, E] -- E is the global
sentinel) or a NaN / infinite weight; no rank's device guard holds a fault of an earlier call.

Where nothing may sync (a CUDA graph captures, torch.compile traces, `verify=False`) there is no status exchange;
the exchanges poison instead (`poison_mask`): every rank marks the same rows (those of tokens with a bad slot),
their outputs turn NaN, and the device guard records the fault (`selector.guard`), raised by the next eager call's
status exchange on every rank, or by `selector.check()`.

Every collective selector issues on gloo waits at most SELECTOR_EP_TIMEOUT seconds (`run`); on nccl the status
exchange does (a host sync follows it anyway) and the data collectives keep torch's own bound, the process group's
timeout. A timed-out rank raises ExpertParallelError: its group is out of step from then on.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from selector import guard, settings
from selector.errors import ExpertsInputError

TIMEOUT_VARIABLE = "SELECTOR_EP_TIMEOUT"

# torch 2.13 names the gather of equal chunks all_gather_single; older releases all_gather_into_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

CODES = {"all_to_all": 1, "all_to_all_padded": 2, "all_reduce": 3}
_NAMES = {code: name for name, code in CODES.items()}
# the words of a rank's status, then `world` words of rows it sends to each rank
STRATEGY, CAPTURED, NUM_EXPERTS, HIDDEN, TOKENS, CAPACITY, FAILURE, BAD_IDS, BAD_ID, BAD_WEIGHTS, PENDING = range(11)
WORDS = 11
COUNTS = WORDS  # where the send counts start
# FAILURE: what went wrong on a rank before the exchange
OK, REFUSED_INPUT, REFUSED_CONFIG, FAILED = 0, 1, 2, 3
_FAILURES = {
    REFUSED_INPUT: "refused its input (ExpertsInputError)",
    REFUSED_CONFIG: "refused its layer's configuration (ValueError)",
    FAILED: "failed before the exchange",
}

T = TypeVar("T")


class ExpertParallelError(RuntimeError):
    """A rank of an expert-parallel group failed before a call's status exchange with an error other than bad input
    or configuration, or a collective did not complete within SELECTOR_EP_TIMEOUT seconds."""


def timeout_seconds() -> float:
    """SELECTOR_EP_TIMEOUT: how long a rank waits in one collective for its peers."""
    return float(settings.get(TIMEOUT_VARIABLE))


def _tracing(tensor: torch.Tensor) -> bool:
    return torch.compiler.is_compiling() or (tensor.is_cuda and torch.cuda.is_current_stream_capturing())


def run(
    op: Callable[..., Any],
    *args: Any,
    group: dist.ProcessGroup | None,
    what: str,
    host_wait: bool = False,
    **kwargs: Any,
) -> None:
    """`op(*args, group=group, **kwargs)`, waited for at most SELECTOR_EP_TIMEOUT seconds where torch allows it:
    every collective on gloo (its calls block the host anyway), and on nccl those with `host_wait` (a host sync
    follows them: the status exchange). Elsewhere (nccl's data collectives, CUDA graph capture, torch.compile) the
    plain call, bounded by the group's own timeout. Raises ExpertParallelError naming the setting on a timeout."""
    first = args[0]
    if _tracing(first) or not (host_wait or dist.get_backend(group) == "gloo"):
        op(*args, group=group, **kwargs)
        return
    seconds = timeout_seconds()
    work = op(*args, group=group, async_op=True, **kwargs)
    try:
        work.wait(timeout=datetime.timedelta(seconds=seconds))
    except RuntimeError as exc:
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        timed_out = "timed out" in str(exc).lower()
        happened = (
            f"did not complete within {seconds:g} s ({TIMEOUT_VARIABLE}): another rank of the group did not join "
            "it (it raised or stopped before its layer, or called another collective)"
            if timed_out
            else f"failed before {TIMEOUT_VARIABLE} ({seconds:g} s) ran out: another rank of the group left it "
            "(its process ended or its connection closed)"
        )
        raise ExpertParallelError(
            f"rank {rank} of {world}: the expert-parallel {what} {happened}. The group's collectives are out of "
            f"step now: destroy the process group rather than use it again ({type(exc).__name__}: {exc})"
        ) from exc


@dataclass
class Statement:
    """What an ExpertParallel layer adds to its calls' status, and what it learns back from them."""

    captured: str | None = None  # the strategy a captured or compiled call would run, told to the other ranks
    counts_equal: bool = False  # the last status exchange saw every rank hold as many tokens


def value_stats(index: torch.Tensor, weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[bad ids, one bad id, non-finite weights] as an int64 tensor on the device, no sync. Ids must lie in
    [0, num_experts]: num_experts itself is the global expert-parallel sentinel (contributes nothing)."""
    if index.numel() == 0:
        return torch.zeros(3, dtype=torch.int64, device=index.device)
    bad = ((index < 0) | (index > num_experts)).reshape(-1)
    count = bad.sum()
    first = index.reshape(-1)[bad.to(torch.int32).argmax()].to(torch.int64)
    value = torch.where(count > 0, first, torch.zeros_like(first))
    return torch.stack([count, value, (~torch.isfinite(weights)).sum()]).to(torch.int64)


def pending_faults(device: torch.device) -> torch.Tensor:
    """The device guard's fault count as it stands, as a [1] int64 tensor on the device (no sync)."""
    flags = guard.flags_for(device, create=False)
    if flags is None:
        return torch.zeros(1, dtype=torch.int64, device=device)
    return flags.flag[guard.BAD_IDS : guard.BAD_WEIGHTS + 1].sum().to(torch.int64).view(1).to(device)


def poison_mask(index: torch.Tensor, weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[rows, 1] bool: the rows with a bad slot (an id outside [0, num_experts], a NaN / infinite weight)."""
    bad = (index < 0) | (index > num_experts) | ~torch.isfinite(weights)
    return bad.any(dim=1, keepdim=True)


class Agreement:
    """One eager call's status exchange: this rank's state gathered from every rank, settled alike on every rank.

    `attempt` runs a step that may fail before the exchange (checks, routing): its failure is stated, not raised;
    `exchange` gathers every rank's words and raises on every rank alike, else returns the gathered rows.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        strategy: str,
        num_experts: int,
        hidden_states: torch.Tensor,
        *,
        capacity: int | None = None,
        statement: Statement | None = None,
    ) -> None:
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.strategy = strategy
        self.num_experts = num_experts
        self.device = hidden_states.device
        self.tokens = int(hidden_states.shape[0]) if hidden_states.dim() else -1
        self.hidden = int(hidden_states.shape[-1]) if hidden_states.dim() == 2 else -1
        self.requested_capacity = capacity
        self.statement = statement
        self.failure: BaseException | None = None
        self.failure_code = OK
        self.values: torch.Tensor | None = None
        self.capacity = self.tokens if capacity is None else capacity  # the agreed one, after `exchange`

    def attempt(self, step: Callable[[], T]) -> T | None:
        """`step()`, or None with its exception stated for the exchange (None at once after an earlier failure)."""
        if self.failure is not None:
            return None
        try:
            return step()
        except ExpertsInputError as exc:
            self.failure, self.failure_code = exc, REFUSED_INPUT
        except ValueError as exc:
            self.failure, self.failure_code = exc, REFUSED_CONFIG
        except Exception as exc:  # noqa: BLE001 - stated to the other ranks, raised on this one after the exchange
            self.failure, self.failure_code = exc, FAILED
        return None

    def check_values(self, index: torch.Tensor, weights: torch.Tensor) -> None:
        """Count bad ids and weights on the device (no sync); the exchange tells every rank."""
        self.values = self.attempt(lambda: value_stats(index, weights, self.num_experts))

    def exchange(self, counts: torch.Tensor | None = None) -> list[list[int]]:
        """Gather every rank's status (and `counts`, the rows this rank sends to each rank) and settle it: raises
        on every rank alike, or returns the rows [world][WORDS + world]."""
        device = self.device
        captured = self.statement.captured if self.statement is not None else None
        host = [
            CODES[self.strategy],
            CODES.get(captured or "", 0),
            self.num_experts,
            self.hidden,
            self.tokens,
            -1 if self.requested_capacity is None else self.requested_capacity,
            self.failure_code,
        ]
        values = self.values if self.values is not None and self.failure is None else None
        parts = [
            # staged from pageable memory at once: no wait for the device (a blocking copy would sync the stream)
            torch.tensor(host, dtype=torch.int64).to(device, non_blocking=True),
            values if values is not None else torch.zeros(3, dtype=torch.int64, device=device),
            pending_faults(device),
            counts.to(torch.int64) if counts is not None and self.failure is None
            else torch.zeros(self.world, dtype=torch.int64, device=device),
        ]
        mine = torch.cat(parts)
        gathered = mine.new_empty(self.world * mine.numel())
        run(_all_gather, gathered, mine, group=self.group, what="status exchange", host_wait=True)
        rows = gathered.view(self.world, -1).tolist()  # the one host sync of the call
        self.settle(rows)
        return rows

    # --- the same checks on every rank, on the same rows ---------------------------------------------------------

    def _prefix(self) -> str:
        return f"expert-parallel layer ({self.strategy} over {self.world} ranks, {self.num_experts} experts)"

    def settle(self, rows: list[list[int]]) -> None:
        tokens = [row[TOKENS] for row in rows]
        if self.statement is not None:
            self.statement.counts_equal = len(set(tokens)) == 1
        self._strategies(rows)
        self._failures(rows)
        self._widths(rows)
        self._counts(rows, tokens)
        self._values(rows)
        self._pending(rows)

    def _strategies(self, rows: list[list[int]]) -> None:
        runs = [(row[STRATEGY], row[CAPTURED]) for row in rows]
        if len(set(runs)) > 1:
            def name(code: int) -> str:
                return _NAMES.get(code, "none")

            listing = ", ".join(
                f"rank {r} {name(s)} (captured: {name(c)})" for r, (s, c) in enumerate(runs)
            )
            raise ValueError(
                f"expert-parallel layer over {self.world} ranks: the ranks of the group run different "
                "expert-parallel strategies on this call: "
                f"{listing}; every rank must build its layer alike (strategy=, same_tokens=, capacity=)"
            )
        experts = [row[NUM_EXPERTS] for row in rows]
        if len(set(experts)) > 1:
            raise ValueError(
                f"{self._prefix()}: the ranks of the group disagree on the layer's expert count: {experts}; every "
                "rank must pass the same num_experts"
            )

    def _failures(self, rows: list[list[int]]) -> None:
        failed = [(r, row[FAILURE]) for r, row in enumerate(rows) if row[FAILURE]]
        if not failed:
            return
        listing = "; ".join(f"rank {r} {_FAILURES.get(code, 'failed')}" for r, code in failed)
        text = (
            f"{self._prefix()}: {listing}. Every rank raises this on the same call; no rank ran its experts"
        )
        mine = self.failure
        if mine is not None:
            text += f". On this rank (rank {self.rank}): {type(mine).__name__}: {mine}"
        worst = max(code for _, code in failed)
        if worst == FAILED:
            if mine is not None and self.failure_code == FAILED:
                mine.add_note(text)
                raise mine
            raise ExpertParallelError(text) from mine
        raise (ValueError if worst == REFUSED_CONFIG else ExpertsInputError)(text) from mine

    def _widths(self, rows: list[list[int]]) -> None:
        widths = [row[HIDDEN] for row in rows]
        if len(set(widths)) > 1:  # rows of different widths would abort gloo's exchange (nccl: read past them)
            raise ValueError(f"{self._prefix()}: the ranks' hidden_states have different hidden sizes {widths}")

    def _counts(self, rows: list[list[int]], tokens: list[int]) -> None:
        if self.strategy == "all_reduce" and len(set(tokens)) > 1:
            raise ValueError(
                f"{self._prefix()}: all_reduce needs the same tokens on every rank (same_tokens=True promised "
                f"it), the ranks hold {tokens} tokens: give every rank the same tokens, or use all_to_all "
                "(strategy='all_to_all', or 'auto' with same_tokens=False)"
            )
        if self.strategy != "all_to_all_padded":
            return
        capacities = [row[CAPACITY] for row in rows]
        if len(set(capacities)) > 1:
            raise ValueError(f"the ranks of the group pad to different capacities {capacities} (-1: none given): "
                             "every rank must pass the same capacity")
        if self.requested_capacity is None:
            if len(set(tokens)) > 1:
                raise ValueError(f"all_to_all_padded without a capacity needs the same token count on every rank, "
                                 f"the ranks hold {tokens}: pass capacity=max tokens per rank, or use all_to_all")
            return
        if max(tokens) > self.requested_capacity:
            raise ValueError(f"a rank holds more tokens than the capacity {self.requested_capacity} of "
                             f"all_to_all_padded: the ranks hold {tokens}; pass a capacity of at least "
                             f"{max(tokens)}")

    def _values(self, rows: list[list[int]]) -> None:
        bad = [(r, row) for r, row in enumerate(rows) if row[BAD_IDS] or row[BAD_WEIGHTS]]
        if not bad:
            return
        E = self.num_experts
        parts = []
        for r, row in bad:
            found = []
            if row[BAD_IDS]:
                found.append(f"{row[BAD_IDS]} expert id(s) outside [0, {E}) other than the expert-parallel "
                             f"sentinel {E} (one was {row[BAD_ID]})")
            if row[BAD_WEIGHTS]:
                found.append(f"{row[BAD_WEIGHTS]} NaN or infinite routing weight(s)")
            parts.append(f"rank {r}: " + " and ".join(found))
        raise ExpertsInputError(
            f"{self._prefix()}: top_k_index / top_k_weights of this call hold {'; '.join(parts)}. Every rank raises "
            "this on the same call; no rank ran its experts. Fix the router's output"
        )

    def _pending(self, rows: list[list[int]]) -> None:
        pending = [(r, row[PENDING]) for r, row in enumerate(rows) if row[PENDING]]
        if not pending:
            return
        listing = "; ".join(f"rank {r}: {n}" for r, n in pending)
        text = (
            f"{self._prefix()}: the routing guard recorded bad ids or weights in an earlier call (faults per rank: "
            f"{listing}); those tokens' outputs were NaN. Every rank raises this on the same call"
        )
        if rows[self.rank][PENDING]:
            try:
                guard.check()  # this rank's own record: which layer, one value; clears it
            except ExpertsInputError as exc:
                raise ExpertsInputError(f"{text}. On this rank (rank {self.rank}): {exc}") from exc
        raise ExpertsInputError(text)


def check_capacity(group: dist.ProcessGroup | None, tokens: int, capacity: int | None, device: torch.device) -> int:
    """The capacity every rank pads to, after one status exchange of (tokens, capacity) proving the ranks agree.

    Raises ValueError on every rank alike. One host sync: call it outside CUDA graphs and torch.compile, on every
    rank alike."""
    agreement = Agreement(
        group, "all_to_all_padded", 0, torch.empty(tokens, 0, device=device), capacity=capacity
    )
    agreement.exchange()
    return agreement.capacity


__all__ = [
    "CODES",
    "TIMEOUT_VARIABLE",
    "Agreement",
    "ExpertParallelError",
    "Statement",
    "check_capacity",
    "pending_faults",
    "poison_mask",
    "run",
    "timeout_seconds",
    "value_stats",
]
