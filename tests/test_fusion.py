"""Tests of fusion: how the arms' hits become one ranked list, gating, entities and boosts."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.memory.read.boosts import (
    apply_date_boost,
    apply_subject_boost,
    behind_newer_facts,
    conversation_lifts,
    smooth_neighbours,
)
from proxy.memory.read.candidates import BM25, DENSE, ENTITY, ArmHit, Candidate, min_max
from proxy.memory.read.fusion import _ranked, _ranked_ids, fuse, keyword_gate, reciprocal_rank_fusion, weighted_fusion
from proxy.memory.read.names import (
    NameIndex,
    entity_scores,
    name_damping,
    names_in_query,
    text_name_scores,
    written_names,
)
from proxy.memory.read.query import build_query
from proxy.memory.read.retrieval_settings import RetrievalSettings
from proxy.memory.store.records import Kind, MemoryRecord

T0 = datetime(2026, 3, 1, 12, tzinfo=UTC)


def _rec(text: str, rid: str, **fields: object) -> MemoryRecord:
    """A memory of user u with a fixed id."""
    fields.setdefault("kind", Kind.FACT)
    fields.setdefault("created_at", T0)
    return MemoryRecord(user_id="u", text=text, id=rid, **fields)  # type: ignore[arg-type]


def _hits(*pairs: tuple[MemoryRecord, float]) -> list[ArmHit]:
    """Arm hits from (record, score) pairs."""
    return [ArmHit(record, score) for record, score in pairs]


def _ids(candidates: list) -> list[str]:  # type: ignore[type-arg]
    """The ids of a candidate list, in order."""
    return [c.id for c in candidates]


JAZZ = _rec("Maya loves vinyl records and jazz", "jazz")
BDAY = _rec("Sam's birthday is June 18", "bday")
INK = _rec("Maya needs printer ink", "ink")
HIKE = _rec("Maya goes hiking in the Alps", "hike")


def test_min_max_maps_onto_zero_one_and_equal_values_onto_one() -> None:
    """The best score becomes 1, the worst 0; a single or tied list is all 1."""
    assert min_max([2.0, 4.0, 3.0]) == [0.0, 1.0, 0.5]
    assert min_max([0.7, 0.7]) == [1.0, 1.0]
    assert min_max([3.2113, 3.2113001]) == [1.0, 1.0]  # float32 rounding of one BM25 score is a tie
    assert min_max([]) == []


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=30))
def test_min_max_keeps_order_within_zero_one(values: list[float]) -> None:
    """Normalisation never reorders scores and stays within [0, 1]."""
    out = min_max(values)
    assert all(0.0 <= v <= 1.0 for v in out)
    for a, b, x, y in zip(values, out, values[1:], out[1:], strict=False):
        assert (a < x) <= (b <= y)


def test_weighted_fusion_is_the_weighted_sum_of_normalised_scores() -> None:
    """Dense 0.8 / BM25 0.1: a memory top in both arms beats one top in dense only."""
    arms = {
        DENSE: _hits((JAZZ, 0.9), (BDAY, 0.5), (INK, 0.1)),
        BM25: _hits((BDAY, 12.0), (JAZZ, 4.0)),
    }
    fused = weighted_fusion(arms, {DENSE: 0.8, BM25: 0.1})
    assert _ids(fused) == ["jazz", "bday", "ink"]
    assert [round(c.fused, 4) for c in fused] == [0.8, 0.8 * 0.5 + 0.1, 0.0]
    assert fused[0].arm_scores == {DENSE: 0.9, BM25: 4.0}


def test_bm25_only_hit_surfaces_in_the_union() -> None:
    """A memory only the keyword arm found is still a candidate."""
    fused = weighted_fusion({DENSE: _hits((JAZZ, 0.9)), BM25: _hits((HIKE, 3.0))}, {DENSE: 0.5, BM25: 0.5})
    assert set(_ids(fused)) == {"jazz", "hike"}


def test_entity_arm_scores_are_not_min_max_flattened() -> None:
    """A common name's damped score stays small instead of being stretched to 1."""
    fused = weighted_fusion({ENTITY: _hits((JAZZ, 0.2), (INK, 0.2))}, {ENTITY: 0.1})
    assert [round(c.fused, 3) for c in fused] == [0.02, 0.02]


def test_reciprocal_rank_fusion_adds_one_over_k_plus_rank() -> None:
    """RRF with k = 60: first in both arms gets 2/61; ties share a rank."""
    arms = {
        DENSE: _hits((JAZZ, 0.9), (BDAY, 0.5)),
        BM25: _hits((JAZZ, 9.0), (INK, 1.0), (HIKE, 1.0)),
    }
    fused = reciprocal_rank_fusion(arms, k=60)
    scores = {c.id: c.fused for c in fused}
    assert scores["jazz"] == pytest.approx(2 / 61)
    assert scores["bday"] == pytest.approx(1 / 62)
    assert scores["ink"] == scores["hike"] == pytest.approx(1 / 62)
    assert _ids(fused)[0] == "jazz"


def test_keyword_gate_drops_bm25_when_no_top_hit_holds_half_the_terms() -> None:
    """BM25 hits that matched one word of four are noise; one matching two of four is not."""
    query_terms = ("caroline", "adoption", "agency", "interview")
    noise = _hits((_rec("The agency was closed", "n1"), 5.0), (_rec("An interview", "n2"), 4.0))
    assert keyword_gate(query_terms, noise, top_n=5, min_fraction=0.5)
    good = [*noise, ArmHit(_rec("Caroline had an adoption interview", "g"), 3.0)]
    assert not keyword_gate(query_terms, good, top_n=5, min_fraction=0.5)
    assert keyword_gate(query_terms, good, top_n=2, min_fraction=0.5)


def test_keyword_gate_compares_inflected_forms() -> None:
    """ "hikes" in a memory counts for "hiking" in the question."""
    assert not keyword_gate(("hiking", "alps"), _hits((HIKE, 1.0)), top_n=3, min_fraction=0.5)
    assert not keyword_gate(("hikes",), _hits((HIKE, 1.0)), top_n=3, min_fraction=1.0)


def test_fuse_reports_gating_and_leaves_bm25_out() -> None:
    """When gated, a BM25-only noise hit does not enter the candidates and the result says gated."""
    query = build_query([{"role": "user", "content": "Which jazz records does Maya collect?"}])
    assert query is not None
    noise = _rec("Records of the meeting", "noise")
    arms = {DENSE: _hits((JAZZ, 0.8)), BM25: _hits((noise, 2.0))}
    result = fuse(arms, query, RetrievalSettings(gating=True))
    assert result.gated
    assert _ids(result.candidates) == ["jazz"]
    ungated = fuse(arms, query, RetrievalSettings(gating=False))
    assert not ungated.gated
    assert set(_ids(ungated.candidates)) == {"jazz", "noise"}


def test_fuse_never_gates_bm25_when_dense_has_nothing() -> None:
    """With no dense answer (embedder down), BM25 alone serves even if its hits are weak."""
    query = build_query([{"role": "user", "content": "Which jazz records does Maya collect?"}])
    assert query is not None
    noise = _rec("Records of the meeting", "noise")
    result = fuse({DENSE: [], BM25: _hits((noise, 2.0))}, query, RetrievalSettings())
    assert not result.gated
    assert _ids(result.candidates) == ["noise"]


def test_fuse_rrf_switch() -> None:
    """fusion="rrf" ranks by reciprocal ranks instead of weighted scores."""
    query = build_query([{"role": "user", "content": "Maya jazz vinyl records"}])
    assert query is not None
    arms = {DENSE: _hits((JAZZ, 0.9), (INK, 0.2)), BM25: _hits((JAZZ, 5.0))}
    result = fuse(arms, query, RetrievalSettings(fusion="rrf", subject_weight=0))
    assert result.candidates[0].fused == pytest.approx(2 / 61)


def test_names_are_found_in_the_query_case_insensitively_as_whole_words() -> None:
    """ "caroline" finds Caroline's memories; "Al" does not match inside "also"; multi-word names match."""
    index = NameIndex.build(
        [
            _rec("x", "a", entities=("Caroline",)),
            _rec("y", "b", entities=("Al", "New York")),
            _rec("z", "c", entities=("王小明",)),
        ]
    )
    assert names_in_query("what did CAROLINE say?", index) == ["caroline"]
    assert names_in_query("I also went there", index) == []
    assert names_in_query("Al moved to new york", index) == ["al", "new york"]
    assert names_in_query("我昨天见到王小明了", index) == ["王小明"]


def test_subject_names_link_to_their_memories() -> None:
    """A subject record's name points at the memories it lists in source_ids."""
    subject = _rec("Pottery", "s1", kind=Kind.SUBJECT, source_ids=("m1", "m2"))
    index = NameIndex.build([subject])
    shared = name_damping(2)
    assert entity_scores(names_in_query("my pottery class", index), index) == {"m1": shared, "m2": shared}


def test_a_name_shared_by_many_memories_counts_for_less() -> None:
    """A name on 60 memories boosts each far less than a name on one."""
    many = [_rec(f"t{i}", f"m{i}", entities=("Maya",)) for i in range(60)]
    index = NameIndex.build([*many, _rec("Sam's birthday", "sam", entities=("Sam",))])
    scores = entity_scores(names_in_query("maya and sam", index), index)
    assert scores["sam"] == 1.0
    assert scores["m0"] == pytest.approx(name_damping(60))
    assert scores["m0"] < 0.25
    assert max(scores, key=scores.__getitem__) == "sam"


def test_pronoun_entities_are_not_indexed() -> None:
    """Extraction noise such as "I" or "she" as an entity does not tie every question to a memory."""
    index = NameIndex.build([_rec("x", "a", entities=("I", "she", "x", "Bo"))])
    assert set(index.names) == {"bo"}


@given(st.lists(st.floats(-1.0, 1.0), min_size=1, max_size=10), st.floats(0.0, 2.0))
def test_subject_boost_never_sinks_a_memory(cosines: list[float], weight: float) -> None:
    """Subject fusion is additive only: no candidate's score goes down, whatever the cosines."""
    records = [_rec(f"m{i}", f"m{i}") for i in range(len(cosines))]
    candidates = weighted_fusion({DENSE: _hits(*((r, 0.5) for r in records))}, {DENSE: 1.0})
    subjects = [
        ArmHit(_rec(f"s{i}", f"s{i}", kind=Kind.SUBJECT, source_ids=(f"m{i}",)), c) for i, c in enumerate(cosines)
    ]
    boosted = {c.id: c.fused for c in apply_subject_boost(candidates, subjects, weight)}
    assert all(boosted[c.id] >= c.fused for c in candidates)


def test_subject_boost_lifts_memories_of_the_querys_subjects() -> None:
    """A memory linked to a subject the query is close to moves up by lambda x cos."""
    candidates = weighted_fusion({DENSE: _hits((INK, 0.9), (JAZZ, 0.8), (HIKE, 0.1))}, {DENSE: 1.0})
    music = ArmHit(_rec("music", "s", kind=Kind.SUBJECT, source_ids=("jazz",)), 0.7)
    boosted = apply_subject_boost(candidates, [music], 0.4)
    by_id = {c.id: c for c in boosted}
    assert by_id["jazz"].fused == pytest.approx(0.875 + 0.28)
    assert by_id["jazz"].boosts == {"subject": pytest.approx(0.28)}
    assert by_id["ink"].fused == 1.0


def test_neighbour_smoothing_lifts_the_turn_next_to_a_strong_one() -> None:
    """The answer turn right after a strongly matching question turn gets part of its score."""
    question = _rec("Where did you go hiking?", "q", kind=Kind.TURN, conversation_id="c")
    answer = _rec(
        "We went to the Alps", "a", kind=Kind.TURN, conversation_id="c", created_at=T0 + timedelta(seconds=30)
    )
    far = _rec("Something else", "f", kind=Kind.TURN, conversation_id="c", created_at=T0 + timedelta(days=1))
    other = _rec("Other chat", "o", kind=Kind.TURN, conversation_id="d", created_at=T0 + timedelta(seconds=10))
    fused = weighted_fusion({DENSE: _hits((question, 0.9), (answer, 0.3), (far, 0.3), (other, 0.1))}, {DENSE: 1.0})
    smoothed = {c.id: c for c in smooth_neighbours(fused, 0.5, window_s=600)}
    assert smoothed["a"].fused == pytest.approx(0.25 + 0.5)
    assert smoothed["q"].fused == pytest.approx(1.0 + 0.5 * 0.25)
    assert smoothed["f"].fused == pytest.approx(0.25)
    assert smoothed["o"].fused == 0.0


@given(st.lists(st.tuples(st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.integers(0, 3)), max_size=30))
def test_fusion_ranks_ties_newer_first_then_by_id(scores_and_ages: list[tuple[float, int]]) -> None:
    """Tied fused scores (common: arms give equal texts equal scores) rank newer first, then by id, as
    ``weighted_fusion``'s candidates do."""
    records = [
        _rec(f"m{i}", f"m{i:02d}", created_at=T0 + timedelta(days=age)) for i, (_, age) in enumerate(scores_and_ages)
    ]
    fused = {r.id: score for r, (score, _) in zip(records, scores_and_ages, strict=True)}
    ranked = [c.id for c in _ranked(Candidate(r, {}, fused[r.id]) for r in records)]
    assert _ranked_ids({r.id: r for r in records}, fused) == ranked


def test_an_endless_neighbour_window_makes_every_turn_of_a_conversation_adjacent() -> None:
    """A window longer than any time span (an infinite setting) counts every gap, years apart included."""
    first = _rec("first", "a", kind=Kind.TURN, conversation_id="c")
    later = _rec("later", "b", kind=Kind.TURN, conversation_id="c", created_at=T0 + timedelta(days=4000))
    fused = weighted_fusion({DENSE: _hits((first, 0.9), (later, 0.1))}, {DENSE: 1.0})
    for window_s in (math.inf, 1e300):
        smoothed = {c.id: c.fused for c in smooth_neighbours(fused, 0.5, window_s=window_s)}
        assert smoothed == pytest.approx({"a": 1.0, "b": 0.5})


def test_date_boost_lifts_memories_from_the_named_month() -> None:
    """ "in March 2026" lifts a memory from March 2026 and not one from May."""
    march = _rec("went to Rome", "mar")
    may = _rec("went to Oslo", "may", created_at=datetime(2026, 5, 2, tzinfo=UTC))
    fused = weighted_fusion({DENSE: _hits((march, 0.5), (may, 0.5))}, {DENSE: 1.0})
    boosted = {c.id: c.fused for c in apply_date_boost(fused, "Where did I go in March 2026?", 0.2)}
    assert boosted == {"mar": 1.2, "may": 1.0}


def test_day_boost_lifts_memories_from_the_named_day_more_than_the_rest_of_the_month() -> None:
    """ "on March 3, 2026" lifts a memory of March 3 by both boosts, one of March 20 by the month's only."""
    third = _rec("lunch with Ana", "d3", created_at=datetime(2026, 3, 3, 13, tzinfo=UTC))
    later = _rec("lunch with Bo", "d20", created_at=datetime(2026, 3, 20, 13, tzinfo=UTC))
    fused = weighted_fusion({DENSE: _hits((third, 0.5), (later, 0.5))}, {DENSE: 1.0})
    boosted = {c.id: c.fused for c in apply_date_boost(fused, "Who did I have lunch with on March 3, 2026?", 0.2, 0.5)}
    assert boosted == pytest.approx({"d3": 1.7, "d20": 1.2})


def test_names_written_in_found_memories_lift_them_damped_by_how_many_carry_them() -> None:
    """A query naming Anna lifts the memories that write "Anna"; a name written in two counts for less."""
    anna = _rec("Anna recommended Dune to me", "anna")
    both = _rec("Anna and Tom went to Oslo", "both")
    book = _rec("I read a book about dunes", "book")
    assert written_names[anna.text] == {"anna", "dune"}
    assert text_name_scores("what did anna recommend?", [anna, book]) == {"anna": 1.0}
    shared = text_name_scores("What did Anna say?", [anna, both, book])
    assert shared == pytest.approx({"anna": name_damping(2), "both": name_damping(2)})


def test_fuse_applies_switched_on_boosts_in_order() -> None:
    """With subject, neighbour and date boosts on, each shows in the candidate's boosts."""
    query = build_query([{"role": "user", "content": "What about jazz in March 2026?"}])
    assert query is not None
    music = ArmHit(_rec("music", "s", kind=Kind.SUBJECT, source_ids=("jazz",)), 0.5)
    settings = RetrievalSettings(subject_weight=0.4, neighbour_weight=0.3, date_weight=0.1)
    result = fuse({DENSE: _hits((JAZZ, 0.9), (INK, 0.5))}, query, settings, subject_hits=[music])
    top = result.candidates[0]
    assert top.id == "jazz"
    assert set(top.boosts) == {"subject", "date"}


@given(
    st.lists(st.tuples(st.integers(0, 30), st.floats(0, 1), st.floats(0, 9), st.integers(0, 3)), max_size=40),
    st.integers(1, 12),
)
def test_fuse_limit_keeps_the_same_best_candidates(rows: list[tuple[int, float, float, int]], limit: int) -> None:
    """Asking fusion for only the best N (as the read path does) gives exactly the first N of the full list."""
    query = build_query([{"role": "user", "content": "What did Maya say about jazz in March 2026?"}])
    assert query is not None
    dense, bm25 = [], []
    for i, (minutes, cosine, bm25_score, conversation) in enumerate(rows):
        record = _rec(
            f"turn {i} about jazz",
            f"r{i:02d}",
            kind=Kind.TURN,
            conversation_id=f"c{conversation}",
            created_at=T0 + timedelta(minutes=minutes),
        )
        dense.append(ArmHit(record, cosine))
        if i % 2:
            bm25.append(ArmHit(record, bm25_score))
    settings = RetrievalSettings()
    everything = fuse({DENSE: dense, BM25: bm25}, query, settings).candidates
    best = fuse({DENSE: dense, BM25: bm25}, query, settings, limit=limit).candidates
    assert best == everything[:limit]


def test_fuse_without_boosts_ranks_as_weighted_fusion() -> None:
    """With every boost off, the read path's fusion ranks exactly as the public weighted fusion does."""
    query = build_query([{"role": "user", "content": "Maya jazz vinyl records"}])
    assert query is not None
    arms = {DENSE: _hits((JAZZ, 0.9), (INK, 0.4), (BDAY, 0.4)), BM25: _hits((JAZZ, 5.0), (HIKE, 1.0))}
    settings = RetrievalSettings(
        subject_weight=0, neighbour_weight=0, conversation_weight=0, date_weight=0, day_weight=0
    )
    weights = {DENSE: settings.dense_weight, BM25: settings.bm25_weight, ENTITY: settings.entity_weight}
    assert fuse(arms, query, settings).candidates == weighted_fusion(arms, weights)


def test_conversation_lifts_follow_each_conversations_best_match() -> None:
    """Every candidate of a conversation is lifted by ``weight`` x that conversation's best fused score (its own
    included); memories without a conversation get nothing."""
    turns = [
        _rec(f"turn {rid}", rid, kind=Kind.TURN, conversation_id=conversation)
        for rid, conversation in (("a1", "a"), ("a2", "a"), ("b1", "b"))
    ]
    fact = _rec("a fact", "f")
    fused = {"a1": 0.9, "a2": 0.2, "b1": 0.5, "f": 1.0}
    lifts = conversation_lifts([*turns, fact], fused, 0.5)
    assert lifts == pytest.approx({"a1": 0.45, "a2": 0.45, "b1": 0.25})


def test_a_lift_does_not_carry_a_fact_past_a_newer_fact_about_the_same_subject() -> None:
    """An older fact lifted past a newer one naming the same entity (any case), which stands as high on its own,
    ends level with it; one about another subject, or one that stands higher on its own, keeps its whole lift."""
    old = _rec("User lives in London", "old", entities=("London",))
    new = _rec("User lives in Paris", "new", entities=("Paris", "london"), created_at=T0 + timedelta(days=35))
    other = _rec("parents live by the sea", "other", entities=("Brighton",))
    fused = {"old": 1.0, "new": 1.0, "other": 1.0}
    lifts = {"old": 0.6, "new": 0.3, "other": 0.6}
    kept = behind_newer_facts([old, new, other], fused, lifts, {"old": 1.0, "new": 1.1, "other": 1.0})
    assert kept == pytest.approx({"old": 0.3, "new": 0.3, "other": 0.6})
    assert lifts["old"] == 0.6  # the lifts given are left as they were
    ahead = behind_newer_facts([old, new, other], fused, lifts, {"old": 1.2, "new": 1.1, "other": 1.0})
    assert ahead == lifts  # the older fact stands higher on its own
    pair = {"old": 0.6, "new": 0.3}
    lower = behind_newer_facts([old, new], {"old": 1.5, "new": 1.0}, pair, {"old": 1.0, "new": 1.1})
    assert lower == pytest.approx({"old": 0.0, "new": 0.3})  # never below its own score


def test_fuse_puts_the_newer_fact_first_when_an_old_conversation_matches_better() -> None:
    """Told "I live in London" five weeks ago and "I moved to Paris" now, "where do I live?" ranks the Paris fact
    above the London fact, although the old turn matches best and lifts its conversation."""
    query = build_query([{"role": "user", "content": "Where do I live?"}])
    assert query is not None
    now = T0 + timedelta(weeks=5)
    turn = _rec("I live in London", "turn", kind=Kind.TURN, conversation_id="spring")
    london = _rec("User lives in London", "london", entities=("London",), conversation_id="spring")
    paris = _rec("User lives in Paris", "paris", entities=("Paris", "London"), conversation_id="summer", created_at=now)
    arms = {DENSE: _hits((turn, 0.9), (london, 0.5), (paris, 0.5), (INK, 0.1))}
    settings = RetrievalSettings(neighbour_weight=0, date_weight=0, day_weight=0, term_match_weight=0)
    assert _ids(fuse(arms, query, settings, now=now).candidates)[:3] == ["turn", "paris", "london"]
    assert _ids(fuse(arms, query, settings).candidates)[:3] == ["turn", "paris", "london"]  # no clock: fused scores


def test_fuse_lifts_the_conversation_of_the_best_match() -> None:
    """Of two equally scored turns, the one sharing a conversation with the best match ranks first."""
    query = build_query([{"role": "user", "content": "jazz records"}])
    assert query is not None
    best, near, far = (
        _rec(text, rid, kind=Kind.TURN, conversation_id=conversation, created_at=T0 + timedelta(hours=hours))
        for text, rid, conversation, hours in (("jazz", "best", "c1", 0), ("x", "near", "c1", 1), ("y", "far", "c2", 2))
    )
    arms = {DENSE: _hits((best, 0.9), (near, 0.5), (far, 0.5), (INK, 0.1))}
    settings = RetrievalSettings(neighbour_weight=0, date_weight=0, day_weight=0)
    ranked = fuse(arms, query, settings).candidates
    assert [c.id for c in ranked[:3]] == ["best", "near", "far"]
    assert ranked[1].boosts["conversation"] > ranked[2].boosts["conversation"]
