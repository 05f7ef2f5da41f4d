"""Plugin discovery for `selector doctor` and `selector plugins`: the plugins are loaded in a child process first.

A thread cannot stop a plugin that calls `os._exit`, crashes the interpreter, or holds the GIL in a C loop: the
process that loads it ends or stalls with it. So the commands load every plugin in a child (`python -c`), which
reports each plugin's stages ("import", "hook", "done") on a pipe of its own. A child that exits during a plugin's
stage names that plugin (with the exit code or signal); a stage that takes longer than SELECTOR_PLUGIN_DEADLINE
seconds names it too (the child is killed). The check then runs again without the plugins named so far, until a
child gets through. The command's process then loads only the plugins the child got through
(`registry.load_registry(quarantine=...)`): the others are reported broken with what they did, never imported.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from dataclasses import dataclass
from typing import IO

import platformdirs

from selector import settings

DEADLINE_VARIABLE = "SELECTOR_PLUGIN_DEADLINE"
STARTUP_S = 30.0  # how long the child may take to start Python and read the entry points (no plugin code yet)
CACHE_FILE = "plugin_check.json"  # in this user's cache folder: the verdict per installed plugin set
CACHE_ENTRIES = 32  # plugin sets remembered (the newest)
_CHILD = (
    "import json, sys\n"
    "args = json.loads(sys.argv[1])\n"
    "sys.path[:] = args['path']\n"
    "from selector.plugin_child import run_child\n"
    "run_child(args)\n"
)


@dataclass(frozen=True)
class _Pass:
    """How one child run ended: got through every plugin, or stopped by `plugin` (None: outside any plugin)."""

    finished: bool
    plugin: str | None = None
    what: str = ""


def _exit_text(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _stage_text(stage: str) -> str:
    return "its import" if stage == "import" else "its selector_backends hook"


def _stop(child: subprocess.Popen[bytes]) -> None:
    """Kill the child and whatever it started (it runs in a session of its own)."""
    try:
        if hasattr(os, "killpg"):
            os.killpg(child.pid, signal.SIGKILL)
        else:
            child.kill()
    except (ProcessLookupError, PermissionError):
        pass
    child.wait()


def _read_lines(stream: IO[bytes], lines: queue.Queue[bytes | None]) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)  # end of the pipe: the child exited (or closed it)


def _one_pass(skip: set[str], environ: Mapping[str, str] | None, deadline: float) -> _Pass:
    """One child that loads every plugin but `skip`; each plugin it gets through joins `skip`."""
    args = {"path": [str(p) for p in sys.path], "environ": None if environ is None else dict(environ),
            "skip": sorted(skip), "deadline": deadline}
    with tempfile.TemporaryFile() as errors:
        child = subprocess.Popen(
            [sys.executable, "-c", _CHILD, json.dumps(args)],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=errors, start_new_session=True,
        )
        assert child.stdout is not None
        lines: queue.Queue[bytes | None] = queue.Queue()
        threading.Thread(target=_read_lines, args=(child.stdout, lines), daemon=True).start()
        plugin, stage, since = None, "", time.monotonic()
        while True:
            limit = (deadline if plugin is not None else STARTUP_S) - (time.monotonic() - since)
            try:
                line = lines.get(timeout=max(limit, 0.0))
            except queue.Empty:
                _stop(child)
                if plugin is None:
                    return _Pass(False, None, f"did not get to the next plugin within {STARTUP_S:g} s")
                return _Pass(False, plugin, f"exceeded the {deadline:g} s deadline ({DEADLINE_VARIABLE}) in "
                                            f"{_stage_text(stage)} in a child process, which was stopped")
            if line is None:
                code = child.wait()
                _stop(child)  # whatever the plugins started in the child's session goes with it
                if stage == "end":
                    return _Pass(True)
                if plugin is None:
                    errors.seek(0)
                    tail = errors.read().decode(errors="replace").strip().splitlines()[-1:]
                    return _Pass(False, None, f"{_exit_text(code)} outside any plugin ({' '.join(tail)})")
                return _Pass(False, plugin, f"{_exit_text(code)} during {_stage_text(stage)} "
                                            "(in a child process loading it)")
            try:
                message = json.loads(line)
            except ValueError:  # not the child's report: ignored
                continue
            stage, since = message["stage"], time.monotonic()
            if stage == "done":
                skip.add(message["plugin"])
            plugin = message.get("plugin") if stage in ("import", "hook") else None


def find_unsafe_plugins(
    environ: Mapping[str, str] | None = None, deadline: float | None = None
) -> tuple[dict[str, str], list[str]]:
    """Plugins that end or stall a process loading them (plugin name -> what happened), and the check's own
    problems (a child that failed outside any plugin: the plugins it did not reach are then loaded unchecked)."""
    if deadline is None:
        deadline = float(settings.get(DEADLINE_VARIABLE, environ))
    unsafe: dict[str, str] = {}
    checked: set[str] = set()  # got through, or named: a later pass starts after them
    while True:
        outcome = _one_pass(checked, environ, deadline)
        if outcome.finished:
            return unsafe, []
        if outcome.plugin is None or outcome.plugin in unsafe:
            return unsafe, [f"the child process that checks plugins {outcome.what}; the plugins were loaded "
                            "in this process unchecked"]
        unsafe[outcome.plugin] = outcome.what
        checked.add(outcome.plugin)


def cached_verdict(key: str, environ: Mapping[str, str] | None = None) -> tuple[dict[str, str], list[str]]:
    """`find_unsafe_plugins` for the installed plugin set `key` (its entry points and versions, and the allow and
    block lists), remembered in this user's cache: a model process pays the child check once per plugin set, not
    per process. A cache that cannot be read is checked again; one that cannot be written is only not kept."""
    path = Path(platformdirs.user_cache_dir("selector")) / CACHE_FILE
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    known = known if isinstance(known, dict) else {}
    entry = known.get(key)
    if isinstance(entry, dict) and isinstance(entry.get("unsafe"), dict):
        return {str(k): str(v) for k, v in entry["unsafe"].items()}, []
    unsafe, problems = find_unsafe_plugins(environ)
    if not problems:  # a check that failed outside any plugin is not remembered: the next process tries again
        kept = {**known, key: {"unsafe": unsafe}}
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{CACHE_FILE}.", delete=False) as f:
                json.dump(dict(list(kept.items())[-CACHE_ENTRIES:]), f)
            os.replace(f.name, path)
        except OSError:
            pass
    return unsafe, problems
