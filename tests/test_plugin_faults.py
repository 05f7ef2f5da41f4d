"""Plugins that end or stall the process loading them, plugins left out by the allow / block lists, and what a
request for a backend of such a plugin says.

`selector doctor` and `selector plugins` load the plugins in a child process first (selector.plugin_probe): a
plugin that calls `os._exit`, hangs or holds the GIL there is named with what it did, and the command's own process
loads only the others. A model's process loads them in threads with a short timeout and names a plugin that
overran. Every plugin here is a fake distribution built in the test (a `*.dist-info` with `entry_points.txt` on
sys.path), as in tests/test_plugin_safety.py.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import load_factor
from test_registry import make_distribution

from selector import cli, settings
from selector.dispatch import check_backend_name
from selector.errors import PluginUnavailableError
from selector.plugin_probe import DEADLINE_VARIABLE, find_unsafe_plugins
from selector.probes import collect_environment
from selector.ranking import rank
from selector.registry import (
    ALLOW_VARIABLE,
    BLOCK_VARIABLE,
    TIMEOUT_VARIABLE,
    build_registry,
    get_registry,
    load_checked_registry,
    reset_registry,
)
from selector.types import Problem, Status

PLAIN_PLUGIN = '''
from selector import BackendSpec, Requirements, hookimpl

def _load():
    def forward(module, hidden_states, top_k_index, top_k_weights):
        return hidden_states * 0
    return forward

@hookimpl
def selector_backends():
    return [BackendSpec(name="faults_plain", load=_load, requirements=Requirements(devices=frozenset({"cpu"})))]
'''

# prints a line shaped like the child's own report first: what a plugin prints must never be read as one
EXIT_AT_IMPORT = 'import os\nprint(\'{"stage": "end"}\', flush=True)\nos._exit(3)\n'

EXIT_IN_HOOK = '''
import os
from selector import hookimpl

@hookimpl
def selector_backends():
    os._exit(4)
'''

# one C call that never lets go of the GIL: catastrophic backtracking, 2**N steps
GIL_HOLDER = '''
import re
from selector import hookimpl

@hookimpl
def selector_backends():
    re.match(r"(a+)+$", "a" * {n} + "b")
    return []
'''

HANG_AT_IMPORT = "import time\ntime.sleep(3600)\n"

RAISE_AT_IMPORT = "import not_installed_anywhere_faults\n"

MODULES = ("faults_plain", "faults_exit_import", "faults_exit_hook", "faults_gil", "faults_hang")
CPU = collect_environment(environ={"SELECTOR_GPUS": "", "PATH": ""})
PLAIN = Problem(num_experts=8, hidden_size=64, intermediate_size=32, top_k=2, dtype="float32", device="cpu")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in (ALLOW_VARIABLE, BLOCK_VARIABLE, TIMEOUT_VARIABLE, DEADLINE_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    yield tmp_path
    reset_registry()  # the process-wide registry a command or a test loaded holds these plugins
    for name in MODULES:
        sys.modules.pop(name, None)


def _install(site: Path, plugin: str, module: str, source: str) -> None:
    """A distribution `faults-<plugin>` with one entry point `faults_<plugin>` -> `module`."""
    make_distribution(site, f"faults-{plugin}", module, source, {f"faults_{plugin}": module})


def _install_process_killers(site: Path) -> None:
    _install(site, "plain", "faults_plain", PLAIN_PLUGIN)
    _install(site, "exit_import", "faults_exit_import", EXIT_AT_IMPORT)
    _install(site, "exit_hook", "faults_exit_hook", EXIT_IN_HOOK)


def test_a_plugin_that_exits_is_named_with_its_exit_code(site: Path) -> None:
    _install_process_killers(site)
    unsafe, problems = find_unsafe_plugins(environ={})
    assert unsafe == {
        "faults_exit_import": "exited with code 3 during its import (in a child process loading it)",
        "faults_exit_hook": "exited with code 4 during its selector_backends hook (in a child process loading it)",
    }
    assert problems == []


def test_the_command_loads_only_what_the_child_got_through(site: Path) -> None:
    _install_process_killers(site)
    registry = load_checked_registry()  # loading either killer in this process would end the test run
    assert "faults_plain" in registry.names and "eager" in registry.names
    info = {p.name: p for p in registry.plugins}
    assert info["faults_exit_import"].error == "exited with code 3 during its import (in a child process loading it)"
    assert info["faults_exit_hook"].error and "exited with code 4" in info["faults_exit_hook"].error
    assert get_registry() is registry  # what the rest of the command uses


def test_a_stalled_plugin_is_named_after_the_deadline(site: Path) -> None:
    _install(site, "hang", "faults_hang", HANG_AT_IMPORT)
    _install(site, "gil", "faults_gil", GIL_HOLDER.replace("{n}", "40"))
    start = time.monotonic()
    unsafe, _ = find_unsafe_plugins(environ={}, deadline=0.5)
    assert unsafe == {
        "faults_hang": f"exceeded the 0.5 s deadline ({DEADLINE_VARIABLE}) in its import in a child process, "
                       "which was stopped",
        "faults_gil": f"exceeded the 0.5 s deadline ({DEADLINE_VARIABLE}) in its selector_backends hook in a "
                      "child process, which was stopped",
    }
    assert time.monotonic() - start < 4 * load_factor()


def test_plugins_command_reports_them(site: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _install_process_killers(site)
    assert cli.main(["plugins", "--json"]) == 1  # a broken plugin is an error of `selector plugins`
    report = json.loads(capsys.readouterr().out)
    errors = {p["name"]: p["error"] for p in report["plugins"]}
    assert "exited with code 3 during its import" in errors["faults_exit_import"]
    assert "exited with code 4 during its selector_backends hook" in errors["faults_exit_hook"]
    assert errors["faults_plain"] is None


def test_the_check_can_be_turned_off(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _install(site, "plain", "faults_plain", PLAIN_PLUGIN)
    monkeypatch.setenv(DEADLINE_VARIABLE, "0")
    assert "faults_plain" in load_checked_registry().names


@pytest.mark.slow
def test_doctor_finishes_with_every_kind_of_process_killer(site: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """One os._exit at import, one in the hook, a hook holding the GIL over 40 s, a hang: with the default
    deadline, doctor names each and finishes in under 10 s."""
    _install_process_killers(site)
    _install(site, "gil", "faults_gil", GIL_HOLDER.replace("{n}", "31"))  # 2**31 steps: over 40 s (about 65 s here)
    _install(site, "hang", "faults_hang", HANG_AT_IMPORT)
    monkeypatch.setenv("SELECTOR_GPUS", "")
    start = time.monotonic()
    code = cli.main(["doctor", "--json"])
    took = time.monotonic() - start
    report = json.loads(capsys.readouterr().out)
    deadline = settings.get(DEADLINE_VARIABLE)
    errors = {p["name"]: p["error"] for p in report["plugins"]}
    assert "exited with code 3 during its import" in errors["faults_exit_import"]
    assert "exited with code 4 during its selector_backends hook" in errors["faults_exit_hook"]
    assert f"exceeded the {deadline:g} s deadline" in errors["faults_gil"] and "hook" in errors["faults_gil"]
    assert f"exceeded the {deadline:g} s deadline" in errors["faults_hang"] and "import" in errors["faults_hang"]
    assert errors["faults_plain"] is None
    assert sorted(w.split(":")[0] for w in report["warnings"] if w.startswith("plugin ")) == [
        "plugin faults_exit_hook", "plugin faults_exit_import", "plugin faults_gil", "plugin faults_hang"]
    assert code == 0 and report["broken"] == []  # broken plugins nobody asked for are warnings
    assert took < 10 * load_factor(), f"doctor took {took:.1f} s"


# --- a model's process: a short timeout, and a plugin that overran named -----------------------------------------


def test_the_default_timeout_is_short() -> None:
    assert settings.get(TIMEOUT_VARIABLE, {}) <= 5


def test_an_overrun_is_named_in_a_warning_and_in_the_ranking(site: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _install(site, "hang", "faults_hang", "import threading\nthreading.Event().wait(2)\n")
    monkeypatch.setenv(TIMEOUT_VARIABLE, "0.3")
    reset_registry()
    with pytest.warns(RuntimeWarning, match=r"plugin 'faults_hang' \(distribution faults-hang 0.1\) import failed: "
                                            r"did not answer within 0.3 s"):
        registry = get_registry()
    assert "eager" in registry.names
    why = rank(PLAIN, CPU, registry).excluded["faults_hang"]
    assert why.status is Status.PLUGIN_ERROR
    assert why.reason.startswith("plugin 'faults_hang' (distribution faults-hang 0.1) failed to import: did not "
                                 "answer within 0.3 s")


def test_a_hook_that_held_the_gil_past_the_timeout_overran(site: Path) -> None:
    _install(site, "gil", "faults_gil", GIL_HOLDER.replace("{n}", "22"))  # about half a second in one C call
    registry = build_registry(environ={TIMEOUT_VARIABLE: "0.05"})
    info = next(p for p in registry.plugins if p.name == "faults_gil")
    assert info.overran and info.error and info.error.startswith("hook failed: did not answer within 0.05 s")


# --- a backend asked for by name that its plugin keeps away --------------------------------------------------------


def test_a_blocked_plugin_is_named(site: Path) -> None:
    _install(site, "plain", "faults_plain", PLAIN_PLUGIN)
    registry = build_registry(environ={BLOCK_VARIABLE: "faults_plain"})
    with pytest.raises(PluginUnavailableError, match=(
            r"experts backend 'faults_plain' is not available: plugin 'faults_plain' \(distribution faults-plain "
            r"0.1\) is blocked by SELECTOR_PLUGINS_BLOCK. Fix: remove it from SELECTOR_PLUGINS_BLOCK")):
        registry.get("faults_plain")


def test_a_blocked_backend_is_named_with_its_plugin(site: Path) -> None:
    _install(site, "plain", "faults_plain", PLAIN_PLUGIN.replace('name="faults_plain"', 'name="faults_backend"'))
    registry = build_registry(environ={BLOCK_VARIABLE: "faults_backend"})
    with pytest.raises(PluginUnavailableError, match=(
            r"backend 'faults_backend' \(plugin 'faults_plain', distribution faults-plain 0.1\) is blocked by "
            r"SELECTOR_PLUGINS_BLOCK")):
        registry.get("faults_backend")


def test_a_plugin_that_failed_to_import_is_named(site: Path) -> None:
    _install(site, "plain", "faults_plain", RAISE_AT_IMPORT)
    registry = build_registry(environ={})
    with pytest.raises(PluginUnavailableError) as caught:
        registry.get("faults_plain")
    assert str(caught.value).startswith(
        "experts backend 'faults_plain' is not available: plugin 'faults_plain' (distribution faults-plain 0.1) "
        "failed to import: ModuleNotFoundError: No module named 'not_installed_anywhere_faults'")
    # an ImportError (something missing), and still the ValueError an unknown name always raised
    assert isinstance(caught.value, ImportError) and isinstance(caught.value, ValueError)
    with pytest.raises(ValueError, match="unknown experts backend 'faults_other'"):
        registry.get("faults_other")


def test_an_explicit_request_names_the_quarantined_plugin(site: Path) -> None:
    _install(site, "exit_import", "faults_exit_import", EXIT_AT_IMPORT)
    load_checked_registry()
    with pytest.raises(PluginUnavailableError, match="plugin 'faults_exit_import' .* exited with code 3"):
        check_backend_name("faults_exit_import")


# --- allow and block lists name plugins, distributions or backends ------------------------------------------------


def test_allow_by_backend_name_loads_that_backend(site: Path) -> None:
    _install(site, "plain", "faults_plain", PLAIN_PLUGIN.replace('name="faults_plain"', 'name="faults_backend"'))
    registry = build_registry(environ={ALLOW_VARIABLE: "faults_backend"})
    assert registry.names == ["faults_backend"]
    info = {p.name: p for p in registry.plugins}
    assert info["eager"].skipped == f"none of its backends is in {ALLOW_VARIABLE}"
    with pytest.raises(PluginUnavailableError, match=f"backend 'eager' .* is not listed in {ALLOW_VARIABLE}"):
        registry.get("eager")


@pytest.mark.parametrize("variable", [ALLOW_VARIABLE, BLOCK_VARIABLE])
def test_lists_take_distribution_names(site: Path, variable: str) -> None:
    _install(site, "plain", "faults_plain", PLAIN_PLUGIN.replace('name="faults_plain"', 'name="faults_backend"'))
    registry = build_registry(environ={variable: "Faults_Plain"})  # compared as PEP 503 names
    info = next(p for p in registry.plugins if p.name == "faults_plain")
    if variable == ALLOW_VARIABLE:
        assert registry.names == ["faults_backend"] and info.backends == ("faults_backend",)
    else:
        assert "faults_backend" not in registry.names and info.skipped == f"in {BLOCK_VARIABLE}"
        assert "eager" in registry.names


def test_allow_by_plugin_name_skips_the_others_unimported(site: Path) -> None:
    _install(site, "plain", "faults_plain", PLAIN_PLUGIN)
    _install(site, "exit_import", "faults_exit_import", EXIT_AT_IMPORT)  # importing it here would end the run
    registry = build_registry(environ={ALLOW_VARIABLE: "faults_plain,eager"})
    assert registry.names == ["eager", "faults_plain"]
    info = next(p for p in registry.plugins if p.name == "faults_exit_import")
    assert info.skipped == f"not in {ALLOW_VARIABLE}"


def test_a_malformed_deadline_means_the_default_and_doctor_reports_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from selector import settings
    from selector.doctor import malformed_settings

    monkeypatch.setenv("SELECTOR_PLUGIN_DEADLINE", "abc")
    assert settings.get("SELECTOR_PLUGIN_DEADLINE") == settings.setting("SELECTOR_PLUGIN_DEADLINE").default
    malformed, _ = malformed_settings(dict(os.environ))
    assert any("SELECTOR_PLUGIN_DEADLINE" in message for message in malformed), malformed


@pytest.mark.slow
def test_a_model_process_loads_and_runs_auto_with_process_killers_installed(site: Path, tmp_path: Path) -> None:
    """A model's process checks the third-party plugins in a child once per installed plugin set (the verdict kept
    in the user's cache) and never loads those that exit or stall it: auto runs; a second process reuses the
    verdict."""
    import subprocess

    _install_process_killers(site)
    _install(site, "gil", "faults_gil", GIL_HOLDER.replace("{n}", "31"))
    _install(site, "hang", "faults_hang", HANG_AT_IMPORT)
    code = ("import torch, selector\nfrom selector.testing import make_experts\n"
            "m = make_experts(4, 16, 8)\nidx = torch.tensor([[0, 1], [2, 3], [1, 2]])\n"
            "with torch.no_grad():\n    m(torch.randn(3, 16), idx, torch.full((3, 2), 0.5))\n"
            "print('ran', selector.last_backend(m))\n")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path]), "XDG_CACHE_HOME": str(tmp_path / "cache"),
           DEADLINE_VARIABLE: "2"}  # fmt: skip
    verdicts = tmp_path / "cache" / "selector" / "plugin_check.json"
    written = []
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and "ran " in done.stdout, done.stderr[-2000:]
        written.append(verdicts.stat().st_mtime_ns)
    (verdict,) = json.loads(verdicts.read_text()).values()
    assert {"faults_exit_import", "faults_exit_hook", "faults_gil", "faults_hang"} <= set(verdict["unsafe"])
    assert written[0] == written[1], "the second process read the verdict instead of checking again"
