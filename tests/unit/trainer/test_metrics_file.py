"""metrics.jsonl after a kill: a torn last line is cut off, and the newest step per agent is read back."""

from __future__ import annotations

import json

from services.trainer.metrics import MetricsSink


def _sink(tmp_path) -> MetricsSink:
    return MetricsSink(tmp_path, progress=False)


def _record(agent: str, step: int) -> dict:
    return {"agent": agent, "step": step, "version": step, "reward_mean": 0.5, "reward_std": 0.1, "loss": 0.25,
            "entropy": 1.0, "tokens_per_s": 10.0, "staleness_mean": 0.0}


def test_a_torn_last_line_is_cut_off_and_the_rest_kept(tmp_path):
    whole = json.dumps(_record("a", 1)) + "\n" + json.dumps(_record("b", 1)) + "\n"
    (tmp_path / "metrics.jsonl").write_text(whole + '{"agent": "a", "step": 2, "los')
    sink = _sink(tmp_path)
    try:
        assert (tmp_path / "metrics.jsonl").read_text() == whole
        assert sink.last_step("a") == 1 and sink.last_step("b") == 1 and sink.last_step("c") is None
        sink.step(_record("a", 2), at=1234.5)
    finally:
        sink.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["agent"], r["step"]) for r in lines] == [("a", 1), ("b", 1), ("a", 2)]
    assert lines[-1]["time"] == 1234.5


def test_a_file_that_is_one_torn_line_becomes_empty(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"agent": "a", "st')
    sink = _sink(tmp_path)
    try:
        assert (tmp_path / "metrics.jsonl").read_text() == "" and sink.last_step("a") is None
    finally:
        sink.close()


def test_the_newest_step_counts_not_the_last_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(_record("a", s)) + "\n" for s in (3, 5, 4)) + "not json\n")
    sink = _sink(tmp_path)
    try:
        assert sink.last_step("a") == 5
    finally:
        sink.close()


def test_a_whole_last_line_without_its_newline_is_ended_not_cut(tmp_path):
    whole = json.dumps(_record("a", 1))
    (tmp_path / "metrics.jsonl").write_text(whole)
    sink = _sink(tmp_path)
    try:
        assert (tmp_path / "metrics.jsonl").read_text() == whole + "\n"
        sink.step(_record("a", 2))
        assert sink.last_step("a") == 2  # counted as written, after the file was read once
        sink.step(_record("a", 3))
        assert sink.last_step("a") == 3
    finally:
        sink.close()
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]


def _step(step: int, version: int):
    from datetime import datetime, timezone

    from services.common.records import TrainerStep

    return TrainerStep(id=step, agent="a", step=step, version=version, consumed=4, discarded=0, state_ref=None,
                       metrics=_record("a", step) | {"version": version},
                       created_at=datetime(2026, 11, 29, 12, 0, tzinfo=timezone.utc))


def test_a_restart_writes_the_line_its_last_commit_missed_once_and_only_where_the_file_goes_on(tmp_path):
    """TrainerService._log_missed_step on the rule alone (the sink real, the service a stand-in: the kill
    test runs the real thing): the line is written when the file's newest step is the one before."""
    from types import SimpleNamespace

    from services.trainer.service import TrainerService

    def restart(folder, last):
        sink = _sink(folder)
        try:
            TrainerService._log_missed_step(SimpleNamespace(metrics=sink, cfg=SimpleNamespace(save_interval=2)), "a", last)
        finally:
            sink.close()
        return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]

    (tmp_path / "metrics.jsonl").write_text(json.dumps(_record("a", 1)) + "\n")
    lines = restart(tmp_path, _step(2, 1))  # step 2 committed, its line never written: it closes v1
    assert [(r["step"], r.get("recovered"), r.get("published")) for r in lines] == [(1, None, None), (2, True, True)]
    assert lines[-1]["time"] == _step(2, 1).created_at.timestamp()
    assert restart(tmp_path, _step(2, 1)) == lines  # once: the next restart finds it
    assert [r.get("published") for r in restart(tmp_path, _step(3, 2))[-1:]] == [None]  # step 3 closes nothing
    other = tmp_path / "elsewhere"
    assert not (restart(other, _step(5, 3)))  # another run folder, far along: not its line to write
    first = tmp_path / "first"
    assert [r["step"] for r in restart(first, _step(1, 1))] == [1]  # an agent's first step, in a new folder
    assert not restart(tmp_path / "none", None)


def test_a_torn_line_longer_than_a_read_is_cut_whole(tmp_path):
    whole = json.dumps(_record("a", 1)) + "\n"
    (tmp_path / "metrics.jsonl").write_text(whole + '{"agent": "a", "pad": "' + "x" * 200_000)
    sink = _sink(tmp_path)
    try:
        assert (tmp_path / "metrics.jsonl").read_text() == whole and sink.last_step("a") == 1
    finally:
        sink.close()
