"""The LanceDB table of record: open and create it, write, read and purge rows, maintain its indexes, reindex.

LanceDB is the source of truth. One table holds every kind of memory of every user (``records.py``); the
manifest beside it (``manifest.py``) names the live table and the embedding model it was built with. Every
read and delete goes through a filter of ``filters.py``, scoped to one user. The indexes (``indexes.py``:
Bitmap on ``user_id``, BTree on ``id``, HNSW-SQ cosine on ``embedding`` past a size) are created as the table grows;
writes are batched by ``background.BatchWriter`` and compaction (``compaction.py``) runs on ``background.Ticker``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, TypeVar

import lancedb
import numpy as np
import numpy.typing as npt
import pyarrow as pa
import pyarrow.compute as pc
import structlog

from proxy.memory.errors import EmbedderMismatch, StoreError
from proxy.memory.store import compaction, indexes
from proxy.memory.store.filters import record_filter, sql_in, sql_string
from proxy.memory.store.gate import ReadGate
from proxy.memory.store.ids import check_user_id, valid_record_id
from proxy.memory.store.manifest import LocalManifest, Manifest
from proxy.memory.store.migrations import check_records_schema
from proxy.memory.store.records import PIECES, Kind, MemoryRecord, arrow_schema, from_row, pieces_array

log = structlog.get_logger(__name__)

RECORD_COLUMNS = [name for name in arrow_schema(1).names if name not in ("embedding", PIECES)]
_IN_CHUNK = 512
# A replica that lost the claim to create the shared table waits this long for the winner's before it creates
# the table itself (the winner died between its claim and its creation).
CREATOR_WAIT_S = 30.0
_PURGE_CLEANUP = timedelta(milliseconds=1)  # every version but the latest (0 would warn about readers)
_T = TypeVar("_T")


def _chunks(values: Sequence[_T], size: int = _IN_CHUNK) -> list[Sequence[_T]]:
    return [values[i : i + size] for i in range(0, len(values), size)]


@dataclass(frozen=True)
class SharedTable:
    """A table on object storage that several replicas use (``replicated.ReplicatedStore`` builds it).

    ``manifests`` has async ``read()``/``write(manifest)`` (an object next to the table); reads see other
    replicas' commits within ``read_consistency``; a purge keeps versions younger than ``purge_cleanup`` and
    never deletes unreferenced files (they may be another replica's commit in flight).
    """

    uri: str
    storage_options: dict[str, str]
    manifests: Any
    read_consistency: timedelta
    purge_cleanup: timedelta


class MemoryTable:
    """The LanceDB table of memories under ``path``; ``open`` it, then use it from one event loop."""

    def __init__(
        self,
        path: Path,
        model_id: str,
        dim: int,
        *,
        allow_mismatch: bool = False,
        shared: SharedTable | None = None,
        cache_bytes: int | None = None,  # None: LanceDB's default session
        follower: bool = False,  # the table another process writes: opened read only, every read sees its commits
    ) -> None:
        self.path = path
        self.follower = follower
        # LanceDB's own caches (opened indexes; file metadata and manifests), which default to 6 GB + 1 GB.
        self.session = indexes.lance_session(cache_bytes)
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
        self.cleaning = asyncio.Lock()  # one removal of old versions at a time: a purge's waits for the routine one

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
        if self.follower:
            await self._open_following()
            return
        self.path.mkdir(parents=True, exist_ok=True)
        if self.shared is None:
            self._db = await lancedb.connect_async(self.path, session=self.session)
        else:
            self._db = await lancedb.connect_async(
                self.shared.uri,
                storage_options=self.shared.storage_options,
                read_consistency_interval=self.shared.read_consistency,
                session=self.session,
            )
        manifest = await self.manifests.read()
        creator = self.shared is None
        if manifest is None:
            manifest = Manifest("memories_1", self.model_id, self.dim)
            if self.shared is not None:  # replicas: the one whose manifest lands creates the table
                winner = await self.manifests.claim(manifest)
                creator = winner is None
                manifest = winner or manifest
        manifest = replace(manifest, schema_version=check_records_schema(manifest.schema_version, self.path))
        self._check_model(manifest)
        names = await self._table_names()
        if creator and manifest.table not in names:
            self._table = await self._db.create_table(manifest.table, schema=arrow_schema(manifest.dim))
        else:
            self._table = await (
                self._db.open_table(manifest.table) if creator else self._creators_table(manifest.table, manifest.dim)
            )
            await self._add_missing_columns()
        if self.shared is None:
            await self.manifests.write(manifest)
        self.manifest = manifest
        for name in names if self.shared is None else ():  # replicas: a reindex may be building one
            if name != manifest.table:
                await self._db.drop_table(name)

    async def _open_following(self) -> None:
        """A follower's open of the table the writer made: read only, each read at the writer's latest version."""
        uri, options = (self.shared.uri, self.shared.storage_options) if self.shared else (str(self.path), None)
        self._db = await lancedb.connect_async(uri, storage_options=options, read_consistency_interval=timedelta(0),
                                               session=self.session)  # fmt: skip
        manifest = await self.manifests.read()
        if manifest is None:
            raise StoreError(f"no memory table at {uri} yet (the memory writer creates it)")
        self._check_model(manifest)
        self._table = await self._db.open_table(manifest.table)
        self.manifest = manifest

    async def _creators_table(self, name: str, dim: int) -> Any:
        """Open the shared table the replica whose manifest claim won is creating.

        Replicas started together on an empty bucket race to create the table; two creations both commit (the later
        as an Overwrite of the earlier, which fails or erases the winner's first appends). So only the replica whose
        conditional write of the manifest landed creates it; the others wait for it here, and create it only if it
        never comes (its creator died). A table listed before its first version is committed fails to open
        (CI saw "Table 'memories_1' was not found"): that counts as not there yet.
        """
        deadline = time.monotonic() + CREATOR_WAIT_S
        pause = 0.05
        while True:
            if name in await self._table_names():
                try:
                    return await self._db.open_table(name)
                except ValueError:  # listed, its first version not committed yet
                    pass
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)
        log.warning("memory.table_creator_gone", table=name, waited_s=CREATOR_WAIT_S)
        return await self._db.create_table(name, schema=arrow_schema(dim), exist_ok=True)

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
        await indexes.rebuild_scalar_indexes(self.table)  # the Bitmap index keeps the user's id as a key otherwise
        async with self.gate.exclusive():  # shared: files of another replica's commit in flight are unreferenced too
            options = self.shared.storage_options if self.shared else None
            await compaction.maintain(self.table, options)
            keep = self.shared.purge_cleanup if self.shared else _PURGE_CLEANUP
            async with self.cleaning:
                await compaction.remove_versions(self.table, options, keep, delete_unverified=self.shared is None)

    async def optimize(self) -> None:
        """Compact small fragments, fold new rows into the indexes (``compaction``), add scalar indexes."""
        await compaction.maintain(self.table, self.shared.storage_options if self.shared else None)
        await self.ensure_scalar_indexes()

    async def remove_old_versions(self, older_than: timedelta) -> None:
        """Remove versions older than ``older_than`` (the store's ``memory-versions`` ticker, every
        ``compaction.CLEANUP_EVERY_S``)."""
        async with self.cleaning:
            options = self.shared.storage_options if self.shared else None
            await compaction.remove_versions(self.table, options, older_than)

    async def _indexed_columns(self) -> dict[tuple[str, ...], str]:
        return await indexes.indexed_columns(self.table)

    async def lacks_scalar_indexes(self) -> bool:
        """Whether the table holds rows but not both scalar indexes (``indexes.missing_scalar_indexes``)."""
        return bool(await indexes.missing_scalar_indexes(self.table))

    async def ensure_scalar_indexes(self) -> None:
        """Create the Bitmap (``user_id``) and BTree (``id``) indexes if missing."""
        await indexes.ensure_scalar_indexes(self.table)

    async def ensure_ann_index(self, min_rows: int) -> bool:
        """Build the HNSW-SQ (cosine) index once the table has ``min_rows``; True if one was built
        (``indexes.ensure_ann_index``)."""
        return await indexes.ensure_ann_index(self.table, min_rows)

    async def _drop_ann_index(self) -> None:
        await indexes.drop_ann_index(self.table)

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
        pieces: Callable[[list[str]], list[npt.NDArray[np.int64]] | None] = lambda _: None,
    ) -> int:
        """Re-embed every row with ``embed`` (and its ``pieces``) into a fresh table, then swap it in; returns
        rows done."""
        total = await self.count()
        name = _next_table_name(self.manifest.table if self.manifest else "memories_0")
        if name in await self._table_names():
            await self._db.drop_table(name)
        fresh = await self._db.create_table(name, schema=arrow_schema(self.dim))
        done = 0
        pending: list[pa.Table] = []
        async for batch in _rebatch(self.batches(RECORD_COLUMNS), batch_rows):
            texts = batch["text"].to_pylist()
            vectors = await embed(texts)
            pending.append(self._with_vectors(batch, vectors, pieces(texts)))
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

    def _with_vectors(
        self, batch: pa.Table, vectors: npt.NDArray[np.float32], pieces: list[npt.NDArray[np.int64]] | None
    ) -> pa.Table:
        schema = arrow_schema(self.dim)
        flat = pa.array(np.ascontiguousarray(vectors, dtype=np.float32).reshape(-1))
        columns = {name: batch[name] for name in RECORD_COLUMNS}
        columns["embedding"] = pa.FixedSizeListArray.from_arrays(flat, self.dim)
        columns["model_id"] = pa.array([self.model_id] * batch.num_rows, pa.string())
        columns[PIECES] = pieces_array(pieces, batch.num_rows)
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
