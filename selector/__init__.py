"""selector: picks the fastest correct Mixture-of-Experts experts backend for this machine, and explains why.

Public API: the types plugins declare (`BackendSpec`, `Requirements`, `ToolkitRule`, `hookimpl`, `Gate`, and the
`ExpertsPlan` a backend prepares per layer, with `GraphPolicy`), the model
API (`experts`, `set_experts_implementation`, `get_experts_implementation`, `explain_model`), the dispatch
core's (`run_experts`, `last_backend`, `explain_module`, `reset_selection_caches`), `check` (raise what the
device-side routing guard recorded), and the ranking (`rank`,
`Problem`, `Ranking`, `Availability`, `Status`), and `TuningRecord`, one measured time as the tuning store keeps
it. Helpers for a plugin's own tests are in `selector.testing`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from selector.gates import Gate
from selector.hookspecs import ENTRY_POINT_GROUP, hookimpl
from selector.types import (
    Availability,
    BackendSpec,
    Candidate,
    ExpertsPlan,
    ForwardPlan,
    GraphPolicy,
    Problem,
    Ranking,
    Requirements,
    Status,
    ToolkitRule,
)

__version__ = "0.1.0"

# The model API imports torch; load it on first use so `selector doctor` starts fast.
_LAZY = {
    "experts": "selector.model",
    "set_experts_implementation": "selector.model",
    "get_experts_implementation": "selector.model",
    "explain_model": "selector.model",
    "reset_selection_caches": "selector.dispatch",
    "run_experts": "selector.dispatch",
    "last_backend": "selector.dispatch",
    "explain_module": "selector.dispatch",
    "check": "selector.guard",
    "rank": "selector.ranking",
    "get_registry": "selector.registry",
    "register_plugin": "selector.registry",
    "current_environment": "selector.environment",
    "set_environment": "selector.environment",
    "from_pretrained": "selector.hf",
    "from_config": "selector.hf",
    "tune_model": "selector.tune.model",
    "TuningRecord": "selector.tuning",
}

if TYPE_CHECKING:
    from selector.dispatch import explain_module, last_backend, reset_selection_caches, run_experts
    from selector.environment import current_environment, set_environment
    from selector.guard import check
    from selector.hf import from_config, from_pretrained
    from selector.model import experts, explain_model, get_experts_implementation, set_experts_implementation
    from selector.ranking import rank
    from selector.registry import get_registry, register_plugin
    from selector.tune.model import tune_model
    from selector.tuning import TuningRecord


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'selector' has no attribute {name!r}")


__all__ = [
    "ENTRY_POINT_GROUP",
    "Availability",
    "BackendSpec",
    "Candidate",
    "ExpertsPlan",
    "ForwardPlan",
    "Gate",
    "GraphPolicy",
    "Problem",
    "Ranking",
    "Requirements",
    "Status",
    "ToolkitRule",
    "__version__",
    "hookimpl",
    *_LAZY,
]
