"""Errors a user sees, built from an Availability so every message says what, what was found, and the fix."""

from __future__ import annotations

from selector.types import Availability


class ExpertsInputError(ValueError):
    """Inputs to an experts layer that no backend should run: wrong shapes, dtypes, ids or weights."""


class PluginUnavailableError(ImportError, ValueError):
    """A backend asked for by name that is not registered because of its plugin (blocked, not allowed, or broken).

    An ImportError (something is missing here) and, for callers that catch the unknown-name error, a ValueError."""


def unavailable_error(name: str, verdict: Availability) -> Exception:
    """ImportError (something missing) or ValueError (configuration unsupported) for a requested backend."""
    parts = [f"experts backend {name!r} cannot run here: {verdict.reason}"]
    if verdict.found:
        parts.append(f"found: {verdict.found}")
    if verdict.remedy:
        parts.append(f"fix: {verdict.remedy}")
    parts.append("`selector doctor` lists every backend and why it can or cannot run")
    return verdict.status.error_type(". ".join(parts) + ".")


def routing_fault_message(
    layer: str, bad_ids: int, bad_weights: int, value: int, num_experts: int | None, expert_parallel: bool
) -> str:
    """What the device-side routing guard saw in one layer: which layer, how many bad entries, one bad value."""
    parts = []
    if bad_ids:
        allowed = f"[0, {num_experts})" if num_experts is not None else "[0, num_experts)"
        if expert_parallel:
            allowed += f" or the expert-parallel sentinel {num_experts}"
        parts.append(f"{bad_ids} expert id(s) outside {allowed} (one was {value})")
    if bad_weights:
        parts.append(f"{bad_weights} NaN or infinite routing weight(s)")
    return (
        f"experts layer {layer}: top_k_index / top_k_weights held {' and '.join(parts)}; the tokens routed "
        "through them got NaN outputs, every other token was computed normally. Fix the router's output "
        "(selector.check() raises this at once after a CUDA-graph replay; SELECTOR_VALIDATE=full checks every "
        "call on the host)"
    )
