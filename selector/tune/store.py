"""What `selector tune` needs of the tuning store, in one small class over `selector.tuning_store.TuningStore`:
which cells are already measured, saving records (and sharing them with the node daemon), the per-GPU lock."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from selector import tuning_store
from selector.tuning import Fingerprints
from selector.tuning_store import PutResult, TuningStore


class TuneStore:
    """The node's tuning store (`path`: another store file, e.g. a test's, whose records are then not shared
    with the daemon and whose reads leave out the shipped files and the daemon's records)."""

    def __init__(self, path: Path | None = None) -> None:
        self.shared = path is None
        self.store = tuning_store.default_store() if path is None else TuningStore(path)

    @property
    def path(self) -> Path:
        return self.store.path

    def fingerprint(self) -> Fingerprints:
        """Each backend's record fingerprint in this process."""
        return tuning_store.current_fingerprints()

    def records(self) -> list[dict[str, Any]]:
        """Every record known: the node's (shipped files, the store, the daemon) for the default store."""
        return tuning_store.known_records() if self.shared else self.store.records()

    def is_measured(
        self, fingerprint: Fingerprints, gpu: str, problem_key: str, mode: str, tokens: int, backends: Sequence[str]
    ) -> bool:
        """Whether every one of `backends` has a stored time for this cell trusted under `fingerprint`."""
        return self.store.is_measured(fingerprint, gpu, problem_key, mode, tokens, backends)

    def save(self, records: Iterable[Mapping[str, Any]]) -> PutResult:
        """Keep `records` (the store refuses, with the reason, any the schema refuses); for the default store,
        shared with the node daemon and gathered again for this process's lookups."""
        records = [dict(r) for r in records]
        result = self.store.put(records)
        if self.shared and result.stored:
            tuning_store.reload()
            from selector.daemon.client import share_tuning_records

            share_tuning_records(records)  # the node's other processes see them at once (never raises)
        return result

    @contextlib.contextmanager
    def measurement_lock(self, name: str, timeout_s: float) -> Iterator[bool]:
        """The store's lock `name` (one tuner per GPU); yields whether it was got within `timeout_s`."""
        with self.store.measurement_lock(name, timeout_s) as got:
            yield got
