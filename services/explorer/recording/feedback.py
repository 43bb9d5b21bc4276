"""Rewards and commits: the durable half of the Explorer's API.

Both return only after their change is committed to the database. Feedback is all or nothing:
an id that names nothing gives 404 and changes nothing. An id this replica is still writing is
waited for (``recorder.feedback_wait_s``, then 503 with Retry-After: the database is not taking
writes); a young id that some other replica may still be writing is retried for a short grace
period before it counts as unknown (ids carry their creation time, see services.common.ids).
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from sqlalchemy.engine import Engine

from services.common import buffer
from services.common.buffer import UnknownIds
from services.common.http.access import Principal, audit_entry, check_agent, ids_target
from services.common.http.errors import APIError
from services.common.ids import id_age_seconds
from services.common.records import DEMONSTRATION_KIND, Experience
from services.explorer.edge.metrics import ExplorerMetrics
from services.explorer.protocol import CommitRequest, FeedbackRequest
from services.explorer.recording.recorder import Recorder

if TYPE_CHECKING:
    from services.explorer.serving.demonstrations import DemonstrationService


class FeedbackService:
    def __init__(
        self, *, db: Engine, recorder: Recorder, metrics: ExplorerMetrics, unknown_id_grace_s: float, wait_s: float = 5.0,
        demonstrations: DemonstrationService | None = None, hint_template: str = "{hint}", hint_role: str = "user",
        key_ttl_s: float = 86_400.0,
    ):
        self._db = db
        self._recorder = recorder
        self._metrics = metrics
        self._grace = unknown_id_grace_s
        self._wait_s = wait_s
        self._demos = demonstrations  # renders words with the served chat template
        self._hint_template, self._hint_role = hint_template, hint_role
        self._key_ttl_s = key_ttl_s

    async def _settle(self, ids: list[str], agents: list[str] | None = None) -> None:
        """Wait until every id is written, by us or (for a short while) by another replica.

        Raises RecordsNotWritten (503) when our own records cannot be written in time, and
        RecordsSetAside (422) for records the buffer refused."""
        await self._recorder.wait_written(ids, self._wait_s, agents=agents)
        deadline = time.monotonic() + self._grace
        delay = 0.02
        while True:
            unknown = await asyncio.to_thread(buffer.find_unknown_ids, engine=self._db, msg_ids=ids, agents=agents)
            young = [i for i in unknown if (age := id_age_seconds(i)) is not None and -5 < age < self._grace]
            if not unknown or len(young) < len(unknown) or time.monotonic() > deadline:
                return  # apply_feedback will name whatever is still unknown
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)

    async def feedback(self, req: FeedbackRequest, principal: Principal) -> dict[str, Any]:
        key = None if req.idempotency_key is None else buffer.IdempotencyKey(
            actor=principal.name, key=req.idempotency_key, request_hash=req.digest(), ttl_s=self._key_ttl_s)
        if key is not None and (done := await asyncio.to_thread(buffer.replayed_feedback, engine=self._db,
                                                                idempotency=key)) is not None:
            return self._body(done)  # a retry of a feedback already applied: nothing changes
        if req.episode:
            check_agent(principal, req.agent, "agent")
            ids = await self._episode(req.task_id, str(req.run_id), req.agent, principal.agent_list)
        else:
            ids = list(dict.fromkeys(req.msg_ids))
            await self._settle(ids, principal.agent_list)
        note = {
            "labels": req.labels or [],
            "comment": req.comment,
            "source": req.source or "api",
            "at": datetime.now(timezone.utc).isoformat(),
        }
        if req.expected is not None:
            note["expected"] = req.expected
        hints, correction = await self._words(req, ids, principal, note)
        details = ({"reward": req.reward} if req.reward is not None else {}) | ({"hint": True} if hints else {}) \
            | ({"correction": True} if correction is not None else {})
        # the reward, the hints and the correction's demonstration: one transaction, all or nothing
        result = await asyncio.to_thread(
            buffer.apply_feedback,
            engine=self._db,
            msg_ids=ids,
            reward=req.reward,
            feedback=note,
            task_id=req.task_id,
            run_id=None if req.run_id is None else str(req.run_id),
            agents=principal.agent_list,
            hints=hints,
            corrections=[correction] if correction is not None else [],
            idempotency=key,
            audit=audit_entry(principal, "feedback", {"task_id": req.task_id, "run_id": req.run_id} if req.episode
                              else ids_target(ids), **details),
        )
        if not result.replayed:
            self._metrics.feedback.inc(len(result.experience_ids))
            self._metrics.late_rewards.inc(len(result.late))
        return self._body(result)

    @staticmethod
    def _body(result: buffer.FeedbackResult) -> dict[str, Any]:
        body: dict[str, Any] = {"status": "success", "updated": len(result.experience_ids),
                                "experience_ids": result.experience_ids}
        if result.late:  # already trained on (or discarded): recorded, the latest reward, trained again only on request
            body["late"] = result.late
        if result.hint_not_kept:  # already trained on: a hint can no longer teach them
            body["hint_not_kept"] = result.hint_not_kept
        if result.demonstration_ids:  # the correction, stored as a demonstration of the call's prompt
            body["demonstration_id"] = result.demonstration_ids[0]
        if result.replayed:  # the idempotency key's first feedback did this; nothing changed now
            body["replayed"] = True
        return body

    async def _words(self, req: FeedbackRequest, ids: list[str], principal: Principal, note: dict[str, Any]
                     ) -> tuple[dict[str, dict[str, Any]] | None, Experience | None]:
        """A hint rendered for every named call ({experience_id: hint}), and a correction as the
        demonstration it becomes; None for what the request does not carry."""
        if req.hint is None and req.correction is None:
            return None, None
        if self._demos is None:
            raise APIError(501, "this Explorer takes no feedback in words (no chat template to render it)",
                           param="hint" if req.hint is not None else "correction")
        rows = await asyncio.to_thread(buffer.feedback_rows, engine=self._db, msg_ids=ids, agents=principal.agent_list)
        field = "hint" if req.hint is not None else "correction"
        for r in rows:
            if r.completion_id.startswith(DEMONSTRATION_KIND + "-"):
                raise APIError(400, f"{r.experience_id} is a demonstration, never sampled: a {field} teaches a sampled "
                               "call (send it a demonstration's reply instead)", param="msg_ids", code="not_sampled")
            if r.purged_at is not None or not r.messages:
                raise APIError(400, f"{r.experience_id}'s conversation was purged (retention): a {field} has nothing "
                               "to be read with", param="msg_ids", code="purged")
            if r.trainable is False:
                raise APIError(400, f"{r.experience_id} is never trained on (no consent, or redacted): a {field} for it "
                               "would train on its conversation", param="msg_ids", code="not_trainable")
            if any(m.get("role") == "prompt" for m in r.messages):
                raise APIError(400, f"{r.experience_id} is a text completion, sampled without a chat template: a "
                               f"{field} is read as a chat turn", param="msg_ids", code="not_a_chat")
        def render() -> tuple[dict[str, dict[str, Any]] | None, Experience | None]:  # tokenizing: off the loop
            hints = None
            if req.hint is not None:
                hints = {r.experience_id: {"text": req.hint, "source": note["source"], "at": note["at"],
                                           "prompt_token_ids": self._demos.hint_prompt(
                                               r, req.hint, template=self._hint_template, role=self._hint_role)}
                         for r in rows}
            correction = None
            if req.correction is not None:
                correction = self._demos.correction(rows[0], req.correction, comment=req.comment)
            return hints, correction

        return await asyncio.to_thread(render)

    async def _episode(self, task_id: str, run_id: str, agent: str | None = None,
                       agents: list[str] | None = None) -> list[str]:
        """Every call of an episode (or of one agent in it; of ``agents`` only, a key's), once this
        replica's records of it are written."""
        await self._recorder.flush(self._wait_s)
        ids = await asyncio.to_thread(buffer.episode_experience_ids, engine=self._db, task_id=task_id, run_id=run_id,
                                      agent=agent, agents=agents)
        if not ids:
            raise UnknownIds([f"episode task_id={task_id!r} run_id={run_id!r}" + (f" agent={agent!r}" if agent else "")])
        return ids

    async def commit(self, req: CommitRequest, principal: Principal) -> dict[str, Any]:
        # Without ids, nothing in flight can qualify: only rewarded rows commit, and a reward
        # is only ever set on a row that is already written.
        if req.msg_ids:
            await self._settle(list(req.msg_ids), principal.agent_list)
        target = ids_target(list(req.msg_ids)) if req.msg_ids else {"task_id": req.task_id}
        n = await asyncio.to_thread(buffer.commit_experiences, engine=self._db, task_id=req.task_id, msg_ids=req.msg_ids,
                                    agents=principal.agent_list, audit=audit_entry(principal, "commit", target))
        self._metrics.committed.inc(n)
        return {"status": "success", "committed": n}
