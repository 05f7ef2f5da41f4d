"""The daemon's wire format and its files: how one request and one reply travel, and where the daemon lives.

Protocol: over a Unix stream socket, one request and one reply per connection. Each message is a frame: a
4-byte big-endian length, then that many bytes of UTF-8 JSON holding one object that carries
`"v": PROTOCOL_VERSION`. Sizes are bounded (MAX_REQUEST_BYTES, MAX_REPLY_BYTES, MAX_RECORDS_PER_PUT) and
nothing but JSON is ever decoded, so a peer can make a request fail but never make either side run its data.

Requests: {"op": "ping"}, {"op": "environment"}, {"op": "tuning_get", "fingerprint": str | [str] | null} (the
records of one fingerprint, of any of a list, or all),
{"op": "tuning_put", "records": [...]}, {"op": "jobs"} (measurement locks held now: tuning in progress),
{"op": "stop"}. Replies: {"ok": true, ...} or {"ok": false, "error": ...}.

Files: the daemon's folder (`$XDG_RUNTIME_DIR/selector`, else `<tempdir>/selector-<uid>`) must belong to this
user, be closed to everyone else and not be a symlink (`check_private_dir`); the socket, its status file, lock
and log live in it. Another local user who creates that folder first must not be able to feed this user's
processes facts or timings, so both sides check it.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import struct
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from selector import settings

PROTOCOL_VERSION = 2
SOCKET_VARIABLE = "SELECTOR_DAEMON_SOCKET"
HEADER = struct.Struct(">I")
MAX_REQUEST_BYTES = 4 * 2**20
MAX_REPLY_BYTES = 32 * 2**20
MAX_RECORDS_PER_PUT = 10_000
MAX_STATUS_BYTES = 64 * 2**10
RECV_CHUNK_BYTES = 256 * 2**10

PING = "ping"
ENVIRONMENT = "environment"
TUNING_GET = "tuning_get"
TUNING_PUT = "tuning_put"
JOBS = "jobs"
STOP = "stop"
OPS = (PING, ENVIRONMENT, TUNING_GET, TUNING_PUT, JOBS, STOP)

SOCKET_NAME = "daemon.sock"


class WireError(ValueError):
    """A frame that is not one message of this protocol (malformed, oversized, not an object, other version)."""


# --- framing ---------------------------------------------------------------------------------------------


def encode(message: Mapping[str, Any], limit: int = MAX_REPLY_BYTES) -> bytes:
    """One message as the frame sent for it, stamped with PROTOCOL_VERSION (WireError when over `limit`)."""
    body = json.dumps({**message, "v": PROTOCOL_VERSION}, allow_nan=False, separators=(",", ":")).encode()
    if len(body) > limit:
        raise WireError(f"message of {len(body)} bytes is over the limit of {limit}")
    return HEADER.pack(len(body)) + body


MAX_DEPTH = 32  # nesting of arrays and objects: a message of this protocol needs 4
MAX_NUMBER_CHARS = 40  # digits of one number: ints and floats of this protocol need under 20


def _no_constant(name: str) -> Any:
    raise WireError(f"{name} is not JSON")


def _int(text: str) -> int:
    if len(text) > MAX_NUMBER_CHARS:
        raise WireError(f"a number of {len(text)} characters is over the limit of {MAX_NUMBER_CHARS}")
    return int(text)


def _float(text: str) -> float:
    if len(text) > MAX_NUMBER_CHARS:
        raise WireError(f"a number of {len(text)} characters is over the limit of {MAX_NUMBER_CHARS}")
    return float(text)


def nesting_depth(text: str) -> int:
    """How deep arrays and objects nest in JSON `text` (brackets inside strings do not count); a linear scan, so
    a frame nested past MAX_DEPTH is refused before the recursive parser sees it."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def decode(body: bytes) -> dict[str, Any]:
    """The message in one frame's body: a JSON object of this protocol version, else WireError saying why.

    Total: whatever the bytes, the result is a message or a WireError (depth and number sizes are bounded before
    they can reach the parser's recursion or int's digit limit)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WireError(f"frame is not UTF-8: {exc.reason}") from None
    depth = nesting_depth(text)
    if depth > MAX_DEPTH:
        raise WireError(f"frame nests {depth} deep, over the limit of {MAX_DEPTH}")
    try:
        message = json.loads(text, parse_constant=_no_constant, parse_int=_int, parse_float=_float)
    except json.JSONDecodeError as exc:
        raise WireError(f"frame is not JSON: {exc.msg}") from None
    except WireError:  # from the number hooks
        raise
    except (ValueError, RecursionError, MemoryError) as exc:
        raise WireError(f"frame is not usable JSON: {type(exc).__name__}") from None
    if not isinstance(message, dict):
        raise WireError(f"a message is a JSON object, got {type(message).__name__}")
    version = message.get("v")
    if version != PROTOCOL_VERSION:
        raise WireError(f"protocol version {version!r}, this side speaks {PROTOCOL_VERSION}")
    return message


def frame_length(header: bytes, limit: int) -> int:
    """The body length a frame header announces; WireError when it is over `limit`."""
    (length,) = HEADER.unpack(header)
    if length > limit:
        raise WireError(f"frame of {length} bytes is over the limit of {limit}")
    return length


# --- whose facts ---------------------------------------------------------------------------------------------


def process_context(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What the probe facts depend on beyond the machine: the Python environment (its packages) and the GPUs
    CUDA shows (CUDA_VISIBLE_DEVICES). A process uses the daemon's facts only when its own context is the same."""
    env = os.environ if environ is None else environ
    return {"python": sys.prefix, "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES")}


# --- credentials -----------------------------------------------------------------------------------------


def peer_uid(sock: socket.socket) -> int | None:
    """The user id of the process at the other end of a Unix socket (None where the platform cannot say)."""
    option = getattr(socket, "SO_PEERCRED", None)
    if option is None:
        return None
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i")))
    return int(uid)


# --- where the daemon lives --------------------------------------------------------------------------------


def default_dir(environ: Mapping[str, str] | None = None) -> Path:
    """$XDG_RUNTIME_DIR/selector, else `<tempdir>/selector-<uid>`."""
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "selector"
    return Path(tempfile.gettempdir()) / f"selector-{os.getuid()}"


def default_socket_path(environ: Mapping[str, str] | None = None) -> Path:
    return default_dir(environ) / SOCKET_NAME


def socket_path(environ: Mapping[str, str] | None = None) -> Path:
    """$SELECTOR_DAEMON_SOCKET when set, else the socket in the default folder."""
    chosen = settings.get(SOCKET_VARIABLE, environ)
    return Path(chosen) if chosen else default_socket_path(environ)


def status_path(sock: Path) -> Path:
    """The status file beside the socket."""
    return sock.with_suffix(".json")


def lock_path(sock: Path) -> Path:
    """The lock a running daemon holds, so that only one serves a socket."""
    return sock.with_suffix(".lock")


def log_path(sock: Path) -> Path:
    """Where a daemon started in the background writes its warnings."""
    return sock.with_suffix(".log")


def check_private_dir(folder: Path) -> str | None:
    """Why `folder` may not hold the daemon's files (None when it may): it must be a real folder (not a
    symlink), owned by this user, with no access for group or others."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return f"{folder} does not exist"
    except OSError as exc:
        return f"{folder} cannot be inspected: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode):
        return f"{folder} is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a folder"
    if st.st_uid != os.getuid():
        return f"{folder} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
    if st.st_mode & 0o077:
        return f"{folder} has mode {stat.S_IMODE(st.st_mode):04o}; it must be closed to group and others (0700)"
    return None


def ensure_private_dir(folder: Path) -> str | None:
    """Create `folder` with mode 0700 when it is missing (its parent must exist), then check it; why it may not
    be used, or None. An existing folder is never loosened or taken over, only checked."""
    try:
        os.mkdir(folder, 0o700)
    except FileExistsError:
        pass  # whoever made it, the check below decides
    except OSError as exc:
        return f"cannot create {folder}: {exc.strerror}"
    return check_private_dir(folder)


def write_private_file(path: Path, text: str) -> None:
    """Write `text` to `path` (mode 0600) through a fresh temp name and a rename, so a symlink planted at
    either name is never followed: the rename replaces the link itself, not what it points to."""
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        os.unlink(temp)
    except FileNotFoundError:
        pass
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(temp, path)
    except BaseException:
        try:
            os.unlink(temp)
        except OSError:
            pass
        raise


def read_private_file(path: Path, limit: int = MAX_STATUS_BYTES) -> str | None:
    """The text of `path` when it is a regular file of this user closed to others, not a symlink, at most
    `limit` bytes; None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError:  # missing, a symlink (ELOOP), unreadable
        return None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077 or st.st_size > limit:
            return None
        data = f.read(limit + 1)
    if len(data) > limit:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None
