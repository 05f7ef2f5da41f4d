"""The hooks a backend plugin implements. One hook, prefixed and documented, in the style of pytest's hookspec."""

from __future__ import annotations

from collections.abc import Sequence

import pluggy

from selector.types import BackendSpec

PROJECT = "selector"
ENTRY_POINT_GROUP = "selector.backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def selector_backends() -> Sequence[BackendSpec]:
    """Return the experts backends this plugin provides.

    Called once per process when the registry is built. Keep it cheap: declare the backend and its
    requirements here and import heavy modules (torch, triton, a hub kernel) only in ``BackendSpec.load``.

    :return: the plugin's backends; each name must be unique across all plugins, lowercase
        ``[a-z0-9_]+``, and not ``auto``.
    """
