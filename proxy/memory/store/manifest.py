"""The table manifest: which LanceDB table is live, and the embedding model and dimension it was built with.

A store opened with another model refuses to start (``EmbedderMismatch``), and ``reindex`` builds a fresh
table and swaps it in by rewriting the manifest. It is a file beside local tables (``LocalManifest``) or an
object beside a shared one (``cluster.RemoteManifest``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import orjson

from proxy.memory.store.objectstore import ObjectStore, PreconditionFailed
from proxy.memory.store.records import SCHEMA_VERSION

MANIFEST_KEY = "manifest.json"


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


class RemoteManifest:
    """The table manifest as an object beside the table."""

    def __init__(self, objects: ObjectStore) -> None:
        self._objects = objects

    async def read(self) -> Manifest | None:
        """The manifest, or None before the first replica opened the store."""
        found = await self._objects.get(MANIFEST_KEY)
        if found is None:
            return None
        data = orjson.loads(found.body)
        return Manifest(data["table"], data["model_id"], int(data["dim"]), int(data["schema_version"]))

    async def claim(self, manifest: Manifest) -> Manifest | None:
        """Write the first manifest of a fresh store: None if this one landed, else the one that did."""
        try:
            await self._objects.put(MANIFEST_KEY, orjson.dumps(manifest.__dict__), if_none_match=True)
        except PreconditionFailed:
            return await self.read() or manifest
        return None

    async def write(self, manifest: Manifest) -> None:
        """Replace the manifest (one PUT: atomic on S3)."""
        await self._objects.put(MANIFEST_KEY, orjson.dumps(manifest.__dict__))
