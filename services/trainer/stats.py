"""What one training step measured, as one typed record that crosses from the learners to the
driver: additive sums over a learner's shard, merged over learners by ``StepStats.merged``."""

from __future__ import annotations

from dataclasses import dataclass, fields


_SAME_ON_ALL = {"lr", "guard_before", "guard_after", "guard_attempts", "guard_refused"}


@dataclass
class StepStats:
    tokens: float = 0.0  # response tokens trained on
    loss: float = 0.0
    entropy_sum: float = 0.0
    kl_sum: float | None = None  # KL to the base model, summed over tokens (kl_metric or kl_coef)
    # From the recipe's loss (None when the objective has no such term)
    policy_loss: float | None = None
    value_loss: float | None = None
    kl_loss: float | None = None
    clip_frac: float | None = None
    ratio_mean: float | None = None
    nll: float | None = None
    demo_nll: float | None = None  # the supervised term on demonstrations (its share of their token mean)
    adv_sum: float | None = None  # recipes that compute advantages in the learner (PPO)
    adv_sq_sum: float | None = None
    adv_count: float | None = None
    value_sum: float | None = None
    # First epoch only: how far the policy's logprobs are from those recorded at sampling
    mismatch_sum: float = 0.0
    mismatch_on_policy_sum: float = 0.0
    on_policy_tokens: float = 0.0
    # The update
    grad_norm: float = 0.0
    lr: float = 0.0
    learner_seconds: float = 0.0
    # The guard (TrainerConfig.guard): the demonstrations' NLL per token around the update; every
    # learner holds the same weights and scores the whole guard set, so these are the same on all
    guard_before: float | None = None
    guard_after: float | None = None  # of the update kept (or of the last refused one)
    guard_attempts: float | None = None  # updates tried (1: the first passed)
    guard_refused: float | None = None  # 1: every attempt was refused; the weights are those before the step

    def add(self, values: dict[str, float], scale: float = 1.0) -> None:
        """Add ``values`` (StepStats field names; an unknown name is a bug) times ``scale``."""
        for k, v in values.items():
            now = getattr(self, k)  # AttributeError names the unknown statistic
            setattr(self, k, (now or 0.0) + float(v) * scale)

    @classmethod
    def merged(cls, parts: list["StepStats"]) -> "StepStats":
        """Sums over learners; the gradient norm is the largest; the learning rate and the guard's
        figures the first's (the same on every learner)."""
        out = cls()
        for f in fields(cls):
            present = [getattr(p, f.name) for p in parts if getattr(p, f.name) is not None]
            if f.name == "grad_norm":
                out.grad_norm = max(present, default=0.0)
            elif f.name in _SAME_ON_ALL:
                if present:
                    setattr(out, f.name, present[0])
            elif present:
                setattr(out, f.name, sum(present))
        return out
