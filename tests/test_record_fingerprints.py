"""Each tuning record carries its own backend's fingerprint: installing, upgrading or blocking one plugin stales
that plugin's records only; records of the older single-fingerprint format are trusted (and rewritten) only where
they are proven current."""

from __future__ import annotations

import sys
import textwrap
import threading
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

from selector import tuning, tuning_store
from selector.daemon import client, wire
from selector.daemon.server import DaemonServer
from selector.hookspecs import ENTRY_POINT_GROUP
from selector.probes import Environment, collect_environment
from selector.registry import Registry, build_registry, plugin_versions
from selector.tuning import Fingerprints, TuningTable, measured_for
from selector.tuning_store import TuningStore, current_fingerprints
from selector.types import Problem

ENV = {
    "SELECTOR_GPUS": "NVIDIA H200:9.0:141",
    "SELECTOR_PACKAGE_TORCH": "2.9.0",
    "SELECTOR_PACKAGE_TRITON": "3.6.0",
    "PATH": "",
}
GPU = "NVIDIA H200"
PROBLEM = Problem(num_experts=8, hidden_size=64, intermediate_size=32, top_k=2, num_tokens=4, device="cuda")
KEY = tuning.problem_key(PROBLEM)
PLUGIN = "fake_acme"  # the entry point
BACKEND = "acme_experts"  # the backend it provides

ACME = '''
from selector import BackendSpec, Requirements, hookimpl

def _load():
    def forward(module, hidden_states, top_k_index, top_k_weights):
        return hidden_states
    return forward

@hookimpl
def selector_backends():
    return [BackendSpec(name="acme_experts", load=_load, description="a fake third-party kernel",
                        requirements=Requirements(packages={"fake-acme-dep": ""}))]
'''
OTHER = ACME.replace("acme_experts", "other_experts").replace('packages={"fake-acme-dep": ""}', "")


def _distribution(root: Path, dist: str, version: str, module: str = "", source: str = "",
                  entry_point: str = "") -> Path:
    """A `*.dist-info` (with entry_points.txt when it has an entry point) and its module, under `root`."""
    root.mkdir(parents=True, exist_ok=True)
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    if module:
        (root / f"{module}.py").write_text(textwrap.dedent(source))
        (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{entry_point} = {module}\n")
    return root


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """Folders of fake distributions: the plugin at 0.1 and 0.2, its declared package at 1.0 and 2.0, another
    plugin. Each goes on sys.path only while a test installs it."""
    roots = {
        "acme-0.1": _distribution(tmp_path / "acme1", "fake-acme", "0.1", "fake_acme_plugin", ACME, PLUGIN),
        "acme-0.2": _distribution(tmp_path / "acme2", "fake-acme", "0.2", "fake_acme_plugin", ACME, PLUGIN),
        "dep-1.0": _distribution(tmp_path / "dep1", "fake-acme-dep", "1.0"),
        "dep-2.0": _distribution(tmp_path / "dep2", "fake-acme-dep", "2.0"),
        "other": _distribution(tmp_path / "other", "fake-other", "0.1", "fake_other_plugin", OTHER, "fake_other"),
    }
    monkeypatch.setattr(sys, "path", list(sys.path))  # each install below changes this copy only
    yield roots
    for name in ("fake_acme_plugin", "fake_other_plugin"):
        sys.modules.pop(name, None)


def _install(roots: list[Path], environ: dict[str, str] | None = None) -> Registry:
    """A fresh registry of the built-ins and the fake distributions in `roots` (and only those on sys.path)."""
    sys.path[:] = [str(r) for r in roots] + [p for p in sys.path if not p.startswith(str(roots[0].parent))]
    ours = {"moe-selector", "fake-acme", "fake-other"}  # not any other plugin this machine has installed
    eps = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)
           if ep.dist is not None and ep.dist.metadata["Name"] in ours]
    return build_registry(entry_points=eps, environ=environ or {})


def _record(fingerprint: str, backend: str, **changes: Any) -> dict[str, Any]:
    record = {"fingerprint": fingerprint, "gpu": GPU, "problem": KEY, "mode": "eager", "tokens": 4}
    return {**record, "backend": backend, "time_s": 1e-4, **changes}


@pytest.fixture
def env() -> Environment:
    return collect_environment(ENV)


@pytest.fixture
def measured(site: dict[str, Path], env: Environment) -> tuple[Fingerprints, list[dict[str, Any]]]:
    """The fingerprints with fake-acme 0.1 (and its package 1.0) installed, and a record of a built-in backend
    and of the plugin's backend measured then."""
    registry = _install([site["acme-0.1"], site["dep-1.0"]])
    assert BACKEND in registry.names and "grouped_mm" in registry.names
    fps = current_fingerprints(env, registry)
    return fps, [_record(fps.of("grouped_mm"), "grouped_mm"), _record(fps.of(BACKEND), BACKEND, time_s=5e-5)]


def _trusted(records: list[dict[str, Any]], fps: Fingerprints, env: Environment) -> set[str]:
    table = TuningTable.from_records(records, fps)
    return set(measured_for(PROBLEM, env, table) or {})


def test_installing_another_plugin_stales_nothing(site: dict[str, Path], env: Environment,
                                                  measured: tuple[Fingerprints, list[dict[str, Any]]]) -> None:
    before, records = measured
    after = current_fingerprints(env, _install([site["acme-0.1"], site["dep-1.0"], site["other"]]))
    assert "other_experts" in after.by_backend
    assert after.legacy != before.legacy  # the older single fingerprint would have thrown every record away
    assert _trusted(records, after, env) == {"grouped_mm", BACKEND}


def test_upgrading_a_plugin_stales_its_records_only(site: dict[str, Path], env: Environment,
                                                    measured: tuple[Fingerprints, list[dict[str, Any]]]) -> None:
    before, records = measured
    after = current_fingerprints(env, _install([site["acme-0.2"], site["dep-1.0"]]))
    assert after.of(BACKEND) != before.of(BACKEND)
    assert all(after.of(b) == before.of(b) for b in before.by_backend if b != BACKEND)  # every built-in's
    table = TuningTable.from_records(records, after)
    assert (len(table), table.stale, table.stale_by_backend) == (1, 1, {BACKEND: 1})
    assert _trusted(records, after, env) == {"grouped_mm"}


def test_upgrading_a_declared_package_stales_that_plugin_only(
        site: dict[str, Path], env: Environment, measured: tuple[Fingerprints, list[dict[str, Any]]]) -> None:
    before, records = measured
    after = current_fingerprints(env, _install([site["acme-0.1"], site["dep-2.0"]]))
    assert after.of(BACKEND) != before.of(BACKEND) and after.of("grouped_mm") == before.of("grouped_mm")
    assert _trusted(records, after, env) == {"grouped_mm"}
    gone = current_fingerprints(env, _install([site["acme-0.1"]]))  # the declared package uninstalled
    assert gone.of(BACKEND) not in (before.of(BACKEND), after.of(BACKEND))


def test_a_blocked_plugin_s_records_are_unused_not_stale(
        site: dict[str, Path], env: Environment, tmp_path: Path,
        measured: tuple[Fingerprints, list[dict[str, Any]]]) -> None:
    before, records = measured
    blocked = current_fingerprints(env, _install([site["acme-0.1"], site["dep-1.0"]],
                                                 {"SELECTOR_PLUGINS_BLOCK": PLUGIN}))
    assert BACKEND not in blocked.by_backend
    table = TuningTable.from_records(records, blocked)
    assert (len(table), table.stale, table.unknown) == (1, 0, 1)
    store = TuningStore(tmp_path / "store.sqlite3")
    store.put(records + [_record("0" * 32, "grouped_mm", tokens=8)])
    summary = store.summary(blocked)
    assert (summary.current, summary.stale, summary.other) == (1, 1, 1)
    assert store.clear_stale(blocked) == 1  # the built-in's stale record; the blocked plugin's stays
    assert {r["backend"] for r in store.records()} == {"grouped_mm", BACKEND}
    assert _trusted(store.records(), before, env) == {"grouped_mm", BACKEND}  # unblocked: current again


def test_the_machine_torch_and_triton_stale_every_backend(site: dict[str, Path],
                                                          measured: tuple[Fingerprints, list[dict[str, Any]]]) -> None:
    _, records = measured
    registry = _install([site["acme-0.1"], site["dep-1.0"]])
    for change in ({"SELECTOR_PACKAGE_TRITON": "3.7.0"}, {"SELECTOR_PACKAGE_TORCH": "2.10.0"},
                   {"SELECTOR_GPUS": "NVIDIA H200:9.0:80"}, {"SELECTOR_DRIVER_VERSION": "999.1"}):
        other = collect_environment({**ENV, **change})
        fps = current_fingerprints(other, registry)
        assert TuningTable.from_records(records, fps).stale == 2, change


def test_a_built_in_follows_selector_s_version_a_plugin_its_own(
        site: dict[str, Path], env: Environment, monkeypatch: pytest.MonkeyPatch,
        measured: tuple[Fingerprints, list[dict[str, Any]]]) -> None:
    import selector

    before, _ = measured
    monkeypatch.setattr(selector, "__version__", "999.0")
    after = current_fingerprints(env, _install([site["acme-0.1"], site["dep-1.0"]]))
    assert after.of("grouped_mm") != before.of("grouped_mm") and after.of(BACKEND) == before.of(BACKEND)


def test_old_format_records_are_trusted_only_where_proven_and_then_rewritten(
        site: dict[str, Path], env: Environment, tmp_path: Path,
        measured: tuple[Fingerprints, list[dict[str, Any]]]) -> None:
    before, _ = measured
    registry = _install([site["acme-0.1"], site["dep-1.0"]])
    assert before.legacy == tuning.legacy_fingerprint(env, plugin_versions(registry))  # what older records carry
    old = [_record(before.legacy, "grouped_mm"), _record(before.legacy, BACKEND, time_s=5e-5),
           _record(before.legacy, "gone_backend"),  # a backend no longer loaded: stays as it is
           _record("9" * 32, "batched_mm")]  # another environment's old fingerprint: stale, never trusted
    table = TuningTable.from_records(old, before)
    assert (len(table), table.legacy, table.stale, table.unknown) == (2, 2, 1, 1)
    assert _trusted(old, before, env) == {"grouped_mm", BACKEND}

    store = TuningStore(tmp_path / "store.sqlite3")
    store.put(old + [_record(before.of("grouped_mm"), "grouped_mm", time_s=2e-4)])  # a newer one, same key
    assert store.migrate(before) == 2
    assert store.migrate(before) == 0  # nothing left to rewrite (and nothing written)
    by_backend = {r["backend"]: r for r in store.records()}
    assert by_backend["grouped_mm"] == _record(before.of("grouped_mm"), "grouped_mm", time_s=2e-4)  # newer kept
    assert by_backend[BACKEND]["fingerprint"] == before.of(BACKEND)
    assert by_backend["gone_backend"]["fingerprint"] == before.legacy

    # after another plugin is installed the old fingerprint no longer matches: rewritten records still do
    after = current_fingerprints(env, _install([site["acme-0.1"], site["dep-1.0"], site["other"]]))
    assert _trusted(store.records(), after, env) == {"grouped_mm", BACKEND}
    assert _trusted(old, after, env) == set()  # not rewritten: no longer provable, so stale


def test_this_process_s_table_migrates_the_default_store(site: dict[str, Path], env: Environment,
                                                         monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from selector import registry as registry_module
    from selector.environment import set_environment

    registry = _install([site["acme-0.1"], site["dep-1.0"]])
    monkeypatch.setattr(registry_module, "get_registry", lambda: registry)
    monkeypatch.setattr(tuning_store, "DATA_DIR", tmp_path / "no-shipped-files")
    monkeypatch.setattr(tuning_store, "shared_tuning_records", lambda fingerprint=None: [])
    monkeypatch.setenv("SELECTOR_TUNING_STORE", str(tmp_path / "default.sqlite3"))
    set_environment(env)
    fps = current_fingerprints()
    tuning_store.save_records([_record(fps.legacy, "grouped_mm"), _record(fps.legacy, BACKEND, time_s=5e-5)])
    table = tuning_store.tuning_table()
    assert len(table) == 2 and table.stale == 0
    assert {r["fingerprint"] for r in tuning_store.default_store().records()} == {fps.of("grouped_mm"),
                                                                                 fps.of(BACKEND)}
    assert set(tuning_store.measured_for(PROBLEM, env) or {}) == {"grouped_mm", BACKEND}


def test_a_tuner_measures_again_only_the_backend_whose_facts_changed(
        site: dict[str, Path], env: Environment, tmp_path: Path,
        measured: tuple[Fingerprints, list[dict[str, Any]]]) -> None:
    _, records = measured
    store = TuningStore(tmp_path / "store.sqlite3")
    store.put(records)
    after = current_fingerprints(env, _install([site["acme-0.2"], site["dep-1.0"]]))
    assert store.unmeasured(after, GPU, KEY, "eager", 4, ["grouped_mm", BACKEND]) == [BACKEND]


def test_the_daemon_answers_the_records_of_several_fingerprints(tmp_path: Path, env: Environment) -> None:
    srv = DaemonServer(tmp_path / "run" / "d.sock", env=env, store_file=tmp_path / "daemon.sqlite3")
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        environ = {wire.SOCKET_VARIABLE: str(srv.path)}
        a, b, c = (_record(f * 32, backend) for f, backend in (("a", "grouped_mm"), ("b", BACKEND), ("c", "eager")))
        assert client.share_tuning_records([a, b, c], environ) == 3
        assert client.shared_tuning_records(environ, fingerprint=["a" * 32, "b" * 32]) == [a, b]
        assert client.shared_tuning_records(environ, fingerprint="c" * 32) == [c]
        bad = client.request(srv.path, {"op": "tuning_get", "fingerprint": ["a" * 32, 3]})
        assert bad is not None and bad["ok"] is False and "fingerprint is a string" in bad["error"]
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=5)
