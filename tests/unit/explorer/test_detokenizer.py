"""Incremental detokenization against a full decode, with stop strings, on the tiny tokenizer."""

from __future__ import annotations

import pytest

from services.common.tiny_model import build_tokenizer
from services.explorer.serving.engines.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(seed=0)


def test_matches_full_decode_including_multibyte(tok):
    text = "Héllo wörld → 42 even 😀 odd"
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    pieces = []
    for i in ids:
        d.add(i)
        pieces.append(d.take())
    pieces.append(d.take(final=True))
    assert "".join(pieces) == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_cuts_text_and_is_never_shown(tok):
    ids = tok.encode("the answer is odd. more text", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, stop=["odd."])
    shown = []
    for i in ids:
        d.add(i)
        shown.append(d.take())
        if d.stopped:
            break
    shown.append(d.take(final=True))
    assert d.stopped
    assert "".join(shown) == "the answer is "
