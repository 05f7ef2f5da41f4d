"""The daemon process: a Unix-socket server holding this node's probe facts and serving the tuning store.

One thread runs a selector loop over every connection, so idle or slow peers cost a slot and a buffer, never a
thread; the store's ops go to STORE_WORKERS threads, as the store may wait on another writer's lock, and `jobs`
(a look at the measurement locks, never the store) to a thread of its own, so a queue of puts never holds it past
a client's quick deadline. At most MAX_CONNECTIONS are open at once (past that the oldest one still sending its
request is told `busy` and closed), each request must arrive whole within REQUEST_DEADLINE_S of the connect (a
deadline, not a per-read timeout, so a peer dripping bytes cannot hold a slot), and the listen backlog is the
system's largest.
Only processes of this user are answered (SO_PEERCRED). Records are validated on the way in and kept in the
`TuningStore`, so they survive a restart.

Files, all in the private folder (see `selector.daemon.wire`): the socket (mode 0600), a lock held while the
daemon runs (one daemon per socket), a status file (pid, socket, fingerprint, versions) written without
following symlinks, and, for a daemon started in the background, its log.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import queue
import selectors
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import selector
from selector.daemon import wire
from selector.daemon.client import ping, request
from selector.probes import Environment, collect_environment
from selector.tuning import check_record

log = logging.getLogger("selector.daemon")
_STORE_OPS = (wire.TUNING_GET, wire.TUNING_PUT)
_LOCK_OPS = (wire.JOBS,)  # reads lock files (a file system may stall): off the loop, but never behind the store

MAX_CONNECTIONS = 256  # open at once; past this the oldest unfinished request is dropped
MAX_BUFFERED_BYTES = 64 * 2**20  # request bytes held over all connections at once
REQUEST_DEADLINE_S = 2.0  # a whole request must arrive within this of the connect
REPLY_DEADLINE_S = 10.0  # a peer gets this long to read its reply
ACCEPT_BATCH = 64  # connections accepted per wake-up, so the ones already open keep moving
STORE_WORKERS = 2  # threads that wait on the store (its lock may be held by a tuner), so pings never do
MAX_REASONS = 20  # refusal reasons sent back per put (the count is always whole)
MAX_FINGERPRINTS = 4096  # in one tuning_get: one per backend, and the legacy one
START_WAIT_S = 10.0  # the daemon probes once before it answers
STOP_WAIT_S = 5.0


class DaemonError(RuntimeError):
    """The daemon cannot serve here (folder, lock, socket); the message is one line saying why."""


class Store(Protocol):
    """What the daemon needs of the tuning store."""

    def put(self, records: list[dict[str, Any]]) -> Any: ...  # a PutResult: .stored, .refused

    def records(self, fingerprint: str | Sequence[str] | None = None) -> list[dict[str, Any]]: ...


def _is_fingerprint_filter(value: object) -> bool:
    if value is None or isinstance(value, str):
        return True
    return isinstance(value, list) and len(value) <= MAX_FINGERPRINTS and all(isinstance(f, str) for f in value)


def open_store(path: Path | None = None) -> Store:
    """The tuning store at `path`, else at its configured place."""
    from selector.tuning_store import TuningStore, store_path

    return TuningStore(path or store_path())


class _Conn:
    """One connection: the request bytes so far, then the reply going out."""

    __slots__ = ("accepted", "buf", "fd", "need", "out", "pending", "reply_deadline", "sent", "sock", "stop")

    def __init__(self, sock: socket.socket, now: float) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.buf = bytearray()
        self.need: int | None = None  # body length, once the header arrived
        self.accepted = now
        self.pending = False  # whole, and being answered by a store worker
        self.out: bytes | None = None
        self.sent = 0
        self.reply_deadline = 0.0
        self.stop = False  # the request was `stop`: exit once the reply is out


def _error(message: str) -> dict[str, Any]:
    return {"ok": False, "error": message}


def _send_now(sock: socket.socket, message: Mapping[str, Any]) -> None:
    """Best effort, never blocking: a short reply to a peer about to be dropped."""
    try:
        sock.send(wire.encode(message))
    except OSError:
        pass


def _take_lock(path: Path) -> int:
    """Hold the lock at `path` for this process's life (DaemonError when another daemon holds it)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise DaemonError(f"cannot open the lock {path}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise DaemonError(f"a selector daemon already serves here (it holds {path})") from None
    return fd


class DaemonServer:
    """The server bound at `path`: checks its folder, takes the lock, replaces a stale socket, writes the status
    file. `serve_forever` runs it; `shutdown` (another thread) or a `stop` request ends it; `server_close`
    removes its files."""

    def __init__(self, path: Path, env: Environment | None = None, store: Store | None = None,
                 store_file: Path | None = None) -> None:
        self.path = path
        reason = wire.ensure_private_dir(path.parent)
        if reason is not None:
            raise DaemonError(f"refusing to serve at {path}: {reason}")
        self._uid = os.getuid()
        self._lock_fd: int | None = _take_lock(wire.lock_path(path))
        self._listener: socket.socket | None = None
        try:
            self.env = env or collect_environment()
            self.fingerprint = self.env.fingerprint()
            self._env_dict = self.env.to_dict()
            self.context = wire.process_context()
            self.store = store if store is not None else open_store(store_file)
            self.store.records(self.fingerprint)  # opens it now: a damaged store is rebuilt (and warned) at start
            self._listener = self._bind()
            self._inode = os.lstat(path).st_ino
            self.started_at = time.time()
            wire.write_private_file(wire.status_path(path), json.dumps(self.status()))
        except BaseException:
            self._release()
            raise
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._conns: OrderedDict[int, _Conn] = OrderedDict()  # by accept time, oldest first
        self._buffered = 0
        self._stopping = threading.Event()
        self._serving = threading.Event()
        self._done = threading.Event()
        self._pool = ThreadPoolExecutor(STORE_WORKERS, thread_name_prefix="selector-daemon-store")
        self._lock_pool = ThreadPoolExecutor(1, thread_name_prefix="selector-daemon-jobs")
        self._answered: queue.SimpleQueue[tuple[_Conn, Mapping[str, Any], dict[str, Any]]] = queue.SimpleQueue()
        self.stats = {"served": 0, "bad_requests": 0, "refused_peers": 0, "dropped_busy": 0, "expired": 0}

    # --- setting up ------------------------------------------------------------------------------------

    def _bind(self) -> socket.socket:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            pass
        else:
            if stat.S_ISDIR(st.st_mode):
                raise DaemonError(f"{self.path} is a folder, not a socket")
            self.path.unlink()  # a stale socket: the lock says no daemon of ours serves it
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket is born 0600: no moment where another user could connect
        try:
            sock.bind(str(self.path))
        except OSError as exc:
            sock.close()
            raise DaemonError(f"cannot bind {self.path}: {exc.strerror}") from None
        finally:
            os.umask(old)
        sock.listen(socket.SOMAXCONN)
        sock.setblocking(False)
        return sock

    def status(self) -> dict[str, Any]:
        """What the status file holds."""
        return {"pid": os.getpid(), "socket": str(self.path), "fingerprint": self.fingerprint,
                "protocol": wire.PROTOCOL_VERSION, "version": selector.__version__,
                "store": str(getattr(self.store, "path", "")), "started_at": self.started_at}

    # --- answering -------------------------------------------------------------------------------------

    def answer(self, message: Mapping[str, Any]) -> dict[str, Any]:
        """The reply to one decoded request."""
        op = message.get("op")
        if op == wire.PING:
            return {"ok": True, "pid": os.getpid(), "protocol": wire.PROTOCOL_VERSION,
                    "version": selector.__version__, "fingerprint": self.fingerprint,
                    "connections": len(self._conns), "uptime_s": round(time.time() - self.started_at, 3)}
        if op == wire.ENVIRONMENT:
            return {"ok": True, "environment": self._env_dict, "fingerprint": self.fingerprint,
                    "context": self.context}
        if op == wire.TUNING_GET:
            fingerprint = message.get("fingerprint")  # a list: the records of any (each backend's own)
            if not _is_fingerprint_filter(fingerprint):
                return _error("bad request: fingerprint is a string, a list of at most "
                              f"{MAX_FINGERPRINTS} strings, or null")
            return {"ok": True, "records": self.store.records(fingerprint)}
        if op == wire.TUNING_PUT:
            return self._put(message.get("records"))
        if op == wire.JOBS:
            return {"ok": True, "jobs": self.jobs()}
        if op == wire.STOP:
            return {"ok": True, "pid": os.getpid()}
        if not isinstance(op, str):
            return _error("bad request: a request names its op")
        return _error(f"unknown op {op!r}")

    def jobs(self) -> list[str]:
        """The measurement locks held now beside the store (`<store folder>/locks/<name>.lock`, taken by a tuner
        for each GPU it measures on): a lock this probe cannot share is held. The probe holds a shared lock for
        an instant, so a tuner trying at that moment tries again at its next poll."""
        from selector.tuning_store import STORE_LOCKS

        folder = Path(str(getattr(self.store, "path", ""))).parent / "locks"
        try:  # the store's own locks (held for a moment by each put) are no jobs
            names = sorted(p.name for p in os.scandir(folder) if p.name.endswith(".lock") and p.is_file(
                follow_symlinks=False) and p.name.removesuffix(".lock") not in STORE_LOCKS)
        except OSError:
            return []
        held = []
        for name in names:
            try:
                fd = os.open(folder / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                held.append(name.removesuffix(".lock"))
            finally:
                os.close(fd)  # also releases the shared lock, if it was got
        return held

    def _put(self, records: object) -> dict[str, Any]:
        if not isinstance(records, list):
            return _error("bad request: records is a list")
        if len(records) > wire.MAX_RECORDS_PER_PUT:
            return _error(f"bad request: {len(records)} records, at most {wire.MAX_RECORDS_PER_PUT} per put")
        valid, refused = [], []
        for r in records:
            reason = check_record(r)
            if reason is None:
                valid.append(r)
            else:
                refused.append(reason)
        stored = 0
        if valid:
            result = self.store.put(valid)
            stored = int(result.stored)
            refused += list(result.refused)
        return {"ok": True, "stored": stored, "refused": len(refused), "reasons": refused[:MAX_REASONS]}

    def _answer_safely(self, message: Mapping[str, Any]) -> dict[str, Any]:
        try:
            return self.answer(message)
        except Exception as exc:  # a failing store must not take the daemon down with it
            log.exception("answering %r failed", message.get("op"))
            return _error(f"internal error: {type(exc).__name__}: {exc}")

    def _on_request(self, conn: _Conn, body: bytes) -> None:
        """Answer one whole request frame: at once, or through the store's workers for the store's ops."""
        try:
            message = wire.decode(body)
        except wire.WireError as exc:
            self.stats["bad_requests"] += 1
            self._reply(conn, _error(f"bad request: {exc}"))
            return
        op = message.get("op")
        if op in _STORE_OPS or op in _LOCK_OPS:  # may wait on the store's lock or the file system: never in the loop
            conn.pending = True
            self._selector.unregister(conn.sock)
            (self._pool if op in _STORE_OPS else self._lock_pool).submit(self._answer_in_pool, conn, message)
        else:
            self._finish(conn, message, self._answer_safely(message))

    def _answer_in_pool(self, conn: _Conn, message: Mapping[str, Any]) -> None:
        self._answered.put((conn, message, self._answer_safely(message)))
        self._wake()

    def _take_answers(self) -> None:
        while True:
            try:
                conn, message, reply = self._answered.get_nowait()
            except queue.Empty:
                return
            if self._conns.get(conn.fd) is conn:  # still open (not expired or dropped meanwhile)
                conn.pending = False
                self._finish(conn, message, reply)

    def _finish(self, conn: _Conn, message: Mapping[str, Any], reply: dict[str, Any]) -> None:
        if not reply.get("ok"):
            self.stats["bad_requests"] += 1
        conn.stop = bool(reply.get("ok")) and message.get("op") == wire.STOP
        self._reply(conn, reply)

    # --- the loop --------------------------------------------------------------------------------------

    def serve_forever(self, poll_interval: float = 1.0) -> None:
        """Serve until `shutdown`, a `stop` request or SIGTERM (under `serve`)."""
        assert self._listener is not None
        sel = self._selector
        sel.register(self._listener, selectors.EVENT_READ, "listen")
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._serving.set()
        try:
            while not self._stopping.is_set():
                for key, events in sel.select(self._timeout(poll_interval)):
                    try:
                        self._on_event(key, events)
                    except Exception:  # one connection's failure is its own: the loop serves the others
                        log.exception("a connection failed; closed")
                        if isinstance(key.data, _Conn):
                            self.stats["bad_requests"] += 1
                            self._close(key.data)
                self._expire(time.monotonic())
        finally:
            for conn in list(self._conns.values()):
                self._close(conn)
            for s in (self._listener, self._wake_r):
                try:
                    sel.unregister(s)
                except (KeyError, ValueError):
                    pass
            self._serving.clear()
            self._done.set()

    def _on_event(self, key: selectors.SelectorKey, events: int) -> None:
        if key.data == "listen":
            self._accept()
        elif key.data == "wake":
            self._drain_wake()
            self._take_answers()
        elif events & selectors.EVENT_READ:
            self._on_read(key.data)
        elif events & selectors.EVENT_WRITE:
            self._on_write(key.data)

    def _timeout(self, poll_interval: float) -> float:
        """Seconds until the next deadline of a connection (at most `poll_interval`)."""
        soonest = math.inf
        for conn in self._conns.values():
            read_by = conn.accepted + REQUEST_DEADLINE_S
            if read_by >= soonest:
                break  # younger ones follow, and a reply's deadline is later than its request's
            soonest = min(soonest, self._deadline(conn))
        return max(0.0, min(poll_interval, soonest - time.monotonic()))

    @staticmethod
    def _deadline(conn: _Conn) -> float:
        if conn.pending:
            return conn.accepted + REPLY_DEADLINE_S
        if conn.out is None:
            return conn.accepted + REQUEST_DEADLINE_S
        return conn.reply_deadline

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # the pipe is full: the loop wakes anyway

    def request_stop(self) -> None:
        """Ask the loop to end (safe from a signal handler or another thread)."""
        self._stopping.set()
        self._wake()

    def shutdown(self) -> None:
        """End `serve_forever` and wait until it returned."""
        self.request_stop()
        if self._serving.is_set():
            self._done.wait()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except OSError:
            pass

    def _accept(self) -> None:
        assert self._listener is not None
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors or memory: drop the oldest, try again next wake-up
                log.warning("accept failed: %s", exc.strerror)
                self._drop_oldest()
                return
            sock.setblocking(False)
            try:
                uid = wire.peer_uid(sock)
            except OSError:
                sock.close()
                continue
            if uid is not None and uid != self._uid:
                self.stats["refused_peers"] += 1
                log.warning("refused a connection from uid %d (this daemon serves uid %d only)", uid, self._uid)
                _send_now(sock, _error(f"refused: this daemon serves uid {self._uid} only"))
                sock.close()
                continue
            if len(self._conns) >= MAX_CONNECTIONS and not self._drop_oldest():
                self.stats["dropped_busy"] += 1
                _send_now(sock, _error("busy"))
                sock.close()
                continue
            conn = _Conn(sock, time.monotonic())
            self._conns[conn.fd] = conn
            self._selector.register(sock, selectors.EVENT_READ, conn)

    def _drop_oldest(self) -> bool:
        """Tell the oldest connection still sending its request `busy` and close it; whether there was one."""
        for conn in self._conns.values():
            if conn.out is None and not conn.pending:
                self.stats["dropped_busy"] += 1
                _send_now(conn.sock, _error("busy"))
                self._close(conn)
                return True
        return False

    def _on_read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(wire.RECV_CHUNK_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        if not data:  # the peer left before its request was whole
            if conn.buf:
                self.stats["bad_requests"] += 1
            self._close(conn)
            return
        conn.buf += data
        self._buffered += len(data)
        if conn.need is None and len(conn.buf) >= wire.HEADER.size:
            try:
                conn.need = wire.frame_length(bytes(conn.buf[:wire.HEADER.size]), wire.MAX_REQUEST_BYTES)
            except wire.WireError as exc:
                self.stats["bad_requests"] += 1
                self._reply(conn, _error(f"bad request: {exc}"))
                return
        if conn.need is None:
            return
        end = wire.HEADER.size + conn.need
        if len(conn.buf) > end:
            self.stats["bad_requests"] += 1
            self._reply(conn, _error("bad request: bytes after the request (one request per connection)"))
        elif len(conn.buf) == end:
            self._on_request(conn, bytes(conn.buf[wire.HEADER.size:]))
        elif self._buffered > MAX_BUFFERED_BYTES:
            self.stats["dropped_busy"] += 1
            self._reply(conn, _error("busy"))

    def _reply(self, conn: _Conn, message: dict[str, Any]) -> None:
        try:
            conn.out = wire.encode(message)
        except (wire.WireError, TypeError, ValueError) as exc:
            conn.out = wire.encode(_error(f"internal error: reply not sent: {exc}"))
        self._buffered -= len(conn.buf)
        conn.buf = bytearray()
        conn.reply_deadline = time.monotonic() + REPLY_DEADLINE_S
        self.stats["served"] += 1
        self._on_write(conn)
        if conn.fd in self._conns:
            try:
                self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
            except KeyError:  # unregistered while the store answered it
                self._selector.register(conn.sock, selectors.EVENT_WRITE, conn)

    def _on_write(self, conn: _Conn) -> None:
        assert conn.out is not None
        try:
            while conn.sent < len(conn.out):
                conn.sent += conn.sock.send(memoryview(conn.out)[conn.sent:])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            pass  # the peer left: nothing more to do for it
        if conn.stop:
            self.request_stop()
        self._close(conn)

    def _expire(self, now: float) -> None:
        late = []
        for conn in self._conns.values():
            if conn.accepted + REQUEST_DEADLINE_S > now:
                break  # younger ones follow
            if now >= self._deadline(conn):
                late.append(conn)
        for conn in late:
            self.stats["expired"] += 1
            if conn.out is None and not conn.pending:
                _send_now(conn.sock, _error(f"bad request: not whole within {REQUEST_DEADLINE_S:g} s"))
            self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if self._conns.pop(conn.fd, None) is None:
            return
        self._buffered -= len(conn.buf)
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()

    # --- closing ---------------------------------------------------------------------------------------

    def _release(self) -> None:
        """Remove the socket (when it is still ours) and the status file, close the listener, drop the lock."""
        if self._listener is not None:
            try:
                if os.lstat(self.path).st_ino == self._inode:
                    self.path.unlink()
            except OSError:
                pass
            wire.status_path(self.path).unlink(missing_ok=True)
            self._listener.close()
            self._listener = None
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def server_close(self) -> None:
        """Release the daemon's files and sockets (after `serve_forever` returned, or instead of it)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._lock_pool.shutdown(wait=False, cancel_futures=True)
        self._release()
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()


def serve(path: Path | None = None, store_file: Path | None = None) -> None:
    """Run the daemon in the foreground until `selector daemon stop`, SIGTERM or SIGINT (DaemonError when it
    cannot serve at `path`)."""
    if not logging.getLogger().handlers and not log.handlers:
        logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="selector daemon: %(levelname)s %(message)s")
    logging.captureWarnings(True)  # the store warns (damaged file rebuilt, records refused): into the log
    server = DaemonServer(path or wire.socket_path(), store_file=store_file)
    previous = signal.signal(signal.SIGTERM, lambda *_: server.request_stop())
    log.info("serving at %s (pid %d, store %s)", server.path, os.getpid(), server.status()["store"])
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        signal.signal(signal.SIGTERM, previous)


def start(path: Path, store_file: Path | None = None, wait_s: float = START_WAIT_S) -> None:
    """Run the daemon in a background process of its own, its warnings going to its log; DaemonError saying
    why when it did not answer within `wait_s`."""
    reason = wire.ensure_private_dir(path.parent)
    if reason is not None:
        raise DaemonError(f"refusing to serve at {path}: {reason}")
    log_file = wire.log_path(path)
    try:
        log_fd = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise DaemonError(f"cannot open the log {log_file}: {exc.strerror}") from None
    command = [sys.executable, "-m", "selector.cli", "daemon", "run", "--socket", str(path)]
    if store_file is not None:
        command += ["--store", str(store_file)]
    try:
        child = subprocess.Popen(command, start_new_session=True, stdin=subprocess.DEVNULL,
                                 stdout=log_fd, stderr=log_fd)
    finally:
        os.close(log_fd)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if ping(path):
            return
        if child.poll() is not None:
            raise DaemonError(f"the daemon exited with status {child.returncode}: {_last_line(log_file)}")
        time.sleep(0.05)
    raise DaemonError(f"the daemon did not answer at {path} within {wait_s:g} s (see {log_file})")


def _last_line(path: Path) -> str:
    text = wire.read_private_file(path, limit=1 << 20) or ""
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def stop(path: Path, wait_s: float = STOP_WAIT_S) -> bool:
    """Ask the daemon at `path` to exit and wait until it stopped answering; False when none answered."""
    reply = request(path, {"op": wire.STOP}, timeout=2.0)
    if reply is None or not reply.get("ok"):
        return False
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and path.exists():
        time.sleep(0.02)
    return True


def read_status(path: Path) -> dict[str, Any] | None:
    """The status file of the daemon answering at `path` (checked: this user's, private, no symlink) with its
    live figures, or None when none answers."""
    live = request(path, {"op": wire.PING})
    if live is None or not live.get("ok") or wire.check_private_dir(path.parent) is not None:
        return None
    text = wire.read_private_file(wire.status_path(path))
    try:
        status = json.loads(text) if text is not None else None
    except ValueError:
        status = None
    if not isinstance(status, dict):
        status = {"status_file": "missing or not trusted"}
    status.update({k: live[k] for k in ("pid", "connections", "uptime_s") if k in live})
    jobs = request(path, {"op": wire.JOBS}, timeout=2.0)
    if jobs is not None and jobs.get("ok"):
        status["jobs"] = jobs.get("jobs", [])
    return status
