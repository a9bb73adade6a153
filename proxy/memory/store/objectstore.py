"""Object storage: where the memory table lives when ``storage.uri`` is ``s3://bucket/prefix``.

Two things live here:

* ``StorageLocation``: the parsed ``storage.uri`` and the storage options handed to LanceDB (from the config
  file's ``storage.options`` and the standard AWS variables ``AWS_ENDPOINT_URL``, ``AWS_REGION``,
  ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``). Its ``repr`` and ``describe()``
  never show a secret; only the loader (``from_settings``) reads the environment.
* ``ObjectStore``: a small async S3 client (boto3 on worker threads) for the coordination objects beside the
  table (lease, change feed, journal, manifest): get, put (optionally conditional: ``If-None-Match: *`` to
  create, ``If-Match: <etag>`` to replace what was read), delete and list. A failed precondition raises
  ``PreconditionFailed``; everything else that goes wrong raises ``ObjectStoreError``.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import boto3
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError

from proxy.memory.errors import StoreError

__all__ = ["ObjectStore", "ObjectStoreError", "PreconditionFailed", "StorageLocation", "is_remote"]

_SECRET_OPTIONS = frozenset({"aws_secret_access_key", "aws_session_token", "secret_access_key", "session_token"})
_ENV_OPTIONS = {  # standard AWS variable -> LanceDB (object_store) storage option
    "AWS_ENDPOINT_URL": "aws_endpoint",
    "AWS_REGION": "aws_region",
    "AWS_DEFAULT_REGION": "aws_region",
    "AWS_ACCESS_KEY_ID": "aws_access_key_id",
    "AWS_SECRET_ACCESS_KEY": "aws_secret_access_key",
    "AWS_SESSION_TOKEN": "aws_session_token",
}


class ObjectStoreError(StoreError):
    """An object-store request failed (network, permissions, missing bucket)."""


class PreconditionFailed(ObjectStoreError):
    """A conditional write lost: the object exists (create) or changed since it was read (replace)."""


def is_remote(uri: str | None) -> bool:
    """Whether ``uri`` names object storage (``s3://...``) rather than a local directory."""
    return bool(uri) and "://" in str(uri) and not str(uri).startswith("file://")


@dataclass(frozen=True)
class StorageLocation:
    """An ``s3://bucket/prefix`` location and the options to reach it (secrets hidden from ``repr``)."""

    uri: str
    options: Mapping[str, str] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        parts = urlsplit(self.uri)
        if parts.scheme != "s3" or not parts.netloc:
            raise ValueError("storage.uri: only local paths and s3://bucket/prefix are supported for replicas")

    @classmethod
    def from_settings(cls, uri: str, options: Mapping[str, str], environ: Mapping[str, str]) -> StorageLocation:
        """The location with options from the AWS variables, overridden by the config file's ``options``."""
        merged: dict[str, str] = {}
        for variable, option in _ENV_OPTIONS.items():
            if environ.get(variable) and option not in merged:
                merged[option] = environ[variable]
        merged.update({key.lower(): str(value) for key, value in options.items()})
        if merged.get("aws_endpoint", "").startswith("http://"):
            merged.setdefault("allow_http", "true")
        return cls(uri.rstrip("/"), merged)

    @property
    def bucket(self) -> str:
        """The bucket name."""
        return urlsplit(self.uri).netloc

    @property
    def prefix(self) -> str:
        """The key prefix under which everything of this store lives (no leading or trailing slash)."""
        return urlsplit(self.uri).path.strip("/")

    def key(self, *parts: str) -> str:
        """The object key of ``parts`` under this store's prefix."""
        return "/".join(p.strip("/") for p in (self.prefix, *parts) if p.strip("/"))

    def child(self, name: str) -> str:
        """The URI of ``name`` under this store's prefix (where LanceDB keeps its tables)."""
        return f"s3://{self.bucket}/{self.key(name)}"

    def describe(self) -> dict[str, str]:
        """What may be logged: the URI, the endpoint and region; never keys."""
        shown = {k: v for k, v in self.options.items() if k in ("aws_endpoint", "aws_region", "allow_http")}
        return {"uri": self.uri, **shown}

    def lance_options(self) -> dict[str, str]:
        """The storage options LanceDB gets (every option: object_store ignores what it does not know)."""
        return dict(self.options)

    def boto_kwargs(self) -> dict[str, Any]:
        """Arguments for ``boto3.client("s3", ...)`` equivalent to the LanceDB options."""
        opts = self.options
        kwargs: dict[str, Any] = {
            "endpoint_url": opts.get("aws_endpoint") or None,
            "region_name": opts.get("aws_region") or "us-east-1",
            "aws_access_key_id": opts.get("aws_access_key_id") or None,
            "aws_secret_access_key": opts.get("aws_secret_access_key") or None,
            "aws_session_token": opts.get("aws_session_token") or None,
        }
        return {k: v for k, v in kwargs.items() if v is not None}


@dataclass(frozen=True)
class StoredObject:
    """An object's bytes and the ETag to replace it conditionally."""

    body: bytes
    etag: str


class ObjectStore:
    """Async access to the objects under a ``StorageLocation`` (boto3 calls run on worker threads)."""

    def __init__(self, location: StorageLocation, *, timeout_s: float = 10.0) -> None:
        self.location = location
        config = BotoConfig(
            connect_timeout=timeout_s,
            read_timeout=timeout_s,
            retries={"max_attempts": 3, "mode": "standard"},
            max_pool_connections=32,
        )
        self._client = boto3.session.Session().client("s3", config=config, **location.boto_kwargs())
        self.requests = 0  # every request sent (for the benchmark's requests-per-chat figure)

    async def _call(self, method: str, **kwargs: Any) -> Any:
        self.requests += 1
        call = functools.partial(getattr(self._client, method), Bucket=self.location.bucket, **kwargs)
        try:
            return await asyncio.to_thread(call)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412):
                raise PreconditionFailed(f"{method}: precondition failed") from None
            if code in ("NoSuchKey", "404") or status == 404:
                raise KeyError(kwargs.get("Key", "")) from None
            raise ObjectStoreError(f"{method} failed: {code or status}") from None
        except BotoCoreError as exc:
            raise ObjectStoreError(f"{method} failed: {type(exc).__name__}") from None

    async def ensure_bucket(self) -> None:
        """Create the bucket if it does not exist (for local S3-compatible servers; S3 itself needs IAM)."""
        try:
            await self._call("head_bucket")
        except (KeyError, ObjectStoreError):
            await self._call("create_bucket")

    async def get(self, key: str) -> StoredObject | None:
        """The object at ``key`` (relative to the prefix), or None."""
        try:
            found = await self._call("get_object", Key=self.location.key(key))
        except KeyError:
            return None
        body = await asyncio.to_thread(found["Body"].read)
        return StoredObject(body, str(found["ETag"]))

    async def put(self, key: str, body: bytes, *, if_none_match: bool = False, if_match: str | None = None) -> str:
        """Write ``body`` at ``key``; returns the new ETag. Conditional writes raise ``PreconditionFailed``."""
        extra: dict[str, Any] = {}
        if if_none_match:
            extra["IfNoneMatch"] = "*"
        if if_match is not None:
            extra["IfMatch"] = if_match
        found = await self._call("put_object", Key=self.location.key(key), Body=body, **extra)
        return str(found["ETag"])

    async def delete(self, key: str) -> None:
        """Remove the object at ``key`` (no error if it is gone)."""
        await self._call("delete_object", Key=self.location.key(key))

    async def list(self, prefix: str, *, start_after: str = "", limit: int = 1000) -> list[str]:
        """Keys (relative to the store's prefix) under ``prefix``, in order, after ``start_after``."""
        base = self.location.key(prefix)
        base = base + "/" if prefix.endswith("/") else base
        strip = len(self.location.key("")) + 1 if self.location.prefix else 0
        kwargs: dict[str, Any] = {"Prefix": base, "MaxKeys": limit}
        if start_after:
            kwargs["StartAfter"] = self.location.key(start_after)
        found = await self._call("list_objects_v2", **kwargs)
        return [str(item["Key"])[strip:] for item in found.get("Contents", [])]

    def close(self) -> None:
        """Release the HTTP connections."""
        self._client.close()
