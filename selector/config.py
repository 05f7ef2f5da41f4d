"""User and project preferences: prefer, deny or pin backends, from YAML files.

Which files, in this order (a later file's keys override an earlier one's):
1. the user file, `<user config dir>/selector/config.yaml` (`user_config_path`), when it exists;
2. the file `SELECTOR_CONFIG` names, when set: it must exist, and the project file is then not read;
   else the project file: `selector.yaml` in the project root (`project_root`), the nearest of the current
   directory and its parents that holds `pyproject.toml` or `.git` (the current directory when none does).
   A `selector.yaml` in a sub-folder of a project is never read.
A file that does not parse is an error naming the file and line.

A config file may come from a checkout the user did not write, so nothing in it is trusted: files over
`MAX_BYTES`, YAML aliases (the "billion laughs" bomb), nesting deeper than `MAX_DEPTH`, bytes that are not
UTF-8 and backend names the registry does not know are one-line `ConfigError`s naming the file, never a
traceback, a MemoryError or a silently ignored name. A pin that cannot run here makes `auto` rank as if there
were none, with one warning naming the pin and why; `selector doctor` reports it as broken (exit 1).
"""

from __future__ import annotations

import os
import stat
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from selector import settings

CONFIG_VARIABLE = "SELECTOR_CONFIG"
PROJECT_FILE = "selector.yaml"
PROJECT_MARKERS = ("pyproject.toml", ".git")  # what makes a folder a project root (.git: a folder or a file)
KEYS = ("prefer", "deny", "pin")
MAX_BYTES = 64 * 1024  # a preferences file is a few lines; anything bigger is a mistake or an attack
MAX_DEPTH = 8  # the format needs 2 levels (a mapping of lists)


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names the file (and line)."""


@dataclass(frozen=True)
class SelectorConfig:
    prefer: tuple[str, ...] = ()  # tried first, in this order, when they can run
    deny: frozenset[str] = frozenset()  # never chosen by "auto"
    pin: str | None = None  # always chosen by "auto" when it can run
    files: tuple[str, ...] = field(default=(), compare=False)  # where the values came from
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)  # key -> the file that set it

    def to_dict(self) -> dict[str, Any]:
        return {"prefer": list(self.prefer), "deny": sorted(self.deny), "pin": self.pin, "files": list(self.files)}


def user_config_path() -> Path:
    import platformdirs

    return Path(platformdirs.user_config_dir("selector")) / "config.yaml"


class _Refused(yaml.MarkedYAMLError):
    """A YAML construct the safe loader will not build (an alias, nesting too deep)."""


class _BoundedLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses aliases and nesting deeper than MAX_DEPTH while composing.

    Aliases are refused, not counted: the format never needs them, and a few of them nested make a 479-byte
    file expand into gigabytes. The depth limit keeps the composer's recursion (and a RecursionError) away.
    """

    _depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            raise _Refused(problem="YAML aliases (*name) are not allowed, write the values out",
                           problem_mark=self.peek_event().start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(problem=f"nesting deeper than {MAX_DEPTH} levels, "
                               "the file holds only prefer / deny (lists) and pin (a name)",
                               problem_mark=self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        # YAML lets a later key silently replace an earlier one: a config with `pin` twice means two things
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) or key is None:
                if key in seen:
                    raise _Refused(problem=f"the key {key!r} is given twice, keep one", problem_mark=key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _names(value: Any, key: str, path: Path) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{path}: '{key}' must be a backend name or a list of names, got {value!r}")
    return tuple(value)


def _parse(path: Path) -> Any:
    """The YAML document in `path`, read with every limit applied; ConfigError (one line) otherwise."""
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}, check the file's permissions") from None
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_BYTES // 1024} KiB, a selector config is a few lines; "
                          "check that this is the file you meant")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 (byte 0x{raw[exc.start]:02x}), save the file as UTF-8") from None
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # noqa: S506 - _BoundedLoader is a SafeLoader
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        what = " ".join(str(exc.problem or exc).split())
        fix = "" if isinstance(exc, _Refused) else ", fix the YAML syntax there"
        raise ConfigError(f"{where}: malformed YAML: {what}{fix}") from None
    except (yaml.YAMLError, RecursionError) as exc:
        what = " ".join(str(exc).split()) or type(exc).__name__
        raise ConfigError(f"{path}: malformed YAML: {what}, fix the YAML syntax") from None


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse one file into {key: value}; ConfigError on bad YAML, oversized or nested files, unknown keys."""
    data = _parse(path)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with keys {', '.join(KEYS)}, got {type(data).__name__}")
    unknown = sorted(map(str, set(data) - set(KEYS)))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; known: {', '.join(KEYS)}")
    out: dict[str, Any] = {}
    if "prefer" in data:
        out["prefer"] = _names(data["prefer"], "prefer", path)
    if "deny" in data:
        out["deny"] = frozenset(_names(data["deny"], "deny", path))
    if "pin" in data:
        if data["pin"] is not None and not isinstance(data["pin"], str):
            raise ConfigError(f"{path}: 'pin' must be one backend name, got {data['pin']!r}")
        out["pin"] = data["pin"]
    return out


def check_names(config: SelectorConfig, registered: Collection[str]) -> None:
    """ConfigError naming the file, the key and the name when prefer / deny / pin names no registered backend.

    A misspelt name would otherwise do nothing: `auto` would quietly rank as if the line were not there.
    """
    for key in KEYS:
        value = getattr(config, key)
        names = [value] if isinstance(value, str) else sorted(value) if key == "deny" else list(value or ())
        for name in names:
            if name not in registered:
                where = config.sources.get(key) or ", ".join(config.files) or "the config"
                raise ConfigError(
                    f"{where}: '{key}' names unknown backend {name!r}; registered: "
                    f"{', '.join(sorted(registered)) or '(none)'}. Fix the name or remove it "
                    "(`selector plugins` lists what loaded)"
                )


def trusted(path: Path) -> bool:
    """Whether a file another local user could have planted or changed is ruled out: it belongs to this user (or
    root) and only its owner may write it. Always true where files have no owners (not POSIX)."""
    if not hasattr(os, "getuid"):
        return True
    info = path.lstat()
    return info.st_uid in (os.getuid(), 0) and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def project_root(start: Path | None = None) -> Path | None:
    """The folder whose `selector.yaml` is the project file: the nearest of `start` (default: the current
    directory) and its parents that holds one of PROJECT_MARKERS this user owns (`trusted`: a `.git` another user
    left in a shared folder such as /tmp marks nothing), else `start` itself. None when the current directory
    cannot be read (deleted under the process)."""
    try:
        here = (start or Path.cwd()).resolve()
        for folder in (here, *here.parents):
            markers = [folder / m for m in PROJECT_MARKERS if (folder / m).exists()]
            if any(trusted(marker) for marker in markers):
                return folder
    except OSError:  # a folder on the way that may not be listed, or a deleted working directory
        return None
    return here


def config_paths(environ: Mapping[str, str] | None = None, cwd: Path | None = None) -> list[Path]:
    """The files `load_config` reads, in order: the user file, then `SELECTOR_CONFIG`'s file or the project file.

    ConfigError naming the variable and the path when `SELECTOR_CONFIG` names no readable file.
    """
    explicit = settings.get(CONFIG_VARIABLE, environ)
    if explicit is None:
        root = project_root(cwd)
        return [user_config_path()] + ([] if root is None else [root / PROJECT_FILE])
    try:
        mode = explicit.stat().st_mode
    except OSError as exc:
        what = "no such file" if isinstance(exc, FileNotFoundError) else f"cannot be read ({exc.strerror or exc})"
        raise ConfigError(f"{CONFIG_VARIABLE}={explicit}: {what}; fix the path or unset {CONFIG_VARIABLE}") from None
    if not stat.S_ISREG(mode):
        what = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
        raise ConfigError(f"{CONFIG_VARIABLE}={explicit}: {what}; name the YAML file itself")
    return [user_config_path(), explicit]


def load_config(
    paths: Sequence[Path] | None = None,
    environ: Mapping[str, str] | None = None,
    registered: Collection[str] | None = None,
) -> SelectorConfig:
    """Merge the config files that exist; later files override earlier keys.

    Every backend name is checked against `registered` (default: the process-wide registry's names, built
    only when some file names a backend); an unknown one is a ConfigError.
    """
    merged: dict[str, Any] = {}
    sources: dict[str, str] = {}
    used: list[str] = []
    for path in config_paths(environ) if paths is None else paths:
        if path.is_file():
            if not trusted(path):
                warnings.warn(f"selector: ignoring {path}: another user may write it (owned by someone else, or "
                              "writable by the group or everyone); make it yours and mode 644", UserWarning, stacklevel=2)
                continue
            values = read_config_file(path)
            merged.update(values)
            sources.update(dict.fromkeys(values, str(path)))
            used.append(str(path))
    config = SelectorConfig(files=tuple(used), sources=sources, **merged)
    if config.prefer or config.deny or config.pin:
        if registered is None:
            from selector.registry import get_registry

            registry = get_registry()
            # a backend its plugin keeps away (blocked, not allowed, failed) is a known name: a pin of it falls back
            registered = [*registry.names, *registry.unavailable]
        check_names(config, registered)
    return config
