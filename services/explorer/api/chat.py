"""POST /v1/chat/completions."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from starlette.responses import Response

from services.explorer.api.deps import ChatDep, PrincipalDep
from services.explorer.api.streaming import EndingStream
from services.explorer.protocol import ChatCompletionRequest
from services.explorer.serving.prepare import off_loop, recorded_header

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, chat: ChatDep, principal: PrincipalDep):
    prepared = await chat.admit(await off_loop(chat.prepare, body, request.headers), principal)
    if body.stream:
        return EndingStream(await chat.stream(prepared), prepared, chat)
    answer = await chat.complete(prepared, receive=request.receive)
    text = await asyncio.to_thread(answer.model_dump_json) if body.logprobs else answer.model_dump_json()  # can be MBs
    return Response(text, media_type="application/json", headers=recorded_header(prepared))
