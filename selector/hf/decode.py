"""The decode phase of `generate()`: selector's grouped_mm runs as its batched_mm on accelerators.

Transformers (>= 5.14) already swaps its own "grouped_mm" for "batched_mm" during the decode steps on
non-CPU devices (from 5.25 not on MPS with torch >= 2.15, whose grouped_mm has a native kernel). selector
extends that same hook (`GenerationMixin._optimize_model_for_decode`) so
"selector:grouped_mm" swaps to "selector:batched_mm" the same way, per sub-config, restored when generation
ends or raises. "auto" needs no swap: it re-ranks per token-count bucket on every call. The hook also marks
the decode steps (`in_decode_phase`), which quantised "auto" reads when it falls back to Transformers' FP8
functions.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from selector.hf.modules import experts_modules
from selector.hf.names import DECODE_SWAPS, HOOK_WRAPS_ATTR

logger = logging.getLogger("selector.hf")

_DECODING: contextvars.ContextVar[bool] = contextvars.ContextVar("selector_hf_decoding", default=False)


def _mps_keeps_grouped_mm() -> bool:
    """Transformers 5.25+ keeps "grouped_mm" for the decode steps on MPS with torch >= 2.15 (a native kernel)."""
    import transformers

    from selector.requirements import version_tuple

    return version_tuple(transformers.__version__)[:2] >= (5, 25) and version_tuple(torch.__version__)[:2] >= (2, 15)


def _default_accelerator_check(device: torch.device) -> bool:
    # the rule of the installed Transformers' own hook: every device but the CPU (and MPS where it keeps grouped_mm)
    if device.type == "cpu":
        return False
    return not (device.type == "mps" and _mps_keeps_grouped_mm())


_accelerator_check: Callable[[torch.device], bool] = _default_accelerator_check


def set_accelerator_check(check: Callable[[torch.device], bool] | None) -> None:
    """Decide which devices get the decode swap (default: Transformers' rule). None restores it.

    Tests use it to run the GPU branch on a CPU; nothing else should need it.
    """
    global _accelerator_check
    _accelerator_check = check or _default_accelerator_check


def on_accelerator(device: torch.device) -> bool:
    """Whether `device` gets the decode-phase rule (see `set_accelerator_check`)."""
    return _accelerator_check(device)


def in_decode_phase() -> bool:
    """True inside the decode steps of `generate()` (set by the hook this module installs)."""
    return _DECODING.get()


def _scope_device(model: torch.nn.Module, members: Sequence[tuple[str, torch.nn.Module]]) -> torch.device:
    for _, module in members:
        weight = getattr(module, "gate_up_proj", None)
        if weight is None:
            weight = getattr(module, "up_proj", None)
        if isinstance(weight, torch.Tensor):
            return weight.device
    device = getattr(model, "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")


def decode_request(model: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """(current request, request for the decode steps): selector's grouped_mm -> batched_mm on accelerators."""
    current = dict(model.get_experts_implementation())
    target = dict(current)
    if not any(isinstance(name, str) and name in DECODE_SWAPS for name in current.values()):
        return current, target  # the common case: nothing to walk
    scopes = experts_modules(model)
    for key, name in current.items():
        swap = DECODE_SWAPS.get(name) if isinstance(name, str) else None
        if swap is None:
            continue
        members = scopes.get(key, [])
        if key == "" and not members:  # the model's own key: follow the experts it holds, else its device
            members = [m for group in scopes.values() for m in group]
        if on_accelerator(_scope_device(model, members)):
            target[key] = swap
    return current, target


@contextmanager
def decode_phase(model: torch.nn.Module) -> Iterator[None]:
    """The decode steps of generate(): selector's grouped_mm runs as batched_mm, restored on exit or error."""
    current, target = decode_request(model)
    if target == current:
        yield
        return
    logger.info("selector: decode steps: %s", _changes(current, target))
    model.set_experts_implementation(target)
    try:
        yield
    finally:
        model.set_experts_implementation(current)


def _changes(current: Mapping[str, Any], target: Mapping[str, Any]) -> str:
    return ", ".join(f"{k or '(model)'}: {current[k]} -> {v}" for k, v in target.items() if current.get(k) != v)


def install_decode_hook() -> None:
    """Wrap GenerationMixin._optimize_model_for_decode (once): ours outside, Transformers' own swap inside."""
    try:
        from transformers.generation.utils import GenerationMixin
    except ImportError:  # pragma: no cover
        return
    original = GenerationMixin.__dict__.get("_optimize_model_for_decode")
    if original is None:
        logger.warning(
            "selector: this Transformers has no GenerationMixin._optimize_model_for_decode; "
            "selector's grouped_mm is not swapped for batched_mm during decode ('auto' still adapts per call)"
        )
        return
    if getattr(original, HOOK_WRAPS_ATTR, None) is not None:
        return

    def _optimize_model_for_decode(self: Any) -> Any:
        return _composed_decode(self, original)

    setattr(_optimize_model_for_decode, HOOK_WRAPS_ATTR, original)
    _optimize_model_for_decode.__doc__ = getattr(original, "__doc__", None)
    GenerationMixin._optimize_model_for_decode = _optimize_model_for_decode  # type: ignore[assignment]


@contextmanager
def _composed_decode(model: Any, original: Callable[[Any], Any]) -> Iterator[None]:
    token = _DECODING.set(True)  # read by quantised "auto" when it falls back to Transformers' FP8 functions
    try:
        with decode_phase(model), original(model):
            yield
    finally:
        _DECODING.reset(token)
