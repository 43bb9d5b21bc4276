"""POST /demonstrations: the ideal reply to a conversation, stored for the Trainer's supervised terms."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from services.common import buffer

from services.common.http.access import check_agent
from services.explorer.api.deps import PrincipalDep, StateDep
from services.explorer.protocol import Demonstration, DemonstrationRequest

router = APIRouter()


@router.post("/demonstrations")
async def add_demonstration(body: DemonstrationRequest, k: StateDep, principal: PrincipalDep) -> Demonstration:
    check_agent(principal, k.registry.agent_named(body.model))
    demo = await k.demonstrations.add(body)
    await asyncio.to_thread(buffer.record_audit, engine=k.db, actor=principal.name, action="demonstration",
                            target={"model": body.model, "experience_id": demo.experience_id})
    return demo
