"""The runner SDK against a real Explorer on the tiny model."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from runner_sdk import (
    EnvironmentRunner,
    ExactMatch,
    ExplicitMarking,
    FunctionReward,
    SamplingRate,
    TrainingRunner,
    mark,
)
from services.common import buffer
from services.common.config import load_config
from services.trainer.batches import select_batch
from services.trainer.config import TrainerConfig

pytestmark = pytest.mark.integration

Q = [{"role": "user", "content": "Name a city."}]


def _experiences(ex, **filters):
    return ex.http.get("/experiences", params={"limit": 1000, **filters}).json()["data"]


def test_sampling_selects_about_p_and_only_selected_are_trained(explorer):
    runner = TrainingRunner(endpoint=explorer.url, model="default", selection=SamplingRate(0.3, seed=7),
                            reward=FunctionReward(lambda text: 1.0), commit_interval=0.5)
    client = runner.openai_client()
    ids_by_selection = {True: [], False: []}
    with runner:
        for i in range(200):
            with runner.run(f"q{i}") as run:
                r = client.chat.completions.create(model="default", messages=Q, max_tokens=1)
                run.output = r.choices[0].message.content
            ids_by_selection[run.selected].append(r.id)
    n = len(ids_by_selection[True])
    # Binomial(200, 0.3): mean 60, sd 6.5; this band is +-4 sd.
    assert 34 <= n <= 86, n
    assert runner.stats.selected == n and runner.stats.feedback_sent == n and runner.stats.feedback_dropped == 0
    rows = _experiences(explorer)
    assert len(rows) == 200
    trained = {r["completion_id"] for r in rows if r["status"] == "committed"}
    assert trained == set(ids_by_selection[True])
    assert all(r["reward"] is None and r["task_id"] is None for r in rows if r["completion_id"] in ids_by_selection[False])
    assert all(r["feedback"]["source"] == "runner_sdk" for r in rows if r["completion_id"] in trained)


def test_marking_selects_exactly_the_marked_requests(explorer):
    runner = TrainingRunner(endpoint=explorer.url, model="default", selection=ExplicitMarking(),
                            reward=FunctionReward(lambda text: 0.5), commit_interval=0)

    async def app():
        client = runner.async_openai_client()
        marked = []
        for i in range(12):
            async def handle(i=i):
                async with runner.run(f"q{i}") as run:
                    # calls from a task and a worker thread inside the run are collected too
                    r1 = await asyncio.create_task(client.chat.completions.create(model="default", messages=Q, max_tokens=1))
                    r2 = await asyncio.to_thread(lambda: runner.openai_client().chat.completions.create(
                        model="default", messages=Q, max_tokens=1))
                    run.output = r1.choices[0].message.content
                return r1.id, r2.id
            if i % 4 == 0:
                with mark("gold", source="test"):
                    marked.append(await handle())
            else:
                await handle()
        return marked

    with runner:
        marked = asyncio.run(app())
    rows = _experiences(explorer, status="committed")
    assert {r["completion_id"] for r in rows} == {cid for pair in marked for cid in pair}
    assert all(r["feedback"]["labels"] == ["gold"] and r["reward"] == 0.5 for r in rows)
    # both calls of one marked run share its task id
    by_task = {}
    for r in rows:
        by_task.setdefault(r["task_id"], set()).add(r["completion_id"])
    assert sorted(len(v) for v in by_task.values()) == [2, 2, 2]


def test_shadow_repeats_form_grpo_groups(explorer):
    async def agent(client, question):
        return await client.complete(question, max_tokens=3)

    runner = TrainingRunner(endpoint=explorer.url, model="default", mode="shadow", agent=agent, repeat=4,
                            selection=SamplingRate(1.0), reward=FunctionReward(lambda text: float(len(text) % 2)),
                            commit_interval=0)
    with runner:
        for q in ("a?", "b?", "c?"):
            assert runner.shadow(q, expected=None)
    assert runner.stats.shadow_runs == 12 and runner.stats.feedback_sent == 12
    rows = _experiences(explorer, status="committed")
    groups = {}
    for r in rows:
        groups.setdefault(r["task_id"], []).append(r["run_id"])
    assert len(groups) == 3 and all(sorted(v) == ["0", "1", "2", "3"] for v in groups.values())
    # The Trainer's grpo sees each task_id as one group of four.
    cfg = load_config(TrainerConfig, None, ["model.path=x", "algorithm.name=grpo", "train_batch_size=12",
                                            "algorithm.std_normalize=false"], env={})
    committed = buffer.fetch_committed(engine=explorer.state.db, agent="default", limit=100)
    sel = select_batch(committed, recipe=cfg.algorithm.recipe(), cfg=cfg, current_version=0)
    assert len(sel.items) == 12
    for task in groups:
        adv = [i.advantage for i in sel.items if i.task_id == task]
        assert len(adv) == 4 and abs(sum(adv)) < 1e-6  # centred within its own group


def test_shadow_never_blocks_production(explorer):
    release = threading.Event()
    started = threading.Event()

    def slow_agent(client, question):
        started.set()
        release.wait(30)
        return "done"

    async def agent(client, question):
        return await asyncio.to_thread(slow_agent, client, question)

    runner = TrainingRunner(endpoint=explorer.url, model="default", mode="shadow", agent=agent, repeat=2,
                            reward=ExactMatch(), commit_interval=0)
    with runner:
        assert runner.shadow("q", expected="done")  # returns while the shadow runs are still blocked
        assert started.wait(10) and not release.is_set()
        release.set()
    assert runner.stats.shadow_runs == 2


def test_killed_explorer_never_raises_into_the_app(make_explorer):
    ex = make_explorer()

    async def agent(client, question):
        return await client.complete(question, max_tokens=2)

    shadow = TrainingRunner(endpoint=ex.url, model="default", mode="shadow", agent=agent, repeat=2,
                            reward=FunctionReward(lambda t: 1.0), commit_interval=0.2, retry_initial=0.05)
    direct = TrainingRunner(endpoint=ex.url, model="default", reward=FunctionReward(lambda t: 1.0),
                            commit_interval=0.2, retry_initial=0.05, max_pending=3)
    shadow.start()
    direct.start()
    with direct.run("q") as run:  # served and rewarded while the Explorer is alive
        run.output = direct.openai_client().chat.completions.create(model="default", messages=Q, max_tokens=1).choices[0].message.content
    direct.commit_now()
    assert direct.stats.feedback_sent == 1 and direct.stats.committed == 1
    ex.stop()
    for i in range(5):
        assert shadow.shadow(f"q{i}")  # nothing raises, nothing blocks
        with direct.run("q") as run:
            run.output = "an answer the app got elsewhere"
        direct.queue_feedback(msg_ids=[f"chatcmpl-{i}"], reward=1.0)  # cannot be delivered now
    time.sleep(1.0)
    t0 = time.monotonic()
    shadow.stop(timeout=2)
    direct.stop(timeout=2)
    assert time.monotonic() - t0 < 15
    assert shadow.stats.shadow_failures == 10
    s = direct.stats
    assert s.feedback_failed_attempts >= 1 and s.feedback_sent == 1
    # bounded in memory: 3 kept while down, 2 dropped at once, the 3 left dropped at stop, all counted
    assert s.feedback_dropped == 5


def test_environment_runner_sends_rewards_and_commits(explorer):
    class GuessEnv:
        """One step: reward 1 if the reply has an even number of characters."""

        def __init__(self, task):
            self.task = task

        def reset(self):
            return f"Task {self.task}: reply."

        def step(self, action):
            return None, float(len(action) % 2 == 0), True, {"len": len(action)}

    async def agent(client, observation):
        return await client.complete(observation, max_tokens=4)

    runner = EnvironmentRunner(endpoint=explorer.url, model="default", make_env=GuessEnv, agent=agent, repeat=3, concurrency=4)
    results = runner.run_sync(range(4))
    assert len(results) == 12 and all(r.error is None and r.steps == 1 and len(r.msg_ids) == 1 for r in results)
    rows = {r["completion_id"]: r for r in _experiences(explorer)}
    for res in results:
        row = rows[res.msg_ids[0]]
        assert row["status"] == "committed" and row["reward"] == res.reward
        assert (row["task_id"], row["run_id"]) == (res.task_id, res.run_id)
    assert len({r.task_id for r in results}) == 4



def test_environment_runner_with_adaptive_groups_runs_more_only_where_the_first_runs_disagree_or_failed(explorer):
    """AdaptiveRepeat(first=2, full=4, failed=6): a task every run solves stops at 2, one whose runs disagree is
    completed to 4, one every run fails goes on to 6; each group's run ids are 0..n-1 and all are committed."""
    from runner_sdk import AdaptiveRepeat

    resets: dict[str, int] = {}

    class KindEnv:
        def __init__(self, task):
            self.task = task

        def reset(self):
            resets[self.task] = resets.get(self.task, 0) + 1
            self.n = resets[self.task]
            return "reply."

        def step(self, action):
            reward = {"solved": 1.0, "failed": 0.0, "mixed": float(self.n % 2)}[self.task]
            return None, reward, True, {}

    async def agent(client, observation):
        return await client.complete(observation, max_tokens=1)

    runner = EnvironmentRunner(endpoint=explorer.url, model="default", make_env=KindEnv, agent=agent,
                               repeat=AdaptiveRepeat(first=2, full=4, failed=6), concurrency=8,
                               task_id=lambda task, k: f"adaptive-{task}")
    results = runner.run_sync(["solved", "mixed", "failed"])
    runs = {kind: sorted(int(r.run_id) for r in results if r.task == kind) for kind in ("solved", "mixed", "failed")}
    assert runs == {"solved": [0, 1], "mixed": [0, 1, 2, 3], "failed": [0, 1, 2, 3, 4, 5]}
    assert all(r.error is None for r in results)
    rows = {r["completion_id"]: r for r in _experiences(explorer)}
    for res in results:
        row = rows[res.msg_ids[0]]
        assert row["status"] == "committed" and (row["task_id"], row["run_id"], row["reward"]) == (res.task_id, res.run_id, res.reward)

def test_runners_commit_only_what_they_rewarded(explorer):
    # Another application's rewarded experience, waiting for its own commit.
    other = explorer.client.chat.completions.create(model="default", messages=Q, max_tokens=1)
    explorer.http.post("/feedback", json={"msg_ids": [other.id], "reward": 1.0}).raise_for_status()

    runner = TrainingRunner(endpoint=explorer.url, model="default", reward=FunctionReward(lambda text: 1.0),
                            commit_interval=0)
    client = runner.openai_client()
    with runner:
        with runner.run("q") as run:
            r = client.chat.completions.create(model="default", messages=Q, max_tokens=1)
            run.output = r.choices[0].message.content
        runner.commit_now()
        assert (runner.stats.commits, runner.stats.committed) == (1, 1)
    assert runner.stats.commits == 1  # stopping had nothing left to commit and sent nothing

    class OneStep:
        def __init__(self, task):
            pass

        def reset(self):
            return "reply."

        def step(self, action):
            return None, 1.0, True, {}

    async def agent(client, observation):
        return await client.complete(observation, max_tokens=1)

    results = EnvironmentRunner(endpoint=explorer.url, model="default", make_env=OneStep, agent=agent,
                                repeat=2).run_sync(range(2))
    status = {row["completion_id"]: row["status"] for row in _experiences(explorer)}
    assert status[other.id] == "rewarded"
    assert status[r.id] == "committed"
    assert all(status[i] == "committed" for res in results for i in res.msg_ids) and len(results) == 4


def test_a_reward_calculator_may_give_a_hint_beside_its_reward_or_alone(explorer):
    from runner_sdk import Verdict

    def judge(run):  # even runs: wrong, with a hint; odd runs: a hint alone
        return Verdict(reward=0.0, hint="Name Paris.") if run.input % 2 == 0 else Verdict(hint="Name Rome.")

    runner = TrainingRunner(endpoint=explorer.url, model="default", selection=SamplingRate(1.0), reward=judge,
                            commit_interval=0)
    client = runner.openai_client()
    ids = {}
    with runner:
        for i in range(4):
            with runner.run(i) as run:
                r = client.chat.completions.create(model="default", messages=Q, max_tokens=2)
                run.output = r.choices[0].message.content
            ids[i] = r.id
        runner.commit_now()
    rows = {r["completion_id"]: r for r in _experiences(explorer)}
    for i, cid in ids.items():
        row = rows[cid]
        assert row["status"] == "committed" and row["hint"]["text"] == ("Name Paris." if i % 2 == 0 else "Name Rome.")
        assert row["reward"] == (0.0 if i % 2 == 0 else None) and row["hint"]["source"] == "runner_sdk"
    assert runner.stats.feedback_sent == 4 and runner.stats.feedback_dropped == 0
    with pytest.raises(ValueError, match="needs a reward or a non-empty hint"):
        Verdict(hint="  ")
    assert Verdict(reward=1.0, hint=" ").hint is None  # a blank hint: the reward alone
    # a hint longer than the Explorer takes is left out, so the reward is not refused with it
    with runner:
        with runner.run(9) as run:
            r = client.chat.completions.create(model="default", messages=Q, max_tokens=2)
            run.output = r.choices[0].message.content
        runner.queue_feedback(msg_ids=[r.id], reward=0.5, hint="x" * 5000)
        runner.commit_now()
    assert _experiences(explorer, completion_id=r.id)[0]["reward"] == 0.5
    # a correction of one call, queued like any feedback: it becomes a demonstration of that call's prompt
    with pytest.raises(ValueError, match="a correction is an assistant message .a dict. for one call"):
        runner.queue_feedback(msg_ids=[ids[0], ids[1]], reward=None, correction={"content": "Paris."})
    with runner:
        # a correction the Explorer refuses (no tools were offered) is dropped alone: the reward beside it lands
        runner.queue_feedback(msg_ids=[r.id], reward=0.25, correction={"tool_calls": [{"function": {"name": "search"}}]})
        runner.queue_feedback(msg_ids=[r.id], reward=None, correction={"role": "assistant", "content": "Paris."})
        runner.commit_now()
    corrected = _experiences(explorer, completion_id=r.id)[0]
    assert corrected["reward"] == 0.25 and runner.stats.feedback_dropped == 1
    (demo,) = [row for row in _experiences(explorer) if (row.get("feedback") or {}).get("corrects") == corrected["experience_id"]]
    assert demo["response"]["content"] == "Paris." and demo["status"] == "committed"
