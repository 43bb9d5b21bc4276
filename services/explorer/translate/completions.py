"""POST /v1/completions: legacy text completions, for tools that still use them.

The prompt is used as it is (a string, or token ids), without the chat template; sampling,
recording (the prompt kept as one message of role ``prompt``), feedback ids and grouping are the
chat service's. One prompt per request (send several requests, or ``n``); ``echo``, ``suffix`` and
``best_of`` > 1 get a 400.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Mapping

from starlette.types import Receive

from services.common.http.errors import APIError
from services.explorer.protocol import CompletionRequest
from services.explorer.serving.chat import ChatService
from services.explorer.serving.prepare import PreparedChat


def _legacy_logprobs(content: list[Any] | None) -> dict[str, Any] | None:
    if content is None:
        return None
    offsets, at = [], 0
    for e in content:
        offsets.append(at)
        at += len(e.token)
    return {"tokens": [e.token for e in content], "token_logprobs": [e.logprob for e in content],
            "top_logprobs": [{t.token: t.logprob for t in e.top_logprobs} for e in content], "text_offset": offsets}


class CompletionsService:
    def __init__(self, *, chat: ChatService):
        self.chat = chat

    def prepare(self, req: CompletionRequest, headers: Mapping[str, str]) -> PreparedChat:
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, f"{len(prompt)} prompts in one request; send one prompt per request (or use n)",
                               param="prompt", code="unsupported_parameter")
            prompt = prompt[0]
        for name, bad in (("echo", req.echo), ("suffix", req.suffix), ("best_of", (req.best_of or 1) > 1)):
            if bad:
                raise APIError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")
        body = {
            "model": req.model, "messages": [{"role": "user", "content": ""}], "max_tokens": req.max_tokens or 16,
            "n": req.n, "seed": req.seed, "stop": req.stop, "stream": req.stream, "stream_options": req.stream_options,
            "temperature": req.temperature, "top_p": req.top_p, "user": req.user, "metadata": req.metadata,
            "frequency_penalty": req.frequency_penalty, "presence_penalty": req.presence_penalty,
            "logit_bias": req.logit_bias, "logprobs": True if req.logprobs is not None else None,
            "top_logprobs": req.logprobs or None, "response_format": req.response_format,
            "return_token_ids": req.return_token_ids,
        }
        return self.chat.prepare_text(self.chat.chat_request(body), headers, prompt=prompt)

    async def complete(self, req: CompletionRequest, p: PreparedChat, *, receive: Receive | None = None) -> dict[str, Any]:
        answer = await self.chat.complete(p, receive=receive)
        out = {"id": answer.id, "object": "text_completion", "created": answer.created, "model": answer.model,
               "system_fingerprint": answer.system_fingerprint, "usage": answer.usage.model_dump(), "choices": []}
        for c in answer.choices:
            choice = {"text": c.message.content or "", "index": c.index, "finish_reason": c.finish_reason,
                      "logprobs": _legacy_logprobs(c.logprobs.content if c.logprobs else None),
                      "experience_id": c.experience_id}  # an extension, not in the OpenAI spec
            if req.return_token_ids:
                choice["token_ids"] = c.token_ids
            out["choices"].append(choice)
        if req.return_token_ids:
            out["prompt_token_ids"] = p.prompt_ids
        return out

    async def stream(self, req: CompletionRequest, p: PreparedChat) -> AsyncIterator[bytes]:
        return self.chat.sse(await self.chat.chunks(p), render=_as_text)


def _as_text(chunk: Any) -> str | None:
    """A chat chunk as a text-completion chunk (None for the opening one that only names the role)."""
    choices = [{"text": c.delta.content or "", "index": c.index, "finish_reason": c.finish_reason,
                "logprobs": _legacy_logprobs(c.logprobs.content if c.logprobs else None),
                "experience_id": c.experience_id} for c in chunk.choices if c.delta.role is None]
    if not choices and chunk.usage is None:
        return None
    body = {"id": chunk.id, "object": "text_completion", "created": chunk.created, "model": chunk.model,
            "system_fingerprint": chunk.system_fingerprint, "choices": choices}
    if chunk.usage is not None:
        body["usage"] = chunk.usage.model_dump()
    return json.dumps(body)
