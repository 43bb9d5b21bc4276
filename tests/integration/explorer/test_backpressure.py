"""Back-pressure on a real Explorer: while more committed experiences wait for the Trainer than
backpressure.max_backlog, an agent's chats get 429 (reject) or go unrecorded (unrecorded), feedback
and commits still work, /metrics says which, and it lifts once the Trainer has consumed them."""

from __future__ import annotations

import time

import pytest

from services.common import buffer

pytestmark = pytest.mark.integration

BODY = {"model": "default", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _wait_metric(ex, needle: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while needle not in ex.http.get("/metrics").text:
        assert time.monotonic() < deadline, f"{needle!r} never appeared in /metrics"
        time.sleep(0.1)


def _committed_backlog(ex, n: int) -> list[str]:
    ids = []
    for _ in range(n):
        ids.append(ex.http.post("/v1/chat/completions", json=BODY).json()["choices"][0]["experience_id"])
    assert ex.http.post("/feedback", json={"msg_ids": ids, "reward": 1.0}).status_code == 200
    assert ex.http.post("/commit", json={"msg_ids": ids}).json()["committed"] == n
    return ids


@pytest.mark.parametrize("mode", ["reject", "unrecorded"])
def test_backpressure_until_the_trainer_catches_up(make_explorer, mode):
    ex = make_explorer("backpressure.max_backlog=2", "backpressure.check_interval_s=0.2", f"backpressure.mode={mode}")
    ids = _committed_backlog(ex, 3)
    _wait_metric(ex, f'kaizen_backpressure{{agent="default",mode="{mode}"}} 1.0')
    assert 'kaizen_backlog{agent="default"} 3.0' in ex.http.get("/metrics").text
    r = ex.http.post("/v1/chat/completions", json=BODY)
    if mode == "reject":
        assert r.status_code == 429 and r.json()["error"]["code"] == "trainer_behind", r.text
        assert r.headers["retry-after"] == "1"
        assert ex.http.post("/v1/messages", json=BODY).status_code == 429
    else:
        assert r.status_code == 200 and r.headers["x-kaizen-recorded"] == "false", r.text
        unrecorded = r.json()["choices"][0]["experience_id"]
        time.sleep(0.3)
        assert ex.http.get(f"/experiences/{unrecorded}").status_code == 404
        assert 'kaizen_unrecorded_completions_total{agent="default"} 1.0' in ex.http.get("/metrics").text
    # Feedback on what was recorded before still lands.
    assert ex.http.post("/feedback", json={"msg_ids": ids[:1], "reward": 0.5}).status_code == 200

    # The Trainer consumes the backlog: back-pressure lifts and traffic is recorded again.
    buffer.consume_batch(engine=ex.state.db, agent="default", step=1, version=1, consumed={i: 1.0 for i in ids[1:]},
                         discarded=[], state_ref="s1")
    with buffer.write_transaction(ex.state.db) as conn:
        conn.execute(buffer.experiences.update().where(buffer.experiences.c.experience_id == ids[0])
                     .values(status="consumed"))
    _wait_metric(ex, f'kaizen_backpressure{{agent="default",mode="{mode}"}} 0.0')
    r = ex.http.post("/v1/chat/completions", json=BODY)
    assert r.status_code == 200 and "x-kaizen-recorded" not in r.headers
    time.sleep(0.3)
    assert ex.http.get(f"/experiences/{r.json()['choices'][0]['experience_id']}").status_code == 200
