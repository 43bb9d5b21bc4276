"""ChatService on a hand-written engine: responses built once for plain and streaming answers,
records token for token, tool calls, and a client that goes away aborts its generation."""

from __future__ import annotations

import asyncio
import json

import pytest

from services.common.config import load_config
from services.common.http.errors import APIError
from services.explorer.config import ExplorerConfig
from services.explorer.edge.metrics import ExplorerMetrics
from services.explorer.protocol import ChatCompletionRequest
from services.explorer.serving.adapters import AdapterRegistry
from services.explorer.serving.chat import ChatService
from tests.unit.explorer.fakes import FakeEngine


class ListRecorder:
    def __init__(self):
        self.records = []

    def has_capacity(self, n: int = 1) -> bool:
        return True

    def record(self, records):
        self.records += records


def _service(tmp_path, engine: FakeEngine) -> tuple[ChatService, ListRecorder]:
    config = load_config(ExplorerConfig, None, [f"model.path={tmp_path}/model", f"checkpoints.root={tmp_path}/ck"], env={})
    registry = AdapterRegistry(engine=engine, checkpoints_root=str(tmp_path / "ck"), base_name="model", agents=[],
                               default_agent="default")
    recorder = ListRecorder()
    return ChatService(config=config, engine=engine, registry=registry, recorder=recorder, metrics=ExplorerMetrics()), recorder


def _request(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "default", "messages": [{"role": "user", "content": "hi"}], **kw})


async def _started(service: ChatService) -> ChatService:
    await service.registry.start()
    return service


def test_plain_answer_matches_the_openai_shape_and_is_recorded_token_for_token(tmp_path):
    service, recorder = _service(tmp_path, FakeEngine(replies=["yes", "no!"]))

    async def go():
        await _started(service)
        p = service.prepare(_request(n=2, max_tokens=3, return_token_ids=True, metadata={"task_id": "t", "run_id": 7}), {})
        return p, await service.complete(p)

    p, answer = asyncio.run(go())
    body = json.loads(answer.model_dump_json())
    assert body["object"] == "chat.completion" and body["system_fingerprint"] == "kaizen-default-v0"
    assert [c["message"] for c in body["choices"]] == [{"role": "assistant", "content": "yes"},
                                                       {"role": "assistant", "content": "no!"}]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "length"]
    assert body["usage"] == {"prompt_tokens": len(p.prompt_ids), "completion_tokens": 6, "total_tokens": len(p.prompt_ids) + 6}
    assert body["prompt_token_ids"] == p.prompt_ids == [ord(c) for c in "user: hi\nassistant:"]
    assert "tool_calls" not in body["choices"][0]["message"] and body["choices"][0]["logprobs"] is None
    rec = {r.experience_id: r for r in recorder.records}
    for c in body["choices"]:
        r = rec[c["experience_id"]]
        assert r.response_token_ids == c["token_ids"] and r.response_logprobs == [-0.5] * 3
        assert (r.task_id, r.run_id, r.completion_id, r.response) == ("t", "7", body["id"], c["message"])


def test_streamed_answer_carries_the_same_records_and_one_entry_per_choice_per_chunk(tmp_path):
    service, recorder = _service(tmp_path, FakeEngine(replies=["abc"]))

    async def go():
        await _started(service)
        p = service.prepare(_request(stream=True, stream_options={"include_usage": True}, max_tokens=10), {})
        return [c async for c in await service.stream(p)]

    raw = asyncio.run(go())
    assert raw[-1] == b"data: [DONE]\n\n"
    chunks = [json.loads(c[len(b"data: "):]) for c in raw[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"])
    assert text == "abc"
    for ch in chunks:
        indexes = [c["index"] for c in ch["choices"]]
        assert len(indexes) == len(set(indexes))
    last = [ch for ch in chunks if ch["choices"]][-1]["choices"][0]
    assert last["finish_reason"] == "stop" and last["delta"] == {"content": "c"}
    assert chunks[-1]["usage"]["completion_tokens"] == 3 and chunks[-1]["choices"] == []
    assert recorder.records[0].response == {"role": "assistant", "content": "abc"}


def test_a_hermes_tool_call_comes_back_as_tool_calls(tmp_path):
    call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    service, recorder = _service(tmp_path, FakeEngine(replies=[call]))
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]

    async def go():
        await _started(service)
        return await service.complete(service.prepare(_request(tools=tools), {}))

    choice = asyncio.run(go()).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls[0].function.name == "add"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"a": 1}
    assert recorder.records[0].response["tool_calls"][0]["function"]["name"] == "add"


def test_a_client_that_goes_away_aborts_its_generation_and_nothing_is_recorded(tmp_path):
    engine = FakeEngine(replies=["x" * 500], seconds_per_token=0.01)
    service, recorder = _service(tmp_path, engine)

    async def go():
        await _started(service)
        p = service.prepare(_request(max_tokens=500), {})

        async def receive():
            await asyncio.sleep(0.1)
            return {"type": "http.disconnect"}

        with pytest.raises(APIError) as e:
            await asyncio.wait_for(service.complete(p, receive=receive), 3)  # 500 tokens would take 5 s
        return e.value

    err = asyncio.run(go())
    assert err.code == "client_closed"
    assert engine.aborted == {engine.requests[0].request_id}
    assert recorder.records == []


def test_a_stream_whose_client_left_before_its_first_byte_lets_go_of_its_lease_and_its_reserved_tokens(tmp_path):
    from services.common.http.access import Principal, Quotas
    from services.explorer.api.streaming import EndingStream

    service, _ = _service(tmp_path, FakeEngine(replies=["abc"]))
    service.quotas = Quotas()
    key = Principal(name="k", scopes=frozenset({"chat"}), tokens_per_min=1000)

    async def send(message):
        raise OSError("the client went away")  # before http.response.start could be sent

    async def receive():
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def go():
        await _started(service)
        p = await service.admit(service.prepare(_request(stream=True, max_tokens=10), {}), key)
        held = service.quotas._tokens["k"].held
        response = EndingStream(await service.stream(p), p, service)
        handle = p.lease
        assert handle.leases == 1 and held == len(p.prompt_ids) + 10
        from starlette.requests import ClientDisconnect

        with pytest.raises(ClientDisconnect):  # Starlette's answer to the OSError (ASGI 2.4)
            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        return handle, p

    handle, p = asyncio.run(go())
    assert handle.leases == 0 and p.lease is None and p.reserved_tokens == 0
    bucket = service.quotas._tokens["k"]
    assert bucket.held == 0 and bucket.level == 1000 - len(p.prompt_ids)  # the prompt was read; nothing generated
