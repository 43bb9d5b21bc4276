"""The Explorer's edge under requests a fuzzer or a careless client sends, on a real server: each
gets a 4xx naming the problem (never a 500), limits hold (size, stalls, concurrency, stored bytes),
a 500 keeps the connection and names no internals, and nothing leaks a server path."""

from __future__ import annotations

import re
import socket
import time

import httpx
import pytest

pytestmark = pytest.mark.integration

HI = [{"role": "user", "content": "hi"}]


def _error(r, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def _local_port(r: httpx.Response) -> int:
    return r.extensions["network_stream"].get_extra_info("socket").getsockname()[1]


def test_fuzzer_findings_are_4xx(explorer):
    """n above what the engine batches (plain and streamed), an offset past the databases'
    integers, a huge stop sequence, a prompt longer than any context: 400s naming the field."""
    http = explorer.http
    limit = explorer.state.engine.max_batch_size
    for stream in (False, True):
        r = http.post("/v1/chat/completions", json={"model": "default", "messages": HI, "n": limit + 1,
                                                    "max_tokens": 2, "stream": stream})
        assert str(limit) in _error(r, 400, "n", "invalid_value")["message"]
    assert http.post("/v1/chat/completions", json={"model": "default", "messages": HI, "n": limit,
                                                   "max_tokens": 1}).status_code == 200
    _error(http.get("/experiences", params={"offset": 2**63}), 400, "query.offset")
    r = http.get("/experiences", params={"offset": 2**63 - 1})
    assert r.status_code == 200 and r.json()["data"] == []
    r = http.post("/v1/chat/completions", json={"model": "default", "messages": HI, "stop": ["x" * 1001]})
    _error(r, 400, "stop")
    r = http.post("/v1/messages", json={"model": "default", "messages": HI, "max_tokens": 2,
                                        "stop_sequences": ["x" * 1001]})
    assert r.status_code == 400, r.text
    chars = 16 * explorer.state.engine.max_model_len + 1  # the default limit: 16 characters per token of context
    r = http.post("/v1/chat/completions", json={"model": "default", "messages": [{"role": "user", "content": "a" * chars}]})
    assert f"{chars:,}" in _error(r, 400, "messages", "context_length_exceeded")["message"]
    r = http.post("/v1/completions", json={"model": "default", "prompt": "a" * chars, "max_tokens": 1})
    _error(r, 400, "prompt", "context_length_exceeded")
    # The server took all of that in its stride.
    assert http.post("/v1/chat/completions", json={"model": "default", "messages": HI, "max_tokens": 2}).status_code == 200


def test_a_request_may_not_multiply_storage(make_explorer):
    ex = make_explorer("server.max_stored_bytes=20000")
    prompt = [{"role": "user", "content": "word " * 1000}]  # 5,000 characters
    r = ex.http.post("/v1/chat/completions", json={"model": "default", "messages": prompt, "n": 5, "max_tokens": 1})
    assert "20,000" in _error(r, 400, "n", "request_too_large")["message"]
    r = ex.http.post("/v1/chat/completions", json={"model": "default", "messages": prompt, "n": 3, "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_unexpected_error_is_a_500_with_an_id_that_keeps_the_connection(explorer, caplog):
    chat = explorer.state.chat
    real = chat._message
    chat._message = lambda *a, **k: (_ for _ in ()).throw(ValueError("boom in /srv/secret/file.py"))
    try:
        with httpx.Client(base_url=explorer.url, timeout=60) as http:
            first = http.get("/health")
            r = http.post("/v1/chat/completions", json={"model": "default", "messages": HI, "max_tokens": 2})
            err = _error(r, 500, None, "internal_error")
            assert "/srv" not in r.text and "boom" not in r.text and "error id " in err["message"]
            after = http.get("/health")
            assert _local_port(first) == _local_port(r) == _local_port(after)  # the same keep-alive connection
    finally:
        chat._message = real
    error_id = err["message"].split("error id ")[1].rstrip(")")
    assert any(error_id in rec.getMessage() and "boom" in str(rec.exc_info) for rec in caplog.records)
    metrics = explorer.http.get("/metrics").text
    assert 'kaizen_requests_total{route="/v1/chat/completions",status="500"} 1.0' in metrics


def test_nothing_names_a_server_path(make_explorer):
    ex = make_explorer("auth.api_keys=[k]", api_key="k")
    model_path = str(ex.state.config.model.path)
    r = ex.http.post("/v1/chat/completions", json={"model": "default@v7", "messages": HI, "max_tokens": 2})
    _error(r, 404, "model", "model_not_found")
    for r in (r, ex.http.get("/v1/models"), ex.http.get("/v1/models/default")):
        assert model_path not in r.text and str(ex.root) not in r.text, r.text
    assert httpx.get(f"{ex.url}/openapi.json").status_code == 401
    schema = ex.http.get("/openapi.json")
    assert schema.status_code == 200 and "/v1/chat/completions" in schema.json()["paths"]


def _stalled_upload(url: str, *, sent: int = 10, declared: int = 100) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(f"POST /feedback HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {declared}\r\n\r\n".encode() + b"{" * sent)
    return s


def _read_status(s: socket.socket, timeout: float) -> tuple[int, bytes, float]:
    """(status, the response as read: headers and the whole body its content-length declares, seconds
    until the headers came). The body may arrive in a later packet than the headers."""
    t0 = time.monotonic()
    s.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(4096)
        if not chunk:
            break
        data += chunk
    waited = time.monotonic() - t0
    head, _, body = data.partition(b"\r\n\r\n")
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    while length and len(body) < int(length.group(1)):
        chunk = s.recv(4096)
        if not chunk:
            break
        body += chunk
    return int(data.split(b" ", 2)[1]), head + b"\r\n\r\n" + body, waited


def test_a_stalled_upload_gets_408_and_the_concurrency_limit_503(make_explorer):
    ex = make_explorer("server.body_timeout_s=1.5", "server.max_concurrent_requests=1")
    stalled = _stalled_upload(ex.url)
    try:
        time.sleep(0.3)  # it holds the only slot now
        r = ex.http.get("/v1/models")
        _error(r, 503, None, "overloaded")
        assert r.headers["retry-after"] == "1"
        assert ex.http.get("/health").status_code == 200  # probes are never limited
        status, raw, waited = _read_status(stalled, timeout=30)
        assert status == 408 and b"body_timeout" in raw and waited < 10, raw
    finally:
        stalled.close()
    assert ex.http.get("/v1/models").status_code == 200  # the slot is free again
    trickle = _stalled_upload(ex.url, sent=1, declared=100)  # one byte every 0.5 s: never 1.5 s apart, still a 408
    try:
        t0 = time.monotonic()
        for _ in range(10):
            time.sleep(0.5)
            trickle.sendall(b" ")
            if time.monotonic() - t0 > 2.5:
                break
        status, raw, _ = _read_status(trickle, timeout=30)
        assert status == 408, raw
    except (BrokenPipeError, ConnectionResetError):
        pass  # answered 408 and closed while we were still sending
    finally:
        trickle.close()
    metrics = ex.http.get("/metrics").text
    assert 'kaizen_requests_total{route="/feedback",status="408"} 2.0' in metrics
    assert 'kaizen_requests_total{route="/v1/models",status="503"} 1.0' in metrics
