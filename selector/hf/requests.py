"""Requests for a Transformers model's experts: the names accepted, checking a request, set and get."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from selector.hf.modules import sub_config_keys
from selector.hf.names import EAGER
from selector.hf.registration import register_with_transformers
from selector.hf.version import check_transformers


def accepted_names() -> list[str]:
    """Every name Transformers' experts interface accepts now (after registering selector's)."""
    moe = check_transformers()
    names = {EAGER, *moe.ALL_EXPERTS_FUNCTIONS.keys()}
    try:
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS

        names |= set(ALL_FP8_EXPERTS_FUNCTIONS.keys())
    except ImportError:  # pragma: no cover - older layouts
        pass
    return sorted(names)


def validate_request(config: Any, request: str | Mapping[str, str]) -> dict[str, str]:
    """Check names and sub-config keys before anything loads; returns the request as a dict.

    Raises ValueError for an unknown name (listing the accepted ones) and for a dict key that matches no
    sub-config of `config` (listing its keys). A name that is known but cannot run here is not an error
    yet: the first forward raises, as for Transformers' own names.
    """
    if not isinstance(request, (str, Mapping)):
        raise TypeError(f"experts_implementation is a name, \"auto\" or {{sub-config key: name}}, "
                        f"got {type(request).__name__} {request!r}; accepted names: {', '.join(accepted_names())}")
    register_with_transformers()
    request_dict = {"": request} if isinstance(request, str) else dict(request)
    keys = sub_config_keys(config) if config is not None else []
    unknown_keys = sorted(k for k in request_dict if k != "" and k not in keys)
    if unknown_keys:
        known = ", ".join(repr(k) for k in keys) or "none"
        raise ValueError(
            f"experts_implementation key(s) {', '.join(map(repr, unknown_keys))} match no sub-config of "
            f"{type(config).__name__}; its sub-config keys: {known} (and '' for the whole model)"
        )
    names = accepted_names()
    for key, name in request_dict.items():
        if not isinstance(name, str) or name not in names:
            where = f" for key {key!r}" if key else ""
            raise ValueError(
                f"unknown experts implementation {name!r}{where}; accepted: {', '.join(names)}. "
                "Third-party selector backends register through the 'selector.backends' entry points; "
                "`selector plugins` lists what loaded."
            )
    return request_dict


def set_experts_implementation(model: torch.nn.Module, implementation: str | Mapping[str, str]) -> None:
    """`model.set_experts_implementation(...)` with selector's checks: unknown names or sub-config keys raise."""
    request = validate_request(getattr(model, "config", None), implementation)
    model.set_experts_implementation(request if not isinstance(implementation, str) else implementation)


def get_experts_implementation(model: torch.nn.Module) -> dict[str, str | None]:
    """{"": the model's own, sub-config key: its own, ...}, as Transformers reports it."""
    return dict(model.get_experts_implementation())
