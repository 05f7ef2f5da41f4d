"""The tuning store under attack, load and damage: another local user's folder, file, symlink or planted rows are
refused (or read, never written, where shared on purpose); eight writing processes lose and refuse nothing; a
store with damaged pages is moved aside and rebuilt; a record whose text cannot be stored is dropped alone.

"Another user" is uid 65534 (nobody) where the test runs as root, else the same checks on modes, owners and
symlinks in tmp_path.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from selector import tuning_store
from selector.cli import main
from selector.tuning import Fingerprints
from selector.tuning_store import TuningStore, TuningStoreWarning

FP = "c" * 32
NOBODY = 65534
as_root = pytest.mark.skipif(os.getuid() != 0, reason="acting as another user needs root")


def _record(**changes: Any) -> dict[str, Any]:
    r = {"fingerprint": FP, "gpu": "NVIDIA H200", "problem": "E8-H16-I8-k2/bfloat16/dense/silu/gated", "mode": "eager",
         "tokens": 4, "backend": "grouped_mm", "time_s": 1e-4}
    r.update(changes)
    return r


def _made(folder: Path, mode: int = 0o700) -> TuningStore:
    """A store with one record in `folder` (made when missing), then the folder set to `mode`."""
    folder.mkdir(mode=0o700, exist_ok=True)
    store = TuningStore(folder / "tuning.sqlite3")
    assert store.put([_record()]).stored == 1
    os.chmod(folder, mode)
    return store


# --- modes, owners, symlinks ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("folder_mode", "file_mode", "reason"), [
    (0o775, 0o600, "has mode 0775: group or others may write it"),
    (0o757, 0o600, "has mode 0757: group or others may write it"),
    (0o700, 0o666, "has mode 0666: group or others may write it"),
    (0o700, 0o620, "has mode 0620: group or others may write it"),
])  # fmt: skip
def test_a_store_others_may_write_is_refused_with_the_reason(tmp_path: Path, folder_mode: int, file_mode: int,
                                                             reason: str) -> None:
    folder = tmp_path / "shared"
    _made(folder)
    os.chmod(folder / "tuning.sqlite3", file_mode)
    os.chmod(folder, folder_mode)
    store = TuningStore(folder / "tuning.sqlite3")
    with pytest.warns(TuningStoreWarning, match=f"{reason}; refusing it .*SELECTOR_TUNING_STORE_READ_ONLY=1"):
        assert store.records() == []  # planted rows never reach a ranking
    result = store.put([_record(tokens=8)])
    assert result.stored == 0 and reason in result.refused[0]
    assert store.access()[0] == "refused"


def test_a_store_shared_on_purpose_is_read_never_written_and_says_so(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    folder = tmp_path / "team"
    _made(folder, 0o775)
    for store in (TuningStore(folder / "tuning.sqlite3", read_only=True), None):
        if store is None:  # the documented setting does the same
            monkeypatch.setenv("SELECTOR_TUNING_STORE_READ_ONLY", "1")
            store = TuningStore(folder / "tuning.sqlite3")
        with pytest.warns(TuningStoreWarning, match="opened read-only, shared on purpose: .*mode 0775"):
            assert store.records() == [_record()]
        result = store.put([_record(tokens=8)])
        assert result.stored == 0 and "opened read-only" in result.refused[0]
        access, why = store.access()
        assert access == "read-only" and why is not None and "0775" in why
        assert store.summary(FP).read_only and store.summary(FP).current == 1
    with pytest.warns(TuningStoreWarning, match="opened read-only"):
        assert len(TuningStore(folder / "tuning.sqlite3", read_only=True).records()) == 1  # nothing was added


def test_a_symlinked_folder_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real"
    _made(real)
    (tmp_path / "link").symlink_to(real)
    store = TuningStore(tmp_path / "link" / "tuning.sqlite3")
    with pytest.warns(TuningStoreWarning, match="link is a symlink; refusing it"):
        assert store.records() == []
    assert store.put([_record(tokens=8)]).stored == 0
    assert len(TuningStore(real / "tuning.sqlite3").records()) == 1


@pytest.mark.parametrize("side", ["-wal", "-shm"])
def test_a_symlinked_wal_or_shm_is_refused(tmp_path: Path, side: str) -> None:
    store = _made(tmp_path / "s")
    target = tmp_path / "elsewhere"
    for suffix in ("-wal", "-shm"):
        Path(f"{store.path}{suffix}").unlink(missing_ok=True)
    Path(f"{store.path}{side}").symlink_to(target)
    fresh = TuningStore(store.path)
    with pytest.warns(TuningStoreWarning, match=f"tuning.sqlite3{side} is a symlink; refusing the store"):
        assert fresh.put([_record(tokens=8)]).stored == 0
    assert not target.exists()


def test_a_symlinked_locks_folder_is_not_followed(tmp_path: Path) -> None:
    folder = tmp_path / "s"
    store = _made(folder)
    shutil.rmtree(folder / "locks")
    target = tmp_path / "attacker-chosen"
    target.mkdir()
    (folder / "locks").symlink_to(target)
    fresh = TuningStore(store.path)
    with pytest.warns(TuningStoreWarning, match="cannot make the lock 'gpu-0' .*symlink"):
        with fresh.measurement_lock("gpu-0", timeout_s=0) as got:
            assert not got
    assert list(target.iterdir()) == []  # nothing was created through the link


def test_a_folder_above_that_others_may_write_is_refused(tmp_path: Path) -> None:
    above = tmp_path / "open"
    above.mkdir()
    (above / "mine").mkdir(mode=0o700)
    os.chmod(above, 0o777)  # not sticky: anyone may rename "mine" and put another folder in its place
    store = TuningStore(above / "mine" / "tuning.sqlite3")
    with pytest.warns(TuningStoreWarning, match="open above the store has mode 0777: group or others may rename"):
        assert store.put([_record()]).stored == 0
    os.chmod(above, 0o1777)  # sticky, like /tmp: only the owner may rename what it holds
    assert TuningStore(store.path).put([_record()]).stored == 1


def test_another_users_folder_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = _made(tmp_path / "s")
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)  # the folder and file are now someone else's
    with pytest.warns(TuningStoreWarning, match="belongs to another user"):
        assert TuningStore(store.path).records() == []


# --- another user, for real (root only) ------------------------------------------------------------------------


@pytest.fixture
def public_tmp() -> Iterator[Path]:
    """A folder outside pytest's (closed) temp root that uid 65534 can reach."""
    folder = Path(tempfile.mkdtemp())
    os.chmod(folder, 0o711)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _nobody_python() -> str:
    for candidate in (os.path.realpath(sys.executable), shutil.which("python3"), "/usr/bin/python3"):
        try:
            ran = subprocess.run([candidate or "", "-I", "-c", "pass"], user=NOBODY, group=NOBODY, extra_groups=[],
                                 cwd="/", env={}, capture_output=True, timeout=30)
        except OSError:
            continue
        if ran.returncode == 0:
            return candidate or ""
    pytest.skip("no Python that uid 65534 can run")


SWAPPER = r"""
import os, sys, time
folder, target, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
name = os.path.join(folder, "tuning.sqlite3")
print("ready", flush=True)
end = time.monotonic() + seconds
while time.monotonic() < end:  # the name is a plain file, then a symlink to where the attacker wants a write
    for make in (lambda: open(name, "w").close(), lambda: os.symlink(target, name)):
        try:
            os.unlink(name)
        except OSError:
            pass
        try:
            make()
        except OSError:
            pass
"""


@as_root
@pytest.mark.parametrize("folder_mode", [0o755, 0o1777, 0o777])
def test_a_store_in_another_users_folder_is_never_written_through_a_swapped_name(public_tmp: Path,
                                                                                  folder_mode: int) -> None:
    """The race that made root write an SQLite file at an attacker-chosen path: the attacker owns the store's
    folder and swaps the file for a symlink while the store checks and opens it."""
    python = _nobody_python()
    folder = public_tmp / "shared"
    folder.mkdir()
    os.chown(folder, NOBODY, NOBODY)
    os.chmod(folder, folder_mode)
    target = public_tmp / "root-writes-here"
    os.chmod(public_tmp, 0o777)  # the attacker may name a target beside the folder
    swapper = subprocess.Popen([python, "-I", "-c", SWAPPER, str(folder), str(target), "2"], user=NOBODY,
                               group=NOBODY, extra_groups=[], cwd="/", env={}, stdout=subprocess.PIPE, text=True)
    try:
        assert swapper.stdout is not None and swapper.stdout.readline().strip() == "ready"
        store = TuningStore(folder / "tuning.sqlite3", timeout_s=0.5)
        stored = 0
        with pytest.warns(TuningStoreWarning, match="belongs to another user"):
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                stored += store.put([_record()]).stored
                assert store.records() == []
    finally:
        swapper.kill()
        swapper.wait(10)
        os.chmod(public_tmp, 0o711)
    assert stored == 0
    assert not target.exists()  # no file made at the attacker's path
    assert not any(p.name.startswith("tuning.sqlite3-") for p in folder.iterdir())  # no -wal / -shm of ours there


PLANTER = r"""
import sqlite3, sys
conn = sqlite3.connect(sys.argv[1])
conn.execute("INSERT OR REPLACE INTO records VALUES (?, ?, ?, ?, ?, ?, ?, ?)", tuple(__import__("json").loads(sys.argv[2])))
conn.commit()
print("planted", flush=True)
"""


@as_root
def test_rows_planted_by_another_user_in_a_store_they_may_write_are_not_read(public_tmp: Path) -> None:
    python = _nobody_python()
    folder = public_tmp / "s"
    store = _made(folder, 0o777)  # opened up by mistake: the attacker can write the folder and the file
    os.chmod(store.path, 0o666)
    for suffix in ("-wal", "-shm"):
        if Path(f"{store.path}{suffix}").exists():
            os.chmod(f"{store.path}{suffix}", 0o666)
    fake = _record(backend="eager", time_s=1e-9)
    row = [*(fake[c] for c in tuning_store.KEY_COLUMNS), json.dumps(fake), time.time()]
    planted = subprocess.run([python, "-I", "-c", PLANTER, str(store.path), json.dumps(row)], user=NOBODY,
                             group=NOBODY, extra_groups=[], cwd="/", env={}, capture_output=True, text=True, timeout=30)
    assert "planted" in planted.stdout, planted.stderr
    with pytest.warns(TuningStoreWarning, match="group or others may write it; refusing it"):
        assert TuningStore(store.path).records() == []  # the planted time never reaches auto's ranking


# --- load ------------------------------------------------------------------------------------------------------


def _writer(path: str, worker: int, count: int, barrier: Any, results: Any) -> None:
    store = TuningStore(Path(path))
    barrier.wait()
    latencies, refused = [], 0
    for i in range(count):  # one put per record: as many chances to collide as there are records
        start = time.perf_counter()
        result = store.put([_record(tokens=i + 1, backend=f"worker{worker}")])
        latencies.append(time.perf_counter() - start)
        refused += len(result.refused) + (1 - result.stored)
    results.put((worker, refused, latencies))


@pytest.mark.slow
def test_eight_writers_of_500_puts_lose_and_refuse_nothing_and_wait_little(tmp_path: Path) -> None:
    path, writers, puts = tmp_path / "tuning.sqlite3", 8, 500
    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(writers), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(path), n, puts, barrier, results)) for n in range(writers)]
    for p in procs:
        p.start()
    got = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert [p.exitcode for p in procs] == [0] * writers
    latencies = sorted(t for _, _, ts in got for t in ts)
    refused = sum(r for _, r, _ in got)
    records = TuningStore(path).records()
    lost = writers * puts - len(records)
    p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]
    print(f"\n{writers} writers x {puts} puts: lost {lost}, refused {refused}, put p50 {p50 * 1e3:.1f} ms, "
          f"p99 {p99 * 1e3:.1f} ms, max {latencies[-1] * 1e3:.1f} ms")
    assert (lost, refused) == (0, 0)
    assert {(r["backend"], r["tokens"]) for r in records} == {
        (f"worker{n}", t) for n in range(writers) for t in range(1, puts + 1)}
    assert p99 < 0.1


# --- damage ----------------------------------------------------------------------------------------------------


def test_a_store_with_damaged_pages_is_moved_aside_and_rebuilt(tmp_path: Path) -> None:
    path = tmp_path / "tuning.sqlite3"
    store = TuningStore(path)
    assert store.put([_record(tokens=t, tool="x" * 200) for t in range(1, 400)]).stored == 399
    del store
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # every page in the file itself
    page_size, pages = (conn.execute(f"PRAGMA {p}").fetchone()[0] for p in ("page_size", "page_count"))
    conn.close()
    assert pages > 8
    with open(path, "r+b") as f:  # a few pages in the middle overwritten, as a bad disk or a torn copy leaves them
        f.seek(page_size * (pages // 2))
        f.write(b"\xa5" * page_size * 2)
    damaged = path.read_bytes()
    fresh = TuningStore(path)
    with pytest.warns(TuningStoreWarning, match="was damaged \\(.*moved it to .*tuning.sqlite3.corrupt-"):
        assert fresh.records() == []
    (aside,) = tmp_path.glob("tuning.sqlite3.corrupt-*[0-9]")
    assert aside.read_bytes() == damaged  # kept for a look
    assert fresh.put([_record()]).stored == 1 and fresh.records() == [_record()]  # and the store works again
    assert TuningStore(path).records() == [_record()]


# --- bad text --------------------------------------------------------------------------------------------------


def test_a_lone_surrogate_key_is_dropped_alone(tmp_path: Path) -> None:
    store = TuningStore(tmp_path / "tuning.sqlite3")
    good = [_record(tokens=t) for t in (1, 2, 4, 8)]
    with pytest.warns(TuningStoreWarning, match="1 tuning record\\(s\\) refused: text that is not valid Unicode"):
        result = store.put([*good[:2], _record(gpu="NVIDIA \ud800", tokens=16), *good[2:]])
    assert result.stored == 4 and result.refused == ["text that is not valid Unicode (a lone surrogate)"]
    assert sorted(r["tokens"] for r in store.records()) == [1, 2, 4, 8]


def test_cli_import_of_a_file_with_a_lone_surrogate_stores_the_good_records(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "node" / "tuning.sqlite3"
    monkeypatch.setenv("SELECTOR_TUNING_STORE", str(path))
    monkeypatch.setattr(tuning_store, "current_fingerprints",
                        lambda *a: Fingerprints({"grouped_mm": FP}))
    file = tmp_path / "export.json"
    records = [_record(tokens=t) for t in (1, 2, 4, 8, 16)]
    records[2]["backend"] = "grouped\ud800mm"  # JSON writes it as \ud800: valid JSON, invalid text
    file.write_text(json.dumps({"schema": "selector.tuning/2", "records": records}))
    assert main(["store", "import", str(file)]) == 0
    out = capsys.readouterr().out
    assert "stored 4, refused 1" in out and "lone surrogate" in out
    assert sorted(r["tokens"] for r in TuningStore(path).records()) == [1, 2, 8, 16]


def test_show_and_doctor_say_how_the_store_is_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "team"
    _made(folder, 0o775)
    monkeypatch.setenv("SELECTOR_TUNING_STORE", str(folder / "tuning.sqlite3"))
    monkeypatch.setattr(tuning_store, "current_fingerprints", lambda *a: Fingerprints({"grouped_mm": FP}))
    monkeypatch.setattr(tuning_store, "_STORES", {})
    assert "not used: the folder " in tuning_store.describe_sources()  # refused, and the doctor's line says why
    with pytest.warns(TuningStoreWarning, match="refusing it"):
        assert main(["store", "show"]) == 1
    assert "not usable:  " in capsys.readouterr().out
    monkeypatch.setenv("SELECTOR_TUNING_STORE_READ_ONLY", "1")
    monkeypatch.setattr(tuning_store, "_STORES", {})
    assert "read-only, shared on purpose: the folder " in tuning_store.describe_sources()
    with pytest.warns(TuningStoreWarning, match="opened read-only"):
        assert main(["store", "show"]) == 0
    out = capsys.readouterr().out
    assert "read-only:   the folder " in out and "mode 0775" in out and "1 current" in out
