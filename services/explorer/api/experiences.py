"""GET /experiences/{id} and GET /experiences: what was recorded, token ids and logprobs included, and
each one's rewards as they were sent (``reward_history``)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Query
from fastapi.encoders import jsonable_encoder

from services.common import buffer
from services.common.http.access import check_agent
from services.common.http.errors import APIError, check_storable
from services.common.records import ExperienceStatus
from services.explorer.api.deps import PrincipalDep, StateDep

router = APIRouter()


@router.get("/experiences/{experience_id}")
async def get_experience(experience_id: str, k: StateDep, principal: PrincipalDep):
    check_storable(experience_id, "experience_id")
    await k.recorder.wait_written([experience_id], k.config.recorder.feedback_wait_s, agents=principal.agent_list)
    exp = await asyncio.to_thread(buffer.get_experience, engine=k.db, experience_id=experience_id)
    if exp is None or not principal.may_use(exp.agent):  # another agent's: as if it did not exist
        raise APIError(404, f"no experience {experience_id!r}", param="experience_id", code="unknown_id")
    history = await asyncio.to_thread(buffer.reward_history, engine=k.db, experience_id=experience_id)
    return {**exp.model_dump(mode="json"), "reward_history": jsonable_encoder(history)}


@router.get("/experiences")
async def list_experiences(
    k: StateDep,
    principal: PrincipalDep,
    task_id: str | None = None,
    status: str | None = None,
    agent: str | None = None,
    completion_id: str | None = None,
    limit: int = Query(default=100, ge=1, le=1000),
    offset: int = Query(default=0, ge=0, le=2**63 - 1),  # the databases' largest integer
    order: str = "asc",
):
    check_storable({"task_id": task_id, "agent": agent, "completion_id": completion_id}, "query")
    if principal.agents is not None and agent is None:
        raise APIError(403, f"API key {principal.name!r} may read only agents {principal.agent_list}: pass agent=",
                       param="agent", code="agent_not_allowed")
    check_agent(principal, agent, "agent")
    if status is not None and status not in {s.value for s in ExperienceStatus}:
        allowed = ", ".join(s.value for s in ExperienceStatus)
        raise APIError(400, f"unknown status {status!r}; use one of {allowed}", param="status")
    if order not in ("asc", "desc"):
        raise APIError(400, f"unknown order {order!r}; use asc (oldest first) or desc (newest first)", param="order")
    await k.recorder.flush(k.config.recorder.feedback_wait_s)
    rows = await asyncio.to_thread(
        buffer.list_experiences, engine=k.db, task_id=task_id, status=status, agent=agent,
        completion_id=completion_id, limit=limit, offset=offset, newest_first=order == "desc",
    )
    histories = await asyncio.to_thread(buffer.reward_histories, engine=k.db, experience_ids=[r.experience_id for r in rows])
    return {"object": "list", "data": [{**r.model_dump(mode="json"), "reward_history": jsonable_encoder(histories[r.experience_id])}
                                       for r in rows]}
