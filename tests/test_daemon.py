"""The node daemon over a Unix socket in a temp dir: shared probes and tuning results, bounded in time."""

from __future__ import annotations

import fcntl
import json
import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from selector.probes import collect_environment

from selector.daemon import client, wire
from selector.daemon.server import DaemonError, DaemonServer
from selector.tuning_store import STORE_LOCKS


@pytest.fixture
def server(tmp_path: Path):
    env = collect_environment({"SELECTOR_GPUS": "NVIDIA H200:9.0:141", "PATH": ""})
    srv = DaemonServer(tmp_path / "run" / "d.sock", env=env, store_file=tmp_path / "daemon-store.sqlite3")
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=5)


def test_clients_share_probe_facts(server: DaemonServer) -> None:
    env = client.environment_from_daemon({wire.SOCKET_VARIABLE: str(server.path)})
    assert env is not None and env.gpu.devices[0].name == "NVIDIA H200"
    assert env.fingerprint() == server.env.fingerprint()
    status = json.loads(wire.status_path(server.path).read_text())
    assert status["pid"] == os.getpid() and status["fingerprint"] == server.env.fingerprint()
    assert status["protocol"] == wire.PROTOCOL_VERSION and status["store"] == str(server.store.path)
    assert stat.S_IMODE(os.lstat(server.path).st_mode) == 0o600
    assert stat.S_IMODE(os.lstat(server.path.parent).st_mode) == 0o700


def test_facts_probed_for_another_python_or_other_gpus_are_not_used(server: DaemonServer) -> None:
    environ = {wire.SOCKET_VARIABLE: str(server.path)}
    assert client.environment_from_daemon(environ) is not None
    assert client.environment_from_daemon({**environ, "CUDA_VISIBLE_DEVICES": "3"}) is None  # the daemon saw all
    server.context = {**server.context, "python": "/elsewhere/venv"}  # its packages are not this process's
    assert client.environment_from_daemon(environ) is None


def test_tuning_results_put_by_one_client_are_read_by_another(server: DaemonServer) -> None:
    record = RECORD
    put = client.request(server.path, {"op": "tuning_put", "records": [record]})
    assert put == {"ok": True, "stored": 1, "refused": 0, "reasons": [], "v": wire.PROTOCOL_VERSION}
    faster = {**record, "time_s": 5e-5}
    client.request(server.path, {"op": "tuning_put", "records": [faster]})
    got = client.request(server.path, {"op": "tuning_get"})["records"]
    assert got == [faster]
    assert server.store.records() == [faster]  # kept in the store, not only in memory


def test_tuning_get_filters_by_fingerprint(server: DaemonServer) -> None:
    other = {**RECORD, "fingerprint": "0" * 32}
    environ = {wire.SOCKET_VARIABLE: str(server.path)}
    assert client.share_tuning_records([RECORD, other], environ) == 2
    assert client.shared_tuning_records(environ, fingerprint="0" * 32) == [other]
    assert client.shared_tuning_records(environ, fingerprint="1" * 32) == []
    assert len(client.shared_tuning_records(environ)) == 2  # no fingerprint: all of them


def test_large_shares_are_split_under_the_limits(server: DaemonServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(wire, "MAX_RECORDS_PER_PUT", 7)
    records = [{**RECORD, "tokens": n} for n in range(1, 31)]
    assert client.share_tuning_records(records, {wire.SOCKET_VARIABLE: str(server.path)}) == 30
    assert server.stats["served"] == 5  # ceil(30 / 7) puts
    assert sorted(r["tokens"] for r in server.store.records()) == list(range(1, 31))


def test_jobs_in_progress_are_the_held_measurement_locks(server: DaemonServer) -> None:
    environ = {wire.SOCKET_VARIABLE: str(server.path)}
    assert client.jobs_in_progress(environ) == []
    with server.store.measurement_lock("gpu-1", timeout_s=1) as got:
        assert got
        with server.store.measurement_lock("gpu-0", timeout_s=1):
            assert client.jobs_in_progress(environ) == ["gpu-0", "gpu-1"]
        assert client.jobs_in_progress(environ) == ["gpu-1"]
        with server.store.measurement_lock("gpu-1", timeout_s=0) as again:
            assert not again  # the probe left the lock as it found it
    assert client.jobs_in_progress(environ) == []
    assert client.jobs_in_progress({wire.SOCKET_VARIABLE: str(server.path.parent / "none.sock")}) is None


def test_a_put_in_progress_is_not_a_job(server: DaemonServer) -> None:
    environ = {wire.SOCKET_VARIABLE: str(server.path)}
    assert server.store.put([RECORD]).stored == 1  # makes locks/ and the store's own lock files
    for name in sorted(STORE_LOCKS):
        fd = os.open(server.store.path.parent / "locks" / f"{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # as a writer (or a repair) holds it while its put runs
            with server.store.measurement_lock("gpu-0", timeout_s=1):
                assert client.jobs_in_progress(environ) == ["gpu-0"]
        finally:
            os.close(fd)


def test_bad_requests_get_errors_not_crashes(server: DaemonServer) -> None:
    assert client.request(server.path, {"op": "dance"}) == {"ok": False, "error": "unknown op 'dance'",
                                                            "v": wire.PROTOCOL_VERSION}
    assert client.request(server.path, {"nop": 1})["ok"] is False
    assert client.request(server.path, {"op": "tuning_put", "records": [{"time_s": "x"}]})["stored"] == 0
    assert client.ping(server.path)
    assert server.stats["bad_requests"] == 2


def test_no_daemon_means_none_and_stale_socket_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "stale.sock"
    assert client.environment_from_daemon({wire.SOCKET_VARIABLE: str(path)}) is None
    path.write_text("")  # a leftover from a daemon that died
    env = collect_environment({"SELECTOR_GPUS": "", "PATH": ""})
    srv = DaemonServer(path, env=env, store_file=tmp_path / "tuning.sqlite3")
    try:
        assert stat.S_ISSOCK(os.lstat(path).st_mode) and wire.status_path(path).exists()
        with pytest.raises(DaemonError, match="already serves here"):  # one daemon per socket
            DaemonServer(path, env=env, store_file=tmp_path / "tuning.sqlite3")
        assert stat.S_ISSOCK(os.lstat(path).st_mode)  # the refused second one left the first one's socket
    finally:
        srv.server_close()
    assert not path.exists() and not wire.status_path(path).exists()


@pytest.mark.slow
def test_cli_start_status_stop(tmp_path: Path) -> None:
    sock = tmp_path / "run" / "cli.sock"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "SELECTOR_GPUS": ""}
        return subprocess.run([sys.executable, "-m", "selector.cli", "daemon", *args, "--socket", str(sock),
                               "--store", str(tmp_path / "tuning.sqlite3")],
                              capture_output=True, text=True, timeout=60, env=env)

    assert cli("status").returncode == 1
    started = cli("start")
    try:
        assert started.returncode == 0 and "started" in started.stdout, started.stderr
        assert "already running" in cli("start").stdout
        status = cli("status")
        assert status.returncode == 0
        shown = json.loads(status.stdout)
        assert shown["protocol"] == wire.PROTOCOL_VERSION and shown["store"] == str(tmp_path / "tuning.sqlite3")
        assert shown["pid"] != os.getpid() and shown["connections"] == 1 and shown["jobs"] == []
    finally:
        assert cli("stop").returncode == 0
    assert not sock.exists()
    assert cli("stop").returncode == 1 and cli("status").returncode == 1


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
    assert tuning_store.known_records() == [record]  # this process's own store is empty: the daemon's record


RECORD = {"fingerprint": "f" * 32, "gpu": "NVIDIA H200", "problem": "E8-H16-I8-k2/bfloat16/dense/silu/gated",
          "mode": "eager", "tokens": 4, "backend": "grouped_mm", "time_s": 1e-4}


def test_wire_frames_are_length_prefixed_versioned_json() -> None:
    frame = wire.encode({"op": wire.PING})
    body = b'{"op":"ping","v":%d}' % wire.PROTOCOL_VERSION
    assert frame == len(body).to_bytes(4, "big") + body
    assert wire.decode(frame[4:]) == {"op": "ping", "v": wire.PROTOCOL_VERSION}
    with pytest.raises(wire.WireError, match="not JSON"):
        wire.decode(b"")  # the peer closed before replying
    with pytest.raises(wire.WireError, match="JSON object, got list"):
        wire.decode(b"[1]")
    with pytest.raises(wire.WireError, match="protocol version 1, this side speaks"):
        wire.decode(b'{"op": "ping", "v": 1}')
    with pytest.raises(wire.WireError, match="Infinity is not JSON"):
        wire.decode(b'{"v": 2, "x": Infinity}')
    with pytest.raises(wire.WireError, match="over the limit"):
        wire.frame_length(wire.HEADER.pack(wire.MAX_REQUEST_BYTES + 1), wire.MAX_REQUEST_BYTES)
    with pytest.raises(wire.WireError, match="over the limit"):
        wire.encode({"pad": "x" * 100}, limit=50)
    with pytest.raises(ValueError):
        wire.encode({"x": float("nan")})  # never sent: the other side could not read it


def test_the_private_folder_check(tmp_path: Path) -> None:
    assert wire.ensure_private_dir(tmp_path / "new") is None
    assert stat.S_IMODE(os.lstat(tmp_path / "new").st_mode) == 0o700
    (tmp_path / "open").mkdir()
    os.chmod(tmp_path / "open", 0o750)
    assert "mode 0750" in (wire.ensure_private_dir(tmp_path / "open") or "")
    assert stat.S_IMODE(os.lstat(tmp_path / "open").st_mode) == 0o750  # checked, never loosened or fixed
    (tmp_path / "link").symlink_to(tmp_path / "new")
    assert "is a symlink" in (wire.check_private_dir(tmp_path / "link") or "")
    (tmp_path / "file").write_text("")
    assert "not a folder" in (wire.check_private_dir(tmp_path / "file") or "")
    assert "does not exist" in (wire.check_private_dir(tmp_path / "missing") or "")
    assert "cannot create" in (wire.ensure_private_dir(tmp_path / "missing" / "deeper") or "")


def test_default_places(tmp_path: Path) -> None:
    assert wire.socket_path({"XDG_RUNTIME_DIR": str(tmp_path)}) == tmp_path / "selector" / "daemon.sock"
    assert wire.socket_path({}).parent.name == f"selector-{os.getuid()}"
    assert wire.socket_path({wire.SOCKET_VARIABLE: str(tmp_path / "x.sock")}) == tmp_path / "x.sock"
    assert client.quick_timeout({"SELECTOR_DAEMON_TIMEOUT": "1.5"}) == 1.5
    assert client.quick_timeout({"SELECTOR_DAEMON_TIMEOUT": "soon"}) == 0.5  # a bad value: the default


def _imports_after(module: str) -> set[str]:
    code = f"import sys, {module}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    return set(out.stdout.split())


def test_the_client_loads_nothing_of_the_server() -> None:
    loaded = _imports_after("selector.daemon.client")
    assert "selector.daemon.server" not in loaded and "socketserver" not in loaded
    assert "selector.tuning" not in loaded and "selector.tuning_store" not in loaded and "sqlite3" not in loaded


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
