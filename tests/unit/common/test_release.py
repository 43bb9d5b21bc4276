"""The release policy's pure parts: its statistics worked by hand, routing, hold-out and config."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from services.common.release import (
    Comparison,
    ReleaseSection,
    confidence_sequence,
    held_out,
    gate_verdict,
    paired_lower_bound,
    refused_versions,
    routed_to_candidate,
    student_t_quantile,
    verdict,
)


def test_student_t_quantile_matches_tables():
    # Tables: t(0.95, 3) = 2.353, t(0.95, 10) = 1.812, t(0.975, 30) = 2.042, t(0.95, inf) = 1.645
    assert student_t_quantile(0.95, 3) == pytest.approx(2.353, abs=0.01)
    assert student_t_quantile(0.95, 10) == pytest.approx(1.812, abs=0.002)
    assert student_t_quantile(0.975, 30) == pytest.approx(2.042, abs=0.002)
    assert student_t_quantile(0.95, 10**7) == pytest.approx(1.645, abs=0.001)


def test_paired_lower_bound_by_hand():
    # Per task the candidate minus the serving version: d = [1, 0, 1, 0]; mean 0.5; sample std
    # sqrt((4 * 0.25) / 3) = 0.5774; half-width t(0.95, 3) * 0.5774 / sqrt(4) = 2.353 * 0.2887 = 0.679.
    c = paired_lower_bound([0, 1, 0, 1], [1, 1, 1, 1], confidence=0.95)
    assert (c.n_serving, c.n_candidate) == (4, 4)
    assert c.mean_serving == 0.5 and c.mean_candidate == 1.0 and c.diff == 0.5
    assert c.lower == pytest.approx(0.5 - 0.679, abs=0.005)
    assert c.upper == pytest.approx(0.5 + 0.679, abs=0.005)


def test_paired_test_of_equal_and_of_broken_versions():
    same = paired_lower_bound([1, 0, 1, 1], [1, 0, 1, 1], confidence=0.95)
    assert same.diff == 0 and same.lower == 0  # no spread: the bound is the mean itself
    assert verdict(same, tolerance=0.05) == "promote"
    broken = paired_lower_bound([1, 1, 1, 1], [0, 0, 0, 0], confidence=0.95)
    assert broken.upper == -1
    assert verdict(broken, tolerance=0.05) == "reject"


def test_gate_rule_turns_the_burden_of_proof():
    # Per task the candidate answers where the serving version failed and fails where it answered:
    # d = [1, -1, 1, -1], mean 0, sample std sqrt(4 / 3) = 1.155, half-width 2.353 * 1.155 / 2 = 1.359.
    swapped = paired_lower_bound([0, 1, 0, 1], [1, 0, 1, 0], confidence=0.95)
    assert swapped.lower == pytest.approx(-1.359, abs=0.01) and swapped.upper == pytest.approx(1.359, abs=0.01)
    # not shown within 0.1 below: refused; not shown worse: promoted
    assert gate_verdict(swapped, rule="non_inferiority", tolerance=0.1) == (False, f"lower bound {swapped.lower:+.3f} <= -0.1")
    assert gate_verdict(swapped, rule="no_harm", tolerance=0.0) == (True, f"upper bound {swapped.upper:+.3f} >= -0 (rule no_harm)")
    # d = [0, -1, 0, -1]: mean -0.5, std 0.5774, half 0.679: upper +0.179, so no_harm still promotes it
    half_worse = paired_lower_bound([1, 1, 1, 1], [1, 0, 1, 0], confidence=0.95)
    assert gate_verdict(half_worse, rule="no_harm", tolerance=0.0)[0]
    # the same spread over 16 tasks: half-width t(0.95, 15) 1.753 * 0.5164 / 4 = 0.226, upper -0.274: shown worse
    worse16 = paired_lower_bound([1] * 16, [1, 0] * 8, confidence=0.95)
    assert worse16.upper == pytest.approx(-0.274, abs=0.005)
    assert gate_verdict(worse16, rule="no_harm", tolerance=0.0) == (False, f"upper bound {worse16.upper:+.3f} < -0 (rule no_harm)")
    assert gate_verdict(worse16, rule="no_harm", tolerance=0.3)[0]  # but not by more than 0.3
    same = paired_lower_bound([1, 0, 1, 1], [1, 0, 1, 1], confidence=0.95)  # no spread: both promote an equal one
    assert gate_verdict(same, rule="no_harm", tolerance=0.0)[0] and gate_verdict(same, rule="non_inferiority", tolerance=0.0) == (False, "lower bound +0.000 <= -0")
    with pytest.raises(ValueError, match="release.gate.rule"):
        gate_verdict(same, rule="maybe", tolerance=0.0)


def test_paired_test_needs_two_matched_tasks():
    with pytest.raises(ValueError, match="same two or more"):
        paired_lower_bound([1.0], [1.0], confidence=0.95)
    with pytest.raises(ValueError, match="same two or more"):
        paired_lower_bound([1.0, 0.0], [1.0], confidence=0.95)


def test_confidence_sequence_by_hand():
    # serving [0, 1] x 10 (mean 0.5, variance 0.25), candidate all 0 (variance 0 -> floor 0.01):
    # s2 = 0.01 / 20 + 0.25 / 20 = 0.013; scale 0.25 -> t2 = 0.0625; alpha = 0.05
    # radius^2 = 2 * 0.013 * (0.013 + 0.0625) / 0.0625 * (ln 20 + 0.5 ln((0.013 + 0.0625) / 0.013))
    #          = 0.031408 * (2.995732 + 0.5 * 1.758298) = 0.031408 * 3.874881 = 0.121702; radius 0.34886
    c = confidence_sequence([0, 1] * 10, [0] * 20, confidence=0.95, scale=0.25)
    assert c.diff == -0.5
    radius = math.sqrt(2 * 0.013 * 0.0755 / 0.0625 * (math.log(20) + 0.5 * math.log(0.0755 / 0.013)))
    assert radius == pytest.approx(0.34886, abs=1e-4)
    assert c.lower == pytest.approx(-0.5 - radius) and c.upper == pytest.approx(-0.5 + radius)
    assert verdict(c, tolerance=0.05) == "reject"  # upper -0.151 < -0.05


def test_confidence_sequence_waits_on_little_evidence_and_narrows_with_more():
    few = confidence_sequence([1, 0, 1], [1, 0, 0], confidence=0.95, scale=0.25)
    assert verdict(few, tolerance=0.05) == "continue"
    # a fair coin on both arms: about 4,000 episodes each bound the difference within 0.05 (radius 0.039)
    many = confidence_sequence([1, 0] * 2000, [1, 0] * 2000, confidence=0.95, scale=0.25)
    assert many.upper - many.lower < few.upper - few.lower
    assert verdict(many, tolerance=0.05) == "promote"  # equal within the tolerance, with confidence


def test_verdict_thresholds():
    def comp(lower: float, upper: float) -> Comparison:
        return Comparison("t", 10, 10, 0.5, 0.5, (lower + upper) / 2, lower, upper)

    assert verdict(comp(-0.04, 0.2), tolerance=0.05) == "promote"
    assert verdict(comp(-0.06, 0.2), tolerance=0.05) == "continue"
    assert verdict(comp(-0.3, -0.06), tolerance=0.05) == "reject"


def test_canary_routing_is_sticky_per_task_and_near_its_share():
    routed = [routed_to_candidate("planner", f"task-{i}", 0.2) for i in range(5000)]
    assert 0.18 < sum(routed) / len(routed) < 0.22
    assert routed == [routed_to_candidate("planner", f"task-{i}", 0.2) for i in range(5000)]  # every replica agrees
    # a larger share keeps every task the smaller one sent to the candidate
    assert all(routed_to_candidate("planner", f"task-{i}", 0.5) for i in range(5000) if routed[i])


def test_hold_out_share():
    assert not any(held_out("a", f"t{i}", 0.0) for i in range(100))
    share = sum(held_out("a", f"t{i}", 0.1) for i in range(5000)) / 5000
    assert 0.08 < share < 0.12


def test_per_agent_policy_and_clear_config_errors():
    cfg = ReleaseSection.model_validate({"mode": "canary", "canary": {"share": 0.2},
                                         "agents": {"planner": {"canary": {"min_episodes": 5}}}})
    p = cfg.policy("planner")
    assert p.mode == "canary" and p.canary.share == 0.2 and p.canary.min_episodes == 5
    assert cfg.policy("solver").canary.min_episodes == 20
    with pytest.raises(ValidationError, match="release.mode=gated needs an evaluation"):
        ReleaseSection.model_validate({"mode": "gated"})
    with pytest.raises(ValidationError, match="holdout_share > 0"):
        ReleaseSection.model_validate({"mode": "gated", "gate": {"replay": {"reward": "m:f"}}})
    with pytest.raises(ValidationError, match="release.agents.planner"):
        ReleaseSection.model_validate({"agents": {"planner": {"mode": "gated"}}})
    with pytest.raises(ValidationError, match="share"):
        ReleaseSection.model_validate({"canary": {"share": 1.5}})


def test_refused_versions_follow_the_decisions_in_order():
    from datetime import datetime, timezone

    from services.common.records import ReleaseDecision

    def d(i: int, decision: str, version: int, **figures) -> ReleaseDecision:
        return ReleaseDecision(id=i, agent="a", version=version, decision=decision, serving=None, actor="t",
                               reason=None, figures=figures or None, created_at=datetime.now(timezone.utc))

    history = [d(1, "promoted", 1), d(2, "candidate", 2), d(3, "rejected", 2), d(4, "promoted", 3),
               d(5, "promoted", 4), d(6, "rolled_back", 4, **{"from": 4, "to": 1, "refused": [2, 3, 4]})]
    assert refused_versions(history) == {2, 3, 4}
    # v3 promoted again by hand: its experiences are trainable again
    assert refused_versions([*history, d(7, "promoted", 3)]) == {2, 4}
    assert refused_versions([d(1, "alarm", 5), d(2, "canary_started", 6)]) == set()


def _version(root, v: int, parent: int, *decisions: dict) -> None:
    from services.common import checkpoints as ck

    ck.publish_version(root, "a", v, lambda d: ((d / "adapter_config.json").write_text("{}"),
                                                 (d / "adapter_model.safetensors").write_bytes(b"x")),
                       {"parent_version": parent})
    for e in decisions:
        ck.record_release(root, "a", v, e)


BETWEEN = {"decision": "promoted", "by": "gate", "figures": {"between_gates": True}}
MEASURED = {"decision": "promoted", "by": "gate", "figures": {"diff": 0.1}}


def test_gate_block_walks_back_through_the_versions_promoted_between_gates(tmp_path):
    from services.common.release import gate_block, promoted_between_gates

    _version(tmp_path, 1, 0, MEASURED)  # the anchor: measured by the gate
    _version(tmp_path, 2, 1, BETWEEN)
    _version(tmp_path, 3, 2, BETWEEN)
    _version(tmp_path, 4, 3, {"decision": "rejected", "by": "gate"})
    _version(tmp_path, 5, 1, BETWEEN)  # trained on from v1 after the rollback below
    _version(tmp_path, 6, 0, BETWEEN)  # a lineage from the base model
    assert gate_block(tmp_path, "a", 3) == (1, [3, 2])
    assert gate_block(tmp_path, "a", 3, limit=1) == (2, [3])  # at most `limit` walked
    assert gate_block(tmp_path, "a", 1) == (1, [])  # the anchor serves itself
    assert gate_block(tmp_path, "a", 5) == (1, [5])
    assert gate_block(tmp_path, "a", 6) == (0, [6])
    assert gate_block(tmp_path, "a", 9) == (9, [])  # not on disk: the caller finds it gone
    # a version promoted between gates and later rolled back is no longer between gates: the walk stops there
    from services.common import checkpoints as ck

    ck.record_release(tmp_path, "a", 3, {"decision": "rolled_back", "by": "gate", "figures": {"refused": [3, 2]}})
    assert gate_block(tmp_path, "a", 3) == (3, [])
    assert not promoted_between_gates({"release": [BETWEEN, {"decision": "rolled_back"}]})
    assert promoted_between_gates({"release": [{"decision": "candidate"}, BETWEEN]})
    assert not promoted_between_gates({}) and not promoted_between_gates({"release": [MEASURED]})


def test_gate_best_reads_the_anchors_own_promotion_and_the_lineage_back_to_it(tmp_path):
    """release.gate.against=best: the anchor's gate promotion names the best measured so far."""
    from services.common.release import gate_best, lineage_since

    best = lambda v, b: {"id": 10 + v, "decision": "promoted", "by": "gate", "figures": {"diff": 0.0, "best": b}}  # noqa: E731
    _version(tmp_path, 1, 0, best(1, 1))
    _version(tmp_path, 2, 1, BETWEEN)
    _version(tmp_path, 3, 2, best(3, 1))  # promoted below v1's mean: v1 stays the best
    _version(tmp_path, 4, 3, BETWEEN)
    _version(tmp_path, 5, 4, best(5, 5))  # promoted above it: the best itself
    _version(tmp_path, 6, 5, MEASURED)  # promoted under against=last: records none
    _version(tmp_path, 7, 6, {"id": 30, "decision": "promoted", "by": "cli", "figures": {"best": 1}})
    _version(tmp_path, 8, 7, {"id": 31, "decision": "promoted", "by": "gate", "figures": {"best": 99}})
    assert gate_best(tmp_path, "a", 3) == (1, 13)
    assert gate_best(tmp_path, "a", 5) == (5, 15)
    assert gate_best(tmp_path, "a", 1) == (1, 11)
    assert gate_best(tmp_path, "a", 6) == (6, None)  # it names none
    assert gate_best(tmp_path, "a", 7) == (7, None)  # promoted by hand
    assert gate_best(tmp_path, "a", 8) == (8, None)  # the version it names is gone from disk
    assert gate_best(tmp_path, "a", 0) == (0, None) and gate_best(tmp_path, "a", 42) == (42, None)
    assert lineage_since(tmp_path, "a", 4, 1) == [4, 3, 2]
    assert lineage_since(tmp_path, "a", 4, 4) == []
    assert lineage_since(tmp_path, "a", 4, 0) == [4, 3, 2, 1]
    assert lineage_since(tmp_path, "a", 4, 5) is None  # not an ancestor
    from services.common import checkpoints as ck

    ck.delete_version(tmp_path, "a", 2)
    assert lineage_since(tmp_path, "a", 4, 1) is None  # the walk breaks where a version is gone
    # a rollback after the promotion leaves it the anchor's last terminal decision only if it came before
    ck.record_release(tmp_path, "a", 5, {"id": 40, "decision": "rolled_back", "by": "gate", "figures": {}})
    assert gate_best(tmp_path, "a", 5) == (5, None)


def test_gate_against_is_last_or_best():
    assert ReleaseSection().gate.against == "last"
    assert ReleaseSection.model_validate({"gate": {"against": "best"}}).policy("x").gate.against == "best"
    with pytest.raises(ValidationError, match="against"):
        ReleaseSection.model_validate({"gate": {"against": "first"}})


def test_gate_every_is_one_or_more():
    assert ReleaseSection().gate.every == 1
    assert ReleaseSection.model_validate({"gate": {"every": 4}}).policy("x").gate.every == 4
    with pytest.raises(ValidationError, match="every"):
        ReleaseSection.model_validate({"gate": {"every": 0}})
