"""Clients that chat, reward the answer and commit it, as fast as they can, recording what the server
acknowledged: what a kill test must find in the buffer afterwards."""

from __future__ import annotations

import random
import threading
import time

import httpx


class Traffic:
    """``client(k)`` runs one client until ``stop`` is set; with ``keys``, client k sends keys[k % len(keys)]."""

    def __init__(self, base: str, keys: list[str] | None = None):
        self.base = base
        self.keys = keys
        self.chats: set[str] = set()
        self.rewards: dict[str, float] = {}
        self.commits: set[str] = set()
        self.failed = 0  # requests that got no answer or a 5xx (the server was down): not acknowledged
        self.stop = threading.Event()
        self.lock = threading.Lock()

    def client(self, k: int) -> None:
        rng = random.Random(k)
        headers = {"Authorization": f"Bearer {self.keys[k % len(self.keys)]}"} if self.keys else {}
        with httpx.Client(base_url=self.base, timeout=30, headers=headers) as http:
            i = 0
            while not self.stop.is_set():
                i += 1
                try:
                    r = http.post("/v1/chat/completions", json={
                        "model": "default", "messages": [{"role": "user", "content": f"client {k} question {i}"}],
                        "max_tokens": 2, "metadata": {"task_id": f"c{k}-{i}"}})
                    if r.status_code != 200:
                        raise httpx.HTTPError(str(r.status_code))
                    eid = r.json()["choices"][0]["experience_id"]
                    with self.lock:
                        self.chats.add(eid)
                    reward = float(rng.randint(0, 1))
                    if http.post("/feedback", json={"msg_ids": [eid], "reward": reward}).status_code != 200:
                        raise httpx.HTTPError("feedback")
                    with self.lock:
                        self.rewards[eid] = reward
                    r = http.post("/commit", json={"msg_ids": [eid]})
                    if r.status_code != 200 or r.json()["committed"] != 1:
                        raise httpx.HTTPError("commit")
                    with self.lock:
                        self.commits.add(eid)
                except httpx.HTTPError:
                    with self.lock:
                        self.failed += 1
                    time.sleep(0.2)

    def lost(self, url: str) -> tuple[list[str], list[str], list[str]]:
        """The acknowledged chats, feedbacks and commits that the buffer at ``url`` does not hold."""
        from services.common import buffer

        db = buffer.create_buffer_engine(url)
        try:
            stored = {e.experience_id: e for e in buffer.list_experiences(engine=db, limit=100_000)}
        finally:
            db.dispose()
        return (sorted(self.chats - set(stored)),
                sorted(i for i, r in self.rewards.items() if i not in stored or stored[i].reward != r),
                sorted(i for i in self.commits if i not in stored or stored[i].status.value != "committed"))
