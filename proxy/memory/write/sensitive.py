"""The sensitive-category screen: health, religion, politics, sexual orientation, ethnicity, crime, unions.

By keyword, in English and in Chinese, Japanese and Korean (the languages the keyword index tokenises); it
backs the memory model's own ``sensitive`` flag.
"""

from __future__ import annotations

import re

from proxy.memory.write.folding import fold

_I = re.IGNORECASE
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
