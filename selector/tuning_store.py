"""Where this node's measured times come from: shipped data files, the user's tuning file, the node daemon.

Sources, later ones overriding earlier: data files shipped in `selector/tuning_data/` (made by
`selector bench` on the named GPU), the user's cache file written by `selector bench --save-tuning`, then
what other processes shared through the node daemon. The lookup itself is `selector.tuning` (pure).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from functools import cache
from pathlib import Path
from typing import Any

from selector import tuning
from selector.daemon.client import shared_tuning_records
from selector.probes import Environment
from selector.tuning import Measurement, TuningTable, record_key
from selector.types import Problem

__all__ = [
    "DATA_DIR",
    "SCHEMA",
    "known_records",
    "measured_for",
    "read_records",
    "current_fingerprint",
    "reload",
    "tuning_table",
    "user_tuning_path",
    "write_records",
]

DATA_DIR = Path(__file__).parent / "tuning_data"
SCHEMA = tuning.SCHEMA


def user_tuning_path() -> Path:
    """The user's tuning file (written by `selector bench --save-tuning`)."""
    import platformdirs

    return Path(platformdirs.user_cache_dir("selector")) / "tuning.json"


def write_records(path: Path, records: Iterable[Mapping[str, Any]]) -> None:
    """Merge `records` into the tuning file at `path` (a record with the same key is replaced)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    existing = read_records(path)
    merged = {record_key(r): r for r in existing}
    for r in records:
        merged[record_key(r)] = dict(r)
    path.write_text(json.dumps({"schema": SCHEMA, "records": list(merged.values())}, indent=1))


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of one tuning file; none when it is missing, unreadable or of another schema."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return list(data.get("records", [])) if data.get("schema") == SCHEMA else []


def describe_sources() -> str:
    """Where `known_records` reads from, for people (doctor)."""
    return f"{user_tuning_path()} (and shipped files in {DATA_DIR}, and the node daemon when one runs)"


def known_records() -> list[dict[str, Any]]:
    """Every record this node knows, in override order: shipped files, the user's file, the daemon's."""
    paths = sorted(DATA_DIR.glob("*.json")) + [user_tuning_path()]
    return [r for path in paths for r in read_records(path)] + shared_tuning_records()


def current_fingerprint() -> str:
    """The tuning fingerprint of this process: its environment, selector's and every backend plugin's version."""
    from selector.environment import current_environment
    from selector.registry import get_registry, plugin_versions

    return tuning.tuning_fingerprint(current_environment(), plugin_versions(get_registry()))


@cache
def tuning_table() -> TuningTable:
    """The known records of this fingerprint indexed for lookup, gathered once per process (until `reload`)."""
    return TuningTable.from_records(known_records(), current_fingerprint())


def reload() -> None:
    """Gather the records again on next use (after a tuning run wrote new ones)."""
    tuning_table.cache_clear()


def measured_for(problem: Problem, env: Environment) -> dict[str, Measurement] | None:
    """What this node measured for `problem`, if any (the pure lookup over `tuning_table()`)."""
    return tuning.measured_for(problem, env, tuning_table())
