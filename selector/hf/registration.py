"""Registering "auto" and every selector backend as Transformers experts implementations.

Names (decided once, in `register_with_transformers`):
- "auto": selector picks the backend per layer and per token-count bucket.
- "selector:<backend>" for every backend in selector's registry (built-in and third-party).
- "<backend>" as well, for every selector backend whose name Transformers does not already use
  (e.g. "triton_fused"). Transformers' own names ("eager", "batched_mm", "grouped_mm", "deepgemm",
  "sonicmoe", ...) keep meaning Transformers' own functions: importing selector never changes what an
  existing name runs. "eager" is always the module's original loop.

Every selector name runs through `selector.dispatch.run_experts` (quantised "auto" through
`selector.hf.quantized`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from selector import dispatch
from selector.hf.decode import install_decode_hook
from selector.hf.names import AUTO, EAGER, FORWARD_REQUEST_ATTR, PREFIX
from selector.hf.quantized import adopt_quantized, quantized_auto
from selector.hf.version import check_transformers

logger = logging.getLogger("selector.hf")

_LOCK = threading.RLock()
_FORWARDS: dict[tuple[bool, str], Callable[..., torch.Tensor]] = {}  # (fp8 interface?, name) -> our function
_LOGGED: set[tuple[Any, ...]] = set()  # (problem, token bucket, backend) that "auto" already logged


def _make_forward(request: str, quantized: bool = False) -> Callable[..., torch.Tensor]:
    """The function Transformers calls for one name: selector's dispatch with that request.

    `quantized`: the function for Transformers' FP8 experts interface (FP8Experts modules, fp8 or fp4
    weights): the module is marked with the selector_* quantisation attributes first, and "auto" falls back
    to Transformers' own FP8 functions where no selector backend takes the format.
    """

    def selector_experts_forward(
        module: torch.nn.Module,
        hidden_states: torch.Tensor,  # [T, H]
        top_k_index: torch.Tensor,  # [T, k]
        top_k_weights: torch.Tensor,  # [T, k]
    ) -> torch.Tensor:  # [T, H]
        if quantized:
            adopt_quantized(module, hidden_states.dtype)
            if request == AUTO:
                return quantized_auto(module, hidden_states, top_k_index, top_k_weights)
        out = dispatch.run_experts(module, hidden_states, top_k_index, top_k_weights, implementation=request)
        if request == AUTO and not torch.compiler.is_compiling() and logger.isEnabledFor(logging.INFO):
            _log_auto_choice(module, hidden_states.shape[0], top_k_index.shape[1])
        return out

    kind = "fp8 " if quantized else ""
    selector_experts_forward.__qualname__ = selector_experts_forward.__name__ = (
        f"selector_experts_forward[{kind}{request}]"
    )
    setattr(selector_experts_forward, FORWARD_REQUEST_ATTR, request)
    return selector_experts_forward


def _log_auto_choice(module: torch.nn.Module, num_tokens: int, top_k: int) -> None:
    name = dispatch.last_backend(module)
    problem = dispatch.problem_of(module, top_k)
    key = (problem, dispatch.token_bucket(num_tokens), name)
    if key in _LOGGED:
        return
    _LOGGED.add(key)
    logger.info(
        "selector auto: %s experts layer (%s), %d tokens (bucket %d) -> %s",
        type(module).__name__,
        problem.describe(tokens=False),
        num_tokens,
        key[1],
        name,
    )


def _ours(fn: object) -> str | None:
    return getattr(fn, FORWARD_REQUEST_ATTR, None)


def _interfaces(moe: Any) -> list[tuple[Any, bool]]:
    """[(experts interface, holds quantised modules)]: the dense one, and the FP8 one where it exists."""
    out = [(moe.ALL_EXPERTS_FUNCTIONS, False)]
    try:
        from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
    except ImportError:  # pragma: no cover - a Transformers without FP8 experts
        return out
    return out + [(ALL_FP8_EXPERTS_FUNCTIONS, True)]


def transformers_names() -> dict[str, str]:
    """{name Transformers accepts: selector request it runs} for every name selector registered."""
    return register_with_transformers()


def register_with_transformers() -> dict[str, str]:
    """Register "auto" and every selector backend into Transformers' experts interfaces. Idempotent.

    Both interfaces get the same names: the dense one and, where Transformers has it, the FP8 one (its
    FP8Experts modules dispatch through it). Calling it again after a plugin was added registers the new
    names and drops those of backends that left. Also installs the decode-phase hook (`selector.hf.decode`).
    Returns {Transformers name: selector request}. Raises ImportError when Transformers is missing or too old.
    """
    moe = check_transformers()
    interfaces = _interfaces(moe)
    registry = dispatch.get_backend_registry()
    with _LOCK:
        existing = [dict(interface.items()) for interface, _ in interfaces]
        wanted: dict[str, str] = {AUTO: AUTO}
        for backend in registry.names:
            wanted[PREFIX + backend] = backend
            # the bare name only where no interface of Transformers uses it for its own function
            if backend != EAGER and all(backend not in held or _ours(held[backend]) == backend for held in existing):
                wanted[backend] = backend
        for (interface, quantized), held in zip(interfaces, existing):
            mapping = type(interface)._global_mapping
            for key in [k for k in _FORWARDS if k[0] == quantized and k[1] not in wanted]:  # backend gone
                if _ours(mapping.get(key[1])) is not None:
                    del mapping[key[1]]
                del _FORWARDS[key]
            for name, request in wanted.items():
                fn = _FORWARDS.get((quantized, name))
                if fn is None or _ours(fn) != request:
                    fn = _FORWARDS[(quantized, name)] = _make_forward(request, quantized)
                if held.get(name) is not fn:
                    type(interface).register(name, fn)
        install_decode_hook()
        return dict(wanted)


def register_on_import() -> None:
    """Register now if Transformers is usable; otherwise log why at DEBUG (the loaders raise it again)."""
    try:
        register_with_transformers()
    except ImportError as exc:  # from_pretrained and friends raise it again, with the same message
        logger.debug("selector.hf: not registered with Transformers: %s", exc)
