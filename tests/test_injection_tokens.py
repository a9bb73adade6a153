"""The memory block's token estimate against real tokenizers, script by script.

The tokenizers are the ones installed with litellm (no download): OpenAI's cl100k and o200k BPE files
(read by tiktoken from litellm's bundled cache) and DeepSeek's ``tokenizer.json`` (read by ``tokenizers``).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
import tiktoken
from tokenizers import Tokenizer

from proxy.memory.read.block import MemoryItem, Section, quote
from proxy.memory.read.injection import inject
from proxy.memory.read.retrieval_settings import InjectionSettings
from proxy.memory.read.tokens import estimate_tokens

Count = Callable[[str], int]

# Two sentences of ordinary chat per script, the kind of thing a memory holds (their own punctuation kept).
SAMPLES = {
    "English": "I adopted a golden retriever puppy named Biscuit last spring. We hike the Cascade trail every "
    "Saturday morning before breakfast, weather permitting.",
    "Chinese": "我去年春天收养了一只名叫饼干的金毛猎犬幼犬。我们每个星期六早上早餐前都会去喀斯喀特步道徒步旅行，"  # noqa: RUF001 - a Chinese comma
    "我的妹妹住在上海，她是一名软件工程师。",  # noqa: RUF001
    "Korean": "작년 봄에 비스킷이라는 골든 리트리버 강아지를 입양했어요. 우리는 매주 토요일 아침 식사 전에 캐스케이드 "
    "트레일을 하이킹합니다. 제 여동생은 서울에 살고 소프트웨어 엔지니어예요.",
    "Japanese": "去年の春にビスケットという名前のゴールデンレトリバーの子犬を飼い始めました。毎週土曜日の朝食前に"
    "カスケードトレイルをハイキングしています。",
    "Arabic": "لقد تبنيت جرو جولدن ريتريفر اسمه بسكويت في الربيع الماضي. نحن نتنزه في مسار كاسكيد كل صباح سبت قبل "
    "الإفطار، وأختي تعيش في القاهرة وتعمل مهندسة برمجيات.",
    "Hindi": "मैंने पिछले वसंत में बिस्किट नाम का एक गोल्डन रिट्रीवर पिल्ला गोद लिया। हम हर शनिवार सुबह नाश्ते से "
    "पहले कैस्केड ट्रेल पर हाइक करते हैं।",
    "Russian": "Прошлой весной я взял щенка золотистого ретривера по кличке Бисквит. Каждую субботу утром мы ходим "
    "в поход по тропе Каскейд, а моя сестра живёт в Москве.",  # noqa: RUF001 - Cyrillic letters
    "Thai": "ฉันรับเลี้ยงลูกสุนัขโกลเด้นรีทรีฟเวอร์ชื่อบิสกิตเมื่อฤดูใบไม้ผลิที่แล้ว และเราเดินป่าทุกเช้าวันเสาร์ก่อนอาหารเช้า",
    "emoji": "Loved the trip 😍🎉🐶🏔️👍🏽 see you soon 🙏✨🔥 the whole family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵🇰🇷",
}


def _bundled() -> Path:
    """litellm's directory of bundled tokenizer files."""
    spec = importlib.util.find_spec("litellm")
    assert spec is not None
    assert spec.origin is not None
    return Path(spec.origin).parent / "litellm_core_utils" / "tokenizers"


@pytest.fixture(scope="module")
def tokenizers() -> dict[str, Count]:
    """Token counters of cl100k, o200k and DeepSeek, read from files installed with litellm."""
    with pytest.MonkeyPatch.context() as env:  # tiktoken finds its BPE files through this variable only
        env.setenv("TIKTOKEN_CACHE_DIR", str(_bundled()))
        cl100k, o200k = tiktoken.get_encoding("cl100k_base"), tiktoken.get_encoding("o200k_base")
    deepseek = Tokenizer.from_file(str(_bundled() / "deepseek_tokenizer.json"))
    return {
        "cl100k": lambda text: len(cl100k.encode(text, disallowed_special=())),
        "o200k": lambda text: len(o200k.encode(text, disallowed_special=())),
        "deepseek": lambda text: len(deepseek.encode(text, add_special_tokens=False).ids),
    }


@pytest.mark.parametrize("script", list(SAMPLES))
def test_estimate_is_never_below_a_real_tokenizer(script: str, tokenizers: dict[str, Count]) -> None:
    """For every script, the quoted memory text costs at least as many estimated tokens as real ones."""
    quoted = quote(SAMPLES[script])
    for name, count in tokenizers.items():
        assert estimate_tokens(quoted) >= count(quoted), name


def test_english_is_not_over_counted_much(tokenizers: dict[str, Count]) -> None:
    """English, the common case, is estimated within 1.4x of cl100k, so the budget is not wasted."""
    quoted = quote(SAMPLES["English"])
    assert estimate_tokens(quoted) <= 1.4 * tokenizers["cl100k"](quoted)


@pytest.mark.parametrize("script", list(SAMPLES))
def test_the_injected_block_fits_its_budget_in_real_tokens(script: str, tokenizers: dict[str, Count]) -> None:
    """A block filled to a 300-token budget with memories in one script is at most 300 real tokens long."""
    items = [
        MemoryItem(id=f"m{i}", section=Section.ABOUT_USER, text=f"{SAMPLES[script]} ({i})", date="2026-03-01",
                   score=1.0 - i / 100)
        for i in range(20)
    ]  # fmt: skip
    result = inject([{"role": "user", "content": "hello"}], items, (), InjectionSettings(budget_tokens=300))
    assert result.items, "the budget holds at least one item"
    for name, count in tokenizers.items():
        assert count(result.block) <= 300, name
