"""`kaizen pretrained smollm2-135m-instruct`: what it writes loads and answers in transformers, takes a
LoRA adapter through the Trainer's Policy and peft, and is written once, with the same bytes every time."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time

import pytest
import torch

from services.common.chat_templates import resolve_chat_template
from services.common.pretrained import MARKER
from tests.helpers import REPO

pytestmark = pytest.mark.integration


def _greedy(model, tok, question: str, max_new_tokens: int = 12) -> str:
    text = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    return tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_transformers_loads_it_and_it_answers(smollm2_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((smollm2_model / "config.json").read_text())
    shape = (config["model_type"], config["num_hidden_layers"], config["head_dim"], config["dtype"])
    assert shape == ("llama", 30, 64, "float32")
    assert "quantization_config" not in config
    tok = AutoTokenizer.from_pretrained(smollm2_model)
    assert tok.chat_template == resolve_chat_template("hermes-tools")  # its own template renders tools
    model = AutoModelForCausalLM.from_pretrained(smollm2_model).eval()
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(135e6, rel=0.01)
    assert "Paris" in _greedy(model, tok, "What is the capital of France?")


def test_a_lora_adapter_attaches_saves_and_loads(smollm2_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from services.trainer.config import LoraSection
    from services.trainer.policy import Policy

    policy = Policy(model_path=str(smollm2_model), dtype="float32", device="cpu",
                    lora=LoraSection(r=8, alpha=16, target_modules=["q_proj", "v_proj"]))
    policy.add_agent("weather", critic=False)
    with torch.no_grad():
        for p in policy.adapter_parameters("weather"):
            p.normal_(0.0, 0.02)  # lora_B starts at 0: make the adapter change something
    policy.save_adapter("weather", tmp_path / "weather")
    ids = policy.tokenizer("The capital of France is", return_tensors="pt").input_ids
    policy.model.eval()
    with torch.no_grad():
        trained = policy.model(ids).logits
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2_model), tmp_path / "weather").eval()
        again = loaded(ids).logits
        with loaded.disable_adapter():
            base = loaded(ids).logits
    assert torch.allclose(trained, again, atol=1e-4)
    assert (trained - base).abs().max() > 1e-2


def test_a_second_call_is_a_no_op(smollm2_model):
    before = {p.name: p.stat().st_mtime_ns for p in smollm2_model.iterdir()}
    start = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "services.cli", "pretrained", "smollm2-135m-instruct", str(smollm2_model)],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "already built" in r.stdout
    assert time.monotonic() - start < 60  # no conversion (that takes ~35 s plus loading torch)
    assert {p.name: p.stat().st_mtime_ns for p in smollm2_model.iterdir()} == before


@pytest.mark.slow
def test_the_conversion_writes_the_same_bytes_again(smollm2_model, tmp_path):
    """A second conversion, as a user runs it, matches the first file for file (the marker holds their digests)."""
    r = subprocess.run([sys.executable, "-m", "services.cli", "pretrained", "smollm2-135m-instruct", str(tmp_path / "again"),
                        "--no-install"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    again = json.loads((tmp_path / "again" / MARKER).read_text())
    for name, info in again["files"].items():
        assert hashlib.sha256((tmp_path / "again" / name).read_bytes()).hexdigest() == info["sha256"], name
    first = json.loads((smollm2_model / MARKER).read_text())
    if first["built_with"] != again["built_with"]:
        pytest.skip(f"{smollm2_model} was built with {first['built_with']}, not {again['built_with']}; remove it to compare")
    assert (tmp_path / "again" / MARKER).read_bytes() == (smollm2_model / MARKER).read_bytes()
    assert sorted(p.name for p in (tmp_path / "again").iterdir()) == sorted(p.name for p in smollm2_model.iterdir())
