"""The operator commands that open the configuration or the data directory: ``config``, ``export``, ``import``,
``migrate`` and ``eval`` (parsers in ``proxy.cli.ops``).

Exit codes: 0 done, 1 failed (the store refused, the data directory is in use...), 2 bad configuration or bad
input (the message names the key, or the line).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from pathlib import Path
from typing import IO

import uvloop
from tqdm import tqdm

from proxy.config import ConfigError, Settings, load_settings
from proxy.evaluation import EvalDataError, run_eval_command
from proxy.logs import configure_logging
from proxy.memory import MemoryLayerError
from proxy.memory.embedders import build_embedder
from proxy.memory.store import MemoryRecord, MemoryStore, SchemaError, migrate_data_dir
from proxy.transfer import (
    ImportCounts,
    ImportFormatError,
    check_vectors,
    export_lines,
    import_records,
    parse_chatgpt,
    parse_mem0,
    parse_memproxy,
)

EXIT_OK, EXIT_FAILED, EXIT_INPUT = 0, 1, 2


class StoreCommandError(Exception):
    """A store command failed; ``code`` is the exit code."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


def _settings(path: Path | None) -> Settings:
    try:
        return load_settings(path)
    except ConfigError as exc:
        raise StoreCommandError(str(exc), EXIT_INPUT) from None


@contextlib.asynccontextmanager
async def open_store(settings: Settings, *, allow_mismatch: bool = False) -> AsyncIterator[MemoryStore]:
    """The configured embedder and store, opened for one command (the server must not be running)."""
    async with build_embedder(settings.embedder) as embedder:
        store = MemoryStore(settings.store_settings(), embedder, allow_mismatch=allow_mismatch)
        async with store:  # a StoreError when a running server owns the directory
            yield store


# --- config -------------------------------------------------------------------------------------------


def cmd_config(args: argparse.Namespace, out: IO[str]) -> int:
    """``memproxy config check FILE`` and ``memproxy config schema``."""
    if args.action == "schema":
        schema = Settings.model_json_schema()
        schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
        schema["title"] = "memproxy configuration (TOML)"
        out.write(json.dumps(schema, indent=2, sort_keys=True) + "\n")
        return EXIT_OK
    settings = _settings(args.file)
    out.write(
        f"{args.file}: ok (upstream {settings.upstream.base_url}, data {settings.storage.path}, "
        f"{len(settings.routes)} routes)\n"
    )
    return EXIT_OK


# --- export -------------------------------------------------------------------------------------------


async def export_store(settings: Settings, user_id: str | None, sink: IO[bytes]) -> int:
    """Stream the store (or one user) to ``sink`` as memproxy JSONL; returns the record count."""
    if not (settings.storage.path / "lance" / "manifest.json").exists():
        raise StoreCommandError(f"no memory store in {settings.storage.path} (storage.path)")
    count = 0
    async with open_store(settings, allow_mismatch=True) as store:
        async for line in export_lines(store, user_id):
            sink.write(line)
            count += 1
    sink.flush()
    return count


def cmd_export(args: argparse.Namespace, out: IO[str]) -> int:
    """``memproxy export [--user U] [-o FILE]``."""
    settings = _settings(args.config)
    if args.output is None:
        count = uvloop.run(export_store(settings, args.user, sys.stdout.buffer))
    else:
        tmp = args.output.with_name(args.output.name + ".partial")
        with tmp.open("wb") as sink:
            count = uvloop.run(export_store(settings, args.user, sink))
        tmp.replace(args.output)
    print(f"exported {count} records", file=sys.stderr)
    return EXIT_OK


# --- import -------------------------------------------------------------------------------------------


def _text_lines(raw: bytes) -> list[str]:
    return raw.decode("utf-8-sig").splitlines()


def _reader(args: argparse.Namespace, max_chars: int) -> Callable[[], Iterable[MemoryRecord]]:
    """A function that parses the whole input once more each time it is called (check passes, a write pass);
    texts are capped at ``max_chars`` like chat turns."""
    raw = sys.stdin.buffer.read() if str(args.file) == "-" else None
    if raw is None and not args.file.is_file():
        raise StoreCommandError(f"{args.file}: no such file", EXIT_INPUT)
    if args.format == "mem0":
        records = parse_mem0(raw if raw is not None else args.file.read_bytes(), args.user)
        return lambda: records
    if args.format == "chatgpt":
        if not args.user:
            raise StoreCommandError("--user is required for --format chatgpt", EXIT_INPUT)
        lines = _text_lines(raw if raw is not None else args.file.read_bytes())
        return lambda: parse_chatgpt(lines, args.user)
    if raw is not None:
        lines_b = raw.splitlines()
        return lambda: parse_memproxy(lines_b, max_chars)
    return lambda: _file_records(args.file, max_chars)


def _file_records(path: Path, max_chars: int) -> Iterator[MemoryRecord]:
    with path.open("rb") as handle:
        yield from parse_memproxy(handle, max_chars)


async def import_into(settings: Settings, read: Callable[[], Iterable[MemoryRecord]], total: int) -> ImportCounts:
    """Write the (already checked) input into the store, with a progress bar on a terminal."""
    async with open_store(settings) as store:
        embedder = store.embedder
        check_vectors(read(), embedder.model_id, embedder.dim)  # before anything is written
        with tqdm(total=total, unit="memory", desc="import", disable=not sys.stderr.isatty()) as bar:
            return await import_records(store, read(), embedder.model_id, embedder.dim, bar.update)


def cmd_import(args: argparse.Namespace, out: IO[str]) -> int:
    """``memproxy import FILE [--format memproxy|mem0|chatgpt] [--user U]``."""
    settings = _settings(args.config)
    read = _reader(args, settings.memory.max_turn_chars)
    total = sum(1 for _ in read())  # the check pass: nothing is written unless every line is valid
    counts = uvloop.run(import_into(settings, read, total))
    out.write(
        f"read {counts.read}, added {counts.added}, already present {counts.existing}, embedded {counts.reembedded}\n"
    )
    return EXIT_OK


# --- migrate and eval ---------------------------------------------------------------------------------


def cmd_migrate(args: argparse.Namespace, out: IO[str]) -> int:
    """``memproxy migrate``: bring every store in the data directory to this version's schemas."""
    settings = _settings(args.config)
    for line in migrate_data_dir(settings.storage.path, settings.jobs_settings().path):
        out.write(line + "\n")
    return EXIT_OK


def cmd_eval(args: argparse.Namespace, out: IO[str]) -> int:
    """``memproxy eval --data FILE``."""
    try:
        return run_eval_command(_settings(args.config), args.data, as_json=args.json, out=out)
    except EvalDataError as exc:
        raise StoreCommandError(str(exc), EXIT_INPUT) from None


COMMANDS: dict[str, Callable[[argparse.Namespace, IO[str]], int]] = {
    "config": cmd_config,
    "export": cmd_export,
    "import": cmd_import,
    "migrate": cmd_migrate,
    "eval": cmd_eval,
}


def run_store_command(args: argparse.Namespace, out: IO[str] | None = None) -> int:
    """Run a parsed store command; returns the exit code."""
    configure_logging("warning")
    try:
        return COMMANDS[args.command](args, out or sys.stdout)
    except ImportFormatError as exc:
        print(f"memproxy: {args.file}: {exc}; nothing was imported", file=sys.stderr)
        return EXIT_INPUT
    except (StoreCommandError, SchemaError) as exc:
        print(f"memproxy: {exc}", file=sys.stderr)
        return getattr(exc, "code", EXIT_FAILED)
    except MemoryLayerError as exc:
        hint = "; stop the server first (a running one takes POST .../memories:batch)" if "in use" in str(exc) else ""
        print(f"memproxy: {exc}{hint}", file=sys.stderr)
        return EXIT_FAILED
