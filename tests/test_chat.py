"""The chat request helpers of the HTTP shell: the X-Memory-Arms entries rendered from the read path's data."""

from __future__ import annotations

from proxy.chat import arms_entries


def test_arms_entries_list_the_arms_then_gated_then_each_degraded_step() -> None:
    """The header lists the arms that ran, ``gated``, then ``degraded=<step>:<reason>`` in the order reported."""
    entries = arms_entries(("dense", "bm25", "entity", "gated"), {"rerank": "timeout", "write": "unavailable:disk"})
    assert ",".join(entries) == "dense,bm25,entity,gated,degraded=rerank:timeout,degraded=write:unavailable:disk"


def test_arms_entries_of_a_request_without_memory_are_empty() -> None:
    """No arm ran and nothing degraded: the header value is the empty string, as before."""
    assert ",".join(arms_entries((), {})) == ""
