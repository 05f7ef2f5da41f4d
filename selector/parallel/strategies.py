"""The expert-parallel strategies as declarations, and which one runs: pure, no torch, no process group touched.

A strategy is one way to spread a layer's experts over the ranks of a torch.distributed process group. Its
requirements are judged against `ParallelFacts` (read off the group by the caller), so `selector doctor` or a
test can explain the choice without a single collective.

- `all_to_all`: each rank sends every token to the ranks that own its experts, once per rank (slots of other
  ranks marked with the sentinel), runs its local experts on what it received and sends the rows back; tokens
  may differ from rank to rank, and so may their count.
- `all_reduce`: every rank holds the same tokens, computes its own experts' share of every token (other ranks'
  slots are sentinels) and a sum over the group adds the shares; simplest, but every rank computes on all tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from selector.types import AVAILABLE, Availability, Status

AUTO = "auto"
COLLECTIVE_BACKENDS = frozenset({"gloo", "nccl"})


@dataclass(frozen=True)
class ParallelFacts:
    """What a strategy's requirements are judged against: the group as seen from this rank, and the layer."""

    has_group: bool  # a process group is given (or the default world is initialised)
    world_size: int
    backend: str | None  # the group's torch.distributed backend ("gloo", "nccl", ...)
    num_experts: int  # the layer's global expert count
    same_tokens: bool = False  # the caller promises every rank holds the same tokens


@dataclass(frozen=True)
class Strategy:
    """One expert-parallel strategy and what it needs."""

    name: str
    description: str
    backends: frozenset[str] = COLLECTIVE_BACKENDS
    needs_same_tokens: bool = False  # every rank must hold the same tokens (replicated activations)


STRATEGIES: Mapping[str, Strategy] = {
    s.name: s
    for s in (
        Strategy(
            "all_to_all",
            "tokens travel to the ranks owning their experts and back (all_to_all_single); token counts may differ",
        ),
        Strategy(
            "all_reduce",
            "every rank computes its experts' share of all tokens, an all_reduce sums the shares",
            needs_same_tokens=True,
        ),
    )
}
PREFERENCE = ("all_to_all", "all_reduce")  # what `auto` tries, best first: all_to_all computes each slot once


def check_strategy(strategy: Strategy, facts: ParallelFacts) -> Availability:
    """Whether the strategy runs on this group and layer, with the reason and the fix when it does not."""
    if not facts.has_group:
        return Availability(
            Status.UNSUPPORTED_CONFIG,
            f"expert-parallel strategy {strategy.name!r} needs a torch.distributed process group, and none is "
            "given or initialised",
            "call torch.distributed.init_process_group (gloo or nccl) and pass the expert-parallel group",
        )
    if facts.backend not in strategy.backends:
        return Availability(
            Status.UNSUPPORTED_CONFIG,
            f"expert-parallel strategy {strategy.name!r} runs on the {' or '.join(sorted(strategy.backends))} "
            f"backend of torch.distributed, the group's is {facts.backend!r}",
            "create the expert-parallel group with backend='nccl' (GPUs) or backend='gloo' (CPUs)",
            found=f"process group backend {facts.backend!r}",
        )
    if facts.world_size < 1 or facts.num_experts % facts.world_size:
        return Availability(
            Status.UNSUPPORTED_CONFIG,
            f"expert-parallel strategy {strategy.name!r} gives every rank the same number of experts: the group's "
            f"size {facts.world_size} must divide the {facts.num_experts} experts",
            "use an expert-parallel group whose size divides the number of experts",
            found=f"{facts.num_experts} experts over {facts.world_size} ranks",
        )
    if strategy.needs_same_tokens and not facts.same_tokens:
        return Availability(
            Status.UNSUPPORTED_CONFIG,
            f"expert-parallel strategy {strategy.name!r} sums every rank's share of the same tokens, and the caller "
            "did not say every rank holds the same tokens",
            "pass same_tokens=True when the activations are replicated over the group, or use all_to_all",
        )
    return AVAILABLE


def explain(facts: ParallelFacts) -> dict[str, Availability]:
    """Every strategy's verdict, in the order `auto` tries them."""
    return {name: check_strategy(STRATEGIES[name], facts) for name in PREFERENCE}


def choose(facts: ParallelFacts, requested: str = AUTO) -> str:
    """The strategy that runs: `requested` if it can (else it raises), or the first of `PREFERENCE` that can.

    Raises ValueError for an unknown name or when nothing runs (the reason of each strategy in the message).
    """
    if requested != AUTO:
        strategy = STRATEGIES.get(requested)
        if strategy is None:
            raise ValueError(
                f"unknown expert-parallel strategy {requested!r}; known: {', '.join([AUTO, *sorted(STRATEGIES)])}"
            )
        verdict = check_strategy(strategy, facts)
        if not verdict.ok:
            raise ValueError(f"{verdict.reason}. fix: {verdict.remedy}")
        return requested
    verdicts = explain(facts)
    for name, verdict in verdicts.items():
        if verdict.ok:
            return name
    reasons = "; ".join(f"{name}: {v.reason}" for name, v in verdicts.items())
    raise ValueError(f"no expert-parallel strategy runs here ({reasons}). fix: {verdicts[PREFERENCE[0]].remedy}")


__all__ = ["AUTO", "PREFERENCE", "STRATEGIES", "ParallelFacts", "Strategy", "check_strategy", "choose", "explain"]
