"""What `selector tune` needs of the tuning store, in one small class: which cells are already measured, saving
records (and sharing them with the node daemon), and the per-GPU measurement lock.

These wrap today's `selector.tuning_store` (a JSON file) so that one place changes when the store gains its own
`has` check, `save_records` and `measurement_lock`.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from selector import tuning, tuning_store

LOCK_POLL_S = 0.2


@dataclass(frozen=True)
class Saved:
    stored: int
    refused: list[tuple[Mapping[str, Any], str]]  # (the record as given, why)


class TuneStore:
    """The user's tuning records (`path`: another tuning file, e.g. a test's, which then is not shared)."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._keys: set[tuple[Any, ...]] | None = None

    def fingerprint(self) -> str:
        return tuning_store.current_fingerprint()

    def records(self) -> list[dict[str, Any]]:
        """Every record this store knows (the node's, for the default store)."""
        return tuning_store.known_records() if self.path is None else tuning_store.read_records(self.path)

    def has(self, fingerprint: str, gpu: str, problem_key: str, mode: str, tokens: int, backend: str) -> bool:
        """Whether this cell is already measured under `fingerprint`."""
        if self._keys is None:
            self._keys = {tuning.record_key(r) for r in self.records() if tuning.is_valid_record(r)}
        return (fingerprint, gpu, problem_key, mode, int(tokens), backend) in self._keys

    def save(self, records: Iterable[Mapping[str, Any]]) -> Saved:
        """Keep the valid ones of `records`, shared with the node daemon (default store); what was stored and
        what was refused (a record the schema refuses, e.g. a spread of 100x, is not kept: its cell is measured
        again next time)."""
        clean, refused = [], []
        for r in records:
            reason = tuning.check_record(r)
            if reason is None:
                clean.append(tuning.clean_record(r))
            else:
                refused.append((r, reason))
        if not clean:
            return Saved(0, refused)
        tuning_store.write_records(self.path or tuning_store.user_tuning_path(), clean)
        if self.path is None:
            from selector.daemon.client import share_tuning_records

            try:  # the node's other processes see them at once, where a daemon runs
                share_tuning_records(clean)
            except (OSError, ValueError):  # a daemon that stopped answering: the file has them already
                pass
        tuning_store.reload()
        if self._keys is not None:
            self._keys |= {tuning.record_key(r) for r in clean}
        return Saved(len(clean), refused)

    def lock_path(self, name: str) -> Path:
        folder = (self.path or tuning_store.user_tuning_path()).parent
        return folder / f"measure-{re.sub(r'[^A-Za-z0-9_.-]+', '_', name)}.lock"

    @contextlib.contextmanager
    def measurement_lock(self, name: str, timeout_s: float) -> Iterator[bool]:
        """Hold the lock of GPU `name` while measuring (two tuners on one GPU would time each other's load);
        yields whether it was got within `timeout_s`."""
        import fcntl

        path = self.lock_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            deadline = time.monotonic() + max(timeout_s, 0.0)
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    got = True
                    break
                except OSError:
                    if time.monotonic() >= deadline:
                        got = False
                        break
                    time.sleep(LOCK_POLL_S)
            try:
                yield got
            finally:
                if got:
                    fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
