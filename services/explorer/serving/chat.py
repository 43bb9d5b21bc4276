"""The chat service: turns an OpenAI request into an engine call, a response and Experience records.

Routes stay thin; this is where a request is checked, rendered with the model's chat template into
prompt token ids, run on the engine under a lease of its agent's adapter version, answered (plain
or as SSE chunks), and recorded token for token.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from datetime import datetime, timezone
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Mapping

from pydantic import ValidationError
from starlette.types import Receive

from services.common import grammar
from services.common.grammar import GrammarError
from services.common.http.access import Principal, Quotas, check_agent
from services.common.http.errors import APIError, error_body, logged_error
from services.common.ids import experience_id, new_id
from services.common.logging import request_id as current_request_id
from services.common.records import Experience
from services.common.release import EVAL_TASK_PREFIX
from services.common.tool_calls import ToolCallStreamFilter, call_grammar, parse_tool_calls
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
    Message,
    ResponseMessage,
    StreamToolCall,
    Usage,
    check_grouping_id,
    check_storable,
)
from services.explorer.recording.privacy import Redactor, consent
from services.explorer.recording.recorder import Recorder
from services.explorer.serving.adapters import AdapterHandle, AdapterRegistry, UnknownModel
from services.explorer.serving.engines.base import ChoiceUpdate, Engine, GenerateRequest, SamplingParams
from services.explorer.serving.episodes import EpisodePins

log = logging.getLogger(__name__)


@dataclass
class PreparedChat:
    """A validated request, rendered to prompt token ids."""

    request: ChatCompletionRequest
    model: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    parse_tools: bool
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    task_id: str | None
    run_id: str | None
    episode_pin: bool = True  # serve the version this episode's first call used
    id_prefix: str = "chatcmpl"  # of the completion id (the Responses API's are resp_...)
    principal: Principal | None = None  # the caller's key (admit): its agents and token quota
    user_id: str | None = None  # metadata.user_id or the privacy.user_id_header header
    request_id: str | None = None  # the request's id (X-Request-Id, given or made up)
    train: bool = True  # consent: False records for audit only (metadata.train, or the key's default)
    record: bool = True  # False: answered, not recorded (back-pressure in mode unrecorded)


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


def _text_content(msg: Message, index: int) -> str | None:
    if msg.content is None or isinstance(msg.content, str):
        return msg.content
    parts = []
    for j, part in enumerate(msg.content):
        if part.type != "text":
            raise APIError(
                400, f"content part type {part.type!r} is not supported; only text parts are",
                param=f"messages.{index}.content.{j}.type", code="unsupported_content",
            )
        parts.append(part.text)
    return "".join(parts)


def normalize_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """OpenAI request messages as the chat template takes them (text parts joined, tool calls
    with string arguments); 400 for what the template cannot render."""
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": _text_content(m, i)}
        if m.role == "assistant" and m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": c.function.arguments
                        if isinstance(c.function.arguments, str)
                        else json.dumps(c.function.arguments),
                    },
                }
                for c in m.tool_calls
            ]
        elif d["content"] is None:
            raise APIError(400, f"messages.{i} ({m.role}) has no content", param=f"messages.{i}.content")
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
        if m.name:
            d["name"] = m.name
        out.append(d)
    return out


_CHARS_PER_TOKEN = 16  # a bound on how many characters a token covers, for refusing prompts before tokenizing
_INLINE_BODY_BYTES = 64 * 1024  # smaller bodies are rendered and tokenized on the event loop (a thread costs more)


def _prompt_chars(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> int:
    """The characters the chat template renders from: contents, tool calls, names, tool definitions."""
    n = len(json.dumps(tools)) if tools else 0
    for m in messages:
        n += len(m.get("content") or "") + len(m.get("name") or "")
        for c in m.get("tool_calls") or ():
            n += len(c["function"]["name"]) + len(c["function"]["arguments"])
    return n


def recorded_header(p: "PreparedChat") -> dict[str, str]:
    """Answers that are not recorded say so (their experience ids take no feedback)."""
    return {} if p.record else {"X-Kaizen-Recorded": "false"}


async def off_loop(prepare: Callable[..., "PreparedChat"], body: Any, headers: Mapping[str, str]) -> "PreparedChat":
    """``prepare(body, headers)``; on a worker thread when the body is large, since rendering and
    tokenizing a big prompt takes long enough to stall every other request on the event loop."""
    size = headers.get("content-length")
    if size is not None and size.isdigit() and int(size) <= _INLINE_BODY_BYTES:
        return prepare(body, headers)
    return await asyncio.to_thread(prepare, body, headers)


def _grouping(req: ChatCompletionRequest, headers: Mapping[str, str]) -> tuple[str | None, str | None]:
    meta = req.metadata or {}
    task = meta.get("task_id", headers.get("x-task-id"))
    run = meta.get("run_id", headers.get("x-run-id"))
    out = []
    for name, value in (("task_id", task), ("run_id", run)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (str, int))):
            raise APIError(400, f"metadata.{name} must be a string or an integer", param=f"metadata.{name}")
        if value is not None:
            value = str(value)
            check_grouping_id(value, f"metadata.{name}")
            check_storable(value, f"metadata.{name}")  # headers too
        out.append(value)
    return out[0], out[1]


def _identifier(value: Any, param: str, limit: int) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise APIError(400, f"{param} must be a string or an integer", param=param)
    value = str(value)
    if len(value) > limit:
        raise APIError(400, f"{param} is {len(value)} characters long; at most {limit} are allowed", param=param)
    check_storable(value, param)
    return value


def _user_id(req: ChatCompletionRequest, headers: Mapping[str, str], header: str) -> str | None:
    meta = req.metadata or {}
    if "user_id" in meta:
        return _identifier(meta["user_id"], "metadata.user_id", 256)
    return _identifier(headers.get(header), header, 256)


def _response_grammar(req: ChatCompletionRequest, tools: list[dict[str, Any]] | None, tool_choice: Any) -> str | None:
    """The grammar a response decodes under (services/common/grammar.py), or None for free text:
    tool_choice required / named: calls only; response_format json_object / json_schema: that JSON
    (or, with tools on auto, either that JSON or calls)."""
    rf = req.response_format or {}
    kind = rf.get("type", "text")
    try:
        text = None
        if kind == "json_object":
            text = grammar.json_object_grammar()
        elif kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise APIError(400, "response_format.json_schema must be an object with a name and a schema object",
                               param="response_format.json_schema")
            strict = spec.get("strict")
            text = grammar.json_schema_grammar(spec.get("schema") or {"type": "object"}, strict=strict is not False)
        elif kind != "text":
            raise APIError(400, f"unknown response_format type {kind!r}; use text, json_object or json_schema",
                           param="response_format.type")
        calls = call_grammar(tools, tool_choice, parallel=req.parallel_tool_calls is not False) if tools else None
        if calls is not None or text is None:
            return calls
        if tools:
            return grammar.either(text, call_grammar(tools, "required", parallel=req.parallel_tool_calls is not False))
        return text
    except GrammarError as e:
        raise APIError(400, str(e), param="response_format" if kind != "text" else "tools") from None


def _chunk_json(chunk: ChatCompletionChunk) -> str:
    return chunk.model_dump_json()


def _episode_pin(req: ChatCompletionRequest, headers: Mapping[str, str]) -> bool:
    """metadata.episode_pin / X-Episode-Pin false: this call takes the current version."""
    value = (req.metadata or {}).get("episode_pin", headers.get("x-episode-pin", True))
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        value = value.lower() in ("true", "1")
    if not isinstance(value, bool):
        raise APIError(400, "metadata.episode_pin must be true or false", param="metadata.episode_pin")
    return value


class ChatService:
    def __init__(
        self,
        *,
        config: ExplorerConfig,
        engine: Engine,
        registry: AdapterRegistry,
        recorder: Recorder,
        metrics: ExplorerMetrics,
    ):
        self.config = config
        self.engine = engine
        self.registry = registry
        self.recorder = recorder
        self.metrics = metrics
        self.quotas: Quotas | None = None  # the API keys' token quotas (app.py sets them)
        self.redactor = Redactor(config.privacy)
        self.backpressure: Backpressure | None = None  # app.py sets it when backpressure.max_backlog is set
        r = config.reload
        self.episodes = EpisodePins(ttl_s=r.episode_pin_s, max_episodes=r.episode_pin_max)
        registry.held_versions = self.episodes.held

    # ------------------------------------------------------------------ preparation

    def admit(self, p: PreparedChat, principal: Principal) -> PreparedChat:
        """403 when the caller's key may not use the agent ``p`` names; its tokens will count
        against the key's quota."""
        agent = self.registry.agent_named(p.model)
        check_agent(principal, agent)
        p.principal = principal
        p.train = consent(p.request.metadata, principal.train)
        bp = self.backpressure
        evaluation = (p.task_id or "").startswith(EVAL_TASK_PREFIX)  # the release gate's own calls, never refused
        if bp is not None and agent in bp.active and not evaluation:
            if bp.cfg.mode == "reject":
                wait = max(1, math.ceil(bp.cfg.check_interval_s))
                raise APIError(429, f"agent {agent!r} is under back-pressure: its Trainer is far behind (more than "
                               f"{bp.cfg.max_backlog} committed experiences wait); retry later", code="trainer_behind",
                               headers={"Retry-After": str(wait)})
            p.record = False
        return p

    def prepare(self, req: ChatCompletionRequest, headers: Mapping[str, str]) -> PreparedChat:
        self._check(req)
        messages = normalize_messages(req.messages)
        tool_choice = req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else req.tool_choice
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        if tool_choice not in (None, "none", "auto") and not tools:
            raise APIError(400, "tool_choice requires tools", param="tool_choice")
        if isinstance(tool_choice, dict) and tool_choice["function"]["name"] not in {t["function"]["name"] for t in tools}:
            raise APIError(400, f"tool_choice names unknown function {tool_choice['function']['name']!r}", param="tool_choice")
        if tool_choice == "none":
            tools = None
        self._check_size(req, _prompt_chars(messages, tools), what="messages")
        constraint = _response_grammar(req, tools, tool_choice)
        try:
            text = self.engine.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
        except Exception as e:
            raise APIError(400, f"the model's chat template rejected these messages: {e}", param="messages") from None
        prompt_ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
        return self._prepared(req, headers, messages=messages, tools=tools, prompt_ids=prompt_ids, grammar=constraint,
                              what="messages")

    def prepare_text(self, req: ChatCompletionRequest, headers: Mapping[str, str], *, prompt: str | list[int]) -> PreparedChat:
        """A text completion (POST /v1/completions): ``prompt`` as it is, no chat template (a list:
        token ids). Its sampling settings come from ``req``, whose messages are not used; the record
        keeps the prompt as one message of role ``prompt``."""
        self._check(req)
        self._check_size(req, len(prompt), what="prompt")
        if isinstance(prompt, str):
            ids, text = self.engine.tokenizer.encode(prompt, add_special_tokens=False), prompt
        else:
            vocab = len(self.engine.tokenizer)
            if any(not 0 <= t < vocab for t in prompt):
                raise APIError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt")
            ids, text = list(prompt), self.engine.tokenizer.decode(prompt)
        if not ids:
            raise APIError(400, "prompt is empty", param="prompt")
        return self._prepared(req, headers, messages=[{"role": "prompt", "content": text}], tools=None, prompt_ids=ids,
                              grammar=_response_grammar(req, None, None), what="prompt", id_prefix="cmpl")

    def _check(self, req: ChatCompletionRequest) -> None:
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(req, name):
                raise APIError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server", param="logit_bias", code="unsupported_parameter")
        if req.top_logprobs and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        if (req.n or 1) > self.engine.max_batch_size:
            raise APIError(400, f"n is {req.n}; this engine generates at most {self.engine.max_batch_size} choices at once",
                           param="n", code="invalid_value")
        if not self.recorder.has_capacity(req.n or 1):
            raise APIError(503, "the experience buffer is unreachable and the backlog is full; retry later", code="buffer_unavailable")

    def _check_size(self, req: ChatCompletionRequest, chars: int, *, what: str) -> None:
        """Refuse, before the costly templating and tokenizing, a prompt no context can hold and a
        request that would store too much (its prompt is stored with each of its n choices)."""
        limit = self.config.server.max_prompt_chars or _CHARS_PER_TOKEN * self.engine.max_model_len
        if chars > limit:
            raise APIError(400, f"the {what} are {chars:,} characters long; this server takes at most {limit:,}",
                           param=what, code="context_length_exceeded")
        n, budget = req.n or 1, self.config.server.max_stored_bytes
        if n * chars > budget:
            raise APIError(400, f"n={n} choices of a {chars:,}-character prompt would store about {n * chars:,} bytes; "
                           f"at most {budget:,} are allowed per request (lower n or shorten the {what})",
                           param="n", code="request_too_large")

    def _prepared(self, req: ChatCompletionRequest, headers: Mapping[str, str], *, messages: list[dict[str, Any]],
                  tools: list[dict[str, Any]] | None, prompt_ids: list[int], grammar: str | None, what: str,
                  id_prefix: str = "chatcmpl") -> PreparedChat:
        """The sampling settings, checked against the context length the prompt leaves."""
        limit = self.engine.max_model_len
        if len(prompt_ids) >= limit:
            raise APIError(
                400, f"this model's maximum context length is {limit} tokens, the {what} take {len(prompt_ids)}",
                param=what, code="context_length_exceeded",
            )
        max_tokens = req.max_completion_tokens or req.max_tokens or self.config.server.default_max_tokens
        if max_tokens is None:
            max_tokens = limit - len(prompt_ids)
        elif len(prompt_ids) + max_tokens > limit:
            raise APIError(
                400,
                f"this model's maximum context length is {limit} tokens; the {what} take {len(prompt_ids)} "
                f"and {max_tokens} were asked for the completion",
                param="max_completion_tokens" if req.max_completion_tokens else "max_tokens",
                code="context_length_exceeded",
            )
        stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
        params = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            max_tokens=max_tokens,
            stop=stop,
            seed=req.seed,
            top_logprobs=(req.top_logprobs or 0) if req.logprobs else 0,
            grammar=grammar,
        )
        task_id, run_id = _grouping(req, headers)
        return PreparedChat(
            request=req, model=req.model, messages=messages, tools=tools, parse_tools=bool(tools), prompt_ids=prompt_ids,
            params=params, n=req.n or 1, task_id=task_id, run_id=run_id, episode_pin=_episode_pin(req, headers),
            id_prefix=id_prefix, user_id=_user_id(req, headers, self.config.privacy.user_id_header),
            request_id=current_request_id.get(),  # set by services/explorer/edge/middleware.py
            train=consent(req.metadata, True),
        )

    @staticmethod
    def chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
        """A chat body translated from another API, checked as a chat request (a 400 naming the
        field when it is not one; None values are left out)."""
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            err = e.errors()[0]
            raise APIError(400, f"{'.'.join(map(str, err['loc']))}: {err['msg']}", param=str(err["loc"][0])) from None

    def prepare_translated(self, body: dict[str, Any], headers: Mapping[str, str], *, id_prefix: str) -> PreparedChat:
        """A request of another API (Responses, Anthropic Messages), translated into a chat body,
        checked and prepared as a chat; its ids start with ``id_prefix``."""
        p = self.prepare(self.chat_request(body), headers)
        p.id_prefix = id_prefix
        return p

    async def _acquire(self, p: PreparedChat) -> AdapterHandle:
        """The handle of the version that serves this request: the agent's current one, or the
        one its episode started on (see services/explorer/serving/episodes.py)."""
        agent = self.registry.agent_of(p.model)
        pinning = self.episodes.enabled and p.episode_pin and agent is not None and p.task_id is not None \
            and p.run_id is not None
        if pinning:
            version = self.episodes.get(agent, p.task_id, p.run_id)
            if version is not None:
                try:
                    handle = await self.registry.acquire(f"{agent}@v{version}")
                except UnknownModel:  # the Trainer deleted it: the episode goes on with the current version
                    self.episodes.misses += 1
                    log.warning("episode %s/%s of %s: v%d is gone; serving the current version", p.task_id, p.run_id,
                                agent, version)
                else:
                    self.episodes.remember(agent, p.task_id, p.run_id, handle.version)
                    return handle
        try:
            handle = await self.registry.acquire(p.model, route_key=p.task_id)
        except UnknownModel as e:
            raise APIError(404, f"the model {str(e)!r} does not exist", param="model", code="model_not_found") from None
        if pinning:
            self.episodes.remember(agent, p.task_id, p.run_id, handle.version)
        return handle

    # ------------------------------------------------------------------ responses

    def _message(self, p: PreparedChat, c: _Choice) -> tuple[ResponseMessage, str]:
        finish = c.finish_reason or "stop"
        if p.parse_tools:
            content, calls = parse_tool_calls(c.text)
            if calls:
                return ResponseMessage(content=content, tool_calls=calls), "tool_calls"
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
        if p.principal is not None and self.quotas is not None:
            self.quotas.charge_tokens(p.principal, len(p.prompt_ids) + completion)
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
        handle = await self._acquire(p)
        answer = _Answer.start(p, handle)
        choices = [_Choice(i) for i in range(p.n)]
        try:
            async with self._abort_on_disconnect(answer.completion_id, receive):
                async for updates in self.engine.generate(self._engine_request(p, handle, answer.completion_id, stream=False)):
                    for u in updates:
                        choices[u.index].add(u)
        finally:
            self.registry.release(handle)
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
        handle = await self._acquire(p)
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
                        rest, calls = filters[u.index].finish()
                        if calls:
                            delta.tool_calls = [StreamToolCall(index=k, **call) for k, call in enumerate(calls)]
                            finish = "tool_calls"
                        elif rest:
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
            self.registry.release(handle)
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
