"""The ``memproxy`` command line: ``serve`` runs the proxy; the other commands manage memory."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
from collections.abc import Sequence
from pathlib import Path

from proxy.cli.memory import add_memory_commands, run_memory_command
from proxy.cli.ops import add_ops_commands

# Commands that open the configuration or the data directory (proxy.cli.store); the others speak HTTP.
_STORE_COMMANDS = ("export", "import", "migrate", "eval", "config")


def version() -> str:
    """The installed distribution's version (``0+unknown`` in a checkout that was never installed)."""
    try:
        return importlib.metadata.version("memproxy")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memproxy", description="A memory sidecar for chat-completion APIs.")
    parser.add_argument("--version", action="version", version=f"memproxy {version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("serve", help="run the proxy")
    run.add_argument("--config", type=Path, help="TOML config file (default: $MEMPROXY_CONFIG or built-in)")
    run.add_argument("--host", help="listen address (overrides server.host)")
    run.add_argument("--port", type=int, help="listen port (overrides server.port; 0 picks a free one)")
    reindex = commands.add_parser(
        "reindex",
        help="re-embed every memory with the configured embedding model "
        "(stop the server first: one process owns the data directory)",
    )
    reindex.add_argument("--config", type=Path, help="TOML config file (default: $MEMPROXY_CONFIG or built-in)")
    add_memory_commands(commands)
    add_ops_commands(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``memproxy`` console script."""
    args = _parser().parse_args(argv)
    if args.command == "serve":
        importlib.import_module("proxy.supervisor").serve_command(args)
    elif args.command == "reindex":
        # Imported here, not at the top: the server stack (LanceDB, onnxruntime, litellm clients) costs seconds
        # of CPU to import, and the memory-management commands only speak HTTP to a running server.
        importlib.import_module("proxy.server").run_command(args)
    elif args.command in _STORE_COMMANDS:
        raise SystemExit(importlib.import_module("proxy.cli.store").run_store_command(args))
    elif hasattr(args, "ops_handler"):
        raise SystemExit(args.ops_handler(args))
    else:
        raise SystemExit(run_memory_command(args))
