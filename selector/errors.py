"""Errors a user sees, built from an Availability so every message says what, what was found, and the fix."""

from __future__ import annotations

from selector.types import Availability


class ExpertsInputError(ValueError):
    """Inputs to an experts layer that no backend should run: wrong shapes, dtypes, ids or weights."""


def unavailable_error(name: str, verdict: Availability) -> Exception:
    """ImportError (something missing) or ValueError (configuration unsupported) for a requested backend."""
    parts = [f"experts backend {name!r} cannot run here: {verdict.reason}"]
    if verdict.found:
        parts.append(f"found: {verdict.found}")
    if verdict.remedy:
        parts.append(f"fix: {verdict.remedy}")
    parts.append("`selector doctor` lists every backend and why it can or cannot run")
    return verdict.status.error_type(". ".join(parts) + ".")
