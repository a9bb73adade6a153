"""Typed configuration, read once at start.

Sources, later ones winning: the defaults below, a TOML file (``--config`` or ``MEMPROXY_CONFIG``), environment
variables ``MEMPROXY_<SECTION>__<KEY>`` (nested keys joined by ``__``), then command-line flags. Only
``load_settings`` reads the environment. ``config/memproxy.toml`` holds, with a comment each, the keys an
operator sets and loads to exactly ``Settings()``; the tuning keys are documented in ``docs/tuning.md`` (tests
check both).
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from insights.service import InsightSettings
from proxy.config_secrets import SecretReferenceError, expand_references, file_variables
from proxy.memory.embedders import EmbedderSettings
from proxy.memory.read import InjectionSettings, RerankSettings, RetrievalSettings
from proxy.memory.store import ClusterSettings, StorageLocation, StoreSettings, StoreTuning
from proxy.memory.write import ExtractionSettings, JobQueueSettings, JobQueueTuning, WebhookSettings, WriterSettings
from proxy.shadow import ShadowSettings
from proxy.telemetry import TelemetrySettings

ENV_PREFIX = "MEMPROXY_"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ServerSettings(_Frozen):
    """Where memproxy listens and how it treats incoming requests."""

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    max_body_bytes: int = Field(default=8 * 2**20, gt=0)
    body_timeout_s: float = Field(default=60.0, gt=0)  # a body must arrive within this (408 otherwise)
    head_timeout_s: float = Field(default=30.0, ge=0)  # and a request's headers within this (408; 0: no limit)
    max_json_depth: int = Field(default=64, ge=2)  # deeper JSON is a 400, checked before parsing
    shutdown_grace_s: float = Field(default=20.0, ge=0)
    # Chat processes of ``memproxy serve`` (proxy/supervisor.py), beside one memory writer process; 0: one per core.
    workers: int = Field(default=0, ge=0)
    # The memory writer process is replaced (the chat goes on) after this many jobs, or once its RSS passed this
    # many MB while no job runs; 0: never.
    writer_max_jobs: int = Field(default=1_000_000, ge=0)
    writer_max_rss_mb: float = Field(default=0.0, ge=0)
    # Serve without client keys on a non-loopback address while holding an upstream key (see proxy/access.py).
    open: bool = False
    # Browser origins (scheme://host[:port]) allowed to call the chat path; others are refused.
    allowed_origins: tuple[str, ...] = ()
    # Host names (or name:port) this server answers to; empty: any. Guards against DNS rebinding.
    allowed_hosts: tuple[str, ...] = ()

    @field_validator("allowed_origins", "allowed_hosts", mode="before")
    @classmethod
    def _comma_list(cls, value: Any) -> Any:
        if isinstance(value, str):  # from an environment variable: comma-separated
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("allowed_hosts")
    @classmethod
    def _lower(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(host.lower() for host in value)


class UpstreamSettings(_Frozen):
    """The default OpenAI-compatible upstream; models without a route go here unchanged."""

    base_url: str = "https://api.openai.com/v1"
    api_key: SecretStr = SecretStr("")
    # Anthropic's Messages API (``POST /v1/messages``): relayed to ``<anthropic_base_url>/v1/messages``; empty:
    # translated to chat completions on ``base_url`` or the model's route.
    anthropic_base_url: str = "https://api.anthropic.com"
    anthropic_api_key: SecretStr = SecretStr("")
    timeout_s: float = Field(default=600.0, gt=0)
    connect_timeout_s: float = Field(default=10.0, gt=0)
    max_connections: int = Field(default=256, gt=0)

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        return value.rstrip("/")

    @field_validator("anthropic_base_url")
    @classmethod
    def _http_url_or_empty(cls, value: str) -> str:
        if value and not value.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://, or be empty (translate to chat completions)")
        return value.rstrip("/")


class RouteSettings(_Frozen):
    """Models whose name starts with ``prefix`` go to this route instead of the default upstream.

    A litellm route fixes its litellm provider (``litellm_provider``, else the first segment of a prefix such
    as ``anthropic/``), so that no model name can choose another provider, address or key.
    """

    prefix: str = Field(min_length=1)
    provider: Literal["openai", "litellm"] = "litellm"
    base_url: str | None = None
    api_key: SecretStr | None = None
    strip_prefix: bool = False
    litellm_provider: str | None = Field(default=None, pattern=r"^[a-z0-9_]+$")

    @model_validator(mode="after")
    def _provider_is_fixed(self) -> RouteSettings:
        if self.provider == "litellm" and self.pinned_provider is None:
            raise ValueError(
                f'route {self.prefix!r}: set litellm_provider (e.g. "anthropic", or "openai" for an '
                "OpenAI-compatible base_url): with strip_prefix or a prefix that names no provider, the model "
                "name would choose the provider"
            )
        return self

    @property
    def pinned_provider(self) -> str | None:
        """The litellm provider every call of this route goes to (None for an ``openai`` route)."""
        if self.provider != "litellm":
            return None
        if self.litellm_provider:
            return self.litellm_provider
        head, slash, _ = self.prefix.partition("/")
        return head if slash and head and not self.strip_prefix else None


class ClientSettings(_Frozen):
    """One app allowed to use the chat path: the SHA-256 (hex) of its key, and the namespace of its users."""

    namespace: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    key_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    name: str = ""


class StorageSettings(_Frozen):
    """The data directory (LanceDB, Tantivy, the job queue), or the memory table on object storage (``uri``)."""

    path: Path = Path("./data")
    # Replicas (proxy/memory/store/cluster.py): s3://bucket/prefix puts the memory table there and keeps only
    # derived state (keyword index, caches) and the local job queue under ``path``; a local path is ``path``.
    uri: str | None = None
    options: dict[str, SecretStr] = {}  # LanceDB storage options (aws_endpoint, ...); AWS_* variables fill gaps
    sync_interval_s: float = Field(default=1.0, gt=0)  # how often a replica looks for the others' writes
    lease_s: float = Field(default=15.0, gt=0)  # maintenance lease; a dead holder's is taken after this
    dead_after_s: float = Field(default=15.0, gt=0)  # a replica silent this long has its journal adopted

    @field_validator("uri")
    @classmethod
    def _storage_uri(cls, value: str | None) -> str | None:
        if value and "://" in value and not value.startswith("s3://"):
            raise ValueError("must be a local path or s3://bucket/prefix")
        if value and value.startswith("s3://") and not value[5:].split("/")[0]:
            raise ValueError("s3:// needs a bucket: s3://bucket/prefix")
        return value or None

    @property
    def local_dir(self) -> Path:
        """Where this process keeps its files: ``uri`` when it is a local path, else ``path``."""
        return Path(self.uri) if self.uri and "://" not in self.uri else self.path

    def cluster(self, environ: Mapping[str, str]) -> ClusterSettings | None:
        """How replicas share the store when ``uri`` is object storage (None: the embedded default)."""
        if not self.uri or "://" not in self.uri:
            return None
        options = {key: secret.get_secret_value() for key, secret in self.options.items()}
        location = StorageLocation.from_settings(self.uri, options, environ)
        return ClusterSettings(
            location, sync_interval_s=self.sync_interval_s, lease_s=self.lease_s, dead_after_s=self.dead_after_s
        )


class AdminSettings(_Frozen):
    """The management API's key; empty turns the management API off."""

    api_key: SecretStr = SecretStr("")


class LoggingSettings(_Frozen):
    """structlog JSON logs on stdout."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    user_ids: Literal["hash", "raw"] = "hash"


class MemorySettings(_Frozen):
    """Memory behaviour that the HTTP shell needs to know."""

    enabled: bool = True
    default_mode: Literal["full", "read", "write", "off"] = "full"
    retrieval_timeout_ms: float = Field(default=1000.0, gt=0)
    # Admission: at most this many read paths run at once; a request that cannot start one within
    # read_queue_ms goes on at once without memory (degraded=memory:busy) instead of waiting out the deadline
    # (which counts from the request's arrival, the wait included).
    max_concurrent_reads: int = Field(default=4, ge=1)
    read_queue_ms: float = Field(default=800.0, ge=0)
    # A stored turn keeps at most this many characters: head and tail around a marker (proxy/bounds.py).
    max_turn_chars: int = Field(default=16_000, ge=200)
    # Stored turns older than this many days are deleted (summaries and facts kept); 0: kept for good.
    turn_retention_days: int = Field(default=0, ge=0)


class MemoryLLMSettings(_Frozen):
    """Where memory-side model calls (facts, summaries, insights) go; empty values reuse [upstream].

    Without a model here (or in [writer] / [insights]), memory-side calls use each user's own latest chat
    model and route; without a key for that route, the key the user's client sent with that chat (held in
    process memory only, for ``client_key_ttl_s``; ``hold_client_keys = false`` turns that off).
    """

    model: str | None = None
    base_url: str | None = None
    api_key: SecretStr | None = None
    hold_client_keys: bool = True
    client_key_ttl_s: float = Field(default=7200.0, gt=0)
    timeout_s: float = Field(default=60.0, gt=0)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)


class Settings(_Frozen):
    """Everything memproxy can be told."""

    server: ServerSettings = ServerSettings()
    upstream: UpstreamSettings = UpstreamSettings()
    routes: tuple[RouteSettings, ...] = ()
    clients: tuple[ClientSettings, ...] = ()
    storage: StorageSettings = StorageSettings()
    admin: AdminSettings = AdminSettings()
    logging: LoggingSettings = LoggingSettings()
    memory: MemorySettings = MemorySettings()
    embedder: EmbedderSettings = EmbedderSettings()
    store: StoreTuning = StoreTuning()
    retrieval: RetrievalSettings = RetrievalSettings()
    injection: InjectionSettings = InjectionSettings()
    rerank: RerankSettings = RerankSettings()
    jobs: JobQueueTuning = JobQueueTuning()
    writer: WriterSettings = WriterSettings()
    extraction: ExtractionSettings = ExtractionSettings()
    memory_llm: MemoryLLMSettings = MemoryLLMSettings()
    insights: InsightSettings = InsightSettings()
    shadow: ShadowSettings = ShadowSettings()
    webhooks: tuple[WebhookSettings, ...] = ()
    telemetry: TelemetrySettings = TelemetrySettings()

    @field_validator("clients")
    @classmethod
    def _distinct_keys(cls, value: tuple[ClientSettings, ...]) -> tuple[ClientSettings, ...]:
        if len({client.key_sha256 for client in value}) != len(value):
            raise ValueError("two [[clients]] entries have the same key_sha256")
        return value

    def store_settings(self) -> StoreSettings:
        """The store's settings, rooted in the data directory."""
        return StoreSettings(path=self.storage.local_dir, **self.store.model_dump())

    def jobs_settings(self) -> JobQueueSettings:
        """The job queue's settings, its database in the data directory."""
        return JobQueueSettings(path=self.storage.local_dir / "jobs.sqlite3", **self.jobs.model_dump())


class ConfigError(Exception):
    """The configuration is invalid; the message names the key and the problem."""


def _set_path(tree: dict[str, Any], keys: list[str], value: str) -> None:
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config error: {'.'.join(keys)}: cannot set inside a non-table value")
        node = child
    node[keys[-1]] = value


def env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    """The nested tree given by ``MEMPROXY_<SECTION>__<KEY>`` variables (``MEMPROXY_CONFIG`` excluded)."""
    tree: dict[str, Any] = {}
    for name, value in environ.items():
        if not name.startswith(ENV_PREFIX) or name == f"{ENV_PREFIX}CONFIG":
            continue
        keys = [part.lower() for part in name[len(ENV_PREFIX) :].split("__")]
        if any(not key for key in keys):
            raise ConfigError(f"config error: {name}: malformed variable name")
        _set_path(tree, keys, value)
    return tree


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError as exc:
        raise ConfigError(f"config error: {path}: file not found") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config error: {path}: invalid TOML: {exc}") from exc


def _describe(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"]) or "(root)"
        lines.append(f"config error: {key}: {error['msg']}")
    return "\n".join(lines)


def load_settings(
    path: Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Settings:
    """Build the settings from file, environment and overrides; raise ``ConfigError`` when invalid."""
    env = os.environ if environ is None else environ
    if path is None and env.get(f"{ENV_PREFIX}CONFIG"):
        path = Path(env[f"{ENV_PREFIX}CONFIG"])
    try:  # secrets by reference: ${NAME} / ${file:PATH} in the file, MEMPROXY_..._FILE in the environment
        tree = expand_references(_read_toml(path), env) if path is not None else {}
        tree = _merge(tree, env_overrides(file_variables(env, ENV_PREFIX)))
    except SecretReferenceError as exc:
        raise ConfigError(str(exc)) from None
    tree = _merge(tree, overrides or {})
    try:
        return Settings.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
