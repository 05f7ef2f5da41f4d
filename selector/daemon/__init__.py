"""The node daemon: probes once and shares facts and measured tuning results between the processes of a node.

Apart, so that a library process loads only what it calls:
- `selector.daemon.wire`: the protocol (length-framed, versioned JSON with bounded sizes; op names) and the
  daemon's files (where they live; the checks that its folder and files are this user's and private);
- `selector.daemon.client`: what a library process calls (`request`, `ping`, `environment_from_daemon`,
  the shared tuning records); it imports nothing of the server;
- `selector.daemon.server`: the socket server, its state and status file, run / start / stop;
- `selector.daemon.commands`: the `selector daemon run|start|stop|status` subcommand.

Clients that find no daemon fall back to probing themselves, so the daemon is an accelerator, never a
dependency. This package imports none of its modules, so importing the client never loads the server.
"""
