"""Feedback in words through a real Explorer: a hint is rendered for each named call as the teacher's
prompt (the call's conversation plus the hint, by the served chat template) and kept through later
rewards; a correction becomes a demonstration of that very prompt; bad words get a clear 4xx and
change nothing."""

from __future__ import annotations

import pytest

from tests.integration.explorer.test_demonstrations import CALL, QUESTION, TOOLS

pytestmark = pytest.mark.integration

HINT = "Call the calculator with 17 * 23 first."


@pytest.fixture
def ex(make_explorer):
    return make_explorer("model.chat_template=hermes-tools")


def _call(ex, **kw):
    r = ex.http.post("/v1/chat/completions", json={"model": "default", "messages": QUESTION, "tools": TOOLS,
                                                   "max_tokens": 6, "return_token_ids": True, **kw})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["experience_id"], body


def _get(ex, exp_id):
    return ex.http.get(f"/experiences/{exp_id}").json()


def test_a_hint_is_kept_with_the_teachers_prompt_and_survives_a_later_reward(ex):
    exp_id, _ = _call(ex)
    r = ex.http.post("/feedback", json={"msg_ids": [exp_id], "hint": HINT, "source": "reviewer"})
    assert r.status_code == 200, r.text
    assert r.json()["updated"] == 1
    stored = _get(ex, exp_id)
    assert stored["status"] == "rewarded" and stored["reward"] is None  # has feedback: can be committed
    hint = stored["hint"]
    assert hint["text"] == HINT and hint["source"] == "reviewer"
    tok = ex.tokenizer
    recorded, teacher = tok.decode(stored["prompt_token_ids"]), tok.decode(hint["prompt_token_ids"])
    head = "<|im_start|>assistant\n"
    assert recorded.endswith(head) and teacher.endswith(head)
    # the teacher reads the same conversation, then the hint as a user's note, then answers
    assert teacher.startswith(recorded[: -len(head)])
    assert teacher[len(recorded) - len(head):] == (
        f"<|im_start|>user\nA note on how to answer, from a reviewer: {HINT}<|im_end|>\n" + head)
    # a reward sent later sets the reward and leaves the hint
    assert ex.http.post("/feedback", json={"msg_ids": [exp_id], "reward": 0.0}).status_code == 200
    again = _get(ex, exp_id)
    assert again["reward"] == 0.0 and again["hint"] == hint
    assert ex.http.post("/commit", json={}).json()["committed"] == 1


def test_a_hint_reaches_every_call_of_an_episode_and_its_template_is_configurable(make_explorer):
    ex = make_explorer("model.chat_template=hermes-tools", "recorder.hint_role=system", "recorder.hint_template=NOTE {hint}")
    ids = [_call(ex, metadata={"task_id": "t1", "run_id": "r1"})[0] for _ in range(2)]
    r = ex.http.post("/feedback", json={"task_id": "t1", "run_id": "r1", "hint": HINT, "reward": 0.5})
    assert r.status_code == 200 and r.json()["updated"] == 2, r.text
    for i in ids:
        e = _get(ex, i)
        assert e["reward"] == 0.5 and ex.tokenizer.decode(e["hint"]["prompt_token_ids"]).endswith(
            f"<|im_start|>system\nNOTE {HINT}<|im_end|>\n<|im_start|>assistant\n")


def test_a_correction_becomes_a_demonstration_of_that_very_prompt(ex):
    exp_id, _ = _call(ex)
    r = ex.http.post("/feedback", json={"msg_ids": [exp_id], "correction": CALL, "comment": "use the tool"})
    assert r.status_code == 200, r.text
    demo = _get(ex, r.json()["demonstration_id"])
    sampled = _get(ex, exp_id)
    assert demo["status"] == "committed" and demo["feedback"]["labels"] == ["demonstration", "correction"]
    assert demo["feedback"]["corrects"] == exp_id and demo["feedback"]["comment"] == "use the tool"
    assert demo["prompt_token_ids"] == sampled["prompt_token_ids"] and demo["feedback"]["prompt_as_recorded"] is True
    assert ex.tokenizer.decode(demo["response_token_ids"]).startswith("<tool_call>")
    assert sampled["status"] == "recorded" and sampled["reward"] is None  # a correction alone rewards nothing
    # the same correction with a reward: both land
    r = ex.http.post("/feedback", json={"msg_ids": [exp_id], "correction": CALL, "reward": 0.0})
    assert r.status_code == 200 and r.json()["updated"] == 1 and _get(ex, exp_id)["reward"] == 0.0


BAD_CALL = {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "function": {"name": "search", "arguments": "{}"}}]}


@pytest.mark.parametrize("body, status, param", [
    ({"hint": "   "}, 400, "hint"),
    ({"hint": "x" * 4001}, 400, "hint"),
    ({"hint": 3}, 400, "hint"),
    ({"correction": BAD_CALL}, 400, "correction.tool_calls.0.function.name"),
    ({"correction": {**CALL, "tool_calls": [{**CALL["tool_calls"][0], "function": {"name": "calculator",
                                                                                 "arguments": "17*23"}}]}},
     400, "correction.tool_calls.0.function.arguments"),
    ({"correction": {"role": "user", "content": "hi"}}, 400, "correction"),
    ({"correction": {"role": "assistant", "content": ""}}, 400, "correction"),
    ({"correction": CALL, "msg_ids": ["SELF", "OTHER"]}, 400, "correction"),
    ({}, 400, "reward"),
    ({"hint": HINT, "msg_ids": ["nobody-0"]}, 404, None),
])
def test_bad_words_get_a_clear_4xx_and_change_nothing(ex, body, status, param):
    exp_id, _ = _call(ex)
    other, _ = _call(ex)
    ids = [{"SELF": exp_id, "OTHER": other}.get(i, i) for i in body.pop("msg_ids", ["SELF"])]
    r = ex.http.post("/feedback", json={"msg_ids": ids, **body})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and (param is None or err["param"] == param), err
    stored = _get(ex, exp_id)
    assert stored["status"] == "recorded" and stored["hint"] is None
    assert ex.http.get("/experiences", params={"status": "committed"}).json()["data"] == []  # no demonstration either


def test_words_for_a_record_never_sampled_are_refused(ex):
    r = ex.http.post("/demonstrations", json={"model": "default", "messages": QUESTION, "tools": TOOLS, "response": CALL})
    demo = r.json()["experience_id"]
    for words in ({"hint": HINT}, {"correction": CALL}):
        r = ex.http.post("/feedback", json={"msg_ids": [demo], **words})
        assert r.status_code == 400 and r.json()["error"]["code"] == "not_sampled", r.text
    assert _get(ex, demo)["hint"] is None


def test_words_for_a_call_never_trained_or_not_a_chat_are_refused(ex):
    private = ex.http.post("/v1/chat/completions", json={"model": "default", "messages": QUESTION, "max_tokens": 4,
                                                         "metadata": {"train": False}}).json()
    text = ex.http.post("/v1/completions", json={"model": "default", "prompt": "2 + 2 =", "max_tokens": 2}).json()
    for msg_id, code in ((private["id"], "not_trainable"), (text["id"], "not_a_chat")):
        for words in ({"hint": HINT}, {"correction": CALL}):
            r = ex.http.post("/feedback", json={"msg_ids": [msg_id], **words})
            assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
    assert ex.http.get("/experiences", params={"status": "committed"}).json()["data"] == []


def test_a_retried_feedback_is_applied_once_and_a_reused_key_is_refused(ex):
    """A client that timed out after the Explorer took its feedback sends it again under the same
    idempotency key: the reward, the hint and the correction's demonstration land once, and the retry
    gets the first answer. The same key with another body is a client's bug: 409, nothing changes."""
    exp_id, _ = _call(ex)
    body = {"msg_ids": [exp_id], "reward": 0.0, "hint": HINT, "correction": CALL}
    first = ex.http.post("/feedback", json=body, headers={"Idempotency-Key": "fb-1"})
    assert first.status_code == 200 and "replayed" not in first.json(), first.text
    for again in (ex.http.post("/feedback", json=body, headers={"Idempotency-Key": "fb-1"}),
                  ex.http.post("/feedback", json={**body, "idempotency_key": "fb-1"})):  # the body's field: the same key
        assert again.status_code == 200 and again.json() == {**first.json(), "replayed": True}, again.text
    demos = ex.http.get("/experiences", params={"status": "committed"}).json()["data"]
    assert [d["experience_id"] for d in demos] == [first.json()["demonstration_id"]]  # one demonstration
    assert len(_get(ex, exp_id)["reward_history"]) == 1  # one reward in the ledger
    # the demonstration is as old as the call it corrects (retention purges them together)
    assert _get(ex, demos[0]["experience_id"])["created_at"] == _get(ex, exp_id)["created_at"]

    reused = ex.http.post("/feedback", json={**body, "reward": 1.0}, headers={"Idempotency-Key": "fb-1"})
    assert reused.status_code == 409 and reused.json()["error"]["code"] == "idempotency_key_reused", reused.text
    both = ex.http.post("/feedback", json={**body, "idempotency_key": "fb-2"}, headers={"Idempotency-Key": "fb-3"})
    assert both.status_code == 400 and both.json()["error"]["param"] == "idempotency_key", both.text
    assert _get(ex, exp_id)["reward"] == 0.0 and len(_get(ex, exp_id)["reward_history"]) == 1
