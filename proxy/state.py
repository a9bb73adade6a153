"""The typed state every handler reads: built once by the app factory, stored under one ``web.AppKey``."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable

from aiohttp import web

from proxy.commit import ExchangeCommitter
from proxy.config import Settings
from proxy.dialects.targets import ResponseChains, Targets
from proxy.memory import MemoryService
from proxy.metrics import Metrics
from proxy.upstream import Router


@dataclasses.dataclass(slots=True)
class AppState:
    """Components shared by the handlers."""

    settings: Settings
    metrics: Metrics
    memory: MemoryService
    router: Router = dataclasses.field(init=False)  # set at startup: it needs the running loop
    targets: Targets = dataclasses.field(init=False)  # set at startup, with the router
    response_chains: ResponseChains = dataclasses.field(default_factory=ResponseChains)
    commits: ExchangeCommitter = dataclasses.field(init=False)  # set at startup, after the memory service
    stopping: bool = False
    # More Prometheus text for ``/metrics`` (a chat process: the memory writer's numbers), merged under its own
    extra_metrics: Callable[[], Awaitable[bytes]] | None = None
    read_slots: asyncio.Semaphore = dataclasses.field(init=False)  # memory.max_concurrent_reads

    def __post_init__(self) -> None:
        self.read_slots = asyncio.Semaphore(self.settings.memory.max_concurrent_reads)


STATE: web.AppKey[AppState] = web.AppKey("memproxy_state", AppState)
