"""The Trainer's driver (the service, its recipes, the learner group) imports no torch: only its
learners load it, which keeps every Trainer start about 2 s shorter (docs/ARCHITECTURE.md)."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO

# imports the driver's modules, then selects a GRPO batch (its group advantages), as the driver does
DRIVER = """
import sys
from datetime import datetime, timezone

import services.cli, services.trainer.service, services.trainer.learners
from services.common.config import load_config
from services.common.records import CommittedExperience
from services.trainer.batches import select_batch
from services.trainer.config import TrainerConfig

now = datetime(2026, 1, 1, tzinfo=timezone.utc)
rows = [CommittedExperience(experience_id=f"e{i}", agent="a", task_id=f"t{i // 2}", run_id=str(i % 2), seq=i, model_version=0,
                            prompt_token_ids=[1, 2], response_token_ids=[3], response_logprobs=[-0.5], reward=float(i % 3 == 0),
                            sampling={}, feedback=None, finish_reason="stop", created_at=now, updated_at=now) for i in range(8)]
for name in ("grpo", "ppo", "sft", "rft", "opd"):
    c = load_config(TrainerConfig, None, ["model.path=/m", f"algorithm.name={name}", "train_batch_size=4",
                                          "algorithm.grpo.group_size=2", "algorithm.sft.min_reward=1"], env={})
    sel = select_batch(rows, recipe=c.algorithm.recipe(), cfg=c, current_version=0, now=now)
    if name == "grpo":
        assert [round(it.advantage, 4) for it in sel.items] == [1.0, -1.0, -1.0, 1.0], [it.advantage for it in sel.items]
print(sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "transformers", "peft"))))
"""


def test_the_driver_imports_no_torch_and_selects_without_it():
    out = subprocess.run([sys.executable, "-c", DRIVER], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
