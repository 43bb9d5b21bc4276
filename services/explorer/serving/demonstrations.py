"""POST /demonstrations: a conversation and its ideal assistant reply (tool calls included), rendered
with the served chat template exactly as a sampled reply would be, and stored as a committed,
labelled experience. The Trainer learns from demonstrations by supervised terms only (they were
never sampled, so they carry no sampling logprobs): a new agent starts from a handful of them.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timezone
from typing import Any

from sqlalchemy.engine import Engine as DBEngine

from services.common import buffer
from services.common.http.errors import APIError
from services.common.hints import hint_prompt_ids
from services.common.ids import experience_id, new_id
from services.common.records import DEMONSTRATION_KIND, DEMONSTRATION_LABEL, Experience, ExperienceStatus
from services.common.replies import ReplyError, correction_record, render_reply
from services.explorer.protocol import Demonstration, DemonstrationRequest, Message
from services.explorer.serving.adapters import AdapterRegistry, UnknownModel
from services.explorer.serving.prepare import normalize_messages
from services.explorer.serving.engines.base import Engine


class DemonstrationService:
    def __init__(self, *, engine: Engine, registry: AdapterRegistry, db: DBEngine):
        self.engine = engine
        self.registry = registry
        self.db = db

    def render(self, req: DemonstrationRequest) -> tuple[list[dict], dict, list[dict] | None, list[int], list[int]]:
        """(messages, reply, tools, prompt ids, reply ids): the reply's ids are what the model would
        have sampled, its turn's closing token included and nothing after it."""
        messages = normalize_messages(req.messages)
        (reply,) = normalize_messages([req.response])
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        return (messages, reply, tools, *self.render_reply(messages, reply, tools))

    def render_reply(self, messages: list[dict], reply: dict, tools: list[dict] | None, *,
                     check_conversation: bool = True) -> tuple[list[int], list[int]]:
        """(prompt ids, reply ids) of normalized messages and an assistant reply
        (services/common/replies.py), a 400 naming the field for what cannot be rendered."""
        try:
            return render_reply(self.engine.tokenizer, messages, reply, tools, max_len=self.engine.max_model_len,
                                check_conversation=check_conversation)
        except ReplyError as e:
            raise APIError(400, e.message, param=e.param, code=e.code) from None

    def hint_prompt(self, exp: Experience, hint: str, *, template: str, role: str) -> list[int]:
        """The teacher's prompt of on-policy self-distillation: ``exp``'s conversation with the hint as
        one more message (``template`` with {hint} replaced, as ``role``), rendered by the served chat
        template up to the reply's start, like the prompt that was sampled from."""
        try:
            ids = hint_prompt_ids(self.engine.tokenizer, exp.messages, exp.tools, hint, template=template, role=role)
        except Exception as e:
            raise APIError(400, f"the model's chat template rejected the hint after call {exp.experience_id}'s "
                           f"conversation: {e} (recorder.hint_role sets the hint's role)", param="hint") from None
        if len(ids) + len(exp.response_token_ids) > self.engine.max_model_len:
            raise APIError(400, f"this model's maximum context length is {self.engine.max_model_len} tokens; call "
                           f"{exp.experience_id}'s conversation with the hint and its reply take "
                           f"{len(ids) + len(exp.response_token_ids)}", param="hint", code="context_length_exceeded")
        return ids

    def correction(self, exp: Experience, reply_message: Message, *, comment: str | None) -> Experience:
        """A demonstration for ``exp``'s prompt: ``reply_message`` rendered as ``/demonstrations`` renders
        a reply (checked against the call's tools), linked to the call it corrects."""
        (reply,) = normalize_messages([reply_message])
        try:
            prompt_ids, reply_ids = self.render_reply(exp.messages, reply, exp.tools, check_conversation=False)
        except APIError as e:  # name the field of this body
            raise APIError(e.status, e.message.replace("response", "correction", 1),
                           param=(e.param or "").replace("response", "correction", 1) or "correction",
                           code=e.code) from None
        return correction_record(exp, reply, prompt_ids, reply_ids, comment=comment)

    async def add(self, req: DemonstrationRequest, audit: dict[str, Any] | None = None) -> Demonstration:
        """Store the demonstration (and ``audit``'s row, with the key's name, in the same transaction)."""
        try:
            agent, _, pinned = self.registry.resolve(req.model)
        except UnknownModel:
            raise APIError(404, f"the model {req.model!r} does not exist (a new agent must be listed in agents.names)",
                           param="model", code="model_not_found") from None
        if pinned is not None:
            raise APIError(400, "a demonstration belongs to an agent, not to a pinned version", param="model")
        messages, reply, tools, prompt_ids, reply_ids = self.render(req)
        cid = new_id(DEMONSTRATION_KIND)
        record = Experience(
            experience_id=experience_id(cid, 0), completion_id=cid, agent=agent, model_version=0,
            task_id=req.task_id, prompt_token_ids=prompt_ids, response_token_ids=reply_ids, response_logprobs=[],
            messages=messages, response=reply, tools=tools, finish_reason="stop", sampling={},
            feedback={"labels": [DEMONSTRATION_LABEL], "source": "demonstration", "comment": req.comment,
                      "at": datetime.now(timezone.utc).isoformat()},
            status=ExperienceStatus.COMMITTED,
        )
        if audit is not None:
            audit = {**audit, "target": {**(audit.get("target") or {}), "experience_id": record.experience_id}}
        await asyncio.to_thread(buffer.insert_experiences, engine=self.db, records=[record], audit=audit)
        return Demonstration(experience_id=record.experience_id, agent=agent, prompt_tokens=len(prompt_ids),
                             response_tokens=len(reply_ids))
