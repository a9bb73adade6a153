"""The write path: what memory learns from a finished chat, after the chat has been answered.

Owns, by module:

- the durable job queue: ``job_types`` (its vocabulary: settings, errors, states, metrics), ``queue_db`` (its
  SQLite database), ``queue`` (``Job`` and the ``JobQueue`` API), ``runner`` (``JobRunner``), ``group_commit``
  (shared fsyncs), ``job_kinds`` (the kinds stored in its rows, the insights trigger's among them);
- the writer's job handlers: ``writer`` (the ``exchange`` job), ``turns``, ``facts_window``, ``facts``,
  ``summaries``, ``subjects``, with ``settings`` and ``payloads``;
- the memory-side model calls: ``llm`` (clients) and ``routing`` (which route a model name takes),
  ``latest_chat`` (each user's latest chat model and key), ``prompts`` and ``extraction``;
- the screens on everything stored: ``screens`` (one text), ``fact_screens`` (extracted facts),
  ``identifiers``, ``instructions``, ``sensitive``, ``folding``; and ``prefilter`` (exchanges not worth a call),
  ``tool_turns`` (tool results and calls as turns).

May import: the memory core's shared root modules (``proxy.memory.errors``, ``service``, ``features``,
``text_cap``, ``lazy``), ``proxy.memory.store`` and ``proxy.memory.embedders``. Never ``proxy.memory.read``,
anything of ``proxy`` outside ``proxy.memory`` (the HTTP shell), nor ``insights`` (which imports from here).
"""
