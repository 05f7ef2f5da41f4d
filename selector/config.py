"""User and project preferences: prefer, deny or pin backends, from YAML files.

Files are read in this order, later ones overriding earlier keys: the user file
(`<user config dir>/selector/config.yaml`), the project file (`selector.yaml` in the working directory),
then the file that `SELECTOR_CONFIG` names. A file that does not parse is an error naming the file and line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from selector import settings

CONFIG_VARIABLE = "SELECTOR_CONFIG"
PROJECT_FILE = "selector.yaml"
KEYS = ("prefer", "deny", "pin")


class ConfigError(ValueError):
    """A configuration file that cannot be used; the message names the file (and line)."""


@dataclass(frozen=True)
class SelectorConfig:
    prefer: tuple[str, ...] = ()  # tried first, in this order, when they can run
    deny: frozenset[str] = frozenset()  # never chosen by "auto"
    pin: str | None = None  # always chosen by "auto" when it can run
    files: tuple[str, ...] = field(default=(), compare=False)  # where the values came from

    def to_dict(self) -> dict[str, Any]:
        return {"prefer": list(self.prefer), "deny": sorted(self.deny), "pin": self.pin, "files": list(self.files)}


def user_config_path() -> Path:
    import platformdirs

    return Path(platformdirs.user_config_dir("selector")) / "config.yaml"


def _names(value: Any, key: str, path: Path) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{path}: '{key}' must be a backend name or a list of names, got {value!r}")
    return tuple(value)


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse one file into {key: value}; ConfigError on bad YAML or unknown keys."""
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        raise ConfigError(f"{where}: malformed YAML: {exc.problem or exc}") from None
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping with keys {', '.join(KEYS)}, got {type(data).__name__}")
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(map(str, unknown))}; known: {', '.join(KEYS)}")
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


def config_paths(environ: Mapping[str, str] | None = None, cwd: Path | None = None) -> list[Path]:
    paths = [user_config_path(), (cwd or Path.cwd()) / PROJECT_FILE]
    explicit = settings.get(CONFIG_VARIABLE, environ)
    if explicit is not None:
        if not explicit.is_file():
            raise ConfigError(f"{CONFIG_VARIABLE}={explicit}: no such file")
        paths.append(explicit)
    return paths


def load_config(paths: Sequence[Path] | None = None, environ: Mapping[str, str] | None = None) -> SelectorConfig:
    """Merge the config files that exist; later files override earlier keys."""
    merged: dict[str, Any] = {}
    used: list[str] = []
    for path in config_paths(environ) if paths is None else paths:
        if path.is_file():
            merged.update(read_config_file(path))
            used.append(str(path))
    return SelectorConfig(files=tuple(used), **merged)
