"""Screens on everything memory stores and may show a model again (pure functions, no I/O).

A stored text comes back in later chats, so what it carries is checked in code before it is written:

- **Identifiers** (``redact_identifiers``): Luhn-valid card numbers, IBANs with a valid mod-97 check,
  SSN/NI-like and other national-id-like numbers, account/passport/licence numbers, API keys and tokens
  (``sk-``, AWS, GitHub, Slack, Google, JWT, bearer tokens, private keys), passwords and PINs. The secret
  itself is replaced by ``[redacted:<kind>]``; the words around it stay, so "my card is ..." still says that
  a card was mentioned. Turns, summaries and facts are redacted unless the user explicitly asked to
  remember (``asked_to_remember``).
- **Instructions and planted links** (``injection_reason``): text that reads as instructions to a model
  ("ignore previous instructions", "you must", role or tool-call syntax, a ``</memory>`` closer, "from now
  on ... leak", "append the link http://... to every answer"). Such a turn or summary is stored *flagged*
  (``MemoryRecord.flagged`` holds the reason): it stays visible in the management API and the web page, and
  is never injected. Facts that read so are not stored at all.
- **Sensitive categories** (``sensitive_category``): health, religion, politics, sexual orientation,
  ethnicity, criminal record and union membership, by keyword, in English and in Chinese, Japanese and
  Korean (the languages the keyword index tokenises); it backs the memory model's own ``sensitive`` flag.

Every match runs on a folded copy of the text (``fold``: NFKC, lookalike brackets mapped to ``<`` and ``>``,
zero-width and bidi characters removed), so a fullwidth closer (U+FF1C /memory U+FF1E) or one with a
zero-width space inside matches as "</memory>".
"""

from __future__ import annotations

import dataclasses
import re
import unicodedata
from collections.abc import Collection, Iterator, Sequence

_I = re.IGNORECASE
REDACTION = "[redacted:{kind}]"
REDACTION_MARK = "[redacted:"

# --- folding ----------------------------------------------------------------------------------------------

_INVISIBLE = re.compile("[\u00ad\u034f\u061c\u115f\u1160\u17b4\u17b5\u180e\u200b-\u200f\u202a-\u202e"
                        "\u2060-\u206f\u3164\ufe00-\ufe0f\ufeff\uffa0]")  # fmt: skip
_LOOKALIKES = str.maketrans({
    "\u2039": "<", "\u203a": ">", "\u2329": "<", "\u232a": ">", "\u3008": "<", "\u3009": ">",
    "\u300a": "<", "\u300b": ">", "\u27e8": "<", "\u27e9": ">", "\u02c2": "<", "\u02c3": ">",
    "\u1438": "<", "\u1433": ">", "\u276e": "<", "\u276f": ">", "\u276c": "<", "\u276d": ">",
    "\u00ab": "<", "\u00bb": ">", "\u2264": "<", "\u2265": ">", "\u2215": "/", "\u2044": "/",
    "\u29f8": "/", "\u0338": "/",
})  # fmt: skip


def fold(text: str) -> str:
    """``text`` as the screens read it: NFKC, lookalike brackets and slashes mapped, invisible marks removed."""
    return _INVISIBLE.sub("", unicodedata.normalize("NFKC", text).translate(_LOOKALIKES))


# --- instructions and planted links -----------------------------------------------------------------------

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
    "private_key": ("-----begin",),
    "api_key": ("sk", "pk-", "rk-", "akia", "gh", "github_pat", "xox", "aiza", "glpat", "eyj"),
    "token": ("bearer",),
    "credential": ("pass", "pin", "cvv", "cvc", "security", "api", "secret", "token", "2fa", "otp", "mot de",
                   "contrase", "密码", "密碼", "口令", "パスワード", "暗証番号", "비밀번호"),
    "pin": ("pin",),
    "account_number": ("account", "acct", "routing", "sort", "passport", "licen", "national", "id", "tax",
                       "social", "insurance", "policy", "member", "card", "身份证", "マイナンバー", "주민등록번호"),
    "national_id": ("passport", "national", "id", "licen", "tax"),
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


# --- identifiers ------------------------------------------------------------------------------------------

_CARD = re.compile(r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])")
_IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?:[ ]?[A-Z0-9]){11,30}\b", _I)
_CJK_PUNCT = "\u3002\uff0c\u3001\uff01\uff1f"  # ideographic full stop, fullwidth comma, ... question mark
_PUNCT_END = rf"(?=[.,;:!?)\]'\"{_CJK_PUNCT}]*(?:\s|$))"
# Each rule's ``secret`` group (or the whole match) is what gets redacted.
_IDENTIFIER_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("ssn", re.compile(r"\b\d{3}-\d{2}-\d{4}\b")),
    ("national_insurance", re.compile(r"\b[A-CEGHJ-PR-TW-Z]{2}\s?\d{2}\s?\d{2}\s?\d{2}\s?[A-D]\b")),
    (
        "private_key",
        re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?(-----END [A-Z ]*PRIVATE KEY-----|$)"),
    ),
    (
        "api_key",
        re.compile(
            r"\b(sk|pk|rk)-[A-Za-z0-9_-]{16,}|\bsk_(live|test)_[A-Za-z0-9]{16,}|\bAKIA[0-9A-Z]{16}\b"
            r"|\bgh[pousr]_[A-Za-z0-9]{30,}|\bgithub_pat_[A-Za-z0-9_]{30,}|\bxox[abprs]-[A-Za-z0-9-]{10,}"
            r"|\bAIza[0-9A-Za-z_-]{35}|\bglpat-[A-Za-z0-9_-]{20,}"
            r"|\beyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{8,}"
        ),
    ),
    ("token", re.compile(r"\bbearer\s+(?P<secret>[A-Za-z0-9._~+/-]{16,}=*)", _I)),
    (
        "credential",
        re.compile(
            r"\b(password|passwd|passcode|passphrase|pass\s*word|pin(\s+(code|number))?|cvv|cvc|security\s+code|"
            r"api[\s_-]?key|secret(\s+key)?|access\s+token|auth\s+token|token|2fa\s+code|otp|mot\s+de\s+passe|"
            r"passwort|contraseña)\s*(is|was|are|:|=)\s*"
            rf"(?P<secret>\S+?){_PUNCT_END}"
            rf"|(密码|密碼|口令|パスワード|暗証番号|비밀번호)\s*(是|为|は|:|=|는|은)?\s*(?P<cjk>[^\s{_CJK_PUNCT}]+)",
            _I,
        ),
    ),
    ("pin", re.compile(r"\bpin\s*(code|number|#)?\s*(?P<secret>\d{4,8})\b", _I)),
    (
        "account_number",
        re.compile(
            r"\b(account|acct|routing|sort\s+code|passport|licen[cs]e|national\s+id|id\s+number|id\s+card|"
            r"tax\s+id|social\s+security|insurance\s+number|policy\s+number|member(ship)?\s+number|card|"
            r"身份证|マイナンバー|주민등록번호)[^\d\n]{0,25}(?P<secret>\d[\d -]{3,}\d)",
            _I,
        ),
    ),
    (
        "national_id",
        re.compile(
            r"\b(passport|national\s+id|id\s+number|id\s+card|licen[cs]e|tax\s+id)\b[^\n]{0,25}?"
            r"(?P<secret>\b(?=[A-Z0-9]*\d{4})[A-Z]{1,3}\d[A-Z0-9]{4,}\b)",
            _I,
        ),
    ),
)


def luhn_valid(digits: str) -> bool:
    """Whether a digit string passes the Luhn checksum (payment card numbers do)."""
    total = 0
    for i, char in enumerate(reversed(digits)):
        value = int(char)
        if i % 2 == 1:
            value = value * 2 - 9 if value > 4 else value * 2
        total += value
    return len(digits) > 1 and total % 10 == 0


def iban_valid(candidate: str) -> bool:
    """Whether a string is an IBAN with a valid ISO 13616 mod-97 check."""
    text = re.sub(r"\s", "", candidate).upper()
    if not re.fullmatch(r"[A-Z]{2}\d{2}[A-Z0-9]{11,30}", text):
        return False
    rearranged = text[4:] + text[:4]
    return int("".join(str(int(char, 36)) for char in rearranged)) % 97 == 1


@dataclasses.dataclass(frozen=True, slots=True)
class Span:
    """One identifier found in a text: where it is and what kind it is."""

    start: int
    end: int
    kind: str


def _valid_iban_prefix(match: re.Match[str]) -> Span | None:
    """The longest valid IBAN at the start of a match (the pattern may run on into the next word)."""
    text = match.group()
    while len(re.sub(r"\s", "", text)) >= 15:
        if iban_valid(text):
            return Span(match.start(), match.start() + len(text), "iban")
        text = text[:-1].rstrip()
    return None


def _checksum_spans(text: str) -> list[Span]:
    spans = [Span(m.start(), m.end(), "card_number") for m in _CARD.finditer(text)
             if luhn_valid(re.sub(r"\D", "", m.group()))]  # fmt: skip
    ibans = (_valid_iban_prefix(m) for m in _IBAN.finditer(text))
    return spans + [span for span in ibans if span is not None]


_DIGIT = re.compile(r"\d")
_NEEDS_DIGITS = frozenset({"ssn", "national_insurance", "pin", "account_number", "national_id"})


# Keyword rules can only match where one of these (lower case) starts: they are tried at those places only,
# instead of at every position (a scan of 100 kB took ~60 ms per rule, ~1 ms this way).
_ANCHORS: dict[str, tuple[str, ...]] = {
    "token": ("bearer",),
    "credential": ("pass", "pin", "cvv", "cvc", "security", "api", "secret", "access", "auth", "token", "2fa",
                   "otp", "mot", "contrase", "密码", "密碼", "口令", "パスワード", "暗証番号", "비밀번호"),
    "pin": ("pin",),
    "account_number": ("account", "acct", "routing", "sort", "passport", "licen", "national", "id", "tax",
                       "social", "insurance", "policy", "member", "card", "身份证", "マイナンバー", "주민등록번호"),
    "national_id": ("passport", "national", "id", "licen", "tax"),
}  # fmt: skip


def _matches(name: str, pattern: re.Pattern[str], text: str, lowered: str) -> Iterator[re.Match[str]]:
    anchors = _ANCHORS.get(name)
    if anchors is None or len(lowered) != len(text):  # lower() moved indexes (rare letters): scan it all
        yield from pattern.finditer(text)
        return
    for anchor in anchors:
        at = lowered.find(anchor)
        while at != -1:
            match = pattern.match(text, at)
            if match is not None:
                yield match
            at = lowered.find(anchor, at + 1)


def identifier_spans(text: str, extra: Sequence[str] = ()) -> list[Span]:
    """Every identifier in ``text`` (positions in ``text`` itself), without overlaps, in order."""
    digits = _DIGIT.search(text) is not None
    lowered = text.lower()
    spans = _checksum_spans(text) if digits else []
    for name, pattern in _IDENTIFIER_RULES:
        if (not digits and name in _NEEDS_DIGITS) or not _may_match(name, lowered):
            continue
        for match in _matches(name, pattern, text, lowered):
            group = next((g for g in ("secret", "cjk") if g in pattern.groupindex and match.group(g)), 0)
            spans.append(Span(match.start(group), match.end(group), name))
    for pattern_text in extra:
        spans += [Span(m.start(), m.end(), "configured_pattern") for m in re.finditer(pattern_text, text, _I)]
    kept: list[Span] = []
    for span in sorted(spans, key=lambda s: (s.start, -s.end)):
        if span.end > span.start and (not kept or span.start >= kept[-1].end):
            kept.append(span)
    return kept


def identifier_reason(text: str, extra: Sequence[str] = ()) -> str | None:
    """The kind of the first identifier ``text`` holds (card, IBAN, SSN-like, account, credential...), or None."""
    for target in (text, fold(text)):
        spans = identifier_spans(target, extra)
        if spans:
            return spans[0].kind
    return None


def redact_identifiers(text: str, extra: Sequence[str] = (), keep: Collection[str] = ()) -> tuple[str, tuple[str, ...]]:
    """``text`` with every identifier replaced by ``[redacted:<kind>]`` (except those in ``keep``, the ones
    the user asked to remember), and the kinds replaced.

    The original text is searched first; when only its folded form shows an identifier (fullwidth digits,
    zero-width characters inside a number), the folded form is what gets redacted and stored.
    """
    source, spans = text, identifier_spans(text, extra)
    if not spans:
        source = fold(text)
        spans = identifier_spans(source, extra) if source != text else []
    spans = [span for span in spans if source[span.start : span.end] not in keep]
    if not spans:
        return text, ()
    out, last = [], 0
    for span in spans:
        out += [source[last : span.start], REDACTION.format(kind=span.kind)]
        last = span.end
    out.append(source[last:])
    return "".join(out), tuple(dict.fromkeys(span.kind for span in spans))


# --- explicit requests ------------------------------------------------------------------------------------

_EXPLICIT = re.compile(
    r"(^|[.!?\n]\s*|\b(please|pls|can\s+you|could\s+you|would\s+you|will\s+you|i\s+want\s+you\s+to|"
    r"i'?d\s+like\s+you\s+to|make\s+sure\s+(to|you))\s+)"
    r"(remember|memori[sz]e|keep\s+in\s+mind|don'?t\s+forget|do\s+not\s+forget|note\s+(that|down)|"
    r"make\s+a\s+note|save\s+(this|that)\s+to\s+(your\s+)?memory)\b",
    _I,
)


def asked_to_remember(user_text: str) -> bool:
    """Whether the user explicitly asked to remember something, in their own words."""
    return _EXPLICIT.search(user_text) is not None


_SENTENCE = re.compile(r"[^.!?\n]+(?:[.!?]+(?=\s|$)|\n|$)|[.!?]")


def remembered_identifiers(user_messages: Sequence[str], extra: Sequence[str] = ()) -> frozenset[str]:
    """The identifiers the user asked to remember: those in a sentence that asks for it ("Please remember my
    PIN is 4921."), in the text as written. Every other identifier of the exchange is redacted."""
    found: set[str] = set()
    for message in user_messages:
        if not asked_to_remember(message):
            continue
        for sentence in _SENTENCE.findall(message):
            if asked_to_remember(sentence.strip()):
                found.update(sentence[span.start : span.end] for span in identifier_spans(sentence, extra))
    return frozenset(found)


# --- sensitive categories ---------------------------------------------------------------------------------

_SENSITIVE_WORDS: dict[str, tuple[str, ...]] = {
    "health": (
        r"diagnos\w*", r"diabet\w*", r"cancer", r"tumou?r", r"chemo\w*", r"hiv", r"depress(ion|ed)",
        r"anxiety\s+disorder", r"panic\s+attacks?", r"bipolar", r"schizophreni\w*", r"adhd", r"autis\w*",
        r"epilep\w*", r"asthma", r"insulin", r"antidepressants?", r"pregnan\w*", r"miscarriage", r"abortion",
        r"dementia", r"alzheimer'?s", r"parkinson'?s", r"multiple\s+sclerosis", r"disorder", r"illness",
        r"disease", r"medications?", r"prescri(bed|ption)", r"therap(y|ist)", r"psychiatri\w*",
        r"rehab", r"addict(ion|ed)", r"alcoholi\w*", r"surgery", r"hospitali[sz]ed", r"blood\s+pressure",
        r"heart\s+attack", r"infertil\w*", r"ptsd", r"ocd", r"eating\s+disorder", r"anorexi\w*",
        r"bulimi\w*", r"diabète", r"krebs", r"diabetes", r"cáncer",
        "糖尿病", "癌症", "抑郁症", "焦虑症", "确诊", "诊断", "艾滋", "怀孕", "住院", "化疗",
        "がん", "診断", "うつ病", "妊娠", "入院", "持病", "당뇨", "진단", "우울증", "임신", "입원",
    ),
    "religion": (
        r"religio\w*", r"christian\w*", r"catholic\w*", r"protestant\w*", r"muslim", r"islam\w*", r"jewish",
        r"judaism", r"hindu\w*", r"buddhis\w*", r"sikh\w*", r"atheis\w*", r"agnostic", r"church", r"mosque",
        r"synagogue", r"pray(ed|ing|s)?", r"bible", r"quran", r"koran", r"converted\s+to", r"mormon\w*", r"jehovah",
        "基督教", "天主教", "伊斯兰", "穆斯林", "佛教", "犹太", "教会", "キリスト教", "仏教", "イスラム",
        "기독교", "불교", "천주교", "이슬람", "교회",
    ),
    "politics": (
        r"vot(e|ed|ing)\s+(for|against)", r"democrat\w*", r"republican\w*", r"labou?r\s+party",
        r"conservative\s+party", r"tor(y|ies)", r"communis\w*", r"socialis\w*", r"fascis\w*", r"politic\w*",
        r"left[\s-]wing", r"right[\s-]wing", r"party\s+member", r"member\s+of\s+the\s+\w+\s+party",
        r"libertarian", r"green\s+party",
        "共产党", "党员", "政党", "投票给", "支持政党", "自民党", "정당", "민주당", "국민의힘", "투표",
    ),
    "sexual_orientation": (
        r"gay", r"lesbian", r"bisexual", r"transgender", r"queer", r"homosexual\w*", r"asexual", r"pansexual",
        r"came\s+out", r"sexual\s+orientation", r"lgbt\w*", r"non[\s-]?binary",
        "同性恋", "双性恋", "跨性别", "出柜", "同性愛", "ゲイ", "レズビアン", "バイセクシュアル",
        "동성애", "게이", "레즈비언", "양성애", "커밍아웃",
    ),
    "ethnicity": (
        r"ethnic\w*", r"my\s+race", r"hispanic", r"latin[oax]", r"african[\s-]american", r"indigenous",
        r"aboriginal", r"racial", r"少数民族", "民族", "인종",
    ),
    "criminal_record": (
        r"convicted", r"felon(y|ies)?", r"criminal\s+record", r"prison", r"jail(ed)?", r"arrested",
        r"probation", r"parole", r"incarcerat\w*", "坐牢", "犯罪记录", "前科", "逮捕", "전과", "수감", "체포",
    ),
    "union_membership": (
        r"trade\s+union", r"labou?r\s+union", r"union\s+(member|rep\w*|dues|steward)", r"unioni[sz]ed",
        "工会", "労働組合", "노동조합", "노조",
    ),
}  # fmt: skip


_WORD = re.compile(r"[a-z][a-z']*")
_HEAD = re.compile(r"[a-z']+")


def _buckets() -> dict[str, list[tuple[str, re.Pattern[str]]]]:
    """The ASCII sensitive patterns by the first four letters of their literal head (three or fewer when the
    head is that short), so that a text is only matched against the patterns its words could start."""
    buckets: dict[str, list[tuple[str, re.Pattern[str]]]] = {}
    for name, words in _SENSITIVE_WORDS.items():
        for word in words:
            if word.isascii():
                head = _HEAD.match(word)
                if head is None or len(head.group()) < 2:
                    raise ValueError(f"sensitive pattern {word!r} must start with at least two letters")
                buckets.setdefault(head.group()[:4], []).append((name, re.compile(rf"\b(?:{word})\b")))
    return buckets


_SENSITIVE_BUCKETS = _buckets()
_SENSITIVE_OTHER = re.compile(  # CJK and accented words: no word boundaries, one named group per category
    "|".join(f"(?P<{name}>{'|'.join(re.escape(w) for w in words if not w.isascii())})"
             for name, words in _SENSITIVE_WORDS.items() if any(not w.isascii() for w in words)),
    _I,
)  # fmt: skip


def sensitive_category(text: str) -> str | None:
    """The sensitive category (health, religion, politics, ...) ``text`` first speaks of, or None."""
    folded = fold(text).lower()
    for token in dict.fromkeys(_WORD.findall(folded)):
        for key in dict.fromkeys((token[:4], token[:3], token[:2])):
            for name, pattern in _SENSITIVE_BUCKETS.get(key, ()):
                if pattern.search(folded):
                    return name
    if not folded.isascii():
        match = _SENSITIVE_OTHER.search(folded)
        if match is not None:
            return match.lastgroup
    return None


# --- one stored text --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class ScreenedText:
    """A text as it may be stored: redacted unless explicit, with why it is flagged and its sensitive category."""

    text: str
    redacted: tuple[str, ...] = ()
    flagged: str | None = None
    sensitive: str | None = None


def screen_text(
    text: str,
    *,
    explicit: bool = False,
    keep: Collection[str] = (),
    extra_identifiers: Sequence[str] = (),
    extra_instructions: Sequence[str] = (),
) -> ScreenedText:
    """Screen one text before it is stored: redact identifiers (all but ``keep``, none when ``explicit``),
    flag instructions."""
    redacted: tuple[str, ...] = ()
    if not explicit:
        text, redacted = redact_identifiers(text, extra_identifiers, keep)
    reason = injection_reason(text, extra_instructions)
    flagged = f"instruction_like:{reason}" if reason is not None else None
    return ScreenedText(text, redacted, flagged, sensitive_category(text))
