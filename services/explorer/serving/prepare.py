"""Request preparation: a chat request checked, rendered with the model's chat template into
prompt token ids and turned into sampling settings, before any engine work (serving/chat.py then
generates, answers and records it).

Everything a client can get wrong is refused here with a 400 naming the field: unsupported
parameters, prompts no context holds, unstorable strings, grammars that do not compile.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from pydantic import ValidationError

from services.common import grammar
from services.common.grammar import GrammarError
from services.common.http.access import Principal, check_agent
from services.common.http.errors import APIError
from services.common.logging import request_id as current_request_id
from services.common.release import EVAL_TASK_PREFIX
from services.common.tool_calls import call_grammar
from services.explorer.config import ExplorerConfig
from services.explorer.edge.backpressure import Backpressure
from services.explorer.protocol import ChatCompletionRequest, Message, check_grouping_id, check_storable
from services.explorer.recording.privacy import consent
from services.explorer.recording.recorder import Recorder
from services.explorer.serving.adapters import AdapterRegistry
from services.explorer.serving.engines.base import Engine, SamplingParams


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
    reserved_tokens: int = 0  # taken from the key's token quota at admission, settled when the answer ends
    quota_hold: str = ""  # the reservation's id (the shared quotas' hold row)
    lease: Any = None  # a stream's adapter handle, leased before its first byte and let go once (ChatService.end)
    user_id: str | None = None  # metadata.user_id or the privacy.user_id_header header
    request_id: str | None = None  # the request's id (X-Request-Id, given or made up)
    train: bool = True  # consent: False records for audit only (metadata.train, or the key's default)
    record: bool = True  # False: answered, not recorded (back-pressure in mode unrecorded)
    call_names: tuple[str, ...] = ()  # the functions a call may name (a cut call's name is completed from them)
    forced_calls: bool = False  # tool_choice required or named: the answer is calls only (decoded under their grammar)


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


def _flag(req: ChatCompletionRequest, headers: Mapping[str, str], name: str, default: bool) -> bool:
    """metadata.<name>, else the header X-<Name> (true/false/1/0); a 400 naming it when it is neither."""
    value = (req.metadata or {}).get(name, headers.get("x-" + name.replace("_", "-"), default))
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        value = value.lower() in ("true", "1")
    if not isinstance(value, bool):
        raise APIError(400, f"metadata.{name} must be true or false", param=f"metadata.{name}")
    return value


def _episode_pin(req: ChatCompletionRequest, headers: Mapping[str, str]) -> bool:
    """metadata.episode_pin / X-Episode-Pin false: this call takes the current version."""
    return _flag(req, headers, "episode_pin", True)


class RequestPreparer:
    """Checks and renders requests for one engine and its agents' adapters (the chat service's
    first half)."""

    def __init__(self, *, config: ExplorerConfig, engine: Engine, registry: AdapterRegistry, recorder: Recorder,
                 backpressure: Backpressure | None = None):
        self.config = config
        self.engine = engine
        self.registry = registry
        self.recorder = recorder
        self.backpressure = backpressure

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
        forced = tools is not None and (tool_choice == "required" or isinstance(tool_choice, dict))
        names = (tool_choice["function"]["name"],) if forced and isinstance(tool_choice, dict) else \
            tuple(t["function"]["name"] for t in tools or ())
        return self._prepared(req, headers, messages=messages, tools=tools, prompt_ids=prompt_ids, grammar=constraint,
                              what="messages", call_names=names, forced_calls=forced)

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
                  id_prefix: str = "chatcmpl", call_names: tuple[str, ...] = (), forced_calls: bool = False) -> PreparedChat:
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
        temperature = 1.0 if req.temperature is None else req.temperature
        if _flag(req, headers, "explore", False):  # an exploration run: the agent's own temperature, if it has one
            temperature = self.config.agents.exploration_temperature.get(self.registry.agent_named(req.model), temperature)
        params = SamplingParams(
            temperature=temperature,
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
            train=consent(req.metadata, True), call_names=call_names, forced_calls=forced_calls,
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
