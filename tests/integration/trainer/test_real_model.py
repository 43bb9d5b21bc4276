"""The loop on a real pretrained model, scaled down to fit the suite: SmolLM2-135M-Instruct's own
samples rewarded by a known rule, four demonstrations posted through a real Explorer, and the real
`kaizen trainer` running the mixed objective (GRPO over episodes + the supervised term on the
demonstrations) for a few steps. Asserted: the direction, with margin, of the two signals a few
steps can move, read exactly off the model (as the tiny-model trainer tests do)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from services.common import buffer, checkpoints
from tests.helpers import REPO
from tests.integration.trainer.data import PROMPTS, fill_buffer, rewarded_share

pytestmark = pytest.mark.integration

TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}}]


def _demo(a: int, b: int) -> dict:
    return {"model": "default", "tools": TOOLS,
            "messages": [{"role": "system", "content": "Use the calculator for arithmetic."},
                         {"role": "user", "content": f"What is {a} * {b}?"}],
            "response": {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "calculator", "arguments": json.dumps({"expression": f"{a} * {b}"})}}]}}


def _reply_logprob(model, experiences) -> float:
    """Mean log-probability per token of the demonstrations' replies."""
    total, n = 0.0, 0
    with torch.no_grad():
        for e in experiences:
            ids = list(e.prompt_token_ids) + list(e.response_token_ids)
            logits = model(torch.tensor([ids])).logits[0, len(e.prompt_token_ids) - 1: -1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(e.response_token_ids).unsqueeze(-1))
            total, n = total + lp.sum().item(), n + len(e.response_token_ids)
    return total / n


def test_smollm2_learns_from_its_rewards_and_demonstrations(smollm2_model, make_explorer, ray_address, tmp_path):
    url = f"sqlite:///{tmp_path}/buffer.db"
    ex = make_explorer(f"model.path={smollm2_model}", f"buffer.url={url}")
    for a, b in [(17, 23), (41, 12), (8, 96), (33, 57)]:
        assert ex.http.post("/demonstrations", json=_demo(a, b)).status_code == 200
    ex.stop()
    rollouts = fill_buffer(url, smollm2_model, prompts=PROMPTS[:12], n=4, max_tokens=2)  # 12 tasks x 4 episodes
    steps = 3
    cmd = [sys.executable, "-m", "services.cli", "trainer", "--config", "configs/trainer.yaml",
           f"model.path={smollm2_model}", f"buffer.url={url}", f"checkpoints.root={tmp_path}/ck",
           f"trainer.run_dir={tmp_path}/run", f"ray.address={ray_address}", "algorithm.name=grpo",
           "algorithm.group_size=4", "train_batch_size=16", "algorithm.demo_batch_size=4", "algorithm.sft_coef=1.0",
           "lora.r=8", "optim.lr=2e-3", "optim.warmup_steps=0", "trainer.torch_threads=1", "--max-steps", str(steps)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    db = buffer.create_buffer_engine(url)
    demos = buffer.fetch_committed(engine=db, agent="default", limit=10, demonstrations=True)
    consumed = {e for e, _ in buffer.consumed_ids(engine=db, agent="default")}
    last = buffer.last_trainer_step(engine=db, agent="default")
    db.dispose()
    assert len(demos) == 4 and len(consumed) == 16 * steps  # demonstrations are replayed, never consumed
    assert last.metrics["demonstrations"] == 4 and last.metrics["demo_nll"] > 0
    # the guard scored the demonstrations around the step (TrainerConfig.guard) and said what it did
    assert last.metrics["guard_attempts"] >= 1 and last.metrics["guard_nll_before"] > 0 and "guard_refused" in last.metrics
    trained = [e for e in rollouts if e.experience_id in consumed]

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2_model),
                                      str(checkpoints.version_dir(tmp_path / "ck", "default", steps)))
    with model.disable_adapter():
        share_before, demo_before = rewarded_share(model, trained), _reply_logprob(model, demos)
    share_after, demo_after = rewarded_share(model, trained), _reply_logprob(model, demos)
    assert share_after - share_before > 0.02, (share_before, share_after)
    assert demo_after - demo_before > 0.2, (demo_before, demo_after)
