"""The tuning store: one SQLite file per user (or per cluster, in a shared folder) holding measured times, and the
records this node knows gathered for the pure lookup in `selector.tuning`.

Sources, later ones overriding earlier: export files shipped in `selector/tuning_data/`, the store
(`$SELECTOR_TUNING_STORE`, else `tuning.sqlite3` in the user's cache folder), then what other processes shared
through the node daemon.

The store never stops a model from loading: a damaged file is moved aside and rebuilt empty, a location that
cannot be used reads as empty and refuses writes, each with a warning. Several processes (and several nodes, on
a filesystem with working POSIX locks) may write at once: every write is one transaction that waits for the
others (`SELECTOR_TUNING_STORE_TIMEOUT`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import sqlite3
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
_FIX = " (set SELECTOR_TUNING_STORE to a file you may write)"


class TuningStoreWarning(UserWarning):
    """A tuning record or store selector could not use; it carries on without it."""


class _Corrupt(Exception):
    """The store file is not a store of this version (the message says what it is instead)."""


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

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "fingerprints": self.fingerprints.to_dict(),
            "usable": self.problem is None,
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

    Every method opens the file for its own transaction, so a store may be used from several threads and
    processes (and across fork) at once. Nothing raises for a bad file or location: it warns once and reads as
    empty; a damaged file is moved aside to `<name>.corrupt-<unix time>` and the store rebuilt empty.
    """

    def __init__(self, path: Path, timeout_s: float | None = None) -> None:
        self.path = Path(path)
        self._timeout_s = timeout_s
        self._warned = False

    @property
    def timeout_s(self) -> float:
        """How long a write waits for other writers (seconds): the constructor's, else the setting's now."""
        return settings.get("SELECTOR_TUNING_STORE_TIMEOUT") if self._timeout_s is None else float(self._timeout_s)

    def __repr__(self) -> str:
        return f"TuningStore({str(self.path)!r})"

    # --- public ----------------------------------------------------------------------------------------------

    def put(self, records: Iterable[Mapping[str, Any]]) -> PutResult:
        """Store the valid ones of `records` in one transaction; an invalid one is refused with a warning naming
        why, and every one is refused (with a warning, once) when the store cannot be written."""
        kept, refused = clean_records(records)
        if not kept:
            return PutResult(0, refused)
        now = time.time()
        rows = [(*(r[c] for c in KEY_COLUMNS), json.dumps(r, sort_keys=True), now) for r in kept]
        try:
            with self._transaction(write=True) as conn:
                if conn is not None:  # always one for a write
                    conn.executemany(_INSERT, rows)
        except _Unusable as exc:
            return PutResult(0, refused + [f"not stored: {exc}"] * len(kept))
        return PutResult(len(kept), refused)

    def records(self, fingerprint: str | Sequence[str] | None = None) -> list[dict[str, Any]]:
        """The stored records (of `fingerprint` alone, or of any of a list of them, when given), oldest write
        first; none when the store is missing or cannot be read."""
        query, args = "SELECT record FROM records", tuple[str, ...]()
        if fingerprint is not None:
            wanted = (fingerprint,) if isinstance(fingerprint, str) else tuple(fingerprint)
            query, args = query + f" WHERE fingerprint IN ({', '.join('?' * len(wanted))})", wanted
        try:
            with self._transaction(write=False) as conn:
                rows = [] if conn is None else conn.execute(query + " ORDER BY rowid", args).fetchall()
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
            with self._transaction(write=False) as conn:
                rows = [] if conn is None else conn.execute(
                    "SELECT fingerprint, gpu, problem, mode, tokens, backend FROM records").fetchall()
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
                            dict(sorted(counts.items())), problems, problem, other, dict(sorted(stale.items())))

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
        try:
            with self._transaction(write=True) as conn:
                if conn is None:
                    return 0
                rows = conn.execute("SELECT rowid, backend, fingerprint FROM records").fetchall()
                gone = [(rowid,) for rowid, backend, fp in rows if fps.is_stale(backend, fp)]
                conn.executemany("DELETE FROM records WHERE rowid = ?", gone)
                return len(gone)
        except _Unusable:
            return 0

    def migrate(self, fingerprints: Fingerprints) -> int:
        """Rewrite the records of the older format proven current (they carry `fingerprints.legacy`: measured
        here with these very plugins) to their backend's fingerprint, so a later plugin change stales only that
        plugin's. A record of the same key already under the new fingerprint is newer and stays. How many were
        rewritten; nothing is written when there is nothing to rewrite."""
        legacy = fingerprints.legacy
        if legacy is None or not self.records(legacy):  # a read: most stores have nothing to rewrite
            return 0
        try:
            with self._transaction(write=True) as conn:
                if conn is None:
                    return 0
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
        except (_Unusable, ValueError, KeyError):  # a row edited by hand: left as it is
            return 0

    def unmeasured(self, fingerprints: Fingerprints | str, gpu: str, problem: str, mode: str, tokens: int,
                   backends: Sequence[str]) -> list[str]:
        """The backends of `backends` without a trusted stored time (under `fingerprints`; a plain string: one
        for every backend) for this problem, mode and token count (all of them when the store cannot be read):
        what a tuner still has to measure."""
        fps = as_fingerprints(fingerprints)
        try:
            with self._transaction(write=False) as conn:
                rows = [] if conn is None else conn.execute(
                    "SELECT backend, fingerprint FROM records WHERE gpu = ? AND problem = ? AND mode = ? "
                    "AND tokens = ?", (gpu, problem, mode, int(tokens))).fetchall()
        except _Unusable:
            rows = []
        have = {b for b, fp in rows if fps.trusts(b, fp)}
        return [b for b in backends if b not in have]

    def is_measured(self, fingerprints: Fingerprints | str, gpu: str, problem: str, mode: str, tokens: int,
                    backends: Sequence[str]) -> bool:
        """Whether every backend of `backends` has a trusted stored time for this problem, mode and token count."""
        return not self.unmeasured(fingerprints, gpu, problem, mode, tokens, backends)

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
            deadline = time.monotonic() + max(timeout_s, 0.0)
            got = False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    got = True
                    break
                except OSError as exc:
                    if exc.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                        self._warn_once(f"cannot lock {name!r} in {self.path.parent / 'locks'}: {exc.strerror}")
                        break
                if time.monotonic() >= deadline:
                    break
                time.sleep(_LOCK_POLL_S)
            yield got
        finally:
            os.close(fd)  # closing the only descriptor releases the lock

    # --- opening, checking, repairing ----------------------------------------------------------------------

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            _warn(message)

    def _safety_problem(self) -> str | None:
        """Why the file at the path must not be used (a symlink, another user's, not a file), None if it may."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return None
        except OSError as exc:
            return f"cannot use {self.path}: {exc.strerror}{_FIX}"
        import stat

        if stat.S_ISLNK(st.st_mode):
            return f"{self.path} is a symlink; refusing it (point SELECTOR_TUNING_STORE at the real file)"
        if st.st_uid != os.getuid():
            return f"{self.path} belongs to another user (uid {st.st_uid}); refusing it (use a store of your own)"
        if not stat.S_ISREG(st.st_mode):
            return f"{self.path} is not a regular file"
        return None

    def _create_file(self) -> None:
        """The folder (0700 when selector makes it) and an empty store file only its owner can read."""
        folder = self.path.parent
        if not folder.is_dir():
            try:
                folder.mkdir(parents=True, mode=0o700, exist_ok=True)
            except OSError as exc:
                raise _Unusable(f"cannot create the folder {folder}: {exc.strerror}{_FIX}") from None
        try:
            os.close(os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600))
        except FileExistsError:
            pass  # another process made it first
        except OSError as exc:
            raise _Unusable(f"cannot create {self.path}: {exc.strerror}{_FIX}") from None

    def _connect(self) -> sqlite3.Connection:
        try:
            conn = sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None)
        except sqlite3.Error as exc:
            raise _Unusable(f"cannot open {self.path}: {exc}") from None
        return conn

    @staticmethod
    def _begin(conn: sqlite3.Connection, write: bool) -> bool:
        """Open a transaction (a write one waits for other writers) and check the layout: True for a store of this
        version, False for an empty file; _Corrupt for anything else. An operational failure (locked, I/O) is
        no damage: it propagates as sqlite3.OperationalError."""
        try:
            conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")
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
        except sqlite3.OperationalError:
            raise
        except sqlite3.DatabaseError as exc:  # "file is not a database", "database disk image is malformed"
            raise _Corrupt(f"not a readable SQLite store ({exc})") from None
        return True

    @contextlib.contextmanager
    def _transaction(self, write: bool) -> Iterator[sqlite3.Connection | None]:
        """A connection inside one transaction on a checked store (None for reads of a store not yet made);
        _Unusable (warned once) when the location cannot serve it. A write waits up to timeout_s for others."""
        problem = self._safety_problem()
        if problem is not None:
            self._warn_once(f"tuning store not used: {problem}")
            raise _Unusable(problem)
        try:
            if write:
                self._create_file()
            elif not self.path.exists():
                yield None
                return
            for attempt in (1, 2):
                conn = self._connect()
                try:
                    try:
                        ready = self._begin(conn, write)
                    except _Corrupt as exc:
                        if attempt == 2:
                            raise _Unusable(f"{self.path} is still damaged after rebuilding it ({exc})") from None
                        conn.close()
                        self._repair(str(exc))
                        continue
                    if not ready:
                        if not write:  # made by another process that has not set it up yet: empty
                            conn.rollback()
                            yield None
                            return
                        for statement in _CREATE:
                            conn.execute(statement)
                        conn.execute("INSERT INTO meta VALUES ('schema_version', ?)", (str(STORE_VERSION),))
                    yield conn
                    conn.commit()
                    return
                finally:
                    conn.close()
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

    def _repair(self, what: str) -> None:
        """Move a damaged store aside and leave an empty one, under a lock so that two processes finding the same
        damage move it once (the second finds the rebuilt store and keeps it)."""
        fd = self._lock_file("store-repair")
        try:
            if fd is not None:
                with contextlib.suppress(OSError):  # a filesystem without flock: repair unguarded, as one process would
                    fcntl.flock(fd, fcntl.LOCK_EX)
            conn = self._connect()
            try:
                self._begin(conn, write=False)
                return  # another process rebuilt it meanwhile
            except _Corrupt:
                pass
            finally:
                conn.close()
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            n = 1
            while aside.exists():
                aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}-{n}")
                n += 1
            try:
                os.replace(self.path, aside)
            except OSError as exc:
                raise _Unusable(f"{self.path} is damaged ({what}); cannot move it aside: {exc.strerror}") from None
            for suffix in ("-journal", "-wal", "-shm"):  # a journal of the old file must not roll back into the new
                with contextlib.suppress(OSError):
                    os.replace(f"{self.path}{suffix}", f"{aside}{suffix}")
            _warn(f"tuning store {self.path} was damaged ({what}); moved it to {aside} and started an empty one")
            self._create_file()
        finally:
            if fd is not None:
                os.close(fd)

    def _lock_file(self, name: str) -> int | None:
        """An open descriptor of `<folder>/locks/<name>.lock` (made 0700 / 0600), None (warned once) if it cannot be."""
        locks = self.path.parent / "locks"
        try:
            if not locks.is_dir():
                locks.mkdir(parents=True, mode=0o700, exist_ok=True)
            return os.open(locks / f"{_sanitised(name)}.lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            self._warn_once(f"cannot make the lock {name!r} in {locks}: {exc.strerror}")
            return None

    def _delete(self, where: str, args: tuple[Any, ...]) -> int:
        try:
            with self._transaction(write=True) as conn:
                return 0 if conn is None else conn.execute("DELETE FROM records" + where, args).rowcount
        except _Unusable:
            return 0


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
    """Where `known_records` reads from, for people (doctor)."""
    return f"{store_path()} (and shipped files in {DATA_DIR}, and the node daemon when one runs)"


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
