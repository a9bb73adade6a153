"""The write path's settings (``[writer]``): the memory-side model, facts windows, summaries, reconciliation."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from proxy.memory.write.prefilter import DEFAULT_MIN_WORDS


class WriterSettings(BaseModel):
    """How the write path uses the memory-side model and when it summarises."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str | None = None  # None: the model (and so the route) of the chat that produced the exchange
    summary_idle_s: float = Field(default=1800.0, gt=0)
    summary_max_new_turns: int = Field(default=40, ge=1)
    summary_max_turns_per_call: int = Field(default=60, ge=2)
    insights_debounce_s: float = Field(default=900.0, ge=0)
    # the query adapter's refit (``[retrieval] query_adapter`` on): at most one per user per this many seconds,
    # and only with at least this many (message, memory) pairs mined from their chats
    adapter_refit_s: float = Field(default=86_400.0, gt=0)
    adapter_min_pairs: int = Field(default=50, ge=10)
    reconcile_neighbours: int = Field(default=3, ge=1, le=20)
    # MiniLM: an update of a fact scores >= 0.6 against it ("lives in London" / "moved to Paris" 0.60), unrelated
    # facts of one user ~0.27 ("likes jazz" / "has a dog"); LoCoMo's facts of one speaker: 98% >= 0.5
    reconcile_min_similarity: float = Field(default=0.5, ge=-1.0, le=1.0)
    # a turn's vector: unit (1 - w) * its own + w * unit(its own + the previous turn's own) (``context_vector``);
    # 0 stores each turn's own vector. 0.5: LoCoMo default R@10 0.728 against 0.715 for turns alone
    # (bench/locomo.py, "+turns"), for one more embedding per exchange (the turn before it)
    context_weight: float = Field(default=0.5, ge=0.0, le=1.0)
    # an exchange whose turns the document model (MiniLM int8, ~5 ms a text) would not have embedded within this
    # many seconds of the reply (by its backlog and pace before it starts, or a deadline while it runs) gets the
    # query side's static vectors (~0.1 ms a text): a write side short of CPU keeps turns searchable within
    # seconds, ranked at worst as with the static model alone; `memproxy_embedder_quick_texts_total` counts them.
    # 0: always the document model
    quick_vectors_after_s: float = Field(default=0.5, ge=0.0)
    # a conversation is (re-)summarised only once this many of its turns are not in its summary yet (a one-message
    # chat needs none; a short tail stays as turns, which are searchable themselves)
    summary_min_turns: int = Field(default=8, ge=1)
    # facts are extracted over a window of a user's exchanges: one call once this many wait...
    facts_window_exchanges: int = Field(default=10, ge=1)
    # ...or this long after the first of them (turns are searchable at once; facts wait at most this long). A chat
    # sends a message every 10-60 s: 5 s makes windows of one exchange, i.e. a call per message
    facts_window_wait_s: float = Field(default=20.0, ge=0.0)
    # characters of each assistant reply shown to extraction (context only)
    facts_reply_chars: int = Field(default=120, ge=0)
    # exchanges whose user messages pass no cheap local check (proxy/memory/write/prefilter.py) skip extraction
    prefilter: bool = True
    prefilter_min_words: int = Field(default=DEFAULT_MIN_WORDS, ge=1)
