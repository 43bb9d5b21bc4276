"""The Explorer's release controller: carries out each agent's release policy (services/common/release.py).

A Trainer in gated or canary mode publishes ``v<N>`` and names it in ``<root>/<agent>/CANDIDATE``
instead of LATEST. Every Explorer replica watches that pointer:

- gated: one replica (whoever holds ``.release.lock``) evaluates the candidate against the serving
  version through this Explorer's own HTTP API, pinned to each (``agent@vN``), on the gate's suite or
  on a replay of held-out traffic, and promotes or rejects it by a one-sided paired t-test;
- canary: every replica routes ``canary.share`` of the agent's traffic (by task_id) to the
  candidate; one replica at a time compares the online rewards of both versions since the canary
  began (from the database, so every replica and a restarted one see the same evidence) with an
  always-valid confidence sequence, and promotes or rolls back;
- immediate: the guard compares the serving version's online reward with its predecessor's and
  raises an alarm (optionally rolls back) when it is worse by more than a margin with confidence.

Every decision is recorded in the database (release_decisions) and the version's manifest before
LATEST or CANDIDATE move, so a replica killed half way leaves a decision the next look finishes.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

from sqlalchemy.engine import Engine as DBEngine

from services.common import buffer, checkpoints
from services.common.checkpoints import CheckpointError
from services.common.http.errors import APIError
from services.common.release import (
    EVAL_TASK_PREFIX,
    carry_out,
    rollback,
    TERMINAL_DECISIONS,
    Comparison,
    GateSection,
    ReleasePolicy,
    ReleaseSection,
    confidence_sequence,
    gate_verdict,
    decide,
    gate_best,
    gate_block,
    lineage_since,
    paired_lower_bound,
    verdict,
)
from services.explorer.edge.metrics import ExplorerMetrics
from services.explorer.serving.adapters import AdapterRegistry
from services.explorer.serving.episodes import EpisodePins

log = logging.getLogger("kaizen.release")


@dataclass
class AgentRelease:
    """What this replica knows of one agent's release, for /v1/models and /metrics."""

    mode: str = "immediate"
    candidate: int | None = None
    phase: str | None = None  # evaluating, canary
    started_at: float | None = None  # when the canary began (from its recorded decision)
    comparison: dict[str, Any] | None = None  # the latest figures of the gate, canary or guard
    last_decision: dict[str, Any] | None = None
    alarm: bool = False


@dataclass
class _GateRun:
    task: asyncio.Task
    candidate: int


class ReleaseController:
    def __init__(self, *, release: ReleaseSection, root: str, registry: AdapterRegistry, db: DBEngine,
                 metrics: ExplorerMetrics, episodes: EpisodePins, api_key: str, base_url: Callable[[], str | None]):
        self.release = release
        self.root = root
        self.registry = registry
        self.db = db
        self.metrics = metrics
        self.episodes = episodes
        self.api_key = api_key  # this Explorer's own key for its evaluations
        self.base_url = base_url
        self.status: dict[str, AgentRelease] = {}
        self._gates: dict[str, _GateRun] = {}
        self._baseline: dict[tuple, list[float]] = {}  # (agent, serving version, what) -> per-task scores
        self._guard_checked: dict[str, float] = {}

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.release.poll_interval_s)
            for agent in list(self.registry.agents):
                try:
                    await self.tick(agent)
                except Exception:
                    log.exception("agent %s: release controller failed; will retry", agent)

    def stop(self) -> None:
        for run in self._gates.values():
            run.task.cancel()

    async def tick(self, agent: str) -> None:
        policy = self.release.policy(agent)
        st = self.status.setdefault(agent, AgentRelease())
        st.mode = policy.mode
        try:
            candidate = checkpoints.read_candidate(self.root, agent)
        except CheckpointError as e:
            log.error("agent %s: %s", agent, e)
            return
        serving = self.registry.agents[agent].current.version
        if candidate is not None and candidate <= (checkpoints.read_latest(self.root, agent) or 0):
            candidate = self._stale_candidate(agent, candidate)
        st.candidate = candidate
        self.metrics.release_candidate.labels(agent).set(candidate or 0)
        if candidate is None:
            st.phase = None
            if self.registry.agents[agent].canary is not None:
                self.registry.clear_canary(agent)
            self.metrics.canary_share.labels(agent).set(0)
            if policy.mode == "immediate" and policy.guard.enabled:
                await self._guard(agent, serving, policy, st)
            return
        decided = self._terminal(agent, candidate)
        if decided is not None:  # recorded, not (fully) carried out: a replica died half way
            self._carry_out(agent, decided)
            return
        if policy.mode == "immediate":
            self._decide(agent, candidate, "promoted", serving=candidate, actor="immediate",
                         reason="release.mode is immediate: a candidate serves at once")
        elif policy.mode == "gated":
            self._start_gate(agent, candidate, policy, st)
        else:
            await self._canary(agent, candidate, serving, policy, st)

    def _stale_candidate(self, agent: str, candidate: int) -> int | None:
        """CANDIDATE names a version at or below the one serving: a promotion whose last step (clearing
        the pointer) did not happen, or a candidate overtaken by a rollback or publication."""
        with self._leader(agent) as leader:
            if leader:
                checkpoints.clear_candidate(self.root, agent, candidate)
        return None

    def _terminal(self, agent: str, version: int):
        for d in reversed(buffer.list_decisions(engine=self.db, agent=agent, version=version, limit=50)):
            if d.decision in TERMINAL_DECISIONS:
                return d
        return None

    # ------------------------------------------------------------------ decisions

    class _Leader:
        def __init__(self, ctl: "ReleaseController", agent: str):
            self.ctl, self.agent, self._cm = ctl, agent, None

        def __enter__(self) -> bool:
            self._cm = checkpoints.release_lock(self.ctl.root, self.agent, timeout_s=0)
            try:
                self._cm.__enter__()
                return True
            except CheckpointError:
                self._cm = None
                return False

        def __exit__(self, *exc) -> None:
            if self._cm is not None:
                self._cm.__exit__(*exc)

    def _leader(self, agent: str) -> "_Leader":
        """``with self._leader(agent) as leader:`` leader is True for the one replica holding the
        agent's release lock now (the others skip the decision this time)."""
        return self._Leader(self, agent)

    def _decide(self, agent: str, version: int, decision: str, *, serving: int | None, actor: str, reason: str, figures: dict[str, Any] | None = None, locked: bool = False, audit: dict[str, Any] | None = None) -> None:
        if not locked:
            with self._leader(agent) as leader:
                if leader and self._terminal(agent, version) is None:
                    self._decide(agent, version, decision, serving=serving, actor=actor, reason=reason,
                                 figures=figures, locked=True, audit=audit)
            return
        d = decide(root=self.root, db=self.db, agent=agent, version=version, decision=decision, serving=serving,
                   actor=actor, reason=reason, figures=figures, audit=audit)
        self._after(agent, d)
        log.warning("agent %s: v%d %s by %s: %s", agent, version, decision.replace("_", " "), actor, reason)

    def _carry_out(self, agent: str, d) -> None:
        with self._leader(agent) as leader:
            if leader:
                carry_out(self.root, agent, d)
        self._after(agent, d)

    def _after(self, agent: str, d) -> None:
        """This replica's side of a decision: the canary ends, pins to a refused version are let go."""
        st = self.status.setdefault(agent, AgentRelease())
        st.last_decision = d.as_entry()
        st.phase, st.candidate = None, None
        self.metrics.release_decisions.labels(agent, d.decision).inc()
        if self.registry.agents[agent].canary is not None and d.decision in TERMINAL_DECISIONS \
                and d.decision != "promoted":
            self.registry.clear_canary(agent)
        if d.decision in ("rejected", "rolled_back"):
            dropped = self.episodes.forget_version(agent, d.version)
            if dropped:
                log.info("agent %s: %d episodes pinned to v%d move to v%s", agent, dropped, d.version, d.serving)

    # ------------------------------------------------------------------ gated

    def _start_gate(self, agent: str, candidate: int, policy: ReleasePolicy, st: AgentRelease) -> None:
        run = self._gates.get(agent)
        if run is not None and not run.task.done():
            return
        st.phase = "evaluating"
        task = asyncio.create_task(self._gate(agent, candidate, policy), name=f"release-gate-{agent}")
        self._gates[agent] = _GateRun(task=task, candidate=candidate)

    def _manifest(self, agent: str, version: int) -> dict | None:
        """The version's manifest; None for one unreadable (its evaluation says what is wrong with it)."""
        try:
            return checkpoints.validate_version(self.root, agent, version).manifest()
        except CheckpointError:
            return None

    @staticmethod
    def _trained_from(manifest: dict | None, serving: int) -> bool:
        """Whether the manifest is of a Trainer's version trained from ``serving`` (not ``kaizen publish``'s, not
        another lineage's)."""
        return manifest is not None and manifest.get("source") != "publish" and manifest.get("parent_version") == serving

    def _block(self, agent: str, candidate: int, every: int) -> tuple[int, list[int], bool, dict | None]:
        """release.gate.every: (the version ``candidate`` is measured against, the versions that served since
        that one, newest first, whether to measure it now, the manifest's ``cold_start`` or None). A Trainer's
        candidate trained from the serving version is measured every ``every`` versions, against the anchor (the
        version the gate last measured); the versions of a Trainer's cold start (its first
        algorithm.cold_start_steps steps, on demonstrations) are one block whatever its length, measured at its
        last against the version it began from; anything else (``kaizen publish``, another lineage, every=1)
        against the serving version (LATEST), at once."""
        serving = checkpoints.read_latest(self.root, agent) or 0  # not this replica's: it may not have loaded it yet
        manifest = self._manifest(agent, candidate)
        if every <= 1 or not self._trained_from(manifest, serving):
            return serving, [], True, None
        cold = manifest.get("cold_start") if isinstance(manifest.get("cold_start"), dict) else None
        anchor, served = gate_block(self.root, agent, serving, limit=None if cold else every - 1)
        block_ends = cold.get("last") if cold else len(served) + 1 >= every
        if not block_ends:
            return anchor, served, False, cold
        if anchor != 0 and anchor not in checkpoints.list_versions(self.root, agent):
            log.warning("agent %s: v%d, the gate's last measured version, is gone from disk: v%d is measured against "
                        "the serving v%d", agent, anchor, candidate, serving)
            return serving, [], True, cold
        return anchor, served, True, cold

    async def _gate(self, agent: str, candidate: int, policy: ReleasePolicy) -> None:
        with self._leader(agent) as leader:
            if not leader or self._terminal(agent, candidate) is not None:
                return  # another replica evaluates it (or has decided)
            gate = policy.gate
            anchor, served, measure, cold = self._block(agent, candidate, gate.every)
            serving = served[0] if served else anchor
            if not measure:
                at = len(served) + 1
                figures = {"between_gates": True, "anchor": anchor, "position": at, "every": gate.every}
                if cold:
                    figures["cold_start"] = cold.get("steps")
                    why = (f"version {at} of the Trainer's cold start ({cold.get('steps')} steps, one block whose last "
                           f"version is measured against v{anchor}): it serves unmeasured (release.gate.every={gate.every})")
                else:
                    why = (f"{at} of {gate.every} versions after v{anchor}, the version the gate last measured: "
                           f"it serves unmeasured (release.gate.every={gate.every})")
                self._decide(agent, candidate, "promoted", serving=candidate, actor="gate", locked=True, reason=why,
                             figures=figures)
                return
            anchor, served, against = self._reference(agent, candidate, serving, anchor, served, gate)
            url = self.base_url()
            if url is None:
                log.warning("agent %s: v%d waits for its gate until this Explorer knows its own address (set "
                            "server.self_url, or it is learned from the first request)", agent, candidate)
                return
            log.info("agent %s: evaluating candidate v%d against v%d (%s)", agent, candidate, anchor,
                     "suite" if gate.suite else "replay of held-out traffic")
            t0 = time.monotonic()
            try:
                c, extra, remember = await asyncio.wait_for(self._evaluate(agent, anchor, candidate, gate, url), gate.timeout_s)
            except asyncio.TimeoutError:
                await self._refuse(agent, candidate, serving, anchor, served, actor="gate",
                                   reason=f"the evaluation took longer than release.gate.timeout_s={gate.timeout_s:g}")
                return
            except Exception as e:  # a broken suite must not promote anything
                log.exception("agent %s: the gate's evaluation of v%d failed", agent, candidate)
                await self._refuse(agent, candidate, serving, anchor, served, actor="gate",
                                   reason=f"the evaluation failed: {type(e).__name__}: {e}")
                return
            figures = {**c.figures(), **extra, "tolerance": gate.tolerance, "rule": gate.rule, "seconds": round(time.monotonic() - t0, 1)}
            if served:  # a block of release.gate.every measured against its anchor
                figures.update(anchor=anchor, served_since=served, every=gate.every)
            promote, bound = gate_verdict(c, rule=gate.rule, tolerance=gate.tolerance)
            if against:  # release.gate.against=best: the best measured so far, which a promotion may replace
                figures.update(against="best", best=candidate if promote and c.mean_candidate >= c.mean_serving else anchor)
            self.status[agent].comparison = figures
            why = (f"mean {c.mean_candidate:.3f} vs v{anchor}{' (the best measured)' if against else ''} "
                   f"{c.mean_serving:.3f} over {c.n_candidate} tasks: difference {c.diff:+.3f}, {bound} ({c.test})")
            if promote:
                key, scores = remember  # the best measured (against=best), else the candidate: the next comparison's baseline
                if not against or figures["best"] == candidate:
                    self._baseline = {k: v for k, v in self._baseline.items() if k[0] != agent}
                    self._baseline[key] = scores
                self._decide(agent, candidate, "promoted", serving=candidate, actor="gate", reason=why, figures=figures,
                             locked=True)
            else:
                await self._refuse(agent, candidate, serving, anchor, served, actor="gate", reason=why, figures=figures)

    def _reference(self, agent: str, candidate: int, serving: int, anchor: int, served: list[int],
                   gate: GateSection) -> tuple[int, list[int], bool]:
        """release.gate.against=best: (the version ``candidate`` is measured against and a rejection rolls back
        to, the versions that served since it, newest first, whether the decision records the best measured).
        For a Trainer's candidate that descends from what serves, the best is what the anchor's own gate
        promotion recorded, unless a decision by hand came since (then the anchor starts the measure again);
        otherwise (against=last, ``kaizen publish``) the anchor and its block."""
        if gate.against != "best" or not self._trained_from(self._manifest(agent, candidate), serving):
            return anchor, served, False
        best, decided_by = gate_best(self.root, agent, anchor)
        if decided_by is None:
            return anchor, served, True  # none recorded yet: the anchor is the best measured
        since = [d for d in buffer.list_decisions(engine=self.db, agent=agent, limit=1000) if d.id > decided_by]
        if any(d.actor not in ("gate", "trainer") for d in since):
            return anchor, served, True  # a version chosen by hand since: the measure starts again from the anchor
        chain = lineage_since(self.root, agent, serving, best)
        if chain is None:
            return anchor, served, True
        return best, chain, True

    async def _refuse(self, agent: str, candidate: int, serving: int, anchor: int, served: list[int], *, actor: str,
                      reason: str, figures: dict[str, Any] | None = None) -> None:
        """Reject ``candidate``; when versions served unmeasured since ``anchor`` (release.gate.every), first roll
        them back to it (one decision naming them all refused). The release lock is held."""
        if served:
            self._decide(agent, serving, "rolled_back", serving=anchor, actor=actor, locked=True,
                         reason=f"v{candidate}, measured {len(served) + 1} versions after v{anchor}, was refused ({reason}): "
                         f"v{anchor} serves again",
                         figures={**(figures or {}), "from": serving, "to": anchor, "refused": served})
            for v in served[1:]:  # the serving one's pins are let go by the decision itself
                self.episodes.forget_version(agent, v)
        self._decide(agent, candidate, "rejected", serving=anchor, actor=actor, reason=reason, figures=figures, locked=True)
        if served:
            await self.registry.sync(agent)

    async def _evaluate(self, agent: str, serving: int, candidate: int, gate: GateSection,
                        url: str) -> tuple[Comparison, dict[str, Any], tuple[tuple, list[float]]]:
        """Score both versions on the same tasks (the scores of the version compared against are kept while
        it is the one compared against). Returns the comparison, its figures (both versions'
        scores per task among them), and the candidate's scores with their key (kept if it is promoted)."""
        from services.explorer.release import evaluation

        if gate.suite is not None:
            score = lambda version, tag: evaluation.run_suite(  # noqa: E731
                gate.suite, url=url, api_key=self.api_key, agent=agent, version=version,
                task_prefix=f"{EVAL_TASK_PREFIX}{agent}/v{candidate}/{tag}")
            key = (agent, serving, "suite", gate.suite.model_dump_json())
            extra: dict[str, Any] = {"eval": "suite"}
        else:
            items = await asyncio.to_thread(evaluation.replay_items, self.db, agent, gate.replay)
            if len(items) < 2:
                raise RuntimeError(f"only {len(items)} held-out rewarded calls to replay (release.gate.replay.holdout_share "
                                   f"= {gate.replay.holdout_share:g}): the gate needs two or more")
            score = lambda version, tag: evaluation.replay(  # noqa: E731
                items, gate.replay, url=url, api_key=self.api_key, agent=agent, version=version,
                task_prefix=f"{EVAL_TASK_PREFIX}{agent}/v{candidate}/{tag}")
            key = (agent, serving, "replay", tuple(i.experience_id for i in items))
            extra = {"eval": "replay", "items": [i.experience_id for i in items]}
        base = self._baseline.get(key)
        if base is None:
            base = await asyncio.to_thread(score, serving, f"serving-v{serving}")
            self._baseline = {k: v for k, v in self._baseline.items() if k[:2] != key[:2]}
            self._baseline[key] = base
        cand = await asyncio.to_thread(score, candidate, "candidate")
        # per task, in the suite's (or the replay's items') order: a decision can be read again task by task
        extra["scores"] = {"against": [round(x, 4) for x in base], "candidate": [round(x, 4) for x in cand]}
        return paired_lower_bound(base, cand, confidence=gate.confidence), extra, ((agent, candidate, *key[2:]), cand)

    # ------------------------------------------------------------------ canary

    async def _canary(self, agent: str, candidate: int, serving: int, policy: ReleasePolicy, st: AgentRelease) -> None:
        cfg = policy.canary
        state = self.registry.agents[agent]
        if state.canary is None or state.canary.version != candidate or state.canary_share != cfg.share:
            try:
                await self.registry.set_canary(agent, candidate, cfg.share)
            except Exception as e:  # an unloadable candidate never serves
                self._decide(agent, candidate, "rejected", serving=serving, actor="canary",
                             reason=f"the candidate cannot be loaded: {e}")
                return
        st.phase = "canary"
        self.metrics.canary_share.labels(agent).set(cfg.share)
        started = self._canary_start(agent, candidate, serving, cfg.share)
        if started is None:
            return
        st.started_at = started.created_at.timestamp()
        base = buffer.version_rewards(engine=self.db, agent=agent, version=serving, since=started.created_at)
        cand = buffer.version_rewards(engine=self.db, agent=agent, version=candidate, since=started.created_at)
        for arm, rewards in (("serving", base), ("candidate", cand)):
            self.metrics.canary_episodes.labels(agent, arm).set(len(rewards))
            self.metrics.canary_reward.labels(agent, arm).set(statistics.fmean(rewards) if rewards else 0.0)
        for arm, n in state.routed.items():
            self.metrics.canary_requests.labels(agent, arm).set(n)
        figures: dict[str, Any] = {"share": cfg.share, "episodes": {"serving": len(base), "candidate": len(cand)},
                                   "requests": dict(state.routed), "tolerance": cfg.tolerance}
        outcome = "continue"
        if min(len(base), len(cand)) >= cfg.min_episodes:
            c = confidence_sequence(base, cand, confidence=cfg.confidence, scale=cfg.mixture_scale)
            figures.update(c.figures())
            self.metrics.canary_bound.labels(agent, "lower").set(c.lower)
            self.metrics.canary_bound.labels(agent, "upper").set(c.upper)
            outcome = verdict(c, tolerance=cfg.tolerance)
            why = (f"{c.n_candidate} episodes at {c.mean_candidate:.3f} vs v{serving}'s {c.n_serving} at "
                   f"{c.mean_serving:.3f}: difference {c.diff:+.3f} in [{c.lower:+.3f}, {c.upper:+.3f}] ({c.test}), "
                   f"tolerance {cfg.tolerance:g}")
        elapsed = time.time() - started.created_at.timestamp()
        if outcome == "continue" and elapsed > cfg.max_duration_s:
            outcome = "promote" if cfg.on_timeout == "promote" else "reject"
            why = f"undecided after {elapsed:.0f}s (release.canary.max_duration_s): on_timeout={cfg.on_timeout}"
        st.comparison = figures
        if outcome == "promote":
            self._decide(agent, candidate, "promoted", serving=candidate, actor="canary", reason=why,
                         figures=figures)
        elif outcome == "reject":
            self._decide(agent, candidate, "rolled_back", serving=serving, actor="canary", reason=why,
                         figures=figures)

    def _canary_start(self, agent: str, candidate: int, serving: int, share: float):
        """The canary's recorded start (one per candidate, whoever records it first), or None while
        another replica records it."""
        for d in buffer.list_decisions(engine=self.db, agent=agent, version=candidate, limit=50):
            if d.decision == "canary_started":
                return d
        with self._leader(agent) as leader:
            if not leader:
                return None
            d = buffer.record_decision(engine=self.db, agent=agent, version=candidate, decision="canary_started",
                                          serving=serving, actor="canary", figures={"share": share},
                                          reason=f"v{candidate} serves {share:.0%} of the traffic beside v{serving}")
        checkpoints.record_release(self.root, agent, candidate, d.as_entry())
        self.metrics.release_decisions.labels(agent, d.decision).inc()
        log.info("agent %s: canary of v%d began (%.0f%% of the traffic)", agent, candidate, share * 100)
        return d

    # ------------------------------------------------------------------ the guard (immediate mode)

    async def _guard(self, agent: str, serving: int, policy: ReleasePolicy, st: AgentRelease) -> None:
        now = time.monotonic()
        g = policy.guard
        if serving == 0 or now - self._guard_checked.get(agent, 0.0) < g.check_interval_s:
            return
        self._guard_checked[agent] = now
        # the alarm is about the version serving now (a rollback since clears it)
        st.alarm = any(d.decision == "alarm" for d in buffer.list_decisions(engine=self.db, agent=agent, version=serving,
                                                                            limit=50))
        self.metrics.release_alarm.labels(agent).set(1 if st.alarm else 0)
        if st.alarm:
            return
        try:
            parent = checkpoints.validate_version(self.root, agent, serving).manifest().get("parent_version")
        except CheckpointError:
            return
        if not isinstance(parent, int) or parent == serving:
            return
        now_r = buffer.version_rewards(engine=self.db, agent=agent, version=serving, limit=g.window)
        before = buffer.version_rewards(engine=self.db, agent=agent, version=parent, limit=g.window)
        if min(len(now_r), len(before)) < g.min_episodes:
            return
        c = confidence_sequence(before, now_r, confidence=g.confidence, scale=g.mixture_scale)
        st.comparison = {**c.figures(), "margin": g.margin, "predecessor": parent}
        if c.upper >= -g.margin:
            return
        why = (f"online reward {c.mean_candidate:.3f} over {c.n_candidate} episodes vs its predecessor v{parent}'s "
               f"{c.mean_serving:.3f} over {c.n_serving}: difference {c.diff:+.3f}, upper bound {c.upper:+.3f} < "
               f"-{g.margin:g} ({c.test})")
        with self._leader(agent) as leader:
            if not leader:
                return
            d = buffer.record_decision(engine=self.db, agent=agent, version=serving, decision="alarm", serving=serving,
                                          actor="guard", reason=why, figures=st.comparison)
            checkpoints.record_release(self.root, agent, serving, d.as_entry())
        self.metrics.release_decisions.labels(agent, "alarm").inc()
        st.alarm, st.last_decision = True, d.as_entry()
        self.metrics.release_alarm.labels(agent).set(1)
        log.error("agent %s: ALARM on v%d: %s", agent, serving, why)
        if g.rollback:
            self._decide(agent, serving, "rolled_back", serving=parent, actor="guard",
                         reason=f"release.guard.rollback after the alarm: {why}", figures=st.comparison)
            await self.registry.sync(agent)

    # ------------------------------------------------------------------ by hand (admin endpoints)

    def _known(self, agent: str) -> None:
        if agent not in self.registry.agents:
            raise APIError(404, f"the agent {agent!r} does not exist", param="agent", code="agent_not_found")

    async def rollback(self, agent: str, *, to: int | None, reason: str | None, actor: str,
                       audit: dict[str, Any] | None = None) -> dict[str, Any]:
        """Serve ``to`` (default: what the serving version was trained from) now: the decision is
        recorded (with ``audit``'s row, in its transaction), LATEST moved, and this replica serves it
        before answering (the others within their poll interval). Requests already running finish on
        their version."""
        self._known(agent)
        try:
            d = await asyncio.to_thread(rollback, root=self.root, db=self.db, agent=agent, to=to, actor=actor,
                                        reason=reason or "by hand", audit=audit)
        except ValueError as e:
            status = 409 if "already serves" in str(e) else 404
            raise APIError(status, str(e), param="to", code="version_not_servable") from None
        except CheckpointError as e:
            raise APIError(409, f"agent {agent}: {e}".replace(str(self.root), "<checkpoints.root>"),
                           code="release_locked") from None
        self._after(agent, d)
        for v in (d.figures or {}).get("refused") or []:
            self.episodes.forget_version(agent, v)
        await self.registry.sync(agent)
        log.warning("agent %s: %s to v%d by %s (%s)", agent, d.decision.replace("_", " "), d.serving, actor, reason)
        return {"agent": agent, "serving": self.registry.agents[agent].current.version, "decision": d.as_entry()}

    async def decide_by_hand(self, agent: str, version: int, decision: str, *, reason: str | None,
                             actor: str, audit: dict[str, Any] | None = None) -> dict[str, Any]:
        """Promote or reject the pending candidate ``version`` (``audit``'s row in the decision's transaction)."""
        self._known(agent)
        candidate = checkpoints.read_candidate(self.root, agent)
        if candidate != version:
            raise APIError(409, f"v{version} is not agent {agent}'s candidate (the candidate is "
                           f"{'none' if candidate is None else f'v{candidate}'})", param="version", code="not_a_candidate")
        serving = checkpoints.read_latest(self.root, agent) or 0
        promote = decision == "promote"
        with self._leader(agent) as leader:
            if not leader:
                raise APIError(409, f"another release decision about agent {agent} is being taken; retry",
                               code="release_locked", headers={"Retry-After": "1"})
            if self._terminal(agent, version) is not None:
                raise APIError(409, f"v{version} was already decided", param="version", code="already_decided")
            self._decide(agent, version, "promoted" if promote else "rejected", serving=version if promote else serving,
                         actor=actor, reason=reason or "by hand", locked=True, audit=audit)
        gate = self._gates.get(agent)
        if gate is not None and gate.candidate == version:
            gate.task.cancel()
        await self.registry.sync(agent)
        return {"agent": agent, "serving": self.registry.agents[agent].current.version,
                "decision": self.status[agent].last_decision}

    async def versions(self, agent: str) -> dict[str, Any]:
        """Every version of ``agent``: on disk with its manifest's lineage, or only in the decisions
        (deleted by retention since), each with its release decisions."""
        if agent not in self.registry.agents and not checkpoints.list_versions(self.root, agent):
            raise APIError(404, f"the agent {agent!r} does not exist", param="agent", code="agent_not_found")
        return await asyncio.to_thread(self._versions, agent)

    def _versions(self, agent: str) -> dict[str, Any]:
        decisions = buffer.list_decisions(engine=self.db, agent=agent, limit=10_000)
        serving = checkpoints.read_latest(self.root, agent) or 0
        candidate = checkpoints.read_candidate(self.root, agent)
        by_version: dict[int, list[dict[str, Any]]] = {}
        for d in decisions:
            by_version.setdefault(d.version, []).append(d.as_entry())
        rows = []
        on_disk = set(checkpoints.list_versions(self.root, agent))
        for v in sorted(on_disk | set(by_version)):
            row: dict[str, Any] = {"version": v, "on_disk": v in on_disk, "serving": v == serving,
                                   "candidate": v == candidate, "decisions": by_version.get(v, [])}
            if v in on_disk:
                try:
                    m = checkpoints.validate_version(self.root, agent, v).manifest()
                except CheckpointError:
                    m = {}
                row.update({k: m.get(k) for k in ("created_at", "source", "parent_version", "step", "algorithm",
                                                   "experience_count")})
            rows.append(row)
        return {"object": "list", "agent": agent, "serving": serving, "candidate": candidate,
                "release": self.describe(agent), "data": rows, "decisions": [d.as_entry() for d in decisions]}

    # ------------------------------------------------------------------ reporting

    def describe(self, agent: str) -> dict[str, Any]:
        st = self.status.get(agent) or AgentRelease(mode=self.release.policy(agent).mode)
        return {"mode": st.mode, "candidate": st.candidate, "phase": st.phase, "started_at": st.started_at,
                "comparison": st.comparison, "last_decision": st.last_decision, "alarm": st.alarm}
