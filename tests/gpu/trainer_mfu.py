"""The Trainer's GRPO step on a GPU, by hand (CI has no GPU): a model of SmolLM2-135M's shape (random
weights: no model hub, and the step's cost does not depend on them), a LoRA adapter as the Trainer trains
it, bfloat16; tokens per second and the model-FLOPs utilisation against the card's dense bf16 peak.

    OUT=/tmp/out python tests/gpu/trainer_mfu.py [--peak-tflops 989] [--sequences 64] [--prompt 256] [--response 256]

MFU counts 6 x parameters per token (a full fine-tune's forward and backward); a LoRA step skips the
frozen weights' gradients, so its real share of the peak is about two thirds of what is printed.
"""
import argparse
import json
import os
import random
import shutil
import sys
import time

import torch

sys.path.insert(0, os.getcwd())


def main() -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the card's dense bf16 peak (H100 SXM, H200: 989)")
    p.add_argument("--sequences", type=int, default=64)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--response", type=int, default=256)
    p.add_argument("--micro", type=int, default=16)
    p.add_argument("--micro-tokens", type=int, default=None, help="trainer.micro_batch_tokens (absent: rows alone)")
    p.add_argument("--vary", action="store_true", help="each sequence's prompt and response 1/4 to all of the given lengths")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=30)
    a = p.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.common.tiny_model import build_tiny_model
    from services.trainer.batches import Norms, TrainItem
    from services.trainer.learner import LearnerWorker

    path = "/tmp/smollm2-shaped"
    tiny = build_tiny_model("/tmp/tiny-for-tokenizer")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=a.layers,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    params = sum(t.numel() for t in model.parameters())
    model.save_pretrained(path)
    for f in os.listdir(tiny):
        if "token" in f or f.endswith(".txt") or f == "special_tokens_map.json":
            shutil.copy(os.path.join(tiny, f), path)
    w = LearnerWorker({"model": {"path": path, "dtype": "bfloat16"}, "trainer": {"device": a.device, "micro_batch_size": a.micro,
                                                                                  "micro_batch_tokens": a.micro_tokens},
                       "algorithm": {"name": "grpo"}, "lora": {"r": 16}, "optim": {"lr": 1e-4, "warmup_steps": 0},
                       "log_level": "warning"})
    w.setup()
    w.ensure_agent("a")
    rng = random.Random(0)
    def length(n: int) -> int:
        return rng.randrange(max(1, n // 4), n + 1) if a.vary else n

    items = []
    for i in range(a.sequences):
        prompt, response = length(a.prompt), length(a.response)
        items.append(TrainItem(experience_id=f"e{i}", task_id=f"t{i // 4}", run_id=str(i % 4), model_version=0,
                               prompt_ids=[rng.randrange(100, 49000) for _ in range(prompt)],
                               response_ids=[rng.randrange(100, 49000) for _ in range(response)],
                               old_logprobs=[-10.8] * response, reward=float(i % 2), temperature=1.0,
                               advantage=1.0 if i % 2 else -1.0, seq=i))
    w.train_step("a", items, Norms.of(items), 0, 0)  # warm-up
    if a.device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(a.steps):
        t0 = time.perf_counter()
        w.train_step("a", items, Norms.of(items), step + 1, 0)
        if a.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    tokens = sum(len(i.prompt_ids) + len(i.response_ids) for i in items)
    best = min(times)
    out = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "params": params,
           "sequences": a.sequences, "micro": a.micro, "micro_tokens": a.micro_tokens, "vary": a.vary, "tokens_per_step": tokens, "step_s": times, "tokens_per_s": tokens / best,
           "mfu_6n": 6 * params * tokens / best / (a.peak_tflops * 1e12),
           "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else None}
    print(json.dumps(out), flush=True)
    os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp/out"), "trainer_mfu.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
