"""Legacy text completions (POST /v1/completions) through the openai client on a real Explorer:
the prompt is used as it is (no chat template), the answer is recorded token for token with its
prompt, logprobs come in the legacy shape, streaming works, and what it cannot do is a 400."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.integration


def test_a_text_completion_uses_the_prompt_as_it_is_and_is_recorded(explorer):
    prompt = "The number 17 is"
    r = explorer.client.completions.create(model="default", prompt=prompt, max_tokens=5, logprobs=2, n=2, seed=1,
                                           extra_body={"metadata": {"task_id": "legacy"}, "return_token_ids": True})
    assert r.object == "text_completion" and len(r.choices) == 2
    ids = explorer.tokenizer.encode(prompt, add_special_tokens=False)
    for c in r.choices:
        rec = explorer.http.get(f"/experiences/{c.model_extra['experience_id']}").json()
        assert rec["prompt_token_ids"] == ids and rec["messages"] == [{"role": "prompt", "content": prompt}]
        assert rec["task_id"] == "legacy" and c.model_extra["token_ids"] == rec["response_token_ids"]
        assert explorer.tokenizer.decode(rec["response_token_ids"], skip_special_tokens=True) == c.text
        assert c.logprobs.token_logprobs == rec["response_logprobs"] and all(len(t) <= 2 for t in c.logprobs.top_logprobs)
        assert "".join(c.logprobs.tokens) == c.text or c.finish_reason == "stop"
    # token ids as the prompt give the same prompt
    again = explorer.client.completions.create(model="default", prompt=ids, max_tokens=2, extra_body={"return_token_ids": True})
    assert again.model_extra["prompt_token_ids"] == ids
    assert explorer.http.post("/feedback", json={"msg_ids": [r.id], "reward": 1.0}).json()["updated"] == 2


def test_a_streamed_text_completion(explorer):
    chunks = list(explorer.client.completions.create(model="default", prompt="Once", max_tokens=6, stream=True,
                                                     stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    rec = explorer.http.get(f"/experiences/{chunks[0].choices[0].model_extra['experience_id']}").json()
    assert text == explorer.tokenizer.decode(rec["response_token_ids"], skip_special_tokens=True)
    assert chunks[-1].usage.completion_tokens == len(rec["response_token_ids"])


@pytest.mark.parametrize("kw, param", [
    ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": "a", "echo": True}, "echo"), ({"prompt": "a", "suffix": "z"}, "suffix"),
    ({"prompt": "a", "best_of": 2}, "best_of"), ({"prompt": ""}, "prompt"), ({"prompt": [10**9]}, "prompt"),
    ({"prompt": "a", "stop": [str(i) for i in range(17)]}, "stop"),  # checked as a chat request
])
def test_what_it_cannot_do_is_a_400(explorer, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        explorer.client.completions.create(model="default", max_tokens=2, **kw)
    assert e.value.body["param"] == param
