"""The read path: from a chat request's messages to the memory block injected into it.

Owns the query analysis, the retrieval arms (dense, keyword, entity) and their I/O shell, fusion and its boosts,
the optional rerank, final scoring, the choice of what to inject, the injection itself, the per-user read cache,
and the read path's settings. Data flows one way: query -> arms -> fusion -> (rerank) -> scoring -> injection;
a module imports only from the steps before it (and the shared candidate types), never from one after it.

May import: the store (``proxy.memory.store``), the embedders (``proxy.memory.embedders``) and the modules every
path shares at the root of ``proxy.memory``; never the write path (``proxy.memory.write``), the HTTP shell
(``proxy.*`` outside ``proxy.memory``) or ``insights``.
"""
