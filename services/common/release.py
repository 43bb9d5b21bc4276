"""Release policy: which published adapter version serves, decided on evidence (both services read it).

    immediate  a new version serves as soon as it is published (with an optional alarm, the guard,
               when the online reward of the serving version falls below its predecessor's)
    gated      a new version is a candidate; an evaluation through the Explorer, pinned to it
               (``agent@vN``), compares it with the serving version on the same tasks, and it is
               promoted only if it is not worse by more than ``gate.tolerance`` (a one-sided paired
               t-test at ``gate.confidence``); otherwise it is rejected and never serves. With
               ``gate.rule: no_harm`` the burden turns: it is rejected only when it is worse by more
               than the tolerance with confidence
    canary     a candidate takes ``canary.share`` of the agent's live traffic (sticky per task_id);
               the online rewards of both versions are compared with an always-valid confidence
               sequence, and it is promoted when it is better or equal within ``canary.tolerance``
               with confidence, rolled back when it is worse by more than that

The statistics here are pure functions, tested by hand-worked examples.
"""

from __future__ import annotations

import hashlib
import logging
import math
import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from services.common.config import ConfigModel, deep_merge
from services.common.records import EVAL_TASK_PREFIX  # published here too: the evaluation's task ids

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

    from services.common.records import ReleaseDecision

log = logging.getLogger("kaizen.release")


class SuiteSection(ConfigModel):
    """A user-supplied evaluation suite: an environment and a dataset, the runner SDK's Environment
    protocol (the same shape ``kaizen train`` uses)."""

    env: str = Field(description="module:attr of the environment class: env(task, **env_args) with reset() and step(action).")
    env_args: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the environment class.")
    dataset: str = Field(description="The evaluation tasks: a .json / .jsonl file or module:attr (a list or a function returning one).")
    agent: str = Field(description="module:attr of `async def agent(client, observation) -> action` (or a class of such callables).")
    agent_args: dict[str, Any] = Field(default_factory=dict, description="Arguments of an agent class.")
    repeat: int = Field(default=1, ge=1, description="Runs of each task per version (their mean is the task's score).")
    max_tasks: int | None = Field(default=None, ge=2, description="Use only the first this many tasks.")
    concurrency: int = Field(default=16, ge=1, description="Episodes in flight at once.")
    max_steps: int = Field(default=8, ge=1, description="Environment steps per episode at most.")


class ReplaySection(ConfigModel):
    """A replay of held-out recent traffic: rewarded calls whose task_id (or experience id) hashes
    into ``holdout_share`` are never trained on; the gate sends their recorded messages to both
    versions and scores the answers with ``reward``, the runner SDK reward the application uses."""

    holdout_share: float = Field(
        default=0.0, ge=0, lt=1,
        description="Share of rewarded traffic held out from training for replay (the Trainer must use the same value).",
    )
    reward: str | None = Field(
        default=None,
        description="module:attr of a runner SDK RewardCalculator (a callable of an AgentRun whose input is the last "
        "user message, output the answer, expected what the feedback carried as `expected`), or a class of one.",
    )
    items: int = Field(default=32, ge=2, description="Held-out calls replayed (the most recent).")
    repeat: int = Field(default=1, ge=1, description="Answers per call and version (their mean is the call's score).")


class GateSection(ConfigModel):
    suite: SuiteSection | None = Field(default=None, description="Evaluate on this suite; absent: replay held-out traffic.")
    replay: ReplaySection = Field(default_factory=ReplaySection)
    tolerance: float = Field(default=0.05, ge=0, description="A candidate may score at most this much below the serving version.")
    confidence: float = Field(default=0.95, gt=0.5, lt=1, description="Confidence of the one-sided bound the gate tests.")
    rule: Literal["non_inferiority", "no_harm"] = Field(
        default="non_inferiority",
        description="Who carries the burden of proof. non_inferiority: the candidate is promoted only if it is shown "
        "not worse than tolerance below the version it is measured against (lower confidence bound above -tolerance); "
        "a small suite then refuses a version that differs without being worse. no_harm: it is rejected only if it "
        "is shown worse by more than tolerance (upper bound below -tolerance); a version that is worse by less than "
        "the suite can see is promoted, and becomes the next one measured against.")
    against: Literal["last", "best"] = Field(
        default="last",
        description="What a Trainer's candidate is measured against. last: the version the gate last measured (the "
        "serving one with every=1); a rejection rolls back to it. best: the best version the gate has measured in the "
        "serving lineage (the highest mean on the gate's tasks among those it promoted); a rejection rolls back to it, "
        "refusing every version since. Under no_harm this stops a walk down in steps each too small to show, since "
        "each is measured against the same best rather than against the one before it. A candidate of `kaizen "
        "publish`, or a version chosen by hand since, starts the measure again from the one serving.")
    timeout_s: float = Field(default=1800.0, gt=0, description="An evaluation that takes longer rejects the candidate.")
    every: int = Field(
        default=1, ge=1,
        description="Measure every this many versions a Trainer publishes: the others, each trained from the version "
        "serving, serve at once (between gates), and every Nth is measured against the version the gate last measured "
        "(the anchor). A rejection rolls back to the anchor, refusing the versions that served since, and the Trainer "
        "continues from the anchor's state. Above 1, a Trainer's cold start (algorithm.cold_start_steps, on "
        "demonstrations) is one block whatever its length: its versions serve unmeasured and its last is measured, the "
        "next block counting from it. 1: every version is measured against the one serving. A candidate of "
        "`kaizen publish` is always measured against the one serving.")


class CanarySection(ConfigModel):
    share: float = Field(default=0.1, gt=0, lt=1, description="Share of the agent's traffic (by task_id) the candidate serves.")
    tolerance: float = Field(
        default=0.05, ge=0,
        description="Promoted when the candidate's reward is at least the serving version's minus this with confidence; "
        "rolled back when it is below that with confidence.",
    )
    confidence: float = Field(default=0.95, gt=0.5, lt=1, description="Confidence of the sequential test (always valid).")
    mixture_scale: float = Field(
        default=0.25, gt=0, description="Scale of the differences in reward the sequential test expects (its mixture prior).",
    )
    min_episodes: int = Field(default=20, ge=2, description="Rewarded episodes each version needs before any decision.")
    max_duration_s: float = Field(default=3600.0, gt=0, description="A canary still undecided after this long ends by on_timeout.")
    on_timeout: Literal["reject", "promote"] = Field(default="reject", description="What an undecided canary becomes at its end.")


class ServingGuardSection(ConfigModel):
    """immediate mode: compare the serving version's online reward with its predecessor's."""

    enabled: bool = Field(default=True, description="Watch the serving version (immediate mode).")
    margin: float = Field(default=0.1, ge=0, description="Alarm when the serving version is below its predecessor by more than this, with confidence.")
    confidence: float = Field(default=0.95, gt=0.5, lt=1, description="Confidence of the sequential test.")
    mixture_scale: float = Field(default=0.25, gt=0, description="Scale of the differences the sequential test expects.")
    min_episodes: int = Field(default=30, ge=2, description="Rewarded episodes each version needs before an alarm.")
    window: int = Field(default=2000, ge=10, description="Most recent rewarded episodes of each version compared.")
    rollback: bool = Field(default=False, description="On the alarm, also roll back to the predecessor.")
    check_interval_s: float = Field(default=10.0, gt=0, description="Seconds between two looks at the online rewards.")


class ReleasePolicy(ConfigModel):
    mode: Literal["immediate", "gated", "canary"] = Field(default="immediate", description="How a new version comes to serve.")
    gate: GateSection = Field(default_factory=GateSection)
    canary: CanarySection = Field(default_factory=CanarySection)
    guard: ServingGuardSection = Field(default_factory=ServingGuardSection)
    rejected_experiences: Literal["discard", "keep"] = Field(
        default="discard",
        description="What the experiences a rejected or rolled-back version produced become (applied by the Trainer, also "
        "to those recorded after the decision): discard (never trained) or keep (trained as usual: the clipped "
        "importance ratio against their recorded logprobs weighs them).",
    )

    @model_validator(mode="after")
    def _check(self) -> "ReleasePolicy":
        if self.mode == "gated" and self.gate.suite is None and self.gate.replay.reward is None:
            raise ValueError("release.mode=gated needs an evaluation: release.gate.suite, or release.gate.replay.reward "
                             "(with release.gate.replay.holdout_share > 0)")
        if self.mode == "gated" and self.gate.suite is None and self.gate.replay.holdout_share <= 0:
            raise ValueError("release.gate.replay needs release.gate.replay.holdout_share > 0 (traffic held out to replay)")
        return self


class ReleaseSection(ReleasePolicy):
    """The default policy, and per-agent overrides in ``agents`` (same keys)."""

    agents: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="Per-agent overrides of the keys above, e.g. {planner: {mode: canary}}.",
    )
    poll_interval_s: float = Field(default=1.0, gt=0, description="Explorer: how often candidates and canaries are looked at.")

    @model_validator(mode="after")
    def _check_agents(self) -> "ReleaseSection":
        for name in self.agents:
            try:
                self.policy(name)
            except ValueError as e:
                raise ValueError(f"release.agents.{name}: {e}") from None
        return self

    def policy(self, agent: str) -> ReleasePolicy:
        base = self.model_dump(exclude={"agents", "poll_interval_s"})
        return ReleasePolicy.model_validate(deep_merge(base, self.agents.get(agent) or {}))


# ---------------------------------------------------------------------------------------------
# Routing and hold-out: deterministic hashes, so every Explorer replica and the Trainer agree.


def unit_hash(*parts: str) -> float:
    """A number in [0, 1) from the parts, the same in every process."""
    digest = hashlib.sha256("\x1f".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def routed_to_candidate(agent: str, task_id: str, share: float) -> bool:
    """Canary routing is sticky per task_id: every call of a task (all its runs) goes one way."""
    return unit_hash("canary", agent, task_id) < share


def held_out(agent: str, key: str, share: float) -> bool:
    """Whether a rewarded call (key: its task_id, else its experience id) is held out from training
    for the gate's replay."""
    return share > 0 and unit_hash("holdout", agent, key) < share


# ---------------------------------------------------------------------------------------------
# Statistics.


@dataclass(frozen=True)
class Comparison:
    """The candidate against the serving version: difference of mean rewards and its bounds."""

    test: str
    n_serving: int
    n_candidate: int
    mean_serving: float
    mean_candidate: float
    diff: float  # candidate - serving
    lower: float
    upper: float

    def figures(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def student_t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t with ``df`` degrees of freedom (Cornish-Fisher expansion around
    the normal quantile, Abramowitz and Stegun 26.7.5; within 0.01 of the exact value for df >= 3)."""
    z = statistics.NormalDist().inv_cdf(p)
    if df >= 1e6:
        return z
    n = float(df)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / n + g2 / n**2 + g3 / n**3 + g4 / n**4


def paired_lower_bound(serving: list[float], candidate: list[float], *, confidence: float) -> Comparison:
    """The gate's test: per task, the candidate's score minus the serving version's; the one-sided
    lower confidence bound of their mean by Student's t (upper: the two-sided counterpart at the same
    level, for reading). Tasks are the unit, so calls of a multi-turn episode are never counted apart."""
    if len(serving) != len(candidate) or len(serving) < 2:
        raise ValueError("the paired test needs the same two or more tasks scored on both versions")
    d = [c - s for s, c in zip(serving, candidate)]
    n = len(d)
    mean = statistics.fmean(d)
    half = student_t_quantile(confidence, n - 1) * statistics.stdev(d) / math.sqrt(n)
    return Comparison(test=f"paired t, one-sided {confidence:.0%}", n_serving=n, n_candidate=n,
                      mean_serving=statistics.fmean(serving), mean_candidate=statistics.fmean(candidate),
                      diff=mean, lower=mean - half, upper=mean + half)


def confidence_sequence(serving: list[float], candidate: list[float], *, confidence: float, scale: float,
                        variance_floor: float = 0.01) -> Comparison:
    """An always-valid confidence sequence for mean(candidate) - mean(serving), safe to look at after
    every new reward (a canary is watched continuously): the normal-mixture boundary of the mixture
    SPRT (Robbins 1970; Johari, Pekelis and Walsh, "Always valid inference", 2017) applied to the
    difference of two sample means with variance s2 = var_c / n_c + var_s / n_s and a N(0, scale^2)
    mixture over the difference:

        radius^2 = 2 s2 (s2 + scale^2) / scale^2 * (ln(1 / alpha) + ln(sqrt((s2 + scale^2) / s2)))

    ``variance_floor`` keeps a run of equal rewards (variance 0) from claiming certainty at once.
    """
    if len(serving) < 2 or len(candidate) < 2:
        raise ValueError("each version needs two or more rewards")
    alpha = 1 - confidence
    vs = max(statistics.pvariance(serving), variance_floor)
    vc = max(statistics.pvariance(candidate), variance_floor)
    s2 = vc / len(candidate) + vs / len(serving)
    t2 = scale**2
    radius = math.sqrt(2 * s2 * (s2 + t2) / t2 * (math.log(1 / alpha) + 0.5 * math.log((s2 + t2) / s2)))
    ms, mc = statistics.fmean(serving), statistics.fmean(candidate)
    diff = mc - ms
    return Comparison(test=f"normal-mixture confidence sequence {confidence:.0%}, scale {scale:g}",
                      n_serving=len(serving), n_candidate=len(candidate), mean_serving=ms, mean_candidate=mc,
                      diff=diff, lower=diff - radius, upper=diff + radius)


def gate_verdict(c: Comparison, *, rule: str, tolerance: float) -> tuple[bool, str]:
    """The gate's one decision on a finished evaluation (release.gate.rule): (promote, the bound that
    decided, as words). non_inferiority promotes when the lower bound is above -tolerance; no_harm
    rejects only when the upper bound is below it."""
    if rule == "non_inferiority":
        promote = c.lower > -tolerance
        return promote, f"lower bound {c.lower:+.3f} {'>' if promote else '<='} -{tolerance:g}"
    if rule == "no_harm":
        promote = c.upper >= -tolerance
        return promote, f"upper bound {c.upper:+.3f} {'>=' if promote else '<'} -{tolerance:g} (rule no_harm)"
    raise ValueError(f"unknown release.gate.rule {rule!r}")


Verdict = Literal["promote", "reject", "continue"]


def verdict(c: Comparison, *, tolerance: float) -> Verdict:
    """Promote when the candidate is better or equal within ``tolerance`` with confidence (lower bound
    above -tolerance); reject when it is worse by more than that with confidence (upper bound below
    -tolerance); else wait for more evidence."""
    if c.lower > -tolerance:
        return "promote"
    if c.upper < -tolerance:
        return "reject"
    return "continue"


# ---------------------------------------------------------------------------------------------
# Carrying out a decision: the database first, then the files. Every step is idempotent, so a
# process killed half way leaves a decision that the next look (``carry_out``) finishes.

TERMINAL_DECISIONS = ("promoted", "rejected", "rolled_back")


def decide(*, root: str | Path, db: "Engine", agent: str, version: int, decision: str, serving: int | None,
           actor: str, reason: str | None = None, figures: dict[str, Any] | None = None,
           audit: dict[str, Any] | None = None) -> "ReleaseDecision":
    """Record ``decision`` about ``version`` and carry it out. ``promoted``: ``serving`` (= version)
    serves; ``rejected``: the candidate never serves; ``rolled_back``: ``serving`` (older) serves
    again. What the refused versions produced is the Trainer's to handle (``refused_versions``).
    ``audit``: the audit log's row, written in the decision's transaction."""
    from services.common import buffer

    record = buffer.record_decision(engine=db, agent=agent, version=version, decision=decision, serving=serving,
                                    actor=actor, reason=reason, figures=figures, audit=audit)
    carry_out(root, agent, record)
    return record


def refused_versions(decisions: "list[ReleaseDecision]") -> set[int]:
    """The versions whose experiences ``rejected_experiences=discard`` keeps out of training: those
    rejected or rolled back (a rollback over several versions names them in ``figures.refused``),
    less any promoted again since. ``decisions`` oldest first."""
    refused: set[int] = set()
    for d in decisions:
        if d.decision in ("rejected", "rolled_back"):
            refused |= {d.version, *((d.figures or {}).get("refused") or [])}
        elif d.decision == "promoted":
            refused.discard(d.version)
    return refused


def promoted_between_gates(manifest: dict[str, Any]) -> bool:
    """Whether a version's last release decision promoted it unmeasured, between two gates (release.gate.every)."""
    final = [e for e in manifest.get("release") or [] if e.get("decision") in TERMINAL_DECISIONS]
    return bool(final) and final[-1]["decision"] == "promoted" and bool((final[-1].get("figures") or {}).get("between_gates"))


def gate_block(root: str | Path, agent: str, serving: int, limit: int | None = None) -> tuple[int, list[int]]:
    """The gated mode's block (release.gate.every), read from the versions' manifests: the version the gate
    last measured (the anchor) and the versions that served since (newest first, ``serving`` first), found by
    walking back from ``serving`` through ``parent_version`` while a version was promoted between gates (at
    most ``limit`` of them). The anchor is 0 (the base model) when the walk reaches it, or a version no longer
    on disk (the caller checks)."""
    from services.common import checkpoints
    from services.common.checkpoints import CheckpointError

    served: list[int] = []
    v = serving
    while v > 0 and (limit is None or len(served) < limit):
        try:
            manifest = checkpoints.validate_version(root, agent, v).manifest()
        except CheckpointError:
            break
        parent = manifest.get("parent_version")
        if not promoted_between_gates(manifest) or not isinstance(parent, int) or parent >= v:
            break
        served.append(v)
        v = parent
    return v, served


def gate_best(root: str | Path, agent: str, anchor: int) -> tuple[int, int | None]:
    """release.gate.against=best: the best version the gate has measured in ``anchor``'s lineage, as the
    anchor's own gate promotion recorded it (``figures.best``), with that decision's id; ``(anchor, None)``
    when the anchor's last decision recorded none (another rule, the base model, a decision by hand) or
    that version is gone from disk."""
    from services.common import checkpoints
    from services.common.checkpoints import CheckpointError

    if anchor <= 0:
        return anchor, None
    try:
        manifest = checkpoints.validate_version(root, agent, anchor).manifest()
    except CheckpointError:
        return anchor, None
    final = [e for e in manifest.get("release") or [] if e.get("decision") in TERMINAL_DECISIONS]
    if not final or final[-1]["decision"] != "promoted" or final[-1].get("by") != "gate":
        return anchor, None
    best = (final[-1].get("figures") or {}).get("best")
    if not isinstance(best, int) or best == anchor:
        return anchor, final[-1].get("id")
    if best > 0 and best not in checkpoints.list_versions(root, agent):
        return anchor, None
    return best, final[-1].get("id")


def lineage_since(root: str | Path, agent: str, version: int, ancestor: int) -> list[int] | None:
    """The versions from ``version`` back to ``ancestor`` (excluded) through ``parent_version``, newest
    first; None when the walk does not reach ``ancestor``."""
    from services.common import checkpoints
    from services.common.checkpoints import CheckpointError

    out: list[int] = []
    v = version
    while v != ancestor:
        if v <= ancestor:
            return None
        try:
            parent = checkpoints.validate_version(root, agent, v).manifest().get("parent_version")
        except CheckpointError:
            return None
        if not isinstance(parent, int) or parent >= v:
            return None
        out.append(v)
        v = parent
    return out


def carry_out(root: str | Path, agent: str, d: "ReleaseDecision") -> None:
    """The file side of a recorded decision: the version's manifest, LATEST, CANDIDATE."""
    from services.common import checkpoints

    checkpoints.record_release(root, agent, d.version, d.as_entry())
    if d.decision in ("promoted", "rolled_back") and d.serving is not None:
        if (checkpoints.read_latest(root, agent) or 0) != d.serving:
            checkpoints.set_latest(root, agent, d.serving)
    if d.decision in TERMINAL_DECISIONS:
        checkpoints.clear_candidate(root, agent, d.version)


def rollback_target(root: str | Path, agent: str, serving: int) -> int:
    """Where ``kaizen rollback`` goes without ``--to``: the version the serving one was trained from
    (its manifest's parent_version) while it is still on disk, else the newest older version on disk,
    else the base model (0)."""
    from services.common import checkpoints
    from services.common.checkpoints import CheckpointError

    older = [v for v in checkpoints.list_versions(root, agent) if v < serving]
    try:
        parent = checkpoints.validate_version(root, agent, serving).manifest().get("parent_version")
    except CheckpointError:
        parent = None
    if isinstance(parent, int) and (parent == 0 or parent in older):
        return parent
    return older[-1] if older else 0


def rollback(*, root: str | Path, db: "Engine", agent: str, to: int | None, actor: str,
             reason: str | None, audit: dict[str, Any] | None = None) -> "ReleaseDecision":
    """Move serving to ``to`` (default: ``rollback_target``), at once: LATEST is replaced, running
    Explorers hot-load it within their poll interval. Raises ValueError for a version that cannot serve."""
    from services.common import checkpoints
    from services.common.checkpoints import CheckpointError

    with checkpoints.release_lock(root, agent, timeout_s=30):
        serving = checkpoints.read_latest(root, agent) or 0
        target = rollback_target(root, agent, serving) if to is None else to
        if target == serving:
            raise ValueError(f"agent {agent} already serves v{serving}")
        if target < 0:
            raise ValueError("a version number is 0 (the base model) or more")
        if target > 0:
            try:
                checkpoints.validate_version(root, agent, target)
            except CheckpointError:
                raise ValueError(f"agent {agent} has no complete v{target} on disk (it was never published or was "
                                 "deleted by retention)") from None
        if target < serving:  # every version above the target that served or waited is refused
            refused = [v for v in checkpoints.list_versions(root, agent) if target < v <= serving]
            return decide(root=root, db=db, agent=agent, version=serving, decision="rolled_back", serving=target,
                          actor=actor, reason=reason, figures={"from": serving, "to": target, "refused": refused},
                          audit=audit)
        return decide(root=root, db=db, agent=agent, version=target, decision="promoted", serving=target, actor=actor,
                      reason=reason, figures={"from": serving, "to": target}, audit=audit)
