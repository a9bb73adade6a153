"""The stream reader: a streamed reply read back whole, however the bytes are cut and whichever line ends."""

from __future__ import annotations

import itertools

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.sse import ReplyAssembler

SEPARATORS = (b"\r\n\r\n", b"\n\n", b"\r\r")


def _event(content: str, separator: bytes) -> bytes:
    delta = {"choices": [{"index": 0, "delta": {"content": content}}]}
    return b"data: " + orjson.dumps(delta) + separator


@settings(max_examples=200, deadline=None)
@given(
    contents=st.lists(st.text(max_size=12), max_size=12),
    separators=st.lists(st.sampled_from(SEPARATORS), min_size=13, max_size=13),
    cuts=st.lists(st.integers(min_value=0, max_value=2000), max_size=8),
)
def test_the_reply_is_the_same_however_the_stream_is_cut(
    contents: list[str], separators: list[bytes], cuts: list[int]
) -> None:
    stream = b"".join(_event(c, s) for c, s in zip(contents, separators, strict=False))
    stream += b"data: [DONE]" + separators[-1]
    assembler = ReplyAssembler()
    edges = [0, *sorted(min(c, len(stream)) for c in cuts), len(stream)]
    for start, end in itertools.pairwise(edges):
        assembler.feed(stream[start:end])
    assert assembler.text == "".join(contents)
    assert assembler.done
    assert assembler.complete


def test_an_event_waits_for_its_blank_line() -> None:
    assembler = ReplyAssembler()
    assembler.feed(_event("half", b"\r\n\r"))  # the blank line is not complete yet
    assert assembler.text == ""
    assembler.feed(b"\n")
    assert assembler.text == "half"


def test_the_earliest_blank_line_ends_an_event() -> None:
    assembler = ReplyAssembler()
    # "\r\r" comes before "\n\n": the event ends there, and what follows the "\n\n" is the next event
    assembler.feed(_event("one", b"\r\r") + b"\n\n" + _event("two", b"\n\n"))
    assert assembler.text == "onetwo"
