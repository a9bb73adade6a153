"""The kinds of the memory jobs, and the insights trigger's dedupe key: the strings stored in the queue's rows.

The write path enqueues ``exchange``, ``facts`` and ``summary`` jobs and handles them itself; after a facts
window it triggers the ``insights`` job that the ``insights`` package handles and schedules (it imports the
kind and the dedupe key from here, so that both sides name the same job). Changing a value orphans the jobs
already queued under the old one.
"""

from __future__ import annotations

from typing import Final

EXCHANGE_JOB: Final = "exchange"
FACTS_JOB: Final = "facts"
SUMMARY_JOB: Final = "summary"
INSIGHTS_JOB: Final = "insights"
INSIGHTS_DEDUPE_KEY: Final = "insights"  # every trigger of a user's insights collapses into one pending job
WEBHOOK_JOB: Final = "webhook"  # one signed delivery of one event to one configured receiver
ADAPTER_JOB: Final = "adapter"  # one refit of a user's query adapter (``adapter_job``)
