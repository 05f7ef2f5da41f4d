"""The node daemon over a Unix socket in a temp dir: shared probes and tuning results, bounded in time."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from selector.probes import collect_environment
from selector import daemon


@pytest.fixture
def server(tmp_path: Path):
    env = collect_environment({"SELECTOR_GPUS": "NVIDIA H200:9.0:141", "PATH": ""})
    srv = daemon.DaemonServer(tmp_path / "d.sock", env=env)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=5)


def test_clients_share_probe_facts(server: daemon.DaemonServer) -> None:
    env = daemon.environment_from_daemon({daemon.SOCKET_VARIABLE: str(server.path)})
    assert env is not None and env.gpu.devices[0].name == "NVIDIA H200"
    assert env.fingerprint() == server.state.env.fingerprint()
    status = daemon.status_path(server.path).read_text()
    assert str(os.getpid()) in status and server.state.env.fingerprint() in status


def test_tuning_results_put_by_one_client_are_read_by_another(server: daemon.DaemonServer) -> None:
    record = {"gpu": "NVIDIA H200", "E": 8, "H": 16, "I": 8, "k": 2, "dtype": "bfloat16", "tokens": 4,
              "backend": "grouped_mm", "time_s": 1e-4}
    assert daemon.request(server.path, {"op": "tuning_put", "records": [record]}) == {"ok": True, "stored": 1}
    faster = {**record, "time_s": 5e-5}
    daemon.request(server.path, {"op": "tuning_put", "records": [faster]})
    got = daemon.request(server.path, {"op": "tuning_get"})["records"]
    assert got == [faster]


def test_bad_requests_get_errors_not_crashes(server: daemon.DaemonServer) -> None:
    assert daemon.request(server.path, {"op": "dance"}) == {"ok": False, "error": "unknown op 'dance'"}
    assert daemon.request(server.path, {"nop": 1})["ok"] is False
    assert daemon.ping(server.path)


def test_no_daemon_means_none_and_stale_socket_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    assert daemon.environment_from_daemon({daemon.SOCKET_VARIABLE: str(path)}) is None
    path.write_text("")  # a leftover from a daemon that died
    srv = daemon.DaemonServer(path, env=collect_environment({"SELECTOR_GPUS": "", "PATH": ""}))
    try:
        assert path.exists() and daemon.status_path(path).exists()
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


def test_current_environment_asks_the_daemon_first(server: daemon.DaemonServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from selector import environment

    monkeypatch.setenv(daemon.SOCKET_VARIABLE, str(server.path))
    environment.set_environment(None)
    try:
        assert environment.current_environment().gpu.devices[0].name == "NVIDIA H200"  # the daemon's facts
    finally:
        environment.set_environment(None)
