"""Loads backend plugins from the `selector.backends` entry points, in our own loop.

Built-in backends take this same road: the core never imports `plugins` by name. A plugin that fails to
import, raises from its hook or returns something malformed is recorded and skipped, never fatal.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

import pluggy

from selector import hookspecs, settings
from selector.types import BackendSpec

ALLOW_VARIABLE = "SELECTOR_PLUGINS_ALLOW"  # declared in selector.settings
BLOCK_VARIABLE = "SELECTOR_PLUGINS_BLOCK"
_NAME = re.compile(r"^[a-z0-9_]+$")
RESERVED_NAMES = frozenset({"auto"})


@dataclass(frozen=True)
class PluginInfo:
    """One entry point (or a plugin registered in code) and what came of loading it."""

    name: str
    target: str  # "module:attr" as the entry point says
    distribution: str  # "name version", or "(registered in code)"
    backends: tuple[str, ...] = ()
    error: str | None = None
    skipped: str | None = None  # why an allow/block list left it out

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "target": self.target,
            "distribution": self.distribution,
            "backends": list(self.backends),
            "error": self.error,
            "skipped": self.skipped,
        }


@dataclass
class Registry:
    """All loaded backends, who provided them, and what went wrong on the way."""

    specs: dict[str, BackendSpec] = field(default_factory=dict)
    providers: dict[str, str] = field(default_factory=dict)  # backend name -> plugin name
    plugins: list[PluginInfo] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # duplicates, malformed specs

    @property
    def names(self) -> list[str]:
        return sorted(self.specs)

    def get(self, name: str) -> BackendSpec:
        """The spec of a registered backend, or a ValueError that lists the registered names."""
        try:
            return self.specs[name]
        except KeyError:
            raise ValueError(
                f"unknown experts backend {name!r}; registered backends: {', '.join(self.names) or '(none)'} "
                f"(and 'auto'). A third-party backend registers through the {hookspecs.ENTRY_POINT_GROUP!r} "
                "entry-point group; `selector plugins` lists what loaded and what failed."
            ) from None


def _distribution_of(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "(unknown distribution)"
    return f"{dist.metadata['Name']} {dist.version}"


def _short_error(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{where}"


def _validate_spec(spec: object) -> str | None:
    if not isinstance(spec, BackendSpec):
        return f"returned {type(spec).__name__}, not a BackendSpec"
    if not _NAME.match(spec.name) or spec.name in RESERVED_NAMES:
        return f"backend name {spec.name!r} is not allowed (lowercase [a-z0-9_]+, not 'auto')"
    if not callable(spec.load):
        return f"backend {spec.name!r}: load is not callable"
    return None


def build_registry(
    entry_points: Iterable[metadata.EntryPoint] | None = None,
    extra_plugins: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Registry:
    """Load every plugin and collect its backends. Never raises for a plugin's fault."""
    allow, block = settings.get(ALLOW_VARIABLE, environ), settings.get(BLOCK_VARIABLE, environ)
    if entry_points is None:
        entry_points = metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP)

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    registry = Registry()
    sources: list[tuple[str, str, str, Any]] = []  # name, target, distribution, object or exception

    for ep in sorted(entry_points, key=lambda e: e.name):
        if (allow and ep.name not in allow) or ep.name in block:
            why = f"not in {ALLOW_VARIABLE}" if allow and ep.name not in allow else f"in {BLOCK_VARIABLE}"
            registry.plugins.append(PluginInfo(ep.name, ep.value, _distribution_of(ep), skipped=why))
            continue
        try:
            obj: Any = ep.load()
        except BaseException as exc:  # an import can raise anything, SystemExit included
            if isinstance(exc, KeyboardInterrupt):
                raise
            obj = exc
        sources.append((ep.name, ep.value, _distribution_of(ep), obj))
    for name, obj in (extra_plugins or {}).items():
        sources.append((name, getattr(obj, "__name__", repr(obj)), "(registered in code)", obj))

    for name, target, dist, obj in sources:
        if isinstance(obj, BaseException):
            registry.plugins.append(PluginInfo(name, target, dist, error=f"import failed: {_short_error(obj)}"))
            continue
        info = _collect(pm, registry, name, target, dist, obj, allow, block)
        registry.plugins.append(info)
    return registry


def _collect(
    pm: pluggy.PluginManager,
    registry: Registry,
    name: str,
    target: str,
    dist: str,
    obj: object,
    allow: set[str],
    block: set[str],
) -> PluginInfo:
    try:
        pm.register(obj, name=name)
        impls = [impl for impl in pm.hook.selector_backends.get_hookimpls() if impl.plugin is obj]
        if not impls:
            return PluginInfo(name, target, dist, error="defines no selector_backends hook implementation")
        specs = [spec for impl in impls for spec in (impl.function() or ())]
    except Exception as exc:
        return PluginInfo(name, target, dist, error=f"hook failed: {_short_error(exc)}")

    added: list[str] = []
    errors: list[str] = []
    for spec in specs:
        problem = _validate_spec(spec)
        if problem:
            errors.append(problem)
            continue
        if (allow and spec.name not in allow and name not in allow) or spec.name in block:
            continue
        if spec.name in registry.specs:
            registry.problems.append(
                f"backend {spec.name!r} is provided by both {registry.providers[spec.name]!r} and {name!r}; "
                f"keeping {registry.providers[spec.name]!r} (block one with {BLOCK_VARIABLE})"
            )
            continue
        registry.specs[spec.name] = spec
        registry.providers[spec.name] = name
        added.append(spec.name)
    error = "; ".join(errors) if errors else None
    registry.problems.extend(f"plugin {name!r}: {e}" for e in errors)
    return PluginInfo(name, target, dist, backends=tuple(added), error=error)


_REGISTRY: Registry | None = None
_EXTRA: dict[str, object] = {}


def get_registry() -> Registry:
    """The process-wide registry, built on first use."""
    global _REGISTRY
    if _REGISTRY is None:
        _REGISTRY = build_registry(extra_plugins=_EXTRA)
    return _REGISTRY


def register_plugin(plugin: object, name: str | None = None) -> None:
    """Add a plugin object from code (tests, notebooks) beside the entry points."""
    _EXTRA[name or getattr(plugin, "__name__", repr(plugin))] = plugin
    reset_registry()


def unregister_plugin(name: str) -> None:
    _EXTRA.pop(name, None)
    reset_registry()


def reset_registry() -> None:
    """Forget the loaded registry; the next use reloads every entry point."""
    global _REGISTRY
    _REGISTRY = None
