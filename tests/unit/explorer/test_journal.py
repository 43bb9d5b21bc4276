"""The recorder's journal: append, replay after a crash, release, and sharing a directory."""

from __future__ import annotations

import os

from services.common.records import Experience
from services.explorer.recording.journal import Journal


def _exp(i: int, task: str | None = "t") -> Experience:
    return Experience(
        experience_id=f"c{i}-0", completion_id=f"c{i}", agent="a", model_version=0, task_id=task,
        prompt_token_ids=[1, 2, 3], response_token_ids=[4], response_logprobs=[-0.5],
        messages=[{"role": "user", "content": "hi"}], response={"role": "assistant", "content": "yo"}, sampling={},
    )


def _crash(j: Journal) -> None:
    """What kill -9 leaves: the files, unlocked, nothing cleaned up."""
    for seg in j._segments.values():
        os.close(seg.fd)
    j._segments.clear()


def _segments(d) -> list[str]:
    return sorted(p.name for p in d.glob("segment-*.jsonl"))


def test_records_appended_before_a_crash_are_replayed_once_by_the_next_start(tmp_path):
    j = Journal(tmp_path)
    assert j.open().records == []
    j.append([_exp(0), _exp(1)])
    j.append([_exp(2, task="\ud800")])  # what no database stores still journals, losslessly
    _crash(j)

    k = Journal(tmp_path)
    replayed = k.open()
    assert [r.experience_id for r in replayed.records] == ["c0-0", "c1-0", "c2-0"]
    assert replayed.records[2].task_id == "\ud800"
    assert len(set(replayed.segments)) == 1
    # Written to the database: the adopted segment goes, only k's own (empty) one is left.
    k.release(replayed.segments[0], 3)
    assert len(_segments(tmp_path)) == 1
    k.close()
    assert _segments(tmp_path) == []


def test_a_live_journal_is_never_adopted_by_another_explorer_sharing_the_directory(tmp_path):
    a = Journal(tmp_path)
    a.open()
    a.append([_exp(0)])
    b = Journal(tmp_path)
    assert b.open().records == []  # a's segment is locked: a is alive
    assert len(_segments(tmp_path)) == 2
    b.close()
    a.close()  # a's record was never released: its segment stays for the next start
    c = Journal(tmp_path)
    assert [r.experience_id for r in c.open().records] == ["c0-0"]
    c.close()


def test_a_running_explorer_adopts_what_a_replica_that_died_left_behind(tmp_path):
    a, b = Journal(tmp_path), Journal(tmp_path)
    a.open(), b.open()
    b.append([_exp(0)])
    assert a.adopt().records == []  # b is alive: its segment is locked
    b.append([_exp(1)])
    _crash(b)  # killed with two records unwritten
    adopted = a.adopt()
    assert [r.experience_id for r in adopted.records] == ["c0-0", "c1-0"]
    assert a.adopt().records == []  # adopted once: a holds it now
    a.release(adopted.segments[0], 2)  # written: the dead replica's segment goes
    assert len(_segments(tmp_path)) == 1
    a.close()
    assert a.adopt().records == [] and _segments(tmp_path) == []


def test_segments_rotate_and_are_deleted_once_every_record_is_written(tmp_path):
    j = Journal(tmp_path, segment_bytes=1)  # every append seals its segment
    j.open()
    keys = [j.append([_exp(i)]) for i in range(3)]
    assert len(set(keys)) == 3 and len(_segments(tmp_path)) == 4
    for k in keys:
        j.release(k)
    assert len(_segments(tmp_path)) == 1  # only the open, empty one
    j.sync()
    j.close()


def test_a_torn_last_line_is_skipped(tmp_path):
    j = Journal(tmp_path)
    j.open()
    j.append([_exp(0)])
    seg = next(iter(j._segments.values()))
    os.write(seg.fd, b'{"experience_id": "c1-0", "compl')  # power cut mid-write
    _crash(j)
    replayed = Journal(tmp_path).open()
    assert [r.experience_id for r in replayed.records] == ["c0-0"] and replayed.torn == 1


def _text(d) -> str:
    return "".join(p.read_text() for p in d.glob("segment-*.jsonl"))


def test_the_open_segment_is_sealed_by_age_or_at_once_and_goes_when_its_records_are_written(tmp_path, monkeypatch):
    import time

    j = Journal(tmp_path)
    j.open()
    assert not j.rotate() and not j.seal_if_old(0.0)  # nothing in it yet: nothing to seal
    key = j.append([_exp(0)])
    assert "c0-0" in _text(tmp_path) and not j.seal_if_old(60.0)  # younger than a minute
    j.release(key)
    assert "c0-0" in _text(tmp_path)  # written, but still in the open segment
    later = time.monotonic() + 61
    monkeypatch.setattr(time, "monotonic", lambda: later)
    assert j.seal_if_old(60.0) and "c0-0" not in _text(tmp_path)  # sealed with nothing outstanding: gone
    key = j.append([_exp(1)])
    assert j.rotate() and "c1-0" in _text(tmp_path)  # sealed, kept until its record is written
    j.release(key)
    assert _text(tmp_path) == "" and len(_segments(tmp_path)) == 1
    j.close()


def test_a_users_dead_letters_are_dropped_and_the_others_kept(tmp_path):
    import json

    from services.explorer.recording.journal import append_dead_letter, drop_dead_letters

    path = tmp_path / "dead-letters.jsonl"
    assert drop_dead_letters(path, "u1") == 0  # no file yet
    for i, (user, agent) in enumerate([("u1", "a"), ("u2", "a"), ("u1", "b")]):
        append_dead_letter(path, _exp(i).model_copy(update={"user_id": user, "agent": agent}), "refused")
    assert drop_dead_letters(path, "u1", agents=["a"]) == 1  # a key limited to agent a: b's stays
    left = [json.loads(line)["experience"] for line in path.read_text().splitlines()]
    assert [(e["user_id"], e["agent"]) for e in left] == [("u2", "a"), ("u1", "b")]
    assert drop_dead_letters(path, "u1") == 1 and drop_dead_letters(path, "u1") == 0
    append_dead_letter(path, _exp(9), "refused")  # appends go on after a scrub
    assert len(path.read_text().splitlines()) == 2
