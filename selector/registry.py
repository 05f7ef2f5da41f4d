"""Loads backend plugins from the `selector.backends` entry points, in our own loop.

Built-in backends take this same road: the core never imports `plugins` by name. A plugin that fails to
import, raises from its hook (`SystemExit` included), does not answer within SELECTOR_PLUGIN_TIMEOUT seconds,
returns something malformed or claims a built-in backend's name is recorded and skipped, never fatal. Only
`KeyboardInterrupt` goes through: the user asked to stop.
"""

from __future__ import annotations

import re
import threading
import traceback
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, TypeVar

import pluggy

from selector import hookspecs, settings
from selector.types import BackendSpec

ALLOW_VARIABLE = "SELECTOR_PLUGINS_ALLOW"  # declared in selector.settings
BLOCK_VARIABLE = "SELECTOR_PLUGINS_BLOCK"
TIMEOUT_VARIABLE = "SELECTOR_PLUGIN_TIMEOUT"
BUILTIN_DISTRIBUTION = "moe-selector"
BUILTIN_PACKAGE = "selector.plugins."
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
    builtins: set[str] = field(default_factory=set)  # the plugins shipped in moe-selector (selector.plugins.*)

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


def plugin_versions(registry: Registry) -> dict[str, str]:
    """selector's version and each loaded plugin's distribution ("name version"): what measured times depend on
    besides the machine (part of the tuning fingerprint)."""
    import selector

    versions = {"moe-selector": selector.__version__}
    for info in registry.plugins:
        if not info.error and not info.skipped:
            versions[f"plugin:{info.name}"] = info.distribution
    return versions


def _distribution_of(ep: metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "(unknown distribution)"
    return f"{dist.metadata['Name']} {dist.version}"


def _short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}{_where(exc)}"


def is_builtin(target: str, distribution: str) -> bool:
    """A backend package shipped in this distribution (`selector.plugins.<name>` from moe-selector)."""
    name = re.sub(r"[-_.]+", "-", distribution.split(" ")[0]).lower()  # PEP 503 normalised
    return target.startswith(BUILTIN_PACKAGE) and name == BUILTIN_DISTRIBUTION


_T = TypeVar("_T")


class _NoAnswer(Exception):
    """A plugin's import or hook that did not return in time (it keeps running in its daemon thread)."""


class _NotSpecs(Exception):
    """A hook returned something that is not a sequence of BackendSpec (None, a string, a number)."""


def _spec_list(returned: object) -> list[object]:
    """What a selector_backends hook returned, as a list; a hook that returns None or a non-sequence is broken
    (reported as such, never as a plugin that loaded with no backends)."""
    if returned is None or isinstance(returned, (str, bytes)) or not hasattr(returned, "__iter__"):
        raise _NotSpecs(f"hook selector_backends returned {type(returned).__name__}, not a list of BackendSpec")
    return list(returned)


def _bounded(call: Callable[[], _T], timeout: float, what: str) -> _T:
    """`call()` in a daemon thread: its value, or what it raised (any BaseException but KeyboardInterrupt,
    re-raised here as is), or _NoAnswer after `timeout` seconds. A hung plugin is left running in its thread;
    daemon threads do not keep the process alive at exit."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # SystemExit from sys.exit() included: it would end only this thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"selector-plugin {what}", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise _NoAnswer(f"did not answer within {timeout:g} s (raise {TIMEOUT_VARIABLE} if it is only slow)")
    if "error" in box:
        raise box["error"]
    return box["value"]


def _failure(exc: BaseException) -> str:
    if isinstance(exc, _NoAnswer):
        return str(exc)
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r}){_where(exc)}"
    return _short_error(exc)


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


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
    timeout = float(settings.get(TIMEOUT_VARIABLE, environ))
    if entry_points is None:
        entry_points = metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP)

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    registry = Registry()
    # position, name, target, distribution, entry point or plugin object
    sources: list[tuple[int, str, str, str, Any]] = []
    infos: list[tuple[int, PluginInfo]] = []  # listed in entry-point order, whatever order they loaded in

    for position, ep in enumerate(sorted(entry_points, key=lambda e: e.name)):
        if (allow and ep.name not in allow) or ep.name in block:
            why = f"not in {ALLOW_VARIABLE}" if allow and ep.name not in allow else f"in {BLOCK_VARIABLE}"
            infos.append((position, PluginInfo(ep.name, ep.value, _distribution_of(ep), skipped=why)))
            continue
        sources.append((position, ep.name, ep.value, _distribution_of(ep), ep))
    for name, obj in (extra_plugins or {}).items():
        target = getattr(obj, "__name__", repr(obj))
        sources.append((len(infos) + len(sources), name, target, "(registered in code)", obj))

    # Built-ins first, so that a third-party backend of the same name meets the built-in already there.
    for position, name, target, dist, obj in sorted(sources, key=lambda src: (not is_builtin(src[2], src[3]), src[0])):
        if isinstance(obj, metadata.EntryPoint):
            try:
                obj = _bounded(obj.load, timeout, name)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # an import can raise anything, SystemExit included
                infos.append((position, PluginInfo(name, target, dist, error=f"import failed: {_failure(exc)}")))
                continue
        info = _collect(pm, registry, name, target, dist, obj, allow, block, timeout)
        infos.append((position, info))
    registry.plugins.extend(info for _, info in sorted(infos, key=lambda item: item[0]))
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
    timeout: float,
) -> PluginInfo:
    try:
        pm.register(obj, name=name)
        impls = [impl for impl in pm.hook.selector_backends.get_hookimpls() if impl.plugin is obj]
        if not impls:
            return PluginInfo(name, target, dist, error="defines no selector_backends hook implementation")
        specs = _bounded(lambda: [spec for impl in impls for spec in _spec_list(impl.function())], timeout, name)
    except _NotSpecs as exc:
        return PluginInfo(name, target, dist, error=str(exc))
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a hook can raise anything, SystemExit included
        return PluginInfo(name, target, dist, error=f"hook failed: {_failure(exc)}")

    added: list[str] = []
    errors: list[str] = []
    for spec in specs:
        problem = _validate_spec(spec)
        if problem:
            errors.append(problem)
            continue
        if (allow and spec.name not in allow and name not in allow) or spec.name in block:
            continue
        holder = registry.providers.get(spec.name)
        if holder is not None and holder in registry.builtins and name not in registry.builtins:
            if name not in allow:
                errors.append(
                    f"backend {spec.name!r} is a built-in backend's name; keeping the built-in {holder!r} "
                    f"(to let {name!r} replace it, list {name!r} in {ALLOW_VARIABLE} with every plugin to load)"
                )
                continue
            registry.problems.append(
                f"backend {spec.name!r}: the built-in is replaced by {name!r}, which {ALLOW_VARIABLE} lists"
            )
        elif spec.name in registry.specs:
            registry.problems.append(
                f"backend {spec.name!r} is provided by both {registry.providers[spec.name]!r} and {name!r}; "
                f"keeping {registry.providers[spec.name]!r} (block one with {BLOCK_VARIABLE})"
            )
            continue
        registry.specs[spec.name] = spec
        registry.providers[spec.name] = name
        added.append(spec.name)
    if is_builtin(target, dist):
        registry.builtins.add(name)
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
