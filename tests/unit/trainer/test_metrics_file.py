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
