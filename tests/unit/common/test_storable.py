"""Which strings a buffer database can store, and where in a request body the first bad one is."""

from __future__ import annotations

from services.common.storable import find_unstorable, string_problem


def test_plain_and_odd_but_valid_unicode_is_storable():
    for s in ["", "hello", "é", "日本語", "🙂", "a\u200fb", "\u2028", "\uffff", "e\u0301", "x" * 100_000]:
        assert string_problem(s) is None, repr(s)


def test_nul_and_lone_surrogates_are_named_with_their_position():
    assert "NUL" in string_problem("ab\x00") and "position 2" in string_problem("ab\x00")
    assert "surrogate (\\ud800) at position 1" in string_problem("a\ud800")
    assert "surrogate (\\udfff)" in string_problem("\udfff")
    # a valid pair written as two escapes in JSON arrives as one character: fine
    assert string_problem("\U0001f642") is None


def test_find_unstorable_gives_the_dotted_path_of_the_first_bad_string():
    body = {"messages": [{"role": "user", "content": "ok"}, {"role": "user", "content": [{"type": "text", "text": "x\x00"}]}],
            "metadata": {"task_id": "\ud800"}}
    assert find_unstorable(body["messages"], "messages")[0] == "messages.1.content.0.text"
    assert find_unstorable(body["metadata"], "metadata")[0] == "metadata.task_id"
    assert find_unstorable({"k\x00": 1}, "metadata")[0] == "metadata.<key>"
    assert find_unstorable({"a": [1, 2.0, None, True, "fine"]}, "x") is None
