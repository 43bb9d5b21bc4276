"""FastAPI dependencies, declared once: the services of the running app and the API-key check."""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING, Annotated

from fastapi import Depends, Request

from services.explorer.errors import APIError
from services.explorer.completions import CompletionsService
from services.explorer.feedback import FeedbackService
from services.explorer.messages import MessagesService
from services.explorer.responses import ResponsesService
from services.explorer.service import ChatService

if TYPE_CHECKING:  # app.py imports the routes, which import this module
    from services.explorer.app import ExplorerState
    from services.explorer.release import ReleaseController


async def get_state(request: Request) -> "ExplorerState":
    return request.app.state.kaizen


async def get_chat(request: Request) -> ChatService:
    return request.app.state.kaizen.chat


async def get_responses(request: Request) -> ResponsesService:
    return request.app.state.kaizen.responses


async def get_messages(request: Request) -> MessagesService:
    return request.app.state.kaizen.messages


async def get_completions(request: Request) -> CompletionsService:
    return request.app.state.kaizen.completions


async def get_feedback(request: Request) -> FeedbackService:
    return request.app.state.kaizen.feedback


async def get_releases(request: Request) -> "ReleaseController":
    return request.app.state.kaizen.releases


async def require_api_key(request: Request) -> None:
    keys: list[bytes] = request.app.state.kaizen.api_keys
    if not keys:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        token = request.headers.get("x-api-key", "")  # Anthropic's clients send their key so
    if not token:
        raise APIError(401, "missing API key: send Authorization: Bearer <key> (or X-Api-Key: <key>)",
                       code="invalid_api_key")
    presented = token.strip().encode()
    ok = False
    for key in keys:  # compare with every key, in constant time each, so timing reveals nothing
        ok |= hmac.compare_digest(presented, key)
    if not ok:
        raise APIError(401, "incorrect API key", code="invalid_api_key")


StateDep = Annotated["ExplorerState", Depends(get_state)]
ChatDep = Annotated[ChatService, Depends(get_chat)]
FeedbackDep = Annotated[FeedbackService, Depends(get_feedback)]
ResponsesDep = Annotated[ResponsesService, Depends(get_responses)]
MessagesDep = Annotated[MessagesService, Depends(get_messages)]
CompletionsDep = Annotated[CompletionsService, Depends(get_completions)]
ReleasesDep = Annotated["ReleaseController", Depends(get_releases)]
