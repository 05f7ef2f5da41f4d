"""The probe facts this process works from: collected once, or injected (tests, the daemon)."""

from __future__ import annotations

from selector.daemon.client import environment_from_daemon
from selector.probes import Environment, collect_environment

_CURRENT: Environment | None = None


def current_environment() -> Environment:
    """Facts from the node daemon when one answers (probed once per node), else probed here."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = environment_from_daemon() or collect_environment()
    return _CURRENT


def set_environment(env: Environment | None) -> None:
    """Use these facts instead of probing (None: probe again on next use)."""
    global _CURRENT
    _CURRENT = env
