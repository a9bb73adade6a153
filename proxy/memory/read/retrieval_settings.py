"""Settings of the read path: query building, arms, fusion, scoring, and injection.

Two models, one per component: ``RetrievalSettings`` (everything that decides which memories come back and
in what order) and ``InjectionSettings`` (how the chosen memories are written into the request). Both are
frozen and reject unknown keys. The numeric defaults of fusion and the boosts were tuned with the LoCoMo
harness (``bench/locomo.py``) on conversations 0-4 and checked on 5-9: the published 0.8/0.1/0.1 fusion
weights came from a stronger embedder than the embedded MiniLM, whose dense arm is weaker than BM25 on chat
turns (``RETRIEVAL-CALIBRATION.md``), so they are config and the harness measures them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class RetrievalSettings(BaseModel):
    """Which memories the read path finds for a request, and how it ranks them."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # query
    short_query_words: int = Field(4, ge=0)  # a latest message of at most this many words is "short"
    expand_anaphoric: bool = True  # short or anaphoric latest message: add the previous user turn
    # arms
    dense_k: int = Field(60, ge=1)  # hits asked of the dense arm, per pool (facts; recent turns+summaries)
    bm25_k: int = Field(60, ge=1)  # hits asked of the keyword arm, per pool
    entity_k: int = Field(20, ge=0)  # most memories the entity arm may add; 0 turns the arm off
    entity_surface_max: int = Field(10, ge=0)  # a name on more memories only lifts what other arms found
    entity_text_names: bool = False  # names written (capitalised) in hits' text count too, among those hits
    bm25_drop_stopwords: bool = True  # send only content words to BM25
    min_dense_score: float = -1.0  # dense hits below this cosine are ignored (-1 keeps all)
    arm_timeout_ms: float = Field(250.0, gt=0)  # each arm (and the query embedding) gets this long
    # fusion (weights tuned on LoCoMo conversations 0-4 with the embedded MiniLM: bench/locomo.py)
    fusion: Literal["weighted", "rrf"] = "weighted"
    dense_weight: float = Field(0.35, ge=0)  # MiniLM's dense arm is weaker than BM25 on chat turns
    bm25_weight: float = Field(0.4, ge=0)  # 0.65 before term matching, which also rewards the query's words
    entity_weight: float = Field(0.1, ge=0)
    rrf_k: int = Field(60, ge=1)
    # keyword gating (off: it cost 0.02 recall@10 on LoCoMo, where BM25 is the stronger arm)
    gating: bool = False
    gating_top_n: int = Field(5, ge=1)  # BM25 results inspected by the gate
    gating_min_term_fraction: float = Field(0.5, ge=0, le=1)
    # subject fusion: score += subject_weight * max cos(q, s) over the memory's subjects in the top-N; off by
    # default: with the subjects the write path creates, 0.4 cost LoCoMo R@10 0.022 (tune) / 0.013 (test), and
    # the entity arm already brings in the memories of a subject the query names
    subject_weight: float = Field(0.0, ge=0)  # 0 turns it off
    subject_top_n: int = Field(40, ge=1)
    # general boosts from the calibration (all additive; 0 turns each off; tuned with bench/locomo.py)
    term_match_weight: float = Field(1.0, ge=0)  # + w x soft coverage of the query's words (term_match.py)
    neighbour_weight: float = Field(0.5, ge=0)  # + a * best adjacent turn's fused score
    neighbour_window_s: float = Field(60.0, ge=0)  # turns this close in one conversation are adjacent
    conversation_weight: float = Field(0.3, ge=0)  # + w x the best fused score in the memory's conversation
    date_weight: float = Field(0.3, ge=0)  # + w when a memory's date matches a month/year the query names
    day_weight: float = Field(0.5, ge=0)  # + w more when it is within a day of a whole day the query names
    # scoring (see proxy/memory/read/scoring.py): "bounded" = relevance x a bounded bonus for being new and
    # important; "minmax" = the seed's sum of min-max normalised relevance, recency and importance
    max_candidates: int = Field(60, ge=1)  # the most relevant this many (after fusion and boosts) are scored
    scoring: Literal["bounded", "minmax"] = "bounded"
    recency_bonus: float = Field(0.2, ge=0)  # bounded: x (1 + this) for a fact created just now
    recency_half_life_days: float = Field(30.0, gt=0)  # bounded: the recency bonus halves every this many days
    importance_bonus: float = Field(0.0, ge=0, le=1)  # bounded: x (1 + this x (importance - 5) / 5)
    relevance_weight: float = Field(1.0, ge=0)  # minmax only
    recency_weight: float = Field(1.0, ge=0)  # minmax only
    importance_weight: float = Field(1.0, ge=0)  # minmax only
    recency_decay: float = Field(0.995, gt=0, le=1)  # minmax, and recent messages: per hour since last access
    # what gets injected
    max_facts: int = Field(8, ge=0)
    max_past: int = Field(12, ge=0)  # relevant past turns and summaries (the budget binds first)
    # None: turns and summaries of all time (a summary is a lossy stand-in for the turns it tells, docs/tuning.md)
    turn_window_days: float | None = Field(None, gt=0)
    # with a window, the turns past it: "unsummarised" those no summary stands in for, "none" none (summaries only)
    turns_past_window: Literal["unsummarised", "none"] = "unsummarised"
    recent_messages: int = Field(5, ge=0)  # the user's last messages from other conversations
    max_insights: int = Field(10, ge=0)
    summary_cooldown_minutes: float = Field(0.0, ge=0)  # skip summaries injected this recently (0: off)
    # the per-user query adapter (proxy/memory/query_adapter.py): refit by a write-side job, applied to the dense
    # arm's query vector. Off: on LoCoMo it lost on both splits (docs/tuning.md)
    query_adapter: bool = False
    query_adapter_cache_bytes: int = Field(32 * 2**20, ge=0)  # loaded adapters kept in RAM (~400 kB each)


class InjectionSettings(BaseModel):
    """How the memory block is written into the request."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    budget_tokens: int = Field(600, ge=0)  # the whole block, preamble included (estimated, see injection)
    max_item_tokens: int = Field(90, ge=8)  # longer items are cut to their best excerpt
    dedupe_against_conversation: bool = True
    drop_repeated: bool = False  # leave out a fact drawn only from turns the block holds above it (docs/tuning.md)
    # Where the block goes (proxy.memory.read.placement): "cached" keeps the provider's prompt cache (a stable
    # part fixed per conversation in the system prompt, later additions attached to user messages), "system"
    # re-writes the system prompt every request, "user" puts the whole block on the latest user message.
    placement: Literal["cached", "system", "user"] = "cached"
    turn_budget_tokens: int = Field(100, ge=0)  # "cached": one request's addition (a turn part)
    conversation_budget_tokens: int = Field(900, ge=0)  # "cached": everything a conversation carries
    conversations_cache_bytes: int = Field(16 * 2**20, ge=0)  # "cached": the ledger of what conversations carry
