"""The real `kaizen trainer` on Ray against a buffer with a known reward signal."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from services.common import buffer, checkpoints
from tests.helpers import REPO
from tests.integration.trainer.data import rewarded_share

pytestmark = pytest.mark.integration


@pytest.fixture
def base_model(tiny_model):
    """A fresh base model per test (PeftModel.from_pretrained injects into the model it is given)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(tiny_model), AutoTokenizer.from_pretrained(tiny_model)


def _args(tiny_model, run: Path, ray_address: str, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "services.cli", "trainer", "--config", "configs/trainer.yaml",
        f"model.path={tiny_model}", f"buffer.url=sqlite:///{run}/buffer.db", f"checkpoints.root={run}/ck",
        f"trainer.run_dir={run}/run", f"ray.address={ray_address}", "train_batch_size=16", "lora.r=8",
        "optim.lr=2e-3", "staleness.max_staleness=100", "trainer.torch_threads=1", "log_level=info", *extra,
    ]


def _share_gain(url: str, base_model, adapter_path) -> float:
    """``rewarded_share`` over every experience the run took from the buffer (trained on, or
    discarded as SFT does with the unrewarded ones): with the adapter minus without it."""
    from peft import PeftModel

    db = buffer.create_buffer_engine(url)
    seen = [e for status in ("consumed", "discarded") for e in buffer.list_experiences(engine=db, status=status, limit=100_000)]
    db.dispose()
    model, _ = base_model
    peft_model = PeftModel.from_pretrained(model, str(adapter_path))
    with peft_model.disable_adapter():
        before = rewarded_share(peft_model, seen)
    after = rewarded_share(peft_model, seen)
    return after - before


def _copy_db(sampled_db: Path, run: Path) -> str:
    run.mkdir(parents=True, exist_ok=True)
    shutil.copy(sampled_db, run / "buffer.db")
    return f"sqlite:///{run}/buffer.db"


def _train(tiny_model, run: Path, ray_address: str, *extra: str, timeout: float = 300) -> str:
    r = subprocess.run(_args(tiny_model, run, ray_address, *extra), cwd=REPO, capture_output=True, text=True, timeout=timeout)
    log = r.stdout + r.stderr
    (run / "trainer.log").write_text(log)
    assert r.returncode == 0, log[-4000:]
    return log


def _adapter(run: Path, version: int) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run / "ck" / "default" / f"v{version}" / "adapter_model.safetensors"))


GRPO_STEPS = 5  # at least 3: the data-parallel test reads this run's v3 (and keep_versions holds v1-v5)


@pytest.fixture(scope="module")
def grpo_run(tiny_model, sampled_db, ray_address, tmp_path_factory) -> tuple[Path, str]:
    """GRPO's run on one worker, trained once for two tests: the run's checks, and its adapter after
    3 steps for the data-parallel test (nothing the Trainer does depends on --max-steps)."""
    run = tmp_path_factory.mktemp("grpo")
    _copy_db(sampled_db, run)
    return run, _train(tiny_model, run, ray_address, "algorithm.name=grpo", "ray.workers=1", "--max-steps", str(GRPO_STEPS))


@pytest.mark.parametrize("algorithm, steps", [("ppo", 5), ("grpo", GRPO_STEPS), ("rft", 4)])
def test_each_algorithm_raises_the_rewarded_probability(algorithm, steps, tiny_model, sampled_db, base_model, ray_address, tmp_path,
                                                         request):
    if algorithm == "grpo":
        run, log = request.getfixturevalue("grpo_run")
        url = f"sqlite:///{run}/buffer.db"
    else:
        run = tmp_path
        url = _copy_db(sampled_db, run)
        log = _train(tiny_model, run, ray_address, f"algorithm.name={algorithm}", "--max-steps", str(steps))
    root = run / "ck"
    # (a) versions published atomically: v1..vN complete, LATEST names the newest, no temp dirs left
    assert checkpoints.read_latest(root, "default") == steps
    assert checkpoints.list_versions(root, "default") == list(range(1, steps + 1))
    assert not [p for p in (root / "default").iterdir() if p.name.startswith(".tmp")]
    v = checkpoints.validate_version(root, "default", steps)
    manifest = v.manifest()
    assert manifest["algorithm"] == algorithm and manifest["step"] == steps and manifest["experience_count"] == 16
    # (b) among the responses it trained on, it gives the rewarded ones a larger share of probability
    gain = _share_gain(url, base_model, v.path)
    assert gain > 0.04, (algorithm, gain)  # measured +0.09 to +0.30 over buffers sampled with seeds 0 and 1
    # lineage: what each version trained on is recorded in the buffer and the manifest
    db = buffer.create_buffer_engine(url)
    consumed = buffer.consumed_ids(engine=db)
    assert len(consumed) == 16 * steps
    assert sorted(e for e, ver in consumed if ver == steps) == manifest["experience_ids"]
    db.dispose()
    # metrics every step, to JSONL and TensorBoard
    records = [json.loads(line) for line in (run / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    for key in ("loss", "kl", "entropy", "reward_mean", "reward_std", "tokens_per_s", "staleness_mean", "logprob_mismatch"):
        assert key in records[-1], key
    if algorithm in ("ppo", "grpo"):
        assert {"clip_frac", "advantage_mean", "advantage_std", "policy_loss"} <= set(records[-1])
        # step 1 trains on what the base model sampled: recorded and recomputed logprobs agree
        assert records[0]["logprob_mismatch"] < 1e-3 and records[0]["logprob_mismatch_on_policy"] < 1e-3
    if algorithm == "ppo":
        assert "value_loss" in records[-1]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(run / "run" / "tensorboard"))
    board.Reload()
    loss = board.Scalars("default/loss")
    assert [e.step for e in loss] == list(range(1, steps + 1))
    assert [e.value for e in loss] == pytest.approx([r["loss"] for r in records], rel=1e-6, abs=1e-6)
    assert "published v" in log


def test_flat_groups_set_aside_by_polls_without_a_step_count_in_the_next_steps_record(tiny_model, sampled_db, ray_address,
                                                                                       tmp_path):
    """flat_groups=discard: while the buffer holds only flat groups, polls set them aside and make no step; the
    step that comes once groups with signal are committed counts them in its record (flat_set_aside, flat_groups,
    informative_share), and a later step starts counting again from 0."""
    import sqlite3

    url = _copy_db(sampled_db, tmp_path)
    with sqlite3.connect(tmp_path / "buffer.db") as con:
        tasks = [t for (t,) in con.execute("SELECT task_id FROM experiences GROUP BY task_id ORDER BY min(seq)")]
        flat, held = tasks[:2], tasks[2:]
        con.execute(f"UPDATE experiences SET reward = 0 WHERE task_id IN ({', '.join('?' * len(flat))})", flat)
        # rewarded but not yet committed: the Trainer does not see them
        held_rows = con.execute(f"UPDATE experiences SET status = 'rewarded' WHERE task_id IN ({', '.join('?' * len(held))})",
                                held).rowcount
    proc = subprocess.Popen(_args(tiny_model, tmp_path, ray_address, "algorithm.name=grpo", "algorithm.grpo.group_size=4",
                                  "algorithm.grpo.flat_groups=discard", "trainer.poll_interval_s=0.2", "--max-steps", "2"),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    db = buffer.create_buffer_engine(url)
    try:
        deadline = time.monotonic() + 240
        while len(buffer.list_experiences(engine=db, status="discarded", limit=1000)) < 8:  # the two flat groups' calls
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0][-4000:] if proc.poll() else "waited"
            time.sleep(0.2)
        time.sleep(1.0)  # more polls without a step
        assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()
        assert buffer.commit_experiences(engine=db) == held_rows
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out[-4000:]
        discarded = {e.task_id for e in buffer.list_experiences(engine=db, status="discarded", limit=100_000)}
    finally:
        if proc.poll() is None:
            proc.kill()
        db.dispose()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    first, second = records
    assert set(flat) <= discarded
    # every flat group set aside before the second step's poll was counted by the first step: the two set aside by
    # polls that made no step, and those of its own poll
    set_aside_later = second["flat_set_aside"]
    assert first["flat_set_aside"] == len(discarded) - set_aside_later and first["flat_set_aside"] >= 2, (first, discarded)
    assert first["flat_groups"] == first["flat_set_aside"]  # all flat groups were set aside: none kept
    assert first["informative_share"] == first["informative_groups"] / (first["informative_groups"] + first["flat_groups"])
    assert second["flat_set_aside"] == second["flat_groups"]


def test_grpo_with_every_lever_learns_and_reports_each(tiny_model, sampled_db, base_model, ray_address, tmp_path):
    """Flat groups set aside (dynamic sampling), importance correction against the proximal policy,
    response-level aggregation, the agent's successes replayed beside a decaying supervised term."""
    import sqlite3

    url = _copy_db(sampled_db, tmp_path)
    with sqlite3.connect(tmp_path / "buffer.db") as con:  # the two oldest groups scored all wrong: no signal
        flat = [t for (t,) in con.execute("SELECT task_id FROM experiences GROUP BY task_id ORDER BY min(seq) LIMIT 2")]
        con.execute(f"UPDATE experiences SET reward = 0 WHERE task_id IN ({', '.join('?' * len(flat))})", flat)
    steps = 4
    _train(tiny_model, tmp_path, ray_address, "algorithm.name=grpo", "algorithm.grpo.group_size=4",
           "algorithm.grpo.flat_groups=discard", "algorithm.grpo.importance=truncate", "algorithm.grpo.aggregation=sequence",
           "algorithm.self_imitation.coef=1", "algorithm.self_imitation.batch_size=4", "algorithm.success_reward=1",
           "--max-steps", str(steps))
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    # the first step met the two flat groups first, set them aside and took the next four
    assert records[0]["flat_groups"] >= 2 and records[0]["informative_groups"] == 4 and records[0]["batch_size"] == 16
    assert records[0]["informative_share"] == 4 / (4 + records[0]["flat_groups"])
    for r in records:
        assert {"informative_groups", "is_weight_mean", "is_capped_frac", "clip_frac"} <= set(r["objective_figures"])
        assert 0.0 < r["is_weight_mean"] <= 2.0 and 0.0 <= r["is_capped_frac"] <= 1.0
    # step 1 trains what its own policy sampled: engine and Trainer agree, every weight about 1
    assert records[0]["is_weight_mean"] == pytest.approx(1.0, abs=0.01) and records[0]["is_capped_frac"] == 0.0
    # from the second step on, the first step's successes are replayed in the supervised term
    assert records[0]["imitations"] == 0 and all(r["imitations"] == 4 for r in records[1:])
    db = buffer.create_buffer_engine(url)
    discarded = buffer.list_experiences(engine=db, status="discarded", limit=100_000)
    db.dispose()
    rewards_of: dict[str, set] = {}
    for e in discarded:  # what was set aside: whole groups whose episodes all scored the same, the two made so first
        rewards_of.setdefault(e.task_id, set()).add(e.reward)
    assert set(flat) <= set(rewards_of) and all(len(r) == 1 for r in rewards_of.values())
    assert len(discarded) == 4 * len(rewards_of)
    v = checkpoints.validate_version(tmp_path / "ck", "default", steps)
    gain = _share_gain(url, base_model, v.path)
    assert gain > 0.04, gain


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_sequence_level_actions_learn_too(algorithm, tiny_model, sampled_db, base_model, ray_address, tmp_path):
    _copy_db(sampled_db, tmp_path)
    _train(tiny_model, tmp_path, ray_address, f"algorithm.name={algorithm}", "algorithm.level=sequence",
           "algorithm.sequence_logprob=sum", "--max-steps", "5")
    gain = _share_gain(f"sqlite:///{tmp_path}/buffer.db", base_model, tmp_path / "ck" / "default" / "v5")
    assert gain > 0.04, (algorithm, gain)


def _steps_in_db(url: str) -> list[int]:
    db = buffer.create_buffer_engine(url)
    with db.connect() as conn:
        steps = [r[0] for r in conn.execute(buffer.trainer_steps.select().with_only_columns(buffer.trainer_steps.c.step))]
    db.dispose()
    return steps


def test_killed_trainer_resumes_exactly(tiny_model, sampled_db, ray_address, tmp_path):
    """kill -9 mid-run, restart: same adapter as an uninterrupted run, nothing trained twice. A cold start of 3 steps
    (no demonstrations here: the label alone) marks the versions that hold its steps, the same in both runs."""
    total, interval = 8, 2
    common = ("algorithm.name=ppo", f"save_interval={interval}", "algorithm.cold_start_steps=3")
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    _copy_db(sampled_db, straight)
    _train(tiny_model, straight, ray_address, *common, "--max-steps", str(total))

    url = _copy_db(sampled_db, killed)
    proc = subprocess.Popen(_args(tiny_model, killed, ray_address, *common, "--max-steps", str(total)), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 240
    while len(_steps_in_db(url)) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, "trainer ended before it could be killed"
        time.sleep(0.05)
    # three steps in, the driver has selected, recorded and published without torch: only its learners load it
    maps = Path(f"/proc/{proc.pid}/maps").read_text()
    assert "/torch/" not in maps, [line for line in maps.splitlines() if "/torch/" in line][:3]
    os.killpg(proc.pid, signal.SIGKILL)  # mid-step, most likely
    proc.wait()
    done = len(_steps_in_db(url))
    assert done < total
    log = _train(tiny_model, killed, ray_address, *common, "--max-steps", str(total - done))
    assert f"resumed at step {done}" in log

    assert _steps_in_db(url) == list(range(1, total + 1))  # every step once, none repeated
    db = buffer.create_buffer_engine(url)
    consumed = buffer.consumed_ids(engine=db)
    db.dispose()
    assert len(consumed) == len({e for e, _ in consumed}) == 16 * total
    # versions hold exactly save_interval steps' worth of experiences each
    assert sorted({v for _, v in consumed}) == list(range(1, total // interval + 1))
    assert all(sum(1 for _, v in consumed if v == ver) == 16 * interval for ver in range(1, total // interval + 1))
    for run in (straight, killed):  # v2 holds steps 3-4: the cold start's last; the gate measures it (release.gate.every)
        marks = [checkpoints.validate_version(run / "ck", "default", v).manifest().get("cold_start") for v in (1, 2, 3, 4)]
        assert marks == [{"steps": 3, "last": False}, {"steps": 3, "last": True}, None, None], (run, marks)
    # and the final adapter is the one an uninterrupted run produces: the state really was resumed
    a, b = _adapter(straight, total // interval), _adapter(killed, total // interval)
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4)


def test_two_data_parallel_workers_match_one(tiny_model, sampled_db, ray_address, tmp_path, grpo_run):
    _copy_db(sampled_db, tmp_path)
    _train(tiny_model, tmp_path, ray_address, "algorithm.name=grpo", "ray.workers=2", "--max-steps", "3")
    a, b = _adapter(grpo_run[0], 3), _adapter(tmp_path, 3)  # one worker's third version, two workers'
    assert a and a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=1e-3)


def test_trainer_continues_from_an_adapter_published_from_elsewhere(tiny_model, sampled_db, ray_address, tmp_path):
    """v1 from the Trainer; v2 from `kaizen publish` (an adapter made outside, with the Trainer's LoRA
    settings); the restarted Trainer continues from v2's weights and publishes v3 after it."""
    from safetensors.torch import save_file

    url = _copy_db(sampled_db, tmp_path)
    _train(tiny_model, tmp_path, ray_address, "algorithm.name=grpo", "--max-steps", "1")
    root = tmp_path / "ck"
    outside = tmp_path / "outside"
    shutil.copytree(root / "default" / "v1", outside)
    (outside / "manifest.json").unlink()
    torch.manual_seed(0)
    save_file({k: v + 0.05 * torch.randn_like(v) for k, v in _adapter(tmp_path, 1).items()}, str(outside / "adapter_model.safetensors"))
    r = subprocess.run([sys.executable, "-m", "services.cli", "publish", "--agent", "default", "--adapter", str(outside),
                        "--checkpoints-root", str(root)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr

    log = _train(tiny_model, tmp_path, ray_address, "algorithm.name=grpo", "--max-steps", "1")
    assert "continuing from v2, published from elsewhere" in log
    assert checkpoints.read_latest(root, "default") == 3
    assert checkpoints.validate_version(root, "default", 3).manifest()["parent_version"] == 2
    v1, v2, v3 = (_adapter(tmp_path, v) for v in (1, 2, 3))
    moved_from_v2 = sum((v3[k] - v2[k]).norm() ** 2 for k in v3) ** 0.5
    moved_from_v1 = sum((v3[k] - v1[k]).norm() ** 2 for k in v3) ** 0.5
    assert moved_from_v2 < 0.5 * moved_from_v1, (moved_from_v2, moved_from_v1)  # one step from v2, not from v1

    # a third run resumes from the state of step 2, which already holds v2: nothing is adopted again
    log = _train(tiny_model, tmp_path, ray_address, "algorithm.name=grpo", "--max-steps", "1")
    assert "continuing from" not in log and checkpoints.read_latest(root, "default") == 4
    db = buffer.create_buffer_engine(url)
    assert sorted({v for _, v in buffer.consumed_ids(engine=db)}) == [1, 3, 4]
    db.dispose()


def test_a_backlog_is_trained_not_thrown_away(tiny_model, sampled_db, ray_address, tmp_path):
    """192 committed experiences of v0 wait (the Trainer was down). Defaults (max_staleness 4, a
    version per step): catch-up trains all of them in 5 steps, each within 4 versions of
    v0 (whole GRPO groups: 40, 40, 40, 36, 36); with catch-up off, 5 steps of 16 train 80 and the other 112 are past max_staleness."""
    runs = {}
    for name, extra in (("catch_up", ()), ("off", ("staleness.catch_up_max_rows=0",))):
        run = tmp_path / name
        url = _copy_db(sampled_db, run)
        log = _train(tiny_model, run, ray_address, "staleness.max_staleness=4", *extra, "--max-steps", "5")
        db = buffer.create_buffer_engine(url)
        steps = [buffer.last_trainer_step(engine=db, agent="default")]
        runs[name] = (buffer.count_by_status(engine=db), steps[0], log)
        db.dispose()
    counts, last, log = runs["catch_up"]
    assert counts == {"consumed": 192}, counts
    assert (last.step, last.version) == (5, 5) and last.metrics["catch_up"] and last.metrics["staleness_max"] <= 4
    assert "catching up on a backlog of 192 committed experiences: this step takes 40" in log  # 10 GRPO groups of 4
    counts, last, _ = runs["off"]
    assert counts == {"consumed": 80, "committed": 112} and last.version == 5  # v5 - v0 > max_staleness: stale
