"""The expert-parallel experts module: this rank's local experts behind the global experts interface.

    group = torch.distributed.new_group(...)             # or None: the default world
    layer = ExpertParallel(local_experts, group, num_experts=64)
    out = layer(hidden_states, top_k_index, top_k_weights)  # global expert ids, this rank's tokens

    shard_experts(experts, group)          # a full decorated experts module -> ExpertParallel of this rank's slice
    parallelize_experts(model, group)      # every selector experts module of a model tree, in place
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from selector import dispatch, layers
from selector.model import is_experts_module
from selector.parallel.exchange import FORWARDS
from selector.parallel.strategies import AUTO, ParallelFacts, choose, explain
from selector.types import Availability


def _group_or_world(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return None


def facts_of(group: dist.ProcessGroup | None, num_experts: int, same_tokens: bool = False) -> ParallelFacts:
    """The facts a strategy is judged against, read off the group (the default world when `group` is None)."""
    group = _group_or_world(group)
    if group is None:
        return ParallelFacts(False, 0, None, num_experts, same_tokens)
    return ParallelFacts(True, dist.get_world_size(group), str(dist.get_backend(group)), num_experts, same_tokens)


class ExpertParallel(torch.nn.Module):
    """Experts spread over a process group: forward(hidden [T,H], top_k_index [T,k] global ids, weights) -> [T,H].

    `experts` holds this rank's `num_experts / world` experts (the rank r holds global ids r*E/w .. (r+1)*E/w-1)
    and is marked expert-parallel here. `strategy`: "all_to_all", "all_reduce" or "auto" (all_to_all where it
    runs); `same_tokens=True` promises every rank holds the same tokens, which all_reduce needs.
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
    ) -> None:
        super().__init__()
        self.experts = experts
        self.group = _group_or_world(group)
        local = layers.dims(experts)[0]
        world = dist.get_world_size(self.group) if self.group is not None else 1
        self.num_experts = int(num_experts) if num_experts is not None else local * world
        self.facts = facts_of(self.group, self.num_experts, same_tokens)
        self.strategy = choose(self.facts, strategy)  # ValueError with the reason when it cannot run
        if local * world != self.num_experts:
            raise ValueError(
                f"the local experts module holds {local} experts; {self.num_experts} experts over {world} ranks "
                f"means {self.num_experts // world} per rank"
            )
        experts._is_expert_parallel = True
        dispatch.forget_module(experts)
        self.implementation = implementation
        self.rank = dist.get_rank(self.group)
        self.first_expert = self.rank * local

    def explain(self) -> dict[str, Availability]:
        """Every strategy's verdict for this layer and group, in the order `auto` tries them."""
        return explain(self.facts)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        forward = FORWARDS[self.strategy]
        return forward(
            self.experts, self.group, self.num_experts, hidden_states, top_k_index, top_k_weights, self.implementation
        )

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
) -> torch.Tensor:
    """One expert-parallel call without a wrapper module (the strategy is chosen on every call)."""
    group = _group_or_world(group)
    name = choose(facts_of(group, num_experts, same_tokens), strategy)
    local._is_expert_parallel = True
    return FORWARDS[name](local, group, num_experts, hidden_states, top_k_index, top_k_weights, implementation)


def shard_experts(
    experts: torch.nn.Module,
    group: dist.ProcessGroup | None = None,
    strategy: str = AUTO,
    same_tokens: bool = False,
    implementation: str | None = None,
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
    return ExpertParallel(experts, group, total, strategy, same_tokens, implementation)


def parallelize_experts(
    model: torch.nn.Module,
    group: dist.ProcessGroup | None = None,
    strategy: str = AUTO,
    same_tokens: bool = False,
    implementation: str | None = None,
) -> list[str]:
    """Replace every `selector.experts` module of a model tree by its `shard_experts` wrapper, in place.

    Returns the paths replaced. The model's own router still produces global ids; the wrappers take them.
    """
    found = [(path, m) for path, m in model.named_modules() if path and is_experts_module(m)]
    for path, module in found:
        parent_path, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        setattr(parent, attr, shard_experts(module, group, strategy, same_tokens, implementation))
    return [path for path, _ in found]


__all__ = ["ExpertParallel", "expert_parallel_forward", "facts_of", "parallelize_experts", "shard_experts"]
