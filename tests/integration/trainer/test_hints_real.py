"""A hint teaches SmolLM2-135M-Instruct a behaviour it almost never shows, with no reward and no
demonstration: its answers, served and recorded by a real Explorer, get only the hint "Begin your
answer with the word Sure." through POST /feedback; the real `kaizen trainer` runs opd (the agent
itself, reading the hint, is the teacher: on-policy self-distillation with the teacher's top tokens).
Asserted, read exactly off the model: on held-out questions, without any hint, the probability that
the answer starts with "Sure" rises by a wide margin (one step: 0.002 -> 0.15 when written; two steps on
32 answers: 0.77, and no rise without the teacher's top tokens, docs/TRAINER.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from services.common import buffer, checkpoints
from tests.helpers import REPO

pytestmark = pytest.mark.integration

HINT = "Begin your answer with the word Sure."
ASKED = ["What is the capital of Spain?", "Name a fruit that is red.", "How many legs does a spider have?",
         "What color is the sky?", "Who wrote Hamlet?", "What is 12 plus 7?", "Name a large animal.",
         "What do bees make?", "Which planet is closest to the sun?", "What is ice made of?"]
HELD_OUT = ["What is the capital of Italy?", "Name a vegetable that is green.", "How many wheels does a bicycle have?",
            "What color is grass?", "Who painted the Mona Lisa?", "What is 9 plus 4?", "What do spiders spin?",
            "Name a small bird."]


def _p_sure(model, tokenizer, questions: list[str]) -> float:
    """Mean probability that the reply to each question (no hint) starts with "Sure"."""
    sure = tokenizer.encode("Sure", add_special_tokens=False)[0]
    total = 0.0
    with torch.no_grad():
        for q in questions:
            text = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
            ids = tokenizer.encode(text, add_special_tokens=False)
            total += float(torch.softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)[sure])
    return total / len(questions)


def test_a_hint_alone_teaches_smollm2_what_it_says(smollm2_model, make_explorer, ray_address, tmp_path):
    url = f"sqlite:///{tmp_path}/buffer.db"
    ex = make_explorer(f"model.path={smollm2_model}", f"buffer.url={url}", "recorder.hint_role=system")
    hinted = 0
    for q in ASKED:
        r = ex.client.chat.completions.create(model="default", messages=[{"role": "user", "content": q}], n=2,
                                              max_tokens=6, temperature=1.0)
        for c in r.choices:  # an answer that does not start as asked gets the hint, and nothing else
            if not (c.message.content or "").startswith("Sure"):
                fb = ex.http.post("/feedback", json={"msg_ids": [c.model_extra["experience_id"]], "hint": HINT})
                assert fb.status_code == 200, fb.text
                hinted += 1
    assert hinted >= 16 and ex.http.post("/commit", json={}).json()["committed"] == hinted
    ex.stop()
    steps = 1
    cmd = [sys.executable, "-m", "services.cli", "trainer", "--config", "configs/trainer.yaml",
           f"model.path={smollm2_model}", f"buffer.url={url}", f"checkpoints.root={tmp_path}/ck",
           f"trainer.run_dir={tmp_path}/run", f"ray.address={ray_address}", "algorithm.name=opd",
           "algorithm.opd.top_k=16", "train_batch_size=16", "lora.r=8", "optim.lr=5e-3", "optim.warmup_steps=0", "trainer.epochs=2",
           "trainer.torch_threads=1", "--max-steps", str(steps)]
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == steps and all(rec["hinted_share"] == pytest.approx(1.0) and rec["teacher_s"] > 0
                                         for rec in records)
    db = buffer.create_buffer_engine(url)
    assert len(buffer.consumed_ids(engine=db, agent="default")) == 16 * steps
    db.dispose()

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_model)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2_model),
                                      str(checkpoints.version_dir(tmp_path / "ck", "default", steps)))
    with model.disable_adapter():
        before = _p_sure(model, tok, HELD_OUT)
    after = _p_sure(model, tok, HELD_OUT)
    print(f"P(reply starts with Sure) on held-out questions: {before:.4f} -> {after:.4f}")
    assert after > max(10 * before, 0.02), (before, after)
