"""The other APIs, each translated to a chat by its service: POST /v1/responses (OpenAI's
Responses API), POST /v1/messages (Anthropic's Messages API), POST /v1/completions (legacy text)."""

from __future__ import annotations

import inspect

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse

from services.common.http.access import Principal
from services.explorer.api.deps import CompletionsDep, MessagesDep, PrincipalDep, ResponsesDep
from services.explorer.api.streaming import EndingStream
from services.explorer.protocol import CompletionRequest, MessagesRequest, ResponsesRequest
from services.explorer.serving.prepare import off_loop, recorded_header

router = APIRouter()


async def _answer(service, body, request: Request, principal: Principal):
    if inspect.iscoroutinefunction(service.prepare):
        # (the Responses API: it reads a stored conversation, which the key must be allowed to see)
        prepared = await service.prepare(body, request.headers, principal)  # it moves its own heavy part off the loop
    else:
        prepared = await off_loop(service.prepare, body, request.headers)
    await service.chat.admit(prepared, principal)
    if body.stream:
        return EndingStream(await service.stream(body, prepared), prepared, service.chat)
    return JSONResponse(await service.complete(body, prepared, receive=request.receive), headers=recorded_header(prepared))


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request, responses: ResponsesDep, principal: PrincipalDep):
    return await _answer(responses, body, request, principal)


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request, messages: MessagesDep, principal: PrincipalDep):
    return await _answer(messages, body, request, principal)


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request, completions: CompletionsDep, principal: PrincipalDep):
    return await _answer(completions, body, request, principal)
