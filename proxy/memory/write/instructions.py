"""The instruction screen: text that reads as instructions to a model, or plants links in its answers.

"ignore previous instructions", "disregard the above", "you must", role or tool-call syntax ("### SYSTEM:"), a
``</memory>`` closer, "from now on ... leak", "append the link http://... to every answer", and the same in German,
Spanish, French, Portuguese, Chinese, Japanese and Korean; a markdown image (or an HTML ``<img>``) pointing at a URL,
or a link whose URL carries a query: rendered by a client, either sends data to that address. ``injection_reason``
names the first rule the unmasked text matches (``folding.unmasked``: NFKC, look-alike letters, invisible
characters, HTML entities, spaced letters). A turn or summary that matches is stored flagged and never injected; a
fact that matches is dropped.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from proxy.memory.write.folding import unmasked

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
        "ignore_context",
        re.compile(
            r"\b(ignore|disregard|forget|override)\s+(all\s+|everything\s+|anything\s+|what\s+(was\s+)?said\s+)?"
            r"(of\s+)?(the\s+|your\s+)?(above|previous|prior|preceding|earlier|foregoing)\b"
            r"(?!\s+(day|week|month|year|night|time|one|two|trip|visit|job|owner|tenant)s?\b)",
            _I,
        ),
    ),
    (
        "ignore_instructions_de",
        re.compile(
            r"\b(ignorier\w*|vergiss|vergessen\s+sie|missachte\w*)\s+(alle[sn]?\s+|die\s+|deine\s+|ihre\s+)*"
            r"(vorherigen|bisherigen|obigen|früheren|vorigen|oben)?\s*(anweisungen|instruktionen|regeln|befehle|"
            r"vorgaben|oben|bisherige|vorherige)\b",
            _I,
        ),
    ),
    (
        "ignore_instructions_es_pt",
        re.compile(
            r"\b(ignora|ignore|ignorar|olvida|olvide|olvidar|omite|esque[cç]a|esquece|desconsidere)\s+"
            r"(todas\s+|todo\s+|tudo\s+)?(las\s+|as\s+|lo\s+|o\s+)?(tus\s+|suas\s+)?(instrucciones|indicaciones|reglas|"
            r"instru[cç][oõ]es|regras|anterior(es)?|acima|arriba|que\s+(está|esta)\s+arriba)\b",
            _I,
        ),
    ),
    (
        "ignore_instructions_fr",
        re.compile(
            r"\b(ignore[zs]?|oublie[zs]?|n[eé]glige[zs]?)\s+(toutes\s+|tout\s+)?(les\s+|tes\s+|vos\s+|ce\s+qui\s+)?"
            r"(instructions|consignes|r[eè]gles|pr[eé]c[eè]de|ci-dessus)\b",
            _I,
        ),
    ),
    (
        "ignore_instructions_cjk",
        re.compile(
            r"(忽略|无视|無視|忘记|忘記|忘掉|不要理会|不要理會)(之前|以前|上面|上述|以上|先前|前面|此前)?的?(所有|一切|全部)?的?"
            r"(指令|指示|说明|說明|规则|規則|提示|内容|內容|设定|設定|一切)"
            r"|(以前|前|上記|これまで)の(すべての)?(指示|命令|指令|ルール)を?(無視|忘れ)"
            r"|(이전|앞의|위의|기존)\s*(의\s*)?(모든\s*)?(지시|명령|지침|규칙)(를|을|은|는)?\s*(무시|잊)",
        ),
    ),
    (
        "markdown_exfiltration",
        re.compile(
            r"!\[[^\]\n]{0,200}\]\(\s*<?(https?:)?//[^)\s]+"  # a markdown image loads its URL when shown
            r"|\[[^\]\n]{0,200}\]\(\s*<?(https?:)?//[^)\s?]+\?[^)\s]*="  # a link with a query carries data
            r"|<\s*img\b[^>]{0,200}\bsrc\s*=\s*[\"']?(https?:)?//",
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
            r"(^|\n|>)\s*(#{1,6}|\*\*|\[)?\s*(system|assistant|developer|tool|function)\s*(\]|\*\*)?\s*:"
            r"|<\|?(im_start|im_end|system|endoftext)\|?>"
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
    "ignore_context": ("ignore", "disregard", "override", "forget"),
    "ignore_instructions_de": ("ignorier", "vergiss", "vergessen", "missacht"),
    "ignore_instructions_es_pt": ("ignor", "olvid", "omite", "esque", "desconsider"),
    "ignore_instructions_fr": ("ignore", "oubli", "neglige", "néglige"),
    "ignore_instructions_cjk": ("忽略", "无视", "無視", "忘", "不要理", "以前", "前の", "上記", "これまで",
                                "이전", "앞의", "위의", "기존"),
    "markdown_exfiltration": ("](", "img"),
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
    folded = unmasked(text)
    lowered = folded.lower()
    for name, pattern in _INJECTION_RULES:
        if _may_match(name, lowered) and pattern.search(folded):
            return name
    for pattern_text in extra:
        if re.search(pattern_text, folded, _I):
            return "configured_pattern"
    return None
