"""FastAPI dependencies, declared once: the services of the running app and the API-key check."""

from __future__ import annotations

import math
from typing import Annotated

from fastapi import Depends, Request

from services.common.http.access import Access, Principal
from services.common.http.errors import APIError
from services.explorer.recording.feedback import FeedbackService
from services.explorer.release.controller import ReleaseController
from services.explorer.serving.chat import ChatService
from services.explorer.state import ExplorerState
from services.explorer.translate.completions import CompletionsService
from services.explorer.translate.messages import MessagesService
from services.explorer.translate.responses import ResponsesService



async def get_state(request: Request) -> ExplorerState:
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


async def get_releases(request: Request) -> ReleaseController:
    return request.app.state.kaizen.releases


async def authenticate(request: Request) -> Principal:
    """The caller, from ``Authorization: Bearer <key>`` (or ``X-Api-Key``, as Anthropic's clients
    send it); 401 without a valid key, 429 when its request quota is spent. Without configured keys
    everyone is the anonymous principal with every scope."""
    state = request.app.state.kaizen
    access: Access = state.access
    principal = access.authenticate(request.headers)
    wait = await access.quotas.admit_async(principal)
    if wait is not None:
        state.metrics.quota_refusals.labels(principal.name).inc()
        raise APIError(429, f"the quota of API key {principal.name!r} is spent for now; retry in {math.ceil(wait)} s",
                       code="rate_limit_exceeded", headers={"Retry-After": str(max(1, math.ceil(wait)))})
    request.state.principal = principal
    return principal


PrincipalDep = Annotated[Principal, Depends(authenticate)]


def require(*scopes: str):
    """A dependency: the caller's key holds one of ``scopes`` (403 otherwise)."""

    async def check(principal: PrincipalDep) -> Principal:
        if not principal.scopes.intersection(scopes):
            need = " or ".join(repr(s) for s in scopes)
            raise APIError(403, f"API key {principal.name!r} lacks the {need} scope this endpoint needs",
                           code="insufficient_scope")
        return principal

    return check


StateDep = Annotated[ExplorerState, Depends(get_state)]
ChatDep = Annotated[ChatService, Depends(get_chat)]
FeedbackDep = Annotated[FeedbackService, Depends(get_feedback)]
ResponsesDep = Annotated[ResponsesService, Depends(get_responses)]
MessagesDep = Annotated[MessagesService, Depends(get_messages)]
CompletionsDep = Annotated[CompletionsService, Depends(get_completions)]
ReleasesDep = Annotated[ReleaseController, Depends(get_releases)]
