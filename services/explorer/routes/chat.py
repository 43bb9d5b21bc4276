"""POST /v1/chat/completions."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse

from services.explorer.deps import ChatDep
from services.explorer.protocol import ChatCompletionRequest

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, chat: ChatDep):
    prepared = chat.prepare(body, request.headers)
    if body.stream:
        chunks = await chat.stream(prepared)
        return StreamingResponse(
            chunks, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        )
    answer = await chat.complete(prepared, receive=request.receive)
    return Response(answer.model_dump_json(), media_type="application/json")
