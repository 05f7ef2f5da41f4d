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

    Called once per process when the registry is built, in a daemon thread with a time bound
    (``SELECTOR_PLUGIN_TIMEOUT``, 5 s). Keep it cheap: declare the backend and its requirements here and
    import heavy modules (torch, triton, a hub kernel) only in ``BackendSpec.load``. A hook that raises
    (``SystemExit`` included), does not return in time or returns something malformed is reported by
    ``selector plugins`` and ``selector doctor`` and its plugin is skipped.

    Declare only what the forward runs: ``Requirements()`` is the plain layout (gated, concatenated
    ``gate_up_proj [E, 2I, H]``, no bias, not transposed, no custom gate, no post-expert norm, no
    expert-parallel sentinels); set each further layout flag the forward really handles (docs/plugins.md).

    :return: the plugin's backends; each name must be unique across all plugins, lowercase
        ``[a-z0-9_]+``, and not ``auto``. A built-in backend's name is refused (the built-in is kept)
        unless ``SELECTOR_PLUGINS_ALLOW`` lists the plugin.
    """
