"""GET /versions (every version of an agent with its lineage and release decisions), POST
/admin/rollback and POST /admin/release (a decision by hand): Kaizen's own, outside the OpenAI spec."""

from __future__ import annotations

from fastapi import APIRouter, Query

from services.explorer.deps import ReleasesDep
from services.explorer.protocol import ReleaseDecisionRequest, RollbackRequest

router = APIRouter()


@router.get("/versions")
async def versions(releases: ReleasesDep, agent: str = Query(min_length=1, max_length=128)):
    return await releases.versions(agent)


@router.post("/admin/rollback")
async def rollback(body: RollbackRequest, releases: ReleasesDep):
    return await releases.rollback(body.agent, to=body.to, reason=body.reason, actor="admin")


@router.post("/admin/release")
async def decide(body: ReleaseDecisionRequest, releases: ReleasesDep):
    return await releases.decide_by_hand(body.agent, body.version, body.decision, reason=body.reason, actor="admin")
