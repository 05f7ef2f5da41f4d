"""The daemon's decoding is total: no frame, however formed, ends its loop or earns a wrong reply.

Frames are sent to a daemon served in a thread (the wire is what matters): named regressions (JSON nested 990 deep,
an integer of 4,301 digits) and a fuzz run of 10,000 random and mutated frames, the daemon checked alive and
answering correctly after every batch.
"""

from __future__ import annotations

import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from selector.probes import collect_environment

from selector.daemon import client, wire
from selector.daemon.server import DaemonServer

GPUS = "NVIDIA H200:9.0:141"
FRAMES = 10_000
BATCH = 500


@pytest.fixture
def threaded(tmp_path: Path) -> Iterator[DaemonServer]:
    env = collect_environment({"SELECTOR_GPUS": GPUS, "PATH": ""})
    srv = DaemonServer(tmp_path / "run" / "d.sock", env=env, store_file=tmp_path / "tuning.sqlite3")
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    srv.thread = thread  # type: ignore[attr-defined]
    yield srv
    srv.shutdown()
    srv.server_close()
    thread.join(timeout=5)


def frame(body: bytes) -> bytes:
    return wire.HEADER.pack(len(body)) + body


def send(path: Path, data: bytes) -> bytes:
    """`data` as it is, the write side closed; whatever the daemon sent back."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5.0)
        s.connect(str(path))
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except OSError:  # the daemon may answer and close before all of a bad frame is sent
            pass
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except OSError:
            pass
    return got


def reply_of(got: bytes) -> dict | None:
    """The reply in what came back (None: the daemon closed without one); raises if it is not a message."""
    if not got:
        return None
    (length,) = wire.HEADER.unpack(got[:4])
    assert len(got) == 4 + length, "a reply is exactly one frame"
    return wire.decode(got[4:])


@pytest.mark.parametrize(
    "body,expected",
    [
        (b"[" * 990 + b"]" * 990, "nests 990 deep"),
        (b'{"v": 2, "op": "ping", "x": ' + b"9" * 4301 + b"}", "4301 characters"),
        (b'{"v": 2, "op": "ping", "x": 1' + b"0" * 400 + b".5}", "over the limit"),
        (b'{"v": 2, "op": "ping", "x": ' + b"[" * 40 + b"]" * 40 + b"}", "nests 41 deep"),
    ],
    ids=["990-deep", "4301-digit-int", "long-float", "41-deep-inside-a-message"],
)
def test_deep_and_huge_frames_get_an_error_and_the_daemon_lives(threaded: DaemonServer, body: bytes, expected: str):
    reply = reply_of(send(threaded.path, frame(body)))
    assert reply is not None and reply["ok"] is False and expected in reply["error"], reply
    assert client.ping(threaded.path)


def test_wire_decode_is_total_on_deep_input() -> None:
    """Decoding never raises anything but WireError, and never recurses past the limit."""
    for body in (b"[" * 100_000, b'{"a":' * 50_000, b"9" * 100_000, b'"' + b"\\" * 1001 + b'"'):
        with pytest.raises(wire.WireError):
            wire.decode(body)
    assert wire.decode(b'{"v": 2, "op": "ping", "s": "[[[[\\"]]]"}')["s"] == '[[[["]]]'


def test_the_client_reads_a_deeply_nested_reply_as_no_daemon(tmp_path: Path) -> None:
    path = tmp_path / "d.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def answer() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(frame(b'{"v": 2, "ok": true, "x": ' + b"[" * 5000 + b"]" * 5000 + b"}"))

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        assert client.request(path, {"op": wire.PING}, timeout=5.0) is None
    finally:
        thread.join(timeout=5)
        listener.close()


def _valid_bodies() -> list[bytes]:
    record = {"fingerprint": "f" * 32, "gpu": "NVIDIA H200", "problem": "E8-H16-I8-k2/bfloat16/dense/silu/gated",
              "mode": "eager", "tokens": 4, "backend": "grouped_mm", "time_s": 1e-4}  # fmt: skip
    messages = [{"op": "ping"}, {"op": "environment"}, {"op": "jobs"}, {"op": "tuning_get", "fingerprint": "f" * 32},
                {"op": "tuning_put", "records": [record]}]  # fmt: skip
    return [wire.encode(m)[4:] for m in messages]


def _mutated(rng: random.Random, bodies: list[bytes]) -> bytes:
    """One fuzz frame: random bytes, or a valid body mutated (flips, cuts, insertions, nesting, long numbers),
    under a header that is right, short, long or random."""
    kind = rng.randrange(8)
    if kind == 0:
        body = rng.randbytes(rng.randrange(0, 300))
    else:
        body = bytearray(rng.choice(bodies))
        for _ in range(rng.randrange(1, 4)):
            at = rng.randrange(len(body) + 1)
            choice = rng.randrange(6)
            if choice == 0 and body:
                body[min(at, len(body) - 1)] ^= 1 << rng.randrange(8)
            elif choice == 1:
                del body[at : at + rng.randrange(1, 20)]
            elif choice == 2:
                body[at:at] = rng.choice([b"[", b"{", b'{"a":']) * rng.randrange(1, 3000)
            elif choice == 3:
                body[at:at] = rng.choice(b"0123456789").to_bytes(1, "big") * rng.randrange(1, 6000)
            elif choice == 4:
                body[at:at] = rng.choice([b"NaN", b"Infinity", b'"\\ud800"', b"\x00", b"\xff", b"null", b"1e999"])
            else:
                body[at:at] = rng.randbytes(rng.randrange(1, 40))
        body = bytes(body)
    header = rng.randrange(5)
    if header == 0:
        return rng.randbytes(4) + body
    if header == 1 and len(body) > 1:
        return wire.HEADER.pack(len(body) - 1) + body
    if header == 2:
        return wire.HEADER.pack(len(body) + rng.randrange(1, 100)) + body
    return frame(body)


def test_fuzz_10000_frames_the_daemon_lives_and_answers_correctly(threaded: DaemonServer) -> None:
    rng = random.Random(20261206)
    bodies = _valid_bodies()
    sent = answered = closed = 0
    for batch in range(FRAMES // BATCH):
        for _ in range(BATCH):
            got = send(threaded.path, _mutated(rng, bodies))
            sent += 1
            reply = reply_of(got)  # a reply, when there is one, is one well-formed message
            if reply is None:
                closed += 1
                continue
            answered += 1
            assert reply["v"] == wire.PROTOCOL_VERSION and isinstance(reply["ok"], bool)
            assert reply["ok"] or isinstance(reply.get("error"), str)
        assert threaded.thread.is_alive(), f"the daemon's loop ended in batch {batch}"
        pong = client.request(threaded.path, {"op": wire.PING}, timeout=5.0)
        assert pong is not None and pong["ok"] is True and pong["pid"] == threaded.status()["pid"]
    assert sent == FRAMES and answered + closed == FRAMES
    assert answered > FRAMES // 2  # most frames were whole enough to be answered, not only dropped
