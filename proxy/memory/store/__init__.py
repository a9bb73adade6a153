"""The store: where memories live, and everything that keeps them there.

Owns the records and their schema, the LanceDB table of record (with its batch writer, maintenance and
schema migrations), the Tantivy keyword index, the per-user vector cache, storage-fault health, object
storage and the replicas that share a table through it, and the one rule for what a valid user id is.

May import: the memory core's root (``proxy.memory.errors`` and the other shared modules) and libraries.
Never imports ``proxy.memory.read``, ``proxy.memory.write``, ``proxy.memory.embedders``, anything else of
``proxy`` (the HTTP shell) or ``insights``: the read and write paths build on the store, not the reverse.
"""
