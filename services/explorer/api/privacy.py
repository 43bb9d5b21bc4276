"""DELETE /experiences?user_id=... (admin): a user's recorded data removed (of the agents the key
may use) from the buffer, this replica's journal and dead letters, and a report of it."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Depends, Query

from services.common import buffer
from services.common.http.access import Principal, audit_entry
from services.common.http.errors import check_storable
from services.explorer.api.deps import StateDep, require

router = APIRouter()


@router.delete("/experiences")
async def delete_user_data(k: StateDep, principal: Annotated[Principal, Depends(require("admin"))],
                           user_id: str = Query(min_length=1, max_length=256)):
    check_storable(user_id, "user_id")
    await k.recorder.flush(k.config.recorder.feedback_wait_s)  # what this replica still writes is deleted too
    report = await asyncio.to_thread(buffer.delete_user_data, engine=k.db, user_id=user_id, agents=principal.agent_list,
                                     audit=audit_entry(principal, "delete_user_data", {"user_id": user_id}))
    k.metrics.deleted_experiences.inc(report["deleted"])
    # and the local copies: this replica's journal segment is sealed (deleted once written, at once here), its
    # dead letters scrubbed; other replicas' segments go within recorder.journal_max_age_s
    report["journal"] = await asyncio.to_thread(k.recorder.forget_user, user_id, principal.agent_list)
    return report
