"""The expert-parallel strategies as declarations, and which one runs: pure, no torch, no process group touched.

A strategy is one way to spread a layer's experts over the ranks of a torch.distributed process group. Its
requirements are judged against `ParallelFacts` (read off the group by the caller, or given to `selector doctor`),
so the choice can be explained without a single collective.

- `all_to_all`: each rank sends every token to the ranks that own its experts, once per rank (slots of other
  ranks marked with the sentinel), runs its local experts on what it received and sends the rows back; tokens
  may differ from rank to rank, and so may their count. The split sizes are read back to the host once per layer,
  so it cannot be captured in a CUDA graph, and torch.compile breaks its graph there.
- `all_to_all_padded`: every rank sends all of its tokens (padded to a fixed capacity) to every rank, which runs
  its own experts' share of them and sends each source its rows back; equal splits, so nothing is read back to the
  host and it captures in a CUDA graph. It moves about 1 / (1 - (1 - 1/world)^k) times the bytes of `all_to_all`.
- `all_reduce`: every rank holds the same tokens, computes its own experts' share of every token (other ranks'
  slots are sentinels) and a sum over the group adds the shares; no host sync under a CUDA graph or torch.compile
  (eager calls first check the ranks' token counts in one small exchange), but every rank computes on all tokens.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from selector.types import AVAILABLE, Availability, Status

AUTO = "auto"
COLLECTIVE_BACKENDS = frozenset({"gloo", "nccl"})


def version_text(version: tuple[int, ...] | None) -> str:
    return ".".join(str(v) for v in version) if version else "unknown"


@dataclass(frozen=True)
class ParallelFacts:
    """What a strategy's requirements are judged against: the group as seen from this rank, and the layer."""

    has_group: bool  # a process group is given (or the default world is initialised)
    world_size: int
    backend: str | None  # the group's torch.distributed backend ("gloo", "nccl", ...)
    num_experts: int  # the layer's global expert count
    same_tokens: bool = False  # the caller promises every rank holds the same tokens
    capturing: bool = False  # the call is captured in a CUDA graph or traced by torch.compile: no host sync allowed
    nccl_version: tuple[int, ...] | None = None  # the NCCL torch runs with, where known
    nccl_problem: str | None = None  # why NCCL cannot run here (a CPU build of torch, no GPU), where known


@dataclass(frozen=True)
class Strategy:
    """One expert-parallel strategy and what it needs."""

    name: str
    description: str
    backends: frozenset[str] = COLLECTIVE_BACKENDS
    needs_same_tokens: bool = False  # every rank must hold the same tokens (replicated activations)
    capturable: bool = False  # no host sync and no data-dependent shape: CUDA graphs and torch.compile take it
    min_nccl: tuple[int, ...] | None = None  # the oldest NCCL it runs with on the nccl backend
    tradeoff: str = ""  # what it costs against the others, for doctor and the docs


STRATEGIES: Mapping[str, Strategy] = {
    s.name: s
    for s in (
        Strategy(
            "all_to_all",
            "tokens travel to the ranks owning their experts and back (all_to_all_single); token counts may differ",
            min_nccl=(2, 7, 0),  # all_to_all_single is built on NCCL's send / recv
            tradeoff="moves only the rows a rank's experts need; one host sync per layer for the split sizes",
        ),
        Strategy(
            "all_to_all_padded",
            "every token goes to every rank at a fixed capacity, each rank runs its experts' share and sends the "
            "rows back (equal splits, no host sync)",
            capturable=True,
            min_nccl=(2, 9, 6),  # the first NCCL whose collectives a CUDA graph may capture
            tradeoff="moves (world - 1) x capacity rows each way per rank, pads and other ranks' tokens included; "
            "wins where latency, not bytes, sets the time: small token counts and decode under CUDA graphs",
        ),
        Strategy(
            "all_reduce",
            "every rank computes its experts' share of all tokens, an all_reduce sums the shares",
            needs_same_tokens=True,
            capturable=True,
            min_nccl=(2, 9, 6),
            tradeoff="no token moves, but every rank runs the gather and elementwise passes on all tokens",
        ),
    )
}
# What `auto` tries, best first: all_to_all computes each slot once and moves the fewest bytes; under a CUDA graph
# or torch.compile it is excluded, and all_reduce (replicated tokens) moves fewer bytes than the padded exchange.
PREFERENCE = ("all_to_all", "all_reduce", "all_to_all_padded")


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
    if facts.backend == "nccl" and facts.nccl_problem:
        return Availability(
            Status.MISSING_PACKAGE,
            f"expert-parallel strategy {strategy.name!r} on the nccl backend needs NCCL: {facts.nccl_problem}",
            "install a CUDA build of torch (it brings NCCL) on a machine with CUDA GPUs, or use backend='gloo'",
            found=facts.nccl_problem,
        )
    if facts.backend == "nccl" and strategy.min_nccl and facts.nccl_version and facts.nccl_version < strategy.min_nccl:
        return Availability(
            Status.PACKAGE_TOO_OLD,
            f"expert-parallel strategy {strategy.name!r} needs NCCL {version_text(strategy.min_nccl)} or newer, "
            f"torch runs NCCL {version_text(facts.nccl_version)}",
            "install a torch build with a newer NCCL",
            found=f"NCCL {version_text(facts.nccl_version)}",
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
    if facts.capturing and not strategy.capturable:
        return Availability(
            Status.UNSUPPORTED_CONFIG,
            f"expert-parallel strategy {strategy.name!r} reads its split sizes back to the host once per layer, "
            "which a CUDA graph cannot capture and torch.compile cannot trace",
            "use all_to_all_padded (or all_reduce with same_tokens=True) under CUDA graphs and torch.compile, "
            "or strategy='auto'",
        )
    if facts.world_size == 1:
        return Availability(
            Status.OK, "one rank holds every expert: the collectives are copies, nothing is spread",
            found="world size 1",
        )
    return AVAILABLE


def explain(facts: ParallelFacts) -> dict[str, Availability]:
    """Every strategy's verdict, in the order `auto` tries them."""
    return {name: check_strategy(STRATEGIES[name], facts) for name in PREFERENCE}


def choose(facts: ParallelFacts, requested: str = AUTO) -> str:
    """The strategy that runs: `requested` if it can (else it raises), or the first of `PREFERENCE` that can.

    Raises ValueError for an unknown name or when nothing runs (the reason of each strategy in the message);
    a requested strategy that cannot run raises ImportError when something is missing (NCCL), else ValueError.
    """
    if requested != AUTO:
        strategy = STRATEGIES.get(requested)
        if strategy is None:
            raise ValueError(
                f"unknown expert-parallel strategy {requested!r}; known: {', '.join([AUTO, *sorted(STRATEGIES)])}"
            )
        verdict = check_strategy(strategy, facts)
        if not verdict.ok:  # ImportError for something missing (NCCL), ValueError for a configuration
            raise verdict.status.error_type(f"{verdict.reason}. fix: {verdict.remedy}")
        return requested
    verdicts = explain(facts)
    for name, verdict in verdicts.items():
        if verdict.ok:
            return name
    reasons = "; ".join(f"{name}: {v.reason}" for name, v in verdicts.items())
    raise ValueError(f"no expert-parallel strategy runs here ({reasons}). fix: {verdicts[PREFERENCE[0]].remedy}")


__all__ = [
    "AUTO",
    "PREFERENCE",
    "STRATEGIES",
    "ParallelFacts",
    "Strategy",
    "check_strategy",
    "choose",
    "explain",
    "version_text",
]
