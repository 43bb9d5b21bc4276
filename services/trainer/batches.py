"""From committed buffer rows to one training batch: what every objective shares.

Pure logic over what ``buffer.fetch_committed`` returns, so every rule is unit-tested without a
database. Rows with broken logprobs (and, for objectives that need one, without a reward) are
discarded, stale rows are discarded or down-weighted; then the agent's recipe
(services/trainer/recipes/, passed in) picks the batch and, where it needs them, computes advantages. Rows neither trained on nor discarded stay committed for later.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Protocol, Sequence, TypeVar

from services.common.records import CORRECTION_LABEL, CommittedExperience, TeamEpisode
from services.trainer.sections import BatchRules, ObjectiveSection

T = TypeVar("T")

log = logging.getLogger(__name__)


@dataclass
class TrainItem:
    """One experience as the learner needs it."""

    experience_id: str
    task_id: str | None
    model_version: int
    prompt_ids: list[int]
    response_ids: list[int]
    old_logprobs: list[float]
    reward: float | None  # None: a row an objective that needs no reward trains (a labelled one)
    temperature: float
    weight: float = 1.0
    advantage: float | None = None  # set at selection by recipes that know it then (GRPO)
    run_id: str | None = None
    seq: int = 0  # arrival order in the buffer: the order of an episode's calls
    demonstration: bool = False  # trained by the supervised term only (a demonstration, or a replayed success)
    grammar: str | None = None  # sampled under this grammar: scored over the tokens it allowed
    # A teammate's call in one of this agent's episodes: its critic values the turn (credit through
    # the joint episode) and learns that value; the policy loss never sees it.
    context: bool = False
    # Feedback in words: the teacher's prompt (this call's conversation with the hint), whose logprobs of
    # the sampled tokens on-policy self-distillation moves the policy towards.
    teacher_prompt_ids: list[int] | None = None
    late: bool = False  # trained before, and again for a reward that came after (late_rewards: retrain)

    @property
    def episode(self) -> tuple[str | None, str]:
        """An episode is every call under one task_id + run_id; a call without a run_id is its own."""
        return (self.task_id, self.run_id) if self.run_id is not None else (None, self.experience_id)


def episodes_of(items: list[TrainItem]) -> list[list[TrainItem]]:
    """Items grouped by episode (first appearance order), each episode's calls in arrival order."""
    by: dict[tuple, list[TrainItem]] = {}
    for it in items:
        by.setdefault(it.episode, []).append(it)
    return [sorted(calls, key=lambda i: i.seq) for calls in by.values()]


def episode_chunks(items: list[TrainItem], size: int) -> list[list[TrainItem]]:
    """Micro-batches of about ``size`` items that never split an episode (its calls are credited
    together); an episode longer than ``size`` is a micro-batch of its own."""
    chunks: list[list[TrainItem]] = [[]]
    for calls in episodes_of(items):
        if chunks[-1] and len(chunks[-1]) + len(calls) > size:
            chunks.append([])
        chunks[-1].extend(calls)
    return [c for c in chunks if c]


def length_chunks(items: list[TrainItem], size: int, tokens: int | None = None) -> list[list[TrainItem]]:
    """Micro-batches of sequences of similar length (shortest first, so little of each forward is
    padding): at most ``size`` rows each and, with ``tokens``, at most that many padded positions
    (rows x (longest prompt + longest response), what the forward computes). A sequence longer than
    ``tokens`` is a micro-batch alone. The step's losses are normalised by the whole batch's counts
    (Norms), so how the batch is cut changes its memory and speed, not its gradient."""
    chunks: list[list[TrainItem]] = []
    prompt = response = 0
    for it in sorted(items, key=lambda i: (len(i.prompt_ids) + len(i.response_ids), i.seq)):
        p, r = max(prompt, len(it.prompt_ids)), max(response, len(it.response_ids))
        if chunks and len(chunks[-1]) < size and (tokens is None or (len(chunks[-1]) + 1) * (p + r) <= tokens):
            chunks[-1].append(it)
            prompt, response = p, r
        else:
            chunks.append([it])
            prompt, response = len(it.prompt_ids), len(it.response_ids)
    return chunks


@dataclass(frozen=True)
class Norms:
    """Batch-wide denominators, so every shard's loss is its share of the batch's mean."""

    tokens: float
    sequences: float
    demo_tokens: float = 0.0  # of the demonstrations in the step (the supervised term's mean)

    @classmethod
    def of(cls, items: list[TrainItem]) -> "Norms":
        rl = [i for i in items if not i.demonstration and not i.context]
        return cls(tokens=float(sum(len(i.response_ids) for i in rl)), sequences=float(len(rl)),
                   demo_tokens=float(sum(len(i.response_ids) for i in items if i.demonstration)))


@dataclass
class Selection:
    items: list[TrainItem] = field(default_factory=list)
    discarded: dict[str, str] = field(default_factory=dict)  # experience id -> why
    stale_downweighted: int = 0
    small_groups: int = 0
    demonstrations: list[TrainItem] = field(default_factory=list)  # replayed, never consumed
    imitations: list[TrainItem] = field(default_factory=list)  # the agent's own successes, replayed (self_imitation)
    guard: list[TrainItem] = field(default_factory=list)  # scored around the update (TrainerConfig.guard)
    context: list[TrainItem] = field(default_factory=list)  # teammates' calls in the items' episodes
    team_episodes: int = 0  # episodes of the items' tasks that set group statistics without this agent in them
    catch_up: bool = False  # a larger step, taken on a backlog (catch_up_size)
    groups: int | None = None  # groups the recipe looked at (None: it has none; every row is its own)
    failed_groups: int = 0  # of those, groups in which no episode succeeded (success_reward)
    figures: dict[str, float] = field(default_factory=dict)  # the recipe's own figures of its choice
    # flat groups set aside (GRPO's flat_groups=discard) since the agent's last step: the earlier polls' on the way
    # in (select_batch's set_aside), this poll's added by the recipe
    flat_set_aside: int = 0
    late: list[TrainItem] = field(default_factory=list)  # trained again for a late reward, never consumed again
    # reward_ledger id -> what this step does with that late reward (None: retrained in its version)
    late_outcomes: dict[int, str | None] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return bool(self.items or self.demonstrations)

    @property
    def all_items(self) -> list[TrainItem]:
        return self.items + self.late + self.demonstrations + self.imitations + self.context


# The team's episodes of the tasks at hand: {task_id: {run_id: TeamEpisode}} (buffer.team_episodes).
TeamEpisodes = dict[str, dict[str, TeamEpisode]]


# A committed row that passed the shared checks, with its staleness weight.
Usable = tuple[CommittedExperience, float]


def aware(t: datetime | None) -> datetime:
    if t is None:
        return datetime.now(timezone.utc)
    return t if t.tzinfo else t.replace(tzinfo=timezone.utc)


def to_item(row: CommittedExperience, weight: float) -> TrainItem:
    temperature = float((row.sampling or {}).get("temperature") or 0.0)
    return TrainItem(
        experience_id=row.experience_id,
        task_id=row.task_id,
        run_id=row.run_id,
        model_version=int(row.model_version),
        prompt_ids=list(row.prompt_token_ids),
        response_ids=list(row.response_token_ids),
        old_logprobs=[float(x) for x in row.response_logprobs],
        reward=None if row.reward is None else float(row.reward),
        temperature=temperature if temperature > 0 else 1.0,  # greedy samples were scored at T=1
        weight=weight,
        seq=int(row.seq),
        grammar=(row.sampling or {}).get("grammar"),
        teacher_prompt_ids=list(row.hint["prompt_token_ids"]) if row.hint and row.hint.get("prompt_token_ids") else None,
    )


def context_item(row: CommittedExperience) -> TrainItem:
    """A teammate's call as this agent's critic sees it: the state its turn starts from (the prompt,
    and one response token, whose value is the turn's)."""
    return TrainItem(
        experience_id=row.experience_id, task_id=row.task_id, run_id=row.run_id, model_version=int(row.model_version),
        prompt_ids=list(row.prompt_token_ids), response_ids=list(row.response_token_ids[:1]),
        old_logprobs=[float(x) for x in row.response_logprobs[:1]], reward=float(row.reward or 0.0), temperature=1.0,
        weight=0.0, seq=int(row.seq), context=True,
    )


def demonstration_item(row: CommittedExperience, weight: float = 1.0) -> TrainItem:
    """A row the supervised term trains (its NLL times ``weight``): a demonstration, or a success replayed."""
    return TrainItem(
        experience_id=row.experience_id, task_id=row.task_id, run_id=row.run_id, model_version=int(row.model_version),
        prompt_ids=list(row.prompt_token_ids), response_ids=list(row.response_token_ids), old_logprobs=[],
        reward=0.0, temperature=1.0, weight=weight, seq=int(row.seq), demonstration=True,
    )


def demonstration_weight(o: ObjectiveSection, step: int) -> float:
    """The demonstrations' weight at ``step``: ``sft_coef``, moving linearly to ``sft_coef_final`` over
    ``sft_decay_steps`` steps after the cold start (CHORD's decaying mu).

    Example: sft_coef 1, final 0.2, decay 4, cold start 4: steps 0-4 -> 1.0, step 6 -> 0.6, step 8 on -> 0.2."""
    if o.sft_coef_final is None:
        return o.sft_coef
    done = 1.0 if o.sft_decay_steps == 0 else min(1.0, max(0, step - o.cold_start_steps) / o.sft_decay_steps)
    return o.sft_coef + (o.sft_coef_final - o.sft_coef) * done


def imitation_weight(o: ObjectiveSection, step: int) -> float:
    """The replayed successes' weight at ``step``: 0 through the cold start, then growing linearly to
    ``self_imitation.coef`` over ``ramp_steps`` steps.

    Example: coef 1, ramp 4, cold start 4: steps 0-3 -> 0, step 4 -> 0.25, step 5 -> 0.5, step 7 on -> 1."""
    si = o.self_imitation
    if si.coef == 0 or step < o.cold_start_steps:
        return 0.0
    return si.coef if si.ramp_steps == 0 else si.coef * min(1.0, (step - o.cold_start_steps + 1) / si.ramp_steps)


def imitation_pool(rows: Sequence[CommittedExperience], *, per_task: int) -> list[CommittedExperience]:
    """The successes to replay: ``rows`` (successful calls, oldest first) grouped into episodes
    (task_id + run_id), at most ``per_task`` episodes of each task (the best reward, ties to the
    newest), an episode whose calls' responses repeat one already kept dropped; every call of a kept
    episode, in the rows' order. A row without a task is an episode and a task of its own."""
    episodes: dict[tuple, list[CommittedExperience]] = {}
    for r in rows:
        if r.response_token_ids:
            key = (r.task_id, r.run_id) if r.task_id is not None and r.run_id is not None else (r.experience_id, None)
            episodes.setdefault(key, []).append(r)
    by_task: dict[str, list[list[CommittedExperience]]] = {}
    for (task, _), calls in episodes.items():
        by_task.setdefault(task, []).append(calls)
    kept: set[str] = set()
    for task_episodes in by_task.values():
        seen: set[tuple] = set()
        ranked = sorted(task_episodes, key=lambda calls: (max(c.reward or 0.0 for c in calls), max(c.seq for c in calls)),
                        reverse=True)
        for calls in ranked:
            text = tuple(tuple(c.response_token_ids) for c in sorted(calls, key=lambda c: c.seq))
            if text in seen:
                continue
            seen.add(text)
            kept.update(c.experience_id for c in calls)
            if len(seen) == per_task:
                break
    return [r for r in rows if r.experience_id in kept]


class BatchPicker(Protocol):
    """What the batch rules ask of an objective (services.trainer.recipes.Recipe is one)."""

    needs_reward: bool

    def refuses(self, row: CommittedExperience) -> str | None: ...

    def select(self, usable: list[Usable], *, batch_size: int, now: datetime, sel: Selection, team: TeamEpisodes) -> None: ...


def select_batch(
    rows: list[CommittedExperience], *, recipe: BatchPicker, cfg: BatchRules, current_version: int, now: datetime | None = None,
    demonstrations: list[CommittedExperience] = (), step: int = 0, team: TeamEpisodes | None = None,
    successes: Sequence[CommittedExperience] = (), set_aside: int = 0,
) -> Selection:
    """Pick the next batch of ``rows`` (oldest first) for one agent at ``current_version``, by the
    rules every objective shares and then by the objective's ``recipe``.

    Demonstrations join every step that trains (``algorithm.demo_batch_size`` of them, in turn, at
    ``demonstration_weight``; with ``demo_replay: failed_groups`` only in proportion to the groups
    that found no success); while no batch of rollouts is ready, the first
    ``algorithm.cold_start_steps`` steps train on them alone (a new agent starting from a handful of
    examples). ``successes``: the agent's consumed successes (``buffer.fetch_successes``), replayed
    in the supervised term at ``imitation_weight`` (``algorithm.self_imitation``). The first ``guard.demonstrations``
    of them (users' corrections left out unless ``guard.corrections``) are the step's guard set (always the same ones). ``team``: the team's episode rewards of
    the rows' tasks, for recipes whose group statistics count the team's episodes (GRPO). ``set_aside``: the
    flat groups the agent's polls since its last step set aside (GRPO's ``flat_max_set_aside`` bounds them).
    """
    sel = Selection(flat_set_aside=set_aside)
    st = cfg.staleness
    usable: list[Usable] = []
    for row in rows:
        lag = current_version - int(row.model_version)
        if row.reward is None and recipe.needs_reward:
            sel.discarded[row.experience_id] = "no reward, a hint alone (algorithm opd learns from those)" if row.hint \
                else "no reward"
            continue
        if not row.response_token_ids or len(row.response_token_ids) != len(row.response_logprobs):
            sel.discarded[row.experience_id] = "empty response or logprobs of another length"
            continue
        weight = 1.0
        if lag > st.max_staleness:
            if st.policy == "discard":
                sel.discarded[row.experience_id] = f"stale: made by v{row.model_version}, {lag} versions behind"
                continue
            weight = st.downweight ** (lag - st.max_staleness)
            sel.stale_downweighted += 1
        if (why := recipe.refuses(row)) is not None:
            sel.discarded[row.experience_id] = why
            continue
        usable.append((row, weight))
    recipe.select(usable, batch_size=cfg.train_batch_size, now=aware(now), sel=sel, team=team or {})
    a = cfg.algorithm
    if sel.groups is None:  # a recipe without groups: each episode is one
        _count_groups(sel, a.success_reward)
    demo_weight = demonstration_weight(a, step)
    if demonstrations and demo_weight > 0 and (sel.items or step < a.cold_start_steps):
        size = a.demo_batch_size
        if a.demo_replay == "failed_groups" and sel.items:  # guidance where the traffic found nothing
            size = -(-a.demo_batch_size * sel.failed_groups // max(sel.groups, 1))
        sel.demonstrations = [demonstration_item(d, demo_weight) for d in in_turn(demonstrations, size, step)] if size else []
        guarded = demonstrations if cfg.guard.corrections else [d for d in demonstrations if CORRECTION_LABEL not in d.labels]
        sel.guard = [demonstration_item(d) for d in guarded[: cfg.guard.demonstrations]]
    sil_weight = imitation_weight(a, step)
    if successes and sil_weight > 0 and sel.items:
        pool = imitation_pool(successes, per_task=a.self_imitation.per_task)
        sel.imitations = [demonstration_item(r, sil_weight) for r in in_turn(pool, a.self_imitation.batch_size, step)]
    return sel


def _count_groups(sel: Selection, success: float) -> None:
    """Groups of the chosen items by task_id (a row without one is its own), and those without a success."""
    groups: dict[str, list[float]] = {}
    for it in sel.items:
        groups.setdefault(it.task_id or it.experience_id, []).append(it.reward if it.reward is not None else float("-inf"))
    sel.groups = len(groups)
    sel.failed_groups = sum(1 for rewards in groups.values() if max(rewards) < success)


def catch_up_size(rows: list[CommittedExperience], *, cfg: BatchRules, current_version: int, step: int,
                  needs_reward: bool = True) -> int:
    """How many experiences the next step takes: ``train_batch_size``, or more when a backlog waits.

    A row made by version m is trainable while ``current_version - m <= max_staleness``; with a
    publication every ``save_interval`` steps (the next one after this step when ``step + 1`` is a
    multiple), it has ``steps_left = (S - step % S) + (max_staleness - lag) * S`` steps left,
    this one included. Taking the oldest first, b per step trains every row in time when, for every
    k, the rows with at most k steps left number at most b * k. So b = max_k ceil(count(<= k) / k),
    at least train_batch_size and at most ``staleness.catch_up_max_rows``.

    Example (S=1, max_staleness=4, batch 16): 800 rows of v0 all have 5 steps left, so b = 160 and
    5 steps train all of them; without catch-up, 5 steps of 16 train 80 and 720 go stale.
    """
    st, base = cfg.staleness, cfg.train_batch_size
    if st.catch_up_max_rows <= base or len(rows) <= base:
        return base
    S = cfg.save_interval
    in_version = S - step % S
    left: dict[int, int] = {}  # steps left -> rows
    for r in rows:
        lag = current_version - int(r.model_version)
        if (r.reward is None and needs_reward) or lag > st.max_staleness:
            continue
        k = in_version + (st.max_staleness - max(lag, 0)) * S
        left[k] = left.get(k, 0) + 1
    need, seen = base, 0
    for k in sorted(left):
        seen += left[k]
        need = max(need, -(-seen // k))
    return min(need, st.catch_up_max_rows)


def in_turn(demos: Sequence[T], size: int, step: int) -> list[T]:
    """The demonstrations step ``step`` replays: ``size`` of them, a different slice each step, all of
    them when they fit."""
    if len(demos) <= size:
        return list(demos)
    start = (step * size) % len(demos)
    return [demos[(start + k) % len(demos)] for k in range(size)]


def take_oldest(usable: list[Usable], *, batch_size: int, sel: Selection) -> None:
    """The plain rule: the oldest ``batch_size`` usable rows, once that many are there, and
    whole episodes only (the last one may take the batch a little over)."""
    episodes: dict[tuple, list[Usable]] = {}
    for r, w in usable:
        episodes.setdefault((r.task_id, r.run_id) if r.run_id is not None else (None, r.experience_id), []).append((r, w))
    chosen: list[Usable] = []
    for calls in episodes.values():
        if len(chosen) >= batch_size:
            break
        chosen += calls
    if len(chosen) >= batch_size:
        sel.items = [to_item(r, w) for r, w in chosen]
