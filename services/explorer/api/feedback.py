"""POST /feedback and POST /commit (bodies compatible with Trinity-RFT's serve mode)."""

from __future__ import annotations

from fastapi import APIRouter, Body

from services.explorer.api.deps import FeedbackDep, PrincipalDep
from services.explorer.protocol import CommitRequest, FeedbackRequest

router = APIRouter()


@router.post("/feedback")
async def feedback(body: FeedbackRequest, service: FeedbackDep, principal: PrincipalDep):
    return await service.feedback(body, principal)


@router.post("/commit")
async def commit(service: FeedbackDep, principal: PrincipalDep, body: CommitRequest | None = Body(default=None)):
    return await service.commit(body or CommitRequest(), principal)
