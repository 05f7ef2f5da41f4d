"""The daemon's wire format: how one request and one reply travel, and where the socket lives.

Protocol: one JSON object per line over a Unix socket, one request and one reply per connection.
Requests: {"op": "ping"}, {"op": "environment"}, {"op": "tuning_get"}, {"op": "tuning_put", "records": [...]},
{"op": "stop"}. Replies: {"ok": true, ...} or {"ok": false, "error": "..."}.
A status file beside the socket holds the pid, the socket path and the environment fingerprint.

Framing lives only here (`encode`, `decode`, `read_request`, `read_reply`), so changing it is one edit.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from selector import settings

SOCKET_VARIABLE = "SELECTOR_DAEMON_SOCKET"
MAX_REQUEST_BYTES = 8 * 2**20
RECV_CHUNK_BYTES = 65536

PING = "ping"
ENVIRONMENT = "environment"
TUNING_GET = "tuning_get"
TUNING_PUT = "tuning_put"
STOP = "stop"
OPS = (PING, ENVIRONMENT, TUNING_GET, TUNING_PUT, STOP)

_END = b"\n"  # one message per line


def default_socket_path() -> Path:
    """$XDG_RUNTIME_DIR/selector/daemon.sock, else a per-user folder in the temp dir."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "selector" / "daemon.sock"
    return Path(tempfile.gettempdir()) / f"selector-{os.getuid()}" / "daemon.sock"


def socket_path(environ: Mapping[str, str] | None = None) -> Path:
    """$SELECTOR_DAEMON_SOCKET when set, else the default socket path."""
    chosen = settings.get(SOCKET_VARIABLE, environ)
    return Path(chosen) if chosen else default_socket_path()


def status_path(sock: Path) -> Path:
    """The status file beside the socket."""
    return sock.with_suffix(".json")


def encode(message: Mapping[str, Any]) -> bytes:
    """One message (request or reply) as the bytes sent for it."""
    return json.dumps(message).encode() + _END


def decode(frame: bytes) -> Any:
    """The message in one received frame; ValueError when it is not JSON."""
    return json.loads(frame)


def read_request(stream: BinaryIO) -> bytes:
    """One request frame from the server's side of a connection (at most MAX_REQUEST_BYTES)."""
    return stream.readline(MAX_REQUEST_BYTES)


def read_reply(sock: socket.socket) -> bytes:
    """One reply frame from the client's side of a connection (what came before the peer closed)."""
    data = b""
    while not data.endswith(_END):
        chunk = sock.recv(RECV_CHUNK_BYTES)
        if not chunk:
            break
        data += chunk
    return data
