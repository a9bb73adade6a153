"""The write path: what memory learns from a finished chat, after the chat has been answered.

Owns the durable job queue (its SQLite database, its runner, group commit), the writer's job handlers (turns,
facts windows, summaries, the insights trigger), fact extraction and the screens on everything stored, the
memory-side LLM clients and their routing, and the per-user latest-chat key/model memory.

May import: the memory core's shared root modules (``proxy.memory.errors``, ``features``, ``text_cap``,
``lazy``...), ``proxy.memory.store`` and ``proxy.memory.embedders``. Never ``proxy.memory.read``, anything of
``proxy`` outside ``proxy.memory`` (the HTTP shell), nor ``insights`` (which imports from here instead).
"""
