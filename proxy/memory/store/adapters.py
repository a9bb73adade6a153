"""The per-user query adapters (``proxy.memory.query_adapter``): a small LanceDB side table beside the memories.

One row per user: the vector space the adapter was fitted in (``model_id``), when, and its weights as one
``.npz`` blob (~400 kB at 384 dimensions). It is derived data, refitted from the user's memories by a write-side
job, so it lives apart from the memory table: it is never searched, never exported as a memory, and a reindex
leaves it behind (an adapter of another ``model_id`` is not applied). ``MemoryStore.forget_user`` deletes the
user's row with their memories.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import lancedb
import pyarrow as pa

from proxy.memory.store.filters import sql_string
from proxy.memory.store.ids import check_user_id

TABLE = "query_adapters"
SCHEMA = pa.schema(
    [
        pa.field("user_id", pa.string(), nullable=False),
        pa.field("model_id", pa.string(), nullable=False),
        pa.field("fitted_at", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("weights", pa.large_binary(), nullable=False),
    ]
)


class AdapterTable:
    """The side table of query adapters under a LanceDB location (a directory, or a URI with options)."""

    def __init__(self, location: Path | str, storage_options: dict[str, str] | None = None) -> None:
        self._location = location
        self._options = storage_options
        self._table: Any = None

    async def _opened(self) -> Any:
        """The table, opened (or created) on first use: most stores never fit an adapter."""
        if self._table is None:
            if isinstance(self._location, Path):
                self._location.mkdir(parents=True, exist_ok=True)
            # every read at the latest version: another process (the memory writer) may store a user's adapter
            db = await lancedb.connect_async(
                self._location, storage_options=self._options, read_consistency_interval=timedelta(0)
            )
            self._table = await db.create_table(TABLE, schema=SCHEMA, exist_ok=True)
        return self._table

    async def get(self, user_id: str) -> tuple[str, bytes] | None:
        """The user's adapter as (model_id, weights blob), or None."""
        table = await self._opened()
        rows = await table.query().where(_user(user_id)).limit(1).to_arrow()
        if rows.num_rows == 0:
            return None
        return str(rows["model_id"][0]), bytes(rows["weights"][0].as_py())

    async def put(self, user_id: str, model_id: str, fitted_at: datetime, weights: bytes) -> None:
        """Store (or replace) the user's adapter."""
        table = await self._opened()
        row = pa.table(
            {"user_id": [check_user_id(user_id)], "model_id": [model_id], "fitted_at": [fitted_at],
             "weights": [weights]},
            schema=SCHEMA,
        )  # fmt: skip
        await table.merge_insert("user_id").when_matched_update_all().when_not_matched_insert_all().execute(row)

    async def delete(self, user_id: str) -> None:
        """Delete the user's adapter (nothing is written if they have none).

        As the memory table's purge does: the delete is followed by a commit that does not name the user (a
        no-op rewrite of the other rows, or an empty table), and on a local disk every older version goes, so
        that no file keeps the user's id or weights (a shared table: at its next cleanup).
        """
        table = await self._opened()
        if await self.get(user_id) is None:
            return
        await table.delete(_user(user_id))
        if await table.count_rows() > 0:
            await table.update(updates_sql={"model_id": "model_id"})
        else:
            db = await lancedb.connect_async(self._location, storage_options=self._options)
            table.close()
            self._table = table = await db.create_table(TABLE, schema=SCHEMA, mode="overwrite")
        if isinstance(self._location, Path):
            await table.optimize(cleanup_older_than=timedelta(milliseconds=1), delete_unverified=True)

    def close(self) -> None:
        """Let go of the table."""
        if self._table is not None:
            self._table.close()
            self._table = None


def _user(user_id: str) -> str:
    return f"user_id = {sql_string(check_user_id(user_id))}"
