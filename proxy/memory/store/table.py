"""The LanceDB side of the store: the table of record, safe filters, the batch writer and maintenance.

LanceDB is the source of truth. One table holds every kind of memory of every user (``records.py``); a
manifest beside it (``lance/manifest.json``) names the live table and the embedding model and dimension it
was built with, so a store opened with another model refuses to start (``EmbedderMismatch``) and
``reindex`` can build a fresh table and swap it in atomically.

Filters are SQL strings, so every value is quoted by ``sql_string`` (single quotes doubled, the only escape
DataFusion's string literals know) and user ids are validated by ``check_user_id`` before they get there;
times are passed as integer microseconds. Writes are batched (``BatchWriter``: one ``add`` per flush, on
size or time), compaction and version cleanup run on a timer (``Ticker``), and the indexes (Bitmap on
``user_id``, BTree on ``id``, HNSW-SQ cosine on ``embedding`` past a size) are created as the table grows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Generic, TypeVar

import lancedb
import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import structlog
from lancedb.index import Bitmap, BTree, HnswSq

from proxy.memory.errors import EmbedderMismatch, InvalidUserId, StoreError
from proxy.memory.store.faults import StorageHealth, is_storage_fault
from proxy.memory.store.migrations import check_records_schema
from proxy.memory.store.records import SCHEMA_VERSION, Kind, MemoryRecord, arrow_schema, from_row

log = structlog.get_logger(__name__)

MAX_ID_BYTES = 512
RECORD_COLUMNS = [name for name in arrow_schema(1).names if name != "embedding"]
_IN_CHUNK = 512
# HNSW build parameters, cheaper than Lance's defaults (m 20, ef_construction 300): indexing 30k x 384
# took 44 s instead of 160 s on two busy cores.
ANN_M = 16
ANN_EF_CONSTRUCTION = 100
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")  # Unicode categories Cc and Cs
_PURGE_CLEANUP = timedelta(milliseconds=1)  # every version but the latest (0 would warn about readers)
_T = TypeVar("_T")


# --- filters -------------------------------------------------------------------------------------------


def check_user_id(user_id: str) -> str:
    """``user_id`` if the store accepts it: 1-512 UTF-8 bytes, no control characters."""
    if not isinstance(user_id, str) or not user_id:
        raise InvalidUserId("user id must be a non-empty string")
    if len(user_id.encode("utf-8", "surrogatepass")) > MAX_ID_BYTES:
        raise InvalidUserId(f"user id is longer than {MAX_ID_BYTES} bytes")
    if _CONTROL.search(user_id):
        raise InvalidUserId("user id contains control characters")
    return user_id


def valid_record_id(record_id: str) -> bool:
    """Whether ``record_id`` can name a record (same rules as user ids)."""
    try:
        check_user_id(record_id)
    except InvalidUserId:
        return False
    return True


def sql_string(value: str) -> str:
    """``value`` as a SQL string literal: single quotes doubled, nothing else interpreted."""
    return "'" + str(value).replace("'", "''") + "'"


def sql_in(column: str, values: Sequence[str]) -> str:
    """``column IN (...)`` over quoted ``values`` (which must not be empty)."""
    return f"{column} IN ({', '.join(sql_string(value) for value in values)})"


def record_filter(
    user_id: str,
    *,
    ids: Sequence[str] | None = None,
    kinds: Sequence[Kind] | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    include_invalid: bool = True,
) -> str:
    """A filter that can only ever match rows of ``user_id``."""
    clauses = [f"user_id = {sql_string(check_user_id(user_id))}"]
    if ids is not None:
        clauses.append(sql_in("id", ids) if ids else "FALSE")
    if kinds:
        clauses.append(sql_in("kind", [str(Kind(kind)) for kind in kinds]))
    if since is not None:
        clauses.append(f"created_at >= to_timestamp_micros({_micros(since)})")
    if until is not None:
        clauses.append(f"created_at <= to_timestamp_micros({_micros(until)})")
    if not include_invalid:
        clauses.append("valid = TRUE")
    return " AND ".join(f"({clause})" for clause in clauses)


def _micros(at: datetime) -> int:
    if at.tzinfo is None:
        raise ValueError("time filters must be timezone-aware")
    return int(at.timestamp() * 1_000_000)


def _chunks(values: Sequence[_T], size: int = _IN_CHUNK) -> list[Sequence[_T]]:
    return [values[i : i + size] for i in range(0, len(values), size)]


# --- manifest ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """Which table is live, and the vector space it was built in."""

    table: str
    model_id: str
    dim: int
    schema_version: int = SCHEMA_VERSION

    @classmethod
    def read(cls, path: Path) -> Manifest | None:
        """The manifest at ``path``, or None before the first open."""
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        return cls(data["table"], data["model_id"], int(data["dim"]), int(data["schema_version"]))

    def write(self, path: Path) -> None:
        """Replace the manifest atomically (write, fsync, rename)."""
        tmp = path.with_suffix(".tmp")
        with tmp.open("w") as handle:
            json.dump(self.__dict__, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)


class LocalManifest:
    """The manifest as a file beside the local tables."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def read(self) -> Manifest | None:
        """The manifest, or None before the first open."""
        return Manifest.read(self.path)

    async def write(self, manifest: Manifest) -> None:
        """Replace the manifest atomically."""
        manifest.write(self.path)


@dataclass(frozen=True)
class SharedTable:
    """A table on object storage that several replicas use (``proxy/memory/store/cluster.py`` builds it).

    ``manifests`` has async ``read()``/``write(manifest)`` (an object next to the table); reads see other
    replicas' commits within ``read_consistency``; a purge keeps versions younger than ``purge_cleanup`` and
    never deletes unreferenced files (they may be another replica's commit in flight).
    """

    uri: str
    storage_options: dict[str, str]
    manifests: Any
    read_consistency: timedelta
    purge_cleanup: timedelta


# --- the table -----------------------------------------------------------------------------------------


class ReadGate:
    """Lets reads run together, and lets a cleanup that deletes old versions' files wait them out."""

    def __init__(self) -> None:
        self._readers = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._open = asyncio.Event()
        self._open.set()

    @contextlib.asynccontextmanager
    async def read(self) -> AsyncIterator[None]:
        """Hold the gate open for one read."""
        await self._open.wait()
        self._readers += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._readers -= 1
            if self._readers == 0:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Wait for running reads to finish and hold new ones back."""
        self._open.clear()
        try:
            await self._idle.wait()
            yield
        finally:
            self._open.set()


class MemoryTable:
    """The LanceDB table of memories under ``path``; ``open`` it, then use it from one event loop."""

    def __init__(
        self, path: Path, model_id: str, dim: int, *, allow_mismatch: bool = False, shared: SharedTable | None = None
    ) -> None:
        self.path = path
        self.shared = shared
        self.manifests: Any = shared.manifests if shared else LocalManifest(path / "manifest.json")
        self.model_id = model_id
        self.dim = dim
        self.allow_mismatch = allow_mismatch
        self.mismatch: EmbedderMismatch | None = None
        self._db: Any = None
        self._table: Any = None
        self.manifest: Manifest | None = None
        self.gate = ReadGate()

    @property
    def table(self) -> Any:
        """The live ``AsyncTable``."""
        if self._table is None:
            raise StoreError("memory table is not open")
        return self._table

    @property
    def stored_dim(self) -> int:
        """The dimension of the vectors in the live table."""
        return self.manifest.dim if self.manifest else self.dim

    async def open(self) -> None:
        """Connect, check the embedding model, open (or create) the live table, drop leftovers."""
        self.path.mkdir(parents=True, exist_ok=True)
        if self.shared is None:
            self._db = await lancedb.connect_async(self.path)
        else:
            self._db = await lancedb.connect_async(
                self.shared.uri,
                storage_options=self.shared.storage_options,
                read_consistency_interval=self.shared.read_consistency,
            )
        manifest = found = await self.manifests.read()
        if manifest is None:
            manifest = Manifest("memories_1", self.model_id, self.dim)
        manifest = replace(
            manifest, schema_version=check_records_schema(manifest.schema_version, self.path))
        self._check_model(manifest)
        names = await self._table_names()
        if manifest.table in names:
            self._table = await self._db.open_table(manifest.table)
            await self._add_missing_columns()
        else:
            self._table = await self._db.create_table(
                manifest.table, schema=arrow_schema(manifest.dim), exist_ok=self.shared is not None
            )
        if found is None or self.shared is None:  # replicas: the first one writes it
            await self.manifests.write(manifest)
        self.manifest = manifest
        for name in names if self.shared is None else ():  # replicas: a reindex may be building one
            if name != manifest.table:
                await self._db.drop_table(name)

    async def _add_missing_columns(self) -> None:
        """Give a table written by an older version the nullable columns added since (metadata only)."""
        have = set((await self._table.schema()).names)
        missing = [f for f in arrow_schema(self.dim) if f.name not in have and f.nullable]
        if missing:
            await self._table.add_columns(missing)
            log.info("memory.schema_upgraded", columns=[f.name for f in missing])

    def _check_model(self, manifest: Manifest) -> None:
        if (manifest.model_id, manifest.dim) == (self.model_id, self.dim):
            return
        mismatch = EmbedderMismatch(manifest.model_id, manifest.dim, self.model_id, self.dim)
        if not self.allow_mismatch:
            raise mismatch
        self.mismatch = mismatch

    async def _table_names(self) -> list[str]:
        return list((await self._db.list_tables()).tables)

    def close(self) -> None:
        """Release the table and the connection."""
        if self._table is not None:
            self._table.close()
            self._table = None
        if self._db is not None:
            self._db.close()
            self._db = None

    # writes ---------------------------------------------------------------------------------------------

    async def existing(self, ids: Sequence[str]) -> dict[str, str]:
        """Which of ``ids`` exist already, with their owner (a write-path check; returns no content)."""
        out: dict[str, str] = {}
        for chunk in _chunks(ids):
            rows = await self.table.query().select(["id", "user_id"]).where(sql_in("id", chunk)).to_arrow()
            out.update(zip(rows["id"].to_pylist(), rows["user_id"].to_pylist(), strict=True))
        return out

    async def add(self, rows: pa.Table) -> None:
        """Append rows in one commit (durable when this returns)."""
        await self.table.add(rows)

    async def replace(self, user_id: str, rows: pa.Table) -> None:
        """Overwrite existing rows of the user by id, all columns, in one commit."""
        owner = f"target.user_id = {sql_string(check_user_id(user_id))}"
        await self.table.merge_insert("id").when_matched_update_all(where=owner).execute(rows)

    async def touch(self, ids_by_user: dict[str, list[str]], at: datetime) -> None:
        """Set ``last_accessed_at`` on these records, in one commit."""
        clauses = [record_filter(user_id, ids=ids) for user_id, ids in ids_by_user.items() if ids]
        if clauses:
            where = " OR ".join(f"({clause})" for clause in clauses)
            await self.table.update(updates={"last_accessed_at": at}, where=where)

    async def delete(self, user_id: str, ids: Sequence[str] | None = None) -> None:
        """Delete the user's records with these ids (all of them when ``ids`` is None)."""
        if ids is None:
            await self.table.delete(record_filter(user_id))
            return
        for chunk in _chunks(ids):
            await self.table.delete(record_filter(user_id, ids=chunk))

    async def fragments_of(self, user_id: str) -> list[int]:
        """The fragments (data files) holding rows of the user; ask before deleting them."""
        rows = await self.table.query().select(["_rowaddr"]).where(record_filter(user_id)).to_arrow()
        return sorted({int(address) >> 32 for address in rows["_rowaddr"].to_numpy()})

    async def purge(self, fragments: Sequence[int] | None) -> None:
        """Rewrite these fragments (all when None) without their deleted rows, then drop old versions.

        Lance deletes by marking rows; the bytes stay until their fragment is rewritten. Rewriting the
        remaining rows of those fragments (a no-op update, one commit) leaves the fragments fully deleted,
        so they go, and the cleanup removes their files and every older version and transaction.
        """
        await self._drop_ann_index()  # it holds the user's vectors, and rewritten rows would need re-indexing
        if fragments is None:
            if await self.table.count_rows() > 0:
                await self.table.update(updates_sql={"importance": "importance"})
        elif fragments:
            where = " OR ".join(f"(_rowaddr >= {f << 32} AND _rowaddr < {(f + 1) << 32})" for f in fragments)
            await self.table.update(updates_sql={"importance": "importance"}, where=where)
        await self._rebuild_scalar_indexes()  # the Bitmap index keeps the user's id as a key otherwise
        async with self.gate.exclusive():
            if self.shared is None:
                await self.table.optimize(cleanup_older_than=_PURGE_CLEANUP, delete_unverified=True)
            else:  # files of another replica's commit in flight are unreferenced too: leave those
                await self.table.optimize(cleanup_older_than=self.shared.purge_cleanup)

    async def _rebuild_scalar_indexes(self) -> None:
        if await self.table.count_rows() == 0:
            return
        await self.table.create_index("user_id", config=Bitmap(), replace=True)
        await self.table.create_index("id", config=BTree(), replace=True)

    async def optimize(self, cleanup_older_than: timedelta) -> None:
        """Compact small fragments, fold new rows into the indexes, drop old versions, add scalar indexes."""
        await self.table.optimize(cleanup_older_than=cleanup_older_than)
        await self.ensure_scalar_indexes()

    async def _indexed_columns(self) -> dict[tuple[str, ...], str]:
        return {tuple(index.columns): index.name for index in await self.table.list_indices()}

    async def ensure_scalar_indexes(self) -> None:
        """Create the Bitmap (``user_id``) and BTree (``id``) indexes if missing (fast: seconds at 1M rows)."""
        if await self.table.count_rows() == 0:
            return
        have = await self._indexed_columns()
        if ("user_id",) not in have:
            await self.table.create_index("user_id", config=Bitmap())
        if ("id",) not in have:
            await self.table.create_index("id", config=BTree())

    async def ensure_ann_index(self, min_rows: int) -> bool:
        """Build the HNSW-SQ (cosine) index once the table has ``min_rows``; True if one was built.

        Slow (minutes for 100k rows on two busy cores), so the store runs it outside its write lock:
        an index build commits alongside appends and deletes without conflict.
        """
        if ("embedding",) in await self._indexed_columns() or await self.table.count_rows() < min_rows:
            return False
        config = HnswSq(distance_type="cosine", m=ANN_M, ef_construction=ANN_EF_CONSTRUCTION)
        await self.table.create_index("embedding", config=config)
        return True

    async def _drop_ann_index(self) -> None:
        name = (await self._indexed_columns()).get(("embedding",))
        if name is not None:
            await self.table.drop_index(name)

    # reads ----------------------------------------------------------------------------------------------

    async def records(self, user_id: str, ids: Sequence[str], *, embedding: bool = True) -> list[MemoryRecord]:
        """The user's records with these ids (any order; missing ids are left out)."""
        wanted = [record_id for record_id in dict.fromkeys(ids) if valid_record_id(record_id)]
        out: list[MemoryRecord] = []
        for chunk in _chunks(wanted):
            query = self.table.query().where(record_filter(user_id, ids=chunk))
            if not embedding:
                query = query.select(RECORD_COLUMNS)
            async with self.gate.read():
                rows = await query.to_arrow()
            out.extend(from_row(row) for row in rows.to_pylist())
        return out

    async def user_rows(self, user_id: str) -> pa.Table:
        """Every row of the user, vectors included (to fill the vector cache)."""
        async with self.gate.read():
            return await self.table.query().where(record_filter(user_id)).to_arrow()

    async def keys(self, user_id: str, kinds: Sequence[Kind] | None, include_invalid: bool) -> pa.Table:
        """(id, created_at) of the user's records matching the filters."""
        where = record_filter(user_id, kinds=kinds, include_invalid=include_invalid)
        async with self.gate.read():
            return await self.table.query().select(["id", "created_at"]).where(where).to_arrow()

    async def vector_search(
        self,
        user_id: str,
        query: npt.NDArray[np.float32],
        k: int,
        where: str,
    ) -> list[tuple[MemoryRecord, float]]:
        """Top ``k`` by cosine among rows matching ``where`` (which must come from ``record_filter``)."""
        if not where.startswith(f"(user_id = {sql_string(user_id)})"):
            raise StoreError("vector search filter is not scoped to the user")
        search = self.table.vector_search(query.astype(np.float32)).distance_type("cosine")
        search = search.where(where).select([*RECORD_COLUMNS, "_distance"]).limit(k)
        async with self.gate.read():
            rows = (await search.to_arrow()).to_pylist()
        return [(from_row(row), 1.0 - float(row["_distance"])) for row in rows]

    async def kind_counts(self, user_id: str) -> dict[str, int]:
        """How many records of each kind the user has."""
        async with self.gate.read():
            rows = await self.table.query().select(["kind"]).where(record_filter(user_id)).to_arrow()
        counts = pc.value_counts(rows["kind"]).to_pylist() if rows.num_rows else []
        return {item["values"]: int(item["counts"]) for item in counts}

    async def count(self, user_id: str | None = None) -> int:
        """Rows of one user, or of everyone."""
        where = record_filter(user_id) if user_id is not None else None
        async with self.gate.read():
            return int(await self.table.count_rows(where))

    async def user_ids(self) -> list[str]:
        """Every user with at least one record, sorted."""
        async with self.gate.read():
            rows = await self.table.query().select(["user_id"]).to_arrow()
        return sorted(pc.unique(rows["user_id"]).to_pylist()) if rows.num_rows else []

    async def batches(self, columns: list[str], where: str | None = None) -> AsyncIterator[pa.RecordBatch]:
        """Stream rows (``where`` must come from ``record_filter`` when given)."""
        query = self.table.query().select(columns)
        if where is not None:
            query = query.where(where)
        async with self.gate.read():
            async for batch in await query.to_batches():
                yield batch

    async def version(self) -> int:
        """The live table's version (moves with every commit)."""
        return int(await self.table.version())

    # reindex --------------------------------------------------------------------------------------------

    async def reindex(
        self,
        embed: Callable[[list[str]], Awaitable[npt.NDArray[np.float32]]],
        progress: Callable[[int, int], None] | None = None,
        batch_rows: int = 256,
    ) -> int:
        """Re-embed every row with ``embed`` into a fresh table, then swap it in; returns rows done."""
        total = await self.count()
        name = _next_table_name(self.manifest.table if self.manifest else "memories_0")
        if name in await self._table_names():
            await self._db.drop_table(name)
        fresh = await self._db.create_table(name, schema=arrow_schema(self.dim))
        done = 0
        pending: list[pa.Table] = []
        async for batch in _rebatch(self.batches(RECORD_COLUMNS), batch_rows):
            vectors = await embed(batch["text"].to_pylist())
            pending.append(self._with_vectors(batch, vectors))
            done += batch.num_rows
            if sum(t.num_rows for t in pending) >= 4096:
                await fresh.add(pa.concat_tables(pending))
                pending = []
            if progress is not None:
                progress(done, total)
        if pending:
            await fresh.add(pa.concat_tables(pending))
        await self._swap(fresh, name)
        return done

    def _with_vectors(self, batch: pa.Table, vectors: npt.NDArray[np.float32]) -> pa.Table:
        schema = arrow_schema(self.dim)
        flat = pa.array(np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1))
        columns = {name: batch[name] for name in RECORD_COLUMNS}
        columns["embedding"] = pa.FixedSizeListArray.from_arrays(flat, self.dim)
        columns["model_id"] = pa.array([self.model_id] * batch.num_rows, pa.string())
        return pa.table([columns[name] for name in schema.names], schema=schema)

    async def _swap(self, fresh: Any, name: str) -> None:
        old = self.manifest.table if self.manifest else None
        self._table = fresh
        await self.ensure_scalar_indexes()  # the ANN index follows at the next maintenance round
        manifest = Manifest(name, self.model_id, self.dim)
        await self.manifests.write(manifest)
        self.manifest = manifest
        self.mismatch = None
        if old is not None:
            await self._db.drop_table(old)


def _next_table_name(current: str) -> str:
    prefix, _, number = current.rpartition("_")
    return f"{prefix or 'memories'}_{int(number or 0) + 1}"


async def _rebatch(batches: AsyncIterator[pa.RecordBatch], rows: int) -> AsyncIterator[pa.Table]:
    buffer: list[pa.RecordBatch] = []
    size = 0
    async for batch in batches:
        buffer.append(batch)
        size += batch.num_rows
        while size >= rows:
            table = pa.Table.from_batches(buffer)
            yield table.slice(0, rows)
            rest = table.slice(rows)
            buffer, size = rest.to_batches(), rest.num_rows
    if size:
        yield pa.Table.from_batches(buffer)


# --- batching and timers -------------------------------------------------------------------------------


@dataclass
class Submission(Generic[_T]):
    """One caller's items and the future that tells it they are written."""

    items: Sequence[_T]
    done: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


_STOP = object()


class BatchWriter(Generic[_T]):
    """Coalesces concurrent submissions into one ``flush`` call per ``max_rows`` items or ``interval_s``.

    ``flush`` receives the batch's submissions and returns, for each, None (written) or the exception to
    raise to that caller; if ``flush`` itself raises, every caller of the batch gets the error.
    """

    def __init__(
        self,
        flush: Callable[[list[Submission[_T]]], Awaitable[list[BaseException | None]]],
        max_rows: int,
        interval_s: float,
        max_pending: int = 1024,
        health: StorageHealth | None = None,
    ) -> None:
        self._flush = flush
        self._health = health or StorageHealth()
        self._max_rows = max_rows
        self._interval = interval_s
        self._queue: asyncio.Queue[Any] = asyncio.Queue(max_pending)
        self._task: asyncio.Task[None] | None = None
        self._closed = False

    async def __aenter__(self) -> BatchWriter[_T]:
        self._task = asyncio.create_task(self._run(), name="memory-batch-writer")
        return self

    async def __aexit__(self, *exc: object) -> None:
        """Flush everything submitted so far, then stop."""
        self._closed = True
        if self._task is None:
            return
        await self._queue.put(_STOP)
        await self._task
        self._task = None

    async def submit(self, items: Sequence[_T]) -> None:
        """Queue ``items`` and wait until the flush that carries them is done."""
        if self._closed or self._task is None:
            raise StoreError("the memory store is closed")
        if self._task.done():
            raise StoreError("the memory store's writer has stopped")
        submission = Submission(items)
        await self._queue.put(submission)
        await submission.done

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        stopping = False
        while not stopping:
            first = await self._queue.get()
            if first is _STOP:
                return
            batch, rows = [first], len(first.items)
            deadline = loop.time() + self._interval
            while rows < self._max_rows:
                item = await self._next(deadline - loop.time())
                if item is None:
                    break
                if item is _STOP:
                    stopping = True
                    break
                batch.append(item)
                rows += len(item.items)
            await self._flush_batch(batch)

    async def _next(self, wait_s: float) -> Any:
        """The next queued item, waiting at most ``wait_s`` seconds (None when there is none)."""
        with contextlib.suppress(asyncio.QueueEmpty):
            return self._queue.get_nowait()
        if wait_s <= 0:
            return None
        try:
            return await asyncio.wait_for(self._queue.get(), wait_s)
        except TimeoutError:
            return None

    async def _flush_batch(self, batch: list[Submission[_T]]) -> None:
        try:
            errors = await self._flush(batch)
        except Exception as exc:  # every caller of the batch must hear about it, and the writer lives on
            if is_storage_fault(exc):  # logged once per fault, not once per batch
                self._health.fault("store", exc)
            else:
                log.exception("memory.flush_failed", submissions=len(batch))
            errors = [exc] * len(batch)
        else:
            self._health.ok("store")
        for submission, error in zip(batch, errors, strict=True):
            if submission.done.done():
                continue
            if error is None:
                submission.done.set_result(None)
            else:
                submission.done.set_exception(error)


class Ticker:
    """Calls ``fn`` every ``interval_s`` seconds until closed; errors are logged, not fatal."""

    def __init__(self, name: str, interval_s: float, fn: Callable[[], Awaitable[None]],
                 health: StorageHealth | None = None) -> None:
        self._name = name
        self._interval = interval_s
        self._fn = fn
        self._health = health or StorageHealth()
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Ticker:
        self._task = asyncio.create_task(self._run(), name=self._name)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            try:
                await self._fn()
            except Exception as exc:  # a failed maintenance round is retried at the next tick
                if is_storage_fault(exc):  # once per fault, not once a second
                    self._health.fault(self._name, exc)
                else:
                    log.exception("memory.maintenance_failed", task=self._name)
            else:
                self._health.ok(self._name)
