"""The runner's feedback queue against a hand-written fake Explorer: what it sends, commits and drops."""

from __future__ import annotations

import asyncio
import threading

import httpx

from runner_sdk.client import ExplorerClient, ExplorerError
from runner_sdk.feedback import COMMIT_CHUNK, Feedback, FeedbackQueue
from runner_sdk.records import RunnerStats


class FakeExplorer:
    """Records every call; ``refuse`` / ``fail`` make the next calls to a route answer an error."""

    def __init__(self):
        self.feedback_calls: list[dict] = []
        self.commit_calls: list[list[str]] = []
        self.refuse: dict[str, int] = {}  # route -> how many calls to answer 404
        self.fail: dict[str, int] = {}  # route -> how many calls fail to connect
        self.attempted_keys: list[str | None] = []  # the idempotency key of every feedback attempt

    def _maybe_error(self, route: str) -> None:
        if self.fail.get(route):
            self.fail[route] -= 1
            raise httpx.ConnectError("down")
        if self.refuse.get(route):
            self.refuse[route] -= 1
            raise ExplorerError(404, "unknown id(s)", "unknown_id")

    async def feedback(self, **body):
        self.attempted_keys.append(body.get("idempotency_key"))
        self._maybe_error("feedback")
        self.feedback_calls.append(body)
        return {"status": "success", "updated": len(body["msg_ids"])}

    async def commit(self, *, task_id=None, msg_ids=None):
        assert msg_ids, "the queue must name what it commits, never send an empty or missing list"
        self._maybe_error("commit")
        self.commit_calls.append(list(msg_ids))
        return {"status": "success", "committed": len(msg_ids)}


def _queue(**kw) -> tuple[FeedbackQueue, RunnerStats]:
    stats = RunnerStats()
    q = FeedbackQueue(stats=stats, lock=threading.Lock(), max_pending=kw.pop("max_pending", 100),
                      retry_initial=0.01, retry_max=0.02, **kw)
    return q, stats


def _fb(*ids: str) -> Feedback:
    return Feedback(msg_ids=ids, reward=1.0, task_id="t", run_id="0", labels=("gold",))


def test_commit_names_exactly_the_delivered_ids_in_chunks():
    async def main():
        q, stats = _queue()
        ex = FakeExplorer()
        q.start(ex, commit_interval=0)
        assert await q.commit() == 0 and ex.commit_calls == []  # nothing delivered: nothing sent
        ids = [f"chatcmpl-{i}" for i in range(2 * COMMIT_CHUNK + 500)]
        q.put(_fb(*ids[:COMMIT_CHUNK + 10]))
        q.put(_fb(*ids[COMMIT_CHUNK + 10:]))
        q.put(_fb(ids[0]))  # rewarded again: committed once
        assert await q.flush(5)
        assert await q.commit() == len(ids)
        assert [len(c) for c in ex.commit_calls] == [COMMIT_CHUNK, COMMIT_CHUNK, 500]
        assert [i for c in ex.commit_calls for i in c] == ids
        assert await q.commit() == 0 and len(ex.commit_calls) == 3  # all committed: nothing more sent
        await q.close(1)
        return stats, ex

    stats, ex = asyncio.run(main())
    keys = [c.pop("idempotency_key") for c in ex.feedback_calls]
    assert len(set(keys)) == 3 and all(len(k) == 32 for k in keys)  # one key per feedback
    assert ex.feedback_calls[0] == {"msg_ids": [f"chatcmpl-{i}" for i in range(COMMIT_CHUNK + 10)], "reward": 1.0,
                                    "task_id": "t", "run_id": "0", "labels": ["gold"], "comment": None,
                                    "source": "runner_sdk", "expected": None, "hint": None, "correction": None}
    assert (stats.feedback_sent, stats.commits, stats.commit_failures) == (3, 3, 0)
    assert stats.committed == 2 * COMMIT_CHUNK + 500


def test_refused_feedback_is_dropped_and_never_committed():
    async def main():
        q, stats = _queue()
        ex = FakeExplorer()
        ex.refuse["feedback"] = 1
        ex.fail["feedback"] = 2  # down twice, then delivered
        q.start(ex, commit_interval=0)
        q.put(_fb("chatcmpl-refused"))
        q.put(_fb("chatcmpl-late"))
        assert await q.flush(5)
        await q.close(1)  # closing commits what went through
        return stats, ex

    stats, ex = asyncio.run(main())
    assert ex.commit_calls == [["chatcmpl-late"]]
    assert (stats.feedback_sent, stats.feedback_dropped, stats.feedback_failed_attempts) == (1, 1, 2)


def test_commit_keeps_what_could_not_be_sent_and_drops_what_was_refused():
    async def main():
        q, stats = _queue()
        ex = FakeExplorer()
        q.start(ex, commit_interval=0)
        q.put(_fb(*[f"a{i}" for i in range(COMMIT_CHUNK)]))
        q.put(_fb("b0", "b1"))
        assert await q.flush(5)
        ex.fail["commit"] = 1
        assert await q.commit() == 0  # Explorer down: both chunks kept for later
        ex.refuse["commit"] = 1
        assert await q.commit() == 2  # first chunk refused and dropped, second committed
        assert await q.commit() == 0
        await q.close(1)
        return stats, ex

    stats, ex = asyncio.run(main())
    assert ex.commit_calls == [["b0", "b1"]]
    assert (stats.commits, stats.committed, stats.commit_failures) == (1, 2, 2)


def test_put_before_start_is_bounded_and_put_from_other_threads_is_sent():
    async def main():
        q, stats = _queue(max_pending=3)
        for i in range(5):  # before start: kept, the oldest dropped past max_pending
            q.put(_fb(f"early-{i}"))
        ex = FakeExplorer()
        q.start(ex, commit_interval=0)
        assert await q.flush(5)
        threads = [threading.Thread(target=q.put, args=(_fb(f"thread-{i}"),)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        await asyncio.sleep(0)  # let the loop run the puts the threads handed over
        assert await q.flush(5)
        await q.close(1)
        return stats, ex

    stats, ex = asyncio.run(main())
    sent = [c["msg_ids"][0] for c in ex.feedback_calls]
    assert sent[:3] == ["early-2", "early-3", "early-4"] and sorted(sent[3:]) == [f"thread-{i}" for i in range(3)]
    assert stats.feedback_dropped == 2 and stats.feedback_sent == 6 and stats.committed == 6


def test_client_answers_an_empty_commit_itself():
    # Port 9 (discard) is closed on loopback: a request would raise ConnectError.
    async def main():
        client = ExplorerClient("http://127.0.0.1:9")
        try:
            return await client.commit(msg_ids=[])
        finally:
            await client.aclose()

    assert asyncio.run(main()) == {"status": "success", "committed": 0}


def test_a_retried_feedback_goes_under_its_first_key():
    """A retry after a failed attempt (which the Explorer may have applied: a timeout after it took it)
    resends the same idempotency key, so the Explorer applies the feedback once."""
    async def main():
        q, stats = _queue()
        ex = FakeExplorer()
        ex.fail["feedback"] = 2
        q.start(ex, commit_interval=0)
        q.put(_fb("chatcmpl-a"))
        q.put(_fb("chatcmpl-b"))
        assert await q.flush(5)
        await q.close(1)
        return stats, ex

    stats, ex = asyncio.run(main())
    first, second = ex.feedback_calls[0]["idempotency_key"], ex.feedback_calls[1]["idempotency_key"]
    assert ex.attempted_keys == [first, first, first, second] and first != second
    assert (stats.feedback_sent, stats.feedback_failed_attempts) == (2, 2)
