"""The exact-search kernel over a user's vector matrix: dot products, the top k, and kind masks.

Plain functions of numpy arrays; ``user_vectors.UserVectors`` calls them over the runs of rows a search scans.
"""

from __future__ import annotations

import functools

import numpy as np
import numpy.typing as npt
import threadpoolctl

from proxy.memory.store.records import Kind

KIND_CODES: dict[str, int] = {str(kind): code for code, kind in enumerate(Kind)}


@functools.lru_cache(maxsize=64)
def kind_table(kinds: tuple[Kind, ...]) -> npt.NDArray[np.bool_]:
    """Kind code -> whether the kind is among ``kinds`` (indexing with the codes is a vectorised ``isin``)."""
    table = np.zeros(len(KIND_CODES), dtype=np.bool_)
    table[[KIND_CODES[str(kind)] for kind in kinds]] = True
    return table


def dot(query: npt.NDArray[np.float32], columns: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Cosine of the query with every column (unit vectors). BLAS runs on one thread (``single_thread_blas``):
    OpenBLAS's threaded gemv spins against the event loop and the embedder on a small busy box."""
    scores: npt.NDArray[np.float32] = query @ columns
    return scores


def single_thread_blas() -> None:
    """Pin BLAS to one thread for the process: the vector search's gemv is memory-bound, and threads that
    spin-wait cost the event loop far more under load than they save."""
    threadpoolctl.threadpool_limits(limits=1, user_api="blas")


def top_k(scores: npt.NDArray[np.float32], rows: npt.NDArray[np.intp], k: int) -> tuple[list[int], list[float]]:
    """The ``k`` best (rows, scores), best first, equal scores in row order; ``scores[i]`` belongs to row
    ``rows[i]``. NaN scores (a stored vector of NaNs) rank last.

    Chosen by value: the k-th best score from a partition of the scores, then the rows scoring at least that. An
    argpartition of the negated scores cost more, and left which of several equal scores at the cut came in to
    its selection algorithm.
    """
    take = min(k, rows.size)
    if take <= 0:
        return [], []
    cut = scores.size - take
    kth = np.partition(scores, cut)[cut]  # NaNs sort last: with any among the best ``take``, none compare
    held = np.flatnonzero(scores >= kth)  # the best ``take``, and any more equal to the k-th
    if held.size < take:  # NaNs took places: a full sort, with them below every number
        top = np.argsort(np.where(np.isnan(scores), np.inf, -scores), kind="stable")[:take]
    else:
        top = held[np.argsort(-scores[held], kind="stable")[:take]]
    return rows[top].tolist(), scores[top].tolist()
