"""The Explorer through the official openai client: what comes back and what gets recorded."""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
import torch

pytestmark = pytest.mark.integration

USER = [{"role": "user", "content": "Is 17 even or odd?"}]


@pytest.fixture(scope="module")
def reference_model(tiny_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def teacher_forced_logprobs(model, prompt_ids, response_ids, temperature):
    """log softmax(logits / T) of each response token given everything before it: one forward."""
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float()
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / t, dim=-1)
    return lp.gather(-1, torch.tensor(response_ids).unsqueeze(-1)).squeeze(-1)


def recorded(explorer, experience_id):
    r = explorer.http.get(f"/experiences/{experience_id}")
    assert r.status_code == 200, r.text
    return r.json()


def test_plain_completion_records_exact_tokens(explorer, reference_model):
    resp = explorer.client.chat.completions.create(
        model="default", messages=USER, max_tokens=24, temperature=0.7, seed=3,
        extra_body={"return_token_ids": True, "metadata": {"task_id": "task-1", "run_id": "0"}},
    )
    choice = resp.choices[0]
    exp = recorded(explorer, choice.model_extra["experience_id"])
    tok = explorer.tokenizer
    # The prompt is exactly the chat template's rendering, and the ids returned are the ids recorded.
    rendered = tok.apply_chat_template(USER, add_generation_prompt=True, tokenize=False)
    assert exp["prompt_token_ids"] == tok.encode(rendered, add_special_tokens=False)
    assert exp["prompt_token_ids"] == resp.model_extra["prompt_token_ids"]
    assert exp["response_token_ids"] == choice.model_extra["token_ids"]
    # Token ids decode to the returned text; one logprob per token.
    assert tok.decode(exp["response_token_ids"], skip_special_tokens=True) == choice.message.content
    assert len(exp["response_logprobs"]) == len(exp["response_token_ids"]) == resp.usage.completion_tokens
    # The recorded logprobs are what a fresh teacher-forced pass of the model gives.
    ref = teacher_forced_logprobs(reference_model, exp["prompt_token_ids"], exp["response_token_ids"], 0.7)
    assert torch.allclose(torch.tensor(exp["response_logprobs"]), ref, atol=1e-4)
    assert exp["task_id"] == "task-1" and exp["run_id"] == "0"
    assert exp["agent"] == "default" and exp["model_version"] == 0 and exp["status"] == "recorded"
    assert exp["sampling"]["temperature"] == 0.7 and exp["sampling"]["max_tokens"] == 24 and exp["sampling"]["seed"] == 3
    assert exp["messages"] == USER and exp["response"]["content"] == choice.message.content
    assert exp["completion_id"] == resp.id


def test_streaming_returns_what_is_recorded(explorer, reference_model):
    stream = explorer.client.chat.completions.create(
        model="default", messages=USER, max_tokens=20, stream=True, stream_options={"include_usage": True},
        logprobs=True, extra_body={"return_token_ids": True},
    )
    text, token_ids, logprobs, finish, usage, exp_id = "", [], [], None, None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            exp_id = c.model_extra["experience_id"]
            text += c.delta.content or ""
            token_ids += c.model_extra.get("token_ids") or []
            if c.logprobs and c.logprobs.content:
                logprobs += [e.logprob for e in c.logprobs.content]
            finish = c.finish_reason or finish
    exp = recorded(explorer, exp_id)
    assert text == exp["response"]["content"]
    assert explorer.tokenizer.decode(exp["response_token_ids"], skip_special_tokens=True) == text
    assert token_ids == exp["response_token_ids"]
    assert logprobs == pytest.approx(exp["response_logprobs"])
    assert usage.completion_tokens == len(token_ids) and finish in ("stop", "length")
    ref = teacher_forced_logprobs(reference_model, exp["prompt_token_ids"], exp["response_token_ids"], 1.0)
    assert torch.allclose(torch.tensor(exp["response_logprobs"]), ref, atol=1e-4)


def test_n_choices_are_separate_experiences(explorer):
    resp = explorer.client.chat.completions.create(model="default", messages=USER, max_tokens=12, n=3, temperature=1.0)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    ids = [c.model_extra["experience_id"] for c in resp.choices]
    assert len(set(ids)) == 3
    rows = explorer.http.get("/experiences", params={"completion_id": resp.id}).json()["data"]
    assert sorted(r["experience_id"] for r in rows) == sorted(ids)
    assert len({tuple(r["response_token_ids"]) for r in rows}) > 1  # sampled independently
    assert all(r["prompt_token_ids"] == rows[0]["prompt_token_ids"] for r in rows)


def test_seed_makes_sampling_reproducible(explorer):
    a = explorer.client.chat.completions.create(model="default", messages=USER, max_tokens=16, seed=11)
    b = explorer.client.chat.completions.create(model="default", messages=USER, max_tokens=16, seed=11)
    c = explorer.client.chat.completions.create(model="default", messages=USER, max_tokens=16, seed=12)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content != c.choices[0].message.content


def test_stop_sequence_cuts_the_text(explorer):
    kw = dict(model="default", messages=USER, max_tokens=30, seed=5)  # a seed makes the runs comparable
    text = explorer.client.chat.completions.create(**kw).choices[0].message.content
    at = next(i for i in range(len(text) // 3, len(text) - 2) if text[i : i + 2].strip() and text[i : i + 2].isprintable())
    stop = text[at : at + 2]
    cut = explorer.client.chat.completions.create(**kw, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[: text.find(stop)]
    # Streaming never shows the stop string either.
    stream = explorer.client.chat.completions.create(**kw, stop=stop, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == cut.choices[0].message.content


def test_max_completion_tokens_and_length_finish(explorer):
    r = explorer.client.chat.completions.create(model="default", messages=USER, max_completion_tokens=5, temperature=0)
    assert r.usage.completion_tokens <= 5
    # The tiny model's greedy answer to USER is longer than 5 tokens: it is always cut.
    assert r.usage.completion_tokens == 5
    assert r.choices[0].finish_reason == "length"


def test_concurrent_requests_are_batched(explorer):
    steps_before = explorer.state.engine.steps

    def one(i):
        return explorer.client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": f"count {i}"}], max_tokens=16
        )

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, range(16)))
    tokens = sum(r.usage.completion_tokens for r in results)
    steps = explorer.state.engine.steps - steps_before
    # One request at a time would need a step per token; batching shares steps between requests.
    assert steps < tokens / 2, (steps, tokens)


def test_message_roles_and_text_parts(explorer):
    messages = [
        {"role": "developer", "content": "Answer briefly."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = explorer.client.chat.completions.create(model="default", messages=messages, max_tokens=8)
    exp = recorded(explorer, r.choices[0].model_extra["experience_id"])
    prompt = explorer.tokenizer.decode(exp["prompt_token_ids"])
    assert "Answer briefly." in prompt and "Weather in Paris?" in prompt
    assert '"name": "get_weather"' in prompt and "<tool_response>\nsunny\n</tool_response>" in prompt


def test_models_lists_base_and_agents(make_explorer):
    ex = make_explorer("agents.names=[default, helper]")
    ids = [m.id for m in ex.client.models.list()]
    assert ids[0] == ex.state.registry.base_name and {"default", "helper"} <= set(ids)
    data = ex.http.get("/v1/models").json()["data"]
    assert next(m for m in data if m["id"] == "helper")["version"] == 0
    # The base model name means the default agent (Trinity clients send the model path).
    r = ex.client.chat.completions.create(model=ex.state.config.model.path, messages=USER, max_tokens=4)
    assert recorded(ex, r.choices[0].model_extra["experience_id"])["agent"] == "default"
    # One model by id (the official client's models.retrieve), also a path-like base name.
    assert ex.client.models.retrieve("helper").model_extra["version"] == 0
    assert ex.http.get(f"/v1/models/{ex.state.registry.base_name}").json()["parent"] is None
    with pytest.raises(openai.NotFoundError, match="ghost"):
        ex.client.models.retrieve("ghost")


def test_health_and_metrics(explorer):
    explorer.client.chat.completions.create(model="default", messages=USER, max_tokens=4)
    assert explorer.http.get("/health").json()["status"] == "ok"
    text = explorer.http.get("/metrics").text
    assert 'kaizen_requests_total{route="/v1/chat/completions",status="200"} 1.0' in text
    assert "kaizen_completion_tokens_total" in text and "kaizen_request_latency_seconds_bucket" in text
    busy = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("kaizen_engine_busy_seconds{")}
    assert set(busy) == {"prefill", "decode", "sample"} and all(v > 0 for v in busy.values()), busy  # a call of 4 tokens
    # JSON for clients that ask for it (Trinity-RFT's ProxyClient.get_metrics reads these keys).
    for kw in ({"headers": {"Accept": "application/json"}}, {"params": {"format": "json"}}):
        body = explorer.http.get("/metrics", **kw).json()
        assert body["rollout/total_request_count"] == 1.0 and body["rollout/model_0/model_version"] == 0
        assert body["metrics"]['kaizen_completions_total{agent=default}'] == 1.0
    scrape = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
    assert explorer.http.get("/metrics", headers={"Accept": scrape}).text.startswith("# HELP")


def test_a_client_that_disconnects_aborts_its_generation(explorer):
    """The engine stops generating for a client that went away (nothing is recorded: nobody got an
    answer); a request that finished naturally would have been recorded."""
    import time

    import httpx

    body = {"model": "default", "messages": [{"role": "user", "content": "go on forever"}], "max_tokens": 1900,
            "temperature": 1.0, "metadata": {"task_id": "gone"}}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{explorer.url}/v1/chat/completions", json=body, timeout=0.3)
    deadline = time.monotonic() + 60
    while explorer.http.get("/health").json()["engine"]["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert explorer.http.get("/health").json()["engine"]["running"] == 0
    assert explorer.http.get("/experiences", params={"task_id": "gone"}).json()["data"] == []


def test_exploration_runs_sample_at_the_agents_exploration_temperature(make_explorer, reference_model):
    ex = make_explorer("agents.exploration_temperature.default=1.5")

    def chat(**extra):
        resp = ex.client.chat.completions.create(model="default", messages=USER, max_tokens=8, temperature=0.7, **extra)
        return recorded(ex, resp.choices[0].model_extra["experience_id"])

    # marked as exploration (metadata, or the header the runner SDK's shadow runs send): the agent's temperature,
    # recorded with logprobs at the temperature actually sampled
    for exp in (chat(extra_body={"metadata": {"explore": True}}), chat(extra_headers={"X-Explore": "true"})):
        assert exp["sampling"]["temperature"] == 1.5
        ref = teacher_forced_logprobs(reference_model, exp["prompt_token_ids"], exp["response_token_ids"], 1.5)
        assert torch.allclose(torch.tensor(exp["response_logprobs"]), ref, atol=1e-4)
    assert chat()["sampling"]["temperature"] == 0.7  # a user's call: what the client asked
    other = make_explorer()  # an agent without an exploration temperature: the client's, flag or not
    resp = other.client.chat.completions.create(model="default", messages=USER, max_tokens=4, temperature=0.7,
                                                extra_body={"metadata": {"explore": True}})
    assert recorded(other, resp.choices[0].model_extra["experience_id"])["sampling"]["temperature"] == 0.7
    r = ex.http.post("/v1/chat/completions", json={"model": "default", "messages": USER, "metadata": {"explore": "maybe"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "metadata.explore", r.text
