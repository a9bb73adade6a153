"""The proxy's paths, by what happens on them (access checks, body handling and routing agree on these)."""

from __future__ import annotations

CHAT_PATHS = frozenset({"/v1/chat/completions", "/chat/completions"})
RESPONSES_PATHS = frozenset({"/v1/responses", "/responses"})
MESSAGES_PATHS = frozenset({"/v1/messages", "/messages"})
# The paths that carry memory: a JSON body, read whole (within server.body_timeout_s) before the handler runs.
MEMORY_PATHS = CHAT_PATHS | RESPONSES_PATHS | MESSAGES_PATHS
MANAGEMENT_PREFIX = "/v1/memory/"
ANTHROPIC_PREFIXES = ("/v1/messages", "/messages")


def is_relayed(path: str) -> bool:
    """Whether ``path`` is an API path relayed as it is (``/v1/*`` without memory: embeddings, audio, files,
    ``/v1/responses/{id}``, ...): its body is streamed, never read whole."""
    return path.startswith("/v1/") and path not in MEMORY_PATHS and not path.startswith(MANAGEMENT_PREFIX)


def is_api(path: str) -> bool:
    """Whether ``path`` is a client API path (client keys, origins and hosts apply): the memory dialects and
    every relayed ``/v1`` path (``/v1/models`` included); management has its own admin key."""
    return path in MEMORY_PATHS or is_relayed(path)
