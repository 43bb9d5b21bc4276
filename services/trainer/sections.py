"""The Trainer's config sections that the objectives and the batch rules read: a floor below both
the recipes and ``TrainerConfig``, so that neither imports the other's room."""

from __future__ import annotations

from typing import Literal, Protocol

from pydantic import Field

from services.common.config import ConfigModel


class SelfImitationSection(ConfigModel):
    """The agent's own successes (consumed rollouts rewarded at least ``success_reward``) replayed in
    the supervised term beside the demonstrations: self-imitation, rejection-sampling fine-tuning on
    traffic (RAFT, ReST). Its weight grows from 0 to ``coef`` while the demonstrations' decays."""

    coef: float = Field(default=0.0, ge=0, description="Weight of the replayed successes in the supervised term (0: off).")
    ramp_steps: int = Field(
        default=0, ge=0, description="The weight grows linearly from 0 to coef over this many steps after the cold start.")
    batch_size: int = Field(default=8, ge=1, description="Calls of replayed successes per step (taken in turn).")
    per_task: int = Field(
        default=1, ge=1, description="Episodes kept per task: the best of each group (ties: the newest), de-duplicated.")
    pool: int = Field(default=512, ge=1, description="The newest this many successful calls are the pool.")


class ObjectiveSection(ConfigModel):
    """What every objective shares: the action level, the ratio's clipping, the KL and entropy
    terms, team credit, and the supervised term on demonstrations (the mixed objective)."""

    level: Literal["token", "sequence"] = Field(
        default="token", description="token: every token is an action; sequence: the whole response is one action (MARFT)."
    )
    sequence_logprob: Literal["sum", "mean"] = Field(
        default="mean", description="Sequence level: log-prob of a response as the sum (true) or mean (GSPO) of its tokens."
    )
    clip_low: float = Field(default=0.2, ge=0, description="Ratio clipped below at 1 - clip_low.")
    clip_high: float = Field(default=0.2, ge=0, description="Ratio clipped above at 1 + clip_high (DAPO: raise it).")
    kl_coef: float = Field(default=0.0, ge=0, description="Weight of the KL penalty to the reference (kl_reference).")
    kl_reference: Literal["base", "cold_start"] = Field(
        default="base",
        description="The KL's reference policy. base: the base model (adapter off). cold_start: the agent's adapter as "
        "its cold start left it (the weights before its first step past cold_start_steps, kept in the Trainer's saved "
        "state), the supervised policy RLHF anchors to: a penalty there holds what the demonstrations taught while the "
        "traffic teaches the rest.")
    entropy_coef: float = Field(default=0.0, ge=0, description="Weight of an entropy bonus.")
    kl_metric: bool = Field(
        default=True, description="Log the KL to the reference every step even when kl_coef is 0 (one forward without gradients)."
    )
    team_credit: bool = Field(
        default=True,
        description="Episodes several agents act in: grpo's group statistics count every rewarded episode of the team "
        "for the task (also those this agent sat out, at their team reward, the reward of their last call), and ppo's "
        "GAE runs through every turn of the joint episode (teammates' turns valued by this agent's critic). false: "
        "each agent sees only its own calls. One agent alone: the same either way.",
    )
    # Demonstrations (POST /demonstrations): the supervised term, added to any objective
    sft_coef: float = Field(
        default=1.0, ge=0,
        description="Weight of the supervised term on demonstrations added to every step (0: demonstrations unused).",
    )
    demo_batch_size: int = Field(default=16, ge=1, description="Demonstrations per step (taken in turn when there are more).")
    cold_start_steps: int = Field(
        default=0, ge=0,
        description="While no batch of rollouts is ready, train the first this many steps on demonstrations alone.",
    )
    sft_coef_final: float | None = Field(
        default=None, ge=0,
        description="The demonstrations' weight after sft_decay_steps steps past the cold start (linear from sft_coef; "
        "absent: sft_coef throughout).")
    sft_decay_steps: int = Field(default=0, ge=0, description="Steps over which sft_coef moves to sft_coef_final.")
    demo_replay: Literal["every_step", "failed_groups"] = Field(
        default="every_step",
        description="every_step: demo_batch_size demonstrations in every step; failed_groups: in proportion to the "
        "share of the step's groups in which no episode succeeded (none when every group found a success), the "
        "guidance of LUFFY and BREAD (the cold start is unchanged).")
    success_reward: float = Field(
        default=1.0, description="A reward at least this is a success: what self_imitation replays and what a failed "
        "group lacks.")
    self_imitation: SelfImitationSection = Field(default_factory=SelfImitationSection)


class GuardSection(ConfigModel):
    """A step that makes the agent much worse at its own demonstrations (their per-token NLL, measured
    before and after each update) or, with ``max_kl``, moves its policy too far on its own samples is
    undone before it is published."""

    demonstrations: int = Field(
        default=64, ge=0, description="The agent's first this many demonstrations are scored around every step (0: no guard).",
    )
    corrections: bool = Field(
        default=False, description="Users' corrections (demonstrations made from feedback) are scored with them. Off: the "
        "guard scores the hand-written demonstrations alone: a correction is of a call the agent got wrong, so its NLL "
        "starts high and, pooled in, would hide a rise on the others (in a demo run with corrections the pooled NLL "
        "was 0.02-0.06 a token against the hand-written ones' 0.003); each also costs a forward pass a step.",
    )
    max_ratio: float = Field(
        default=2.0, ge=1, description="An update is refused when their NLL after it exceeds max_ratio x before + slack.",
    )
    slack: float = Field(default=0.002, ge=0, description="Nats per token an update may add on top of max_ratio.")
    retries: int = Field(
        default=1, ge=0, description="A refused update is redone this many times, each at half the learning rate of the "
        "last; when all are refused the step keeps the weights it started from (its data is consumed).",
    )
    max_kl: float | None = Field(
        default=None, gt=0, description="Also refuse an update after which the step's own sampled tokens' mean KL from "
        "the policy before it (k3, nats per token) exceeds this: a step that throws a policy away, with or without "
        "demonstrations. Costs two forward passes over the batch. null: off.",
    )


class LateRewardsSection(ConfigModel):
    """What the Trainer does with a reward sent after its experience was trained on (``reward_ledger``)."""

    mode: Literal["record", "retrain"] = Field(
        default="record",
        description="record: kept with its history (the release gate and canary read it), not trained again; retrain: "
        "trained again in the agent's next step, off-policy (the ratio against the Trainer's own policy, the gap to "
        "the recorded logprobs corrected by importance weights truncated at algorithm.grpo.importance_cap), within "
        "staleness.max_staleness versions of the one that sampled it, once per late reward.")
    agents: dict[str, Literal["record", "retrain"]] = Field(default_factory=dict, description="Per agent, over mode.")
    max_per_step: int = Field(default=64, ge=1, description="retrain: late rewards handled in one step at most.")

    def mode_of(self, agent: str) -> str:
        return self.agents.get(agent, self.mode)


class StalenessSection(ConfigModel):
    max_staleness: int = Field(default=4, ge=0, description="Experiences from more versions back than this are stale.")
    policy: Literal["discard", "downweight"] = Field(default="discard", description="What happens to stale experiences.")
    downweight: float = Field(default=0.5, gt=0, le=1, description="downweight: factor per version beyond max_staleness.")
    catch_up_max_rows: int = Field(
        default=1024, ge=0,
        description="Catch-up on a backlog (a Trainer that was down, or slower than the traffic): while more committed "
        "experiences wait than the coming steps can take before they pass max_staleness, a step takes as many as "
        "it needs so that every one is trained in time, up to this many (train_batch_size at least). No trained "
        "batch is ever more than max_staleness versions off the policy that made it; what still cannot be "
        "trained in time is stale as before. 0: off (steps of train_batch_size, a backlog mostly goes stale).",
    )


class BatchRules(Protocol):
    """The settings the batch rules read (services/trainer/batches.py); a TrainerConfig is one."""

    train_batch_size: int
    save_interval: int
    staleness: StalenessSection
    guard: GuardSection

    @property
    def algorithm(self) -> ObjectiveSection: ...
