"""What a recipe is, what it gets from the learner, and the inputs every clipped-ratio loss shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from services.common.records import CommittedExperience
from services.trainer.algorithms.advantages import sequence_logprob
from services.trainer.batches import Norms, Selection, TeamEpisodes, TrainItem, Usable

if TYPE_CHECKING:
    from services.trainer.config import AlgorithmSection, TrainerConfig


@dataclass
class MicroBatch:
    """One micro-batch after the policy's forward pass, as a recipe's ``loss`` sees it.

    Shapes: B sequences, R the longest response; every (B, R) tensor is masked by ``mask``.
    """

    items: list[TrainItem]
    logprobs: torch.Tensor  # (B, R) under the policy, with gradients
    old_logprobs: torch.Tensor  # (B, R) recorded at sampling
    mask: torch.Tensor  # (B, R) 1 on the response tokens the policy is trained on (not teammates' context calls)
    weights: torch.Tensor  # (B,) staleness weights
    rewards: torch.Tensor  # (B,)
    hidden: torch.Tensor | None  # (B, R, H) final hidden states, for recipes with a critic
    value_head: Callable[[torch.Tensor], torch.Tensor] | None  # (B, R, H) -> (B, R)
    norms: Norms
    algorithm: "AlgorithmSection"
    sequence_level: bool  # the whole response is one action
    key: int  # this micro-batch's index in the step
    first_epoch: bool
    cache: dict[Any, Any] = field(default_factory=dict)  # lives for one step (e.g. PPO's old values)
    value_mask: torch.Tensor | None = None  # (B, R) where a critic learns: mask plus the first token of context calls

    @property
    def own(self) -> torch.Tensor:
        """(B,) 1 for this agent's calls, 0 for teammates' context calls."""
        return torch.tensor([0.0 if it.context else 1.0 for it in self.items], device=self.mask.device)

    @property
    def advantages(self) -> torch.Tensor:
        """(B,) advantages set at selection."""
        return torch.tensor([it.advantage for it in self.items], device=self.mask.device)


class Recipe(Protocol):
    name: str
    uses_critic: bool  # needs a value head on the policy
    uses_ratio: bool  # clipped importance ratio against the sampling logprobs (and the KL penalty)
    team_rewards: bool  # its group statistics count the team's episodes: select gets their rewards

    def refuses(self, row: CommittedExperience, cfg: "TrainerConfig") -> str | None:
        """Why this otherwise usable row is not for this objective (it is discarded), or None."""
        ...

    def select(self, usable: list[Usable], *, cfg: "TrainerConfig", now: datetime, sel: Selection,
               team: TeamEpisodes) -> None:
        """Fill ``sel.items`` (oldest first, advantages where known now), or leave it empty to wait.
        ``team``: the team's episode rewards of the usable rows' tasks (empty unless ``team_rewards``)."""
        ...

    def loss(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's share of the batch loss, and its statistics (StepStats field names)."""
        ...


def ratio_inputs(mb: MicroBatch, advantages: torch.Tensor) -> tuple[dict[str, torch.Tensor], float]:
    """The keyword inputs of a clipped-ratio loss and their normalizer, at token or sequence level.

    ``advantages``: (B,) one per response, or (B, R) one per token.
    """
    if mb.sequence_level:
        mode = mb.algorithm.sequence_logprob
        adv = advantages if advantages.dim() == 1 else advantages[:, 0]
        return dict(
            logprobs=sequence_logprob(mb.logprobs, mb.mask, mode=mode),
            old_logprobs=sequence_logprob(mb.old_logprobs, mb.mask, mode=mode),
            advantages=adv, mask=mb.own, weights=mb.weights,
        ), mb.norms.sequences
    tok_adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1).expand_as(mb.mask)
    return dict(
        logprobs=mb.logprobs, old_logprobs=mb.old_logprobs, advantages=tok_adv, mask=mb.mask,
        weights=mb.weights.unsqueeze(-1),
    ), mb.norms.tokens


def clip_args(a: "AlgorithmSection") -> dict[str, float]:
    return dict(clip_low=a.clip_low, clip_high=a.clip_high)
