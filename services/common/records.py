"""The Experience record: one generated choice, exactly as the engine produced it.

Everything downstream of the Explorer (the Trainer, the admin endpoints, the demo) reads this and
nothing else. Token ids and logprobs are what the engine consumed and sampled, never re-tokenized.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import BaseModel, Field


# Demonstrations (POST /demonstrations) are experiences whose completion id is ``demo-...``: never
# sampled, trained by supervised terms only, replayed by the Trainer rather than consumed.
DEMONSTRATION_KIND = "demo"
DEMONSTRATION_LABEL = "demonstration"  # the label of every demonstration (POST /demonstrations, a correction)
CORRECTION_LABEL = "correction"  # the label of a demonstration made from feedback's correction of a sampled call

# Evaluation traffic's task ids start with this (the release gate's calls): never rewarded, never
# trained, never counted online. services.common.release publishes it too.
EVAL_TASK_PREFIX = "release-eval/"


class ExperienceStatus(str, enum.Enum):
    """Lifecycle: recorded -> rewarded -> committed -> consumed (or discarded)."""

    RECORDED = "recorded"
    REWARDED = "rewarded"
    COMMITTED = "committed"
    CONSUMED = "consumed"
    DISCARDED = "discarded"


class Experience(BaseModel):
    experience_id: str = Field(description="Unique id of this choice; returned to the client.")
    completion_id: str = Field(description="The OpenAI response id; n choices give n experiences.")
    agent: str = Field(description="The agent (adapter lineage) that served it.")
    model_version: int = Field(description="Adapter version that produced every token (0 = base).")
    task_id: str | None = None
    run_id: str | None = None
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    messages: list[dict[str, Any]]
    response: dict[str, Any] = Field(description="The returned assistant message.")
    tools: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    sampling: dict[str, Any] = Field(description="temperature, top_p, max_tokens, seed as used.")
    reward: float | None = None
    feedback: dict[str, Any] | None = None
    status: ExperienceStatus = ExperienceStatus.RECORDED
    trained_in: int | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    user_id: str | None = Field(default=None, description="Whose traffic this is (metadata.user_id or X-User-Id).")
    request_id: str | None = Field(default=None, description="The HTTP request that produced it (X-Request-Id).")
    trainable: bool | None = Field(
        default=None, description="False: recorded for audit, never trained (no consent, or redacted without its ids).")
    privacy: dict[str, Any] | None = Field(
        default=None, description="What was done for privacy: redacted patterns, ids dropped, consent.")
    purged_at: datetime | None = Field(default=None, description="When retention removed its raw text.")
    hint: dict[str, Any] | None = Field(
        default=None, description="Feedback in words: text, and the teacher's prompt ids (the conversation with the hint).")


@dataclass(frozen=True)
class CommittedExperience:
    """What the Trainer reads of a committed experience (``buffer.fetch_committed``)."""

    seq: int
    experience_id: str
    agent: str
    model_version: int
    task_id: str | None
    run_id: str | None
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    sampling: dict[str, Any]
    reward: float | None
    feedback: dict[str, Any] | None
    finish_reason: str | None
    created_at: datetime | None
    updated_at: datetime | None
    hint: dict[str, Any] | None = None  # feedback in words (Experience.hint)

    @property
    def labels(self) -> list[str]:
        return list((self.feedback or {}).get("labels") or [])


@dataclass(frozen=True)
class TeamEpisode:
    """An episode (task_id + run_id) as the team's GRPO statistics see it: the reward of its last
    call, whichever agent made it, and the agents that acted in it."""

    reward: float
    agents: frozenset[str]


@dataclass(frozen=True)
class ReleaseDecision:
    """One decision about which version of an agent serves (table release_decisions)."""

    id: int
    agent: str
    version: int  # the version decided about
    decision: str  # candidate, canary_started, promoted, rejected, rolled_back, alarm
    serving: int | None  # the version serving once it is carried out
    actor: str  # gate, canary, guard, trainer, admin:<key>, cli
    reason: str | None
    figures: dict[str, Any] | None
    created_at: datetime

    def as_entry(self) -> dict[str, Any]:
        """As a version's manifest and the API show it."""
        return {"id": self.id, "decision": self.decision, "version": self.version, "serving": self.serving,
                "by": self.actor, "reason": self.reason, "figures": self.figures,
                "at": self.created_at.isoformat() if self.created_at else None}


@dataclass(frozen=True)
class TrainerStep:
    """One training step as the buffer records it, with the trainer state it produced."""

    id: int
    agent: str
    step: int
    version: int
    consumed: int
    discarded: int
    state_ref: str | None
    metrics: dict[str, Any] | None
    created_at: datetime
