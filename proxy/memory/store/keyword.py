"""The keyword arm: a Tantivy BM25 index of every memory's text, scoped by user.

The fields, analyzers and documents are ``keyword_schema``'s. Queries are built from terms through Tantivy's
query API: the query text goes through the same analyzers as the documents and each resulting token becomes a
term query, so no user text or id is ever parsed as query syntax. The index has one writer, used under one lock;
all Tantivy calls run on this module's own small thread pool. Each physical index lives in a generation
directory named by ``CURRENT``, so a rebuild (to purge a forgotten user's bytes from disk, or to rewrite a
fragmented index as one segment) swaps atomically.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar, cast

import tantivy
from tantivy import (
    FieldType,
    Index,
    Occur,
    Query,
)

from proxy.memory.errors import StoreError
from proxy.memory.store.keyword_schema import (
    CJK,
    CJK_FIELD,
    SCOPED,
    STEM_FIELD,
    STEMS,
    WORDS,
    KeywordDoc,
    KeywordFilter,
    boost,
    cjk_analyzer,
    cjk_bigrams,
    document_json,
    filter_scope,
    id_from_halves,
    ids_from_halves,
    index_schema,
    stem_analyzer,
    user_key,
    word_analyzer,
)

MAX_QUERY_TERMS = 64
_T = TypeVar("_T")


def _unique(tokens: Iterable[str], limit: int) -> list[str]:
    return list(dict.fromkeys(tokens))[:limit]


class _Generation:
    """One physical Tantivy index directory with its writer."""

    def __init__(self, path: Path, heap_bytes: int, *, writable: bool = True) -> None:
        self.path = path
        self.schema = index_schema()
        path.mkdir(parents=True, exist_ok=True)
        try:
            self.index = Index(self.schema, path=str(path), reuse=True)
        except (ValueError, OSError) as exc:
            raise _Unusable(str(exc)) from exc
        self.index.register_tokenizer(WORDS, word_analyzer())
        self.index.register_tokenizer(STEMS, stem_analyzer())
        self.index.register_tokenizer(CJK, cjk_analyzer())
        self.writer: Any = None
        if not writable:  # a follower's: the writer process holds the index writer
            return
        try:
            self.writer = self.index.writer(heap_size=heap_bytes, num_threads=1)
        except ValueError as exc:
            raise StoreError(f"cannot open the keyword index writer at {path}: {exc}") from exc

    def close(self) -> None:
        if self.writer is not None:
            self.writer.wait_merging_threads()
            self.writer = None


def _hit_ids(searcher: tantivy.Searcher, addresses: list[Any]) -> list[str]:
    """The ids of the documents at ``addresses``: from the fast id halves, or the stored document for an id
    that is not a generated one."""
    if not addresses:
        return []
    hexes = searcher.fast_field_values("hex_id", addresses)
    highs = searcher.fast_field_values("id_hi", addresses)
    lows = searcher.fast_field_values("id_lo", addresses)
    if all(hexes) and None not in highs and None not in lows:  # every one generated: both halves are integers
        return ids_from_halves(cast("list[int]", highs), cast("list[int]", lows))
    return [
        id_from_halves(high, low)
        if hexed and isinstance(high, int) and isinstance(low, int)
        else searcher.doc(address)["id"][0]
        for address, hexed, high, low in zip(addresses, hexes, highs, lows, strict=True)
    ]


class _Unusable(Exception):
    """An index directory that cannot be opened (corrupt, or from another schema)."""


class KeywordIndex:
    """The Tantivy index under ``path``; open with ``async with``."""

    def __init__(self, path: Path, *, heap_bytes: int = 64_000_000, threads: int = 2, follower: bool = False) -> None:
        """``follower``: open the index another process writes, read only (``reload`` picks up its commits)."""
        self.path = path
        self.follower = follower
        self._heap_bytes = heap_bytes
        self._threads = threads
        self._words = word_analyzer()
        self._stems = stem_analyzer()
        self._lock = asyncio.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._gen: _Generation | None = None
        self.fresh = False  # True when opening found no usable index (the store re-indexes everything)
        # ``time.monotonic()`` at the last commit since opening, None before the first: the store's maintenance
        # rewrites a fragmented index only once no commit came for a while (``StoreWrites.keyword_fragmented``)
        self.committed_at: float | None = None
        self.on_commit: Callable[[], object] | None = None  # told after each commit or rebuild (the writer's mirror)

    async def __aenter__(self) -> KeywordIndex:
        self._pool = ThreadPoolExecutor(max_workers=self._threads, thread_name_prefix="tantivy")
        try:
            self._gen = await self._run(self._open_current)
        except BaseException:
            self._pool.shutdown(wait=True)
            self._pool = None
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._gen is not None:
            await self._run(self._gen.close)
            self._gen = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    async def _run(self, fn: Callable[..., _T], *args: Any) -> _T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, fn, *args)

    @property
    def _g(self) -> _Generation:
        if self._gen is None:
            raise RuntimeError("keyword index is not open")
        return self._gen

    def _current_name(self) -> str:
        pointer = self.path / "CURRENT"
        return pointer.read_text().strip() if pointer.exists() else ""

    def _open_current(self) -> _Generation:
        if self.follower:
            name = self._current_name()
            if not name:
                raise StoreError(f"no keyword index at {self.path} yet (the memory writer creates it)")
            return _Generation(self.path / name, self._heap_bytes, writable=False)
        self.path.mkdir(parents=True, exist_ok=True)
        name = self._current_name()
        self._remove_other_generations(keep=name)
        if name:
            try:
                return _Generation(self.path / name, self._heap_bytes)
            except _Unusable:
                shutil.rmtree(self.path / name, ignore_errors=True)
        self.fresh = True
        return self._new_generation(int(name[1:] or 0) + 1 if name.startswith("g") else 1)

    def _new_generation(self, number: int) -> _Generation:
        name = f"g{number:06d}"
        shutil.rmtree(self.path / name, ignore_errors=True)
        gen = _Generation(self.path / name, self._heap_bytes)
        self._point_to(name)
        return gen

    def _point_to(self, name: str) -> None:
        tmp = self.path / "CURRENT.tmp"
        tmp.write_text(name)
        os.replace(tmp, self.path / "CURRENT")

    def _remove_other_generations(self, keep: str) -> None:
        for child in self.path.iterdir():
            if child.is_dir() and child.name != keep:
                shutil.rmtree(child, ignore_errors=True)

    async def reload(self) -> None:
        """A follower's: see the writer's latest commit, or the generation it swapped in (a rebuild)."""
        gen = self._g
        if self._current_name() != gen.path.name:
            self._gen = await self._run(self._open_current)
            return
        await self._run(gen.index.reload)

    # writes ---------------------------------------------------------------------------------------------

    async def add(self, docs: Sequence[KeywordDoc]) -> None:
        """Add documents whose ids the index does not hold yet (visible after ``commit``)."""
        async with self._lock:
            await self._run(self._add_all, self._g, docs)

    async def upsert(self, docs: Sequence[KeywordDoc]) -> None:
        """Add documents, replacing any with the same id (visible after ``commit``)."""
        async with self._lock:
            await self._run(self._upsert, self._g, docs)

    @staticmethod
    def _upsert(gen: _Generation, docs: Sequence[KeywordDoc]) -> None:
        for doc in docs:
            gen.writer.delete_documents_by_term("id", doc.id)
            gen.writer.add_json(document_json(doc))

    async def remove(self, user_id: str, ids: Sequence[str]) -> None:
        """Delete the user's documents with these ids (visible after ``commit``)."""
        async with self._lock:
            await self._run(self._remove, self._g, user_id, ids)

    @staticmethod
    def _remove(gen: _Generation, user_id: str, ids: Sequence[str]) -> None:
        user = Query.term_query(gen.schema, "user_id", user_id)
        for record_id in ids:
            one = Query.term_query(gen.schema, "id", record_id)
            gen.writer.delete_documents_by_query(Query.boolean_query([(Occur.Must, user), (Occur.Must, one)]))

    async def remove_ids(self, ids: Sequence[str]) -> None:
        """Delete documents by id whoever they belong to (repair of documents LanceDB does not have)."""
        async with self._lock:
            await self._run(self._remove_ids, self._g, ids)

    @staticmethod
    def _remove_ids(gen: _Generation, ids: Sequence[str]) -> None:
        for record_id in ids:
            gen.writer.delete_documents_by_term("id", record_id)

    async def remove_user(self, user_id: str) -> None:
        """Delete every document of the user (visible after ``commit``)."""
        async with self._lock:
            await self._run(self._g.writer.delete_documents_by_term, "user_id", user_id)

    async def commit(self) -> None:
        """Make all writes durable and visible to searches."""
        async with self._lock:
            await self._run(self._commit, self._g)
            self.committed_at = time.monotonic()
        if self.on_commit is not None:
            self.on_commit()

    @staticmethod
    def _commit(gen: _Generation) -> None:
        gen.writer.commit()
        gen.index.reload()

    async def rebuild(self, batches: AsyncIterator[Sequence[KeywordDoc]]) -> int:
        """Write a fresh index from ``batches`` and swap it in (purges deleted documents' bytes from disk)."""
        async with self._lock:
            old = self._g
            number = int(old.path.name[1:]) + 1
            gen = await self._run(_Generation, self.path / f"g{number:06d}", self._heap_bytes)
            count = 0
            async for batch in batches:
                await self._run(self._add_all, gen, batch)
                count += len(batch)
            await self._run(self._commit, gen)
            await self._run(self._point_to, gen.path.name)
            self._gen = gen
            await self._run(old.close)
            await self._run(shutil.rmtree, old.path, True)
        if self.on_commit is not None:
            self.on_commit()
        return count

    @staticmethod
    def _add_all(gen: _Generation, docs: Sequence[KeywordDoc]) -> None:
        for doc in docs:
            gen.writer.add_json(document_json(doc))

    # reads ----------------------------------------------------------------------------------------------

    async def search(self, user_id: str, text: str, k: int, where: KeywordFilter) -> list[tuple[str, float]]:
        """Top ``k`` (id, BM25 score) of the user's documents matching any term of ``text``."""
        return (await self.search_pools(user_id, text, [(k, where)]))[0]

    async def search_pools(
        self, user_id: str, text: str, pools: Sequence[tuple[int, KeywordFilter]]
    ) -> list[list[tuple[str, float]]]:
        """Top (id, BM25 score) in each (k, filter) pool of the user's documents, in one trip to the worker.

        A pool the scoped terms cover (``filter_scope``) is searched through them, any other as the user's
        documents that pass its filter and hold any of the words; both score the words alone, alike."""
        gen = self._g
        searcher = gen.index.searcher()  # one view for the statistics the boosts use and for the searches
        terms = self._terms(text)
        scopes = [filter_scope(where) for _, where in pools]
        if any(field not in SCOPED for field, _ in terms):  # plain words (a stop-word query): no scoped copies
            scopes = [None] * len(pools)
        counts = _word_counts(searcher, terms) if any(scopes) else None
        matching = _matching(gen.schema, terms) if None in scopes else None  # shared by the filtered pools
        key = user_key(user_id)
        queries = [
            (_scoped(gen.schema, user_id, matching, where) if scope is None or counts is None
             else _scoped_terms(gen.schema, searcher, key + scope, terms, counts), k)
            for (k, where), scope in zip(pools, scopes, strict=True)
        ]  # fmt: skip
        if all(query is None or k <= 0 for query, k in queries):
            return [[] for _ in pools]
        # On the loop: a filtered top-k costs less than the hop to a worker thread would
        # (the handoff, the GIL passing twice); writes and commits stay on the workers.
        return self._search_pools(searcher, queries)

    @staticmethod
    def _search_pools(
        searcher: tantivy.Searcher, queries: Sequence[tuple[Query | None, int]]
    ) -> list[list[tuple[str, float]]]:
        found = [[] if query is None or k <= 0 else searcher.search(query, k, count=False).hits for query, k in queries]
        ids = iter(_hit_ids(searcher, [address for hits in found for _, address in hits]))  # all pools' at once
        return [[(next(ids), float(score)) for score, _ in hits] for hits in found]

    def _terms(self, text: str) -> list[tuple[str, str]]:
        """The (field, token) pairs a search matches: the text's stems and CJK bigrams, or, when it has only
        stop words ("to be or not to be"), its plain words."""
        terms = [(STEM_FIELD, word) for word in _unique(self._stems.analyze(text), MAX_QUERY_TERMS)]
        terms += [(CJK_FIELD, pair) for pair in _unique(cjk_bigrams(text), MAX_QUERY_TERMS)]
        return terms or [("text", word) for word in _unique(self._words.analyze(text), MAX_QUERY_TERMS)]

    def holding(self, ids: Sequence[str]) -> set[str]:
        """Which of ``ids`` the index holds, any user's (term lookups, cheap enough for the loop)."""
        if not ids:
            return set()
        gen = self._g
        searcher = gen.index.searcher()
        result = searcher.search(Query.term_set_query(gen.schema, "id", list(ids)), len(ids), count=False)
        return {searcher.doc(address)["id"][0] for _, address in result.hits}

    async def signatures(self) -> dict[str, str]:
        """Every document's id and signature (for the startup repair)."""
        return await self._run(self._signatures, self._g)

    @staticmethod
    def _signatures(gen: _Generation) -> dict[str, str]:
        searcher = gen.index.searcher()
        if searcher.num_docs == 0:
            return {}
        result = searcher.search(Query.all_query(), searcher.num_docs, count=False)
        out: dict[str, str] = {}
        for _, address in result.hits:
            doc = searcher.doc(address)
            out[doc["id"][0]] = doc["sig"][0]
        return out

    def segments(self) -> int:
        """Segments a search walks (each commit adds one; Tantivy merges eight of a size into one)."""
        return int(self._g.index.searcher().num_segments)

    async def count(self) -> int:
        """Documents visible to searches."""
        return await self._run(lambda: int(self._g.index.searcher().num_docs))


def _word_counts(searcher: tantivy.Searcher, terms: Sequence[tuple[str, str]]) -> tuple[int, list[int]]:
    """What the boosts need of the whole index, once per search: the document count BM25's IDF uses (every
    document in the searcher's segments, the deleted ones included until a merge drops them, as the terms'
    document frequencies count them; every document holds ``valid``) and how many documents hold each term."""
    docs = int(searcher.doc_freq("valid", True) + searcher.doc_freq("valid", False))
    return docs, [int(searcher.doc_freq(field, token)) for field, token in terms]


def _scoped_terms(
    schema: tantivy.Schema,
    searcher: tantivy.Searcher,
    prefix: str,
    terms: Sequence[tuple[str, str]],
    counts: tuple[int, list[int]],
) -> Query | None:
    """The words as ``prefix``'s scoped terms (a user's key and a pool), each boosted to score as its word does
    over the whole index (``counts``: ``_word_counts``); None when the pool holds none of them."""
    docs, word_docs = counts
    should = []
    for (field, token), held_by_word in zip(terms, word_docs, strict=True):
        scoped = prefix + token
        if held := searcher.doc_freq(SCOPED[field], scoped):  # a term no document holds adds nothing
            term = Query.term_query(schema, SCOPED[field], scoped)
            should.append((Occur.Should, Query.boost_query(term, boost(docs, held_by_word, held))))
    return Query.boolean_query(should) if should else None


def _matching(schema: tantivy.Schema, terms: Sequence[tuple[str, str]]) -> Query | None:
    """Documents holding any of ``terms`` (None: there are none), scored by BM25."""
    should = [(Occur.Should, Query.term_query(schema, field, token)) for field, token in terms]
    return Query.boolean_query(should) if should else None


def _scoped(schema: tantivy.Schema, user_id: str, matching: Query | None, where: KeywordFilter) -> Query | None:
    """``matching`` within one user's documents that pass ``where`` (None when ``matching`` is), scored by
    ``matching`` alone (the filters add nothing, so these scores and the scoped terms' agree)."""
    if matching is None:
        return None
    must = [(Occur.Must, _unscored(Query.term_query(schema, "user_id", user_id))), (Occur.Must, matching)]
    return Query.boolean_query(must + _filter_clauses(schema, where))


def _unscored(query: Query) -> Query:
    return Query.const_score_query(query, 0.0)


def _filter_clauses(schema: tantivy.Schema, where: KeywordFilter) -> list[tuple[Occur, Query]]:
    clauses: list[tuple[Occur, Query]] = []
    if not where.include_invalid:
        clauses.append((Occur.Must, _unscored(Query.term_query(schema, "valid", True))))
    if where.kinds:
        clauses.append((Occur.Must, _any_kind(schema, where.kinds)))
    if where.since_us is not None or where.until_us is not None:
        window = Query.range_query(schema, "created_us", FieldType.Integer, where.since_us, where.until_us)
        clauses.append((Occur.Must, _unscored(window)))
    return clauses


def _any_kind(schema: tantivy.Schema, kinds: Sequence[str]) -> Query:
    """Documents of any of ``kinds``, unscored: a disjunction of term queries finds the same documents as a
    term set query at less than half the cost of a search (the term set query walks an automaton over the
    terms)."""
    return _unscored(Query.boolean_query([(Occur.Should, Query.term_query(schema, "kind", kind)) for kind in kinds]))
