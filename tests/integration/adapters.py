"""Makes real LoRA adapters for tests: a few SFT steps on the tiny model, published as a version."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from pathlib import Path

import torch

from services.common.checkpoints import publish_version
from tests.helpers import ADAPTER_CACHE_ENV




def train_adapter(model_path: Path, prompt_ids: list[int], target_ids: list[int], *, steps: int = 200, seed: int = 0):
    """A peft model whose adapter makes ``target_ids`` the greedy continuation of ``prompt_ids``.

    Trained once per test run for the same model files and arguments: the first test to ask trains it
    and saves it under $KAIZEN_TEST_ADAPTERS, and every later one (on any test worker) loads it."""
    cache = os.environ.get(ADAPTER_CACHE_ENV)
    if not cache:
        return _train(model_path, prompt_ids, target_ids, steps=steps, seed=seed)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    key = hashlib.sha256(json.dumps([_model_digest(model_path), prompt_ids, target_ids, steps, seed]).encode()).hexdigest()[:24]
    folder = Path(cache) / key
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "adapter_config.json").exists():
            _train(model_path, prompt_ids, target_ids, steps=steps, seed=seed).save_pretrained(folder)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    return PeftModel.from_pretrained(base, folder).eval()


def _model_digest(model_path: Path) -> str:
    """The model's identity by content (each test worker builds its own copy of the tiny model)."""
    h = hashlib.sha256()
    for f in sorted(Path(model_path).glob("*.json")) + sorted(Path(model_path).glob("*.safetensors")):
        h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


def _train(model_path: Path, prompt_ids: list[int], target_ids: list[int], *, steps: int, seed: int):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    cfg = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = get_peft_model(model, cfg)
    ids = torch.tensor([prompt_ids + target_ids])
    labels = ids.clone()
    labels[:, : len(prompt_ids)] = -100
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(steps):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.01:
            break
    model.eval()
    return model


def train_reply_adapter(model_path: Path, messages: list[dict], reply: str, *, tools: list[dict] | None = None):
    """A peft model whose adapter answers ``messages`` (rendered by the chat template, with
    ``tools``) with exactly ``reply`` and then ends its turn."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path)
    prompt = tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    target = tok.encode(reply, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    return train_adapter(model_path, tok.encode(prompt, add_special_tokens=False), target)


def publish_adapter(model, root: Path, agent: str, version: int) -> Path:
    v = publish_version(root, agent, version, lambda d: model.save_pretrained(d), {"step": 0, "algorithm": "test"})
    return v.path
