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
