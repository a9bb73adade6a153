"""Clustering of one user's messages into themes: a pure, seeded function of their embeddings.

Method:

1. Below ``min_messages`` there is too little to generalise from: no clusters.
2. k is chosen on a seeded sample of at most ``sample_size`` points: KMeans for k = 2..max_clusters, the k
   with the best cosine silhouette wins (below ``min_silhouette`` nothing separates and k = 1).
3. All points take the nearest of the sample's centres, refined by a few spherical Lloyd steps.
4. Clusters whose centroids have a cosine of at least ``merge_similarity`` are merged, closest pair first.
   Silhouette always prefers some split, even of one theme; measured with all-MiniLM-L6-v2, halves of one
   topic have centroid cosines of 0.58-0.70, distinct topics 0.07-0.21, so 0.55 keeps a one-topic user at
   one cluster without merging distinct topics.
5. Outliers are points whose cosine distance to the cluster's core centroid (the mean of its tighter half)
   exceeds ``median + outlier_z * 1.4826 * MAD`` (MAD floored), or whose cosine is under
   ``min_relative_similarity`` times the cluster's median cosine. Off-topic one-off questions sit at cosine
   0.0-0.2 to a topic's centroid, its members at 0.45-0.85.
6. Clusters with fewer than ``min_cluster_size`` inliers are dropped (their members count as outliers).

Alternatives measured (2-core machine, all-MiniLM-L6-v2 vectors of LoCoMo's 5,882 chat turns and of the
test scenario): HDBSCAN(``algorithm="brute"``, cosine) finds the scenario's four topics, but on real chat
messages it labels most points noise (177 of 211, 229 of 313 for two LoCoMo speakers; all 5,000 with
``min_cluster_size=50``) and was slower than this method on thousands of points; its cluster count is not bounded
by ``max_clusters`` either. Centring the vectors on the user's mean separates LoCoMo's chit-chat into themes
but dissolves a one-topic user into noise, so it is not done. Embeddings are L2-normalised first, so
Euclidean KMeans on them is spherical (cosine) KMeans.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import numpy.typing as npt
from threadpoolctl import threadpool_limits

Floats = npt.NDArray[np.float32]

DEFAULT_MIN_CLUSTER_SIZE = 5
DEFAULT_MIN_MESSAGES = 20
_MAD_TO_SIGMA = 1.4826
# KMeans restarts per k: small samples are cheap and each restart there fixes merged topics (tests: 14/50
# wrong k with 1 restart, 3/50 with 3, 0/50 with 10); past ~500 points 3 restarts are stable enough.
N_INIT_SMALL, N_INIT_LARGE, SMALL_SAMPLE = 10, 3, 500
REFINE_STEPS = 10
_MIN_SPREAD = 0.03  # floor on the scaled MAD, in cosine distance


@dataclasses.dataclass(frozen=True, eq=False)
class Cluster:
    """One theme: which messages belong to it, where its centre is and how tight it is."""

    members: tuple[int, ...]  # indices into the clustered embeddings, ascending
    centroid: Floats  # unit vector
    cohesion: float  # mean cosine of the members to the centroid
    representatives: tuple[int, ...]  # members nearest the centroid first

    @property
    def size(self) -> int:
        """How many messages the cluster holds."""
        return len(self.members)


@dataclasses.dataclass(frozen=True)
class ClusteringParams:
    """The knobs of ``cluster_messages`` (see the module docstring for what each one does)."""

    max_clusters: int = 8
    min_cluster_size: int = DEFAULT_MIN_CLUSTER_SIZE
    min_messages: int = DEFAULT_MIN_MESSAGES
    seed: int = 0
    sample_size: int = 1000
    min_silhouette: float = 0.02
    outlier_z: float = 3.0
    min_relative_similarity: float = 0.5
    merge_similarity: float = 0.55
    representatives: int = 12


def cluster_messages(embeddings: npt.ArrayLike, **params: Any) -> list[Cluster]:
    """Themes in ``embeddings`` (one row per message), largest first; outliers belong to none.

    Keyword arguments are the fields of ``ClusteringParams``. sklearn runs single-threaded here: on a
    busy machine its OpenMP threads spin against each other and KMeans gets much slower.
    """
    settings = ClusteringParams(**params)
    points = _normalise(np.asarray(embeddings, dtype=np.float32))
    if len(points) < max(settings.min_messages, 1):
        return []
    with threadpool_limits(limits=1):
        return _cluster(points, settings)


def _cluster(points: Floats, params: ClusteringParams) -> list[Cluster]:
    """``cluster_messages`` on unit vectors, enough of them."""
    k_max = min(params.max_clusters, len(points) // max(params.min_cluster_size, 1))
    sample = points[_sample_indices(len(points), params.sample_size, params.seed)]
    k, centres = choose_k(sample, k_max=k_max, seed=params.seed, min_silhouette=params.min_silhouette)
    labels = merge_similar(points, _fit_labels(points, k, centres), params.merge_similarity)
    clusters = [_build_cluster(points, np.flatnonzero(labels == label), params) for label in np.unique(labels)]
    kept = [c for c in clusters if c is not None and c.size >= params.min_cluster_size]
    return sorted(kept, key=lambda c: (-c.size, c.members[0]))


def choose_k(sample: Floats, *, k_max: int, seed: int, min_silhouette: float) -> tuple[int, Floats | None]:
    """The k with the best cosine silhouette on ``sample`` and its centres (1 and None if none separates)."""
    # scikit-learn (with scipy) is ~90 MB of RSS: a proxy that never clusters a user's messages never loads it.
    from sklearn.cluster import KMeans
    from sklearn.metrics import silhouette_score

    data = sample.astype(np.float64)  # sklearn's float32 distance path upcasts chunk by chunk, slower
    distances = np.clip(1.0 - data @ data.T, 0.0, 2.0)
    np.fill_diagonal(distances, 0.0)
    n_init = N_INIT_SMALL if len(sample) <= SMALL_SAMPLE else N_INIT_LARGE
    best: tuple[int, Floats | None] = (1, None)
    best_score = min_silhouette
    for k in range(2, min(k_max, len(sample) - 1) + 1):
        model = KMeans(n_clusters=k, n_init=n_init, random_state=seed).fit(data)
        if len(np.unique(model.labels_)) < 2:
            continue
        score = float(silhouette_score(distances, model.labels_, metric="precomputed"))
        if score > best_score:
            best, best_score = (k, np.asarray(model.cluster_centers_, dtype=np.float32)), score
    return best


def _fit_labels(points: Floats, k: int, centres: Floats | None) -> npt.NDArray[np.intp]:
    """Labels for all points: nearest of the sample's centres, refined by a few spherical Lloyd steps.

    Cheaper than a full KMeans fit (one matrix product per step); on LoCoMo's chat turns, which have no
    clear themes and so the least stable boundaries, 94-95 % of points get the label a full fit gives.
    """
    if k == 1 or centres is None:
        return np.zeros(len(points), dtype=np.intp)
    unit = centres / np.maximum(np.linalg.norm(centres, axis=1, keepdims=True), 1e-12)
    labels = np.argmax(points @ unit.T, axis=1)
    for _ in range(REFINE_STEPS):
        present = np.unique(labels)
        unit = np.stack([_unit(points[labels == label].mean(axis=0)) for label in present])
        updated = present[np.argmax(points @ unit.T, axis=1)]
        if np.array_equal(updated, labels):
            break
        labels = updated
    return np.asarray(labels, dtype=np.intp)


def merge_similar(points: Floats, labels: npt.NDArray[np.intp], threshold: float) -> npt.NDArray[np.intp]:
    """``labels`` after merging, closest pair first, clusters whose centroids' cosine is at least ``threshold``."""
    merged = labels.copy()
    while True:
        ids = np.unique(merged)
        if len(ids) < 2:
            return merged
        centroids = np.stack([_unit(points[merged == i].mean(axis=0)) for i in ids])
        similarity = centroids @ centroids.T
        np.fill_diagonal(similarity, -np.inf)
        a, b = np.unravel_index(int(np.argmax(similarity)), similarity.shape)
        if similarity[a, b] < threshold:
            return merged
        merged[merged == ids[b]] = ids[a]


def _build_cluster(points: Floats, members: npt.NDArray[np.intp], params: ClusteringParams) -> Cluster | None:
    """The cluster of ``members`` with its outliers removed, or None if nothing is left."""
    if len(members) == 0:
        return None
    inliers = members[_inlier_mask(points[members], params)]
    if len(inliers) == 0:
        return None
    centroid = _unit(points[inliers].mean(axis=0))
    similarity = points[inliers] @ centroid
    nearest = inliers[np.argsort(-similarity, kind="stable")[: params.representatives]]
    return Cluster(
        members=tuple(int(i) for i in inliers),
        centroid=centroid,
        cohesion=float(similarity.mean()),
        representatives=tuple(int(i) for i in nearest),
    )


def _inlier_mask(points: Floats, params: ClusteringParams) -> npt.NDArray[np.bool_]:
    """Which points are close enough to the cluster's core: robustly, and relative to the typical member."""
    similarity = points @ _core_centroid(points)
    distance = 1.0 - similarity
    typical = float(np.median(similarity))
    return (distance <= robust_threshold(distance, params.outlier_z)) & (
        similarity >= params.min_relative_similarity * typical
    )


def _core_centroid(points: Floats) -> Floats:
    """The centre of the tighter half of ``points``, which outliers cannot drag towards themselves."""
    centroid = _unit(points.mean(axis=0))
    similarity = points @ centroid
    core = points[similarity >= np.median(similarity)]
    return _unit(core.mean(axis=0))


def robust_threshold(distance: npt.NDArray[np.floating], z: float) -> float:
    """``median + z * sigma`` with sigma estimated from the median absolute deviation."""
    median = float(np.median(distance))
    spread = _MAD_TO_SIGMA * float(np.median(np.abs(distance - median)))
    return median + z * max(spread, _MIN_SPREAD)


def _sample_indices(n: int, sample_size: int, seed: int) -> npt.NDArray[np.intp]:
    """A seeded sample of at most ``sample_size`` row indices, ascending."""
    if n <= sample_size:
        return np.arange(n)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(n, size=sample_size, replace=False))


def _normalise(points: Floats) -> Floats:
    """Rows scaled to unit length (zero rows stay zero)."""
    if points.ndim != 2:
        raise ValueError(f"embeddings must be 2-D, got shape {points.shape}")
    norms = np.linalg.norm(points, axis=1, keepdims=True)
    unit: Floats = np.divide(points, norms, out=np.zeros_like(points), where=norms > 0)
    return unit


def _unit(vector: npt.NDArray[np.floating]) -> Floats:
    """``vector`` scaled to unit length, as float32."""
    norm = float(np.linalg.norm(vector))
    return np.asarray(vector / norm if norm > 0 else vector, dtype=np.float32)
