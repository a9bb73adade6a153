"""Operator commands of ``memproxy``: ``config``, ``export``, ``import``, ``migrate``, ``eval``, ``dead-letters``.

Only the parsers live here (cheap to import). ``config``, ``export``, ``import``, ``migrate`` and ``eval`` open
the configuration and the data directory themselves and run in ``proxy.cli.store`` (stop the server first, one
process owns a data directory; a running server takes bulk adds at ``POST .../memories:batch`` instead).
``dead-letters`` speaks to a running server's management API like ``memproxy memories``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from proxy.cli.memory import (
    EXIT_OK,
    Client,
    CommandError,
    client_for,
    connection_options,
    one_line,
    print_json,
    short_date,
    table,
)

IMPORT_FORMATS = ("memproxy", "mem0", "chatgpt")
DEAD_LETTERS_PATH = "/v1/memory/dead-letters"


def _config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="TOML config file (default: $MEMPROXY_CONFIG or built-in)")


def _add_config(commands: Any) -> None:
    config = commands.add_parser("config", help="check a config file or print its JSON Schema")
    actions = config.add_subparsers(dest="action", required=True)
    check = actions.add_parser(
        "check", help="validate FILE (and MEMPROXY_* variables) without starting; exit 2 naming the bad key"
    )
    check.add_argument("file", type=Path)
    actions.add_parser("schema", help="the JSON Schema of the TOML file (for editors)")


def _add_transfer(commands: Any) -> None:
    export = commands.add_parser("export", help="every memory (or one user's) as JSON lines with vectors")
    _config_arg(export)
    export.add_argument("--user", help="only this user")
    export.add_argument("--output", "-o", type=Path, help="write to this file instead of stdout")
    imp = commands.add_parser("import", help="add memories from a file: idempotent, all or nothing")
    _config_arg(imp)
    imp.add_argument("file", type=Path, help="the file to read ('-' for stdin)")
    imp.add_argument(
        "--format",
        choices=IMPORT_FORMATS,
        default="memproxy",
        help="memproxy JSONL (default), mem0 get_all JSON, or ChatGPT saved memories (text lines)",
    )
    imp.add_argument(
        "--user",
        help="the user the memories belong to (required for chatgpt; for mem0, overrides the user_id of each item)",
    )
    migrate = commands.add_parser("migrate", help="bring the data directory's schemas up to this version")
    _config_arg(migrate)


def _add_eval(commands: Any) -> None:
    evaluate = commands.add_parser(
        "eval", help="the retrieval benchmark on a LoCoMo-layout file with the current configuration"
    )
    _config_arg(evaluate)
    evaluate.add_argument("--data", type=Path, required=True, help="a JSON file in LoCoMo's layout")
    evaluate.add_argument("--json", action="store_true", help="print the metrics as JSON")


def _add_dead_letters(commands: Any) -> None:
    dead = commands.add_parser("dead-letters", help="memory jobs that gave up: list or requeue them")
    actions = dead.add_subparsers(dest="action", required=True)
    common = connection_options()
    listing = actions.add_parser("list", parents=[common], help="the most recent dead jobs")
    listing.add_argument("--limit", type=int, default=100, help="how many (1-1000, default 100)")
    listing.set_defaults(ops_handler=_run(cmd_dead_list))
    requeue = actions.add_parser("requeue", parents=[common], help="give a dead job a fresh set of attempts")
    requeue.add_argument("job_id", nargs="+")
    requeue.set_defaults(ops_handler=_run(cmd_dead_requeue))


def add_ops_commands(commands: Any) -> None:
    """Add the operator commands to the ``memproxy`` parser's subcommands."""
    _add_config(commands)
    _add_transfer(commands)
    _add_eval(commands)
    _add_dead_letters(commands)


# --- dead letters over HTTP ---------------------------------------------------------------------------


def cmd_dead_list(client: Client, args: argparse.Namespace, out: IO[str]) -> int:
    """``memproxy dead-letters list``."""
    result = client.json("GET", f"{DEAD_LETTERS_PATH}?limit={args.limit}")
    if args.json:
        print_json(result, out)
        return EXIT_OK
    rows = [
        [
            job["id"],
            job["kind"],
            job.get("user_id") or "-",
            str(job["attempts"]),
            short_date(job.get("updated_at")),
            one_line(job.get("last_error") or "", 80),
        ]
        for job in result["data"]
    ]
    if not rows:
        out.write("no dead letters\n")
    table(rows, ["id", "kind", "user", "attempts", "died", "last error"], out)
    return EXIT_OK


def cmd_dead_requeue(client: Client, args: argparse.Namespace, out: IO[str]) -> int:
    """``memproxy dead-letters requeue ID...``."""
    for job_id in args.job_id:
        result = client.json("POST", f"{DEAD_LETTERS_PATH}/{job_id}/requeue")
        if args.json:
            print_json(result, out)
        else:
            out.write(f"requeued {result['id']} ({result['kind']})\n")
    return EXIT_OK


def _run(command: Callable[[Client, argparse.Namespace, IO[str]], int]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        try:
            return command(client_for(args), args, sys.stdout)
        except CommandError as exc:
            print(f"memproxy: {exc}", file=sys.stderr)
            return exc.code

    return run
