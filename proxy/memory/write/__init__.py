"""The write path: what memory learns from a finished chat, after the chat has been answered.

Owns, by module:

- the durable job queue: ``job_types`` (its vocabulary: settings, errors, states, metrics), ``queue_db`` (its
  SQLite database), ``queue`` (``Job`` and the ``JobQueue`` API), ``runner`` (``JobRunner``), ``group_commit``
  (shared fsyncs), ``job_kinds`` (the kinds stored in its rows, the insights trigger's among them);
- the writer's job handlers: ``writer`` (the ``exchange`` job), ``turns``, ``facts_window``, ``facts``,
  ``summaries``, ``subjects``, with ``settings`` and ``payloads``;
- the memory-side model calls: ``llm`` (clients) and ``routing`` (which route a model name takes),
  ``latest_chat`` (each user's latest chat model and key), ``prompts`` and ``extraction``;
- the screens on everything stored: ``screens`` (one text), ``fact_screens`` (extracted facts),
  ``identifiers``, ``instructions``, ``sensitive``, ``folding``; and ``prefilter`` (exchanges not worth a call),
  ``tool_turns`` (tool results and calls as turns).

May import: the memory core's shared root modules (``proxy.memory.errors``, ``service``, ``features``,
``text_cap``, ``lazy``), ``proxy.memory.store`` and ``proxy.memory.embedders``. Never ``proxy.memory.read``,
anything of ``proxy`` outside ``proxy.memory`` (the HTTP shell), nor ``insights`` (which imports from here).

What the rest of memproxy may use of it is this package's ``__all__`` (imported on first use).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from proxy.memory.lazy import exports_on_first_use

if TYPE_CHECKING:
    from proxy.memory.write.adapter_job import AdapterJobs
    from proxy.memory.write.dialect_llm import ANTHROPIC_ROUTE, DialectLLM, DialectRouter
    from proxy.memory.write.extraction import ExtractionSettings, Extractor
    from proxy.memory.write.identifiers import identifier_reason
    from proxy.memory.write.instructions import injection_reason
    from proxy.memory.write.job_kinds import INSIGHTS_DEDUPE_KEY, INSIGHTS_JOB
    from proxy.memory.write.job_types import (
        LATENCY_BUCKETS_S,
        JobQueueSettings,
        JobQueueTuning,
        QueueMetrics,
        RetryLater,
        StepLatency,
        WaitForConfig,
    )
    from proxy.memory.write.latest_chat import LatestChats
    from proxy.memory.write.llm import (
        KeySource,
        LiteLLMClient,
        LiteLLMSettings,
        LLMBadOutput,
        LLMClient,
        LLMUnavailable,
        OpenAICompatibleLLM,
        OpenAICompatibleSettings,
        PrefixRouter,
        Route,
        UsageObserver,
    )
    from proxy.memory.write.payloads import exchange_payload
    from proxy.memory.write.queue import Handler, Job, JobQueue
    from proxy.memory.write.routing import route_index
    from proxy.memory.write.runner import JobRunner
    from proxy.memory.write.settings import WriterSettings
    from proxy.memory.write.stated import Stated, StatedFacts
    from proxy.memory.write.webhooks import Webhooks, WebhookSettings
    from proxy.memory.write.writer import Writer, enqueue_exchange

# What the face exports, and the module that defines it (imported on first use).
_WHERE = {
    "AdapterJobs": "proxy.memory.write.adapter_job",
    "ANTHROPIC_ROUTE": "proxy.memory.write.dialect_llm",
    "DialectLLM": "proxy.memory.write.dialect_llm",
    "DialectRouter": "proxy.memory.write.dialect_llm",
    "ExtractionSettings": "proxy.memory.write.extraction",
    "Extractor": "proxy.memory.write.extraction",
    "Handler": "proxy.memory.write.queue",
    "INSIGHTS_DEDUPE_KEY": "proxy.memory.write.job_kinds",
    "INSIGHTS_JOB": "proxy.memory.write.job_kinds",
    "Job": "proxy.memory.write.queue",
    "JobQueue": "proxy.memory.write.queue",
    "JobQueueSettings": "proxy.memory.write.job_types",
    "JobQueueTuning": "proxy.memory.write.job_types",
    "JobRunner": "proxy.memory.write.runner",
    "KeySource": "proxy.memory.write.llm",
    "LATENCY_BUCKETS_S": "proxy.memory.write.job_types",
    "LLMBadOutput": "proxy.memory.write.llm",
    "LLMClient": "proxy.memory.write.llm",
    "LLMUnavailable": "proxy.memory.write.llm",
    "LatestChats": "proxy.memory.write.latest_chat",
    "LiteLLMClient": "proxy.memory.write.llm",
    "LiteLLMSettings": "proxy.memory.write.llm",
    "OpenAICompatibleLLM": "proxy.memory.write.llm",
    "OpenAICompatibleSettings": "proxy.memory.write.llm",
    "PrefixRouter": "proxy.memory.write.llm",
    "QueueMetrics": "proxy.memory.write.job_types",
    "RetryLater": "proxy.memory.write.job_types",
    "Route": "proxy.memory.write.llm",
    "Stated": "proxy.memory.write.stated",
    "StatedFacts": "proxy.memory.write.stated",
    "StepLatency": "proxy.memory.write.job_types",
    "UsageObserver": "proxy.memory.write.llm",
    "WaitForConfig": "proxy.memory.write.job_types",
    "WebhookSettings": "proxy.memory.write.webhooks",
    "Webhooks": "proxy.memory.write.webhooks",
    "Writer": "proxy.memory.write.writer",
    "enqueue_exchange": "proxy.memory.write.writer",
    "WriterSettings": "proxy.memory.write.settings",
    "exchange_payload": "proxy.memory.write.payloads",
    "identifier_reason": "proxy.memory.write.identifiers",
    "injection_reason": "proxy.memory.write.instructions",
    "route_index": "proxy.memory.write.routing",
}
__all__ = [
    "ANTHROPIC_ROUTE",
    "INSIGHTS_DEDUPE_KEY",
    "INSIGHTS_JOB",
    "LATENCY_BUCKETS_S",
    "AdapterJobs",
    "DialectLLM",
    "DialectRouter",
    "ExtractionSettings",
    "Extractor",
    "Handler",
    "Job",
    "JobQueue",
    "JobQueueSettings",
    "JobQueueTuning",
    "JobRunner",
    "KeySource",
    "LLMBadOutput",
    "LLMClient",
    "LLMUnavailable",
    "LatestChats",
    "LiteLLMClient",
    "LiteLLMSettings",
    "OpenAICompatibleLLM",
    "OpenAICompatibleSettings",
    "PrefixRouter",
    "QueueMetrics",
    "RetryLater",
    "Route",
    "Stated",
    "StatedFacts",
    "StepLatency",
    "UsageObserver",
    "WaitForConfig",
    "WebhookSettings",
    "Webhooks",
    "Writer",
    "WriterSettings",
    "enqueue_exchange",
    "exchange_payload",
    "identifier_reason",
    "injection_reason",
    "route_index",
]

__getattr__ = exports_on_first_use(__name__, _WHERE)
