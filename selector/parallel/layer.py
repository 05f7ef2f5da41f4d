"""The expert-parallel experts module: this rank's local experts behind the global experts interface.

    group = torch.distributed.new_group(...)             # or None: the default world
    layer = ExpertParallel(local_experts, group, num_experts=64)
    out = layer(hidden_states, top_k_index, top_k_weights)  # global expert ids, this rank's tokens

    shard_experts(experts, group)          # a full decorated experts module -> ExpertParallel of this rank's slice
    parallelize_experts(model, group)      # every selector experts module of a model tree, in place
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist

from selector import dispatch, layers
from selector.model import is_experts_module
from selector.parallel.exchange import FORWARDS
from selector.parallel.status import Statement
from selector.parallel.strategies import AUTO, ParallelFacts, choose, explain
from selector.types import Availability


def _group_or_world(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def _nccl_version() -> tuple[int, ...] | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - a CPU build or a torch without the binding: unknown, not an error
        return None
    return tuple(version) if isinstance(version, tuple) else None


def facts_of(
    group: dist.ProcessGroup | None, num_experts: int, same_tokens: bool = False, capturing: bool = False
) -> ParallelFacts:
    """The facts a strategy is judged against, read off the group (the default world when `group` is None)."""
    group = _group_or_world(group)
    if group is None:
        return ParallelFacts(False, 0, None, num_experts, same_tokens, capturing)
    backend = str(dist.get_backend(group))
    nccl = _nccl_version() if backend == "nccl" else None
    return ParallelFacts(True, dist.get_world_size(group), backend, num_experts, same_tokens, capturing, nccl)


def capturing_now(x: torch.Tensor) -> bool:
    """Whether this call is captured in a CUDA graph or traced by torch.compile (no host sync allowed)."""
    return torch.compiler.is_compiling() or (x.is_cuda and torch.cuda.is_current_stream_capturing())


def _choice(facts: ParallelFacts, strategy: str) -> str | Exception:
    try:
        return choose(facts, strategy)
    except (ValueError, ImportError) as exc:
        return exc


class ExpertParallel(torch.nn.Module):
    """Experts spread over a process group: forward(hidden [T,H], top_k_index [T,k] global ids, weights) -> [T,H].

    `experts` holds this rank's `num_experts / world` experts (the rank r holds global ids r*E/w .. (r+1)*E/w-1)
    and is marked expert-parallel here. `strategy`: "all_to_all", "all_to_all_padded", "all_reduce" or "auto":
    all_to_all where it runs, and where a CUDA graph captures or torch.compile traces (no host sync allowed)
    all_reduce when `same_tokens`, else all_to_all_padded. `same_tokens=True` promises every rank holds the same
    tokens, which all_reduce needs. `capacity`: the rows per rank all_to_all_padded pads to (the same on every rank,
    at least every rank's token count); None pads to the token count, which every rank must then share. Eager
    calls of all_to_all_padded prove that the ranks agree (one host sync); captured and compiled calls do not, so
    run the shape eagerly once before capturing it, as CUDA graphs need anyway.
    `implementation`: the local backend (a name or "auto"), else the local module's own request.
    """

    def __init__(
        self,
        experts: torch.nn.Module,
        group: dist.ProcessGroup | None = None,
        num_experts: int | None = None,
        strategy: str = AUTO,
        same_tokens: bool = False,
        implementation: str | None = None,
        capacity: int | None = None,
    ) -> None:
        super().__init__()
        self.experts = experts
        self.group = _group_or_world(group)
        local = layers.dims(experts)[0]
        world = dist.get_world_size(self.group) if self.group is not None else 1
        self.num_experts = int(num_experts) if num_experts is not None else local * world
        self.facts = facts_of(self.group, self.num_experts, same_tokens)
        self.strategy = choose(self.facts, strategy)  # ValueError with the reason when it cannot run eagerly
        # where nothing may sync: decided now, raised at the first captured call when nothing can run there
        self.captured_strategy = _choice(replace(self.facts, capturing=True), strategy)
        if local * world != self.num_experts:
            raise ValueError(
                f"the local experts module holds {local} experts; {self.num_experts} experts over {world} ranks "
                f"means {self.num_experts // world} per rank"
            )
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be at least 0, got {capacity}")
        experts._is_expert_parallel = True
        dispatch.forget_module(experts)
        self.implementation = implementation
        self.capacity = capacity
        self.rank = dist.get_rank(self.group)
        self.first_expert = self.rank * local
        self._seen: set[tuple[int, ...]] = set()  # input shapes whose values were checked
        # told to the other ranks in each eager call's status exchange (which strategy a captured call runs);
        # learns back whether every rank held as many tokens in the last eager call
        self._statement = Statement(
            captured=self.captured_strategy if isinstance(self.captured_strategy, str) else None
        )

    @property
    def _counts_agree(self) -> bool:
        """The last eager call's status exchange saw every rank hold as many tokens."""
        return self._statement.counts_equal

    def explain(self, capturing: bool = False) -> dict[str, Availability]:
        """Every strategy's verdict for this layer and group, in the order `auto` tries them; `capturing`: as
        judged where a CUDA graph captures or torch.compile traces."""
        return explain(replace(self.facts, capturing=capturing))

    def strategy_for(self, hidden_states: torch.Tensor) -> str:
        """The strategy this call runs: the eager choice, or the capturable one under a CUDA graph or compile."""
        if not capturing_now(hidden_states):
            return self.strategy
        if isinstance(self.captured_strategy, Exception):
            raise self.captured_strategy
        if self.captured_strategy == "all_to_all_padded" and self.capacity is None and not self._counts_agree:
            # without a capacity each rank pads to its own count: unequal counts would mismatch the collectives
            # (a hang or an abort), and nothing can check them where no host sync is allowed
            raise ValueError(
                "expert parallelism under a CUDA graph or torch.compile runs all_to_all_padded, which needs the "
                "ranks' token counts to agree: pass capacity= (the most tokens any rank holds), or run one eager "
                "call of the layer with every rank's tokens (its status exchange checks the ranks agree) before "
                "capturing or compiling"
            )
        if self.captured_strategy == "all_reduce" and not self._counts_agree:
            # a sum over tensors of different sizes aborts gloo and reads past buffers on nccl
            raise ValueError(
                "expert parallelism under a CUDA graph or torch.compile runs all_reduce (same_tokens=True), which "
                "needs every rank to hold the same tokens and cannot check it there: run one eager call of the "
                "layer (its status exchange checks the ranks' token counts) before capturing or compiling"
            )
        return self.captured_strategy

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        name = self.strategy_for(hidden_states)
        args = (self.experts, self.group, self.num_experts, hidden_states, top_k_index, top_k_weights)
        # every eager call opens with the status exchange (for all_to_all it carries the split sizes): the ranks
        # agree on strategy, counts and capacity, and bad input on any rank raises on every rank alike
        extra = {"capacity": self.capacity} if name == "all_to_all_padded" else {}
        return FORWARDS[name](*args, self.implementation, seen=self._seen, statement=self._statement, **extra)

    def extra_repr(self) -> str:
        return f"strategy={self.strategy}, num_experts={self.num_experts}, first_expert={self.first_expert}"


def expert_parallel_forward(
    local: torch.nn.Module,
    group: dist.ProcessGroup | None,
    num_experts: int,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    strategy: str = AUTO,
    same_tokens: bool = False,
    implementation: str | None = None,
    capacity: int | None = None,
) -> torch.Tensor:
    """One expert-parallel call without a wrapper module (the strategy is chosen on every call; the padded
    exchange proves the ranks' capacity on every eager call, one host sync)."""
    group = _group_or_world(group)
    capturing = capturing_now(hidden_states)
    name = choose(facts_of(group, num_experts, same_tokens, capturing), strategy)
    if capturing and name == "all_to_all_padded" and capacity is None:
        raise ValueError(
            "expert_parallel_forward under a CUDA graph or torch.compile runs all_to_all_padded, which needs the "
            "ranks' token counts to agree and cannot check them there: pass capacity= (the most tokens any rank "
            "holds), or use an ExpertParallel layer and one eager all_to_all_padded call before capturing"
        )
    local._is_expert_parallel = True
    extra = {"capacity": capacity} if name == "all_to_all_padded" else {}
    return FORWARDS[name](local, group, num_experts, hidden_states, top_k_index, top_k_weights, implementation, **extra)


def shard_experts(
    experts: torch.nn.Module,
    group: dist.ProcessGroup | None = None,
    strategy: str = AUTO,
    same_tokens: bool = False,
    implementation: str | None = None,
    capacity: int | None = None,
) -> ExpertParallel:
    """Keep this rank's slice of a full experts module (the same weights on every rank) and wrap it.

    Every parameter and buffer of the module itself whose first dim is E is cut to this rank's experts, in place
    (submodules such as a post-expert norm are shared by all experts and stay whole); `num_experts` becomes local.
    """
    group = _group_or_world(group)
    total = layers.dims(experts)[0]
    facts = facts_of(group, total, same_tokens)
    choose(facts, strategy)  # refuses before any weight is cut
    per_rank = total // facts.world_size
    first = dist.get_rank(group) * per_rank
    for name, tensor in [*experts.named_parameters(recurse=False), *experts.named_buffers(recurse=False)]:
        if tensor.dim() and tensor.shape[0] == total:
            piece = tensor.detach()[first : first + per_rank].clone()
            if isinstance(tensor, torch.nn.Parameter):
                setattr(experts, name, torch.nn.Parameter(piece, requires_grad=tensor.requires_grad))
            else:
                setattr(experts, name, piece)
    if hasattr(experts, "num_experts"):
        experts.num_experts = per_rank
    return ExpertParallel(experts, group, total, strategy, same_tokens, implementation, capacity)


def parallelize_experts(
    model: torch.nn.Module,
    group: dist.ProcessGroup | None = None,
    strategy: str = AUTO,
    same_tokens: bool = False,
    implementation: str | None = None,
    capacity: int | None = None,
) -> list[str]:
    """Replace every `selector.experts` module of a model tree by its `shard_experts` wrapper, in place.

    Returns the paths replaced. The model's own router still produces global ids; the wrappers take them.
    """
    found = [(path, m) for path, m in model.named_modules() if path and is_experts_module(m)]
    for path, module in found:
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, attr, shard_experts(module, group, strategy, same_tokens, implementation, capacity))
    return [path for path, _ in found]


__all__ = [
    "ExpertParallel",
    "capturing_now",
    "expert_parallel_forward",
    "facts_of",
    "parallelize_experts",
    "shard_experts",
]
