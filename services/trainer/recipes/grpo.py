"""GRPO over episodes: batches of whole task_id groups of whole episodes (task_id + run_id), each
episode's reward relative to the other episodes of its task (the team's, when several agents act in
them), the clipped ratio."""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from services.common.records import CommittedExperience
from services.trainer.algorithms.group import batch_relative, episode_relative
from services.trainer.batches import Selection, TeamEpisodes, TrainItem, Usable, aware, to_item
from services.trainer.recipes.base import BaseRecipe, MicroBatch, Scorer, clip_args, ratio_inputs
from services.trainer.recipes.hints import (
    HintSettings,
    hint_advantage,
    hint_figures,
    hint_statistics,
    hint_top_k_loss,
    teacher_inputs,
    trained_hint_advantage,
)
from services.trainer.sections import ObjectiveSection

if TYPE_CHECKING:
    import torch


class GRPOConfig(HintSettings):
    std_normalize: bool = Field(default=True, description="Divide group-centred rewards by the group std.")
    min_group_size: int = Field(default=2, ge=1, description="Smallest group trained as a group.")
    group_size: int | None = Field(
        default=None, ge=1, description="A group this large is complete at once; smaller ones wait group_wait_s."
    )
    group_wait_s: float = Field(default=30.0, ge=0, description="How long an incomplete group waits for more runs.")
    small_groups: Literal["wait", "discard", "batch"] = Field(
        default="batch",
        description="After group_wait_s, groups under min_group_size keep waiting, are discarded, "
        "or are trained against the batch mean.",
    )
    flat_groups: Literal["keep", "discard", "baseline"] = Field(
        default="keep",
        description="Groups whose episodes all scored the same carry no group-relative signal: keep (trained with "
        "advantage 0: only the KL, entropy and supervised terms move them), discard (set aside, and the step is "
        "filled with groups that carry signal: DAPO's dynamic sampling), or baseline (advantage = reward - "
        "flat_baseline: an all-wrong group still pushes its answers down, an all-right one up).",
    )
    flat_baseline: float = Field(default=0.5, description="flat_groups=baseline: the fixed baseline of a flat group.")
    flat_max_set_aside: int = Field(
        default=0, ge=0, description="flat_groups=discard: at most this many flat groups are set aside between two steps; "
        "past it the flat groups are kept as with keep, so the step comes (and replays the demonstrations) even while the "
        "policy rarely succeeds, as DAPO caps its generation batches; they come after every group with signal the poll "
        "holds. 0: no bound (a step waits for groups with signal). Unused unless flat_groups=discard.")
    aggregation: Literal["token", "sequence"] = Field(
        default="token", description="Token level: the loss is the mean over the batch's tokens (DAPO) or over its "
        "responses, each response's tokens averaged first (the original GRPO).")
    importance: Literal["off", "truncate", "mask"] = Field(
        default="off", description="Token level: the clipped ratio against the Trainer's own policy before the step "
        "(proximal), and the gap to the sampling engine's recorded logprobs (stale versions, engine/trainer "
        "mismatch) corrected by importance weights truncated at importance_cap, or masked above it (off: the "
        "ratio against the recorded logprobs, as in PPO).")
    importance_cap: float = Field(default=2.0, gt=1, description="importance: the largest weight kept.")
    hint_coef: float = Field(
        default=0.0, ge=0, description="Token level: add this times the distillation advantage of calls that got a hint "
        "(on-policy self-distillation, see opd) to their reward's advantage; 0: hints unused. Calls with a hint "
        "and no reward are set aside (algorithm opd learns from them).")


class GRPO(BaseRecipe):
    name = "grpo"
    Config = GRPOConfig
    legacy_keys = {k: k for k in ("std_normalize", "min_group_size", "group_size", "group_wait_s", "small_groups")}
    uses_ratio = True
    team_rewards = True
    retrains_late = True
    config: GRPOConfig

    def __init__(self, config: GRPOConfig, objective: ObjectiveSection):
        if config.hint_coef > 0 and objective.level != "token":
            raise ValueError("algorithm.grpo.hint_coef teaches each token of a hinted call (algorithm.level must be token)")
        super().__init__(config, objective)

    def late_items(self, rows: list[CommittedExperience], *, team: TeamEpisodes) -> tuple[list[TrainItem], dict[str, str]]:
        """Each late row's episode is valued against its group as the rewards stand now (the latest of each
        episode of its task this agent acted in, or the team's with team_credit), as ``select`` would have;
        every call of it that got the late reward is trained again with that advantage."""
        a = self.config
        episodes: dict[tuple[str | None, str | None], list[CommittedExperience]] = {}
        for r in rows:
            episodes.setdefault((r.task_id, r.run_id), []).append(r)
        items: list[TrainItem] = []
        skipped: dict[str, str] = {}
        for (task, run), calls in episodes.items():
            agent = calls[0].agent
            group = {k: ep for k, ep in (team.get(task) or {}).items() if self.objective.team_credit or agent in ep.agents}
            why = None
            if task is None or run is None or run not in group:
                why = "not an episode of a group (task_id and run_id)"
            elif len(group) < a.min_group_size:
                why = f"group of {len(group)} episodes < min_group_size {a.min_group_size}"
            else:
                runs = sorted(group)
                rewards = [float(group[k].reward) for k in runs]
                if max(rewards) == min(rewards) and a.flat_groups != "baseline":
                    why = f"no signal: every episode of the group scored {rewards[0]:g}"
                else:
                    adv = rewards[runs.index(run)] - a.flat_baseline if max(rewards) == min(rewards) \
                        else episode_relative(rewards, [0] * len(runs), std_normalize=a.std_normalize)[runs.index(run)]
            for r in sorted(calls, key=lambda r: r.seq):
                if why is not None:
                    skipped[r.experience_id] = why
                    continue
                it = to_item(r, 1.0 / len(calls))
                it.advantage, it.late = adv, True
                items.append(it)
        return items, skipped

    def inert(self, item: TrainItem) -> bool:
        """A call whose advantage is 0 (its group's runs all scored alike, flat_groups=keep): the clipped ratio
        times 0, whatever the weights; not with hints on, whose distillation term may still move it."""
        return item.advantage == 0.0 and not item.demonstration and not item.context and self.config.hint_coef == 0

    @property
    def reads_hints(self) -> bool:
        return self.config.hint_coef > 0

    def extra_inputs(self, items: list[TrainItem], scorer: Scorer) -> dict[str, torch.Tensor]:
        return teacher_inputs(items, scorer, self.config.teacher, self.config.top_k) if self.config.hint_coef > 0 else {}

    def statistics(self, sums: dict[str, float], *, tokens: float) -> dict[str, float]:
        return hint_figures(sums) if self.config.hint_coef > 0 else dict(sums)

    def select(self, usable: list[Usable], *, batch_size: int, now: datetime, sel: Selection, team: TeamEpisodes) -> None:
        """Whole groups of whole episodes, oldest first. A group (task_id) is complete at
        ``group_size`` episodes (or ``min_group_size`` without one); an incomplete one waits
        ``group_wait_s``, then is trained, discarded or trained against the batch mean
        (``small_groups``). ``train_batch_size`` counts calls.

        With ``algorithm.team_credit``, a group is the team's episodes of the task: those of
        ``team`` this agent sat out count too, at their team reward (their last call's), in the
        group's size and statistics; they carry no calls of this agent, so nothing of them is trained."""
        a, team_credit = self.config, self.objective.team_credit
        groups: dict[str, dict[str, list[Usable]]] = {}
        agent = usable[0][0].agent if usable else None
        for row, w in usable:
            episode = row.run_id if row.run_id is not None else f"__call__{row.experience_id}"
            groups.setdefault(row.task_id or f"__single__{row.experience_id}", {}).setdefault(episode, []).append((row, w))
        chosen: list[tuple[list[list[Usable]], list[float]]] = []  # (this agent's episodes, sat-out team rewards)
        fallback: list[list[Usable]] = []
        count = seen = flat = failed = 0
        set_aside_before = sel.flat_set_aside  # flat groups the polls since the last step set aside (flat_groups=discard)
        flat_chosen: set[int] = set()  # indexes into chosen of groups trained against flat_baseline
        # flat groups past flat_max_set_aside: kept, but after every group with signal this poll holds
        deferred: list[tuple[list[list[Usable]], list[float], int, bool]] = []
        success = self.objective.success_reward
        # An episode's reward is its last call's (an episode reward sent for all its calls is the same on each).
        last = lambda e: max(e, key=lambda rw: rw[0].seq)[0].reward  # noqa: E731
        for task, episodes in groups.items():  # insertion order = oldest first
            if count >= batch_size:
                break
            sat_out = [ep.reward for run, ep in (team.get(task) or {}).items()
                       if team_credit and run not in episodes and agent not in ep.agents]
            n = len(episodes) + len(sat_out)
            calls = sum(len(e) for e in episodes.values())
            age = (now - max(aware(r.updated_at) for e in episodes.values() for r, _ in e)).total_seconds()
            full = n >= a.group_size if a.group_size else n >= a.min_group_size
            if not full and age < a.group_wait_s:
                continue  # more runs of this task may still arrive
            if n >= a.min_group_size:
                rewards = [last(e) for e in episodes.values()] + sat_out
                is_flat, no_success = max(rewards) == min(rewards), max(rewards) < success
                if is_flat and a.flat_groups == "discard":
                    if not a.flat_max_set_aside or sel.flat_set_aside < a.flat_max_set_aside:
                        seen, flat, failed = seen + 1, flat + 1, failed + no_success
                        sel.flat_set_aside += 1
                        for e in episodes.values():
                            for r, _ in e:
                                sel.discarded[r.experience_id] = f"no signal: every episode of the group scored {rewards[0]:g}"
                    else:
                        deferred.append((list(episodes.values()), sat_out, calls, no_success))
                    continue
                seen, failed = seen + 1, failed + no_success
                if is_flat:
                    flat += 1
                    flat_chosen.add(len(chosen))
                chosen.append((list(episodes.values()), sat_out))
                count += calls
                sel.team_episodes += len(sat_out)
            elif a.small_groups == "discard":
                for e in episodes.values():
                    for r, _ in e:
                        sel.discarded[r.experience_id] = f"group of {n} episodes < min_group_size {a.min_group_size}"
            elif a.small_groups == "batch":
                fallback.extend(episodes.values())
                count += calls
                sel.small_groups += 1
        for own, sat_out, calls, no_success in deferred:  # the step comes even while the policy rarely succeeds
            if count >= batch_size:
                break  # left committed: the next poll meets them again
            seen, flat, failed = seen + 1, flat + 1, failed + no_success
            flat_chosen.add(len(chosen))
            chosen.append((own, sat_out))
            count += calls
            sel.team_episodes += len(sat_out)
        if count < batch_size:
            sel.team_episodes = 0
            return
        sel.groups, sel.failed_groups = seen + len(fallback), failed + sum(last(e) < success for e in fallback)
        # the groups looked at since the last step: this poll's, and the flat ones earlier polls set aside
        looked = seen + set_aside_before
        sel.figures = {"informative_groups": float(seen - flat), "flat_groups": float(flat + set_aside_before),
                       "informative_share": (seen - flat) / looked if looked else 0.0}
        if a.flat_groups == "discard":
            sel.figures["flat_set_aside"] = float(sel.flat_set_aside)
        episodes = [e for own, _ in chosen for e in own]
        rewards = [r for own, others in chosen for r in [last(e) for e in own] + others]
        gids = [g for g, (own, others) in enumerate(chosen) for _ in range(len(own) + len(others))]
        mine = [k for g, (own, others) in enumerate(chosen) for k in [1] * len(own) + [0] * len(others)]
        adv_all = episode_relative(rewards, gids, std_normalize=a.std_normalize)
        if flat_chosen and a.flat_groups == "baseline":  # no group signal: against the fixed baseline instead
            adv_all = [r - a.flat_baseline if gids[k] in flat_chosen else v for k, (v, r) in enumerate(zip(adv_all, rewards))]
        adv = [v for v, m in zip(adv_all, mine) if m]
        if fallback:
            adv += batch_relative([last(e) for e in episodes + fallback], std_normalize=a.std_normalize)[len(episodes):]
        items = []
        for e, v in zip(episodes + fallback, adv):
            for r, w in sorted(e, key=lambda rw: rw[0].seq):
                it = to_item(r, w / len(e))  # every episode weighs the same, whatever its number of calls
                it.advantage = v
                items.append(it)
        sel.items = items

    def loss(self, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        import torch  # the learner's half: the driver, which selects, loads no torch

        from services.trainer.algorithms.grpo import grpo_loss
        from services.trainer.algorithms.importance import behaviour_weights

        a = self.config
        advantages, stats = mb.advantages, {}
        if a.hint_coef > 0:  # the reward's advantage on every token, plus the teacher's on a hinted call's
            hinted, hint_mask = hint_advantage(mb, clip=a.hint_clip, skip=a.hint_skip_first)
            trained = trained_hint_advantage(hinted, hint_mask, a.hint_baseline)
            advantages = advantages.unsqueeze(-1).expand_as(mb.mask) + a.hint_coef * trained
            stats = hint_statistics(mb, hinted, hint_mask)
        inputs, normalizer = ratio_inputs(mb, advantages)
        late = torch.tensor([1.0 if it.late else 0.0 for it in mb.items], device=mb.mask.device).unsqueeze(-1)
        if not mb.sequence_level and a.importance == "off" and bool(late.any()):
            # a late reward's calls were sampled several versions back: against the Trainer's own policy, the gap
            # to the recorded logprobs corrected by truncated importance weights (as importance=truncate does)
            if mb.first_epoch:
                mb.cache[("proximal", mb.key)] = mb.logprobs.detach()
            proximal = mb.cache[("proximal", mb.key)]
            w, _ = behaviour_weights(proximal, mb.old_logprobs, mb.mask * late, mode="truncate", cap=a.importance_cap,
                                     normalizer=mb.norms.tokens)
            inputs.update(old_logprobs=late * proximal + (1 - late) * inputs["old_logprobs"],
                          weights=inputs["weights"] * (late * w + (1 - late)))
        if not mb.sequence_level and a.importance != "off":
            if mb.first_epoch:  # the proximal policy: the Trainer's own, before this step's update
                mb.cache[("proximal", mb.key)] = mb.logprobs.detach()
            proximal = mb.cache[("proximal", mb.key)]
            w, importance = behaviour_weights(proximal, mb.old_logprobs, mb.mask, mode=a.importance,
                                              cap=a.importance_cap, normalizer=mb.norms.tokens)
            stats.update(importance)
            inputs.update(old_logprobs=proximal, weights=inputs["weights"] * w)
        by_response = not mb.sequence_level and a.aggregation == "sequence"
        if by_response:  # each response's tokens averaged first
            lengths = mb.mask.sum(-1, keepdim=True).clamp(min=1)
            inputs["weights"] = inputs["weights"] / lengths
            normalizer = mb.norms.sequences
        loss, own = grpo_loss(**inputs, normalizer=normalizer, **clip_args(mb.objective))
        if a.hint_coef > 0 and a.top_k:
            top, figures = hint_top_k_loss(mb, a.top_k_coef, a.hint_skip_first)
            loss, stats = loss + top, {**stats, **figures}
        if by_response:  # its token figures as shares of the batch's tokens, as at token level
            scale = mb.norms.sequences / max(mb.norms.tokens, 1.0)
            own.update(clip_frac=own["clip_frac"] * scale, ratio_mean=own["ratio_mean"] * scale)
        return loss, {**own, **stats}
