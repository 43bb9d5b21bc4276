"""What one training step measured, as one typed record that crosses from the learners to the
driver: additive sums over a learner's shard, merged over learners by ``StepStats.merged``. The
figures every objective has are fields; the objective's own (its recipe's ``loss`` statistics) are
``objective``, summed by name and turned into the step record's figures by the recipe itself."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, fields
from typing import Any

from services.trainer.batches import Norms, Selection, episodes_of
from services.trainer.recipes.base import Recipe


_SAME_ON_ALL = {"lr", "guard_before", "guard_after", "guard_attempts", "guard_refused", "guard_kl"}


@dataclass
class StepStats:
    tokens: float = 0.0  # response tokens trained on
    loss: float = 0.0
    entropy_sum: float = 0.0
    kl_sum: float | None = None  # KL to the reference (kl_reference), summed over tokens (kl_metric or kl_coef)
    kl_loss: float | None = None  # the KL penalty (kl_coef > 0)
    demo_nll: float | None = None  # the supervised term on demonstrations (its share of their token mean)
    objective: dict[str, float] = field(default_factory=dict)  # the recipe's loss statistics, summed by name
    # First epoch only: how far the policy's logprobs are from those recorded at sampling
    mismatch_sum: float = 0.0
    mismatch_on_policy_sum: float = 0.0
    on_policy_tokens: float = 0.0
    # The update
    grad_norm: float = 0.0
    lr: float = 0.0
    learner_seconds: float = 0.0
    inert_calls: float = 0.0  # calls whose term of the loss is exactly zero: scored without gradients (Recipe.inert)
    # The guard (TrainerConfig.guard): the demonstrations' NLL per token around the update; every
    # learner holds the same weights and scores the whole guard set, so these are the same on all
    guard_before: float | None = None
    guard_after: float | None = None  # of the update kept (or of the last refused one)
    guard_attempts: float | None = None  # updates tried (1: the first passed)
    guard_refused: float | None = None  # 1: every attempt was refused; the weights are those before the step
    guard_kl: float | None = None  # guard.max_kl: the policy's move on the step's own samples (all-reduced)
    guard_seconds: float | None = None  # scoring the guard set, before and after each attempt (summed over learners)

    def add(self, values: dict[str, float], scale: float = 1.0) -> None:
        """Add ``values`` (StepStats field names; an unknown name is a bug) times ``scale``."""
        for k, v in values.items():
            now = getattr(self, k)  # AttributeError names the unknown statistic
            setattr(self, k, (now or 0.0) + float(v) * scale)

    def add_objective(self, values: dict[str, float], scale: float = 1.0) -> None:
        for k, v in values.items():
            self.objective[k] = self.objective.get(k, 0.0) + float(v) * scale

    @classmethod
    def merged(cls, parts: list["StepStats"]) -> "StepStats":
        """Sums over learners; the gradient norm is the largest; the learning rate and the guard's
        figures the first's (the same on every learner)."""
        out = cls()
        for f in fields(cls):
            present = [getattr(p, f.name) for p in parts if getattr(p, f.name) is not None]
            if f.name == "objective":
                for p in parts:
                    out.add_objective(p.objective)
            elif f.name == "grad_norm":
                out.grad_norm = max(present, default=0.0)
            elif f.name in _SAME_ON_ALL:
                if present:
                    setattr(out, f.name, present[0])
            elif present:
                setattr(out, f.name, sum(present))
        return out


def step_record(*, agent: str, step: int, version: int, algorithm: str, recipe: Recipe, published: int,
                selection: Selection, total: StepStats, norms: Norms, seconds: float) -> dict[str, Any]:
    """One line of the metrics log and of trainer_steps.metrics: the figures every step has, then
    the objective's own (its recipe's ``statistics``, named in ``objective_figures``)."""
    tokens = max(total.tokens, 1.0)
    items = selection.items
    rewards = [i.reward for i in items if i.reward is not None]  # none in a cold-start step (demonstrations only)
    lags = [published - i.model_version for i in items] or [0]
    rec: dict[str, Any] = {
        "agent": agent, "step": step, "version": version, "algorithm": algorithm,
        "batch_size": len(items), "tokens": int(norms.tokens), "demonstrations": len(selection.demonstrations),
        "episodes": len(episodes_of(items)),
        "reward_mean": statistics.fmean(rewards) if rewards else None,
        "reward_std": statistics.pstdev(rewards) if rewards else None,
        "loss": total.loss, "entropy": total.entropy_sum / tokens,
        "tokens_per_s": total.tokens / max(seconds, 1e-9), "step_seconds": seconds,
        "grad_norm": total.grad_norm, "lr": total.lr,
        "staleness_mean": statistics.fmean(lags), "staleness_max": max(lags),
        "stale_downweighted": selection.stale_downweighted, "discarded": len(selection.discarded),
        "small_groups": selection.small_groups, "catch_up": selection.catch_up,
        "team_episodes": selection.team_episodes, "teammate_turns": len(selection.context),
        "logprob_mismatch": total.mismatch_sum / tokens,
        "inert_calls": int(total.inert_calls),
        "imitations": len(selection.imitations), "groups": selection.groups, "failed_groups": selection.failed_groups,
        "late_retrained": len(selection.late),  # calls trained again for a late reward; and those left as recorded:
        "late_not_retrained": len({lid for lid, w in selection.late_outcomes.items() if w}),
    }
    if total.demo_nll is not None:
        rec["demo_nll"] = total.demo_nll
    if total.guard_before is not None:
        rec["guard_nll_before"], rec["guard_nll_after"] = total.guard_before, total.guard_after
    if total.guard_kl is not None:
        rec["guard_kl"] = total.guard_kl
    if total.guard_attempts is not None:
        rec["guard_attempts"], rec["guard_refused"] = int(total.guard_attempts), bool(total.guard_refused)
    if total.guard_seconds is not None:
        rec["guard_seconds"] = total.guard_seconds
    if total.kl_loss is not None:
        rec["kl_loss"] = total.kl_loss
    if total.kl_sum is not None:
        rec["kl"] = total.kl_sum / tokens
    if total.on_policy_tokens:
        rec["logprob_mismatch_on_policy"] = total.mismatch_on_policy_sum / total.on_policy_tokens
    if items and items[0].advantage is not None:  # set at selection (GRPO)
        adv = [i.advantage for i in items]
        rec["advantage_mean"], rec["advantage_std"] = statistics.fmean(adv), statistics.pstdev(adv)
    # the objective's own figures, passed through: of its choice of the batch, and of its loss
    own = {**selection.figures, **recipe.statistics(total.objective, tokens=total.tokens)}
    rec.update(own)
    rec["objective_figures"] = sorted(own)
    return rec
