"""POST /v1/responses: OpenAI's Responses API, served by the chat service.

A request is translated into a chat request (``instructions`` become the system message, input
items become messages, flat function tools become chat tools, ``text.format`` becomes
``response_format``), answered and recorded by ``ChatService`` exactly as a chat is: one experience
per answer with the same grouping ids, and the response id is the completion id, so ``/feedback``
takes it as it is. The answer is translated back into output items (a ``message`` with
``output_text``, ``function_call`` items) and, when streamed, into the Responses event sequence.

``previous_response_id`` continues a recorded conversation: the messages of that response and its
answer come first, then the new input. New ``instructions`` replace the system message the
conversation started with (OpenAI's rule: instructions are not carried over); without new ones, the
old system message stays. ``store: false`` answers are recorded all the same (Kaizen learns from
every exchange) but cannot be continued by ``previous_response_id`` while this Explorer runs.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from functools import partial
from typing import Any, AsyncIterator, Mapping

from sqlalchemy.engine import Engine as DBEngine
from starlette.types import Receive

from services.common import buffer
from services.common.http.access import Principal
from services.common.http.errors import APIError
from services.common.ids import experience_id
from services.explorer.protocol import ChatCompletion, ResponsesRequest
from services.explorer.recording.recorder import Recorder
from services.explorer.serving.chat import ChatService
from services.explorer.serving.prepare import PreparedChat, off_loop

_TEXT_PARTS = ("input_text", "output_text", "text")
_UNSTORED_MAX = 100_000


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of content parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "refusal":
            parts.append(part.get("refusal") or "")
        elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append(part["text"])
        else:
            raise APIError(400, f"content part type {kind!r} is not supported; only text parts are",
                           param=f"{where}.{j}.type", code="unsupported_content")
    return "".join(parts)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as chat messages: calls join the assistant turn before them, outputs are tool turns."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input.{i}"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise APIError(400, f"{where}.role must be user, system, developer or assistant", param=f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name"):
                if not isinstance(item.get(key), str) or not item[key]:
                    raise APIError(400, f"{where}.{key} is missing", param=f"{where}.{key}")
            args = item.get("arguments", "{}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(400, f"{where}.call_id is missing", param=f"{where}.call_id")
            output = item.get("output", "")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # a reasoning model's summary: nothing this model's template renders
        else:
            raise APIError(400, f"input item type {kind!r} is not supported; use message, function_call or "
                           "function_call_output", param=f"{where}.type", code="unsupported_parameter")
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise APIError(400, f"tool type {t.get('type')!r} is not supported; only function tools are",
                           param=f"tools.{i}.type", code="unsupported_parameter")
        fn = {k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise APIError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                   param="tool_choice")


def chat_response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise APIError(400, "text.format must be an object", param="text.format")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    return {"type": fmt.get("type")}


def _usage(u: Any) -> dict[str, Any]:
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.total_tokens}


class ResponsesService:
    def __init__(self, *, chat: ChatService, db: DBEngine, recorder: Recorder, wait_s: float):
        self.chat = chat
        self._db = db
        self._recorder = recorder
        self._wait_s = wait_s
        self._unstored: OrderedDict[str, None] = OrderedDict()

    # ------------------------------------------------------------------ request

    async def prepare(self, req: ResponsesRequest, headers: Mapping[str, str], principal: Principal | None = None) -> PreparedChat:
        messages = await self._history(req.previous_response_id, principal) if req.previous_response_id else []
        new = input_messages(req.input)
        if req.instructions is not None:
            if messages and messages[0]["role"] in ("system", "developer"):
                messages = messages[1:]
            messages = [{"role": "system", "content": req.instructions}, *messages]
        if not messages and not new:
            raise APIError(400, "input is empty", param="input")
        logprobs = bool(req.top_logprobs) or "message.output_text.logprobs" in (req.include or [])
        body = {
            "model": req.model, "messages": [*messages, *new], "max_completion_tokens": req.max_output_tokens,
            "metadata": req.metadata, "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature,
            "top_p": req.top_p, "tools": chat_tools(req.tools), "tool_choice": chat_tool_choice(req.tool_choice),
            "response_format": chat_response_format(req.text), "seed": req.seed, "user": req.user,
            "logprobs": logprobs or None, "top_logprobs": req.top_logprobs if logprobs else None,
            "return_token_ids": req.return_token_ids, "stream": req.stream,
            "stream_options": {"include_usage": True} if req.stream else None,
        }
        return await off_loop(partial(self.chat.prepare_translated, id_prefix="resp"), body, headers)

    async def _history(self, response_id: str, principal: Principal | None = None) -> list[dict[str, Any]]:
        if response_id in self._unstored:
            raise APIError(404, f"response {response_id!r} was created with store: false and cannot be continued",
                           param="previous_response_id", code="response_not_found")
        eid = experience_id(response_id, 0)
        await self._recorder.wait_written([eid], self._wait_s, agents=principal.agent_list if principal else None)
        exp = await asyncio.to_thread(buffer.get_experience, engine=self._db, experience_id=eid)
        if exp is None or (principal is not None and not principal.may_use(exp.agent)):  # another agent's: unseen
            raise APIError(404, f"no response {response_id!r}", param="previous_response_id", code="response_not_found")
        if exp.purged_at is not None:
            raise APIError(404, f"response {response_id!r} is past the retention period (privacy.retention_days): its "
                           "text was purged", param="previous_response_id", code="response_not_found")
        # With privacy.redact on, the stored turns are the redacted ones, and so is what continues from them.
        reply = {k: v for k, v in exp.response.items() if k in ("role", "content", "tool_calls")}
        return [*exp.messages, reply]

    def _remember(self, req: ResponsesRequest, response_id: str) -> None:
        if req.store is False:
            self._unstored[response_id] = None
            while len(self._unstored) > _UNSTORED_MAX:
                self._unstored.popitem(last=False)

    # ------------------------------------------------------------------ answer

    def _shell(self, req: ResponsesRequest, response_id: str, created: int, status: str) -> dict[str, Any]:
        return {
            "id": response_id, "object": "response", "created_at": created, "status": status, "error": None,
            "incomplete_details": None, "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": req.model, "output": [], "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": None, "store": req.store is not False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
            "usage": None, "user": req.user, "metadata": req.metadata or {},
        }

    @staticmethod
    def _items(response_id: str, content: str | None, calls: list[dict[str, Any]], logprobs: list | None = None) -> list[dict]:
        suffix = response_id.split("-", 1)[-1]
        items: list[dict[str, Any]] = []
        if content:
            part = {"type": "output_text", "text": content, "annotations": [], "logprobs": logprobs or []}
            items.append({"type": "message", "id": f"msg_{suffix}", "status": "completed", "role": "assistant",
                          "content": [part]})
        for k, call in enumerate(calls):
            fn = call["function"]
            items.append({"type": "function_call", "id": f"fc_{suffix}_{k}", "call_id": call["id"], "name": fn["name"],
                          "arguments": fn["arguments"], "status": "completed"})
        return items

    def _finish(self, body: dict[str, Any], finish: str | None) -> dict[str, Any]:
        if finish == "length":
            body["status"], body["incomplete_details"] = "incomplete", {"reason": "max_output_tokens"}
        else:
            body["status"] = "completed"
        return body

    async def complete(self, req: ResponsesRequest, p: PreparedChat, *, receive: Receive | None = None) -> dict[str, Any]:
        answer: ChatCompletion = await self.chat.complete(p, receive=receive)
        self._remember(req, answer.id)
        choice = answer.choices[0]
        msg = choice.message
        calls = [c.model_dump() for c in msg.tool_calls or []]
        logprobs = [e.model_dump() for e in choice.logprobs.content] if choice.logprobs and choice.logprobs.content else None
        body = self._shell(req, answer.id, answer.created, "completed")
        body["output"] = self._items(answer.id, msg.content, calls, logprobs)
        body["usage"] = _usage(answer.usage)
        # Extensions, not in the OpenAI spec
        body["experience_id"] = choice.experience_id
        if req.return_token_ids:
            body["prompt_token_ids"], body["token_ids"] = answer.prompt_token_ids, choice.token_ids
        return self._finish(body, choice.finish_reason if choice.finish_reason == "length" else None)

    async def stream(self, req: ResponsesRequest, p: PreparedChat) -> AsyncIterator[bytes]:
        """The event sequence the official client reads; the adapter is leased before the first byte."""
        return self._events(req, await self.chat.chunks(p))

    async def _events(self, req: ResponsesRequest, chunks) -> AsyncIterator[bytes]:
        seq = 0

        def event(kind: str, **data: Any) -> bytes:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **data})}\n\n".encode()

        body: dict[str, Any] | None = None
        text, text_open, finish, calls, eid = "", False, None, [], None
        try:
            async for chunk in chunks:
                if body is None:
                    body = self._shell(req, chunk.id, chunk.created, "in_progress")
                    self._remember(req, chunk.id)
                    yield event("response.created", response=body)
                    yield event("response.in_progress", response=body)
                if chunk.usage is not None:
                    body["usage"] = _usage(chunk.usage)
                for c in chunk.choices:
                    eid = c.experience_id
                    finish = c.finish_reason or finish
                    piece = c.delta.content or ""
                    if piece:
                        item_id = f"msg_{chunk.id.split('-', 1)[-1]}"
                        if not text_open:
                            text_open = True
                            yield event("response.output_item.added", output_index=0, item={
                                "type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []})
                            yield event("response.content_part.added", item_id=item_id, output_index=0, content_index=0,
                                        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
                        text += piece
                        yield event("response.output_text.delta", item_id=item_id, output_index=0, content_index=0,
                                    delta=piece, logprobs=[])
                    calls += [t.model_dump(exclude={"index"}) for t in c.delta.tool_calls or []]
            items = self._items(body["id"], text, calls)
            if text_open:
                msg = items[0]
                part = msg["content"][0]
                yield event("response.output_text.done", item_id=msg["id"], output_index=0, content_index=0,
                            text=text, logprobs=[])
                yield event("response.content_part.done", item_id=msg["id"], output_index=0, content_index=0, part=part)
                yield event("response.output_item.done", output_index=0, item=msg)
            for k, item in enumerate(items[1 if text_open else 0:], start=1 if text_open else 0):
                yield event("response.output_item.added", output_index=k, item={**item, "arguments": "", "status": "in_progress"})
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=k,
                            delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=k,
                            name=item["name"], arguments=item["arguments"])
                yield event("response.output_item.done", output_index=k, item=item)
            body["output"] = items
            body["experience_id"] = eid  # an extension, not in the OpenAI spec
            self._finish(body, finish if finish == "length" else None)
            yield event("response.completed" if body["status"] == "completed" else "response.incomplete", response=body)
        except APIError as e:
            yield event("error", message=e.message, param=e.param, code=e.code)
        except Exception as e:
            yield event("error", message=f"stream failed: {e}", param=None, code="engine_error")
        finally:
            await chunks.aclose()
