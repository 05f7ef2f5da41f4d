"""Model API for any nn.Module tree: decorate an experts class, then choose its backend by name, "auto" or dict.

    @selector.experts(has_bias=True)
    class MyExperts(nn.Module): ...            # gate_up_proj, down_proj, act_fn, num_experts as Transformers'

    selector.set_experts_implementation(model, "auto")               # or "grouped_mm"
    selector.set_experts_implementation(model, {"": "auto", "vision_config": "eager"})
    selector.get_experts_implementation(model)  -> {"": "auto", "vision_config": "eager"}

A name is checked against the registry at once (unknown -> ValueError listing the names). Whether it can
run on this machine and this layer is checked at the first forward, which raises ImportError or ValueError
with the reason and the fix; "auto" picks the best runnable backend per token-count bucket instead.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Mapping
from functools import wraps
from typing import Any, TypeVar

import torch

from selector import dispatch, layers
from selector.dispatch import AUTO, explain_module, last_backend, reset_selection_caches, run_experts
from selector.gates import Gate
from selector.types import Ranking, Status

_BACKBONE = "_selector_backbone"  # the sub-config key this module answers to
logger = logging.getLogger("selector")

M = TypeVar("M", bound=type)


def experts(
    cls: M | None = None,
    *,
    has_gate: bool = True,
    has_bias: bool = False,
    is_transposed: bool = False,
    is_concatenated: bool = True,
    has_post_expert_norm: bool = False,
    gate_fn: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor] | None = None,
    gate: Gate | None = None,
    backbone: str | None = None,
    replace_forward: bool = False,
) -> Any:
    """Class decorator: the module's forward(hidden_states, top_k_index, top_k_weights) runs the chosen backend.

    Flags as Transformers' `use_experts_implementation`: `is_concatenated=False` means interleaved gate/up
    channels; `gate_fn(module, gate_up_out) -> gated` replaces act(gate) * up (GPT-OSS style gates);
    `gate=selector.Gate("clamped_swiglu", alpha=1.702, limit=7.0)` declares the gate as data (selector.gates),
    so fused kernels that declare it run it in their epilogue; torch backends run `gate_fn` or the class's own
    `_apply_gate` when there is one (they must compute the declared gate), else the gate's torch form.
    `backbone` names the sub-config key that dict requests use for this module.

    The decorator installs its own `forward`. A class that defines `forward` itself gets a `UserWarning`
    (its method would never run: the selected backend computes the layer from the weights); pass
    `replace_forward=True` to say that is intended (e.g. a forward kept as the reference).
    """

    if gate is not None and not isinstance(gate, Gate):
        raise TypeError(f"selector.experts(gate=...) takes a selector.Gate, got {type(gate).__name__} {gate!r}")

    def wrap(klass: M) -> M:
        if not isinstance(klass, type):
            raise TypeError(f"selector.experts decorates a class, got {klass!r}")
        if "forward" in klass.__dict__ and not replace_forward:
            warnings.warn(
                f"selector.experts: {klass.__qualname__} defines forward() itself, and the decorator replaces it "
                "with the selected backend's, so that method never runs; remove it, or pass "
                "replace_forward=True to say it is meant",
                UserWarning,
                stacklevel=2 if cls is None else 3,
            )
        original_init = klass.__init__

        @wraps(original_init)
        def __init__(self: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
            original_init(self, *args, **kwargs)
            self.has_gate = has_gate
            self.has_bias = has_bias
            self.is_transposed = is_transposed
            self.is_concatenated = is_concatenated
            self.has_post_expert_norm = has_post_expert_norm
            self._is_expert_parallel = getattr(self, "_is_expert_parallel", False)
            if backbone is not None:
                self.__dict__[_BACKBONE] = backbone
            dispatch.track(self)

        def forward(
            self: torch.nn.Module,
            hidden_states: torch.Tensor,
            top_k_index: torch.Tensor,
            top_k_weights: torch.Tensor,
        ) -> torch.Tensor:
            return run_experts(self, hidden_states, top_k_index, top_k_weights)

        klass.__init__ = __init__
        klass.forward = forward
        if gate_fn is not None:
            klass._apply_gate = gate_fn
        elif gate is not None and getattr(klass, "_apply_gate", layers.default_apply_gate) is layers.default_apply_gate:
            klass._apply_gate = layers.declared_apply_gate
        elif not hasattr(klass, "_apply_gate"):
            klass._apply_gate = layers.default_apply_gate
        if gate is not None:
            klass.selector_gate = gate
        setattr(klass, layers.DECORATED, True)
        return klass

    return wrap(cls) if cls is not None else wrap


def is_experts_module(module: torch.nn.Module) -> bool:
    """An experts module whose class `selector.experts` decorated."""
    return layers.is_decorated(module)


def _scope_of(model: torch.nn.Module, module: torch.nn.Module) -> str:
    """The sub-config key of an experts module: its declared backbone, or the sub-config its config is."""
    declared = module.__dict__.get(_BACKBONE)
    if declared is not None:
        return declared
    root_config, own_config = getattr(model, "config", None), getattr(module, "config", None)
    if root_config is None or own_config is None or own_config is root_config:
        return ""
    for key in getattr(root_config, "sub_configs", {}) or {}:
        if getattr(root_config, key, None) is own_config:
            return key
    return ""


def experts_scopes(model: torch.nn.Module) -> dict[str, list[tuple[str, torch.nn.Module]]]:
    """{sub-config key: [(module path, experts module), ...]}; "" is the model's own scope."""
    scopes: dict[str, list[tuple[str, torch.nn.Module]]] = {}
    for path, module in layers.find_experts(model):
        if is_experts_module(module):
            scopes.setdefault(_scope_of(model, module), []).append((path, module))
    return scopes


def set_experts_implementation(model: torch.nn.Module, implementation: str | Mapping[str, str]) -> None:
    """Choose the backend of every experts module, at any time, without reloading.

    `implementation`: a name, "auto", or {sub-config key: name} with "" for the whole model.
    A Transformers model (no selector-decorated modules, Transformers' experts interface) is handed to
    `selector.hf.set_experts_implementation`, which sets the same through Transformers' own call.
    """
    if not isinstance(implementation, (str, Mapping)):
        raise TypeError(f"an experts implementation is a backend name, \"auto\" or {{sub-config key: name}}, "
                        f"got {type(implementation).__name__} {implementation!r}")
    if _is_transformers_model(model):
        from selector import hf

        hf.set_experts_implementation(model, implementation)
        return
    request = {"": implementation} if isinstance(implementation, str) else dict(implementation)
    scopes = experts_scopes(model)
    unknown = sorted(k for k in request if k != "" and k not in scopes)
    if unknown:
        known = ", ".join(repr(k) for k in sorted(scopes) if k) or "none (only the '' key applies)"
        raise ValueError(f"no experts modules under sub-config key(s) {unknown}; this model's keys: {known}")
    for name in request.values():
        dispatch.check_backend_name(name)
    for key, members in scopes.items():
        name = request.get(key, request.get(""))
        if name is None:
            continue
        for _, module in members:
            dispatch.set_requested_implementation(module, name)
    previous = model.__dict__.get("_selector_request", {})
    model.__dict__["_selector_request"] = {**previous, **request}


def _is_transformers_model(model: torch.nn.Module) -> bool:
    """No selector-decorated modules, and Transformers' experts interface: the adapter answers for it."""
    return not any(is_experts_module(m) for m in model.modules()) and hasattr(model, "set_experts_implementation")


def get_experts_implementation(model: torch.nn.Module) -> dict[str, str]:
    """{"": whole-model choice, sub-config key: its choice, ...} as currently set.

    For a Transformers model, what Transformers holds (e.g. "selector:batched_mm" after
    `set_experts_implementation(model, "selector:batched_mm")`), as `selector.hf.get_experts_implementation`.
    """
    if _is_transformers_model(model):
        from selector import hf

        return {k: v for k, v in hf.get_experts_implementation(model).items() if v is not None}
    request = model.__dict__.get("_selector_request", {})
    result = {"": request.get("", AUTO)}
    for key, members in experts_scopes(model).items():
        result[key] = dispatch.requested_implementation(members[0][1])
    return result


def _experts_members(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(path, experts module) for every decorated module and every Transformers experts module."""
    return layers.find_experts(model)


def _declares_top_k(module: torch.nn.Module) -> bool:
    return bool(getattr(module, "top_k", 0) or getattr(getattr(module, "config", None), "num_experts_per_tok", 0))


def explain_model(
    model: torch.nn.Module, num_tokens: int | None = None, top_k: int | None = None
) -> dict[str, Ranking]:
    """The ranking behind each experts module's choice: {module path: Ranking}, for logs and `doctor`.

    Decorated modules and Transformers' experts modules alike. k is `top_k` when given, else that of the
    module's last call, else what the module (`top_k`) or its config (`num_experts_per_tok`) declares; a
    module with none of these is ranked with k=1 and a warning is logged saying so.
    """
    out: dict[str, Ranking] = {}
    for path, module in _experts_members(model):
        k = top_k
        if k is None:
            k = dispatch.traced_top_k(module)
            if last_backend(module) is None and not _declares_top_k(module):
                logger.warning(
                    "explain_model: %s has not run yet and declares no top_k; ranking with k=%d is a guess "
                    "(pass top_k=, or run one forward first)", path or type(module).__name__, k,
                )
        out[path] = explain_module(module, num_tokens=num_tokens, top_k=k)
    return out


__all__ = [
    "AUTO",
    "last_backend",
    "Status",
    "experts",
    "experts_scopes",
    "explain_model",
    "explain_module",
    "get_experts_implementation",
    "reset_selection_caches",
    "run_experts",
    "set_experts_implementation",
]
