"""POST /feedback and POST /commit (bodies compatible with Trinity-RFT's serve mode)."""

from __future__ import annotations

from fastapi import APIRouter, Body, Header

from services.common.http.errors import APIError
from services.explorer.api.deps import FeedbackDep, PrincipalDep
from services.explorer.protocol import CommitRequest, FeedbackRequest

router = APIRouter()


@router.post("/feedback")
async def feedback(body: FeedbackRequest, service: FeedbackDep, principal: PrincipalDep,
                   idempotency_key: str | None = Header(default=None)):
    if idempotency_key is not None:  # the Idempotency-Key header: the same as the body's field
        if body.idempotency_key is not None and body.idempotency_key != idempotency_key:
            raise APIError(400, "the Idempotency-Key header and the body's idempotency_key differ: send one key",
                           param="idempotency_key", code="invalid_request")
        if not 1 <= len(idempotency_key) <= 128:
            raise APIError(400, "the Idempotency-Key header must have 1 to 128 characters", param="idempotency_key",
                           code="invalid_request")
        body = body.model_copy(update={"idempotency_key": idempotency_key})
    return await service.feedback(body, principal)


@router.post("/commit")
async def commit(service: FeedbackDep, principal: PrincipalDep, body: CommitRequest | None = Body(default=None)):
    return await service.commit(body or CommitRequest(), principal)
