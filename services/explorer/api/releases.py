"""GET /versions (every version of an agent with its lineage and release decisions), POST
/admin/rollback and POST /admin/release (a decision by hand), GET /admin/audit (who did what):
Kaizen's own, outside the OpenAI spec."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Query

from services.common import buffer
from services.common.http.access import Principal, audit_entry, check_agent
from services.explorer.api.deps import ReleasesDep, StateDep, require
from services.explorer.protocol import AGENT_PATTERN, ReleaseDecisionRequest, RollbackRequest, check_storable

router = APIRouter()
Reader = Annotated[Principal, Depends(require("read"))]
Admin = Annotated[Principal, Depends(require("admin"))]


@router.get("/versions")
async def versions(releases: ReleasesDep, principal: Reader, agent: str = Query(pattern=AGENT_PATTERN)):
    check_agent(principal, agent, "agent")
    return await releases.versions(agent)


@router.post("/admin/rollback")
async def rollback(body: RollbackRequest, releases: ReleasesDep, principal: Admin):
    check_agent(principal, body.agent, "agent")
    # the audit row is written in the decision's transaction: no decision without it, nor the reverse
    return await releases.rollback(body.agent, to=body.to, reason=body.reason, actor=f"admin:{principal.name}",
                                   audit=audit_entry(principal, "rollback", {"agent": body.agent, "to": body.to},
                                                     reason=body.reason))


@router.post("/admin/release")
async def decide(body: ReleaseDecisionRequest, releases: ReleasesDep, principal: Admin):
    check_agent(principal, body.agent, "agent")
    return await releases.decide_by_hand(
        body.agent, body.version, body.decision, reason=body.reason, actor=f"admin:{principal.name}",
        audit=audit_entry(principal, f"release_{body.decision}", {"agent": body.agent, "version": body.version},
                          reason=body.reason))


def audit_visible(principal: Principal):
    """What an admin key limited to some agents may read of the audit log: its own actions, and the
    actions whose target names one of its agents (an agent, or a model that is one, pinned or not).
    Everything else (another key's feedback, commits or deletions, which name ids or users, not agents)
    stays hidden, so the log tells it nothing of other agents. None: every row (an unlimited key)."""
    if principal.agents is None:
        return None

    def visible(row: dict) -> bool:
        if row["actor"] == principal.name:
            return True
        target = row.get("target") or {}
        named = target.get("agent") or str(target.get("model") or "").partition("@")[0]
        return named in principal.agents

    return visible


@router.get("/admin/audit")
async def audit(k: StateDep, principal: Admin, limit: int = Query(default=100, ge=1, le=10_000),
                actor: str | None = None, action: str | None = None):
    check_storable({"actor": actor, "action": action}, "query")
    rows = await asyncio.to_thread(buffer.list_audit, engine=k.db, limit=limit, actor=actor, action=action,
                                   visible=audit_visible(principal))
    return {"object": "list", "data": rows}
