"""Makes real LoRA adapters for tests: a few SFT steps on the tiny model, published as a version."""

from __future__ import annotations

from pathlib import Path

import torch

from services.common.checkpoints import publish_version


def train_adapter(model_path: Path, prompt_ids: list[int], target_ids: list[int], *, steps: int = 200, seed: int = 0):
    """A peft model whose adapter makes ``target_ids`` the greedy continuation of ``prompt_ids``."""
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
