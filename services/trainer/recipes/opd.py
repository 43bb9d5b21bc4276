"""OPD: on-policy self-distillation from hints. Calls that got a hint as feedback (``POST /feedback``
with ``hint``) are trained towards what the agent itself would have sampled had it read the hint: the
teacher is the policy (or the base model) given the conversation plus the hint, scoring the tokens the
agent actually sampled; each token's advantage is the teacher's logprob minus the sampled one
(services/trainer/algorithms/distill.py), under the clipped ratio of PPO, token by token (whatever ``algorithm.level``). No reward is needed; calls
without a hint are set aside (``grpo`` with ``hint_coef`` learns from rewards and hints together)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from services.common.records import CommittedExperience
from services.trainer.batches import TrainItem
from services.trainer.recipes.base import BaseRecipe, MicroBatch, Scorer, clip_args
from services.trainer.recipes.hints import (
    HintSettings,
    hint_advantage,
    hint_figures,
    hint_statistics,
    hint_top_k_loss,
    teacher_inputs,
    trained_hint_advantage,
)

if TYPE_CHECKING:
    import torch


class OPDConfig(HintSettings):
    coef: float = Field(default=1.0, gt=0, description="Scale of the distillation advantage.")


class OPD(BaseRecipe):
    name = "opd"
    Config = OPDConfig
    needs_reward = False
    uses_ratio = True
    config: OPDConfig

    reads_hints = True

    def refuses(self, row: CommittedExperience) -> str | None:
        if row.hint and row.hint.get("prompt_token_ids"):
            return None
        return "no hint: algorithm opd learns from hinted calls only (grpo with hint_coef takes rewards too)"

    def extra_inputs(self, items: list[TrainItem], scorer: Scorer) -> dict[str, torch.Tensor]:
        return teacher_inputs(items, scorer, self.config.teacher, self.config.top_k)

    def loss(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        from services.trainer.algorithms.grpo import grpo_loss  # the learner's half (the driver loads no torch)

        adv, mask = hint_advantage(mb, clip=self.config.hint_clip, skip=self.config.hint_skip_first)
        trained = trained_hint_advantage(adv, mask, self.config.hint_baseline)
        # each token is an action here, whatever algorithm.level says: the teacher grades every token
        loss, stats = grpo_loss(logprobs=mb.logprobs, old_logprobs=mb.old_logprobs, advantages=trained * self.config.coef,
                                mask=mask, weights=mb.weights.unsqueeze(-1), normalizer=mb.norms.tokens,
                                **clip_args(mb.objective))
        stats = {**stats, **hint_statistics(mb, adv, mask)}
        if self.config.top_k:
            top, figures = hint_top_k_loss(mb, self.config.top_k_coef, self.config.hint_skip_first)
            loss, stats = loss + top, {**stats, **figures}
        return loss, stats

    def statistics(self, sums: dict[str, float], *, tokens: float) -> dict[str, float]:
        return hint_figures(sums)
