"""The ``memproxy`` command line: ``serve`` runs the proxy; the other commands manage memory."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvloop

from proxy.cli_memory import add_memory_commands, run_memory_command
from proxy.config import ConfigError, Settings, load_settings
from proxy.logs import configure_logging
from proxy.server import reindex, serve

EXIT_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memproxy", description="A memory sidecar for chat-completion APIs.")
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("serve", help="run the proxy")
    run.add_argument("--config", type=Path, help="TOML config file (default: $MEMPROXY_CONFIG or built-in)")
    run.add_argument("--host", help="listen address (overrides server.host)")
    run.add_argument("--port", type=int, help="listen port (overrides server.port; 0 picks a free one)")
    reindex = commands.add_parser("reindex", help="re-embed every memory with the configured embedding model "
                                  "(stop the server first: one process owns the data directory)")
    reindex.add_argument("--config", type=Path, help="TOML config file (default: $MEMPROXY_CONFIG or built-in)")
    add_memory_commands(commands)
    return parser


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    server: dict[str, Any] = {}
    if getattr(args, "host", None) is not None:
        server["host"] = args.host
    if getattr(args, "port", None) is not None:
        server["port"] = args.port
    return {"server": server} if server else {}


def load_or_exit(args: argparse.Namespace) -> Settings:
    """The settings, or exit code 2 with one message naming the bad key."""
    try:
        return load_settings(getattr(args, "config", None), overrides=_overrides(args))
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        raise SystemExit(EXIT_CONFIG) from None


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point of the ``memproxy`` console script."""
    args = _parser().parse_args(argv)
    if args.command == "serve":
        settings = load_or_exit(args)
        configure_logging(settings.logging.level)
        uvloop.run(serve(settings))
    elif args.command == "reindex":
        settings = load_or_exit(args)
        configure_logging("warning")
        count = uvloop.run(reindex(settings))
        print(f"re-embedded {count} memories with {settings.embedder.model}")
    else:
        raise SystemExit(run_memory_command(args))


if __name__ == "__main__":
    main()
