"""One user's insight regeneration: read their messages, cluster, generate, replace the set atomically.

``regenerate`` reads the user's own turns (role "user") of the last ``window_weeks`` with their vectors
from the store, clusters them off the event loop, asks the model for one insight per cluster (concurrently,
in one task group) and replaces the user's insight set:

1. the new set is added, all records sharing a fresh ``generation_id``;
2. then every other valid insight of the user is marked ``valid=False`` (kept as history for export).

Readers that must never see two sets at once (between steps 1 and 2, or after a crash between them) use
``current_insights``, which keeps only the newest generation. A run that finds nothing to say (too few
messages, or the model declines every cluster) leaves the previous set in place.

Concurrent calls for one user (a job, a manual trigger) collapse: a call made while a run is in flight
awaits that run's result instead of starting another. The queue's dedupe key does the same for jobs not
yet started (see ``insights.scheduler``).
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable, Iterator
from datetime import datetime, timedelta

import numpy as np
import numpy.typing as npt
import structlog
from pydantic import BaseModel, ConfigDict, Field

from insights.clustering import Cluster, cluster_messages
from insights.generation import InsightError, InsightRun, UserMessage, generate_insight
from proxy.memory.store import Kind, MemoryRecord, MemoryStore, new_id, newest_generation, utcnow
from proxy.memory.write import LLMClient, LLMUnavailable

log = structlog.get_logger("memproxy.insights")

PAGE_SIZE = 1000
WEEK_S = 7 * 24 * 3600.0


class InsightSettings(BaseModel):
    """What insights are made from, how many, how often, and by which model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    window_weeks: int = Field(default=8, ge=1, le=520)
    max_clusters: int = Field(default=8, ge=1, le=32)
    min_cluster_size: int = Field(default=5, ge=2)
    min_messages: int = Field(default=20, ge=2)
    max_messages: int = Field(default=5000, ge=2)  # the newest ones in the window
    min_message_words: int = Field(default=3, ge=1)  # "thanks", "ok!" say nothing about the user
    schedule_interval_s: float = Field(default=WEEK_S, gt=0)
    schedule_check_s: float = Field(default=3600.0, gt=0)  # how often the scheduler looks for due users
    model: str | None = None  # None: [writer]/[memory_llm] model, else the user's latest chat model (scheduler)
    prompt_token_budget: int = Field(default=1000, ge=50)  # representative messages per call
    seed: int = 0


_Runs = dict[str, "asyncio.Future[list[MemoryRecord]]"]
_IN_FLIGHT: weakref.WeakKeyDictionary[MemoryStore, _Runs] = weakref.WeakKeyDictionary()


async def regenerate(
    store: MemoryStore,
    llm: LLMClient,
    user_id: str,
    settings: InsightSettings,
    now: datetime | None = None,
    *,
    model: str | None = None,
) -> list[MemoryRecord]:
    """Regenerate ``user_id``'s insights from the window ending at ``now``; returns the current set.

    ``settings.model`` wins over ``model``; with neither, ``InsightError``. ``LLMUnavailable`` propagates.
    """
    chosen = settings.model or model
    if not chosen:
        raise InsightError("no model for insights: set [insights] model or pass the chat's model")
    runs = _IN_FLIGHT.setdefault(store, {})
    return await _coalesced(runs, user_id, lambda: _regenerate(store, llm, user_id, settings, now, chosen))


async def _coalesced(runs: _Runs, key: str, start: Callable[[], Awaitable[list[MemoryRecord]]]) -> list[MemoryRecord]:
    """The result of the run in flight for ``key``, or of a new one started by this call."""
    running = runs.get(key)
    if running is not None:
        log.info("insights.joined_running")
        return await asyncio.shield(running)
    future: asyncio.Future[list[MemoryRecord]] = asyncio.get_running_loop().create_future()
    runs[key] = future
    try:
        result = await start()
    except BaseException as error:
        shared = error if isinstance(error, Exception) else InsightError("the insight run was cancelled")
        future.set_exception(shared)
        future.exception()  # retrieved here: no "never retrieved" warning when nobody joined
        raise
    else:
        future.set_result(result)
        return result
    finally:
        runs.pop(key, None)


async def _regenerate(
    store: MemoryStore, llm: LLMClient, user_id: str, settings: InsightSettings, now: datetime | None, model: str
) -> list[MemoryRecord]:
    end = now or utcnow()
    records = await load_user_messages(store, user_id, end - timedelta(weeks=settings.window_weeks), end, settings)
    clusters = await cluster_user_messages(store, records, settings)
    messages = [UserMessage(r.id, r.text, r.created_at) for r in records]
    if not clusters:
        log.info("insights.nothing_to_say", messages=len(messages))
        return await current_insights(store, user_id)
    run = InsightRun(user_id, new_id(), utcnow(), model, settings.prompt_token_budget)
    fresh = [record for record in await _generate_all(llm, run, clusters, messages) if record is not None]
    if not fresh:
        log.info("insights.nothing_to_say", messages=len(messages), clusters=len(clusters))
        return await current_insights(store, user_id)
    return await replace_insights(store, user_id, fresh)


async def _generate_all(
    llm: LLMClient, run: InsightRun, clusters: list[Cluster], messages: list[UserMessage]
) -> list[MemoryRecord | None]:
    """One insight (or None) per cluster, asked concurrently; the first failure cancels the rest and is raised.

    An unreachable model wins over other failures, so that the job waits for it rather than spending attempts.
    """
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(generate_insight(llm, run, c, messages)) for c in clusters]
    except ExceptionGroup as failed:
        leaves = list(_leaves(failed))
        raise next((e for e in leaves if isinstance(e, LLMUnavailable)), leaves[0]) from None
    return [task.result() for task in tasks]


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    """The exceptions inside ``group``, nested groups flattened."""
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            yield from _leaves(error)
        else:
            yield error


async def load_user_messages(
    store: MemoryStore, user_id: str, since: datetime, until: datetime, settings: InsightSettings
) -> list[MemoryRecord]:
    """The user's own turns sent in [since, until], oldest first, at most the newest ``max_messages``."""
    found: list[MemoryRecord] = []
    for record in await store.user_turns(user_id, since, until):  # newest first, one columnar read
        if len(found) >= settings.max_messages:
            break
        if _worth_clustering(record, settings):
            found.append(record)
    return found[::-1]


def _worth_clustering(record: MemoryRecord, settings: InsightSettings) -> bool:
    """A user message long enough to say something about the user."""
    return record.role == "user" and len(record.text.split()) >= settings.min_message_words


async def message_vectors(store: MemoryStore, records: list[MemoryRecord]) -> npt.NDArray[np.float32]:
    """The stored vectors of ``records``; any without one (or of another size) is embedded again."""
    dim = store.embedder.dim
    vectors = np.zeros((len(records), dim), dtype=np.float32)
    missing: list[int] = []
    for i, record in enumerate(records):
        if record.embedding is not None and len(record.embedding) == dim:
            vectors[i] = np.asarray(record.embedding, dtype=np.float32)
        else:
            missing.append(i)
    if missing:
        vectors[missing] = await store.embedder.embed_documents([records[i].text for i in missing])
    return vectors


async def cluster_user_messages(
    store: MemoryStore, records: list[MemoryRecord], settings: InsightSettings
) -> list[Cluster]:
    """Clusters of ``records`` (indices into that list), computed off the event loop."""
    if len(records) < settings.min_messages:
        return []
    vectors = await message_vectors(store, records)
    return await asyncio.to_thread(
        cluster_messages,
        vectors,
        max_clusters=settings.max_clusters,
        min_cluster_size=settings.min_cluster_size,
        min_messages=settings.min_messages,
        seed=settings.seed,
    )


async def valid_insights(store: MemoryStore, user_id: str) -> list[MemoryRecord]:
    """Every valid insight record of the user, newest first (normally one generation)."""
    found: list[MemoryRecord] = []
    cursor: str | None = None
    while True:
        page = await store.list(user_id, [Kind.INSIGHT], limit=PAGE_SIZE, cursor=cursor)
        found += page.data
        if page.next_cursor is None:
            return found
        cursor = page.next_cursor


async def current_insights(store: MemoryStore, user_id: str) -> list[MemoryRecord]:
    """The user's current insight set: the newest valid generation only."""
    return newest_generation(await valid_insights(store, user_id))


async def replace_insights(store: MemoryStore, user_id: str, fresh: list[MemoryRecord]) -> list[MemoryRecord]:
    """Add ``fresh`` (one generation), then retire every other valid insight of the user."""
    generation = fresh[0].generation_id
    await store.add(fresh)
    retired = [r for r in await valid_insights(store, user_id) if r.generation_id != generation]
    if retired:
        await store.update_many(user_id, [r.id for r in retired], valid=False)
    log.info("insights.replaced", added=len(fresh), retired=len(retired))
    return newest_generation(fresh)
