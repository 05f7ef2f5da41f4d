"""Finding the experts modules of a Transformers model, the sub-config each belongs to, and their shape in words."""

from __future__ import annotations

from typing import Any

import torch

from selector import dispatch
from selector.layers import find_experts, is_transformers_experts
from selector.types import Problem


def sub_config_keys(config: Any) -> list[str]:
    """The keys of `config`'s sub-configs that are set (e.g. "text_config", "vision_config")."""
    return [k for k in (getattr(config, "sub_configs", None) or {}) if getattr(config, k, None) is not None]


def _scope_of(root_config: Any, module_config: Any) -> str:
    if module_config is root_config:
        return ""
    for key in sub_config_keys(root_config):
        if getattr(root_config, key) is module_config:
            return key
    return ""


def experts_modules(model: torch.nn.Module) -> dict[str, list[tuple[str, torch.nn.Module]]]:
    """{sub-config key ("" for the model's own config): [(module path, experts module), ...]}."""
    root_config = getattr(model, "config", None)
    out: dict[str, list[tuple[str, torch.nn.Module]]] = {}
    for path, module in find_experts(model):
        if is_transformers_experts(module):
            dispatch.track(module)  # so torch.compile can name it (see selector.dispatch.track)
            out.setdefault(_scope_of(root_config, module.config), []).append((path, module))
    return out


def describe_problem(problem: Problem) -> str:
    """One experts layer as logs and reports show it: "E=.. H=.. I=.. k=.. dtype device activation [flags]"."""
    flags = [
        f"E={problem.num_experts}",
        f"H={problem.hidden_size}",
        f"I={problem.intermediate_size}",
        f"k={problem.top_k}",
        problem.dtype,
        problem.device,
        problem.activation if problem.gate.is_default else problem.gate.label(),
    ]
    flags += [
        name
        for name, on in (
            ("bias", problem.has_bias),
            ("transposed", problem.is_transposed),
            ("interleaved", problem.interleaved),
            ("custom-gate", problem.custom_gate),
            ("post-norm", problem.post_expert_norm),
        )
        if on
    ]
    if problem.weight_format != "dense":
        flags.append(f"{problem.weight_format}/{problem.scale_format}")
    return " ".join(flags)
