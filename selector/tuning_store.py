"""The tuning store: one SQLite file per user (or per cluster, in a shared folder) holding measured times, and the
records this node knows gathered for the pure lookup in `selector.tuning`.

Sources, later ones overriding earlier: export files shipped in `selector/tuning_data/`, the store
(`$SELECTOR_TUNING_STORE`, else `tuning.sqlite3` in the user's cache folder), then what other processes shared
through the node daemon.

The store never stops a model from loading: a damaged file (damaged pages too: `PRAGMA quick_check` at a
process's first open) is moved aside and rebuilt empty, a location that cannot be used reads as empty and refuses
writes, each with a warning. Several processes of one node may write at once: every put is one transaction, the
writers take turns on `<folder>/locks/store-write.lock` (waiting up to `SELECTOR_TUNING_STORE_TIMEOUT`), and the
file is in WAL mode (which needs every writer on one host). Nothing another local user controls is trusted: see
`TuningStore`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import sqlite3
import stat
import tempfile
import threading
import time
import urllib.parse
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from selector import settings, tuning
from selector.daemon.client import shared_tuning_records
from selector.probes import Environment, normalize_package_name
from selector.tuning import Fingerprints, Measurement, TuningTable, as_fingerprints
from selector.types import Problem

if TYPE_CHECKING:
    from selector.registry import Registry

__all__ = [
    "DATA_DIR",
    "SCHEMA",
    "STORE_VERSION",
    "PutResult",
    "ProblemSummary",
    "StoreSummary",
    "TuningStore",
    "TuningStoreWarning",
    "current_fingerprints",
    "default_store",
    "known_records",
    "measured_for",
    "measurement_lock",
    "read_export",
    "reload",
    "save_records",
    "store_path",
    "tuning_table",
    "write_export",
]

DATA_DIR = Path(__file__).parent / "tuning_data"
SCHEMA = tuning.SCHEMA  # of export files
STORE_VERSION = 1  # of the store's table layout; another version is moved aside, never migrated in place
STORE_FILE = "tuning.sqlite3"
KEY_COLUMNS = ("fingerprint", "gpu", "problem", "mode", "tokens", "backend")
_COLUMNS = frozenset({*KEY_COLUMNS, "record", "stored_at"})
_TABLES = frozenset({"meta", "records"})
_CREATE = (
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE records (fingerprint TEXT NOT NULL, gpu TEXT NOT NULL, problem TEXT NOT NULL, mode TEXT NOT NULL, "
    "tokens INTEGER NOT NULL, backend TEXT NOT NULL, record TEXT NOT NULL, stored_at REAL NOT NULL, "
    "PRIMARY KEY (fingerprint, gpu, problem, mode, tokens, backend))",
)
_INSERT = (
    "INSERT OR REPLACE INTO records (fingerprint, gpu, problem, mode, tokens, backend, record, stored_at) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
)
_LOCK_POLL_S = 0.02
_ATTEMPTS = 5  # opens of a store that other processes of this user rebuild meanwhile
_WRITER_POLL_S = 0.002  # a write holds the store for about a millisecond: look again soon
_FIX = " (set SELECTOR_TUNING_STORE to a file you may write)"
WRITE_LOCK = "store-write"  # writers take turns on it
REPAIR_LOCK = "store-repair"  # one process moves a damaged store aside
STORE_LOCKS = frozenset({WRITE_LOCK, REPAIR_LOCK})  # the store's own, in locks/ beside the measurement locks
T = TypeVar("T")


class TuningStoreWarning(UserWarning):
    """A tuning record or store selector could not use; it carries on without it."""


class _Corrupt(Exception):
    """The store file is not a store of this version (the message says what it is instead)."""


class _Changed(Exception):
    """The name held another file when SQLite opened it than when it was checked (another process of this user
    rebuilt the store meanwhile: no one else may change a name in the folder): check and open again."""


class _Unusable(Exception):
    """The store's location cannot be used (the message says why and what to do)."""


@dataclass
class PutResult:
    """What a write kept: how many records were stored, and why each refused one was refused."""

    stored: int = 0
    refused: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class ProblemSummary:
    """The records of one problem in one mode on one GPU (current fingerprint)."""

    gpu: str
    problem: str
    mode: str
    tokens: tuple[int, ...]
    backends: tuple[str, ...]
    records: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "gpu": self.gpu,
            "problem": self.problem,
            "mode": self.mode,
            "tokens": list(self.tokens),
            "backends": list(self.backends),
            "records": self.records,
        }


@dataclass(frozen=True)
class StoreSummary:
    """What a store holds seen from this process's fingerprints: records it trusts (current), records of its
    backends measured under other facts (stale), and records of backends not loaded here (other)."""

    path: Path
    fingerprints: Fingerprints
    current: int
    stale: int
    by_fingerprint: dict[str, int]
    problems: tuple[ProblemSummary, ...]
    problem: str | None = None  # why the store cannot be used, None when it can
    other: int = 0
    stale_by_backend: dict[str, int] = field(default_factory=dict)
    read_only: bool = False  # shared on purpose: read, never written

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "fingerprints": self.fingerprints.to_dict(),
            "usable": self.problem is None,
            "read_only": self.read_only,
            "problem": self.problem,
            "current": self.current,
            "stale": self.stale,
            "other": self.other,
            "stale_by_backend": dict(self.stale_by_backend),
            "by_fingerprint": dict(self.by_fingerprint),
            "problems": [p.to_dict() for p in self.problems],
        }


def _warn(message: str) -> None:
    warnings.warn(message, TuningStoreWarning, stacklevel=3)


def clean_records(records: Iterable[Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """The valid records of `records` with only the known fields, and why each other one was refused (each
    refusal also warned)."""
    kept: list[dict[str, Any]] = []
    refused: list[str] = []
    for r in records:
        reason = tuning.check_record(r)
        if reason is None:
            kept.append(tuning.clean_record(r))
        else:
            refused.append(reason)
            _warn(f"tuning record refused: {reason}")
    return kept, refused


def read_export(path: Path) -> list[dict[str, Any]]:
    """The records of an export file, unchecked; ValueError naming the file when it is missing, not JSON or not
    of schema selector.tuning/2."""
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it ({exc.strerror if isinstance(exc, OSError) else exc})") from None
    except ValueError as exc:
        raise ValueError(f"{path}: not JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA or not isinstance(data.get("records"), list):
        found = data.get("schema") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"{path}: not a tuning export (expected schema {SCHEMA!r} with a records list, "
                         f"found {found!r})")
    return list(data["records"])


def write_export(path: Path, records: Iterable[Mapping[str, Any]]) -> int:
    """Write `records` (the valid ones) as an export file at `path`, atomically: a reader sees the old file or the
    whole new one. How many were written; OSError when the folder cannot take the file."""
    kept, _ = clean_records(records)
    path = Path(path)
    text = json.dumps({"schema": SCHEMA, "records": kept}, indent=1) + "\n"
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(temp, 0o644)  # an export is meant to be shipped and read by others
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return len(kept)


def _sanitised(name: str) -> str:
    clean = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:100].lstrip(".")
    return clean or "_"


class TuningStore:
    """Tuning records in one SQLite file, one row per `tuning.record_key` (a later record replaces an earlier one).

    Every method runs its own transaction (on a connection each thread keeps while the file stays the same), so
    a store may be used from several threads and processes (and across fork) at once. Nothing raises for a bad file or location: it warns once and reads as
    empty; a damaged file is moved aside to `<name>.corrupt-<unix time>` and the store rebuilt empty.

    Nothing another local user controls is trusted: the folder must be this user's and closed to writes by group
    and others, its ancestors root's or this user's (or sticky, like /tmp), and nothing from the folder down (the
    folder, `locks/`, the file, its -wal and -shm) may be a symlink. A store shared on purpose (`read_only`, or
    SELECTOR_TUNING_STORE_READ_ONLY) skips the owner and mode checks, says so, and is never written.
    """

    def __init__(self, path: Path, timeout_s: float | None = None, read_only: bool | None = None) -> None:
        self.path = Path(path)
        self._timeout_s = timeout_s
        self._read_only = read_only
        self._warned = False
        self._checked: tuple[int, int, int] | None = None  # (pid, st_dev, st_ino) of the file quick_check passed
        self._local = threading.local()  # each thread's kept connection

    @property
    def timeout_s(self) -> float:
        """How long a write waits for other writers (seconds): the constructor's, else the setting's now."""
        return settings.get("SELECTOR_TUNING_STORE_TIMEOUT") if self._timeout_s is None else float(self._timeout_s)

    @property
    def read_only(self) -> bool:
        """Whether this store is only read (shared on purpose): the constructor's, else the setting's now."""
        return settings.get("SELECTOR_TUNING_STORE_READ_ONLY") if self._read_only is None else bool(self._read_only)

    def __repr__(self) -> str:
        return f"TuningStore({str(self.path)!r})"

    # --- public ----------------------------------------------------------------------------------------------

    def put(self, records: Iterable[Mapping[str, Any]]) -> PutResult:
        """Store the valid ones of `records` in one transaction; an invalid one is refused with a warning naming
        why (one by one: the others are stored), and every one is refused (with a warning, once) when the store
        cannot be written."""
        kept, refused = clean_records(records)
        now = time.time()
        rows = []
        unencodable = 0
        for r in kept:
            try:  # SQLite takes UTF-8 only: a lone surrogate would abort the whole batch inside executemany
                json.dumps(r, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError:
                unencodable += 1
                refused.append("text that is not valid Unicode (a lone surrogate)")
                continue
            rows.append((*(r[c] for c in KEY_COLUMNS), json.dumps(r, sort_keys=True), now))
        if unencodable:
            _warn(f"{unencodable} tuning record(s) refused: text that is not valid Unicode (a lone surrogate)")
        if not rows:
            return PutResult(0, refused)
        try:
            self._run(True, lambda conn: conn.executemany(_INSERT, rows))
        except _Unusable as exc:
            return PutResult(0, refused + [f"not stored: {exc}"] * len(rows))
        return PutResult(len(rows), refused)

    def records(self, fingerprint: str | Sequence[str] | None = None) -> list[dict[str, Any]]:
        """The stored records (of `fingerprint` alone, or of any of a list of them, when given), oldest write
        first; none when the store is missing or cannot be read."""
        query, args = "SELECT record FROM records", tuple[str, ...]()
        if fingerprint is not None:
            wanted = (fingerprint,) if isinstance(fingerprint, str) else tuple(fingerprint)
            query, args = query + f" WHERE fingerprint IN ({', '.join('?' * len(wanted))})", wanted
        try:
            rows = self._run(False, lambda conn: conn.execute(query + " ORDER BY rowid", args).fetchall(), [])
        except _Unusable:
            return []
        out = []
        for (text,) in rows:
            try:
                r = json.loads(text)
            except ValueError:
                continue
            if tuning.check_record(r) is None:  # a row edited by hand is skipped like a malformed one
                out.append(r)
        return out

    def summary(self, fingerprints: Fingerprints | str) -> StoreSummary:
        """What the store holds seen from `fingerprints` (a plain string: one for every backend): the trusted
        records per problem, and counts per fingerprint."""
        fps = as_fingerprints(fingerprints)
        problem = None
        try:
            rows = self._run(False, lambda conn: conn.execute(
                "SELECT fingerprint, gpu, problem, mode, tokens, backend FROM records").fetchall(), [])
        except _Unusable as exc:
            rows, problem = [], str(exc)
        counts: dict[str, int] = {}
        stale: dict[str, int] = {}
        other = 0
        groups: dict[tuple[str, str, str], list[tuple[int, str]]] = {}
        for fp, gpu, prob, mode, tokens, backend in rows:
            counts[fp] = counts.get(fp, 0) + 1
            if fps.trusts(backend, fp):
                groups.setdefault((gpu, prob, mode), []).append((int(tokens), backend))
            elif fps.knows(backend):
                stale[backend] = stale.get(backend, 0) + 1
            else:
                other += 1
        problems = tuple(
            ProblemSummary(
                gpu, prob, mode, tuple(sorted({t for t, _ in rows_})), tuple(sorted({b for _, b in rows_})), len(rows_)
            )
            for (gpu, prob, mode), rows_ in sorted(groups.items())
        )
        return StoreSummary(self.path, fps, sum(p.records for p in problems), sum(stale.values()),
                            dict(sorted(counts.items())), problems, problem, other, dict(sorted(stale.items())),
                            self.read_only)

    def export(self, path: Path, fingerprint: Fingerprints | str | None = None) -> int:
        """Write the records (those `fingerprint` trusts, when given; a plain string: one fingerprint for every
        backend) to an export file; how many."""
        records = self.records()
        if fingerprint is not None:
            fps = as_fingerprints(fingerprint)
            records = [r for r in records if fps.trusts(r["backend"], r["fingerprint"])]
        return write_export(path, records)

    def import_file(self, path: Path) -> PutResult:
        """Store the records of an export file (ValueError when the file is not one)."""
        return self.put(read_export(path))

    def clear(self, fingerprint: str | None = None) -> int:
        """Delete every record (of `fingerprint` alone when given); how many went."""
        return self._delete("" if fingerprint is None else " WHERE fingerprint = ?",
                            () if fingerprint is None else (fingerprint,))

    def clear_stale(self, fingerprints: Fingerprints | str) -> int:
        """Delete the stale records: of a backend known to `fingerprints` (a plain string: one for every
        backend) under a fingerprint it does not trust. Records of backends not loaded here stay. How many went."""
        fps = as_fingerprints(fingerprints)

        def body(conn: sqlite3.Connection) -> int:
            rows = conn.execute("SELECT rowid, backend, fingerprint FROM records").fetchall()
            gone = [(rowid,) for rowid, backend, fp in rows if fps.is_stale(backend, fp)]
            conn.executemany("DELETE FROM records WHERE rowid = ?", gone)
            return len(gone)

        try:
            return self._run(True, body)
        except _Unusable:
            return 0

    def migrate(self, fingerprints: Fingerprints) -> int:
        """Rewrite the records of the older format proven current (they carry `fingerprints.legacy`: measured
        here with these very plugins) to their backend's fingerprint, so a later plugin change stales only that
        plugin's. A record of the same key already under the new fingerprint is newer and stays. How many were
        rewritten; nothing is written when there is nothing to rewrite."""
        legacy = fingerprints.legacy
        if legacy is None or self.read_only or not self.records(legacy):  # a read: most stores have nothing to do
            return 0

        def body(conn: sqlite3.Connection) -> int:
            rows = conn.execute("SELECT rowid, backend, record, stored_at FROM records WHERE fingerprint = ?",
                                (legacy,)).fetchall()
            moved = 0
            for rowid, backend, text, stored_at in rows:
                new = fingerprints.by_backend.get(backend)
                if new is None:
                    continue  # a backend not loaded here: its record stays as it is (stale once plugins change)
                conn.execute("DELETE FROM records WHERE rowid = ?", (rowid,))
                r = {**json.loads(text), "fingerprint": new}
                conn.execute(_INSERT.replace("OR REPLACE", "OR IGNORE"),
                             (*(r[c] for c in KEY_COLUMNS), json.dumps(r, sort_keys=True), stored_at))
                moved += 1
            return moved

        try:
            return self._run(True, body)
        except (_Unusable, ValueError, KeyError):  # a row edited by hand: left as it is
            return 0

    def unmeasured(self, fingerprints: Fingerprints | str, gpu: str, problem: str, mode: str, tokens: int,
                   backends: Sequence[str]) -> list[str]:
        """The backends of `backends` without a trusted stored time (under `fingerprints`; a plain string: one
        for every backend) for this problem, mode and token count (all of them when the store cannot be read):
        what a tuner still has to measure."""
        fps = as_fingerprints(fingerprints)
        try:
            rows = self._run(False, lambda conn: conn.execute(
                "SELECT backend, fingerprint FROM records WHERE gpu = ? AND problem = ? AND mode = ? AND tokens = ?",
                (gpu, problem, mode, int(tokens))).fetchall(), [])
        except _Unusable:
            rows = []
        have = {b for b, fp in rows if fps.trusts(b, fp)}
        return [b for b in backends if b not in have]

    def is_measured(self, fingerprints: Fingerprints | str, gpu: str, problem: str, mode: str, tokens: int,
                    backends: Sequence[str]) -> bool:
        """Whether every backend of `backends` has a trusted stored time for this problem, mode and token count."""
        return not self.unmeasured(fingerprints, gpu, problem, mode, tokens, backends)

    def access(self) -> tuple[str, str | None]:
        """How this process may use the store, for reports: ("read-write" | "read-only" | "missing" | "refused",
        the reason for read-only and refused). Warns nothing."""
        try:
            where = self._locate(write=False, quiet=True)
        except _Unusable as exc:
            return "refused", str(exc)
        if where is None:
            return "missing", None
        where.close()
        if where.read_only:
            return "read-only", where.shared_reason or "opened read-only"
        return "read-write", None

    @contextlib.contextmanager
    def measurement_lock(self, name: str, timeout_s: float) -> Iterator[bool]:
        """Hold the exclusive lock `name` (e.g. `gpu-0`: one tuning job per GPU) shared by every process using
        this store's folder; yields whether it was got within `timeout_s` seconds (the body runs either way).
        The lock is `fcntl.flock` on `<folder>/locks/<name>.lock`, released when the body ends or the process dies."""
        fd = self._lock_file(name)
        if fd is None:
            yield False
            return
        try:
            got = _flock(fd, timeout_s, lambda exc: self._warn_once(
                f"cannot lock {name!r} in {self.path.parent / 'locks'}: {exc.strerror}"))
            yield got
        finally:
            os.close(fd)  # closing the only descriptor releases the lock

    # --- opening, checking, repairing ----------------------------------------------------------------------

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            _warn(message)

    def _locate(self, write: bool, quiet: bool = False) -> _Where | None:
        """The store's folder and file opened and checked (see the class doc), the file made (0600, its folder
        0700) when `write`; None when reading a store that does not exist yet; _Unusable saying why it may not
        be used. The folder is checked on its open descriptor (O_DIRECTORY | O_NOFOLLOW, fstat) and everything in it
        through that descriptor (never following a symlink), so what was checked is what SQLite is handed."""
        read_only = self.read_only
        if write and read_only:
            raise _Unusable(f"{self.path} is opened read-only (shared on purpose: SELECTOR_TUNING_STORE_READ_ONLY "
                            "or read_only=True); nothing is written to it")
        folder, name = self.path.parent, self.path.name
        if write and not os.path.lexists(folder):
            try:
                os.makedirs(folder, mode=0o700, exist_ok=True)
            except OSError as exc:
                raise _Unusable(f"cannot create the folder {folder}: {exc.strerror}{_FIX}") from None
        try:
            dirfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            if write:
                raise _Unusable(f"cannot open the folder {folder}: it went away{_FIX}") from None
            return None
        except OSError as exc:
            if exc.errno == errno.ELOOP or os.path.islink(folder):
                raise _Unusable(f"{folder} is a symlink; refusing it (point SELECTOR_TUNING_STORE at a file in the "
                                "real folder)") from None
            if exc.errno == errno.ENOTDIR and not write:
                raise _Unusable(f"cannot use {folder}: it is not a folder{_FIX}") from None
            raise _Unusable(f"cannot open the folder {folder}: {exc.strerror}{_FIX}") from None
        where = _Where(dirfd, name, folder)
        try:
            shared = [p for p in (_foreign(os.fstat(dirfd), folder, "folder"), _ancestors_problem(where.canonical))
                      if p is not None]
            if shared and not read_only:  # before anything is made or looked at in it
                raise _Unusable(_refusal(shared[0]))
            st = self._stat_file(where, write)
            if st is None:
                where.close()
                return None
            where.st = st
            if not stat.S_ISREG(st.st_mode):
                raise _Unusable(f"{self.path} is not a regular file")
            mine = _foreign(st, self.path, "file")
            if mine is not None:
                shared.append(mine)
            for suffix in ("-wal", "-shm"):
                try:
                    side = os.stat(name + suffix, dir_fd=dirfd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if stat.S_ISLNK(side.st_mode):
                    raise _Unusable(f"{self.path}{suffix} is a symlink; refusing the store")
                if not stat.S_ISREG(side.st_mode):
                    raise _Unusable(f"{self.path}{suffix} is not a regular file; refusing the store")
                problem = _foreign(side, Path(f"{self.path}{suffix}"), "file")
                if problem is not None:
                    shared.append(problem)
            if shared and not read_only:
                raise _Unusable(_refusal(shared[0]))
            where.read_only = read_only
            where.shared_reason = "; ".join(shared) if shared else None
            if shared and not quiet:
                self._warn_once(f"tuning store {self.path} opened read-only, shared on purpose: {where.shared_reason}")
            return where
        except BaseException:
            where.close()
            raise

    def _stat_file(self, where: _Where, write: bool) -> os.stat_result | None:
        """The store file's status, seen through the checked folder without following a symlink (made 0600 first
        when `write` and missing); None when reading a store not made yet. The file itself is never opened here:
        closing a descriptor of it would drop the POSIX locks this process's SQLite connections hold on it (and
        let another process checkpoint and delete the WAL under them)."""
        if write:
            try:
                os.close(os.open(where.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                 dir_fd=where.dirfd))  # a new file: no connection of ours holds it yet
            except FileExistsError:
                pass
            except OSError as exc:
                raise _Unusable(f"cannot create {self.path}: {exc.strerror}{_FIX}") from None
        try:
            st = os.stat(where.name, dir_fd=where.dirfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise _Unusable(f"cannot use {self.path}: {exc.strerror}{_FIX}") from None
        if stat.S_ISLNK(st.st_mode):
            raise _Unusable(f"{self.path} is a symlink; refusing it (point SELECTOR_TUNING_STORE at the real file)")
        return st

    def _connect(self, where: _Where) -> sqlite3.Connection:
        """A connection to the checked file. Python's sqlite3 takes a file name, not a descriptor, so SQLite is
        handed `/proc/self/fd/<folder fd>/<name>`: the folder it reaches is the one opened and checked, whatever
        its path names now. SQLite (3.40 here) resolves that link to the folder's real path and opens the file by
        name (and names its -wal and -shm from it), so the check and the open are one step because no other user
        can change a name on that path: the folder is ours and closed to their writes, its ancestors are root's
        or ours and closed (or sticky), and the file SQLite opened is then compared (device, inode) with the one
        checked. Not `/proc/self/fd/<file fd>`: SQLite would name its -wal and -shm beside the link (it cannot
        create them in /proc), and our own descriptor of the file, once closed, would drop the POSIX locks
        SQLite holds on it. A `file:` URI (used for a read-only open) is only another spelling of the path."""
        path = where.sqlite_path
        try:
            if where.read_only:
                conn = sqlite3.connect(f"file:{urllib.parse.quote(path)}?mode=ro", uri=True, timeout=self.timeout_s,
                                       isolation_level=None)
            else:
                conn = sqlite3.connect(path, timeout=self.timeout_s, isolation_level=None)
        except sqlite3.Error as exc:
            raise _Unusable(f"cannot open {self.path}: {exc}") from None
        try:
            files = [f for _, db, f in conn.execute("PRAGMA database_list") if db == "main"]
            st, opened = where.st, os.stat(files[0]) if files and files[0] else None
            if opened is None or (opened.st_dev, opened.st_ino) != (st.st_dev, st.st_ino):
                raise _Changed(f"{self.path} changed while it was opened")
            if not where.read_only:
                conn.execute("PRAGMA synchronous = NORMAL")  # in WAL mode a commit survives a crash of the process
        except sqlite3.OperationalError:
            conn.close()
            raise
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise _Corrupt(f"not a readable SQLite store ({exc})") from None
        except BaseException:
            conn.close()
            raise
        return conn

    def _connection(self, where: _Where) -> sqlite3.Connection:
        """This thread's connection to the checked file: kept from one transaction to the next while the name
        still holds the same file (a new one otherwise, and in a forked child), so that a write costs neither
        SQLite's recovery of the WAL at open nor its checkpoint at close."""
        st = where.st
        assert st is not None
        key = (os.getpid(), st.st_dev, st.st_ino, where.read_only)
        cached = getattr(self._local, "conn", None)
        if cached is not None:
            if cached[0] == key:
                if cached[1].in_transaction:  # left open by a body that failed: start clean
                    cached[1].rollback()
                return cached[1]
            self._drop_connection()
        conn = self._connect(where)
        self._local.conn = (key, conn)
        return conn

    def _drop_connection(self) -> None:
        cached = getattr(self._local, "conn", None)
        self._local.conn = self._local.layout = self._local.wal = None
        if cached is not None and cached[0][0] == os.getpid():  # a forked child never closes its parent's
            with contextlib.suppress(sqlite3.Error):
                cached[1].close()

    def _begin(self, conn: sqlite3.Connection, write: bool, where: _Where | None = None) -> bool:
        """Open a transaction and check the layout (and, once per process and file, `PRAGMA quick_check`): True
        for a store of this version, False for an empty file; _Corrupt for anything else. An operational failure
        (locked, I/O) is no damage: it propagates as sqlite3.OperationalError."""
        try:
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
            cookie = conn.execute("PRAGMA schema_version").fetchone()[0]  # changes with any change of the layout
            if getattr(self._local, "layout", None) == (id(conn), cookie) and where is not None:
                return True  # this connection checked this very layout before (and quick_check ran on the file)
            tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            if not tables:
                return False
            if tables != _TABLES:
                raise _Corrupt(f"a SQLite file with other tables ({', '.join(sorted(tables))})")
            version = conn.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
            if version is None or version[0] != str(STORE_VERSION):
                raise _Corrupt(f"store version {version[0] if version else 'missing'}, expected {STORE_VERSION}")
            columns = {row[1] for row in conn.execute("PRAGMA table_info(records)")}
            if columns != _COLUMNS:
                raise _Corrupt(f"a records table with columns {', '.join(sorted(columns))}")
            key = None
            if where is not None and where.st is not None:
                st = where.st
                key = (os.getpid(), st.st_dev, st.st_ino)
            if where is None or key != self._checked:
                found = [row[0] for row in conn.execute("PRAGMA quick_check(5)")]
                if found != ["ok"]:
                    raise _Corrupt(f"damaged pages: {'; '.join(map(str, found))}")
                if key is not None:
                    self._checked = key
            self._local.layout = (id(conn), cookie)
        except sqlite3.OperationalError:
            raise
        except sqlite3.DatabaseError as exc:  # "file is not a database", "database disk image is malformed"
            raise _Corrupt(f"not a readable SQLite store ({exc})") from None
        return True

    def _run(self, write: bool, body: Callable[[sqlite3.Connection], T], empty: Any = None) -> T:
        """`body(conn)` inside one transaction on the checked store (`empty` for a read of a store not made yet);
        _Unusable (warned once) when the location cannot serve it. Writers take turns on `locks/store-write.lock`
        (waiting up to timeout_s), so SQLite's own sleeping retry loop is seldom met. A store found damaged (at
        open or by the body) is moved aside and rebuilt, and the body runs once more on the rebuilt one."""
        try:
            repaired = False
            for attempt in range(_ATTEMPTS):
                where = self._locate(write)
                if where is None:
                    return empty
                turn = None
                try:
                    if write:
                        turn = self._writer_turn()
                    conn = self._connection(where)
                    try:
                        ready = self._begin(conn, write, where)
                        if not ready:
                            if not write:  # made by another process that has not set it up yet: empty
                                conn.rollback()
                                return empty
                            for statement in _CREATE:
                                conn.execute(statement)
                            conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(STORE_VERSION),))
                        try:
                            result = body(conn)
                        except sqlite3.OperationalError:
                            raise
                        except sqlite3.DatabaseError as exc:
                            if type(exc) is not sqlite3.DatabaseError:  # integrity, programming: no damage
                                raise
                            raise _Corrupt(f"not a readable SQLite store ({exc})") from None
                        conn.commit()
                        if write and getattr(self._local, "wal", None) != id(conn):
                            # set on a file just proven a store (never on a foreign one), and kept in the file:
                            # readers then never wait for the writer, and a commit needs no journal file
                            if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                                conn.execute("PRAGMA journal_mode = WAL")
                            self._local.wal = id(conn)
                        return result
                    except BaseException:
                        self._drop_connection()
                        raise
                except _Corrupt as exc:
                    self._checked = None
                    if where.read_only:
                        raise _Unusable(f"{self.path} is damaged ({exc}); read-only here, so not rebuilt") from None
                    if repaired:
                        raise _Unusable(f"{self.path} is still damaged after rebuilding it ({exc})") from None
                    if turn is not None:
                        os.close(turn)
                        turn = None
                    self._repair(str(exc), where)
                    repaired = True
                except _Changed as exc:
                    if attempt == _ATTEMPTS - 1:
                        raise _Unusable(f"{exc}, again and again; refusing it") from None
                finally:
                    if turn is not None:
                        os.close(turn)
                    where.close()
            raise _Unusable(f"{self.path} was rebuilt by others while this process opened it; try again")
        except sqlite3.Error as exc:
            reason = f"{self.path}: {exc}"
            if "readonly" in str(exc) or "unable to open" in str(exc):
                reason += " (check the permissions of the file and its folder, or set SELECTOR_TUNING_STORE)"
            self._warn_once(f"tuning store not used: {reason}")
            raise _Unusable(reason) from None
        except OSError as exc:  # a lock the filesystem refuses, a folder that went away
            reason = f"{self.path}: {exc.strerror or exc}"
            self._warn_once(f"tuning store not used: {reason}")
            raise _Unusable(reason) from None
        except _Unusable as exc:
            self._warn_once(f"tuning store not used: {exc}")
            raise

    def _writer_turn(self) -> int | None:
        """Wait (up to timeout_s) for this process's turn to write: the lock `store-write`; its descriptor (closing
        it ends the turn), None where locks cannot be had (SQLite's busy timeout then orders the writers)."""
        fd = self._lock_file(WRITE_LOCK)
        if fd is None:
            return None
        if _flock_blocking(fd, self.timeout_s):
            return fd
        os.close(fd)
        raise _Unusable(f"{self.path}: other writers held it for {self.timeout_s:g} s (SELECTOR_TUNING_STORE_TIMEOUT)")

    def _repair(self, what: str, where: _Where | None = None) -> None:
        """Move a damaged store aside and leave an empty one, under a lock so that two processes finding the same
        damage move it once (the second finds the rebuilt store and keeps it)."""
        self._drop_connection()
        fd = self._lock_file(REPAIR_LOCK)
        turn: int | None = None
        own = where is None
        try:
            if fd is not None:
                with contextlib.suppress(OSError):  # a filesystem without flock: repair unguarded, as one process would
                    fcntl.flock(fd, fcntl.LOCK_EX)
            turn = self._lock_file(WRITE_LOCK)  # no writer inside the file while it is moved
            if turn is not None:
                _flock(turn, self.timeout_s, lambda exc: None, _WRITER_POLL_S)
            fresh = self._locate(write=True)  # what the name holds now, under the lock
            assert fresh is not None
            if own:
                where = fresh
            else:
                where.close()
                where = fresh
            try:
                conn = self._connect(where)
                try:
                    self._checked = None
                    self._begin(conn, write=False, where=where)
                    return  # another process rebuilt it meanwhile
                finally:
                    conn.close()
            except _Corrupt:
                pass
            name, dirfd = where.name, where.dirfd
            stamp = int(time.time())
            aside, n = f"{name}.corrupt-{stamp}", 1
            while _lexists(aside, dirfd):
                aside, n = f"{name}.corrupt-{stamp}-{n}", n + 1
            try:
                os.rename(name, aside, src_dir_fd=dirfd, dst_dir_fd=dirfd)
            except OSError as exc:
                raise _Unusable(f"{self.path} is damaged ({what}); cannot move it aside: {exc.strerror}") from None
            for suffix in ("-journal", "-wal", "-shm"):  # a journal of the old file must not roll back into the new
                with contextlib.suppress(OSError):
                    os.rename(name + suffix, aside + suffix, src_dir_fd=dirfd, dst_dir_fd=dirfd)
            _warn(f"tuning store {self.path} was damaged ({what}); moved it to {self.path.parent / aside} and "
                  "started an empty one")
            with contextlib.suppress(OSError):
                os.close(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                                 dir_fd=dirfd))
        except sqlite3.Error as exc:
            raise _Unusable(f"{self.path} is damaged ({what}); cannot rebuild it: {exc}") from None
        finally:
            if where is not None:
                where.close()
            for held in (turn, fd):
                if held is not None:
                    os.close(held)

    def _lock_file(self, name: str) -> int | None:
        """An open descriptor of `<folder>/locks/<name>.lock` (made 0700 / 0600), None (warned once) if it cannot be:
        the folder and `locks/` are checked like the store's (this user's, closed to writes by others, no symlink)."""
        locks = self.path.parent / "locks"
        try:
            where = self._locate_folder()
        except _Unusable as exc:
            self._warn_once(f"cannot make the lock {name!r} in {locks}: {exc}")
            return None
        try:
            try:
                os.mkdir("locks", 0o700, dir_fd=where)
            except FileExistsError:
                pass
            lockdir = os.open("locks", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=where)
            try:
                problem = _foreign(os.fstat(lockdir), locks, "folder")
                if problem is not None:
                    raise _Unusable(problem)
                fd = os.open(f"{_sanitised(name)}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=lockdir)
            finally:
                os.close(lockdir)
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                os.close(fd)
                raise _Unusable(f"{locks / name} is not a lock file of this user")
            return fd
        except OSError as exc:
            why = "a symlink" if exc.errno == errno.ELOOP else exc.strerror
            self._warn_once(f"cannot make the lock {name!r} in {locks}: {why}")
            return None
        except _Unusable as exc:
            self._warn_once(f"cannot make the lock {name!r} in {locks}: {exc}")
            return None
        finally:
            os.close(where)

    def _locate_folder(self) -> int:
        """The store's folder opened (made 0700 when missing) and checked; its descriptor."""
        folder = self.path.parent
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise _Unusable("a symlink" if exc.errno == errno.ELOOP else str(exc.strerror)) from None
        problem = _foreign(os.fstat(fd), folder, "folder")
        if problem is not None:
            os.close(fd)
            raise _Unusable(problem)
        return fd

    def _delete(self, where: str, args: tuple[Any, ...]) -> int:
        try:
            return self._run(True, lambda conn: conn.execute("DELETE FROM records" + where, args).rowcount)
        except _Unusable:
            return 0


class _Where:
    """The store's folder as opened and checked (its descriptor), its file's status, and the name SQLite is
    handed."""

    def __init__(self, dirfd: int, name: str, folder: Path) -> None:
        self.dirfd = dirfd
        self.name = name
        self.st: os.stat_result | None = None  # the store file's, once looked at
        self.read_only = False
        self.shared_reason: str | None = None
        magic = f"/proc/self/fd/{dirfd}"
        try:
            self.canonical = os.readlink(magic)  # the opened folder's real path now
            self.sqlite_path = f"{magic}/{name}"
        except OSError:  # no /proc: the real path, checked the same way
            self.canonical = os.path.realpath(folder)
            self.sqlite_path = os.path.join(self.canonical, name)

    def close(self) -> None:
        if self.dirfd is not None:
            with contextlib.suppress(OSError):
                os.close(self.dirfd)
        self.dirfd = None  # type: ignore[assignment]


def _refusal(problem: str) -> str:
    return (f"{problem}; refusing it (another user could plant or change its records: make it yours and closed to "
            "others, or read a store shared on purpose with SELECTOR_TUNING_STORE_READ_ONLY=1)")


def _foreign(st: os.stat_result, path: Path, what: str) -> str | None:
    """Why a folder or file with status `st` is not this user's alone to write, None when it is."""
    if st.st_uid != os.getuid():
        return f"{path} belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"the {what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: group or others may write it"
    return None


def _ancestors_problem(canonical: str) -> str | None:
    """Why another user could rename a folder above `canonical` (a real path), None when none can: each must
    be root's or this user's, and closed to writes by group and others unless sticky (like /tmp)."""
    uid = os.getuid()
    path = Path(canonical)
    for parent in path.parents:
        try:
            st = os.lstat(parent)
        except OSError:
            continue
        if st.st_uid not in (0, uid):
            return f"the folder {parent} above the store belongs to another user (uid {st.st_uid})"
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return (f"the folder {parent} above the store has mode {stat.S_IMODE(st.st_mode):04o}: group or others "
                    "may rename what it holds")
    return None


def _lexists(name: str, dirfd: int) -> bool:
    try:
        os.stat(name, dir_fd=dirfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _flock_blocking(fd: int, timeout_s: float) -> bool:
    """Take the exclusive flock on `fd` within `timeout_s` seconds, sleeping in the kernel until the holder lets go
    (no polling: under load a poller wakes late and the store sits idle meanwhile). The wait runs in a helper
    thread so that it can be given up; a lock it gets after that is dropped at once."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return False
    waiter_fd = os.dup(fd)  # the helper's own descriptor of the same open file: it closes it, whatever happens
    state = {"got": False, "gave_up": False}
    guard = threading.Lock()
    done = threading.Event()

    def wait() -> None:
        try:
            fcntl.flock(waiter_fd, fcntl.LOCK_EX)
            with guard:
                if state["gave_up"]:
                    fcntl.flock(waiter_fd, fcntl.LOCK_UN)
                else:
                    state["got"] = True
        except OSError:
            pass
        finally:
            os.close(waiter_fd)
            done.set()

    threading.Thread(target=wait, name="tuning-store-turn", daemon=True).start()
    done.wait(max(timeout_s, 0.0))
    with guard:
        if not state["got"]:
            state["gave_up"] = True
        return state["got"]


def _flock(fd: int, timeout_s: float, on_error: Callable[[OSError], None], max_pause: float = _LOCK_POLL_S) -> bool:
    """Take the exclusive flock on `fd` within `timeout_s` seconds (polling, from 1 ms up to `max_pause`);
    whether it was got. A filesystem that refuses locks: `on_error`, False."""
    deadline = time.monotonic() + max(timeout_s, 0.0)
    pause = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                on_error(exc)
                return False
        now = time.monotonic()
        if now >= deadline:
            return False
        time.sleep(min(pause, deadline - now))
        pause = min(pause * 2, max_pause)


# --- this process's store and records ------------------------------------------------------------------------


def store_path(environ: Mapping[str, str] | None = None) -> Path:
    """The store's file: `$SELECTOR_TUNING_STORE`, else `tuning.sqlite3` in the user's cache folder."""
    chosen = settings.get("SELECTOR_TUNING_STORE", environ)
    if chosen is not None:
        return Path(chosen).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("selector")) / STORE_FILE


_STORES: dict[Path, TuningStore] = {}


def default_store() -> TuningStore:
    """The store at `store_path()`, one object per path for the process (so each warns once)."""
    path = store_path()
    store = _STORES.get(path)
    if store is None:
        store = _STORES[path] = TuningStore(path)
    return store


@contextlib.contextmanager
def measurement_lock(name: str, timeout_s: float) -> Iterator[bool]:
    """`default_store().measurement_lock(name, timeout_s)`: hold `name` (e.g. `gpu-0`) across processes."""
    with default_store().measurement_lock(name, timeout_s) as got:
        yield got


def _shipped_records() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for path in sorted(DATA_DIR.glob("*.json")):
        try:
            out.extend(read_export(path))
        except ValueError as exc:
            _warn(f"shipped tuning file skipped: {exc}")
    return out


def describe_sources() -> str:
    """Where `known_records` reads from, for people (doctor): the store, and how this process may use it."""
    access, why = default_store().access()
    state = {"read-only": f"read-only, shared on purpose: {why}", "refused": f"not used: {why}",
             "missing": "not made yet"}.get(access)
    shipped = f"shipped files in {DATA_DIR}" if DATA_DIR.is_dir() else None  # name only a folder that exists
    also = ", ".join(part for part in (shipped, "the node daemon when one runs") if part)
    return f"{store_path()}" + (f" ({state})" if state else "") + f", and {also}"


def known_records(fingerprints: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Every record this node knows, in override order: shipped files, the store's, the daemon's (of
    `fingerprints` only, when given: the others would not be trusted here anyway)."""
    shared = shared_tuning_records(fingerprint=None if fingerprints is None else list(fingerprints))
    return _shipped_records() + default_store().records() + shared


def save_records(records: Iterable[Mapping[str, Any]]) -> PutResult:
    """Store `records` in the default store and gather the known records again on next use."""
    result = default_store().put(records)
    reload()
    return result


def _installed_version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except (metadata.PackageNotFoundError, ValueError):
        return None


def backend_origins(registry: Registry) -> dict[str, tuple[str, list[str]]]:
    """Backend name -> (the distribution it comes from, "name version": selector's own version for a built-in;
    the packages its requirements declare): what besides the machine its records' fingerprint covers."""
    import selector
    from selector.registry import is_builtin

    plugins = {p.name: p for p in registry.plugins}
    origins = {}
    for name, spec in registry.specs.items():
        info = plugins.get(registry.providers.get(name, ""))
        if info is None:
            distribution = "(unknown distribution)"
        elif is_builtin(info.target, info.distribution):
            distribution = f"moe-selector {selector.__version__}"
        else:
            distribution = info.distribution
        origins[name] = (distribution, sorted(spec.requirements.packages))
    return origins


def current_fingerprints(env: Environment | None = None, registry: Registry | None = None) -> Fingerprints:
    """Each loaded backend's record fingerprint (`tuning.fingerprints_of`) and the legacy one, in `env` with
    `registry` (default: this process's facts and plugins)."""
    from selector.environment import current_environment
    from selector.registry import get_registry, plugin_versions

    env = env or current_environment()
    registry = registry or get_registry()
    origins = backend_origins(registry)
    declared = {p for _, packages in origins.values() for p in packages if env.package(p) is None}
    installed = {normalize_package_name(p): _installed_version(p) for p in declared}
    return tuning.fingerprints_of(env, origins, plugin_versions(registry), installed)


@cache
def tuning_table() -> TuningTable:
    """The known records trusted here indexed for lookup, gathered once per process (until `reload`); records
    of the older format proven current are rewritten in the store to their backend's fingerprint first."""
    fingerprints = current_fingerprints()
    default_store().migrate(fingerprints)
    return TuningTable.from_records(known_records(fingerprints.accepted()), fingerprints)


def reload() -> None:
    """Gather the records again on next use (after a tuning run wrote new ones)."""
    tuning_table.cache_clear()


def measured_for(problem: Problem, env: Environment) -> dict[str, Measurement] | None:
    """What this node measured for `problem`, if any (the pure lookup over `tuning_table()`)."""
    return tuning.measured_for(problem, env, tuning_table())
