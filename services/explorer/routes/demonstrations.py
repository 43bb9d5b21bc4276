"""POST /demonstrations: the ideal reply to a conversation, stored for the Trainer's supervised terms."""

from __future__ import annotations

from fastapi import APIRouter

from services.explorer.deps import StateDep
from services.explorer.protocol import Demonstration, DemonstrationRequest

router = APIRouter()


@router.post("/demonstrations")
async def add_demonstration(body: DemonstrationRequest, k: StateDep) -> Demonstration:
    return await k.demonstrations.add(body)
