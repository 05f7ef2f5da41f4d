"""The `selector store show|export|import|clear` subcommand: the tuning store seen from this process."""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from selector.tuning import Fingerprints
    from selector.tuning_store import TuningStore

EXIT_OK, EXIT_BROKEN, EXIT_USAGE = 0, 1, 2


def register(sub: Any) -> None:
    """Add the `store` subcommand to the CLI's subparsers."""
    store = sub.add_parser(
        "store",
        help="the tuning store: show, export, import or clear measured times",
        description="The tuning store holds measured times (from `selector bench --save-tuning` and tuners) "
        "that auto trusts where each record's backend fingerprint (GPU, driver, CUDA, torch, Triton and that "
        "backend's own distribution) is current. Its file is $SELECTOR_TUNING_STORE, else tuning.sqlite3 in the "
        "user cache dir.",
    )
    actions = store.add_subparsers(dest="action", required=True)
    show = actions.add_parser("show", help="where the store is, each backend's fingerprint, counts per problem")
    show.add_argument("--json", action="store_true", help="machine-readable summary")
    export = actions.add_parser("export", help="write the records to a file (schema selector.tuning/2)")
    export.add_argument("file", type=Path)
    export.add_argument("--current", action="store_true", help="only the records trusted here")
    imp = actions.add_parser("import", help="store the records of an export file (a later record replaces)")
    imp.add_argument("file", type=Path)
    clear = actions.add_parser("clear", help="delete the records (all of them, or the stale ones)")
    clear.add_argument("--stale", action="store_true",
                       help="only stale records (of backends loaded here, measured under other facts)")
    store.set_defaults(func=_handle)


def _handle(args: argparse.Namespace) -> int:
    from selector import tuning_store

    store = tuning_store.default_store()
    if args.action == "import":
        return _import(store, args.file)
    fingerprints = tuning_store.current_fingerprints()
    store.migrate(fingerprints)  # records of the older format proven current take their backend's fingerprint
    if args.action == "show":
        return _show(store, fingerprints, args.json)
    if args.action == "export":
        return _export(store, args.file, fingerprints if args.current else None)
    if args.stale:
        removed = store.clear_stale(fingerprints)
    else:
        removed = store.clear()
    tuning_store.reload()
    print(f"removed {removed} record{'s' * (removed != 1)} from {store.path}")
    return EXIT_OK


def _show(store: TuningStore, fingerprints: Fingerprints, as_json: bool) -> int:
    summary = store.summary(fingerprints)
    if as_json:
        print(json.dumps({"schema": "selector.store/2", **summary.to_dict()}, indent=1))
        return EXIT_OK if summary.problem is None else EXIT_BROKEN
    print(f"store:       {summary.path}")
    print("fingerprints (this process, one per backend: GPU, driver, CUDA, torch, Triton, its distribution):")
    for backend, fp in sorted(fingerprints.by_backend.items()):
        print(f"  {backend:<20} {fp}")
    if summary.problem is not None:
        print(f"not usable:  {summary.problem}")
        return EXIT_BROKEN
    if summary.read_only:
        access, why = store.access()
        print(f"read-only:   {why or 'SELECTOR_TUNING_STORE_READ_ONLY is set'} (shared on purpose: read, never written)")
    line = f"records:     {summary.current} current, {summary.stale} stale"
    if summary.stale:
        per_backend = ", ".join(f"{b} {n}" for b, n in summary.stale_by_backend.items())
        line += f" ({per_backend}: never used; `selector store clear --stale` removes them)"
    if summary.other:
        line += f", {summary.other} of backends not loaded here (kept)"
    print(line)
    for p in summary.problems:
        tokens = ",".join(map(str, p.tokens))
        print(f"  {p.gpu} {p.problem} {p.mode}: {p.records} records, tokens {tokens}, backends {', '.join(p.backends)}")
    return EXIT_OK


def _export(store: TuningStore, file: Path, fingerprints: Fingerprints | None) -> int:
    from selector.cli import UsageError

    if file.is_dir():
        raise UsageError(f"{file} is a folder; give a file name, e.g. {file / 'tuning.json'}")
    if not file.parent.is_dir():
        raise UsageError(f"cannot write {file}: no folder {file.parent}; create it or pick another path")
    try:
        written = store.export(file, fingerprints)
    except OSError as exc:
        raise UsageError(f"cannot write {file}: {exc.strerror}; pick a writable folder") from None
    print(f"exported {written} record{'s' * (written != 1)} to {file}")
    return EXIT_OK


def _import(store: TuningStore, file: Path) -> int:
    import warnings

    from selector import tuning_store
    from selector.cli import UsageError

    try:
        records = tuning_store.read_export(file)
    except ValueError as exc:
        raise UsageError(f"{exc}; give a file written by `selector store export` or `selector bench`") from None
    for line in unknown_key_warnings(records):
        print(line, file=sys.stderr)
    with warnings.catch_warnings(record=True) as caught:  # the refusals are printed below, once each
        warnings.simplefilter("always", tuning_store.TuningStoreWarning)
        result = store.put(records)
    for w in caught:
        if not issubclass(w.category, tuning_store.TuningStoreWarning):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    tuning_store.reload()
    print(f"stored {result.stored}, refused {len(result.refused)} (from {file} into {store.path})")
    for reason in sorted(set(result.refused)):
        print(f"  refused {result.refused.count(reason)}: {reason}")
    return EXIT_OK if result.stored or not result.refused else EXIT_BROKEN


def unknown_key_warnings(records: Iterable[object]) -> list[str]:
    """One line per key of a record that is no field of the record format (misspelt, or of another tool): the
    store keeps only the known fields, so the value would be dropped without a word."""
    from selector.tuning import OPTIONAL, REQUIRED, unknown_keys

    known = [*REQUIRED, *OPTIONAL]
    lines = []
    for number, record in enumerate(records, 1):
        if not isinstance(record, dict):
            continue  # not a record at all: the store refuses it and says why
        what = ", ".join(f"{k} {record[k]}" for k in ("backend", "problem", "tokens") if k in record)
        for key in unknown_keys(record):
            close = difflib.get_close_matches(key, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            lines.append(f"warning: record {number} ({what or 'no backend'}): unknown key {key!r}{hint}, not stored")
    return lines
