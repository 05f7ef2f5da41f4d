"""Expert parallelism over torch.distributed: every selector backend as the local experts of a layer whose
experts are spread over the ranks of a process group.

`selector.parallel.strategies` declares the strategies and chooses one without torch; the layer and the
exchanges (`layer`, `exchange`) load torch.distributed on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from selector.parallel.strategies import (
    AUTO,
    PREFERENCE,
    STRATEGIES,
    ParallelFacts,
    Strategy,
    check_strategy,
    choose,
    explain,
    version_text,
)

if TYPE_CHECKING:
    from selector.parallel.exchange import all_reduce_forward, all_to_all_forward, all_to_all_padded_forward
    from selector.parallel.status import ExpertParallelError
    from selector.parallel.layer import (
        ExpertParallel,
        capturing_now,
        expert_parallel_forward,
        facts_of,
        parallelize_experts,
        shard_experts,
    )

_LAZY = {
    "ExpertParallel": "layer",
    "expert_parallel_forward": "layer",
    "facts_of": "layer",
    "parallelize_experts": "layer",
    "shard_experts": "layer",
    "capturing_now": "layer",
    "all_reduce_forward": "exchange",
    "all_to_all_forward": "exchange",
    "all_to_all_padded_forward": "exchange",
    "ExpertParallelError": "status",
}


def __getattr__(name: str) -> Any:
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'selector.parallel' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"selector.parallel.{where}"), name)


__all__ = [
    "AUTO",
    "PREFERENCE",
    "STRATEGIES",
    "ExpertParallel",
    "ExpertParallelError",
    "ParallelFacts",
    "Strategy",
    "all_reduce_forward",
    "all_to_all_forward",
    "all_to_all_padded_forward",
    "capturing_now",
    "check_strategy",
    "choose",
    "expert_parallel_forward",
    "explain",
    "facts_of",
    "parallelize_experts",
    "shard_experts",
    "version_text",
]
