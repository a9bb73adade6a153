"""Clustering of a user's messages into themes: known topic mixtures in, the right clusters out."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from insights.clustering import Cluster, cluster_messages, robust_threshold
from proxy.memory.embedders.base import BaseEmbedder
from tests.support.embedder import HashingEmbedder
from tests.support.insight_scenario import (
    TOPICS,
    synthetic_messages,
    synthetic_outliers,
    user_messages,
)

HASHING = HashingEmbedder(dim=1024)  # wide enough that the topic vocabularies do not collide


async def embed(rows: Sequence[tuple[str, str]]) -> np.ndarray:
    """Hashing-embedder vectors of the rows' texts."""
    return await HASHING.embed_documents([text for text, _ in rows])


def topics_of(cluster: Cluster, labels: Sequence[str]) -> Counter[str]:
    """How many members of ``cluster`` come from each topic."""
    return Counter(labels[i] for i in cluster.members)


@pytest.mark.parametrize("topics", [2, 3, 4, 6])
async def test_known_topic_mixture_gives_one_pure_cluster_per_topic(topics: int) -> None:
    """Each topic becomes exactly one cluster holding (nearly) all of it and nothing else."""
    rows = synthetic_messages(topics, 15, seed=topics) + synthetic_outliers(4)
    labels = [label for _, label in rows]
    clusters = cluster_messages(await embed(rows))
    assert len(clusters) == topics
    for cluster in clusters:
        (topic, count), *others = topics_of(cluster, labels).most_common()
        assert others == []
        assert topic != "outlier"
        assert count >= 13


async def test_outliers_belong_to_no_cluster() -> None:
    """Messages unrelated to anything else are left out of every cluster."""
    rows = synthetic_messages(3, 15) + synthetic_outliers(5)
    clusters = cluster_messages(await embed(rows))
    members = {i for cluster in clusters for i in cluster.members}
    outliers = {i for i, (_, label) in enumerate(rows) if label == "outlier"}
    assert outliers
    assert not members & outliers


async def test_too_few_messages_give_no_clusters() -> None:
    """Below ``min_messages`` there is nothing to generalise from."""
    rows = synthetic_messages(2, 9)
    assert cluster_messages(await embed(rows), min_messages=20) == []
    assert len(cluster_messages(await embed(rows), min_messages=10, min_cluster_size=4)) == 2


async def test_small_topic_is_dropped_not_merged() -> None:
    """A topic with fewer messages than ``min_cluster_size`` forms no cluster and pollutes none."""
    rows = synthetic_messages(2, 15) + synthetic_messages(3, 3, seed=7)[-3:]
    labels = [label for _, label in rows]
    clusters = cluster_messages(await embed(rows), min_cluster_size=5)
    found = [topics_of(cluster, labels) for cluster in clusters]
    assert sorted(next(iter(c)) for c in found) == ["marathon", "sourdough"]
    assert all(len(c) == 1 for c in found)


async def test_never_more_clusters_than_the_maximum() -> None:
    """Six topics with ``max_clusters=3`` still give at most three clusters."""
    clusters = cluster_messages(await embed(synthetic_messages(6, 15)), max_clusters=3)
    assert 1 <= len(clusters) <= 3


async def test_one_theme_stays_one_cluster() -> None:
    """A user who only ever talks about one thing gets one cluster, not an arbitrary split."""
    rows = synthetic_messages(1, 40, seed=3)
    clusters = cluster_messages(await embed(rows))
    assert [cluster.size for cluster in clusters] == [40]


async def test_same_input_and_seed_give_the_same_clusters() -> None:
    """Clustering is deterministic, so a regeneration without new messages says the same things."""
    vectors = await embed(synthetic_messages(4, 15) + synthetic_outliers(3))
    first, second = cluster_messages(vectors, seed=5), cluster_messages(vectors, seed=5)
    assert [c.members for c in first] == [c.members for c in second]


async def test_cluster_describes_its_centre_and_tightness() -> None:
    """Representatives are members nearest the centroid first; cohesion is their mean cosine to it."""
    vectors = await embed(synthetic_messages(3, 15))
    for cluster in cluster_messages(vectors, representatives=5):
        similarity = vectors[list(cluster.members)] @ cluster.centroid
        nearest = np.asarray(cluster.members)[np.argsort(-similarity, kind="stable")[:5]]
        assert cluster.representatives == tuple(int(i) for i in nearest)
        assert cluster.cohesion == pytest.approx(float(similarity.mean()), abs=1e-5)
        assert float(np.linalg.norm(cluster.centroid)) == pytest.approx(1.0, abs=1e-5)


def test_robust_threshold_ignores_a_far_point() -> None:
    """One extreme distance barely moves the threshold, so it cannot hide itself."""
    distances = np.array([0.30, 0.32, 0.35, 0.31, 0.33, 0.34, 0.29, 0.95])
    assert robust_threshold(distances, 3.0) < 0.5


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    n=st.integers(min_value=0, max_value=120),
    dim=st.sampled_from([8, 32]),
    seed=st.integers(min_value=0, max_value=2**16),
    max_clusters=st.integers(min_value=1, max_value=8),
)
def test_clusters_are_disjoint_and_bounded_for_any_input(n: int, dim: int, seed: int, max_clusters: int) -> None:
    """Whatever the vectors, clusters never share a message, never exceed the maximum, never go under size."""
    vectors = np.random.default_rng(seed).normal(size=(n, dim)).astype(np.float32)
    clusters = cluster_messages(vectors, max_clusters=max_clusters, min_cluster_size=4, min_messages=10)
    members = [i for cluster in clusters for i in cluster.members]
    assert len(members) == len(set(members))
    assert all(0 <= i < n for i in members)
    assert len(clusters) <= max_clusters
    assert all(cluster.size >= 4 for cluster in clusters)


# ------------------------------------------------------------------------------- the real embedding model


@pytest.mark.asyncio(loop_scope="module")
async def test_real_model_finds_the_users_topics_and_leaves_out_the_one_offs(local: BaseEmbedder) -> None:
    """Realistic messages on four topics plus four one-off questions: four clusters, one per topic."""
    rows = user_messages()
    labels = [label for _, _, label in rows]
    clusters = cluster_messages(await local.embed_documents([text for text, _, _ in rows]))
    assert abs(len(clusters) - len(TOPICS)) <= 1
    found = [topics_of(cluster, labels).most_common() for cluster in clusters]
    assert sorted(counts[0][0] for counts in found) == sorted(topic.name for topic in TOPICS)
    assert all(len(counts) == 1 and counts[0][1] >= 12 for counts in found)
