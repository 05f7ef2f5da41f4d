"""A node-level daemon that probes once and shares facts and measured tuning results between processes.

Protocol: one JSON object per line over a Unix socket, one request and one reply per connection.
Requests: {"op": "ping"}, {"op": "environment"}, {"op": "tuning_get"}, {"op": "tuning_put", "records": [...]},
{"op": "stop"}. Replies: {"ok": true, ...} or {"ok": false, "error": "..."}.
A status file beside the socket holds the pid, the socket path and the environment fingerprint; clients that
find no daemon fall back to probing themselves, so the daemon is an accelerator, never a dependency.
"""

from __future__ import annotations

import json
import os
import socket
import socketserver
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from selector.probes import Environment, collect_environment
from selector.tuning import record_key

SOCKET_VARIABLE = "SELECTOR_DAEMON_SOCKET"
MAX_REQUEST_BYTES = 8 * 2**20


def default_socket_path() -> Path:
    """$XDG_RUNTIME_DIR/selector/daemon.sock, else a per-user folder in the temp dir."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "selector" / "daemon.sock"
    import tempfile

    return Path(tempfile.gettempdir()) / f"selector-{os.getuid()}" / "daemon.sock"


def socket_path(environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    return Path(environ[SOCKET_VARIABLE]) if environ.get(SOCKET_VARIABLE) else default_socket_path()


def status_path(sock: Path) -> Path:
    return sock.with_suffix(".json")


class _State:
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


class _Handler(socketserver.StreamRequestHandler):
    server: DaemonServer

    def handle(self) -> None:
        line = self.rfile.readline(MAX_REQUEST_BYTES)
        try:
            request = json.loads(line)
            reply = self.server.answer(request)
        except (ValueError, KeyError, TypeError) as exc:
            reply = {"ok": False, "error": f"bad request: {exc}"}
        self.wfile.write(json.dumps(reply).encode() + b"\n")


class DaemonServer(socketserver.ThreadingUnixStreamServer):
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
        status_path(path).write_text(json.dumps(
            {"pid": os.getpid(), "socket": str(path), "fingerprint": self.state.env.fingerprint()}
        ))

    def answer(self, request: Mapping[str, Any]) -> dict[str, Any]:
        op = request["op"]
        if op == "ping":
            return {"ok": True, "pid": os.getpid(), "fingerprint": self.state.env.fingerprint()}
        if op == "environment":
            return {"ok": True, "environment": self.state.env.to_dict()}
        if op == "tuning_get":
            with self.state.lock:
                return {"ok": True, "records": list(self.state.records.values())}
        if op == "tuning_put":
            return {"ok": True, "stored": self.state.put(request["records"])}
        if op == "stop":
            threading.Thread(target=self.shutdown, daemon=True).start()
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {op!r}"}

    def server_close(self) -> None:
        super().server_close()
        for p in (self.path, status_path(self.path)):
            p.unlink(missing_ok=True)


def request(path: Path, payload: Mapping[str, Any], timeout: float = 2.0) -> dict[str, Any]:
    """Send one request; raises OSError when no daemon answers."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(json.dumps(payload).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    return json.loads(data)


def ping(path: Path) -> bool:
    try:
        return bool(request(path, {"op": "ping"}, timeout=0.5).get("ok"))
    except (OSError, ValueError):
        return False


def environment_from_daemon(environ: Mapping[str, str] | None = None) -> Environment | None:
    """The daemon's probe facts, or None when no daemon answers (the caller probes itself)."""
    path = socket_path(environ)
    if not path.exists():
        return None
    try:
        reply = request(path, {"op": "environment"}, timeout=0.5)
    except (OSError, ValueError):
        return None
    return Environment.from_dict(reply["environment"]) if reply.get("ok") else None


def serve(path: Path | None = None) -> None:
    """Run the daemon in the foreground until `selector daemon stop` (or SIGINT)."""
    server = DaemonServer(path or socket_path())
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()


def register(sub: Any) -> None:
    import argparse

    daemon = sub.add_parser("daemon", help="share probes and tuning results between processes of this node")
    daemon.add_argument("action", choices=["run", "start", "stop", "status"])
    daemon.add_argument("--socket", type=Path, help=f"socket path (default: ${SOCKET_VARIABLE} or the runtime dir)")

    def handle(args: argparse.Namespace) -> int:
        path = args.socket or socket_path()
        if args.action == "run":
            serve(path)
            return 0
        if args.action == "start":
            import subprocess
            import sys
            import time

            if ping(path):
                print(f"already running at {path}")
                return 0
            subprocess.Popen([sys.executable, "-m", "selector.cli", "daemon", "run", "--socket", str(path)],
                             start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for _ in range(50):  # up to 5 s for the first probe
                if ping(path):
                    print(f"started at {path}")
                    return 0
                time.sleep(0.1)
            print(f"daemon did not answer at {path}")
            return 1
        if args.action == "stop":
            if not ping(path):
                print(f"no daemon at {path}")
                return 1
            request(path, {"op": "stop"})
            print("stopped")
            return 0
        if ping(path):
            print(json.dumps(json.loads(status_path(path).read_text()), indent=1))
            return 0
        print(f"no daemon at {path}")
        return 1

    daemon.set_defaults(func=handle)
