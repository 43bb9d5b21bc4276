"""POST /v1/messages: Anthropic's Messages API, served by the chat service.

For agents written against Anthropic's SDK. A request is translated into a chat request (``system``
becomes the system message, ``tool_use`` blocks become the assistant's tool calls, ``tool_result``
blocks become tool turns, Anthropic tools and ``tool_choice`` become chat ones), answered and
recorded by ``ChatService`` as a chat is (one experience; the message id takes ``/feedback``), and
the answer is translated back into content blocks, or the Messages event stream. Grouping ids:
headers ``X-Task-Id`` / ``X-Run-Id``, or ``metadata.task_id`` / ``metadata.run_id``.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Mapping

from starlette.types import Receive

from services.common.http.errors import APIError
from services.explorer.protocol import MessagesRequest
from services.explorer.serving.chat import ChatService
from services.explorer.serving.prepare import PreparedChat

_STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def _block_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of blocks", param=where)
    parts = []
    for j, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            kind = b.get("type") if isinstance(b, dict) else None
            raise APIError(400, f"content block type {kind!r} is not supported here; only text blocks are",
                           param=f"{where}.{j}.type", code="unsupported_content")
        parts.append(b["text"])
    return "".join(parts)


def chat_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if req.system is not None:
        out.append({"role": "system", "content": _block_text(req.system, "system")})
    for i, m in enumerate(req.messages):
        where = f"messages.{i}.content"
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
            continue
        text, calls, results = [], [], []
        for j, b in enumerate(m.content):
            kind = b.get("type")
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "tool_use" and m.role == "assistant":
                if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                    raise APIError(400, f"{where}.{j} needs an id and a name", param=f"{where}.{j}")
                calls.append({"id": b["id"], "type": "function",
                              "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {})}})
            elif kind == "tool_result" and m.role == "user":
                if not isinstance(b.get("tool_use_id"), str):
                    raise APIError(400, f"{where}.{j}.tool_use_id is missing", param=f"{where}.{j}.tool_use_id")
                body = b.get("content", "")
                results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                                "content": _block_text(body, f"{where}.{j}.content")})
            else:
                raise APIError(400, f"content block type {kind!r} is not supported in a {m.role} message; use text, "
                               "tool_use (assistant) or tool_result (user)", param=f"{where}.{j}.type",
                               code="unsupported_content")
        if m.role == "assistant":
            out.append({"role": "assistant", "content": "".join(text) or None, **({"tool_calls": calls} if calls else {})})
        else:
            out += results
            if text or not results:
                out.append({"role": "user", "content": "".join(text)})
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") not in (None, "custom") or not isinstance(t.get("name"), str):
            raise APIError(400, f"tool {i} is not supported: only client tools with a name and an input_schema are",
                           param=f"tools.{i}", code="unsupported_parameter")
        fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object"}}
        if t.get("description"):
            fn["description"] = t["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """(chat tool_choice, parallel_tool_calls)."""
    if choice is None:
        return None, None
    parallel = False if choice.get("disable_parallel_tool_use") else None
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise APIError(400, "tool_choice must be {\"type\": auto | any | none} or {\"type\": \"tool\", \"name\": ...}",
                   param="tool_choice")


class MessagesService:
    def __init__(self, *, chat: ChatService):
        self.chat = chat

    def prepare(self, req: MessagesRequest, headers: Mapping[str, str]) -> PreparedChat:
        if req.top_k is not None:
            raise APIError(400, "top_k is not supported by this server", param="top_k", code="unsupported_parameter")
        choice, parallel = chat_tool_choice(req.tool_choice)
        meta = {k: v for k, v in (req.metadata or {}).items() if k in ("task_id", "run_id", "user_id", "train")}
        body = {
            "model": req.model, "messages": chat_messages(req), "max_tokens": req.max_tokens, "metadata": meta or None,
            "stop": req.stop_sequences, "temperature": req.temperature, "top_p": req.top_p, "tools": chat_tools(req.tools),
            "tool_choice": choice, "parallel_tool_calls": parallel, "stream": req.stream,
            "stream_options": {"include_usage": True} if req.stream else None,
        }
        return self.chat.prepare_translated(body, headers, id_prefix="msg")

    @staticmethod
    def _blocks(content: str | None, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        blocks: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
        for c in calls:
            try:
                args = json.loads(c["function"]["arguments"] or "{}")
            except ValueError:
                args = {"_raw": c["function"]["arguments"]}
            blocks.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"], "input": args})
        return blocks

    async def complete(self, req: MessagesRequest, p: PreparedChat, *, receive: Receive | None = None) -> dict[str, Any]:
        answer = await self.chat.complete(p, receive=receive)
        choice = answer.choices[0]
        calls = [c.model_dump() for c in choice.message.tool_calls or []]
        return {
            "id": answer.id, "type": "message", "role": "assistant", "model": req.model,
            "content": self._blocks(choice.message.content, calls),
            # A stop sequence and the end of turn both end as "stop" in the engines: end_turn for both.
            "stop_reason": _STOP.get(choice.finish_reason, "end_turn"), "stop_sequence": None,
            "usage": {"input_tokens": answer.usage.prompt_tokens, "output_tokens": answer.usage.completion_tokens},
            "experience_id": choice.experience_id,  # an extension, not in Anthropic's spec
        }

    async def stream(self, req: MessagesRequest, p: PreparedChat) -> AsyncIterator[bytes]:
        return self._events(req, p, await self.chat.chunks(p))

    async def _events(self, req: MessagesRequest, p: PreparedChat, chunks) -> AsyncIterator[bytes]:
        def event(kind: str, **data: Any) -> bytes:
            return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()

        started, text_open, index, finish, calls, usage, eid = False, False, 0, None, [], None, None
        try:
            async for chunk in chunks:
                if not started:
                    started = True
                    yield event("message_start", message={
                        "id": chunk.id, "type": "message", "role": "assistant", "model": req.model, "content": [],
                        "stop_reason": None, "stop_sequence": None,
                        "usage": {"input_tokens": len(p.prompt_ids), "output_tokens": 0}})
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices:
                    eid = c.experience_id
                    finish = c.finish_reason or finish
                    if c.delta.content:
                        if not text_open:
                            text_open = True
                            yield event("content_block_start", index=0, content_block={"type": "text", "text": ""})
                        yield event("content_block_delta", index=0, delta={"type": "text_delta", "text": c.delta.content})
                    calls += [t.model_dump(exclude={"index"}) for t in c.delta.tool_calls or []]
            if text_open:
                yield event("content_block_stop", index=0)
                index = 1
            for k, block in enumerate(self._blocks(None, calls), start=index):
                yield event("content_block_start", index=k, content_block={**block, "input": {}})
                yield event("content_block_delta", index=k,
                            delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"])})
                yield event("content_block_stop", index=k)
            yield event("message_delta", delta={"stop_reason": _STOP.get(finish or "stop", "end_turn"), "stop_sequence": None},
                        usage={"output_tokens": usage.completion_tokens if usage else 0}, experience_id=eid)
            yield event("message_stop")
        except APIError as e:
            yield event("error", error={"type": "invalid_request_error" if e.status < 500 else "api_error",
                                        "message": e.message})
        except Exception as e:
            yield event("error", error={"type": "api_error", "message": f"stream failed: {e}"})
        finally:
            await chunks.aclose()
