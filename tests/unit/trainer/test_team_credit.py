"""PPO's credit through a joint episode: teammates' turns are steps of the trajectory, valued by this
agent's critic, and never trained by its policy loss (worked by hand in the comments)."""

from __future__ import annotations

import pytest
import torch

from services.common.config import load_config
from services.trainer.batches import Norms, TrainItem, episodes_of
from services.trainer.config import TrainerConfig
from services.trainer.recipes.base import MicroBatch, ratio_inputs
from services.trainer.recipes.ppo import PPOConfig, _episode_credit

CREDIT = PPOConfig(gamma=1.0, lam=0.5)

approx = lambda x: pytest.approx(x, abs=1e-5)  # noqa: E731


def item(seq: int, length: int, *, context: bool = False, reward: float = 1.0) -> TrainItem:
    return TrainItem(experience_id=f"e{seq}", task_id="t", run_id="r", model_version=0, prompt_ids=[1],
                     response_ids=[5] * length, old_logprobs=[-1.0] * length, reward=0.0 if context else reward,
                     temperature=1.0, seq=seq, weight=0.0 if context else 1.0, context=context)


def micro(items: list[TrainItem], values: list[list[float]], *, level: str) -> tuple[MicroBatch, torch.Tensor]:
    cfg = load_config(TrainerConfig, None, ["model.path=/m", "algorithm.name=ppo", f"algorithm.level={level}",
                                            "algorithm.ppo.gamma=1.0", "algorithm.ppo.lam=0.5"], env={})
    R = max(len(i.response_ids) for i in items)
    full = torch.tensor([[1.0] * len(i.response_ids) + [0.0] * (R - len(i.response_ids)) for i in items])
    own = torch.tensor([0.0 if i.context else 1.0 for i in items]).unsqueeze(-1)
    old = torch.tensor([v + [0.0] * (R - len(v)) for v in values])
    mb = MicroBatch(items=items, logprobs=torch.zeros_like(full), old_logprobs=torch.zeros_like(full), mask=full * own,
                    weights=torch.tensor([i.weight for i in items]), rewards=torch.tensor([i.reward for i in items]),
                    hidden=None, value_head=None, norms=Norms.of(items), objective=cfg.algorithm,
                    sequence_level=level == "sequence", key=0, first_epoch=True, value_mask=full)
    return mb, old


def test_turn_level_credit_runs_through_the_teammates_turns():
    # Joint episode: A (V 0.5), B (V 0.2), A (V 0.1), B (V 0.4), then A's reward 1. gamma 1, lam 0.5:
    #   delta3 = 1 - 0.4 = 0.6          A3 = 0.6
    #   delta2 = 0.4 - 0.1 = 0.3        A2 = 0.3 + 0.5 * 0.6 = 0.6
    #   delta1 = 0.1 - 0.2 = -0.1       A1 = -0.1 + 0.5 * 0.6 = 0.2
    #   delta0 = 0.2 - 0.5 = -0.3       A0 = -0.3 + 0.5 * 0.2 = -0.2
    # A's turns get -0.2 and 0.6; returns A + V = 0.3, 0.4, 0.7, 1.0 train the critic on all four.
    # Over A's own turns alone (0.5, 0.1) A's turns would get 0.05 and 0.9.
    items = [item(0, 2), item(1, 1, context=True), item(2, 1), item(3, 1, context=True)]
    mb, old = micro(items, [[0.5, 0.0], [0.2], [0.1], [0.4]], level="sequence")
    adv, ret = _episode_credit(mb, old, episodes_of(items), CREDIT)
    assert adv[0] == approx(-0.2) and adv[2] == approx(0.6)
    assert ret.tolist() == [approx(0.3), approx(0.4), approx(0.7), approx(1.0)]
    inputs, normalizer = ratio_inputs(mb, adv)
    assert inputs["mask"].tolist() == [1.0, 0.0, 1.0, 0.0] and normalizer == 2  # the policy acts in A's turns only


def test_token_level_credit_treats_a_teammates_turn_as_one_step():
    # A's first call has two tokens (V 0.5, 0.3), B's turn one step (V 0.2), A's second call one token
    # (V 0.1), reward 1 at the end; gamma 1, lam 0.5 over the flat sequence 0.5, 0.3, 0.2, 0.1:
    #   A3 = 1 - 0.1 = 0.9
    #   A2 = (0.1 - 0.2) + 0.5 * 0.9 = 0.35
    #   A1 = (0.2 - 0.3) + 0.5 * 0.35 = 0.075
    #   A0 = (0.3 - 0.5) + 0.5 * 0.075 = -0.1625
    items = [item(0, 2), item(1, 1, context=True), item(2, 1)]
    mb, old = micro(items, [[0.5, 0.3], [0.2], [0.1]], level="token")
    adv, ret = _episode_credit(mb, old, episodes_of(items), CREDIT)
    assert adv[0].tolist() == [approx(-0.1625), approx(0.075)] and adv[2, 0] == approx(0.9)
    assert ret[1, 0] == approx(0.55)  # B's turn: A2 + V = 0.35 + 0.2, what the critic learns there
    assert mb.mask.sum() == 3 and mb.value_mask.sum() == 4  # B's token is the critic's, not the policy's


def test_the_reward_is_this_agents_own():
    # B's call ends the episode carrying its own reward 0 (a per-agent reward); A's reward is 1.
    items = [item(0, 1, reward=1.0), item(1, 1, context=True)]
    items[1].reward = 0.0
    mb, old = micro(items, [[0.0], [0.0]], level="sequence")
    adv, _ = _episode_credit(mb, old, episodes_of(items), CREDIT)
    assert adv[0] == approx(0.5)  # lam 0.5: delta1 = 1, A1 = 1; A0 = 0 + 0.5 * 1
