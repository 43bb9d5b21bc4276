"""The Explorer's outermost layer (pure ASGI): what every request passes before any route.

It gives each request its id (the client's ``X-Request-Id`` when it is a plain token of at most
64 characters, else a new one), returned in ``X-Request-Id``, on every log line of the request and
stored with its experiences. It refuses bodies over the size limit (413) or that stall (408),
requests over the concurrency limit (503 with Retry-After), turns an unexpected exception into a
500 that names an error id but no internals (and keeps the connection open), and counts every
answer by route and status in ``kaizen_requests_total``. It notes the address the Explorer is
reached at (``ServedAddress``), where the release gate calls it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import secrets
import sys

from services.common.http.errors import error_body, logged_error
from services.common.logging import request_id
from services.explorer.config import ServerSection
from services.explorer.edge.metrics import ExplorerMetrics

log = logging.getLogger(__name__)

ROUTES = ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/completions", "/feedback", "/commit",
          "/demonstrations", "/experiences", "/v1/models", "/versions", "/admin", "/health", "/metrics",
          "/openapi.json")
_UNLIMITED = ("/health", "/metrics")  # probes must answer while the server is saturated
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,64}$")


class ServedAddress:
    """Where this Explorer is reached: ``server.self_url`` when set, else the socket its first
    request came in on (the middleware notes it), else loopback on ``server.port``."""

    def __init__(self, server: ServerSection):
        self._server = server
        self.seen: str | None = None  # http://host:port of the first request's socket

    def note(self, scope) -> None:
        if self.seen is None and scope.get("server"):
            host, port = scope["server"][:2]
            self.seen = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"

    def self_url(self) -> str | None:
        if self._server.self_url:
            return self._server.self_url.rstrip("/")
        if self.seen:
            return self.seen
        return f"http://127.0.0.1:{self._server.port}" if self._server.port else None


class EdgeMiddleware:
    def __init__(self, app, *, max_body_bytes: int, body_timeout_s: float, max_concurrent: int,
                 metrics: ExplorerMetrics, served: ServedAddress):
        self.app = app
        self.max = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.max_concurrent = max_concurrent
        self.active = 0
        self.metrics = metrics
        self.served = served

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.served.note(scope)
        path = scope.get("path", "")
        route = next((r for r in ROUTES if path == r or path.startswith(r + "/")), "other")
        state = {"code": 500, "started": False, "answered": False}
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _REQUEST_ID.match(given) else f"req-{secrets.token_hex(8)}"
        rid_header = (b"x-request-id", rid.encode())
        token = request_id.set(rid)

        async def send_wrapper(message):
            if state["answered"]:
                return  # we answered already (413, 408); the app's own answer is dropped
            if message["type"] == "http.response.start":
                state["code"], state["started"] = message["status"], True
                message = {**message, "headers": [*message.get("headers", []), rid_header]}
            await send(message)

        async def answer(status: int, message: str, code: str, headers: dict[str, str] | None = None):
            state["answered"], state["code"] = True, status
            body = json.dumps(error_body(status, message, code=code)).encode()
            raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), rid_header,
                   *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items())]
            await send({"type": "http.response.start", "status": status, "headers": raw})
            await send({"type": "http.response.body", "body": body})

        try:
            await self._handle(scope, receive, send_wrapper, answer, state, route, path)
        finally:
            self.metrics.requests.labels(route, str(state["code"])).inc()
            request_id.reset(token)

    async def _handle(self, scope, receive, send_wrapper, answer, state, route: str, path: str) -> None:
        length = dict(scope.get("headers") or []).get(b"content-length")
        limited = route not in _UNLIMITED
        if length is not None and length.isdigit() and int(length) > self.max:
            await answer(413, f"request body is larger than the limit of {self.max} bytes", "body_too_large")
            return
        if limited and self.active >= self.max_concurrent:
            await answer(503, f"the server is handling its limit of {self.max_concurrent} requests; retry shortly",
                         "overloaded", {"Retry-After": "1"})
            return
        seen, body_done = 0, False
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s  # for the whole body, not each piece

        async def receive_wrapper():
            nonlocal seen, body_done
            if state["answered"]:
                return {"type": "http.disconnect"}
            if body_done:  # only a disconnect can come now: wait for it as long as it takes
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
            except asyncio.TimeoutError:
                if not state["started"]:
                    await answer(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                                 "body_timeout")
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if seen > self.max and not state["started"]:
                    await answer(413, f"request body is larger than the limit of {self.max} bytes", "body_too_large")
                    return {"type": "http.disconnect"}
            return message

        self.active += limited
        try:
            await self.app(scope, receive_wrapper, send_wrapper)
        except Exception:
            if state["answered"]:
                pass
            elif state["started"]:
                raise  # part of the answer is out: the connection cannot be saved
            else:
                # Caught here, not by Starlette's last-resort handler, which re-raises and so
                # closes the keep-alive connection. The log has the details; the client an id.
                what = f"unhandled error on {scope.get('method')} {path}"
                await answer(500, f"internal error ({logged_error(what, sys.exc_info()[1])})", "internal_error")
        finally:
            self.active -= limited
