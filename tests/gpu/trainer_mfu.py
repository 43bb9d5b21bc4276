"""The Trainer's GRPO step on a GPU, by hand (CI has no GPU): a model of SmolLM2-135M's shape (random
weights: no model hub, and the step's cost does not depend on them), a LoRA adapter as the Trainer trains
it, bfloat16; tokens per second and the model-FLOPs utilisation against the card's dense bf16 peak.

    OUT=/tmp/out python tests/gpu/trainer_mfu.py [--peak-tflops 989] [--sequences 64] [--prompt 256] [--response 256]
    python tests/gpu/trainer_mfu.py --calls 4 [--no-chain]   # episodes of 4 calls, as an agent's tool loop records them

MFU counts 6 x parameters per token the body runs (a full fine-tune's forward and backward); a LoRA step
skips the frozen weights' gradients, so its real share of the peak is about two thirds of what is printed.
tokens_per_s counts every call's prompt and response, as one row per call would run them, so chained
rows (fewer tokens through the body) show as more of them.
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


def shaped_model(layers: int = 30) -> tuple[str, int]:
    """A model of SmolLM2-135M's shape with random bfloat16 weights and the tiny model's tokenizer (ids past its
    vocabulary decode to nothing), built once a machine under /tmp: its path and parameter count."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.common.tiny_model import build_tiny_model

    path = f"/tmp/smollm2-shaped-{layers}"
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, tie_word_embeddings=True)
    if not os.path.exists(os.path.join(path, "params.json")):  # built once a machine: later runs reuse it
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
        model.save_pretrained(path + ".part")
        tiny = build_tiny_model("/tmp/tiny-for-tokenizer")
        for f in os.listdir(tiny):
            if "token" in f or f.endswith(".txt") or f == "special_tokens_map.json":
                shutil.copy(os.path.join(tiny, f), path + ".part")
        with open(os.path.join(path + ".part", "params.json"), "w") as f:
            json.dump(sum(t.numel() for t in model.parameters()), f)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(path + ".part", path)
        del model
    with open(os.path.join(path, "params.json")) as f:
        return path, json.load(f)


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
    p.add_argument("--calls", type=int, default=1, help="episodes of this many calls: each call's prompt holds the last "
                   "call's prompt, its response and a tool's 16-token result (so trainer.chain_calls can score them in one row)")
    p.add_argument("--no-chain", action="store_true", help="trainer.chain_calls off: one row per call")
    p.add_argument("--tag", default="", help="written to $OUT/trainer_mfu{-tag}.json")
    a = p.parse_args()
    from services.trainer.batches import Norms, TrainItem
    from services.trainer.learner import LearnerWorker
    from services.trainer.policy import chain_rows

    path, params = shaped_model(a.layers)
    w = LearnerWorker({"model": {"path": path, "dtype": "bfloat16"}, "trainer": {"device": a.device, "micro_batch_size": a.micro,
                                                                                  "micro_batch_tokens": a.micro_tokens,
                                                                                  "chain_calls": not a.no_chain},
                       "algorithm": {"name": "grpo"}, "lora": {"r": 16}, "optim": {"lr": 1e-4, "warmup_steps": 0},
                       "log_level": "warning"})
    w.setup()
    w.ensure_agent("a")
    rng = random.Random(0)
    def length(n: int) -> int:
        return rng.randrange(max(1, n // 4), n + 1) if a.vary else n

    def random_ids(n: int) -> list[int]:
        return [rng.randrange(100, 49000) for _ in range(n)]

    items, prompt_ids = [], []
    for i in range(a.sequences):
        call = i % a.calls  # the call's place in its episode
        prompt_ids = random_ids(length(a.prompt)) if call == 0 else prompt_ids + items[-1].response_ids + random_ids(16)
        response = length(a.response)
        episode = i // a.calls
        items.append(TrainItem(experience_id=f"e{i}", task_id=f"t{episode // 4}", run_id=str(episode % 4), model_version=0,
                               prompt_ids=prompt_ids, response_ids=random_ids(response),
                               old_logprobs=[-10.8] * response, reward=float(episode % 2), temperature=1.0,
                               advantage=1.0 if episode % 2 else -1.0, seq=i))
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
    tokens = sum(len(i.prompt_ids) + len(i.response_ids) for i in items)  # as one row per call would run them
    chained = w.cfg.trainer.chain_calls and getattr(w.policy, "chains", True)
    rows = (chain_rows(*zip(*[(i.prompt_ids, i.response_ids, i.temperature) for i in items])) if chained
            else [[k] for k in range(len(items))])
    row_tokens = sum(len(items[r[0]].prompt_ids) + len(items[r[0]].response_ids) for r in rows)  # what the body runs
    best = min(times)
    out = {"device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu", "params": params,
           "sequences": a.sequences, "calls": a.calls, "chain_calls": chained,
           "rows": len(rows), "micro": a.micro, "micro_tokens": a.micro_tokens, "vary": a.vary, "tokens_per_step": tokens,
           "row_tokens_per_step": row_tokens, "step_s": times, "tokens_per_s": tokens / best,
           "mfu_6n": 6 * params * row_tokens / best / (a.peak_tflops * 1e12),
           "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if a.device == "cuda" else None}
    print(json.dumps(out), flush=True)
    os.makedirs(os.environ.get("OUT", "/tmp/out"), exist_ok=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp/out"), f"trainer_mfu{'-' + a.tag if a.tag else ''}.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
