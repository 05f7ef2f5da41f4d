"""The `selector daemon run|start|stop|status` subcommand: argument parsing and what it prints."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from selector.daemon import server
from selector.daemon.client import ping
from selector.daemon.wire import SOCKET_VARIABLE, socket_path


def register(sub: Any) -> None:
    """Add the `daemon` subcommand to the CLI's subparsers."""
    daemon = sub.add_parser(
        "daemon", help="share probes and tuning results between processes of this node",
        description="run: in the foreground (systemd, containers); start: in the background; one per user and node",
    )
    daemon.add_argument("action", choices=["run", "start", "stop", "status"])
    daemon.add_argument("--socket", type=Path,
                        help=f"socket path (default: ${SOCKET_VARIABLE}, else daemon.sock in the private folder)")
    daemon.add_argument("--store", type=Path, help="tuning store file (default: the tuning store's own place)")
    daemon.set_defaults(func=_handle)


def _handle(args: argparse.Namespace) -> int:
    path: Path = args.socket or socket_path()
    try:
        if args.action == "run":
            server.serve(path, store_file=args.store)
            return 0
        if args.action == "start":
            if ping(path):
                print(f"already running at {path}")
                return 0
            server.start(path, store_file=args.store)
            print(f"started at {path}")
            return 0
    except server.DaemonError as exc:
        print(f"selector daemon: {exc}", file=sys.stderr)
        return 1
    if args.action == "stop":
        if not server.stop(path):
            print(f"no daemon at {path}")
            return 1
        print("stopped")
        return 0
    status = server.read_status(path)
    if status is None:
        print(f"no daemon at {path}")
        return 1
    print(json.dumps(status, indent=1))
    return 0
