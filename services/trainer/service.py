"""The Trainer service: poll the buffer, train on Ray, publish versions. Read it top to bottom.

    kaizen trainer --config configs/trainer.yaml [--max-steps N] [dotted.key=value ...]

Per agent, forever (or for ``trainer.max_steps`` steps):
  1. read the oldest committed experiences; pick a batch (staleness, demonstrations, GRPO groups);
  2. run one training step on the learner workers (Ray actors, data parallel when workers > 1);
  3. save the trainer state for that step, then in ONE database transaction mark the batch
     consumed (trained_in = the version the step goes into) and record the step with its state;
  4. every ``save_interval`` steps publish ``v<N>`` atomically and move LATEST.

A crash anywhere leaves the database pointing at the last state whose batch was consumed: a
restarted trainer loads that state, so no experience is trained twice and none is skipped. Before
that it repairs what the kill left half done (``_repair``), so a restart never needs a hand:
  - temporaries of an interrupted atomic write (``.tmp-*`` and the like) are removed;
  - states newer than the step the database names are dropped (their batch was never committed);
  - a version the database owes (its last step closed it) is published, or, when ``v<N>`` was
    renamed into place but LATEST not yet written, LATEST is pointed at it; this happens at start,
    not when the next experiences arrive, so the Explorer never waits on data for it.
``KAIZEN_FAILPOINTS`` (services/common/faults.py) kills the process inside these windows in tests.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from services.common import buffer, checkpoints
from services.common.buffer import BatchChanged, create_buffer_engine
from services.common.checkpoints import CheckpointError
from services.common.config import dump_config
from services.common.faults import failpoint
from services.common.records import TrainerStep
from services.common.release import ReleasePolicy, held_out, refused_versions
from services.trainer.batches import (
    Norms,
    Selection,
    TeamEpisodes,
    TrainItem,
    aware,
    catch_up_size,
    context_item,
    select_batch,
)
from services.trainer.config import TrainerConfig
from services.trainer.learners import LearnerGroup, LearnersLost, LearnersUnavailable, shard
from services.trainer.metrics import MetricsSink
from services.trainer.ray_cluster import LocalRayCluster
from services.trainer.retention import prune_versions
from services.trainer.schedule import Turn, current_turn, next_agent
from services.trainer.stats import StepStats, step_record

log = logging.getLogger("kaizen.trainer")


@dataclass
class AgentProgress:
    step: int  # steps trained so far (all runs)
    published: int  # the version the learners' weights were last published as, or taken from (0: the base model)
    next_version: int  # the version the next step goes into
    state_path: str | None  # the state the learners hold right now (rollback point); None: the adapter of `published`
    waiting_on: int | None = None  # the candidate whose release decision this agent's training waits for
    flat_set_aside: int = 0  # flat groups set aside since the last step (GRPO's flat_groups=discard; not kept across restarts)


_MAX_DEMONSTRATIONS = 10_000  # read per poll; an agent's demonstrations are a few to a few hundred


class TrainerService:
    def __init__(self, cfg: TrainerConfig):
        self.cfg = cfg
        self.root = Path(cfg.checkpoints.root)
        self.db = create_buffer_engine(cfg.buffer.url)
        t = cfg.trainer
        self.metrics = MetricsSink(t.run_dir, progress=t.progress,
                                   prometheus=None if t.metrics_port is None else (t.metrics_host, t.metrics_port))
        self.recipe = cfg.algorithm.recipe()
        self.learners: LearnerGroup | None = None
        self.agents: dict[str, AgentProgress] = {}
        self.stop_event = threading.Event()
        self.steps_this_run = 0
        self.learner_restarts = 0  # learner groups rebuilt after a worker died
        self._ray: LocalRayCluster | None = None  # the cluster this Trainer started (none when it joined one)
        self._joined = False  # this Trainer connected to a running cluster (ray.address) itself
        # round_robin: a turn passed on for want of data, until the next recorded step (newest step, turn)
        self._passed: tuple[Any, Turn] | None = None
        self._waiting: tuple[Any, float] | None = None  # ((newest step, agent), since) of the turn waiting for data

    # ------------------------------------------------------------------ start / stop

    def start(self) -> None:
        import ray

        log.info("trainer config:\n%s", dump_config(self.cfg))
        if not ray.is_initialized():
            kwargs: dict[str, Any] = dict(include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
            if self.cfg.ray.address:
                ray.init(address=self.cfg.ray.address, **kwargs)
                self._joined = True
            else:
                # Ray starts workers at nice 15 by default; the learner is the whole point of this
                # process, so it must not starve behind an Explorer sharing the machine. "local": a
                # cluster of its own, never one that /tmp/ray/ray_current_cluster names (another
                # process's, or a dead one's).
                self._ray = LocalRayCluster(self.cfg.trainer.run_dir)
                self._ray.start(object_store_memory=256 * 1024 * 1024, _system_config={"worker_niceness": 0}, **kwargs)
        self.learners = LearnerGroup(self.cfg)
        if self._ray is not None:
            self._ray.track()  # the learner actors' processes too
        try:
            self._recover()
        except LearnersLost as e:
            self._rebuild_learners(e)

    def close(self) -> None:
        if self.learners is not None and self._ray is None:  # joined a cluster: the actors outlive a driver that lingers
            self.learners.shutdown()
        self.metrics.close()
        self.db.dispose()
        if self._ray is not None:
            self._ray.shutdown()
        elif self._joined:
            import ray

            # Now rather than in Ray's exit handler, which first sleeps 0.5 s for the workers' last log
            # lines (the learners are gone already).
            ray.shutdown()

    # ------------------------------------------------------------------ agents

    def _recover(self) -> None:
        """Finish the publications a killed run owes before polling: an agent whose data is all
        consumed would otherwise never get its last version out to the Explorer."""
        wanted = self.cfg.trainer.agents
        for agent in checkpoints.list_trained_agents(self.root):
            if wanted and agent not in wanted:
                continue
            last = buffer.last_trainer_step(engine=self.db, agent=agent)
            self._log_missed_step(agent, last)
            if self._owed_version(agent, last) is not None:
                with checkpoints.publication_lock(self.root, agent):
                    self.agents[agent] = self._init_agent(agent)

    def _log_missed_step(self, agent: str, last: TrainerStep | None) -> None:
        """A Trainer killed between a step's commit and its metrics line never wrote the line: write it
        now from the record the buffer committed with the step. Only where this run folder's
        metrics.jsonl goes on from the step before (a restart in another run folder starts its own)."""
        if last is None or not last.metrics:
            return
        logged = self.metrics.last_step(agent)
        if logged != last.step - 1 and not (logged is None and last.step == 1):
            return
        record = {**last.metrics, "recovered": True}
        if last.step % self.cfg.save_interval == 0:  # as a step that closes a version says (its version is, or is owed)
            record["published"] = True
        self.metrics.step(record, at=aware(last.created_at).timestamp())
        log.warning("agent %s: wrote step %d's metrics line, which the run killed after its commit never wrote", agent, last.step)

    def _owed_version(self, agent: str, last: TrainerStep | None) -> int | None:
        """The version the database says is complete (its last step closed it) whose publication did
        not finish: the trainer died between that step's commit and the end of its publication.
        ``_publish`` records this Trainer's release decision about a version (``promoted`` in
        immediate mode, ``candidate`` otherwise) before it moves the pointer (LATEST or CANDIDATE).
        Finished: LATEST or CANDIDATE names it or a newer version (``kaizen publish`` may have moved
        them on since), or a decision taken after this Trainer's (a rejection, a rollback) settled it."""
        if not last or last.step % self.cfg.save_interval:
            return None
        v = last.version
        decided = buffer.list_decisions(engine=self.db, agent=agent, version=v)
        mine = [d for d in decided if d.actor == "trainer"]
        if decided and not mine:
            return None  # decided about by someone else (a rollback)
        if mine:
            newest = buffer.list_decisions(engine=self.db, agent=agent, limit=1)
            if newest and newest[-1].id != mine[-1].id:
                return None
        latest = checkpoints.read_latest(self.root, agent, fallback=False) or 0
        return v if max(latest, checkpoints.read_candidate(self.root, agent) or 0) < v else None

    def _policy(self, agent: str) -> ReleasePolicy:
        return self.cfg.release.policy(agent)

    def _announce(self, agent: str, version: int) -> None:
        """Record this Trainer's release decision about a version it published (once): in immediate
        mode it serves (``promoted``), otherwise it is a ``candidate`` for the Explorer's release
        controller. Recorded before the pointer moves (``_owed_version`` relies on that order)."""
        if any(d.actor == "trainer" for d in buffer.list_decisions(engine=self.db, agent=agent, version=version)):
            return
        mode = self._policy(agent).mode
        serving = checkpoints.read_latest(self.root, agent) or 0
        d = buffer.record_decision(
            engine=self.db, agent=agent, version=version, actor="trainer",
            decision="promoted" if mode == "immediate" else "candidate",
            serving=version if mode == "immediate" else serving,
            reason="release.mode is immediate: it serves once published" if mode == "immediate"
            else f"release.mode is {mode}: it awaits its release decision while v{serving} serves")
        checkpoints.record_release(self.root, agent, version, d.as_entry())

    def _repair(self, agent: str, last: TrainerStep | None) -> None:
        """Undo or finish what a kill left half done on disk; the database is the truth."""
        for path in checkpoints.remove_temporaries(self.root, agent):
            log.warning("agent %s: removed %s, left by an interrupted write", agent, path)
        for step in checkpoints.drop_states_after(self.root, agent, step=last.step if last else 0):
            log.warning("agent %s: dropped the state of step %d, whose batch was never committed", agent, step)
        self._prune_states(agent)  # a kill between a commit and the pruning leaves one state too many
        owed = self._owed_version(agent, last)
        candidate = self._policy(agent).mode != "immediate"
        if owed is not None and self._complete(agent, owed):
            self._announce(agent, owed)
        if owed is not None and checkpoints.finish_publication(self.root, agent, owed, candidate=candidate):
            log.warning("agent %s: finished the publication of v%d (%s did not name it yet)", agent, owed,
                        "CANDIDATE" if candidate else "LATEST")

    def _complete(self, agent: str, version: int) -> bool:
        try:
            checkpoints.validate_version(self.root, agent, version)
            return True
        except CheckpointError:
            return False

    def _init_agent(self, agent: str) -> AgentProgress:
        """Repair, then resume from the state the database names, else start from the serving adapter."""
        last = buffer.last_trainer_step(engine=self.db, agent=agent)
        self._repair(agent, last)
        latest = checkpoints.read_latest(self.root, agent) or 0
        if last and last.state_ref and (self.root / last.state_ref).is_dir():
            state = self.root / last.state_ref
            self.learners.ensure_agent(agent, state_dir=str(state))
            meta = json.loads((state / "trainer.json").read_text())
            closed = last.step % self.cfg.save_interval == 0  # this step's version is (or is owed) published
            parent = int(meta.get("parent", latest))
            progress = AgentProgress(step=last.step, published=last.version if closed else parent,
                                     next_version=last.version, state_path=str(state))
            if closed:
                if self._owed_version(agent, last) is not None:  # died between the commit and the version's writing
                    self._publish(agent, progress, last.version)
                progress.next_version = last.version + 1
            progress.next_version = max(progress.next_version, self._newest_version(agent) + 1)
            log.info("agent %s: resumed at step %d from %s (serving v%d)", agent, progress.step, state, latest)
            return progress
        if last:
            log.warning("agent %s: state %s named by the buffer is missing; starting from v%d", agent, last.state_ref, latest)
        adapter_dir = str(checkpoints.version_dir(self.root, agent, latest)) if latest else None
        self.learners.ensure_agent(agent, adapter_dir=adapter_dir)
        step = last.step if last else 0
        state = checkpoints.state_path(self.root, agent, step)
        if not state.exists():
            self.learners.save_state(agent, str(state), {"agent": agent, "step": step, "version": latest, "parent": latest})
        log.info("agent %s: starting at step %d from %s", agent, step, f"v{latest}" if latest else "the base model")
        taken = max(self._newest_version(agent), last.version if last else 0)
        return AgentProgress(step=step, published=latest, next_version=taken + 1, state_path=str(state))

    def _newest_version(self, agent: str) -> int:
        """The newest version number published (on disk, or decided about since retention deleted
        it): never reused, since versions are immutable and vLLM caches adapters by name."""
        return max([0, *checkpoints.list_versions(self.root, agent), buffer.newest_decided_version(engine=self.db, agent=agent)])

    def _awaiting_release(self, agent: str, progress: AgentProgress) -> bool:
        """A candidate (this Trainer's, or one ``kaizen publish`` named) is awaiting its release
        decision: the agent's training waits, so the next version descends from what serves."""
        candidate = checkpoints.read_candidate(self.root, agent)
        if candidate is None or candidate <= (checkpoints.read_latest(self.root, agent) or 0):
            progress.waiting_on = None
            return False
        if progress.waiting_on != candidate:
            log.info("agent %s: v%d is a candidate (release.mode %s); training waits for its release decision", agent,
                     candidate, self._policy(agent).mode)
            progress.waiting_on = candidate
        return True

    def _follow_serving(self, agent: str, progress: AgentProgress) -> None:
        """Continue from the version that serves when it is not the one the learners' weights were
        published as: a candidate was rejected or a version rolled back (the state saved when the
        serving version was published is restored, optimizer and critic included, not the refused
        one's), or ``kaizen publish`` or a rollback named a version trained elsewhere (its adapter
        with a fresh optimizer). Experiences trained into refused versions stay consumed (their
        lineage is recorded); the next version is numbered after every number taken."""
        latest = checkpoints.read_latest(self.root, agent) or 0
        if latest == progress.published:
            return
        state, how = self._load_version(agent, latest)
        log.warning("agent %s: continuing from v%d, %s (it serves now; the learners were at v%d)", agent, latest, how,
                    progress.published)
        progress.published, progress.state_path = latest, (str(state) if state is not None else None)
        progress.next_version = max(progress.next_version, self._newest_version(agent) + 1)

    def _load_version(self, agent: str, version: int) -> tuple[Path | None, str]:
        """Put ``version``'s weights in the learners: its trainer state when on disk, else its adapter
        (or the base model) with a fresh optimizer. Returns the state used and how, in words."""
        state = self._state_of(agent, version)
        if state is not None:
            self.learners.load_state(agent, str(state))
            return state, f"its own trainer state {state.name}"
        if version > 0:
            self.learners.adopt_adapter(agent, str(checkpoints.version_dir(self.root, agent, version)))
            source = "published from elsewhere (kaizen publish)" if self._published_elsewhere(agent, version) else "its adapter"
            return None, f"{source}, with a fresh optimizer"
        self.learners.reset_agent(agent)
        return None, "the base model, with a fresh optimizer"

    def _state_of(self, agent: str, version: int) -> Path | None:
        """The trainer state saved by the step that published ``version``, if it is still on disk."""
        ref = buffer.publishing_steps(engine=self.db, agent=agent, save_interval=self.cfg.save_interval).get(version)
        if ref and (self.root / ref).is_dir():
            return self.root / ref
        return None

    def _published_elsewhere(self, agent: str, version: int) -> bool:
        """Whether ``version`` came from ``kaizen publish`` (an adapter trained outside this Trainer)."""
        try:
            return checkpoints.validate_version(self.root, agent, version).manifest().get("source") == "publish"
        except CheckpointError:
            return False

    def _agents_to_poll(self) -> list[str]:
        have = buffer.agents_with_committed(engine=self.db)
        wanted = self.cfg.trainer.agents
        return [a for a in have if not wanted or a in wanted]

    def _turn(self) -> tuple[Turn, Any]:
        """round_robin: whose turn it is, and the newest recorded step it was derived from."""
        sch = self.cfg.trainer.schedule
        order = sch.order or self.cfg.trainer.agents
        recent = buffer.recent_trainer_steps(engine=self.db, agents=order, limit=sch.interval + 1)
        newest = recent[0] if recent else None
        if self._passed is not None and self._passed[0] == newest:
            return self._passed[1], newest
        return current_turn(recent, order, sch.interval), newest

    def _idle_turn(self, turn: Turn, newest: Any) -> None:
        """round_robin: the agent whose turn it is had no batch ready; after ``turn_timeout_s`` of
        that, the turn passes to the next agent (until a step is recorded, in this process)."""
        timeout = self.cfg.trainer.schedule.turn_timeout_s
        if timeout is None:
            return
        now, key = time.monotonic(), (newest, turn.agent)
        if self._waiting is None or self._waiting[0] != key:
            self._waiting = (key, now)
            return
        if now - self._waiting[1] >= timeout:
            sch = self.cfg.trainer.schedule
            # the teammates changed last before the idle agent's turn: the same start for the next one
            nxt = Turn(next_agent(sch.order or self.cfg.trainer.agents, turn.agent), 0, turn.started_at)
            self._passed, self._waiting = (newest, nxt), None
            log.info("agent %s: no batch ready in %.0fs of its turn; the turn passes to %s", turn.agent, timeout, nxt.agent)

    def _polled(self) -> tuple[list[tuple[str, Turn | None]], tuple[Turn, Any] | None]:
        """The agents to poll now, each with its round-robin turn (None when simultaneous)."""
        agents = self._agents_to_poll()
        if self.cfg.trainer.schedule.mode == "simultaneous":
            return [(a, None) for a in agents], None
        turn, newest = self._turn()
        return ([(turn.agent, turn)] if turn.agent in agents else []), (turn, newest)

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        max_steps = self.cfg.trainer.max_steps
        while not self.stop_event.is_set():
            if max_steps is not None and self.steps_this_run >= max_steps:
                log.info("reached trainer.max_steps=%d", max_steps)
                break
            trained = False
            polled, turn = self._polled()
            for agent, agent_turn in polled:
                if self.stop_event.is_set() or (max_steps is not None and self.steps_this_run >= max_steps):
                    break
                try:
                    trained |= self._poll_agent(agent, agent_turn)
                except LearnersLost as e:
                    self._rebuild_learners(e)
                    trained = True  # poll again at once, from the agents' last saved states
                    break
            if turn is not None and not trained:
                self._idle_turn(*turn)
            if not trained:
                self.metrics.waiting("waiting for committed experiences ...")
                self.stop_event.wait(self.cfg.trainer.poll_interval_s)
        return 0

    def _rebuild_learners(self, lost: LearnersLost) -> None:
        """A learner worker died (its process or its node): the step in flight is lost, nothing of it
        committed. Build the workers again (waiting up to ray.recover_timeout_s for the cluster to
        place them, however often they are lost meanwhile) and resume every agent from the state its
        last committed step saved, as a restarted Trainer would: nothing is trained twice or skipped.
        A stop asked for meanwhile returns with no learners (the run loop then ends)."""
        r = self.cfg.ray
        deadline = time.monotonic() + r.recover_timeout_s
        while True:
            self.learner_restarts += 1
            log.error("learner worker lost (%s): the step in flight is dropped; rebuilding the %d worker(s) and "
                      "resuming every agent from its last saved state", lost, r.workers)
            self.metrics.learners_lost()
            if self.learners is not None:
                self.learners.shutdown()
                self.learners = None
            self.agents.clear()
            try:
                while self.learners is None:
                    if self.stop_event.is_set():
                        return
                    try:
                        self.learners = LearnerGroup(self.cfg, wait_s=max(1.0, min(30.0, deadline - time.monotonic())))
                    except LearnersUnavailable as e:
                        if time.monotonic() >= deadline:
                            raise LearnersUnavailable(f"the learner workers could not be placed again within "
                                                      f"ray.recover_timeout_s={r.recover_timeout_s:.0f}s: {e}") from None
                        log.warning("waiting for the cluster to place the learner workers again: %s", e)
                if self._ray is not None:
                    self._ray.track()
                log.warning("learner workers rebuilt (%s); resuming", self.learners.info)
                self._recover()
                return
            except LearnersLost as again:  # lost again while being built or while finishing publications
                if time.monotonic() >= deadline:
                    raise
                lost = again

    def _poll_agent(self, agent: str, turn: Turn | None = None) -> bool:
        window = max(self.cfg.train_batch_size * 8, 256, self.cfg.staleness.catch_up_max_rows)
        rows = buffer.fetch_committed(engine=self.db, agent=agent, limit=window)
        if turn is not None and turn.started_at is not None and self.cfg.trainer.schedule.frozen_experiences == "discard":
            rows = self._discard_frozen(agent, rows, turn.started_at)
        rows = self._hold_out(agent, rows)
        rows = self._drop_refused(agent, rows)
        a = self.cfg.algorithm
        demos = buffer.fetch_committed(engine=self.db, agent=agent, limit=_MAX_DEMONSTRATIONS, demonstrations=True) \
            if a.sft_coef > 0 or (a.sft_coef_final or 0) > 0 else []
        if not rows and not demos:
            return False
        successes = buffer.fetch_successes(engine=self.db, agent=agent, min_reward=a.success_reward,
                                           limit=a.self_imitation.pool) if rows and a.self_imitation.coef > 0 else []
        # The lock keeps `kaizen publish` from taking a version number between this step's choice of
        # it and its publication; what serves now (a publication made while it waited, a release
        # decision) is followed first.
        with checkpoints.publication_lock(self.root, agent):
            if agent not in self.agents:
                self.agents[agent] = self._init_agent(agent)
            progress = self.agents[agent]
            if self._awaiting_release(agent, progress):
                return False
            self._follow_serving(agent, progress)
            team = self._team_episodes(rows) if self.recipe.team_rewards and self.cfg.algorithm.team_credit else None
            selection = self._select(agent, progress, rows, demos, team, successes)
            if selection.items and self.recipe.uses_critic and self.cfg.algorithm.team_credit:
                selection.context = self._teammates_turns(agent, selection.items)
            if not selection.ready:
                if selection.discarded:
                    n = buffer.discard_experiences(engine=self.db, experience_ids=list(selection.discarded))
                    self._log_discards(agent, selection, n)
                    progress.flat_set_aside = selection.flat_set_aside
                return False
            if self.cfg.late_rewards.mode_of(agent) == "retrain":
                self._late(agent, progress, selection)
            return self._train(agent, progress, selection)

    def _late(self, agent: str, progress: AgentProgress, selection: Selection) -> None:
        """late_rewards: retrain: the agent's late rewards no step has handled yet ride along with this
        step: trained again (``Selection.late``) within max_staleness versions, or set down with why not;
        their ledger rows are marked in the step's own transaction (``consume_batch``)."""
        pending = buffer.pending_late_rewards(engine=self.db, agent=agent, limit=self.cfg.late_rewards.max_per_step)
        if not pending:
            return
        found = {r.experience_id: r for r in buffer.fetch_experiences(engine=self.db, experience_ids=[e for _, e in pending])}
        refused = refused_versions(buffer.list_decisions(engine=self.db, agent=agent, limit=100_000)) \
            if self._policy(agent).rejected_experiences == "discard" else set()
        why: dict[str, str] = {}
        for _, e in pending:
            row = found.get(e)
            lag = None if row is None else progress.published - row.model_version
            if row is None:
                why[e] = "not retrained: discarded, purged or not trainable"
            elif row.model_version in refused:
                why[e] = f"not retrained: made by v{row.model_version}, a refused version (release.rejected_experiences)"
            elif lag > self.cfg.staleness.max_staleness:
                why[e] = f"not retrained: {lag} versions stale (staleness.max_staleness {self.cfg.staleness.max_staleness})"
        rows = [r for e, r in found.items() if e not in why]
        team = buffer.team_episodes(engine=self.db, task_ids=[r.task_id for r in rows if r.task_id and r.run_id is not None])
        items, skipped = self.recipe.late_items(rows, team=team) if rows else ([], {})
        why.update({e: f"not retrained: {w}" for e, w in skipped.items()})
        selection.late = items
        selection.late_outcomes = {lid: why.get(e) for lid, e in pending}
        log.info("agent %s: %d late reward(s): %d call(s) trained again, %d not (%s)", agent, len(pending), len(items),
                 sum(1 for w in selection.late_outcomes.values() if w), "; ".join(sorted(set(why.values()))) or "-")

    def _select(self, agent: str, progress: AgentProgress, rows: list, demos: list, team, successes: list) -> Selection:
        """The next batch; larger than train_batch_size while a backlog would otherwise go stale
        (``catch_up_size``), unless the recipe cannot fill the larger one (GRPO's whole groups)."""
        size = catch_up_size(rows, cfg=self.cfg, current_version=progress.published, step=progress.step,
                             needs_reward=self.recipe.needs_reward)

        def select(cfg: TrainerConfig) -> Selection:
            return select_batch(rows, recipe=self.recipe, cfg=cfg, current_version=progress.published,
                                demonstrations=demos, step=progress.step, team=team, successes=successes,
                                set_aside=progress.flat_set_aside)

        if size > self.cfg.train_batch_size:
            selection = select(self.cfg.model_copy(update={"train_batch_size": size}))
            if selection.ready:
                log.info("agent %s: catching up on a backlog of %d committed experiences: this step takes %d "
                         "(staleness.catch_up_max_rows=%d; each is trained within max_staleness=%d versions of its own)",
                         agent, len(rows), len(selection.items), self.cfg.staleness.catch_up_max_rows,
                         self.cfg.staleness.max_staleness)
                selection.catch_up = True
                return selection
        return select(self.cfg)

    def _team_episodes(self, rows: list) -> TeamEpisodes:
        """The team's rewarded episodes of the tasks these rows belong to (GRPO's group statistics)."""
        return buffer.team_episodes(engine=self.db, task_ids=[r.task_id for r in rows if r.task_id and r.run_id is not None])

    def _teammates_turns(self, agent: str, items: list[TrainItem]) -> list[TrainItem]:
        """Teammates' calls in the episodes of ``items``: PPO credits through the joint episode."""
        episodes = {(i.task_id, i.run_id) for i in items if i.task_id is not None and i.run_id is not None}
        if not episodes:
            return []
        return [context_item(r) for r in buffer.teammate_calls(engine=self.db, episodes=sorted(episodes), agent=agent)
                if r.response_token_ids]

    def _discard_frozen(self, agent: str, rows: list, started_at: datetime) -> list:
        """round_robin with frozen_experiences=discard: experiences recorded before this agent's turn
        began were made beside teammates that have changed since: off-policy for the team."""
        before = [r for r in rows if r.created_at is not None and aware(r.created_at) < aware(started_at)]
        if before:
            n = buffer.discard_experiences(engine=self.db, experience_ids=[r.experience_id for r in before])
            log.info("agent %s: discarded %d experiences recorded before its turn began (frozen_experiences=discard)", agent, n)
        dropped = {r.experience_id for r in before}
        return [r for r in rows if r.experience_id not in dropped]

    def _hold_out(self, agent: str, rows: list) -> list:
        """release.gate.replay.holdout_share: rewarded calls whose task (or id) hashes into the share
        are never trained on; the Explorer's release gate replays them to compare versions."""
        share = self._policy(agent).gate.replay.holdout_share
        if share <= 0:
            return rows
        out = [r for r in rows if held_out(agent, r.task_id or r.experience_id, share)]
        if out:
            n = buffer.discard_experiences(engine=self.db, experience_ids=[r.experience_id for r in out])
            log.info("agent %s: held out %d experiences for the release gate's replay (release.gate.replay.holdout_share)",
                     agent, n)
        dropped = {r.experience_id for r in out}
        return [r for r in rows if r.experience_id not in dropped]

    def _drop_refused(self, agent: str, rows: list) -> list:
        """release.rejected_experiences=discard: what a rejected or rolled-back version produced is
        never trained on, also what was recorded or rewarded after the decision (in-flight calls)."""
        if self._policy(agent).rejected_experiences != "discard" or not rows:
            return rows
        refused = refused_versions(buffer.list_decisions(engine=self.db, agent=agent, limit=100_000))
        out = [r for r in rows if r.model_version in refused]
        if out:
            n = buffer.discard_experiences(engine=self.db, experience_ids=[r.experience_id for r in out])
            log.info("agent %s: discarded %d experiences of refused versions %s (release.rejected_experiences=discard)",
                     agent, n, sorted({r.model_version for r in out}))
        dropped = {r.experience_id for r in out}
        return [r for r in rows if r.experience_id not in dropped]

    def _log_discards(self, agent: str, selection: Selection, n: int) -> None:
        reasons: dict[str, int] = {}
        for why in selection.discarded.values():
            reasons[why.split(":")[0]] = reasons.get(why.split(":")[0], 0) + 1
        log.info("agent %s: discarded %d experiences (%s)", agent, n, ", ".join(f"{k}: {v}" for k, v in reasons.items()))

    def _train(self, agent: str, progress: AgentProgress, selection: Selection) -> bool:
        cfg = self.cfg
        items = selection.items  # the rollouts this step consumes; demonstrations are replayed, not consumed
        norms = Norms.of(selection.all_items)
        shards = shard(selection.all_items, cfg.ray.workers)
        t0 = time.perf_counter()
        results = self.learners.train(agent, shards, norms, progress.step, progress.published, selection.guard)
        seconds = time.perf_counter() - t0
        step, version = progress.step + 1, progress.next_version
        state = checkpoints.state_path(self.root, agent, step)
        self.learners.save_state(agent, str(state), {"agent": agent, "step": step, "version": version,
                                                     "parent": progress.published})
        failpoint("trainer.after_state_saved")
        record = step_record(agent=agent, step=step, version=version, algorithm=cfg.algorithm.name, recipe=self.recipe,
                             published=progress.published, selection=selection, total=StepStats.merged(results),
                             norms=norms, seconds=seconds)
        try:
            buffer.consume_batch(
                engine=self.db, agent=agent, step=step, version=version,
                consumed={i.experience_id: i.reward for i in items}, discarded=list(selection.discarded),
                state_ref=str(state.relative_to(self.root)), metrics=record,
                late_outcomes={lid: why or f"retrained in v{version}" for lid, why in selection.late_outcomes.items()},
                unhinted=[i.experience_id for i in items if not i.teacher_prompt_ids] if getattr(self.recipe, "reads_hints", False) else (),
            )
        except BatchChanged as e:
            log.warning("agent %s: %s; rolling the step back and retrying with fresh data", agent, e)
            if progress.state_path is not None:
                self.learners.load_state(agent, progress.state_path)
            else:  # the learners took the serving version's adapter after the last saved state
                self._load_version(agent, progress.published)
            checkpoints.drop_states_after(self.root, agent, step=progress.step)
            return False
        if selection.discarded:
            self._log_discards(agent, selection, len(selection.discarded))
        failpoint("trainer.after_consume_commit")
        progress.step, progress.state_path, progress.flat_set_aside = step, str(state), 0
        self.steps_this_run += 1
        if step % cfg.save_interval == 0:
            guard = {k: record[k] for k in ("guard_attempts", "guard_refused") if k in record}
            self._publish(agent, progress, version, guard=guard or None)
            progress.next_version = version + 1
            record["published"] = True
        self._prune_states(agent)
        self.metrics.step(record)
        return True

    def _publish(self, agent: str, progress: AgentProgress, version: int, guard: dict[str, Any] | None = None) -> None:
        """``guard``: what the guard did in the step that made this version (a refused step's version
        has its parent's weights)."""
        lineage = sorted(e for e, _ in buffer.consumed_ids(engine=self.db, agent=agent, trained_in=version))
        retrained = buffer.retrained_in(engine=self.db, agent=agent, version=version)
        manifest = {
            "step": progress.step,
            "base_model": self.cfg.model.path,
            "algorithm": self.cfg.algorithm.name,
            "level": self.cfg.algorithm.level,
            "lora": self.cfg.lora.model_dump(),
            "parent_version": progress.published,
            "experience_ids": lineage,
            "experience_count": len(lineage),
        }
        cold = self.cfg.algorithm.cold_start_steps
        if progress.step - self.cfg.save_interval < cold:  # a version of the cold start: the gate measures its last
            manifest["cold_start"] = {"steps": cold, "last": progress.step >= cold}
        if retrained:  # trained again in this version for rewards that came after their first training
            manifest["late_retrained_ids"] = retrained
        if guard:
            manifest["guard"] = guard
        path = self.learners.write_version(agent, str(self.root), version, manifest)
        failpoint("trainer.after_version_renamed")
        self._announce(agent, version)
        immediate = self._policy(agent).mode == "immediate"
        if immediate:
            checkpoints.set_latest(self.root, agent, version)
        else:
            checkpoints.set_candidate(self.root, agent, version)
        progress.published = version
        log.info("agent %s: published v%d (%d experiences) at %s%s", agent, version, len(lineage), path,
                 "" if immediate else f" as a candidate (release.mode {self._policy(agent).mode})")
        prune_versions(self.root, agent, keep=self.cfg.checkpoints.keep_versions, grace_s=self.cfg.checkpoints.delete_grace_s)

    def _prune_states(self, agent: str) -> None:
        """Keep the newest ``keep_states`` states, and the state of each version still on disk: a
        rejected candidate or a rollback continues from the serving version's own state."""
        published = buffer.publishing_steps(engine=self.db, agent=agent, save_interval=self.cfg.save_interval)
        on_disk = set(checkpoints.list_versions(self.root, agent))
        kept = {self.root / ref for v, ref in published.items() if v in on_disk}
        for step in checkpoints.list_states(self.root, agent)[: -self.cfg.checkpoints.keep_states]:
            if checkpoints.state_path(self.root, agent, step) in kept:
                continue
            try:
                checkpoints.delete_state(self.root, agent, step)
            except OSError as e:  # an old state left over is harmless; the next step tries again
                log.warning("agent %s: could not delete the state of step %d: %s", agent, step, e)


def run_trainer(cfg: TrainerConfig) -> int:
    service = TrainerService(cfg)

    def _stop(signum, _frame):
        log.info("signal %d: finishing the current step, then stopping", signum)
        service.stop_event.set()

    try:
        service.start()
        # Installed after start: ray.init replaces the SIGTERM handler with one that exits at once,
        # mid-step; ours lets the current step finish.
        signal.signal(signal.SIGTERM, _stop)
        signal.signal(signal.SIGINT, _stop)
        return service.run()
    finally:
        service.close()
