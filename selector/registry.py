"""Loads backend plugins from the `selector.backends` entry points, in our own loop.

Built-in backends take this same road: the core never imports `plugins` by name. A plugin that fails to
import, raises from its hook (`SystemExit` included), does not answer within SELECTOR_PLUGIN_TIMEOUT seconds,
returns something malformed or claims a built-in backend's name is recorded and skipped, never fatal. Only
`KeyboardInterrupt` goes through: the user asked to stop. A plugin that ends or stalls the whole process
(`os._exit`, a C loop holding the GIL) is caught only by loading it in a child process first:
`selector.plugin_probe` does that (`load_checked_registry`) and hands the plugins it found unsafe to
`load_registry(quarantine=...)`; `selector doctor` and `selector plugins` check each time, a model's process once
per installed plugin set (the verdict kept in this user's cache), and only when third-party plugins are installed.

SELECTOR_PLUGINS_ALLOW / SELECTOR_PLUGINS_BLOCK name plugins (entry-point or distribution names) or backends.
A backend that is not registered because of its plugin is remembered (`Registry.unavailable`), so that a
request for it names the plugin and what happened instead of calling the name unknown.
"""

from __future__ import annotations

import json
import re
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, TypeVar

import pluggy

from selector import hookspecs, settings
from selector.errors import PluginUnavailableError
from selector.types import Availability, BackendSpec, Status

ALLOW_VARIABLE = "SELECTOR_PLUGINS_ALLOW"  # declared in selector.settings
BLOCK_VARIABLE = "SELECTOR_PLUGINS_BLOCK"
TIMEOUT_VARIABLE = "SELECTOR_PLUGIN_TIMEOUT"
BUILTIN_DISTRIBUTION = "moe-selector"
BUILTIN_PACKAGE = "selector.plugins."
_NAME = re.compile(r"^[a-z0-9_]+$")
RESERVED_NAMES = frozenset({"auto"})
NO_ANSWER = "did not answer within"  # how a plugin that overran the timeout is reported (PluginInfo.error)

# Called with (plugin name, stage) as loading goes: "import", "hook", then "done". The child process of
# selector.plugin_probe reports these to its parent, which thus knows which plugin ended or stalled it.
Progress = Callable[[str, str], None]


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

    @property
    def overran(self) -> bool:
        """Its import or hook did not answer within SELECTOR_PLUGIN_TIMEOUT."""
        return bool(self.error) and NO_ANSWER in str(self.error)


@dataclass
class Registry:
    """All loaded backends, who provided them, and what went wrong on the way."""

    specs: dict[str, BackendSpec] = field(default_factory=dict)
    providers: dict[str, str] = field(default_factory=dict)  # backend name -> plugin name
    plugins: list[PluginInfo] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # duplicates, malformed specs
    builtins: set[str] = field(default_factory=set)  # the plugins shipped in moe-selector (selector.plugins.*)
    # a name a user may ask for (a backend, or a plugin whose backends are unknown) that is not registered
    # because of its plugin: blocked, not allowed, or broken; the reason names the plugin and its distribution
    unavailable: dict[str, Availability] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        return sorted(self.specs)

    def get(self, name: str) -> BackendSpec:
        """The spec of a registered backend. A name left out because of its plugin raises PluginUnavailableError
        (an ImportError and a ValueError) naming the plugin and why; any other name a ValueError listing the
        registered names."""
        try:
            return self.specs[name]
        except KeyError:
            pass
        if name in self.unavailable:
            why = self.unavailable[name]
            raise PluginUnavailableError(
                f"experts backend {name!r} is not available: {why.reason}. Fix: {why.remedy}. "
                "`selector plugins` lists every plugin and what came of loading it."
            )
        raise ValueError(
            f"unknown experts backend {name!r}; registered backends: {', '.join(self.names) or '(none)'} "
            f"(and 'auto'). A third-party backend registers through the {hookspecs.ENTRY_POINT_GROUP!r} "
            "entry-point group; `selector plugins` lists what loaded and what failed."
        )

    def failed_plugins(self) -> dict[str, Availability]:
        """Each broken plugin that registered no backend, by name, with what happened: the ranking lists them
        among its exclusions, so that `explain` says why their backends are absent."""
        return {
            name: why for name, why in self.unavailable.items()
            if why.status is Status.PLUGIN_ERROR and name not in self.specs
        }


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


def _normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def _short_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}{_where(exc)}"


def is_builtin(target: str, distribution: str) -> bool:
    """A backend package shipped in this distribution (`selector.plugins.<name>` from moe-selector)."""
    return target.startswith(BUILTIN_PACKAGE) and _normalised(distribution.split(" ")[0]) == BUILTIN_DISTRIBUTION


def lists_plugin(names: Iterable[str], plugin: str, distribution: str) -> bool:
    """Whether an allow or block list names this plugin: its entry-point name or its distribution's name."""
    listed = set(names)
    dist = _normalised(distribution.split(" ")[0])
    return plugin in listed or any(_normalised(n) == dist for n in listed)


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
    daemon threads do not keep the process alive at exit. A call that holds the GIL (a C loop) keeps this thread
    waiting until it lets go; it answered late, so it is reported as not answering too."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except BaseException as exc:  # SystemExit from sys.exit() included: it would end only this thread
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"selector-plugin {what}", daemon=True)
    start = time.monotonic()
    thread.start()
    thread.join(timeout)
    took = time.monotonic() - start
    if thread.is_alive():
        raise _NoAnswer(f"{NO_ANSWER} {timeout:g} s (raise {TIMEOUT_VARIABLE} if it is only slow)")
    if took > timeout:
        raise _NoAnswer(f"{NO_ANSWER} {timeout:g} s: it held this process for {took:.1f} s "
                        f"(raise {TIMEOUT_VARIABLE} if it is only slow)")
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


def _broken(name: str, dist: str, what: str) -> Availability:
    return Availability(
        Status.PLUGIN_ERROR,
        f"plugin {name!r} (distribution {dist}) {what}; its backends are not registered",
        f"fix or update that distribution, or block it with {BLOCK_VARIABLE}={name} "
        f"(`selector plugins` shows every plugin)",
    )


def _left_out(what: str, variable: str) -> Availability:
    verb = f"is blocked by {variable}" if variable == BLOCK_VARIABLE else f"is not listed in {variable}"
    fix = f"remove it from {variable}" if variable == BLOCK_VARIABLE else f"add it to {variable}"
    return Availability(Status.DENIED_BY_CONFIG, f"{what} {verb}", fix)


@dataclass(frozen=True)
class _Lists:
    """SELECTOR_PLUGINS_ALLOW / _BLOCK, each name either a plugin (entry point or distribution) or a backend."""

    allow: frozenset[str]
    block: frozenset[str]
    plugin_names: frozenset[str]  # the allowed names that name an installed plugin; the rest name backends

    def keeps_backend(self, backend: str, plugin: str, dist: str) -> str | None:
        """None where the backend stays; else the variable that leaves it out."""
        if backend in self.block:
            return BLOCK_VARIABLE
        if self.allow and backend not in self.allow and not lists_plugin(self.allow, plugin, dist):
            return ALLOW_VARIABLE
        return None

    def allows_plugin(self, plugin: str, dist: str) -> bool:
        return lists_plugin(self.allow, plugin, dist)


def _lists(environ: Mapping[str, str] | None, eps: list[metadata.EntryPoint]) -> _Lists:
    allow, block = settings.get(ALLOW_VARIABLE, environ), settings.get(BLOCK_VARIABLE, environ)
    plugins = frozenset(n for n in allow if any(lists_plugin({n}, ep.name, _distribution_of(ep)) for ep in eps))
    return _Lists(frozenset(allow), frozenset(block), plugins)


def build_registry(
    entry_points: Iterable[metadata.EntryPoint] | None = None,
    extra_plugins: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
    quarantine: Mapping[str, str] | None = None,
    progress: Progress | None = None,
    timeout: float | None = None,
) -> Registry:
    """Load every plugin and collect its backends. Never raises for a plugin's fault.

    `quarantine`: plugin name -> what it did to a process that loaded it (selector.plugin_probe); such a plugin
    is not imported and is reported broken with that. `progress` hears each plugin's stages (see `Progress`).
    `timeout`: seconds for each import and each hook (default SELECTOR_PLUGIN_TIMEOUT)."""
    if timeout is None:
        timeout = float(settings.get(TIMEOUT_VARIABLE, environ))
    if entry_points is None:
        entry_points = metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP)
    eps = sorted(entry_points, key=lambda e: e.name)
    lists = _lists(environ, eps)
    quarantine = quarantine or {}

    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    registry = Registry()
    # position, name, target, distribution, entry point or plugin object
    sources: list[tuple[int, str, str, str, Any]] = []
    infos: list[tuple[int, PluginInfo]] = []  # listed in entry-point order, whatever order they loaded in

    # Allowed names that name no plugin are backend names: then the other plugins load to find them.
    looks_up = bool(lists.allow - lists.plugin_names)
    for position, ep in enumerate(eps):
        dist = _distribution_of(ep)
        variable = (BLOCK_VARIABLE if lists_plugin(lists.block, ep.name, dist)
                    else ALLOW_VARIABLE if lists.allow and not looks_up and not lists.allows_plugin(ep.name, dist)
                    else None)  # fmt: skip
        if variable is not None:
            why = f"in {BLOCK_VARIABLE}" if variable == BLOCK_VARIABLE else f"not in {ALLOW_VARIABLE}"
            infos.append((position, PluginInfo(ep.name, ep.value, dist, skipped=why)))
            registry.unavailable[ep.name] = _left_out(f"plugin {ep.name!r} (distribution {dist})", variable)
            continue
        if ep.name in quarantine:
            infos.append((position, PluginInfo(ep.name, ep.value, dist, error=quarantine[ep.name])))
            registry.unavailable[ep.name] = _broken(ep.name, dist, quarantine[ep.name])
            continue
        sources.append((position, ep.name, ep.value, dist, ep))
    for name, obj in (extra_plugins or {}).items():
        target = getattr(obj, "__name__", repr(obj))
        sources.append((len(infos) + len(sources), name, target, "(registered in code)", obj))

    # Built-ins first, so that a third-party backend of the same name meets the built-in already there.
    for position, name, target, dist, obj in sorted(sources, key=lambda src: (not is_builtin(src[2], src[3]), src[0])):
        if isinstance(obj, metadata.EntryPoint):
            if progress is not None:
                progress(name, "import")
            try:
                obj = _bounded(obj.load, timeout, name)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # an import can raise anything, SystemExit included
                failure = _failure(exc)
                infos.append((position, PluginInfo(name, target, dist, error=f"import failed: {failure}")))
                registry.unavailable[name] = _broken(name, dist, f"failed to import: {failure}")
                if progress is not None:
                    progress(name, "done")
                continue
        info = _collect(pm, registry, name, target, dist, obj, lists, timeout, progress)
        if looks_up and info.backends == () and not info.error and not lists.allows_plugin(name, dist):
            info = PluginInfo(name, target, dist, skipped=f"none of its backends is in {ALLOW_VARIABLE}")
        infos.append((position, info))
        if progress is not None:
            progress(name, "done")
    registry.plugins.extend(info for _, info in sorted(infos, key=lambda item: item[0]))
    return registry


def _collect(
    pm: pluggy.PluginManager,
    registry: Registry,
    name: str,
    target: str,
    dist: str,
    obj: object,
    lists: _Lists,
    timeout: float,
    progress: Progress | None,
) -> PluginInfo:
    if progress is not None:
        progress(name, "hook")
    try:
        pm.register(obj, name=name)
        impls = [impl for impl in pm.hook.selector_backends.get_hookimpls() if impl.plugin is obj]
        if not impls:
            error = "defines no selector_backends hook implementation"
            registry.unavailable[name] = _broken(name, dist, error)
            return PluginInfo(name, target, dist, error=error)
        specs = _bounded(lambda: [spec for impl in impls for spec in _spec_list(impl.function())], timeout, name)
    except _NotSpecs as exc:
        registry.unavailable[name] = _broken(name, dist, str(exc))
        return PluginInfo(name, target, dist, error=str(exc))
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a hook can raise anything, SystemExit included
        registry.unavailable[name] = _broken(name, dist, f"failed in its selector_backends hook: {_failure(exc)}")
        return PluginInfo(name, target, dist, error=f"hook failed: {_failure(exc)}")

    added: list[str] = []
    errors: list[str] = []
    for spec in specs:
        problem = _validate_spec(spec)
        if problem:
            errors.append(problem)
            continue
        variable = lists.keeps_backend(spec.name, name, dist)
        if variable is not None:
            if spec.name not in registry.specs:
                registry.unavailable[spec.name] = _left_out(
                    f"backend {spec.name!r} (plugin {name!r}, distribution {dist})", variable)
            continue
        holder = registry.providers.get(spec.name)
        if holder is not None and holder in registry.builtins and name not in registry.builtins:
            if not lists.allows_plugin(name, dist):
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
        registry.unavailable.pop(spec.name, None)
        added.append(spec.name)
    if is_builtin(target, dist):
        registry.builtins.add(name)
    error = "; ".join(errors) if errors else None
    registry.problems.extend(f"plugin {name!r}: {e}" for e in errors)
    if error and not added:
        registry.unavailable[name] = _broken(name, dist, error)
    return PluginInfo(name, target, dist, backends=tuple(added), error=error)


_REGISTRY: Registry | None = None
_EXTRA: dict[str, object] = {}


def load_registry(quarantine: Mapping[str, str] | None = None, problems: Iterable[str] = ()) -> Registry:
    """Build the process-wide registry now (what `get_registry` returns from then on), leaving out the plugins in
    `quarantine` (plugin name -> what it did in a child process that loaded it) and adding `problems` (of that
    check) to its own. A plugin that overran SELECTOR_PLUGIN_TIMEOUT is named in a warning."""
    global _REGISTRY
    registry = build_registry(extra_plugins=_EXTRA, quarantine=quarantine)
    registry.problems.extend(problems)
    for info in registry.plugins:
        if info.overran:
            warnings.warn(
                f"selector: plugin {info.name!r} (distribution {info.distribution}) {info.error}; its backends "
                f"are left out in this process",
                RuntimeWarning,
                stacklevel=2,
            )
    _REGISTRY = registry
    return registry


def get_registry() -> Registry:
    """The process-wide registry, built on first use: third-party plugins only after a child process loaded them
    (`load_checked_registry`), so one that ends or stalls a process cannot take a model's process with it."""
    return _REGISTRY if _REGISTRY is not None else load_checked_registry(remember=True)


def _third_party_key(environ: Mapping[str, str] | None = None) -> str | None:
    """What the plugin check's verdict depends on: the installed third-party entry points (name, target,
    distribution, version) and the allow and block lists; None when only the built-ins are installed."""
    found = []
    for ep in metadata.entry_points(group=hookspecs.ENTRY_POINT_GROUP):
        dist = _distribution_of(ep)
        if not is_builtin(ep.value, dist):
            found.append([ep.name, ep.value, dist, getattr(ep.dist, "version", None) or ""])
    if not found:
        return None
    lists = [settings.get(v, environ) for v in (ALLOW_VARIABLE, BLOCK_VARIABLE)]
    return json.dumps([sorted(found), [sorted(names) for names in lists]])


def load_checked_registry(remember: bool = False) -> Registry:
    """The process-wide registry, the plugins first loaded in a child process (selector/plugin_probe.py): those
    that exited it or overran SELECTOR_PLUGIN_DEADLINE are reported with what they did and never loaded here.
    `remember`: reuse this user's cached verdict for the installed plugin set (a model's process); else check now
    (`selector doctor`, `selector plugins`). Only the built-ins installed, or the deadline 0: no check."""
    from selector import plugin_probe

    key = _third_party_key()
    if key is None or float(settings.get(plugin_probe.DEADLINE_VARIABLE)) <= 0:
        return load_registry()
    unsafe, problems = plugin_probe.cached_verdict(key) if remember else plugin_probe.find_unsafe_plugins()
    return load_registry(quarantine=unsafe, problems=problems)


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
