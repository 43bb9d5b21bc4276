"""POST /demonstrations: the ideal reply to a conversation, stored for the Trainer's supervised terms."""

from __future__ import annotations

from fastapi import APIRouter

from services.common.http.access import audit_entry, check_agent
from services.explorer.api.deps import PrincipalDep, StateDep
from services.explorer.protocol import Demonstration, DemonstrationRequest

router = APIRouter()


@router.post("/demonstrations")
async def add_demonstration(body: DemonstrationRequest, k: StateDep, principal: PrincipalDep) -> Demonstration:
    check_agent(principal, k.registry.agent_named(body.model))
    return await k.demonstrations.add(body, audit=audit_entry(principal, "demonstration", {"model": body.model}))
