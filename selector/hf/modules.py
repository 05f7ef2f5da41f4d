"""Finding the experts modules of a Transformers model, the sub-config each belongs to, and their shape in words."""

from __future__ import annotations

from typing import Any

import torch

from selector import dispatch
from selector.layers import find_experts, is_transformers_experts


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
