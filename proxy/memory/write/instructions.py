"""The instruction screen: text that reads as instructions to a model, or plants links in its answers.

"ignore previous instructions", "you must", role or tool-call syntax, a ``</memory>`` closer, "from now on ...
leak", "append the link http://... to every answer": ``injection_reason`` names the first rule a (folded) text
matches. A turn or summary that matches is stored flagged and never injected; a fact that matches is dropped.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from proxy.memory.write.folding import fold

_I = re.IGNORECASE
_URL = r"(?:https?://|www\.|\b[a-z0-9-]{1,63}\.(?:com|net|org|io|example|xyz|ru|cn|top|info|biz|link|click)\b)"

_ANSWERS = r"(?:answers?|repl(?:y|ies)|responses?|messages?|outputs?|emails?|posts?|texts?|suggestions?)"
_INJECTION_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    (
        "ignore_instructions",
        re.compile(
            r"\b(ignore|disregard|override|forget)\s+(all\s+|any\s+|the\s+|your\s+|of\s+|these\s+|those\s+)*"
            r"(previous|prior|above|earlier|preceding|original|system)?\s*"
            r"(instructions?|prompts?|rules|guidelines|directions|directives)\b",
            _I,
        ),
    ),
    (
        "you_must",
        re.compile(
            r"\byou\s+(must|shall|are\s+required\s+to|should\s+(always|never)|will\s+(always|never)|have\s+to\s+"
            r"(always|never|answer|reply|respond|ignore|obey|include|append|say|tell|reveal|follow))\b"
            r"(?!\s+(be|have|'ve|feel|love|know|think|miss|enjoy|like|mean|really\s+\w+)\b)",  # "you must be proud"
            _I,
        ),
    ),
    (
        "model_directive",
        re.compile(
            r"\b(the\s+)?(assistant|ai|model|chatbot|llm)\s+(must|shall|should\s+always|should\s+never|"
            r"is\s+required\s+to|will\s+always|will\s+never)\b",
            _I,
        ),
    ),
    ("system_prompt", re.compile(r"\b(system|developer)\s+(prompt|message|instructions?)\b", _I)),
    ("memory_tag", re.compile(r"<\s*/?\s*(memory|memories|context|instructions?)\s*>", _I)),
    (
        "role_syntax",
        re.compile(
            r"(^|\n|>)\s*(system|assistant|developer|tool|function)\s*:|<\|?(im_start|im_end|system|endoftext)\|?>"
            r"|\[/?INST\]|<</?SYS>>|</?(system|assistant|user|tool|tool_call|function_call)>",
            _I,
        ),
    ),
    (
        "tool_call",
        re.compile(
            r"\"(tool_calls|function_call|tool_call_id)\"\s*:|\{\s*\"name\"\s*:\s*\"[^\"]*\"\s*,\s*\"arguments\""
            r"|<function=|\bfunctions\.\w+\(",
            _I,
        ),
    ),
    (
        "persona_override",
        re.compile(
            r"\b(you\s+are\s+now\s+(an?|the|in|called|named|my|free|unrestricted|jailbroken|dan|evil|no\s+longer)"
            r"|new\s+instructions|jailbreak|developer\s+mode|dan\s+mode)\b"
            r"|\b(from\s+now\s+on|henceforth|going\s+forward)\b[^.\n]{0,60}\b(you|assistant|respond|answer|"
            r"reply|leak|reveal|secrets?|passwords?|keys?|ignore|obey|links?|urls?)\b"
            r"|\b(act|roleplay)\s+as\s+(an?\s+)?(ai|assistant|system|admin(istrator)?|root|unrestricted)\b",
            _I,
        ),
    ),
    (
        "link_planting",
        re.compile(
            rf"\b(append|add|include|insert|attach|put|place|paste|end|start|begin|sign|close|finish|promote|"
            rf"recommend|mention|share|link)\w*\b[^\n]{{0,100}}\b(every|each|all|any|your)\s+(\w+\s+)?{_ANSWERS}\b"
            rf"|\b(always|every\s+time|whenever|in\s+every|in\s+each)\b[^\n]{{0,60}}\b(append|add|include|insert|"
            rf"attach|paste|send|show|share|recommend|mention|put)\w*\b[^\n]{{0,60}}({_URL}|\blinks?\b)"
            rf"|{_URL}[^\n]{{0,100}}\b(every|each|all)\s+(\w+\s+)?{_ANSWERS}\b",
            _I,
        ),
    ),
)


# Cheap prefilters: a rule can only match text (lower-cased) holding one of its needles.
_NEEDLES: dict[str, tuple[str, ...]] = {
    "ignore_instructions": ("ignore", "disregard", "override", "forget"),
    "you_must": ("must", "shall", "required", "should", "will", "have"),
    "model_directive": ("must", "shall", "should", "required", "will"),
    "system_prompt": ("system", "developer"),
    "memory_tag": ("<",),
    "role_syntax": (":", "<", "[", "inst"),
    "tool_call": ('"', "<function", "functions."),
    "persona_override": ("now", "instructions", "jailbreak", "developer", "dan", "henceforth", "forward", "act",
                         "roleplay"),
    "link_planting": ("answer", "repl", "respons", "message", "output", "email", "post", "text", "suggestion",
                      "link", "http", "www.", ".com", ".net", ".org", ".io", ".example", ".xyz", ".ru", ".cn",
                      ".top", ".info", ".biz", ".click"),
}  # fmt: skip


def _may_match(name: str, lowered: str) -> bool:
    needles = _NEEDLES.get(name)
    return needles is None or any(needle in lowered for needle in needles)


def injection_reason(text: str, extra: Sequence[str] = ()) -> str | None:
    """The name of the first instruction or link-planting rule ``text`` matches, or None."""
    folded = fold(text)
    lowered = folded.lower()
    for name, pattern in _INJECTION_RULES:
        if _may_match(name, lowered) and pattern.search(folded):
            return name
    for pattern_text in extra:
        if re.search(pattern_text, folded, _I):
            return "configured_pattern"
    return None
