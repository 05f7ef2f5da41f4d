"""The child's side of the plugin check (selector/plugin_probe.py): started as `python -c`, it loads every plugin but
those the parent names, telling the parent each plugin's stage on a private copy of stdout."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from selector.registry import build_registry


def run_child(args: Mapping[str, Any]) -> None:
    """The child's side: load every plugin but those to skip (checked in an earlier pass), telling the parent
    each stage on a private copy of stdout (what plugins print goes to stderr)."""
    report = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def tell(plugin: str, stage: str) -> None:
        report.write(json.dumps({"plugin": plugin, "stage": stage}) + "\n")
        report.flush()

    report.write(json.dumps({"stage": "start"}) + "\n")
    report.flush()
    # The parent keeps the time; the child's own thread timeout stays out of its way.
    build_registry(environ=args["environ"], quarantine=dict.fromkeys(args["skip"], "checked"), progress=tell,
                   timeout=2 * float(args["deadline"]) + 5)
    report.write(json.dumps({"stage": "end"}) + "\n")
    report.flush()
