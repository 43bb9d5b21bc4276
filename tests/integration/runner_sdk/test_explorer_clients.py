"""The SDK's two Explorer clients, sync and async, against a real Explorer: the same calls give the
same answers and the same errors."""

from __future__ import annotations

import asyncio

import pytest

from runner_sdk import ExplorerClient, ExplorerError, SyncExplorerClient

pytestmark = pytest.mark.integration

Q = [{"role": "user", "content": "Name a city."}]


def test_sync_client_chats_rewards_commits_and_names_errors(explorer):
    with SyncExplorerClient(explorer.url) as client:
        assert client.health()["status"] == "ok"
        assert "default" in [m["id"] for m in client.models()]
        reply = client.chat_completions(model="default", messages=Q, max_tokens=2)
        cid = reply["id"]
        assert cid.startswith("chatcmpl-") and reply["choices"][0]["message"]["role"] == "assistant"
        fed = client.feedback(msg_ids=[cid], reward=1.0, source="sync-test")
        assert fed["status"] == "success"
        assert client.commit(msg_ids=[]) == {"status": "success", "committed": 0}  # never sent
        assert client.commit(msg_ids=[cid])["committed"] == 1
        rows = client.experiences(status="committed")
        assert [r["completion_id"] for r in rows] == [cid] and rows[0]["reward"] == 1.0
        assert "kaizen_requests_total" in client.metrics()
        with pytest.raises(ExplorerError) as e:
            client.feedback(msg_ids=["chatcmpl-nothing"], reward=1.0)
        assert e.value.status == 404 and e.value.code == "unknown_id" and not e.value.retryable


def test_async_client_gives_the_same_answers(explorer):
    async def main():
        async with ExplorerClient(explorer.url) as client:
            reply = await client.chat_completions(model="default", messages=Q, max_tokens=2)
            await client.feedback(msg_ids=[reply["id"]], reward=0.5)
            committed = await client.commit(msg_ids=[reply["id"]])
            rows = await client.experiences(status="committed")
            with pytest.raises(ExplorerError) as e:
                await client.feedback(msg_ids=["chatcmpl-nothing"], reward=1.0)
            return reply["id"], committed, rows, e.value

    cid, committed, rows, error = asyncio.run(main())
    assert committed["committed"] == 1 and [r["completion_id"] for r in rows] == [cid] and rows[0]["reward"] == 0.5
    assert error.status == 404 and error.code == "unknown_id"


def test_the_client_sends_feedback_in_words(explorer):
    with SyncExplorerClient(explorer.url) as client:
        cid = client.chat_completions(model="default", messages=Q, max_tokens=2)["id"]
        assert client.feedback(msg_ids=[cid], hint="Name a capital.")["updated"] == 1
        fixed = client.feedback(msg_ids=[cid], correction={"role": "assistant", "content": "Paris."}, reward=0.0)
        demo = client.experiences(status="committed")
        assert [d["experience_id"] for d in demo] == [fixed["demonstration_id"]]
        assert demo[0]["feedback"]["corrects"] == client.experiences(completion_id=cid)[0]["experience_id"]
        with pytest.raises(ExplorerError) as e:
            client.feedback(msg_ids=[cid], hint="")
        assert e.value.status == 400 and "hint" in str(e.value)
