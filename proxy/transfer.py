"""Moving memories in and out of a store: memproxy JSONL (with vectors), mem0 exports, ChatGPT saved memories.

Export streams every record (of one user or of everyone) as one JSON object per line: the record's public
fields plus ``embedding`` (the stored float32 vector, written exactly). Importing that file into an empty store
gives the same records: ids, texts, vectors and every other field.

Import is all or nothing at the level of the input: the whole file is parsed and checked first (an error names
the line, or the item of a JSON document) and only then written, in chunks. Records keep their ids (mem0's ids;
for ChatGPT lines and id-less batch items, an id derived from user, kind and text), and the store ignores an id
it already holds, so importing the same file twice adds nothing, and re-running an interrupted import finishes
it. A record embedded by another model than the store's (or without a vector) is embedded again.

Import is as strict as the API: a user id must follow the API's rule (``APP_ID_RULE``: one the API could not list,
export or forget is refused), a text longer than a chat turn may be (``memory.max_turn_chars``) is capped the same
way (head and tail around a marker), a vector must be finite and, when it is the store's model's, of its dimension,
and one id given to two users in one file is an error naming both lines. The store's own export always imports.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from datetime import UTC, datetime
from typing import Any, Literal, Protocol

import numpy as np
import orjson
from pydantic import TypeAdapter, ValidationError

from proxy.memory import cap_text
from proxy.memory.store import APP_ID_RULE, Kind, MemoryRecord, valid_app_id, valid_record_id

Format = Literal["memproxy", "mem0", "chatgpt"]
MAX_TEXT_CHARS = 4000
MAX_TURN_CHARS = 16_000  # memory.max_turn_chars's default
CHUNK_RECORDS = 512
_RECORD = TypeAdapter(MemoryRecord)
_FIELDS = frozenset(field.name for field in dataclasses.fields(MemoryRecord))
_BULLET = re.compile(r"^\s*(?:[-*•]|\d+[.)])\s+")


class ImportFormatError(ValueError):
    """The input is not valid for its format; the message names the line (or item) and the problem."""


class RecordStore(Protocol):
    """What import and export need from ``proxy.memory.store.memory_store.MemoryStore``."""

    async def add(self, records: Sequence[MemoryRecord]) -> list[MemoryRecord]: ...

    async def get_many(self, user_id: str, ids: Sequence[str]) -> list[MemoryRecord]: ...

    def records_with_vectors(self, user_id: str | None = None) -> AsyncIterator[MemoryRecord]: ...


# --- export -------------------------------------------------------------------------------------------


def export_line(record: MemoryRecord) -> bytes:
    """One record as a JSON line, its vector included."""
    row = record.public_dict()
    row["embedding"] = None if record.embedding is None else np.asarray(record.embedding, dtype=np.float32)
    return orjson.dumps(row, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_APPEND_NEWLINE)


async def export_lines(store: RecordStore, user_id: str | None = None) -> AsyncIterator[bytes]:
    """Every record of ``user_id`` (or of everyone), streamed as JSON lines."""
    async for record in store.records_with_vectors(user_id):
        yield export_line(record)


# --- parsing ------------------------------------------------------------------------------------------


def content_id(user_id: str, kind: str, text: str) -> str:
    """A stable id for a memory that came without one: the same user, kind and text give the same id."""
    return hashlib.sha256(f"{user_id}\0{kind}\0{text}".encode()).hexdigest()[:32]


def _utc(value: datetime | None) -> datetime | None:
    if value is None:
        return None
    return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    where = ".".join(str(part) for part in error["loc"])
    return f"{where}: {error['msg']}" if where else str(error["msg"])


def checked(record: MemoryRecord, where: str, max_chars: int = MAX_TURN_CHARS) -> MemoryRecord:
    """``record`` with UTC timestamps and its text capped at ``max_chars``, or ``ImportFormatError`` naming
    ``where`` if the API would refuse it (user id, id, empty text, a vector that is not finite)."""
    if not valid_app_id(record.user_id):
        raise ImportFormatError(f"{where}: user_id: must be {APP_ID_RULE}")
    if not valid_record_id(record.id):
        raise ImportFormatError(f"{where}: id: not a valid record id")
    if not record.text.strip():
        raise ImportFormatError(f"{where}: text: empty")
    if record.embedding is not None and not np.isfinite(np.asarray(record.embedding, dtype=np.float32)).all():
        raise ImportFormatError(f"{where}: embedding: holds a value that is not a finite float32")
    times = {
        name: _utc(getattr(record, name))
        for name in ("created_at", "updated_at", "last_accessed_at", "start_at", "end_at", "expires_at")
    }
    return record.replace(text=cap_text(record.text, max_chars), **times)


def parse_memproxy_line(line: bytes | str, number: int, max_chars: int = MAX_TURN_CHARS) -> MemoryRecord | None:
    """One line of memproxy JSONL as a record (None for a blank line)."""
    where = f"line {number}"
    if not line.strip():
        return None
    try:
        row = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise ImportFormatError(f"{where}: not JSON: {exc}") from None
    if not isinstance(row, dict):
        raise ImportFormatError(f"{where}: expected a JSON object")
    unknown = sorted(set(row) - _FIELDS)
    if unknown:
        raise ImportFormatError(f"{where}: unknown field {unknown[0]!r}")
    try:
        record = _RECORD.validate_python(row)
    except ValidationError as exc:
        raise ImportFormatError(f"{where}: {_first_error(exc)}") from None
    if record.embedding is not None:
        with np.errstate(over="ignore"):  # 1e308 becomes inf: refused by ``checked``
            record = record.replace(embedding=np.asarray(record.embedding, dtype=np.float32))
    return checked(record, where, max_chars)


def parse_memproxy(lines: Iterable[bytes | str], max_chars: int = MAX_TURN_CHARS) -> Iterator[MemoryRecord]:
    """Records from memproxy JSONL (``memproxy export`` or the per-user export of the management API); an id
    given to two users is an error naming both lines."""
    owners: dict[str, tuple[str, int]] = {}
    for number, line in enumerate(lines, start=1):
        record = parse_memproxy_line(line, number, max_chars)
        if record is None:
            continue
        owner, first = owners.setdefault(record.id, (record.user_id, number))
        if owner != record.user_id:
            raise ImportFormatError(
                f"line {number}: id {record.id[:64]!r} is also the id of user {owner[:64]!r}'s record on line {first}"
            )
        yield record


def _mem0_items(document: Any) -> list[Any]:
    if isinstance(document, dict) and isinstance(document.get("results"), list):
        return list(document["results"])
    if isinstance(document, dict) and isinstance(document.get("memories"), list):
        return list(document["memories"])
    if isinstance(document, list):
        return document
    raise ImportFormatError('item 0: expected mem0\'s get_all output: a list or {"results": [...]}')


def _mem0_record(item: Any, index: int, user_id: str | None) -> MemoryRecord:
    where = f"item {index}"
    if not isinstance(item, dict):
        raise ImportFormatError(f"{where}: expected a JSON object")
    text = item.get("memory") if isinstance(item.get("memory"), str) else item.get("text")
    owner = user_id or item.get("user_id")
    if not isinstance(text, str):
        raise ImportFormatError(f"{where}: memory: missing or not a string")
    if not isinstance(owner, str) or not owner:
        raise ImportFormatError(f"{where}: user_id: missing (pass --user)")
    categories = item.get("categories") or []
    meta = {"source": "mem0", **{k: item[k] for k in ("hash", "metadata", "agent_id", "run_id") if item.get(k)}}
    text = text.strip()
    record_id = str(item.get("id") or "") or content_id(owner, "fact", text)
    row = {
        "user_id": owner,
        "kind": "fact",
        "text": text,
        "id": record_id,
        "category": categories[0] if categories and isinstance(categories[0], str) else None,
        "meta": json.dumps(meta, ensure_ascii=False),
    }
    for name in ("created_at", "updated_at"):
        if item.get(name):
            row[name] = item[name]
    if item.get("expiration_date"):  # mem0's name for the same thing
        row["expires_at"] = item["expiration_date"]
    try:
        return checked(_RECORD.validate_python(row), where)
    except ValidationError as exc:
        raise ImportFormatError(f"{where}: {_first_error(exc)}") from None


def parse_mem0(raw: bytes, user_id: str | None = None) -> list[MemoryRecord]:
    """Facts from mem0's ``get_all`` JSON (v1.0 list or v1.1 ``{"results": [...]}``), keeping mem0's ids."""
    try:
        document = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ImportFormatError(f"line 1: not JSON: {exc}") from None
    return [_mem0_record(item, i, user_id) for i, item in enumerate(_mem0_items(document))]


def parse_chatgpt_line(line: str, number: int, user_id: str) -> MemoryRecord | None:
    """One saved ChatGPT memory (a text line, a leading bullet or number dropped) as a fact."""
    text = _BULLET.sub("", line).strip()
    if not text:
        return None
    if len(text) > MAX_TEXT_CHARS:
        raise ImportFormatError(f"line {number}: longer than {MAX_TEXT_CHARS} characters")
    record = MemoryRecord(
        user_id=user_id, kind=Kind.FACT, text=text, id=content_id(user_id, "fact", text), meta='{"source": "chatgpt"}'
    )
    return checked(record, f"line {number}")


def parse_chatgpt(lines: Iterable[str], user_id: str) -> Iterator[MemoryRecord]:
    """Facts from ChatGPT's saved memories, one per line (as copied from Settings > Personalization)."""
    for number, line in enumerate(lines, start=1):
        record = parse_chatgpt_line(line, number, user_id)
        if record is not None:
            yield record


# --- writing ------------------------------------------------------------------------------------------


def check_vectors(records: Iterable[MemoryRecord], model_id: str, dim: int) -> int:
    """The number of records; ``ImportFormatError`` for a vector said to be the store's model's but of another
    dimension (a vector of another model is embedded again)."""
    count = 0
    for count, record in enumerate(records, start=1):
        if record.embedding is not None and record.model_id == model_id and len(record.embedding) != dim:
            raise ImportFormatError(
                f"record {count} (id {record.id[:64]!r}): embedding: {len(record.embedding)} values, but {model_id} "
                f"makes {dim}"
            )
    return count


def for_model(record: MemoryRecord, model_id: str, dim: int) -> MemoryRecord:
    """``record`` as the store can take it: its vector kept only if it is this model's and this size."""
    embedding = record.embedding
    if embedding is not None and record.model_id == model_id and len(embedding) == dim:
        return record
    return record.replace(embedding=None, model_id="")


@dataclasses.dataclass
class ImportCounts:
    """What an import did."""

    read: int = 0
    added: int = 0
    existing: int = 0
    reembedded: int = 0


async def _present(store: RecordStore, records: Sequence[MemoryRecord]) -> set[str]:
    by_user: dict[str, list[str]] = defaultdict(list)
    for record in records:
        by_user[record.user_id].append(record.id)
    present: set[str] = set()
    for user_id, ids in by_user.items():
        present.update(record.id for record in await store.get_many(user_id, ids))
    return present


async def write_records(
    store: RecordStore, records: Sequence[MemoryRecord], model_id: str, dim: int, counts: ImportCounts
) -> list[MemoryRecord]:
    """Add one chunk of already-checked records, skipping (and counting) ids the store holds."""
    present = await _present(store, records)
    new = {r.id: for_model(r, model_id, dim) for r in records if r.id not in present}
    counts.read += len(records)
    counts.existing += len(records) - len(new)
    counts.reembedded += sum(1 for r in new.values() if r.embedding is None)
    stored = await store.add(list(new.values())) if new else []
    counts.added += len(stored)
    return stored


def chunked(records: Iterable[MemoryRecord], size: int = CHUNK_RECORDS) -> Iterator[list[MemoryRecord]]:
    """``records`` in lists of at most ``size``."""
    chunk: list[MemoryRecord] = []
    for record in records:
        chunk.append(record)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


async def import_records(
    store: RecordStore,
    records: Iterable[MemoryRecord],
    model_id: str,
    dim: int,
    progress: Callable[[int], None] | None = None,
) -> ImportCounts:
    """Write ``records`` (checked beforehand) chunk by chunk; ``progress`` gets each chunk's size."""
    counts = ImportCounts()
    for chunk in chunked(records):
        await write_records(store, chunk, model_id, dim, counts)
        if progress is not None:
            progress(len(chunk))
    return counts
