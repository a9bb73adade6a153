"""The store: where memories live, and everything that keeps them there.

Owns the records and their schema, the LanceDB table of record (with its batch writer, maintenance and
schema migrations), the Tantivy keyword index, the per-user vector cache, storage-fault health, object
storage and the replicas that share a table through it, and the one rule for what a valid user id is.

May import: the memory core's root (``proxy.memory.errors`` and the other shared modules) and libraries.
Never imports ``proxy.memory.read``, ``proxy.memory.write``, ``proxy.memory.embedders``, anything else of
``proxy`` (the HTTP shell) or ``insights``: the read and write paths build on the store, not the reverse.

What the rest of memproxy may use of it is this package's ``__all__`` (imported on first use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from proxy.memory.lazy import exports_on_first_use

if TYPE_CHECKING:
    from proxy.memory.store.background import Ticker
    from proxy.memory.store.cluster import ClusterSettings, replica_name
    from proxy.memory.store.faults import StorageHealth, fault_reason, is_storage_fault
    from proxy.memory.store.ids import APP_ID_RULE, valid_app_id, valid_record_id
    from proxy.memory.store.journal import Journal
    from proxy.memory.store.memory_store import MemoryStore
    from proxy.memory.store.migrations import SchemaError, migrate_data_dir
    from proxy.memory.store.objectstore import ObjectStore, StorageLocation
    from proxy.memory.store.reads import Page
    from proxy.memory.store.records import Kind, MemoryRecord, new_id, newest_generation, utcnow
    from proxy.memory.store.replicated import ReplicatedStore, shared_table
    from proxy.memory.store.runtime import ClusterRuntime
    from proxy.memory.store.settings import StoreSettings, StoreTuning
    from proxy.memory.store.vector_cache import holding

# What the face exports, and the module that defines it (imported on first use).
_WHERE = {
    "APP_ID_RULE": "proxy.memory.store.ids",
    "ClusterRuntime": "proxy.memory.store.runtime",
    "ClusterSettings": "proxy.memory.store.cluster",
    "Journal": "proxy.memory.store.journal",
    "Kind": "proxy.memory.store.records",
    "MemoryRecord": "proxy.memory.store.records",
    "MemoryStore": "proxy.memory.store.memory_store",
    "ObjectStore": "proxy.memory.store.objectstore",
    "Page": "proxy.memory.store.reads",
    "ReplicatedStore": "proxy.memory.store.replicated",
    "SchemaError": "proxy.memory.store.migrations",
    "StorageHealth": "proxy.memory.store.faults",
    "shared_table": "proxy.memory.store.replicated",
    "StorageLocation": "proxy.memory.store.objectstore",
    "StoreSettings": "proxy.memory.store.settings",
    "StoreTuning": "proxy.memory.store.settings",
    "Ticker": "proxy.memory.store.background",
    "fault_reason": "proxy.memory.store.faults",
    "holding": "proxy.memory.store.vector_cache",
    "is_storage_fault": "proxy.memory.store.faults",
    "migrate_data_dir": "proxy.memory.store.migrations",
    "new_id": "proxy.memory.store.records",
    "newest_generation": "proxy.memory.store.records",
    "replica_name": "proxy.memory.store.cluster",
    "utcnow": "proxy.memory.store.records",
    "valid_app_id": "proxy.memory.store.ids",
    "valid_record_id": "proxy.memory.store.ids",
}
__all__ = [
    "APP_ID_RULE",
    "ClusterRuntime",
    "ClusterSettings",
    "Journal",
    "Kind",
    "MemoryRecord",
    "MemoryStore",
    "ObjectStore",
    "Page",
    "ReplicatedStore",
    "SchemaError",
    "StorageHealth",
    "StorageLocation",
    "StoreSettings",
    "StoreTuning",
    "Ticker",
    "fault_reason",
    "holding",
    "is_storage_fault",
    "migrate_data_dir",
    "new_id",
    "newest_generation",
    "replica_name",
    "shared_table",
    "utcnow",
    "valid_app_id",
    "valid_record_id",
]

__getattr__ = exports_on_first_use(__name__, _WHERE)
