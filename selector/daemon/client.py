"""What a library process asks the node daemon: one request per call, None or empty when no daemon answers.

Every call is bounded by one deadline for the whole exchange (connect, send, the reply's last byte), so a busy,
dead, dripping or silent daemon costs a library call at most that long; then the caller works alone. Nothing
here raises into the library: a missing or foreign folder, a socket of another user, a reply of another
protocol version or garbage all read as "no daemon". Imports nothing of the server or of the store, so a
worker process that only asks pays for a socket, not a server.
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from selector import settings
from selector.daemon import wire
from selector.daemon.wire import socket_path
from selector.probes import Environment

__all__ = [
    "environment_from_daemon",
    "jobs_in_progress",
    "ping",
    "request",
    "share_tuning_records",
    "shared_tuning_records",
    "socket_path",
]

TIMEOUT_VARIABLE = "SELECTOR_DAEMON_TIMEOUT"
QUICK_TIMEOUT_S = 0.5  # a library call must not wait long for a daemon that is busy or gone
RECORDS_TIMEOUT_S = 2.0  # record transfers are larger and happen once per process
_REFUSED_RETRIES = 3  # a refused connect is retried only briefly: a live daemon restarting, else a stale socket
_PUT_BATCH_BYTES = wire.MAX_REQUEST_BYTES // 2


def quick_timeout(environ: Mapping[str, str] | None = None) -> float:
    """Seconds a quick library call waits for the daemon ($SELECTOR_DAEMON_TIMEOUT)."""
    value: float = settings.get(TIMEOUT_VARIABLE, environ)
    return value


def _connect(path: Path, deadline: float) -> socket.socket | None:
    """A socket connected to `path` before `deadline`, retrying a full backlog; None when none answers."""
    delay = 0.001
    refused = 0
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            s.connect(str(path))
            return s
        except (BlockingIOError, InterruptedError):
            pass  # the listen backlog is full: the daemon is alive but behind, so wait a little
        except ConnectionRefusedError:
            refused += 1
            if refused > _REFUSED_RETRIES:
                s.close()
                return None
        except OSError:
            s.close()
            return None
        s.close()
        if time.monotonic() + delay >= deadline:
            return None
        time.sleep(delay)
        delay = min(delay * 2, 0.02)


def _owned_by_us(s: socket.socket, path: Path) -> bool:
    """Whether the process serving `s` runs as this user (a socket someone replaced is not ours)."""
    uid = wire.peer_uid(s)
    if uid is None:  # no SO_PEERCRED here: the socket file's owner is the next best witness
        try:
            uid = os.lstat(path).st_uid
        except OSError:
            return False
    return uid == os.getuid()


def _recv_exact(s: socket.socket, size: int, deadline: float) -> bytes | None:
    """`size` bytes from `s` before `deadline`, or None (peer closed, deadline passed)."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        s.settimeout(remaining)
        n = s.recv_into(view[got:], min(size - got, wire.RECV_CHUNK_BYTES))
        if n == 0:
            return None
        got += n
    return bytes(buf)


def request(path: Path, payload: Mapping[str, Any], timeout: float = QUICK_TIMEOUT_S) -> dict[str, Any] | None:
    """Send one request to the daemon at `path` and return its reply (a dict of this protocol version), or
    None when no daemon of this user answered properly within `timeout` seconds. Never raises."""
    deadline = time.monotonic() + timeout
    try:
        frame = wire.encode(payload, limit=wire.MAX_REQUEST_BYTES)
    except (TypeError, ValueError):  # not JSON, or too big to send
        return None
    try:
        s = _connect(path, deadline)
        if s is None:
            return None
        with s:
            if not _owned_by_us(s, path):
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            s.settimeout(remaining)
            s.sendall(frame)
            header = _recv_exact(s, wire.HEADER.size, deadline)
            if header is None:
                return None
            body = _recv_exact(s, wire.frame_length(header, wire.MAX_REPLY_BYTES), deadline)
        return None if body is None else wire.decode(body)
    except (OSError, ValueError):  # timeouts, resets, oversized or garbled frames (WireError is a ValueError)
        return None


def ping(path: Path, timeout: float | None = None) -> bool:
    """Whether a daemon of this user answers at `path`."""
    reply = request(path, {"op": wire.PING}, quick_timeout() if timeout is None else timeout)
    return reply is not None and reply.get("ok") is True


def _ask(payload: Mapping[str, Any], environ: Mapping[str, str] | None, timeout: float) -> dict[str, Any] | None:
    """The daemon's ok reply to `payload` at the configured socket, or None when none answers, it refused,
    or its folder is not this user's private one."""
    path = socket_path(environ)
    if wire.check_private_dir(path.parent) is not None:
        return None
    reply = request(path, payload, timeout)
    return reply if reply is not None and reply.get("ok") is True else None


def environment_from_daemon(environ: Mapping[str, str] | None = None) -> Environment | None:
    """The daemon's probe facts, or None (the caller probes itself) when no daemon answers, its facts do not
    match their fingerprint, or it probed another Python environment or other visible GPUs than this process's."""
    try:
        reply = _ask({"op": wire.ENVIRONMENT}, environ, quick_timeout(environ))
        if reply is None or reply.get("context") != wire.process_context(environ):
            return None
        env = Environment.from_dict(reply["environment"])
        return env if env.fingerprint() == reply.get("fingerprint") else None
    except Exception:  # facts the probes cannot read back are no facts; the caller probes itself
        return None


def shared_tuning_records(environ: Mapping[str, str] | None = None,
                          fingerprint: str | Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Timings the processes of this node shared through the daemon: those of `fingerprint` (one, or any of a
    list: each backend's record fingerprint), or all when it is None (none when no daemon answers)."""
    if fingerprint is not None and not isinstance(fingerprint, str):
        fingerprint = list(fingerprint)
    try:
        reply = _ask({"op": wire.TUNING_GET, "fingerprint": fingerprint}, environ, RECORDS_TIMEOUT_S)
        records = [] if reply is None else reply.get("records")
        return [dict(r) for r in records if isinstance(r, dict)] if isinstance(records, list) else []
    except Exception:  # a bad setting or a strange reply: the caller works from its own files
        return []


def _batches(records: Iterable[Mapping[str, Any]]) -> Iterator[list[dict[str, Any]]]:
    """Records in puts that stay under the daemon's limits (bytes and count per request)."""
    batch: list[dict[str, Any]] = []
    size = 0
    for r in records:
        item = dict(r)
        n = len(json.dumps(item, allow_nan=False))
        if batch and (size + n > _PUT_BATCH_BYTES or len(batch) >= wire.MAX_RECORDS_PER_PUT):
            yield batch
            batch, size = [], 0
        batch.append(item)
        size += n
    if batch:
        yield batch


def share_tuning_records(records: Iterable[Mapping[str, Any]], environ: Mapping[str, str] | None = None) -> int | None:
    """Hand timings to the daemon for the other processes of this node; how many it stored (it refuses records
    that do not validate), None when no daemon took them."""
    try:
        stored = 0
        for batch in _batches(records):
            reply = _ask({"op": wire.TUNING_PUT, "records": batch}, environ, RECORDS_TIMEOUT_S)
            if reply is None or not isinstance(reply.get("stored"), int):
                return None
            stored += reply["stored"]
        return stored
    except Exception:  # records that are not JSON, a bad setting: sharing is a courtesy, never a failure
        return None


def jobs_in_progress(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The measurement locks held now (e.g. `gpu-0`: a tuning job runs on that GPU), None without a daemon."""
    try:
        reply = _ask({"op": wire.JOBS}, environ, quick_timeout(environ))
        jobs = None if reply is None else reply.get("jobs")
        return [j for j in jobs if isinstance(j, str)] if isinstance(jobs, list) else None
    except Exception:  # a bad setting or a strange reply: nothing known
        return None
