"""The chat service: turns an OpenAI request into an engine call, a response and Experience records.

Routes stay thin; this is where a request, once checked and rendered into prompt token ids
(serving/prepare.py), is run on the engine under a lease of its agent's adapter version, answered
(plain or as SSE chunks), and recorded token for token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
import uuid
from datetime import datetime, timezone
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Mapping

from starlette.types import Receive

from services.common.http.access import Principal, Quotas
from services.common.http.errors import APIError, error_body, logged_error
from services.common.ids import experience_id, new_id
from services.common.records import Experience
from services.common.tool_calls import ToolCallStreamFilter, parse_cut_tool_calls, parse_tool_calls
from services.explorer.config import ExplorerConfig
from services.explorer.edge.backpressure import Backpressure
from services.explorer.edge.metrics import ExplorerMetrics
from services.explorer.protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    Delta,
    ResponseMessage,
    StreamToolCall,
    Usage,
)
from services.explorer.recording.privacy import Redactor
from services.explorer.recording.recorder import Recorder
from services.explorer.serving.adapters import AdapterHandle, AdapterRegistry, UnknownModel
from services.explorer.serving.engines.base import ChoiceUpdate, Engine, GenerateRequest
from services.explorer.serving.episodes import EpisodePins
from services.explorer.serving.prepare import PreparedChat, RequestPreparer

log = logging.getLogger(__name__)


@dataclass
class _Choice:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None

    def add(self, u: ChoiceUpdate) -> None:
        self.token_ids += u.token_ids
        self.logprobs += u.logprobs
        if u.top_logprobs:
            self.top += u.top_logprobs
        self.text += u.text
        if u.finish_reason:
            self.finish_reason = u.finish_reason


def _chunk_json(chunk: ChatCompletionChunk) -> str:
    return chunk.model_dump_json()


class ChatService:
    def __init__(
        self,
        *,
        config: ExplorerConfig,
        engine: Engine,
        registry: AdapterRegistry,
        recorder: Recorder,
        metrics: ExplorerMetrics,
        episodes: EpisodePins | None = None,
        quotas: Quotas | None = None,
        backpressure: Backpressure | None = None,
    ):
        """``episodes``: the episode pins, shared with the registry (which keeps pinned versions
        loaded) and the release controller; built from ``reload`` when not given. ``quotas``: the
        API keys' token quotas. ``backpressure``: given when ``backpressure.max_backlog`` is set."""
        self.config = config
        self.engine = engine
        self.registry = registry
        self.recorder = recorder
        self.metrics = metrics
        self.quotas = quotas
        self.redactor = Redactor(config.privacy)
        self.backpressure = backpressure
        r = config.reload
        # `is not None`, never `or`: an EpisodePins with no episode yet is falsy (it has a length)
        self.episodes = episodes if episodes is not None else EpisodePins(ttl_s=r.episode_pin_s,
                                                                          max_episodes=r.episode_pin_max)
        self.preparer = RequestPreparer(config=config, engine=engine, registry=registry, recorder=recorder,
                                        backpressure=backpressure)

    # ------------------------------------------------------------------ preparation (serving/prepare.py)

    async def admit(self, p: PreparedChat, principal: Principal) -> PreparedChat:
        """The caller may use the agent (403), and its key's token quota holds this request's
        prompt and the most it may generate (429 otherwise): reserved now, settled when it ends."""
        p = self.preparer.admit(p, principal)
        if self.quotas is not None and principal.tokens_per_min is not None:
            estimate = len(p.prompt_ids) + p.n * p.params.max_tokens
            hold = uuid.uuid4().hex
            reserving = asyncio.ensure_future(self.quotas.reserve_tokens_async(principal, estimate, hold))
            try:
                wait = await asyncio.shield(reserving)
            except asyncio.CancelledError:  # the request was cancelled while its tokens were being held
                reserving.add_done_callback(lambda f: self._let_go(f, principal, estimate, hold))
                raise
            if wait is not None:
                self.metrics.quota_refusals.labels(principal.name).inc()
                raise APIError(429, f"the token quota of API key {principal.name!r} cannot hold this request's "
                               f"{estimate} tokens (its prompt and max_tokens) now; retry in {math.ceil(wait)} s",
                               code="rate_limit_exceeded", headers={"Retry-After": str(max(1, math.ceil(wait)))})
            p.reserved_tokens, p.quota_hold = estimate, hold
        return p

    def _let_go(self, reserving: asyncio.Future, principal: Principal, estimate: int, hold: str) -> None:
        """A reservation whose request was cancelled while it was made: given back unused once made."""
        if not reserving.cancelled() and reserving.exception() is None and reserving.result() is None:
            self.quotas.settle_tokens(principal, estimate, 0, hold)

    def end(self, p: PreparedChat, choices: list[_Choice] = ()) -> None:
        """A stream's end, whatever its way: its adapter lease let go and its token reservation
        settled, each once (the stream's own ``finally``, or its response's when the client went
        away before the stream was ever started)."""
        if p.lease is not None:
            handle, p.lease = p.lease, None
            self.registry.release(handle)
        self._settle(p, list(choices))

    def _settle(self, p: PreparedChat, choices: list[_Choice]) -> None:
        """Give back what a request reserved of its key's token quota and did not use (once)."""
        if p.reserved_tokens and p.principal is not None and self.quotas is not None:
            used = len(p.prompt_ids) + sum(len(c.token_ids) for c in choices)
            self.quotas.settle_tokens(p.principal, p.reserved_tokens, used, p.quota_hold)
        p.reserved_tokens = 0

    def prepare(self, req: ChatCompletionRequest, headers: Mapping[str, str]) -> PreparedChat:
        return self.preparer.prepare(req, headers)

    def prepare_text(self, req: ChatCompletionRequest, headers: Mapping[str, str], *, prompt: str | list[int]) -> PreparedChat:
        return self.preparer.prepare_text(req, headers, prompt=prompt)

    def prepare_translated(self, body: dict[str, Any], headers: Mapping[str, str], *, id_prefix: str) -> PreparedChat:
        return self.preparer.prepare_translated(body, headers, id_prefix=id_prefix)

    chat_request = staticmethod(RequestPreparer.chat_request)

    async def _acquire(self, p: PreparedChat) -> AdapterHandle:
        """The handle of the version that serves this request: the agent's current one, or the
        one its episode started on (see services/explorer/serving/episodes.py)."""
        agent = self.registry.agent_of(p.model)
        pinning = self.episodes.enabled and p.episode_pin and agent is not None and p.task_id is not None \
            and p.run_id is not None
        gone = False
        if pinning:
            version, first_at = self.episodes.get(agent, p.task_id, p.run_id), None
            if version is None and self.episodes.shared:  # another replica may have served its first call
                version, first_at = await self.episodes.find(agent, p.task_id, p.run_id) or (None, None)
            if version is not None:
                try:
                    handle = await self.registry.acquire(f"{agent}@v{version}")
                except UnknownModel:  # the Trainer deleted it: the episode goes on with the current version
                    gone = True
                    self._pin_missed(p, agent, version)
                else:
                    self.episodes.remember(agent, p.task_id, p.run_id, handle.version, first_at)
                    return handle
        try:
            handle = await self.registry.acquire(p.model, route_key=p.task_id)
        except UnknownModel as e:
            raise APIError(404, f"the model {str(e)!r} does not exist", param="model", code="model_not_found") from None
        if not pinning:
            return handle
        if gone:
            try:  # (the handle is let go if this is cancelled or fails: a lease never leaks)
                await self.episodes.moved(agent, p.task_id, p.run_id, handle.version)
            except BaseException:
                self.registry.release(handle)
                raise
        else:  # its first call: served now, recorded for the other replicas off this request's path
            self.episodes.claim_later(agent, p.task_id, p.run_id, handle.version)
        self.episodes.remember(agent, p.task_id, p.run_id, handle.version)
        return handle

    def _pin_missed(self, p: PreparedChat, agent: str, version: int) -> None:
        self.episodes.misses += 1
        log.warning("episode %s/%s of %s: v%d is gone; serving the current version", p.task_id, p.run_id, agent, version)

    # ------------------------------------------------------------------ responses

    def _message(self, p: PreparedChat, c: _Choice) -> tuple[ResponseMessage, str]:
        finish = c.finish_reason or "stop"
        if p.parse_tools:
            content, calls = parse_tool_calls(c.text)
            if calls:
                return ResponseMessage(content=content, tool_calls=calls), "tool_calls"
            if finish == "length":  # cut inside a call: the call as far as it got, as OpenAI answers it
                content, calls = parse_cut_tool_calls(c.text, p.call_names, forced=p.forced_calls)
                return ResponseMessage(content=content, tool_calls=calls or None), finish
        return ResponseMessage(content=c.text), finish

    def _logprobs(self, c: _Choice) -> ChoiceLogprobs:
        tok = self.engine.tokenizer

        def entry(tid: int, lp: float) -> dict[str, Any]:
            s = tok.decode([tid])
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

        content = []
        for i, (tid, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            e = entry(tid, lp)
            e["top_logprobs"] = [entry(t, v) for t, v in c.top[i]] if i < len(c.top) else []
            content.append(e)
        return ChoiceLogprobs(content=content)

    def _record(self, p: PreparedChat, handle: AdapterHandle, completion_id: str, choices: list[_Choice],
                messages_out: list[ResponseMessage], leased_at: datetime) -> None:
        if not p.record:
            self.metrics.unrecorded.labels(handle.agent).inc()
        elif self.config.recorder.enabled:
            t0 = time.perf_counter()
            self.recorder.record(self._records(p, handle, completion_id, choices, messages_out, leased_at))
            self.metrics.record_handoff.observe(time.perf_counter() - t0)

    def _records(
        self, p: PreparedChat, handle: AdapterHandle, completion_id: str, choices: list[_Choice],
        messages_out: list[ResponseMessage], leased_at: datetime,
    ) -> list[Experience]:
        """One record per choice; created_at is when the version was leased, so ordering by it
        orders experiences by the version that produced them."""
        sampling = p.params.as_record()
        records = [
            Experience(
                experience_id=experience_id(completion_id, c.index),
                completion_id=completion_id,
                agent=handle.agent,
                model_version=handle.version,
                task_id=p.task_id,
                run_id=p.run_id,
                prompt_token_ids=p.prompt_ids,
                response_token_ids=c.token_ids,
                response_logprobs=c.logprobs,
                messages=p.messages,
                response=msg.model_dump(mode="json"),
                tools=p.tools,
                finish_reason=c.finish_reason,
                sampling=sampling,
                created_at=leased_at,
                user_id=p.user_id,
                request_id=p.request_id,
                trainable=None if p.train else False,
                privacy=None if p.train else {"train": False},
            )
            for c, msg in zip(choices, messages_out)
        ]
        return self.redactor.apply(records) if self.redactor.enabled else records

    def _account(self, handle: AdapterHandle, p: PreparedChat, choices: list[_Choice], t0: float, stream: bool) -> None:
        m = self.metrics
        m.completions.labels(handle.agent).inc()
        m.prompt_tokens.labels(handle.agent).inc(len(p.prompt_ids))
        completion = sum(len(c.token_ids) for c in choices)
        m.completion_tokens.labels(handle.agent).inc(completion)
        m.latency.labels("true" if stream else "false").observe(time.perf_counter() - t0)

    def _engine_request(self, p: PreparedChat, handle: AdapterHandle, completion_id: str, stream: bool) -> GenerateRequest:
        return GenerateRequest(
            request_id=completion_id, prompt_token_ids=p.prompt_ids, params=p.params, n=p.n,
            adapter=handle.ref, stream=stream,
        )

    async def complete(self, p: PreparedChat, *, receive: Receive | None = None) -> ChatCompletion:
        """The whole answer at once. With ``receive`` (the ASGI channel), a client that goes away
        aborts its generation in the engine instead of leaving it to run to the end."""
        t0 = time.perf_counter()
        choices = [_Choice(i) for i in range(p.n)]
        try:
            handle = await self._acquire(p)
        except BaseException:
            self._settle(p, choices)
            raise
        answer = _Answer.start(p, handle)
        try:
            async with self._abort_on_disconnect(answer.completion_id, receive):
                async for updates in self.engine.generate(self._engine_request(p, handle, answer.completion_id, stream=False)):
                    for u in updates:
                        choices[u.index].add(u)
        finally:
            self.registry.release(handle)
            self._settle(p, choices)
        if any(c.finish_reason == "abort" for c in choices):
            raise APIError(499, "the client closed the request", code="client_closed")  # nobody to answer

        def build() -> tuple[list[Choice], list[ResponseMessage]]:
            out_choices, messages_out = [], []
            for c in choices:
                message, finish = self._message(p, c)
                messages_out.append(message)
                out_choices.append(Choice(
                    index=c.index, message=message, finish_reason=finish, experience_id=answer.experience_id(c.index),
                    logprobs=self._logprobs(c) if p.request.logprobs else None,
                    token_ids=c.token_ids if p.request.return_token_ids else None,
                ))
            return out_choices, messages_out

        # Decoding every token (and its top alternatives) for logprobs can take a second at n=32: off the loop.
        out_choices, messages_out = await asyncio.to_thread(build) if p.request.logprobs else build()
        self._record(p, handle, answer.completion_id, choices, messages_out, answer.leased_at)
        self._account(handle, p, choices, t0, stream=False)
        return ChatCompletion(
            id=answer.completion_id, created=answer.created, model=p.model, choices=out_choices,
            usage=answer.usage(choices), system_fingerprint=answer.fingerprint,
            prompt_token_ids=p.prompt_ids if p.request.return_token_ids else None,
        )

    @contextlib.asynccontextmanager
    async def _abort_on_disconnect(self, request_id: str, receive: Receive | None):
        if receive is None:
            yield
            return

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            log.info("client of %s went away; aborting its generation", request_id)
            await self.engine.abort(request_id)

        watcher = asyncio.create_task(watch())
        try:
            yield
        finally:
            watcher.cancel()

    async def stream(self, p: PreparedChat) -> AsyncIterator[bytes]:
        """SSE chunks; the handle is leased before the first byte so errors can still be a 4xx.
        A client that goes away closes this generator, which aborts the engine's generation."""
        return self.sse(await self.chunks(p))

    async def chunks(self, p: PreparedChat) -> AsyncIterator[ChatCompletionChunk]:
        """The streamed answer as chunk objects (other APIs' streams are built from them)."""
        try:
            p.lease = handle = await self._acquire(p)
        except BaseException:
            self._settle(p, [])
            raise
        return self._chunks(p, handle)

    async def sse(self, chunks, render: Callable[[ChatCompletionChunk], str | None] = _chunk_json) -> AsyncIterator[bytes]:
        """Server-sent events of ``chunks`` as ``render`` writes each (None: skip it), then [DONE]."""
        try:
            async for chunk in chunks:
                data = render(chunk)
                if data is not None:
                    yield b"data: " + data.encode() + b"\n\n"
        except APIError as e:
            yield b"data: " + json.dumps(error_body(e.status, e.message, param=e.param, code=e.code)).encode() + b"\n\n"
        except Exception as e:
            message = f"the stream failed ({logged_error('stream failed', e)})"
            yield b"data: " + json.dumps(error_body(500, message, code="engine_error")).encode() + b"\n\n"
        finally:
            await chunks.aclose()  # a client gone: close the generation now, not when collected
        yield b"data: [DONE]\n\n"

    async def _chunks(self, p: PreparedChat, handle: AdapterHandle) -> AsyncIterator[ChatCompletionChunk]:
        t0 = time.perf_counter()
        answer = _Answer.start(p, handle)
        include_usage = bool(p.request.stream_options and p.request.stream_options.include_usage)
        want_ids = bool(p.request.return_token_ids)

        def chunk(choices: list[ChunkChoice], **extra) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=answer.completion_id, created=answer.created, model=p.model,
                                       system_fingerprint=answer.fingerprint, choices=choices, **extra)

        def piece(index: int, delta: Delta, finish: str | None = None, **extra) -> ChunkChoice:
            return ChunkChoice(index=index, delta=delta, finish_reason=finish, experience_id=answer.experience_id(index),
                               **extra)

        choices = [_Choice(i) for i in range(p.n)]
        filters = [ToolCallStreamFilter() if p.parse_tools else None for _ in range(p.n)]
        try:
            yield chunk([piece(i, Delta(role="assistant", content="")) for i in range(p.n)],
                        prompt_token_ids=p.prompt_ids if want_ids else None)
            async for updates in self.engine.generate(self._engine_request(p, handle, answer.completion_id, stream=True)):
                out = []
                for u in updates:
                    c = choices[u.index]
                    c.add(u)
                    text = filters[u.index].feed(u.text) if filters[u.index] else u.text
                    delta, finish = Delta(content=text or None), u.finish_reason
                    if finish and filters[u.index]:
                        f = filters[u.index]
                        cut = f.finish_cut(p.call_names, forced=p.forced_calls) if finish == "length" else None
                        rest, calls = cut if cut is not None else f.finish()
                        if calls:
                            delta.tool_calls = [StreamToolCall(index=k, **call) for k, call in enumerate(calls)]
                            finish = finish if cut is not None else "tool_calls"
                        if rest:
                            delta.content = text + rest
                    # One entry per choice per chunk: clients read the finish reason from the entry
                    # that carries the last text, so it must not come in a second entry.
                    if finish or text or (u.token_ids and (want_ids or p.request.logprobs)):
                        out.append(piece(
                            u.index, delta, finish, token_ids=u.token_ids if want_ids else None,
                            logprobs=self._logprobs(_Choice(u.index, u.token_ids, u.logprobs, u.top_logprobs or []))
                            if p.request.logprobs else None,
                        ))
                if out:
                    yield chunk(out)
        finally:
            self.end(p, choices)
        if any(c.finish_reason == "abort" for c in choices):
            return  # aborted in the engine: nobody got a whole answer, nothing to record
        messages_out = [self._message(p, c)[0] for c in choices]
        self._record(p, handle, answer.completion_id, choices, messages_out, answer.leased_at)
        self._account(handle, p, choices, t0, stream=True)
        if include_usage:
            yield chunk([], usage=answer.usage(choices))


@dataclass
class _Answer:
    """What the plain and the streaming answer to one request share."""

    completion_id: str
    created: int
    fingerprint: str
    prompt_tokens: int
    leased_at: datetime  # when the adapter version was leased: the record's created_at

    @classmethod
    def start(cls, p: PreparedChat, handle: AdapterHandle) -> "_Answer":
        return cls(completion_id=new_id(p.id_prefix), created=int(time.time()),
                   fingerprint=f"kaizen-{handle.agent}-v{handle.version}", prompt_tokens=len(p.prompt_ids),
                   leased_at=datetime.now(timezone.utc))

    def experience_id(self, index: int) -> str:
        return experience_id(self.completion_id, index)

    def usage(self, choices: list[_Choice]) -> Usage:
        completion = sum(len(c.token_ids) for c in choices)
        return Usage(prompt_tokens=self.prompt_tokens, completion_tokens=completion,
                     total_tokens=self.prompt_tokens + completion)
