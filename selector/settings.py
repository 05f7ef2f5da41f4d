"""Every `SELECTOR_*` environment variable, declared once: name, kind, default and one line of doc.

Values are read when used (`get`), never when a module is imported, so a changed environment (a test's
monkeypatch, a launcher that sets variables late) counts. For selector's own settings an empty value counts as
unset. The probe overrides (declared beside the probes, in `selector.probes.overrides`, which may not import
this module) differ: there a variable that is set but empty means "absent" (no GPU, no toolkit, not installed).

A bad value is a `ValueError` naming the variable and what it expects, except where a setting says it falls
back to its default (`on_bad="default"`: read inside cost estimates, where an error would only hide a backend).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, get_args

from selector.probes.overrides import OVERRIDE_VARIABLES

Kind = Literal["bool", "int", "float", "str", "path", "choice", "names"]
KINDS: tuple[str, ...] = get_args(Kind)
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
PACKAGE_PATTERN = "SELECTOR_PACKAGE_<NAME>"
_PACKAGE_NAME = re.compile(r"SELECTOR_PACKAGE_[A-Z0-9_]+")


@dataclass(frozen=True)
class Setting:
    """One environment variable: how its text is parsed, what it is when unset, and what it does."""

    name: str
    kind: Kind
    default: Any
    doc: str
    choices: tuple[str, ...] = ()  # kind "choice"
    minimum: float | None = None  # kinds "int" / "float": smallest accepted value
    positive: bool = False  # kinds "int" / "float": the value must be > 0
    on_bad: Literal["error", "default"] = "error"  # "error": ValueError naming the variable; "default": the default
    empty_is_unset: bool = True  # False for the probe overrides, where "" means "absent"
    default_text: str = ""  # how the table shows a default that depends on the machine
    probe: bool = False  # read by the probes (selector.probes.overrides), through read_override

    def expects(self) -> str:
        """What a good value looks like, for error messages."""
        if self.kind == "bool":
            return "1/true/yes/on or 0/false/no/off"
        if self.kind == "choice":
            return "one of " + ", ".join(self.choices)
        if self.kind in ("int", "float"):
            what = "an integer" if self.kind == "int" else "a number"
            if self.positive:
                return f"{what} > 0"
            return what if self.minimum is None else f"{what} >= {self.minimum:g}"
        if self.kind == "names":
            return "a comma-separated list of names"
        return "a " + ("path" if self.kind == "path" else "string")

    def parse(self, raw: str) -> Any:
        """The typed value of `raw`; ValueError naming the variable when it is not one."""
        text = raw.strip()
        if self.kind in ("str", "names", "path"):
            if self.kind == "names":
                return frozenset(part.strip() for part in text.split(",") if part.strip())
            return Path(raw) if self.kind == "path" else text
        value: Any = None
        if self.kind == "bool":
            low = text.lower()
            value = True if low in _TRUE else False if low in _FALSE else None
        elif self.kind == "choice":
            value = text if text in self.choices else None
        else:
            try:
                value = int(text) if self.kind == "int" else float(text)
            except ValueError:
                value = None
            if value is not None and (
                (self.positive and not value > 0) or (self.minimum is not None and value < self.minimum)
            ):
                value = None
        if value is None:
            raise ValueError(f"{self.name}={raw!r}: expected {self.expects()}")
        return value

    def shown_default(self) -> str:
        if self.default_text:
            return self.default_text
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        if isinstance(self.default, frozenset):
            return ", ".join(sorted(self.default)) or "empty"
        if isinstance(self.default, float) and self.default.is_integer():
            return str(int(self.default))
        return str(self.default)


def _probe_settings() -> list[Setting]:
    """The probes' override variables: strings (trimmed), None when unset, "" meaning absent."""
    return [
        Setting(name, "str", None, doc, empty_is_unset=False, probe=True) for name, doc in OVERRIDE_VARIABLES.items()
    ]


_DECLARED = [
    # --- selection and loading ---------------------------------------------------------------------------
    Setting("SELECTOR_CONFIG", "path", None,
            "the YAML file (prefer / deny / pin) read after the user file, instead of the project root's "
            "selector.yaml; it must exist"),
    Setting("SELECTOR_PLUGINS_ALLOW", "names", frozenset(),
            "comma list of plugin or backend names to load; every other plugin is skipped (empty: all). A backend "
            "name keeps that backend only, so every plugin is imported to find it. A third-party plugin listed "
            "here may replace a built-in backend of the same name"),
    Setting("SELECTOR_PLUGINS_BLOCK", "names", frozenset(), "comma list of plugin or backend names to skip"),
    Setting("SELECTOR_PLUGIN_TIMEOUT", "float", 5.0,
            "seconds a plugin's import or selector_backends hook may take in a model's process before it is "
            "reported as not answering (named in a warning and in the ranking's reasons) and skipped (it keeps "
            "running in a daemon thread); a bad value means the default",
            positive=True, on_bad="default"),
    Setting("SELECTOR_PLUGIN_DEADLINE", "float", 3.0,
            "third-party plugins are first loaded in a child process (selector doctor and selector plugins "
            "each time, a model's process once per installed plugin set): seconds each plugin's import, then its "
            "hook, may take there before the child is stopped and that plugin reported (as one that exits the "
            "process is) and left out; 0 loads them in the process itself; a bad value means the default (doctor "
            "reports it)",
            minimum=0.0, on_bad="default"),
    Setting("SELECTOR_VALIDATE", "choice", None,
            "input checks at the experts boundary: full (values every call), first (values on the first call "
            "of each module and shape), shapes; every level but off also guards ids and weights on the device "
            "(selector.check)",
            choices=("full", "first", "shapes", "off"), default_text="full on CPU, first on GPU"),
    Setting("SELECTOR_EP_TIMEOUT", "float", 60.0,
            "seconds an expert-parallel layer (selector.parallel) waits in one of its collectives for the other "
            "ranks before it raises ExpertParallelError (gloo: every collective; nccl: the status exchange that "
            "opens each eager call); the group is out of step after that",
            positive=True),
    Setting("SELECTOR_JIT_AMORTIZE_CALLS", "float", 1000.0,
            "over how many calls auto spreads a backend's one-time cost (download, JIT compile) in its estimate; "
            "a bad value means the default",
            positive=True, on_bad="default"),
    Setting("SELECTOR_TUNE_ON_LOAD", "float", 0.0,
            "seconds selector.from_pretrained / from_config may spend tuning a loaded model's experts shapes that "
            "no shipped table or earlier tuning covers (selector.tune_model); 0: off. Needs a CUDA GPU",
            minimum=0.0),
    # --- tuning store -------------------------------------------------------------------------------------
    Setting("SELECTOR_TUNING_STORE", "path", None,
            "the tuning store (a SQLite file of measured times) of this node's processes; nodes share one by "
            "reading it (SELECTOR_TUNING_STORE_READ_ONLY) or through `selector store export` / `import`",
            default_text="tuning.sqlite3 in the user cache dir"),
    Setting("SELECTOR_TUNING_STORE_TIMEOUT", "float", 10.0,
            "seconds a write to the tuning store waits for other writers before it is refused; a bad value means "
            "the default",
            positive=True, on_bad="default"),
    Setting("SELECTOR_TUNING_STORE_READ_ONLY", "bool", False,
            "read the tuning store without ever writing it: a store shared on purpose (another user's, or in a "
            "folder group or others may write) is then read, and said so; off, such a store is refused"),
    # --- hub kernels --------------------------------------------------------------------------------------
    Setting("SELECTOR_KERNELS_LOCK", "path", None,
            "a kernels.lock (from `kernels lock`): hub kernel pins resolve to its commits"),
    Setting("SELECTOR_SONICMOE_PAD_TOKENS", "bool", True,
            "sonicmoe pads token counts up to quarter-octave buckets, so fewer token counts JIT-compile"),
    # --- node daemon --------------------------------------------------------------------------------------
    Setting("SELECTOR_DAEMON_SOCKET", "path", None,
            "the node daemon's Unix socket; its folder must be this user's, mode 0700, not a symlink",
            default_text="daemon.sock in $XDG_RUNTIME_DIR/selector or <tempdir>/selector-<uid>"),
    Setting("SELECTOR_DAEMON_TIMEOUT", "float", 0.5,
            "seconds a library call waits for the node daemon's whole reply before working alone (record "
            "transfers wait 2 s); a bad value means the default",
            positive=True, on_bad="default"),
    # --- triton_fused backend (read in plugins/triton_fused) ----------------------------------------------
    Setting("SELECTOR_TRITON_FUSED_CONFIG_DIR", "path", None,
            "folder of tuned tile-configuration files (`<GPU>.json`) for triton_fused",
            default_text="the shipped configs folder"),
    Setting("SELECTOR_TRITON_FUSED_USER_CONFIG_DIR", "path", None,
            "folder of the tile tables `selector tune` writes for triton_fused (`<GPU>.json`); read before the "
            "shipped tables", default_text="triton_fused in selector's user cache folder"),
    Setting("SELECTOR_TRITON_FUSED_GRAPHS", "bool", True,
            "triton_fused records and replays CUDA graphs for small eager calls"),
    Setting("SELECTOR_DIRECT_REPLAYS", "bool", True,
            "a recorded graph is recorded again on the caller's addresses when they repeat, replayed without copies"),
    # --- quantised kernels (read in plugins/quant_kernels) ------------------------------------------------
    Setting("SELECTOR_QUANT_GRAPHS", "bool", True,
            "the quantised grouped path records and replays CUDA graphs for small eager calls"),
    Setting("SELECTOR_QUANT_USER_CONFIG_DIR", "path", None,
            "folder of the tile tables `selector tune` writes for the quantised grouped kernels (`<GPU>.json`); "
            "read before the shipped tables", default_text="quant_kernels in selector's user cache folder"),
    *_probe_settings(),
]

SETTINGS: Mapping[str, Setting] = MappingProxyType({s.name: s for s in _DECLARED})


def setting(name: str) -> Setting:
    """The declaration of `name` (a concrete SELECTOR_PACKAGE_X resolves to the pattern); KeyError if undeclared."""
    found = SETTINGS.get(name)
    if found is None and _PACKAGE_NAME.fullmatch(name):
        found = SETTINGS[PACKAGE_PATTERN]
    if found is None:
        raise KeyError(f"{name} is not a declared selector setting (see selector.settings.SETTINGS)")
    return found


# os.environ.get builds and drops a KeyError for every unset name (about 1 us), and every experts call reads a
# few settings. On POSIX os.environ keeps its values in a dict of bytes that each of its writes updates (setenv,
# del, monkeypatch): reading that dict sees exactly what os.environ.get sees, for a fraction of the cost.
_POSIX_ENVIRON = os.environ if os.name == "posix" and isinstance(getattr(os.environ, "_data", None), dict) else None
_ENCODED: dict[str, bytes] = {}
_DECODED: dict[bytes, str] = {}
_PARSED: dict[tuple[str, str], Any] = {}  # (name, text) -> typed value: parsing is pure, texts are few


def environ_text(name: str) -> str | None:
    """os.environ.get(name), cheaply where os.environ is the POSIX mapping Python made at start-up."""
    env = os.environ
    if env is not _POSIX_ENVIRON:  # not POSIX, or replaced by a caller's mapping
        return env.get(name)
    encoded = _ENCODED.get(name)
    if encoded is None:
        encoded = _ENCODED[name] = os.fsencode(name)
    raw = env._data.get(encoded)  # type: ignore[attr-defined]
    if raw is None:
        return None
    text = _DECODED.get(raw)
    if text is None:
        text = os.fsdecode(raw)
        if len(_DECODED) < 1024:
            _DECODED[raw] = text
    return text


def get(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The current typed value of setting `name`, read from `environ` (default: os.environ) now."""
    declared = SETTINGS.get(name) or setting(name)
    raw = environ_text(name) if environ is None else environ.get(name)
    if raw is None or (declared.empty_is_unset and not raw.strip()):
        return declared.default
    key = (name, raw)
    if key in _PARSED:
        return _PARSED[key]
    try:
        value = declared.parse(raw)
    except ValueError:
        if declared.on_bad == "default":
            return declared.default
        raise
    if len(_PARSED) < 1024:
        _PARSED[key] = value
    return value


def help_table(width: int = 36) -> str:
    """Plain-text table of every setting, for `selector doctor --help`: selector's own, then the probe overrides."""
    lines = ["environment variables (an empty value means unset):"]
    for s in SETTINGS.values():
        if not s.probe:
            lines.append(f"  {s.name:<{width}} {s.doc}")
            lines.append(f"  {'':<{width}} ({s.kind}, default: {s.shown_default()})")
    lines += ["", "probe override variables (an empty value means 'absent'):"]
    lines += [f"  {s.name:<{width}} {s.doc}" for s in SETTINGS.values() if s.probe]
    return "\n".join(lines)


def markdown_rows() -> list[str]:
    """One markdown table row per setting, as README's Configuration section lists them."""
    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    return [
        f"| `{s.name}` | {s.kind} | {cell('probed' if s.probe else s.shown_default())} | {cell(s.doc)} |"
        for s in SETTINGS.values()
    ]


def markdown_table() -> str:
    return "\n".join(["| variable | kind | default | meaning |", "|---|---|---|---|", *markdown_rows()])


if __name__ == "__main__":
    print(markdown_table())
