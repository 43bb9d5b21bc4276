"""What a recipe is, what it gets from the learner, and the inputs every clipped-ratio loss shares.

A recipe owns its objective: its config section (``algorithm.<name>``, a ``RecipeConfig``), whether
it needs a reward, how it picks a batch from the usable rows, what extra inputs a micro-batch
carries (``extra_inputs``, e.g. a teacher's logprobs of the sampled tokens), its loss (a pure
function under services/trainer/algorithms/) and the statistics it reports. The learner, the step
record, the Trainer's /metrics and the dashboard pass those statistics through without naming them.

A recipe's module imports no torch at its top: the Trainer's driver builds recipes to select batches
and loads no torch (about 2 s of every start); the tensor work (``extra_inputs``, ``loss``) imports
it where it runs, in the learners.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol, Sequence

from services.common.config import ConfigModel
from services.common.records import CommittedExperience
from services.trainer.batches import Norms, Selection, TeamEpisodes, TrainItem, Usable, take_oldest
from services.trainer.sections import ObjectiveSection

if TYPE_CHECKING:
    import torch


class RecipeConfig(ConfigModel):
    """A recipe's own settings, the section ``algorithm.<recipe name>`` (none by default)."""


class Scorer(Protocol):
    """What the learner lends ``Recipe.extra_inputs``: scoring without gradients."""

    def logprobs(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                 temperatures: Sequence[float], *, adapter: bool = True, model: str | None = None,
                 version: int | None = None) -> torch.Tensor:
        """(B, R) logprobs of ``responses`` after ``prompts`` (R the longest response, zero past
        each row's end), under the agent's adapter as it was before this step's update (``adapter``)
        or the base model; or under ``model``, the path of another model that shares the agent's
        tokenizer (a teacher), loaded once. With ``version`` (and ``adapter``): under the agent's
        adapter as published in that version (the one that sampled the tokens) when ``has_version``
        says it is at hand, else as before this step."""
        ...

    def top_logprobs(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                     temperatures: Sequence[float], k: int, *, adapter: bool = True, model: str | None = None,
                     version: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``logprobs``' (B, R), and at each response position the k likeliest tokens: their (B, R, k)
        logprobs (zero past each row's end) and (B, R, k) ids (a teacher's distribution, in brief)."""
        ...

    def has_version(self, version: int) -> bool:
        """Whether ``version=`` scores under that version's own weights: it is the policy's version before
        this step, or its published adapter can be read (a version retention deleted cannot)."""
        ...


# The key of ``extra_inputs``' answer that asks the learner's forward for more logprobs: (B, R, k) token
# ids, whose logprobs under the policy (with gradients) reach the loss as ``MicroBatch.gathered``.
GATHER_IDS = "gather_ids"


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
    rewards: torch.Tensor  # (B,) (0 where a recipe that needs none trains a row without one)
    hidden: torch.Tensor | None  # (B, R, H) final hidden states, for recipes with a critic
    value_head: Callable[[torch.Tensor], torch.Tensor] | None  # (B, R, H) -> (B, R)
    norms: Norms
    objective: ObjectiveSection
    sequence_level: bool  # the whole response is one action
    key: int  # this micro-batch's index in the step
    first_epoch: bool
    cache: dict[Any, Any] = field(default_factory=dict)  # lives for one step (e.g. PPO's old values)
    value_mask: torch.Tensor | None = None  # (B, R) where a critic learns: mask plus the first token of context calls
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # the recipe's extra_inputs, computed once a step
    gathered: torch.Tensor | None = None  # (B, R, k) policy logprobs of extra[GATHER_IDS], with gradients

    @property
    def own(self) -> torch.Tensor:
        """(B,) 1 for this agent's calls, 0 for teammates' context calls."""
        import torch

        return torch.tensor([0.0 if it.context else 1.0 for it in self.items], device=self.mask.device)

    @property
    def advantages(self) -> torch.Tensor:
        """(B,) advantages set at selection."""
        import torch

        return torch.tensor([it.advantage for it in self.items], device=self.mask.device)


class Recipe(Protocol):
    name: ClassVar[str]  # algorithm.name, and the key of its config section algorithm.<name>
    Config: ClassVar[type[RecipeConfig]]
    legacy_keys: ClassVar[dict[str, str]]  # flat algorithm.<key> of older configs -> its key in the section
    needs_reward: ClassVar[bool]  # rows without a reward are discarded before select (else they reach it)
    uses_critic: ClassVar[bool]  # needs a value head on the policy
    uses_ratio: ClassVar[bool]  # clipped importance ratio against the sampling logprobs (and the KL penalty)
    team_rewards: ClassVar[bool]  # its group statistics count the team's episodes: select gets their rewards
    retrains_late: ClassVar[bool]  # implements late_items (late_rewards: retrain)
    reads_hints: bool  # its loss learns from hints: a hint that arrives while a step trains its call redoes the step
    config: RecipeConfig
    objective: ObjectiveSection

    def refuses(self, row: CommittedExperience) -> str | None:
        """Why this otherwise usable row is not for this objective (it is discarded), or None."""
        ...

    def select(self, usable: list[Usable], *, batch_size: int, now: datetime, sel: Selection, team: TeamEpisodes) -> None:
        """Fill ``sel.items`` (oldest first, advantages where known now), or leave it empty to wait.
        ``team``: the team's episode rewards of the usable rows' tasks (empty unless ``team_rewards``)."""
        ...

    def late_items(self, rows: list[CommittedExperience], *, team: TeamEpisodes) -> tuple[list[TrainItem], dict[str, str]]:
        """Already-trained rows whose reward came late, as items to train again (``late=True``, advantages
        from the latest rewards), and {experience_id: why not} for the rest. ``team``: the episodes of
        their tasks, with their latest rewards. Only with ``retrains_late``."""
        ...

    def extra_inputs(self, items: list[TrainItem], scorer: Scorer) -> dict[str, torch.Tensor]:
        """Tensors the loss needs beyond the policy's forward ((B, R) each, in ``items``' order),
        computed once per micro-batch and step, before any update; ``MicroBatch.extra``."""
        ...

    def loss(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The micro-batch's share of the batch loss, and its statistics: shares of the batch's
        figures or sums, added over micro-batches and learners (``loss`` is the total's)."""
        ...

    def statistics(self, sums: dict[str, float], *, tokens: float) -> dict[str, float]:
        """The step record's figures from the summed statistics of ``loss`` (``tokens``: response
        tokens trained on)."""
        ...

    def inert(self, item: TrainItem) -> bool:
        """Whether ``item``'s term of ``loss`` is exactly zero whatever the weights (a GRPO call of a group
        whose runs all scored alike, advantage 0): the learner still scores it, for the step's figures,
        but computes no gradient for it."""
        ...


class BaseRecipe:
    """The defaults a recipe may keep: no section, a reward needed, no critic, the oldest rows,
    no extra inputs, the statistics as summed."""

    name: ClassVar[str]
    Config: ClassVar[type[RecipeConfig]] = RecipeConfig
    legacy_keys: ClassVar[dict[str, str]] = {}
    needs_reward: ClassVar[bool] = True
    uses_critic: ClassVar[bool] = False
    uses_ratio: ClassVar[bool] = False
    team_rewards: ClassVar[bool] = False
    retrains_late: ClassVar[bool] = False
    reads_hints: bool = False

    def __init__(self, config: RecipeConfig, objective: ObjectiveSection):
        self.config = config
        self.objective = objective

    def refuses(self, row: CommittedExperience) -> str | None:
        return None

    def select(self, usable: list[Usable], *, batch_size: int, now: datetime, sel: Selection, team: TeamEpisodes) -> None:
        take_oldest(usable, batch_size=batch_size, sel=sel)

    def extra_inputs(self, items: list[TrainItem], scorer: Scorer) -> dict[str, torch.Tensor]:
        return {}

    def statistics(self, sums: dict[str, float], *, tokens: float) -> dict[str, float]:
        return dict(sums)

    def inert(self, item: TrainItem) -> bool:
        return False


def ratio_inputs(mb: MicroBatch, advantages: torch.Tensor) -> tuple[dict[str, torch.Tensor], float]:
    """The keyword inputs of a clipped-ratio loss and their normalizer, at token or sequence level.

    ``advantages``: (B,) one per response, or (B, R) one per token.
    """
    from services.trainer.algorithms.advantages import sequence_logprob

    if mb.sequence_level:
        mode = mb.objective.sequence_logprob
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


def clip_args(o: ObjectiveSection) -> dict[str, float]:
    return dict(clip_low=o.clip_low, clip_high=o.clip_high)
