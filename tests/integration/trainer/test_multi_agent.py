"""Several agents on one base, trained agent by agent (trainer.schedule.mode=round_robin) by the real
`kaizen trainer` on Ray: one agent's turn at a time, each adapter trained on its own calls only,
the schedule carried over a restart, and experiences recorded before a turn discarded on request."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from runner_sdk.examples.two_agents import _says
from services.common import buffer, checkpoints
from tests.helpers import REPO
from tests.integration.trainer.data import PROMPTS, fill_buffer
from tests.integration.trainer.test_trainer_service import _train

pytestmark = pytest.mark.integration

ORDER = ("trainer.schedule.mode=round_robin", "trainer.schedule.order=[planner,solver]", "trainer.schedule.interval=2",
         "algorithm.name=grpo")


def _steps(url: str) -> list[tuple[str, int]]:
    db = buffer.create_buffer_engine(url)
    with db.connect() as conn:
        t = buffer.trainer_steps.c
        rows = [(r.agent, r.version) for r in conn.execute(select(t.agent, t.version).order_by(t.id))]
    db.dispose()
    return rows


def _ids_of(records) -> set[str]:
    return {r.experience_id for r in records}


def test_round_robin_trains_agent_by_agent_and_resumes_the_schedule(tiny_model, ray_address, tmp_path: Path):
    url = f"sqlite:///{tmp_path}/buffer.db"
    planner = fill_buffer(url, tiny_model, agent="planner", seed=0, prompts=PROMPTS[:12])
    solver = fill_buffer(url, tiny_model, agent="solver", seed=1, prompts=PROMPTS[:12])
    root = tmp_path / "ck"

    _train(tiny_model, tmp_path, ray_address, *ORDER, "--max-steps", "3")
    # planner trains its two steps while solver's version stays at 0, then solver's turn begins
    assert _steps(url) == [("planner", 1), ("planner", 2), ("solver", 1)]
    assert checkpoints.read_latest(root, "planner") == 2 and checkpoints.read_latest(root, "solver") == 1

    # a restarted Trainer goes on with solver's turn (one step left), then planner's again
    _train(tiny_model, tmp_path, ray_address, *ORDER, "--max-steps", "2")
    assert _steps(url) == [("planner", 1), ("planner", 2), ("solver", 1), ("solver", 2), ("planner", 3)]

    # each adapter trained on its own agent's calls only
    db = buffer.create_buffer_engine(url)
    mine = {a: {e for e, _ in buffer.consumed_ids(engine=db, agent=a)} for a in ("planner", "solver")}
    db.dispose()
    assert mine["planner"] and mine["planner"] <= _ids_of(planner)
    assert mine["solver"] and mine["solver"] <= _ids_of(solver)


def test_frozen_experiences_can_be_discarded_when_the_turn_comes(tiny_model, ray_address, tmp_path: Path):
    """solver's experiences recorded while planner was still training are dropped at solver's turn;
    the ones recorded after it began are trained on."""
    url = f"sqlite:///{tmp_path}/buffer.db"
    fill_buffer(url, tiny_model, agent="planner", seed=0, prompts=PROMPTS[:8])
    before = fill_buffer(url, tiny_model, agent="solver", seed=1, prompts=PROMPTS[:4])
    discard = (*ORDER[:2], "trainer.schedule.interval=1", ORDER[3], "trainer.schedule.frozen_experiences=discard")
    _train(tiny_model, tmp_path, ray_address, *discard, "--max-steps", "1")
    assert _steps(url) == [("planner", 1)]
    after = fill_buffer(url, tiny_model, agent="solver", seed=2, prompts=PROMPTS[4:8])
    log = _train(tiny_model, tmp_path, ray_address, *discard, "--max-steps", "1")
    assert _steps(url) == [("planner", 1), ("solver", 1)]
    assert f"discarded {len(before)} experiences recorded before its turn began" in log
    db = buffer.create_buffer_engine(url)
    statuses = {e: buffer.get_experience(engine=db, experience_id=e).status for e in _ids_of(before) | _ids_of(after)}
    consumed = {e for e, _ in buffer.consumed_ids(engine=db, agent="solver")}
    db.dispose()
    assert {statuses[e] for e in _ids_of(before)} == {"discarded"}
    assert consumed and consumed <= _ids_of(after)


def test_an_idle_agent_passes_its_turn_after_the_timeout(tiny_model, ray_address, tmp_path: Path):
    """planner's turn comes first but it has no data: after turn_timeout_s solver trains."""
    url = f"sqlite:///{tmp_path}/buffer.db"
    fill_buffer(url, tiny_model, agent="solver", seed=1, prompts=PROMPTS[:4])
    log = _train(tiny_model, tmp_path, ray_address, *ORDER, "trainer.schedule.turn_timeout_s=1", "--max-steps", "1")
    assert "agent planner: no batch ready in 1s of its turn; the turn passes to solver" in log
    assert _steps(url) == [("solver", 1)]


def test_the_two_agents_example_records_team_episodes_and_trains_each_agent(make_explorer, tiny_model, ray_address):
    """runner_sdk/examples/two_agents.py against a real Explorer, then the Trainer with
    configs/examples/two-agents-trainer.yaml at action level (the other tests train at token level):
    one step per agent, each on its own calls."""
    ex = make_explorer("agents.names=[proposer,verifier]", "agents.default=proposer")
    r = subprocess.run([sys.executable, "-m", "runner_sdk.examples.two_agents", ex.url, "4", "4"], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "episodes 16: team reward" in r.stdout
    url = f"sqlite:///{ex.root}/buffer.db"
    db = buffer.create_buffer_engine(url)
    rows = buffer.list_experiences(engine=db, status="committed", limit=1000)
    db.dispose()
    episodes: dict[tuple, dict[str, list]] = {}
    for row in rows:
        episodes.setdefault((row.task_id, row.run_id), {}).setdefault(row.agent, []).append(row)
    assert len(episodes) == 16 and all(set(e) == {"proposer", "verifier"} for e in episodes.values())
    for (task_id, _), calls in episodes.items():  # the team reward on the verifier, the proposer's own on it
        truth = "even" if int(task_id.split("-")[1]) % 2 == 0 else "odd"
        for agent, row in ((a, calls[a][0]) for a in ("proposer", "verifier")):
            assert row.reward == float(_says(row.response.get("content") or "") == truth), (agent, row.response)

    cmd = [sys.executable, "-m", "services.cli", "trainer", "--config", "configs/examples/two-agents-trainer.yaml",
           f"model.path={tiny_model}", f"buffer.url={url}", f"checkpoints.root={ex.root}/checkpoints",
           f"trainer.run_dir={ex.root}/run", f"ray.address={ray_address}", "trainer.schedule.interval=1",
           "trainer.torch_threads=1", "algorithm.level=sequence", "algorithm.sequence_logprob=sum", "--max-steps", "2"]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert _steps(url) == [("proposer", 1), ("verifier", 1)]
    db = buffer.create_buffer_engine(url)
    for agent in ("proposer", "verifier"):
        consumed = {e for e, _ in buffer.consumed_ids(engine=db, agent=agent)}
        assert consumed == {row.experience_id for e in episodes.values() for row in e[agent]}
    db.dispose()


def _metrics(url: str) -> dict[str, list[dict]]:
    db = buffer.create_buffer_engine(url)
    with db.connect() as conn:
        t = buffer.trainer_steps.c
        rows = conn.execute(select(t.agent, t.metrics).order_by(t.id)).all()
    db.dispose()
    out: dict[str, list[dict]] = {}
    for agent, metrics in rows:
        out.setdefault(agent, []).append(metrics)
    return out


def test_team_credit_through_joint_episodes(tiny_model, ray_address, tmp_path: Path):
    """Two agents act in the same episodes (task_id + run_id). PPO credits each agent through its
    teammate's turns (read from the buffer, valued by its own critic, never trained by its policy);
    GRPO groups count the team's episodes an agent sat out. Each adapter still trains on its own
    calls only."""
    url = f"sqlite:///{tmp_path}/buffer.db"
    planner = fill_buffer(url, tiny_model, agent="planner", seed=0, prompts=PROMPTS[:4], task_prefix="team")
    solver = fill_buffer(url, tiny_model, agent="solver", seed=1, prompts=PROMPTS[:4], task_prefix="team")
    _train(tiny_model, tmp_path, ray_address, "algorithm.name=ppo", "train_batch_size=8", "--max-steps", "2")
    m = _metrics(url)
    assert [s["teammate_turns"] for s in m["planner"] + m["solver"]] == [8, 8]  # the teammate's calls of 2 tasks x 4 runs
    db = buffer.create_buffer_engine(url)
    mine = {a: {e for e, _ in buffer.consumed_ids(engine=db, agent=a)} for a in ("planner", "solver")}
    db.dispose()
    assert mine["planner"] and mine["planner"] <= _ids_of(planner)
    assert mine["solver"] and mine["solver"] <= _ids_of(solver)
    off = tmp_path / "off"
    off.mkdir()
    url_off = f"sqlite:///{off}/buffer.db"
    fill_buffer(url_off, tiny_model, agent="planner", seed=0, prompts=PROMPTS[:4], task_prefix="team")
    _train(tiny_model, off, ray_address, "algorithm.name=ppo", "train_batch_size=8", "algorithm.team_credit=false",
           "--max-steps", "1")
    assert _metrics(url_off)["planner"][0]["teammate_turns"] == 0

    # GRPO: the solver acts only in runs 0 and 1 of tasks the planner plays four times
    grpo = tmp_path / "grpo"
    grpo.mkdir()
    url_g = f"sqlite:///{grpo}/buffer.db"
    fill_buffer(url_g, tiny_model, agent="planner", seed=0, prompts=PROMPTS[:4], task_prefix="team")
    fill_buffer(url_g, tiny_model, agent="solver", seed=1, n=2, prompts=PROMPTS[:4], task_prefix="team")
    _train(tiny_model, grpo, ray_address, "algorithm.name=grpo", "train_batch_size=8", "trainer.agents=[solver]",
           "--max-steps", "1")
    step = _metrics(url_g)["solver"][0]
    assert step["batch_size"] == 8 and step["team_episodes"] == 8  # 4 tasks x the 2 runs it sat out
