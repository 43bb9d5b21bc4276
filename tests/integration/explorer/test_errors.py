"""Bad input gets a clear 4xx in OpenAI's error shape, engine failures a 5xx, and the server stays up."""

from __future__ import annotations

import openai
import pytest

pytestmark = pytest.mark.integration

OK = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def _assert_openai_error(r, status, param=None, needle=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param
    if needle is not None:
        assert needle in err["message"], err["message"]
    return err


@pytest.mark.parametrize(
    "patch, param, needle",
    [
        ({"messages": []}, "messages", "at least 1"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role", "system"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content", None),
        ({"messages": [{"role": "user"}]}, "messages.0.content", "no content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages.0.content.0.type", "image_url"),
        ({"temperature": "hot"}, "temperature", None),
        ({"temperature": 3.5}, "temperature", None),
        ({"max_tokens": 0}, "max_tokens", None),
        ({"max_tokens": "10"}, "max_tokens", None),
        ({"n": 0}, "n", None),
        ({"max_tokens": 100_000}, "max_tokens", "maximum context length"),
        ({"top_logprobs": 2}, "top_logprobs", "requires logprobs"),
        ({"frequency_penalty": 0.5}, "frequency_penalty", "not supported"),
        ({"tool_choice": "required"}, "tool_choice", "requires tools"),
        ({"model": "no-such-agent"}, "model", "does not exist"),
        ({"model": "default@v7"}, "model", "does not exist"),
    ],
)
def test_bad_chat_requests(explorer, patch, param, needle):
    body = {**OK, **patch}
    r = explorer.http.post("/v1/chat/completions", json=body)
    err = _assert_openai_error(r, 404 if param == "model" else 400, param, needle)
    assert err["type"] in ("invalid_request_error", "not_found_error")


def test_missing_field_and_malformed_json(explorer):
    _assert_openai_error(explorer.http.post("/v1/chat/completions", json={"messages": OK["messages"]}), 400, "model", "missing")
    r = explorer.http.post("/v1/chat/completions", content=b'{"model": "default", "messages": [', headers={"content-type": "application/json"})
    _assert_openai_error(r, 400, None, "not valid JSON")
    r = explorer.http.post("/v1/chat/completions", content=b"model=default")
    _assert_openai_error(r, 400, None, "JSON object")
    _assert_openai_error(explorer.http.post("/v1/chat/completions", json=[1, 2]), 400)
    # and the server is still fine
    assert explorer.http.post("/v1/chat/completions", json=OK).status_code == 200


def test_body_over_the_limit_is_413(make_explorer):
    ex = make_explorer("server.max_body_bytes=2048")
    big = {**OK, "messages": [{"role": "user", "content": "x" * 5000}]}
    _assert_openai_error(ex.http.post("/v1/chat/completions", json=big), 413, None, "2048 bytes")

    def chunks():  # no Content-Length: the limit is enforced while reading
        yield b'{"model": "default", "messages": [{"role": "user", "content": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}]}'

    r = ex.http.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
    _assert_openai_error(r, 413)
    assert ex.http.post("/v1/chat/completions", json=OK).status_code == 200


def test_openai_client_raises_typed_errors(explorer):
    with pytest.raises(openai.NotFoundError):
        explorer.client.chat.completions.create(model="nobody", messages=OK["messages"])
    with pytest.raises(openai.BadRequestError) as e:
        explorer.client.chat.completions.create(model="default", messages=OK["messages"], max_tokens=10**6)
    assert e.value.code == "context_length_exceeded"


def test_unknown_endpoint_is_openai_shaped(explorer):
    _assert_openai_error(explorer.http.get("/v1/nope"), 404)
    _assert_openai_error(explorer.http.get("/feedback"), 405)


def test_api_keys(make_explorer):
    ex = make_explorer("auth.api_keys=[k-one, k-two]", api_key="k-two")
    assert ex.client.chat.completions.create(model="default", messages=OK["messages"], max_tokens=2).choices
    bad = openai.OpenAI(base_url=f"{ex.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="default", messages=OK["messages"])
    import httpx

    anon = httpx.Client(base_url=ex.url)
    for method, path in [("post", "/v1/chat/completions"), ("post", "/feedback"), ("post", "/commit"),
                         ("get", "/experiences"), ("get", "/v1/models"), ("get", "/metrics")]:
        _assert_openai_error(getattr(anon, method)(path), 401)
    assert anon.get("/health").status_code == 200
    _assert_openai_error(anon.get("/v1/models", headers={"Authorization": "Basic k-one"}), 401)
    assert anon.get("/v1/models", headers={"Authorization": "Bearer k-one"}).status_code == 200


def test_engine_failure_is_a_500_not_a_hang(explorer, caplog):
    """The client gets an error id, the log the details (a 500 names no internals)."""
    engine = explorer.state.engine
    real_forward = engine._forward
    engine._forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("simulated device fault at /secret/path"))
    try:
        r = explorer.http.post("/v1/chat/completions", json=OK)
        err = _assert_openai_error(r, 500, None, "error id ")
        assert err["type"] == "server_error" and "/secret" not in r.text and "device fault" not in r.text
        error_id = err["message"].split("error id ")[1].rstrip(")")
        assert any(error_id in rec.getMessage() and "device fault" in rec.getMessage() for rec in caplog.records)
        s = explorer.http.post("/v1/chat/completions", json={**OK, "stream": True})
        assert s.status_code == 200 and "error id " in s.text and "/secret" not in s.text
        assert s.text.rstrip().endswith("data: [DONE]")
    finally:
        engine._forward = real_forward
    assert explorer.http.post("/v1/chat/completions", json=OK).status_code == 200  # the engine lives on
