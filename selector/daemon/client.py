"""What a library process asks the node daemon: one request per call, None or empty when no daemon answers.

Imports nothing of the server, so a worker process that only asks pays for a socket, not a server.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from selector.daemon import wire
from selector.daemon.wire import socket_path
from selector.probes import Environment

__all__ = [
    "environment_from_daemon",
    "ping",
    "request",
    "share_tuning_records",
    "shared_tuning_records",
    "socket_path",
]

QUICK_TIMEOUT_S = 0.5  # a library call must not wait long for a daemon that is busy or gone


def request(path: Path, payload: Mapping[str, Any], timeout: float = 2.0) -> dict[str, Any]:
    """Send one request and return the reply; OSError when no daemon answers, ValueError on a garbled reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(path))
        s.sendall(wire.encode(payload))
        data = wire.read_reply(s)
    reply: dict[str, Any] = wire.decode(data)
    return reply


def ping(path: Path) -> bool:
    """Whether a daemon answers at `path`."""
    try:
        return bool(request(path, {"op": wire.PING}, timeout=QUICK_TIMEOUT_S).get("ok"))
    except (OSError, ValueError):
        return False


def _ask(op: str, environ: Mapping[str, str] | None) -> dict[str, Any] | None:
    """The daemon's ok reply to `op` at the configured socket, or None when none answers or it refused."""
    path = socket_path(environ)
    if not path.exists():
        return None
    try:
        reply = request(path, {"op": op}, timeout=QUICK_TIMEOUT_S)
    except (OSError, ValueError):
        return None
    return reply if reply.get("ok") else None


def environment_from_daemon(environ: Mapping[str, str] | None = None) -> Environment | None:
    """The daemon's probe facts, or None when no daemon answers (the caller probes itself)."""
    reply = _ask(wire.ENVIRONMENT, environ)
    return None if reply is None else Environment.from_dict(reply["environment"])


def shared_tuning_records(environ: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
    """Timings other processes of this node shared through the daemon (none when it is not running)."""
    reply = _ask(wire.TUNING_GET, environ)
    return [] if reply is None else list(reply.get("records", []))


def share_tuning_records(records: Iterable[Mapping[str, Any]], environ: Mapping[str, str] | None = None) -> int | None:
    """Hand timings to the daemon for the other processes of this node; how many it stored, None without one."""
    path = socket_path(environ)
    if not ping(path):
        return None
    reply = request(path, {"op": wire.TUNING_PUT, "records": [dict(r) for r in records]})
    return int(reply["stored"]) if reply.get("ok") else None
