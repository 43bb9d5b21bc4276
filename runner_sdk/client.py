"""HTTP clients of the Explorer, async and sync (same method names as its routes), and the call tracking.

Calls to ``/chat/completions`` made while an ``AgentRun`` is current carry its task and run ids
(``X-Task-Id`` / ``X-Run-Id``) and have the completion id the Explorer returns collected into
``run.msg_ids``, whether the response is plain JSON or an SSE stream and whichever client made the
call (this SDK's ``AgentClient``, or the official ``openai`` client built on ``tracked_http_client``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterator

import httpx

from runner_sdk.context import current_run
from runner_sdk.records import AgentRun

_COMPLETION_ID = re.compile(rb'"id"\s*:\s*"(chatcmpl-[^"]+)"')
_SNIFF_BYTES = 8192


class ExplorerError(RuntimeError):
    """The Explorer answered with an error (OpenAI shape)."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message
        self.code = code

    @property
    def retryable(self) -> bool:
        return self.status in (408, 425, 429) or self.status >= 500


def _track(request: httpx.Request) -> AgentRun | None:
    run = current_run()
    if run is None or not run.selected or not request.url.path.endswith("/chat/completions"):
        return None
    request.headers["X-Task-Id"] = run.task_id
    request.headers["X-Run-Id"] = run.run_id
    if run.explore:
        request.headers["X-Explore"] = "true"
    return run


class _Sniffer:
    """Looks for the completion id in the first bytes of a response while passing them on."""

    def __init__(self, run: AgentRun):
        self.run = run
        self.head = b""
        self.done = False

    def feed(self, chunk: bytes) -> None:
        if self.done:
            return
        self.head += chunk
        m = _COMPLETION_ID.search(self.head)
        if m:
            cid = m.group(1).decode()
            if cid not in self.run.msg_ids:
                self.run.msg_ids.append(cid)
            self.done = True
        elif len(self.head) > _SNIFF_BYTES:
            self.done = True


class _AsyncStream(httpx.AsyncByteStream):
    def __init__(self, inner: httpx.AsyncByteStream, sniffer: _Sniffer):
        self.inner, self.sniffer = inner, sniffer

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.inner:
            self.sniffer.feed(chunk)
            yield chunk

    async def aclose(self) -> None:
        await self.inner.aclose()


class _SyncStream(httpx.SyncByteStream):
    def __init__(self, inner: httpx.SyncByteStream, sniffer: _Sniffer):
        self.inner, self.sniffer = inner, sniffer

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.inner:
            self.sniffer.feed(chunk)
            yield chunk

    def close(self) -> None:
        self.inner.close()


class TrackingAsyncTransport(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport | None = None):
        self.inner = inner or httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        run = _track(request)
        response = await self.inner.handle_async_request(request)
        if run is None or response.status_code >= 400:
            return response
        return httpx.Response(response.status_code, headers=response.headers,
                              stream=_AsyncStream(response.stream, _Sniffer(run)), extensions=response.extensions)

    async def aclose(self) -> None:
        await self.inner.aclose()


class TrackingTransport(httpx.BaseTransport):
    def __init__(self, inner: httpx.BaseTransport | None = None):
        self.inner = inner or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        run = _track(request)
        response = self.inner.handle_request(request)
        if run is None or response.status_code >= 400:
            return response
        return httpx.Response(response.status_code, headers=response.headers,
                              stream=_SyncStream(response.stream, _Sniffer(run)), extensions=response.extensions)

    def close(self) -> None:
        self.inner.close()


def tracked_http_client(*, timeout: float = 600.0, **kwargs: Any) -> httpx.Client:
    """An httpx.Client for ``openai.OpenAI(http_client=...)`` that tags and collects calls."""
    return httpx.Client(transport=TrackingTransport(), timeout=timeout, **kwargs)


def tracked_async_http_client(*, timeout: float = 600.0, **kwargs: Any) -> httpx.AsyncClient:
    """An httpx.AsyncClient for ``openai.AsyncOpenAI(http_client=...)`` that tags and collects calls."""
    return httpx.AsyncClient(transport=TrackingAsyncTransport(), timeout=timeout, **kwargs)


@dataclass(frozen=True)
class _Call:
    """One request to the Explorer, built once for both clients, and how to read its answer."""

    method: str
    path: str
    json: dict[str, Any] | None = None
    params: dict[str, Any] | None = None
    headers: dict[str, str] | None = None
    key: str | None = None  # return only this key of the JSON answer (lists come as {"data": [...]})
    text: bool = False  # the answer is plain text (Prometheus), not JSON
    answer: Any = None  # answered here, without a request (see commit)


def _present(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if v is not None}


def _answer(call: _Call, r: httpx.Response) -> Any:
    """The one mapping from the Explorer's answer to a value or an ``ExplorerError``."""
    if r.status_code >= 400:
        try:
            err = r.json().get("error", {})
        except ValueError:
            err = {}
        raise ExplorerError(r.status_code, err.get("message") or r.text[:500], err.get("code"))
    if call.text:
        return r.text
    body = r.json()
    return body[call.key] if call.key else body


class _ExplorerRoutes:
    """The Explorer's routes, each written once: a method builds its ``_Call`` and hands it to
    ``_send``, which ``ExplorerClient`` awaits and ``SyncExplorerClient`` runs directly. So every
    method returns a coroutine on the async client and the value itself on the sync one."""

    endpoint: str

    def _send(self, call: _Call) -> Any:
        raise NotImplementedError

    def chat_completions(self, **body: Any) -> Any:
        return self._send(_Call("POST", "/v1/chat/completions", json=body))

    def feedback(self, *, reward: float | None = None, msg_ids: list[str] | None = None, task_id: str | None = None,
                 run_id: str | None = None, labels: list[str] | None = None, comment: str | None = None,
                 source: str | None = None, agent: str | None = None, expected: Any = None, hint: str | None = None,
                 correction: dict[str, Any] | None = None, idempotency_key: str | None = None) -> Any:
        """``expected``: what the run was expected to produce, kept with the reward (a gated release
        replays held-out calls and scores them with the same reward calculator). Feedback in words,
        alone or beside the reward: ``hint``, what should have been done (the agent learns it by
        self-distillation), and ``correction``, the assistant message one call (msg_ids of one id)
        should have answered (it becomes a demonstration for that call's prompt).
        ``idempotency_key``: send a retry of this feedback under the same key and it is applied once
        (the answer then says ``replayed``); sent as the Idempotency-Key header."""
        body = {"msg_ids": msg_ids, "reward": reward, "task_id": task_id, "run_id": run_id,
                "labels": labels, "comment": comment, "source": source, "agent": agent, "expected": expected,
                "hint": hint, "correction": correction}
        headers = None if idempotency_key is None else {"Idempotency-Key": idempotency_key}
        return self._send(_Call("POST", "/feedback", json=_present(body), headers=headers))

    def episode_feedback(self, *, task_id: str, run_id: str, reward: float | None = None, **extra: Any) -> Any:
        """The reward of a whole episode: it reaches every call made under task_id + run_id (a team
        reward in a multi-agent episode); ``agent=NAME`` narrows it to that agent's calls."""
        return self.feedback(reward=reward, task_id=task_id, run_id=run_id, **extra)

    def demonstrations(self, *, model: str, messages: list[dict[str, Any]], response: dict[str, Any],
                       tools: list[dict[str, Any]] | None = None, task_id: str | None = None,
                       comment: str | None = None) -> Any:
        """Store the ideal ``response`` (an assistant message, tool calls included) to ``messages``
        as a demonstration: a new agent's cold start, trained by supervised terms."""
        body = {"model": model, "messages": messages, "response": response, "tools": tools, "task_id": task_id,
                "comment": comment}
        return self._send(_Call("POST", "/demonstrations", json=_present(body)))

    def commit(self, *, task_id: str | None = None, msg_ids: list[str] | None = None) -> Any:
        if msg_ids is not None and not msg_ids:
            # Nothing named, nothing to commit. Never sent: an older Explorer reads an empty list
            # as "every rewarded row", a newer one refuses it.
            return self._send(_Call("POST", "/commit", answer={"status": "success", "committed": 0}))
        return self._send(_Call("POST", "/commit", json=_present({"task_id": task_id, "msg_ids": msg_ids})))

    def experiences(self, **filters: Any) -> Any:
        """Recorded experiences (a list), filtered as ``GET /experiences`` filters them."""
        return self._send(_Call("GET", "/experiences", params=_present(filters), key="data"))

    def models(self) -> Any:
        """The served agents (a list), each with the version it serves."""
        return self._send(_Call("GET", "/v1/models", key="data"))

    def versions(self, *, agent: str) -> Any:
        """An agent's published versions (a list) with their release decisions."""
        return self._send(_Call("GET", "/versions", params={"agent": agent}, key="data"))

    def health(self) -> Any:
        return self._send(_Call("GET", "/health"))

    def metrics(self) -> Any:
        """The Explorer's Prometheus metrics, as text."""
        return self._send(_Call("GET", "/metrics", text=True))


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class ExplorerClient(_ExplorerRoutes):
    """Async client of the Explorer's API; method names mirror its routes (``await client.feedback(...)``)."""

    def __init__(self, endpoint: str, *, api_key: str | None = None, timeout: float = 30.0):
        self.endpoint = endpoint.rstrip("/")
        self._http = httpx.AsyncClient(base_url=self.endpoint, headers=_headers(api_key), timeout=timeout,
                                       transport=TrackingAsyncTransport())

    async def _send(self, call: _Call) -> Any:
        if call.answer is not None:
            return call.answer
        return _answer(call, await self._http.request(call.method, call.path, json=call.json, params=call.params,
                                          headers=call.headers))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "ExplorerClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class SyncExplorerClient(_ExplorerRoutes):
    """The same client for synchronous code: the same methods, answering directly (``client.feedback(...)``)."""

    def __init__(self, endpoint: str, *, api_key: str | None = None, timeout: float = 30.0):
        self.endpoint = endpoint.rstrip("/")
        self._http = httpx.Client(base_url=self.endpoint, headers=_headers(api_key), timeout=timeout,
                                  transport=TrackingTransport())

    def _send(self, call: _Call) -> Any:
        if call.answer is not None:
            return call.answer
        return _answer(call, self._http.request(call.method, call.path, json=call.json, params=call.params,
                                          headers=call.headers))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "SyncExplorerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass
class ChatReply:
    id: str
    content: str | None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    raw: dict[str, Any] = field(default_factory=dict)


class AgentClient:
    """What an agent function gets in shadow and environment runs: chat with the trainable model."""

    def __init__(self, explorer: ExplorerClient, model: str, api_key: str | None = None):
        self.explorer = explorer
        self.model = model
        self._api_key = api_key

    async def chat(self, messages: list[dict[str, Any]] | str, **params: Any) -> ChatReply:
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        raw = await self.explorer.chat_completions(model=self.model, messages=messages, **params)
        msg = raw["choices"][0]["message"]
        return ChatReply(id=raw["id"], content=msg.get("content"), tool_calls=msg.get("tool_calls") or [], raw=raw)

    async def complete(self, messages: list[dict[str, Any]] | str, **params: Any) -> str:
        return (await self.chat(messages, **params)).content or ""

    def as_agent(self, model: str) -> "AgentClient":
        """The same client for another agent (its own adapter on the same base): in a multi-agent
        episode, every agent's calls join the episode and its reward."""
        return AgentClient(self.explorer, model, self._api_key)

    def openai(self):
        """An ``openai.AsyncOpenAI`` on the Explorer whose calls are tracked (needs the openai package)."""
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.explorer.endpoint}/v1", api_key=self._api_key or "none",
                                  http_client=tracked_async_http_client())
