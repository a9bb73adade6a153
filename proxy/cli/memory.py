"""``memproxy memories ...`` and ``memproxy insights ...``: the management API from a terminal.

The commands talk to a running server (``--url``) with the admin key read from the environment
(``MEMPROXY_ADMIN__API_KEY``, or the variable named by ``--key-env``), print readable tables by default and
the API's JSON with ``--json``. Exit codes: 0 done, 1 the server refused or could not be reached, 2 bad usage.
The client is plain ``urllib``: one short request per command, no event loop needed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any

DEFAULT_URL = "http://127.0.0.1:8080"
KEY_ENV = "MEMPROXY_ADMIN__API_KEY"
KINDS = ("turn", "fact", "summary", "insight", "subject")
TIMEOUT_S = 120.0
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class CommandError(Exception):
    """A command could not be done; ``code`` is the exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


# --- HTTP ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Client:
    """The management API of one server, with one admin key."""

    base_url: str
    key: str

    def _request(self, method: str, path: str, body: Any = None) -> urllib.request.Request:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Authorization": f"Bearer {self.key}", "Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        return urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)  # noqa: S310

    def open(self, method: str, path: str, body: Any = None) -> Any:
        """The open HTTP response, or ``CommandError`` with the server's own message."""
        try:
            return urllib.request.urlopen(self._request(method, path, body), timeout=TIMEOUT_S)  # noqa: S310
        except urllib.error.HTTPError as exc:
            raise CommandError(f"HTTP {exc.code}: {_error_message(exc.read())}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise CommandError(f"cannot reach memproxy at {self.base_url}: {reason}") from None

    def json(self, method: str, path: str, body: Any = None) -> Any:
        """The decoded JSON answer."""
        with self.open(method, path, body) as response:
            return json.loads(response.read())


def _error_message(raw: bytes) -> str:
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace")[:500] or "no details"


def user_path(user_id: str) -> str:
    """The API path of one user (every character that could change the path percent-encoded)."""
    return "/v1/memory/users/" + urllib.parse.quote(user_id, safe="")


def base_url(url: str) -> str:
    """The server root, also when given with a trailing ``/v1``."""
    url = url.rstrip("/")
    return url.removesuffix("/v1")


def client_for(args: argparse.Namespace) -> Client:
    """The client for the parsed arguments; exit 2 when the key is missing."""
    key = os.environ.get(args.key_env, "")
    if not key:
        raise CommandError(f"no admin key: set {args.key_env} (or pass --key-env NAME)", EXIT_USAGE)
    return Client(base_url(args.url), key)


# --- output -------------------------------------------------------------------------------------------


def short_date(value: str | None) -> str:
    """``2025-03-01 14:02`` from an ISO timestamp (UTC as stored)."""
    return value[:16].replace("T", " ") if value else "-"


def one_line(text: str, width: int) -> str:
    """``text`` on one line, cut to ``width`` characters with an ellipsis."""
    flat = " ".join(str(text).split())
    return flat if len(flat) <= width else flat[: max(1, width - 1)] + "…"


def table(rows: Sequence[Sequence[str]], headers: Sequence[str], out: IO[str], flexible: int = -1) -> None:
    """Print an aligned table; the ``flexible`` column takes what the terminal width leaves."""
    if not rows:
        return
    widths = [max(len(headers[i]), *(len(row[i]) for row in rows)) for i in range(len(headers))]
    total = shutil.get_terminal_size((120, 24)).columns
    flex = flexible % len(headers)
    room = total - sum(w for i, w in enumerate(widths) if i != flex) - 2 * (len(headers) - 1)
    widths[flex] = max(20, min(widths[flex], room))
    lines = [headers, ["-" * w for w in widths]] + [list(row) for row in rows]
    for line in lines:
        cells = [one_line(cell, widths[i]).ljust(widths[i]) for i, cell in enumerate(line)]
        out.write("  ".join(cells).rstrip() + "\n")


def memory_rows(records: Sequence[dict[str, Any]]) -> list[list[str]]:
    """Table rows for memory records."""
    return [
        [r["id"], r["kind"] + ("" if r.get("valid", True) else " (old)"), short_date(r.get("created_at")),
         r.get("category") or "-", str(r.get("importance", "-")), r["text"]]
        for r in records
    ]  # fmt: skip


MEMORY_HEADERS = ["ID", "KIND", "CREATED", "CATEGORY", "IMP", "TEXT"]


def print_json(data: Any, out: IO[str]) -> None:
    """``data`` as indented JSON."""
    out.write(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


# --- commands -----------------------------------------------------------------------------------------


def _pages(client: Client, path: str, query: dict[str, str], everything: bool) -> Iterator[dict[str, Any]]:
    cursor: str | None = None
    while True:
        params = {**query, **({"cursor": cursor} if cursor else {})}
        page = client.json("GET", f"{path}?{urllib.parse.urlencode(params)}")
        yield page
        cursor = page.get("next_cursor")
        if not everything or not cursor:
            return


def cmd_list(client: Client, args: argparse.Namespace, out: IO[str]) -> int:
    """List memories, newest first."""
    query = {"limit": str(args.limit)}
    if args.kind:
        query["kind"] = args.kind
    if args.history:
        query["include_invalid"] = "true"
    records: list[dict[str, Any]] = []
    next_cursor = None
    for page in _pages(client, user_path(args.user) + "/memories", query, args.all):
        records += page["data"]
        next_cursor = page.get("next_cursor")
    if args.json:
        print_json({"data": records, "next_cursor": next_cursor}, out)
        return EXIT_OK
    if not records:
        out.write(f"no memories for {args.user}\n")
        return EXIT_OK
    table(memory_rows(records), MEMORY_HEADERS, out)
    if next_cursor:
        out.write(f"… more: --all, or --limit above {args.limit}\n")
    return EXIT_OK


def cmd_add(client: Client, args: argparse.Namespace, out: IO[str]) -> int:
    """Add a fact."""
    body: dict[str, Any] = {"text": args.text, "kind": "fact"}
    if args.importance is not None:
        body["importance"] = args.importance
    if args.category:
        body["category"] = args.category
    record = client.json("POST", user_path(args.user) + "/memories", body)
    if args.json:
        print_json(record, out)
    else:
        out.write(f"added {record['id']}\n")
    return EXIT_OK


def cmd_edit(client: Client, args: argparse.Namespace, out: IO[str]) -> int:
    """Edit a memory's text or importance."""
    body: dict[str, Any] = {}
    if args.text is not None:
        body["text"] = args.text
    if args.importance is not None:
        body["importance"] = args.importance
    if not body:
        raise CommandError("give --text and/or --importance", EXIT_USAGE)
    path = f"{user_path(args.user)}/memories/{urllib.parse.quote(args.id, safe='')}"
    record = client.json("PATCH", path, body)
    if args.json:
        print_json(record, out)
    elif record["id"] != args.id:
        out.write(f"edited {args.id} -> {record['id']} (old version kept in history)\n")
    else:
        out.write(f"edited {record['id']}\n")
    return EXIT_OK


def cmd_delete(client: Client, args: argparse.Namespace, out: IO[str]) -> int:
    """Delete one memory."""
    path = f"{user_path(args.user)}/memories/{urllib.parse.quote(args.id, safe='')}"
    result = client.json("DELETE", path)
    if args.json:
        print_json(result, out)
    else:
        out.write(f"deleted {args.id}\n")
    return EXIT_OK


def _confirmed(args: argparse.Namespace) -> bool:
    if args.yes:
        return True
    if not sys.stdin.isatty():
        raise CommandError("refusing to forget without --yes when not run interactively", EXIT_USAGE)
    answer = input(f"Erase everything memproxy keeps about {args.user!r}? Type the user id to confirm: ")
    return bool(answer.strip() == args.user)


def cmd_forget(client: Client, args: argparse.Namespace, out: IO[str]) -> int:
    """Forget a user entirely."""
    if not _confirmed(args):
        out.write("not confirmed; nothing erased\n")
        return EXIT_FAILED
    result = client.json("DELETE", user_path(args.user))
    if args.json:
        print_json(result, out)
        return EXIT_OK
    counts = ", ".join(f"{n} {kind}" for kind, n in sorted(result["deleted"].items()) if n)
    out.write(f"forgot {args.user}: {result['total']} records erased ({counts or 'nothing was kept'})\n")
    return EXIT_OK


def cmd_export(client: Client, args: argparse.Namespace, out: IO[str]) -> int:
    """Write the user's JSONL export to a file or stdout."""
    with client.open("GET", user_path(args.user) + "/export") as response:
        if args.output is None:
            shutil.copyfileobj(response, sys.stdout.buffer)
            sys.stdout.buffer.flush()
            return EXIT_OK
        with open(args.output, "wb") as handle:
            shutil.copyfileobj(response, handle)
    with open(args.output, "rb") as handle:
        lines = sum(1 for _ in handle)
    out.write(f"exported {lines} records to {args.output}\n")
    return EXIT_OK


def cmd_search(client: Client, args: argparse.Namespace, out: IO[str]) -> int:
    """Show what would be injected for a message."""
    result = client.json("POST", user_path(args.user) + "/search", {"query": args.query, "k": args.k})
    if args.json:
        print_json(result, out)
        return EXIT_OK
    out.write("arms: " + (", ".join(result["arms"]) or "-") + "\n\n")
    rows = [[f"{hit['score']:.3f}", hit["kind"], hit["id"], hit["text"]] for hit in result["results"]]
    table(rows, ["SCORE", "KIND", "ID", "TEXT"], out)
    if not rows:
        out.write("nothing relevant found\n")
    out.write("\ninjected block:\n" + (result["injected_block"] or "(nothing would be injected)") + "\n")
    return EXIT_OK


def cmd_insights_list(client: Client, args: argparse.Namespace, out: IO[str]) -> int:
    """List the user's current insights."""
    page = client.json("GET", user_path(args.user) + "/insights?limit=500")
    if args.json:
        print_json(page, out)
        return EXIT_OK
    rows = [[item["id"], "-" if item["confidence"] is None else f"{item['confidence']:.2f}",
             f"{short_date(item['date_range']['start'])[:10]}..{short_date(item['date_range']['end'])[:10]}",
             str(item.get("size") or "-"), item["text"]] for item in page["data"]]  # fmt: skip
    table(rows, ["ID", "CONF", "DATES", "SIZE", "TEXT"], out)
    if not rows:
        out.write(f"no insights for {args.user}\n")
    return EXIT_OK


def cmd_regenerate(client: Client, args: argparse.Namespace, out: IO[str]) -> int:
    """Queue an insight run for the user."""
    result = client.json("POST", user_path(args.user) + "/insights/regenerate")
    if args.json:
        print_json(result, out)
    else:
        out.write(f"insight run queued for {args.user} (job {result['job_id']})\n")
    return EXIT_OK


# --- parser -------------------------------------------------------------------------------------------

Command = Callable[[Client, argparse.Namespace, IO[str]], int]


def connection_options() -> argparse.ArgumentParser:
    """``--url``, ``--key-env`` and ``--json``: how every command that speaks to a server is told where and how."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=DEFAULT_URL, help=f"the memproxy server (default {DEFAULT_URL})")
    common.add_argument(
        "--key-env",
        default=KEY_ENV,
        metavar="NAME",
        help=f"environment variable holding the admin key (default {KEY_ENV})",
    )
    common.add_argument("--json", action="store_true", help="print the API's JSON instead of a table")
    return common


def _common() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False, parents=[connection_options()])
    common.add_argument("--user", required=True, help="the user id")
    return common


def _importance(value: str) -> int:
    number = int(value)
    if not 1 <= number <= 10:
        raise argparse.ArgumentTypeError("importance is 1 to 10")
    return number


def _add_memories(subparsers: Any, common: argparse.ArgumentParser) -> None:
    memories = subparsers.add_parser("memories", help="see, add, edit, delete, export or forget memories")
    actions = memories.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", parents=[common], help="list memories, newest first")
    listing.add_argument("--kind", choices=KINDS, help="only this kind")
    listing.add_argument("--limit", type=int, default=50, help="page size, 1-500 (default 50)")
    listing.add_argument("--all", action="store_true", help="follow every page")
    listing.add_argument("--history", action="store_true", help="include superseded and replaced records")
    listing.set_defaults(handler=cmd_list)
    add = actions.add_parser("add", parents=[common], help="add a fact")
    add.add_argument("text")
    add.add_argument("--importance", type=_importance, help="1 (trivia) to 10 (core identity)")
    add.add_argument("--category", help="e.g. identity, work, preference")
    add.set_defaults(handler=cmd_add)
    edit = actions.add_parser("edit", parents=[common], help="change a memory's text or importance")
    edit.add_argument("id")
    edit.add_argument("--text")
    edit.add_argument("--importance", type=_importance)
    edit.set_defaults(handler=cmd_edit)
    delete = actions.add_parser("delete", parents=[common], help="delete one memory")
    delete.add_argument("id")
    delete.set_defaults(handler=cmd_delete)
    forget = actions.add_parser("forget", parents=[common], help="erase everything kept about the user")
    forget.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    forget.set_defaults(handler=cmd_forget)
    export = actions.add_parser("export", parents=[common], help="everything kept, as JSON lines")
    export.add_argument("--output", "-o", help="write to this file instead of stdout")
    export.set_defaults(handler=cmd_export)
    search = actions.add_parser("search", parents=[common], help="what would be injected for a message")
    search.add_argument("query")
    search.add_argument("-k", type=int, default=10, help="how many results (1-50, default 10)")
    search.set_defaults(handler=cmd_search)


def _add_insights(subparsers: Any, common: argparse.ArgumentParser) -> None:
    insights = subparsers.add_parser("insights", help="see or regenerate a user's insights")
    actions = insights.add_subparsers(dest="action", required=True)
    actions.add_parser("list", parents=[common], help="the current insights").set_defaults(handler=cmd_insights_list)
    actions.add_parser("regenerate", parents=[common], help="queue a fresh insight run").set_defaults(
        handler=cmd_regenerate
    )


def add_memory_commands(subparsers: Any) -> None:
    """Add ``memories`` and ``insights`` to the ``memproxy`` parser's subcommands."""
    common = _common()
    _add_memories(subparsers, common)
    _add_insights(subparsers, common)


def run_memory_command(args: argparse.Namespace, out: IO[str] | None = None) -> int:
    """Run a parsed ``memories`` or ``insights`` command; returns the exit code."""
    out = out or sys.stdout
    handler: Command = args.handler
    try:
        return handler(client_for(args), args, out)
    except CommandError as exc:
        print(f"memproxy: {exc}", file=sys.stderr)
        return exc.code
