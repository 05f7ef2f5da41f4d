"""Reading the per-GPU tile tables the Triton kernels ship (`configs/<GPU name>.json`; no torch here).

File layout: {"configs": {shape_key: {token_count: config}}, ...}. Each kernel family brings its own
`normalize` (which keys a config has, their defaults); an entry it rejects is skipped, not fatal. Tables tuned on
this node (`selector tune`) add {"tuned": {shape_key: [token counts measured]}} and are written atomically;
`tuning_summary` and `run_tuner`: the summary both kernel families' tuners report, and their commands'
ending.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

Table = dict[str, dict[int, dict[str, Any]]]


def read_table(path: Path, normalize: Callable[[Any], dict[str, Any]]) -> Table:
    """{shape_key: {token_count: normalized config}}; empty when the file is missing or unreadable."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    table: Table = {}
    for key, per_t in (data.get("configs") or {}).items():
        entries = {}
        for t, cfg in per_t.items():
            try:
                entries[int(t)] = normalize(cfg)
            except (ValueError, TypeError):
                continue
        if entries:
            table[key] = entries
    return table


# --- tables tuned on this node (`selector tune`): read leniently, written atomically -------------------------


def read_document(path: Path) -> dict[str, Any]:
    """A table file's JSON document; {} when absent. Raises ValueError saying why it is unusable."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise ValueError(f"cannot read it ({exc.strerror or exc})") from None
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("configs", {}), dict):
        raise ValueError('not a tile table (expected an object with a "configs" object)')
    return doc


def read_user_table(path: Path, normalize: Callable[[Any], dict[str, Any]], owner: str) -> Table:
    """Like read_table, for a table written on this node: one that is malformed is ignored with a warning (a broken
    cache file must never stop a model from running), as are its malformed entries."""
    try:
        doc = read_document(path)
    except ValueError as exc:
        warnings.warn(
            f"{owner}: ignoring the tuned tile table {path}: {exc}; delete it or run `selector tune` "
            "again to rewrite it",
            RuntimeWarning,
            stacklevel=3,
        )
        return {}
    table: Table = {}
    skipped = 0
    for key, per_t in (doc.get("configs") or {}).items():
        if not isinstance(per_t, dict):
            skipped += 1
            continue
        entries = {}
        for t, cfg in per_t.items():
            try:
                entries[int(t)] = normalize(cfg)
            except (ValueError, TypeError):
                skipped += 1
        if entries:
            table[key] = entries
    if skipped:
        warnings.warn(
            f"{owner}: ignoring {skipped} malformed entr{'y' if skipped == 1 else 'ies'} of the tuned tile "
            f"table {path}",
            RuntimeWarning,
            stacklevel=3,
        )
    return table


def token_list(values: Any) -> frozenset[int]:
    try:
        return frozenset(int(t) for t in values or ())
    except (TypeError, ValueError):
        return frozenset()


def tuned_tokens(path: Path, key: str) -> frozenset[int]:
    """Token counts of `key` the table holds measured tiles for (its "tuned" lists), not filled-in defaults."""
    try:
        listed = read_document(path).get("tuned")
    except ValueError:
        return frozenset()
    return token_list(listed.get(key) if isinstance(listed, dict) else None)


def merge_entries(
    path: Path,
    key: str,
    entries: Mapping[int, Mapping[str, Any]],
    tuned: Iterable[int],
    header: Mapping[str, Any],
    owner: str,
) -> None:
    """Merge one shape's {token_count: config} into the table at `path` and add `tuned` to its measured token
    counts; atomically (temp file beside it, then os.replace): a reader sees the old file or the new one, never
    half of one. An unreadable table is replaced, with a warning."""
    try:
        doc = read_document(path)
    except ValueError as exc:
        warnings.warn(f"{owner}: replacing the unreadable tuned tile table {path}: {exc}", RuntimeWarning, stacklevel=3)
        doc = {}
    configs = doc.get("configs") if isinstance(doc.get("configs"), dict) else {}
    per_t = configs.get(key) if isinstance(configs.get(key), dict) else {}
    per_t.update({str(int(t)): dict(cfg) for t, cfg in entries.items()})
    configs[key] = per_t
    listed = doc.get("tuned") if isinstance(doc.get("tuned"), dict) else {}
    listed[key] = sorted(token_list(listed.get(key)) | {int(t) for t in tuned})
    doc.update({**header, "configs": configs, "tuned": listed})
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(doc, indent=1, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def user_table_dir(variable: str, backend: str) -> Path:
    """Folder of a backend's tile tables tuned on this node: `variable` when set, else `<user cache>/selector/<backend>`."""
    from selector import settings

    chosen = settings.get(variable)
    if chosen:
        return Path(chosen)
    # the layer asks on every call: platformdirs' answer is kept per value of the variables it reads
    return _default_table_dir(os.environ.get("XDG_CACHE_HOME"), os.environ.get("HOME"), backend)


@functools.lru_cache(maxsize=16)
def _default_table_dir(xdg_cache_home: str | None, home: str | None, backend: str) -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("selector")) / backend


def run_tuner(tool: str, timed: str, gpu_visible: bool, debug: bool, tune: Callable[[], Any]) -> int:
    """A tuner's `main` once its flags are read: `tune()` writes the table and returns its path. Exit 0 after
    writing it, 1 with one line on stderr where no GPU is visible or `tune` raises (`debug`: the traceback)."""
    if not gpu_visible:
        print(
            f"{tool} tune: needs a CUDA GPU and none is visible (it times {timed} on the GPU the "
            "table is for); run it on that GPU's node",
            file=sys.stderr,
        )
        return 1
    try:
        out = tune()
    except Exception as exc:  # one line with the fix; --debug shows where it came from
        if debug:
            raise
        print(
            f"{tool} tune: {type(exc).__name__}: {' '.join(str(exc).split())} (rerun with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1
    print(f"wrote {out}")
    return 0


def tuning_summary(shape: str, device: str | None, budget_s: float, skipped: str | None = None, **extra: Any) -> dict:
    """A tuner's summary of one layer before its search (filled in as it goes): token counts tuned, cut short
    ("tokens_partial") and left on defaults, the configs chosen and their times, and `extra` fields of its own."""
    return {
        "backend": "triton_fused",
        "shape": shape,
        "device": device,
        "budget_s": float(budget_s),
        "tokens_tuned": [],
        "tokens_partial": [],
        "tokens_default": [],
        "configs": {},
        "time_us": {},
        **extra,
        "seconds": 0.0,
        "cut_short": False,
        "written_to": None,
        "skipped": skipped,
    }
