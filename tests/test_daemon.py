"""The node daemon over a Unix socket in a temp dir: shared probes and tuning results, bounded in time."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from selector.daemon import client, wire
from selector.daemon.server import DaemonServer
from selector.probes import collect_environment


@pytest.fixture
def server(tmp_path: Path):
    env = collect_environment({"SELECTOR_GPUS": "NVIDIA H200:9.0:141", "PATH": ""})
    srv = DaemonServer(tmp_path / "d.sock", env=env)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=5)


def test_clients_share_probe_facts(server: DaemonServer) -> None:
    env = client.environment_from_daemon({wire.SOCKET_VARIABLE: str(server.path)})
    assert env is not None and env.gpu.devices[0].name == "NVIDIA H200"
    assert env.fingerprint() == server.state.env.fingerprint()
    status = wire.status_path(server.path).read_text()
    assert str(os.getpid()) in status and server.state.env.fingerprint() in status


def test_tuning_results_put_by_one_client_are_read_by_another(server: DaemonServer) -> None:
    record = RECORD
    assert client.request(server.path, {"op": "tuning_put", "records": [record]}) == {"ok": True, "stored": 1}
    faster = {**record, "time_s": 5e-5}
    client.request(server.path, {"op": "tuning_put", "records": [faster]})
    got = client.request(server.path, {"op": "tuning_get"})["records"]
    assert got == [faster]


def test_bad_requests_get_errors_not_crashes(server: DaemonServer) -> None:
    assert client.request(server.path, {"op": "dance"}) == {"ok": False, "error": "unknown op 'dance'"}
    assert client.request(server.path, {"nop": 1})["ok"] is False
    assert client.ping(server.path)


def test_no_daemon_means_none_and_stale_socket_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    assert client.environment_from_daemon({wire.SOCKET_VARIABLE: str(path)}) is None
    path.write_text("")  # a leftover from a daemon that died
    srv = DaemonServer(path, env=collect_environment({"SELECTOR_GPUS": "", "PATH": ""}))
    try:
        assert path.exists() and wire.status_path(path).exists()
    finally:
        srv.server_close()
    assert not path.exists()


def test_cli_start_status_stop(tmp_path: Path) -> None:
    sock = str(tmp_path / "cli.sock")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "SELECTOR_GPUS": ""}
        return subprocess.run([sys.executable, "-m", "selector.cli", "daemon", *args, "--socket", sock],
                              capture_output=True, text=True, timeout=60, env=env)

    assert cli("status").returncode == 1
    started = cli("start")
    try:
        assert started.returncode == 0 and "started" in started.stdout
        status = cli("status")
        assert status.returncode == 0 and '"pid"' in status.stdout
    finally:
        assert cli("stop").returncode == 0


def test_current_environment_asks_the_daemon_first(server: DaemonServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from selector import environment

    monkeypatch.setenv(wire.SOCKET_VARIABLE, str(server.path))
    environment.set_environment(None)
    try:
        assert environment.current_environment().gpu.devices[0].name == "NVIDIA H200"  # the daemon's facts
    finally:
        environment.set_environment(None)


def test_shared_timings_reach_the_tuning_store(server: DaemonServer, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from selector import tuning_store

    record = RECORD
    environ = {wire.SOCKET_VARIABLE: str(server.path)}
    assert client.share_tuning_records([record], environ) == 1
    assert client.shared_tuning_records(environ) == [record]
    assert client.shared_tuning_records({wire.SOCKET_VARIABLE: str(tmp_path / "none.sock")}) == []
    monkeypatch.setenv(wire.SOCKET_VARIABLE, str(server.path))
    monkeypatch.setattr(tuning_store, "DATA_DIR", tmp_path / "none")
    monkeypatch.setenv("SELECTOR_TUNING_STORE", str(tmp_path / "tuning.sqlite3"))
    assert tuning_store.known_records() == [record]


RECORD = {"fingerprint": "f" * 32, "gpu": "NVIDIA H200", "problem": "E8-H16-I8-k2/bfloat16/dense/silu/gated",
          "mode": "eager", "tokens": 4, "backend": "grouped_mm", "time_s": 1e-4}


def test_wire_frames_one_message_per_line() -> None:
    frame = wire.encode({"op": wire.PING})
    assert frame == b'{"op": "ping"}\n' and wire.decode(frame) == {"op": "ping"}
    with pytest.raises(ValueError):
        wire.decode(b"")  # the peer closed before replying


def _imports_after(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return set(out.stdout.split())


def test_the_client_loads_nothing_of_the_server() -> None:
    loaded = _imports_after("selector.daemon.client")
    assert "selector.daemon.server" not in loaded and "socketserver" not in loaded
    assert "selector.tuning" not in loaded


def test_the_tuning_lookup_is_pure() -> None:
    import ast

    from selector import tuning

    tree = ast.parse(Path(tuning.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    allowed = {"__future__", "math", "collections.abc", "typing", "selector.probes", "selector.types",
               "selector.presets"}
    assert imported <= allowed | {"hashlib", "json", "dataclasses"}  # no sockets, files, environment variables or torch of its own
    loaded = _imports_after("selector.tuning")
    assert "torch" not in loaded
    above = ("selector.daemon", "selector.environment", "selector.tuning_store", "selector.dispatch")
    assert not {m for m in loaded if m.startswith(above)}
