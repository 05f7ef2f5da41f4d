"""The node daemon under load, failure and attack: nothing lost, nothing hangs a client, nothing foreign trusted.

Daemons run as subprocesses (`selector daemon run`) where the test kills, restarts or floods them, in a thread
where only the wire matters. "Another user" is uid 65534 (nobody): an attacker subprocess runs as that user, so
those tests need root and skip otherwise.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from selector.probes import collect_environment

from selector.daemon import client, server, wire
from selector.daemon.server import DaemonServer

GPUS = "NVIDIA H200:9.0:141"
NOBODY = 65534
RECORD = {"fingerprint": "f" * 32, "gpu": "NVIDIA H200", "problem": "E8-H16-I8-k2/bfloat16/dense/silu/gated",
          "mode": "eager", "tokens": 4, "backend": "grouped_mm", "time_s": 1e-4}

as_root = pytest.mark.skipif(os.getuid() != 0, reason="acting as another user needs root")


def _env() -> dict[str, str]:
    return {**os.environ, "SELECTOR_GPUS": GPUS}


class Daemon:
    """`selector daemon run` in a subprocess, its stderr kept in a file."""

    def __init__(self, sock: Path, store: Path) -> None:
        self.sock, self.store = sock, store
        self.err = sock.parent.parent / f"daemon-{time.monotonic_ns()}.err"
        with open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "selector.cli", "daemon", "run", "--socket", str(sock), "--store", str(store)],
                stdout=err, stderr=err, env=_env(), start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while not client.ping(sock, timeout=1.0):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"daemon did not start: {self.stderr()}")
            time.sleep(0.05)

    def stderr(self) -> str:
        return self.err.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path / "run" / "d.sock", tmp_path / "tuning.sqlite3")
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture
def threaded(tmp_path: Path) -> Iterator[DaemonServer]:
    env = collect_environment({"SELECTOR_GPUS": GPUS, "PATH": ""})
    srv = DaemonServer(tmp_path / "run" / "d.sock", env=env, store_file=tmp_path / "tuning.sqlite3")
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=5)


def raw(path: Path, data: bytes, close_write: bool = True, timeout: float = 5.0) -> dict | None:
    """Send `data` as it is, return the decoded reply (None when the daemon closed without one)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(data)
        if close_write:
            s.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    if len(got) < 4:
        return None
    return wire.decode(got[4:4 + wire.HEADER.unpack(got[:4])[0]])


def frame(body: bytes) -> bytes:
    return wire.HEADER.pack(len(body)) + body


# --- load ----------------------------------------------------------------------------------------------------

WORKER = r"""
import json, os, sys, time
from pathlib import Path
from selector.daemon import client
path, go, n, pid, fingerprint = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
while not go.exists():
    time.sleep(0.005)
lost = wrong = 0
worst = 0.0
for i in range(n):
    op = ("ping", "environment", "tuning_get")[i % 3]
    payload = {"op": op, "fingerprint": "f" * 32} if op == "tuning_get" else {"op": op}
    t = time.monotonic()
    reply = client.request(path, payload, timeout=5.0)
    worst = max(worst, time.monotonic() - t)
    if reply is None:
        lost += 1
    elif op == "ping" and (reply.get("pid") != pid or reply.get("fingerprint") != fingerprint):
        wrong += 1
    elif op == "environment" and reply.get("fingerprint") != fingerprint:
        wrong += 1
    elif op == "tuning_get" and [r["time_s"] for r in reply.get("records", [])] != [1e-4]:
        wrong += 1
print(json.dumps({"lost": lost, "wrong": wrong, "worst_s": worst}))
"""


@pytest.mark.slow
def test_32_concurrent_clients_lose_nothing(daemon: Daemon, tmp_path: Path) -> None:
    clients, per_client = 32, 500
    assert client.request(daemon.sock, {"op": "tuning_put", "records": [RECORD]})["stored"] == 1
    info = client.request(daemon.sock, {"op": "ping"})
    go = tmp_path / "go"
    workers = [
        subprocess.Popen([sys.executable, "-c", WORKER, str(daemon.sock), str(go), str(per_client),
                          str(info["pid"]), info["fingerprint"]], stdout=subprocess.PIPE, text=True, env=_env())
        for _ in range(clients)
    ]
    time.sleep(1.0)  # let every worker import and wait at the gate, so they start together
    start = time.monotonic()
    go.touch()
    results = [json.loads(w.communicate(timeout=120)[0]) for w in workers]
    elapsed = time.monotonic() - start
    total = clients * per_client
    lost, wrong = sum(r["lost"] for r in results), sum(r["wrong"] for r in results)
    print(f"\n{total} requests from {clients} processes in {elapsed:.1f} s ({total / elapsed:.0f}/s); lost {lost}, "
          f"wrong {wrong}, slowest {max(r['worst_s'] for r in results) * 1000:.0f} ms")
    assert (lost, wrong) == (0, 0)
    assert client.ping(daemon.sock)


def test_sigkill_mid_request_clients_fall_back_fast(daemon: Daemon) -> None:
    environ = {wire.SOCKET_VARIABLE: str(daemon.sock)}
    assert client.environment_from_daemon(environ) is not None
    os.kill(daemon.proc.pid, signal.SIGSTOP)  # requests now connect and wait for a reply that never comes
    results: list[tuple[object, float]] = []

    def ask() -> None:
        reply = client.request(daemon.sock, {"op": "ping"}, timeout=30.0)
        results.append((reply, time.monotonic()))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    assert not results  # in flight
    killed = time.monotonic()
    os.kill(daemon.proc.pid, signal.SIGKILL)
    daemon.proc.wait(10)
    for t in threads:
        t.join(timeout=5)
    assert len(results) == 8 and all(reply is None for reply, _ in results)
    assert max(at for _, at in results) - killed < 2.0  # the dead peer is noticed, not waited out
    t0 = time.monotonic()
    assert client.environment_from_daemon(environ) is None  # the stale socket: in-process from now on
    assert client.shared_tuning_records(environ) == []
    assert client.share_tuning_records([RECORD], environ) is None
    assert time.monotonic() - t0 < 2.0
    again = Daemon(daemon.sock, daemon.store)  # the dead one's lock died with it; its socket is replaced
    try:
        assert client.environment_from_daemon(environ) is not None
    finally:
        again.stop()


# --- slow and broken peers ----------------------------------------------------------------------------------


class FakeDaemon:
    """A server that accepts, reads the request, then does `behaviour` with the connection."""

    def __init__(self, path: Path, behaviour, backlog: int = 16, accept: bool = True) -> None:
        path.parent.mkdir(mode=0o700, exist_ok=True)
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(backlog)
        self.behaviour = behaviour
        self.stopped = threading.Event()
        self.conns: list[socket.socket] = []
        if accept:
            threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        self.sock.settimeout(0.1)
        while not self.stopped.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(5)
            conn.recv(65536)
            self.behaviour(conn, self.stopped)
        except OSError:
            pass

    def close(self) -> None:
        self.stopped.set()
        self.sock.close()
        for c in self.conns:
            c.close()


def _drip(conn: socket.socket, stopped: threading.Event) -> None:
    for byte in frame(json.dumps({"ok": True, "v": wire.PROTOCOL_VERSION, "pad": "x" * 200}).encode()):
        if stopped.wait(0.3):
            return
        conn.send(bytes([byte]))


def _silent(conn: socket.socket, stopped: threading.Event) -> None:
    stopped.wait(30)


@pytest.mark.slow
@pytest.mark.parametrize("behaviour", [_drip, _silent], ids=["dripping", "silent"])
def test_slow_daemons_cost_a_client_at_most_its_deadline(tmp_path: Path, behaviour) -> None:
    fake = FakeDaemon(tmp_path / "run" / "d.sock", behaviour)
    environ = {wire.SOCKET_VARIABLE: str(fake.path), "SELECTOR_DAEMON_TIMEOUT": "0.5"}
    try:
        for call, fallback in ((lambda: client.request(fake.path, {"op": "ping"}, timeout=0.5), None),
                               (lambda: client.environment_from_daemon(environ), None),
                               (lambda: client.ping(fake.path, timeout=0.5), False)):
            t0 = time.monotonic()
            assert call() == fallback
            assert time.monotonic() - t0 < 1.0  # the deadline, plus slack for a busy machine
    finally:
        fake.close()


def test_a_full_backlog_is_retried_within_the_deadline(tmp_path: Path) -> None:
    fake = FakeDaemon(tmp_path / "run" / "d.sock", _silent, backlog=0, accept=False)
    fillers: list[socket.socket] = []
    full = False
    try:
        while not full and len(fillers) < 8:  # fill the backlog: further connects fail at once with EAGAIN
            filler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            filler.setblocking(False)
            try:
                filler.connect(str(fake.path))
                fillers.append(filler)
            except BlockingIOError:
                filler.close()
                full = True
        assert full
        t0 = time.monotonic()
        assert client.request(fake.path, {"op": "ping"}, timeout=0.4) is None
        waited = time.monotonic() - t0
        assert 0.3 < waited < 1.0  # retried until the deadline, not given up at the first EAGAIN
        # the daemon catches up within the deadline: a retry gets through

        def catch_up() -> None:
            time.sleep(0.15)
            fake.sock.settimeout(2)
            fake.conns.extend(fake.sock.accept()[0] for _ in fillers)
            conn, _ = fake.sock.accept()
            conn.recv(65536)
            conn.sendall(wire.encode({"ok": True}))
            conn.close()

        threading.Thread(target=catch_up, daemon=True).start()
        t0 = time.monotonic()
        assert client.request(fake.path, {"op": "ping"}, timeout=1.0) == {"ok": True, "v": wire.PROTOCOL_VERSION}
        assert time.monotonic() - t0 > 0.1  # it got in once the backlog had room, not at once
    finally:
        for filler in fillers:
            filler.close()
        fake.close()


GARBAGE = {
    "not a dict": frame(b'[1, 2]'),
    "wrong version": frame(json.dumps({"ok": True, "v": 99, "environment": {}}).encode()),
    "no version": frame(b'{"ok": true}'),
    "not json": frame(b"\x80\x81 not json"),
    "oversized": wire.HEADER.pack(wire.MAX_REPLY_BYTES + 1),
    "truncated": wire.HEADER.pack(100) + b'{"ok": tr',
    "nan": frame(b'{"ok": true, "v": 2, "x": NaN}'),
    "newline protocol": b'{"ok": true}\n',
}


@pytest.mark.parametrize("reply", list(GARBAGE.values()), ids=list(GARBAGE))
def test_garbage_replies_read_as_no_daemon(tmp_path: Path, reply: bytes) -> None:
    def send(conn: socket.socket, stopped: threading.Event) -> None:
        conn.sendall(reply)
        conn.close()

    fake = FakeDaemon(tmp_path / "run" / "d.sock", send)
    environ = {wire.SOCKET_VARIABLE: str(fake.path)}
    try:
        assert client.request(fake.path, {"op": "ping"}) is None
        assert client.environment_from_daemon(environ) is None
        assert client.shared_tuning_records(environ) == []
        assert client.share_tuning_records([RECORD], environ) is None
        assert client.ping(fake.path) is False
    finally:
        fake.close()


def test_facts_that_do_not_match_their_fingerprint_are_refused(tmp_path: Path) -> None:
    env = collect_environment({"SELECTOR_GPUS": GPUS, "PATH": ""})
    other = collect_environment({"SELECTOR_GPUS": "NVIDIA A100:8.0:80", "PATH": ""})

    def lie(conn: socket.socket, stopped: threading.Event) -> None:
        conn.sendall(wire.encode({"ok": True, "environment": env.to_dict(), "fingerprint": other.fingerprint(),
                                  "context": wire.process_context()}))

    def records_not_a_list(conn: socket.socket, stopped: threading.Event) -> None:
        conn.sendall(wire.encode({"ok": True, "records": {"a": 1}, "stored": "3"}))

    for behaviour in (lie, records_not_a_list):
        fake = FakeDaemon(tmp_path / "run" / "d.sock", behaviour)
        environ = {wire.SOCKET_VARIABLE: str(fake.path)}
        try:
            assert client.environment_from_daemon(environ) is None
            assert client.shared_tuning_records(environ) == []
            assert client.share_tuning_records([RECORD], environ) is None
        finally:
            fake.close()
            fake.path.unlink()


# --- what the daemon is sent --------------------------------------------------------------------------------

BAD_FRAMES = {
    "malformed json": (frame(b'{"op": "ping",'), "not JSON"),
    "not utf-8": (frame(b'\xff\xfe{}'), "not UTF-8"),
    "non-object": (frame(b'["ping"]'), "JSON object, got list"),
    "wrong version": (frame(b'{"op": "ping", "v": 1}'), "protocol version 1"),
    "no version": (frame(b'{"op": "ping"}'), "protocol version None"),
    "nan": (frame(b'{"op": "ping", "v": 2, "x": NaN}'), "NaN is not JSON"),
    "oversized": (wire.HEADER.pack(wire.MAX_REQUEST_BYTES + 1), "over the limit"),
    "two requests": (wire.encode({"op": "ping"}) * 2, "one request per connection"),
    "newline protocol": (b'{"op": "ping"}\n', "over the limit"),
    "no op": (wire.encode({"nop": 1}), "names its op"),
    "records not a list": (wire.encode({"op": "tuning_put", "records": {"a": 1}}), "records is a list"),
    "too many records": (wire.encode({"op": "tuning_put", "records": [RECORD] * (wire.MAX_RECORDS_PER_PUT + 1)},
                                     limit=wire.MAX_REQUEST_BYTES), "at most 10000"),
    "fingerprint not a string": (wire.encode({"op": "tuning_get", "fingerprint": 3}), "fingerprint is a string"),
}


@pytest.mark.parametrize("data,expected", list(BAD_FRAMES.values()), ids=list(BAD_FRAMES))
def test_bad_frames_get_an_error_and_the_daemon_lives(threaded: DaemonServer, data: bytes, expected: str) -> None:
    reply = raw(threaded.path, data)
    assert reply is not None and reply["ok"] is False and expected in reply["error"], reply
    assert reply["v"] == wire.PROTOCOL_VERSION
    assert client.ping(threaded.path)
    assert threaded.store.records() == []


@pytest.mark.slow
def test_truncated_and_dripped_requests_are_dropped_and_the_daemon_lives(threaded: DaemonServer) -> None:
    assert raw(threaded.path, wire.HEADER.pack(100) + b'{"op"') is None  # the peer left mid-frame
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:  # one byte every 0.3 s: past the deadline
        s.connect(str(threaded.path))
        t0 = time.monotonic()
        closed_after = None
        for byte in wire.encode({"op": "ping", "pad": "x" * 100}):
            try:
                s.send(bytes([byte]))
            except OSError:
                closed_after = time.monotonic() - t0
                break
            assert client.ping(threaded.path)  # others are answered meanwhile
            time.sleep(0.3)
        if closed_after is None:
            s.settimeout(1)
            got = s.recv(65536)
            assert b"not whole within" in got
        else:
            assert closed_after < server.REQUEST_DEADLINE_S + 1
    assert threaded.stats["expired"] == 1 and client.ping(threaded.path)


def test_bad_records_are_refused_and_never_stored(threaded: DaemonServer) -> None:
    bad = [{k: v for k, v in RECORD.items() if k != "time_s"}, {**RECORD, "time_s": "fast"},
           {**RECORD, "tokens": True}, {**RECORD, "mode": "warp"}, "not a record", {**RECORD, "time_s": -1}]
    reply = client.request(threaded.path, {"op": "tuning_put", "records": [*bad, RECORD]})
    assert reply is not None and reply["ok"] and reply["stored"] == 1 and reply["refused"] == len(bad)
    assert "missing field 'time_s'" in reply["reasons"][0] and "field 'time_s' is str" in reply["reasons"][1]
    got = client.request(threaded.path, {"op": "tuning_get"})
    assert got is not None and got["records"] == [RECORD]
    assert client.ping(threaded.path)


class FakeStuckStore:
    """A store whose writes wait until released, as a store does while a tuner holds its lock."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.kept: list[dict] = []
        self.waiting = 0  # puts inside put() now

    def put(self, records: list[dict]):
        self.waiting += 1
        self.entered.set()
        self.release.wait(30)
        self.kept += records
        return type("PutResult", (), {"stored": len(records), "refused": []})()

    def records(self, fingerprint: str | None = None) -> list[dict]:
        return list(self.kept)


def test_a_store_waiting_on_its_lock_does_not_stop_pings(tmp_path: Path) -> None:
    store = FakeStuckStore()
    env = collect_environment({"SELECTOR_GPUS": GPUS, "PATH": ""})
    srv = DaemonServer(tmp_path / "run" / "d.sock", env=env, store=store)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    replies: list[dict | None] = []
    putter = threading.Thread(target=lambda: replies.append(
        client.request(srv.path, {"op": "tuning_put", "records": [RECORD]}, timeout=10)))
    try:
        putter.start()
        assert store.entered.wait(5)
        t0 = time.monotonic()
        assert client.ping(srv.path, timeout=0.5)
        assert client.environment_from_daemon({wire.SOCKET_VARIABLE: str(srv.path)}) is not None
        assert time.monotonic() - t0 < 0.5
        assert not replies  # the put still waits
        store.release.set()
        putter.join(5)
        assert replies[0] is not None and replies[0]["stored"] == 1
    finally:
        store.release.set()
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=5)


def test_jobs_answers_within_the_quick_deadline_while_every_store_worker_waits(tmp_path: Path) -> None:
    """`jobs` reads lock files, not the store: puts queued behind a held store lock (as under many writers) must not
    hold it past the client's quick deadline (it lost 11-29 of 4,000 under 32 clients of mixed requests)."""
    store = FakeStuckStore()
    env = collect_environment({"SELECTOR_GPUS": GPUS, "PATH": ""})
    srv = DaemonServer(tmp_path / "run" / "d.sock", env=env, store=store)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    putters = [threading.Thread(target=client.request, args=(srv.path, {"op": "tuning_put", "records": [RECORD]}),
                                kwargs={"timeout": 10}) for _ in range(server.STORE_WORKERS + 2)]
    try:
        for t in putters:
            t.start()
        deadline = time.monotonic() + 5
        while store.waiting < server.STORE_WORKERS and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.waiting == server.STORE_WORKERS  # every store worker waits, more puts queued behind them
        t0 = time.monotonic()
        assert client.jobs_in_progress({wire.SOCKET_VARIABLE: str(srv.path)}) == []
        assert time.monotonic() - t0 < client.QUICK_TIMEOUT_S
    finally:
        store.release.set()
        for t in putters:
            t.join(5)
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=5)


def _raise_nofile(at_least: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= at_least:
        return
    if hard != resource.RLIM_INFINITY and hard < at_least:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < {at_least}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (at_least, hard))


def test_1000_idle_connections_do_not_stop_a_ping(daemon: Daemon) -> None:
    _raise_nofile(1200)
    idle = []
    try:
        for _ in range(1000):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(str(daemon.sock))
            idle.append(s)
        t0 = time.monotonic()
        assert client.ping(daemon.sock, timeout=0.5)
        print(f"\nping with 1000 idle connections open: {(time.monotonic() - t0) * 1000:.0f} ms")
        fds = len(os.listdir(f"/proc/{daemon.proc.pid}/fd"))
        assert fds < server.MAX_CONNECTIONS + 32  # bounded, not one per idle connection
        for s in idle[:10]:  # the oldest idle connections were told `busy`
            got = s.recv(65536)
            assert b'"busy"' in got or got == b""
    finally:
        for s in idle:
            s.close()
    assert client.ping(daemon.sock)


# --- the store --------------------------------------------------------------------------------------------


def test_restart_keeps_records(tmp_path: Path) -> None:
    sock, store = tmp_path / "run" / "d.sock", tmp_path / "tuning.sqlite3"
    first = Daemon(sock, store)
    try:
        reply = client.request(sock, {"op": "tuning_put", "records": [RECORD]})
        assert reply is not None and reply["stored"] == 1
    finally:
        first.stop()
    assert first.proc.returncode == 0 and not sock.exists()
    second = Daemon(sock, store)
    try:
        environ = {wire.SOCKET_VARIABLE: str(sock)}
        assert client.shared_tuning_records(environ, fingerprint=RECORD["fingerprint"]) == [RECORD]
        assert client.shared_tuning_records(environ, fingerprint="0" * 32) == []
    finally:
        second.stop()


def test_a_corrupt_store_is_rebuilt_with_a_warning(tmp_path: Path) -> None:
    store = tmp_path / "tuning.sqlite3"
    store.write_bytes(b"this is not a SQLite file" * 100)
    d = Daemon(tmp_path / "run" / "d.sock", store)
    try:
        assert client.request(d.sock, {"op": "tuning_put", "records": [RECORD]})["stored"] == 1
        assert client.shared_tuning_records({wire.SOCKET_VARIABLE: str(d.sock)}) == [RECORD]
    finally:
        d.stop()
    assert "damaged" in d.stderr()
    assert any(p.name.startswith("tuning.sqlite3.corrupt") for p in tmp_path.iterdir())


# --- attacks ----------------------------------------------------------------------------------------------


def _run_cli(*args: str, environ: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "selector.cli", "daemon", *args], capture_output=True, text=True,
                          timeout=60, env={**_env(), **environ})


def _nobody_python() -> str:
    """A Python that uid 65534 may run (this venv's may sit in a folder closed to it)."""
    for candidate in (os.path.realpath(sys.executable), shutil.which("python3"), "/usr/bin/python3"):
        try:
            ran = subprocess.run([candidate or "", "-I", "-c", "pass"], user=NOBODY, group=NOBODY, extra_groups=[],
                                 cwd="/", env={}, capture_output=True, timeout=30)
        except OSError:
            continue
        if ran.returncode == 0:
            return candidate or ""
    pytest.skip("no Python that uid 65534 can run")


@pytest.fixture
def public_tmp() -> Iterator[Path]:
    """A folder outside pytest's (closed) temp root, so the other user can reach what the test lets it reach."""
    folder = Path(tempfile.mkdtemp())
    os.chmod(folder, 0o711)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _precreated(tmp_path: Path, how: str) -> Path:
    runtime = tmp_path / "rt"
    runtime.mkdir()
    folder = runtime / "selector"
    if how == "mode":
        folder.mkdir(mode=0o755)
        os.chmod(folder, 0o755)
    elif how == "owner":
        folder.mkdir(mode=0o700)
        os.chown(folder, NOBODY, NOBODY)
    else:
        (tmp_path / "elsewhere").mkdir(mode=0o700)
        folder.symlink_to(tmp_path / "elsewhere")
    return runtime


@pytest.mark.parametrize("how,reason", [("mode", "mode 0755"), pytest.param("owner", "belongs to uid 65534",
                                                                              marks=as_root), ("symlink", "symlink")])
def test_a_precreated_folder_is_refused(tmp_path: Path, how: str, reason: str) -> None:
    runtime = _precreated(tmp_path, how)
    environ = {"XDG_RUNTIME_DIR": str(runtime)}
    result = _run_cli("run", environ=environ)
    assert result.returncode == 1 and reason in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (runtime / "selector" / "daemon.sock").exists()
    assert _run_cli("start", environ=environ).returncode == 1


@pytest.mark.parametrize("how", ["mode", pytest.param("owner", marks=as_root), "symlink"])
def test_the_client_treats_a_foreign_folder_as_no_daemon(tmp_path: Path, how: str) -> None:
    env = collect_environment({"SELECTOR_GPUS": GPUS, "PATH": ""})
    good = tmp_path / "good"
    srv = DaemonServer(good / "d.sock", env=env, store_file=tmp_path / "tuning.sqlite3")
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        assert client.environment_from_daemon({wire.SOCKET_VARIABLE: str(good / "d.sock")}) is not None
        if how == "mode":
            os.chmod(good, 0o755)
            path = good / "d.sock"
        elif how == "owner":
            os.chown(good, NOBODY, NOBODY)
            path = good / "d.sock"
        else:
            (tmp_path / "link").symlink_to(good)
            path = tmp_path / "link" / "d.sock"
        environ = {wire.SOCKET_VARIABLE: str(path)}
        assert client.environment_from_daemon(environ) is None
        assert client.shared_tuning_records(environ) == []
        assert client.share_tuning_records([RECORD], environ) is None
    finally:
        os.chown(good, os.getuid(), os.getgid())
        os.chmod(good, 0o700)
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=5)


FAKE_SERVER = r"""
import socket, sys
reply = bytes.fromhex(sys.argv[2])
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(sys.argv[1])
s.listen(16)
print("ready", flush=True)
while True:
    conn, _ = s.accept()
    try:
        conn.recv(65536)
        conn.sendall(reply)
    except OSError:
        pass  # the client hung up first
    conn.close()
"""


def _fake_facts_reply() -> str:
    """What a convincing fake daemon answers: facts of a GPU this node lacks, with their right fingerprint."""
    fake = collect_environment({"SELECTOR_GPUS": "Fake GPU:9.0:1", "PATH": ""})
    return wire.encode({"ok": True, "environment": fake.to_dict(), "fingerprint": fake.fingerprint(),
                        "context": wire.process_context(),
                        "records": [RECORD], "stored": 1, "pid": 1}).hex()


@as_root
def test_a_socket_replaced_by_another_user_is_not_trusted(tmp_path: Path, public_tmp: Path) -> None:
    python = _nobody_python()
    theirs = public_tmp / "attacker"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, NOBODY, NOBODY)
    ours = tmp_path / "run"
    ours.mkdir(mode=0o700)
    procs = []
    try:
        for user, folder in ((NOBODY, theirs), (None, ours)):  # the attacker's, and the same server run as us
            kwargs = {"user": user, "group": user, "extra_groups": []} if user else {}
            proc = subprocess.Popen([python, "-I", "-c", FAKE_SERVER, str(folder / "fake.sock"), _fake_facts_reply()],
                                    stdout=subprocess.PIPE, text=True, cwd="/", env={}, **kwargs)
            procs.append(proc)
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        os.rename(theirs / "fake.sock", ours / "d.sock")  # their socket now sits where our daemon's was
        environ = {wire.SOCKET_VARIABLE: str(ours / "d.sock")}
        assert client.environment_from_daemon(environ) is None
        assert client.shared_tuning_records(environ) == []
        assert client.share_tuning_records([RECORD], environ) is None
        assert not client.ping(ours / "d.sock")
        # the control: the same server run by this user is believed, so the refusal above is the uid check
        os.rename(ours / "fake.sock", ours / "d.sock")
        env = client.environment_from_daemon(environ)
        assert env is not None and env.gpu.devices[0].name == "Fake GPU"
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(5)


@as_root
def test_another_users_client_is_refused_by_the_daemon(public_tmp: Path) -> None:
    python = _nobody_python()
    env = collect_environment({"SELECTOR_GPUS": GPUS, "PATH": ""})
    srv = DaemonServer(public_tmp / "run" / "d.sock", env=env, store_file=public_tmp / "tuning.sqlite3")
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    os.chmod(srv.path.parent, 0o711)  # the daemon's folder and socket opened by mistake: the uid check remains
    os.chmod(srv.path, 0o666)
    attacker = r"""
import json, socket, struct, sys
body = json.dumps({"op": sys.argv[2], "v": 2, "records": json.loads(sys.argv[3])}).encode()
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(5)
s.connect(sys.argv[1])
try:
    s.sendall(struct.pack(">I", len(body)) + body)
except OSError:
    pass  # refused before the request was read; the reason still waits to be read
got = b""
try:
    while chunk := s.recv(65536):
        got += chunk
except OSError as exc:
    got += b"    " + repr(exc).encode()
print(got[4:].decode(errors="replace"))
"""
    try:
        for op in ("tuning_put", "environment"):
            result = subprocess.run([python, "-I", "-c", attacker, str(srv.path), op, json.dumps([RECORD])],
                                    user=NOBODY, group=NOBODY, extra_groups=[], cwd="/", env={},
                                    capture_output=True, text=True, timeout=30)
            assert result.returncode == 0, result.stderr
            assert "refused: this daemon serves uid 0 only" in result.stdout
            assert "NVIDIA H200" not in result.stdout
        assert srv.stats["refused_peers"] == 2
        assert srv.store.records() == []  # nothing they sent was stored
        assert client.ping(srv.path)
    finally:
        srv.shutdown()
        srv.server_close()
        thread.join(timeout=5)


def test_a_planted_status_symlink_is_not_followed(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (folder / "d.json").symlink_to(victim)  # the status file's name, pointing at someone's file
    (folder / f".d.json.{os.getpid()}.tmp").symlink_to(victim)  # and the temp name it is written through
    env = collect_environment({"SELECTOR_GPUS": "", "PATH": ""})
    srv = DaemonServer(folder / "d.sock", env=env, store_file=tmp_path / "tuning.sqlite3")
    try:
        assert victim.read_text() == "precious"
        status = wire.status_path(srv.path)
        st = os.lstat(status)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert json.loads(status.read_text())["pid"] == os.getpid()
    finally:
        srv.server_close()
    assert victim.read_text() == "precious"


def test_status_files_are_read_only_when_private_and_ours(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    target = tmp_path / "planted.json"
    target.write_text('{"pid": 1}')
    os.chmod(target, 0o600)
    assert wire.read_private_file(target) == '{"pid": 1}'
    (folder / "link.json").symlink_to(target)
    assert wire.read_private_file(folder / "link.json") is None
    os.chmod(target, 0o644)
    assert wire.read_private_file(target) is None
    if os.getuid() == 0:
        os.chmod(target, 0o600)
        os.chown(target, NOBODY, NOBODY)
        assert wire.read_private_file(target) is None
