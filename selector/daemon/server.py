"""The daemon process: a Unix-socket server holding this node's probe facts and shared timings.

It writes a status file beside the socket (pid, socket path, environment fingerprint) and removes both when
it closes. `serve` runs it in the foreground; `start` runs it in the background; `stop` asks it to exit.
"""

from __future__ import annotations

import json
import os
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from selector.daemon import wire
from selector.daemon.client import ping, request
from selector.probes import Environment, collect_environment
from selector.tuning import record_key

START_WAIT_S = 5.0  # the daemon probes once before it answers


class _State:
    """The facts and the shared timings, one record per tuning key (a later put replaces an earlier one)."""

    def __init__(self, env: Environment) -> None:
        self.env = env
        self.records: dict[tuple[Any, ...], dict[str, Any]] = {}
        self.lock = threading.Lock()

    def put(self, records: Iterable[Mapping[str, Any]]) -> int:
        count = 0
        with self.lock:
            for r in records:
                self.records[record_key(r)] = dict(r)
                count += 1
        return count

    def get(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.records.values())


class _Handler(socketserver.StreamRequestHandler):
    server: DaemonServer

    def handle(self) -> None:
        frame = wire.read_request(self.rfile)
        try:
            reply = self.server.answer(wire.decode(frame))
        except (ValueError, KeyError, TypeError) as exc:
            reply = {"ok": False, "error": f"bad request: {exc}"}
        self.wfile.write(wire.encode(reply))


class DaemonServer(socketserver.ThreadingUnixStreamServer):
    """The server bound at `path`; replaces a stale socket, refuses to start beside a live daemon."""

    daemon_threads = True

    def __init__(self, path: Path, env: Environment | None = None) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            if ping(path):
                raise RuntimeError(f"a selector daemon already answers at {path}")
            path.unlink()  # a stale socket from a daemon that died
        super().__init__(str(path), _Handler)
        self.path = path
        self.state = _State(env or collect_environment())
        wire.status_path(path).write_text(json.dumps(
            {"pid": os.getpid(), "socket": str(path), "fingerprint": self.state.env.fingerprint()}
        ))

    def answer(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """The reply to one decoded request (KeyError / TypeError for a malformed one)."""
        op = request["op"]
        if op == wire.PING:
            return {"ok": True, "pid": os.getpid(), "fingerprint": self.state.env.fingerprint()}
        if op == wire.ENVIRONMENT:
            return {"ok": True, "environment": self.state.env.to_dict()}
        if op == wire.TUNING_GET:
            return {"ok": True, "records": self.state.get()}
        if op == wire.TUNING_PUT:
            return {"ok": True, "stored": self.state.put(request["records"])}
        if op == wire.STOP:
            threading.Thread(target=self.shutdown, daemon=True).start()
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def server_close(self) -> None:
        super().server_close()
        for p in (self.path, wire.status_path(self.path)):
            p.unlink(missing_ok=True)


def serve(path: Path | None = None) -> None:
    """Run the daemon in the foreground until `selector daemon stop` (or SIGINT)."""
    server = DaemonServer(path or wire.socket_path())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def start(path: Path, wait_s: float = START_WAIT_S) -> bool:
    """Run the daemon in a background process of its own; whether it answered within `wait_s`."""
    subprocess.Popen([sys.executable, "-m", "selector.cli", "daemon", "run", "--socket", str(path)],
                     start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if ping(path):
            return True
        time.sleep(0.1)
    return False


def stop(path: Path) -> bool:
    """Ask the daemon at `path` to exit; False when none answers."""
    if not ping(path):
        return False
    request(path, {"op": wire.STOP})
    return True


def read_status(path: Path) -> dict[str, Any] | None:
    """The status file of the daemon answering at `path`, or None when none answers."""
    if not ping(path):
        return None
    status: dict[str, Any] = json.loads(wire.status_path(path).read_text())
    return status
