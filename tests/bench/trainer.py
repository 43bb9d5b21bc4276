"""One GRPO training step of our LearnerWorker vs TRL's GRPOTrainer update, on the identical batch.

    python -m tests.bench.trainer

Both sides get the same tiny model (float32, CPU), the same LoRA (r=16, alpha=32, dropout 0, all
projections), the same starting adapter weights, learning rate, clip epsilon 0.2, grad-norm clip 1.0,
no KL, one optimizer step on the whole batch (one micro-batch) and the same torch thread count. The
batch is 4 chat prompts x 4 random completions of 32..64 tokens with group-relative advantages.

Ours is ``LearnerWorker.train_step`` called in-process (no Ray). TRL's is a real ``GRPOTrainer``
whose generation is skipped: the inputs dict its ``_generate_and_score_completions`` would return is
built here, then ``compute_loss``, ``backward``, grad clipping and its own optimizer's ``step``, as its
training loop does. TRL's ``loss_type="dapo"`` divides by the number of completion tokens in the
batch, as our token-mean aggregation does. Rounds alternate the two so machine drift hits both.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass

import torch

from tests.bench.common import TINY, table

PROMPTS = [
    "Explain briefly why the sky is blue during the day.",
    "Write a haiku about autumn leaves falling in a quiet park at dusk, please.",
    "A farmer has 17 sheep and all but 9 run away. How many are left?",
    "List three uses of a paperclip that are not about holding paper together, and say which one you like most.",
]
GENERATIONS = 4
COMPLETION_LEN = (32, 64)
LR = 1e-4
EPSILON = 0.2
GRAD_CLIP = 1.0
LORA = dict(r=16, alpha=32, dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
WARMUP, ROUNDS = 2, 5


@dataclass
class Batch:
    prompts: list[list[int]]  # one per sequence (each prompt repeated GENERATIONS times)
    completions: list[list[int]]
    rewards: torch.Tensor  # (B,)
    group_ids: torch.Tensor  # (B,)
    advantages: torch.Tensor  # (B,)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c) for c in self.completions)

    @property
    def total_tokens(self) -> int:
        return self.completion_tokens + sum(len(p) for p in self.prompts)


def make_batch(tokenizer, seed: int = 0) -> Batch:
    from services.trainer.algorithms.group import group_relative

    rng = random.Random(seed)
    special = set(tokenizer.added_tokens_decoder)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    prompts, completions, gids = [], [], []
    for g, text in enumerate(PROMPTS):
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        ids = tokenizer.encode(rendered, add_special_tokens=False)
        for _ in range(GENERATIONS):
            prompts.append(ids)
            completions.append([rng.choice(vocab) for _ in range(rng.randint(*COMPLETION_LEN))])
            gids.append(g)
    rewards = [float(rng.random() < 0.5) for _ in prompts]
    adv = torch.tensor(group_relative(rewards, gids, std_normalize=True))
    return Batch(prompts, completions, torch.tensor(rewards), torch.tensor(gids), adv)


class Ours:
    """LearnerWorker in-process: items as the Trainer sends them over Ray, one train_step per call."""

    def __init__(self, model: str, batch: Batch, threads: int, attention: str = "sdpa"):
        from services.common.config import load_config
        from services.trainer.config import TrainerConfig
        from services.trainer.learner import LearnerWorker
        from services.trainer.batches import Norms, TrainItem
        from services.trainer.policy import pack

        overrides = [
            f"model.path={model}", "model.dtype=float32", "trainer.device=cpu", "algorithm.name=grpo",
            "algorithm.kl_coef=0", "algorithm.kl_metric=false", f"algorithm.clip_low={EPSILON}",
            f"algorithm.clip_high={EPSILON}", f"trainer.micro_batch_size={len(batch.prompts)}",
            f"train_batch_size={len(batch.prompts)}", f"trainer.torch_threads={threads}", f"optim.lr={LR}",
            f"optim.grad_clip={GRAD_CLIP}", f"lora.r={LORA['r']}", f"lora.alpha={LORA['alpha']}",
            f"lora.dropout={LORA['dropout']}", "log_level=warning",
            # TRL's model attends by SDPA (transformers' default): so does ours by default here, in every dtype
            # (trainer.attention's auto would take plain products for bfloat16 on a CPU), so that the two steps run the
            # same kernels; smollm2's bench adds a side on the Trainer's own default (auto)
            f"trainer.attention={attention}",
        ]
        cfg = load_config(TrainerConfig, None, overrides, env={})
        self.worker = LearnerWorker(cfg.model_dump(), rank=0, world_size=1)
        self.worker.setup()
        self.worker.ensure_agent("bench")
        p = self.worker.policy
        packed = pack(batch.prompts, batch.completions, [1.0] * len(batch.prompts), p.pad_id)
        with torch.no_grad():  # sampling logprobs = the base model's, so the ratio starts at 1
            old = p.forward(packed, need_hidden=False, adapter=False).logprobs
        self.items = [
            TrainItem(experience_id=f"e{i}", task_id=f"t{int(batch.group_ids[i])}", model_version=0, prompt_ids=pr,
                 response_ids=c, old_logprobs=old[i, : len(c)].tolist(), reward=float(batch.rewards[i]),
                 temperature=1.0, advantage=float(batch.advantages[i]))
            for i, (pr, c) in enumerate(zip(batch.prompts, batch.completions))
        ]
        self.norms = Norms(tokens=float(batch.completion_tokens), sequences=float(len(self.items)))
        self.steps = 0

    def adapter_state(self) -> dict[str, torch.Tensor]:
        return {n: q for n, q in self.worker.policy.model.named_parameters() if ".bench." in n and "lora_" in n}

    def step(self) -> float:
        stats = self.worker.train_step("bench", self.items, self.norms, self.steps, current_version=0)
        self.steps += 1
        return stats.loss


def _zero_reward(completions, **kwargs):
    return [0.0] * len(completions)


class TRL:
    """A real trl.GRPOTrainer; its update (loss, backward, clip, optimizer step) on a prebuilt inputs dict."""

    def __init__(self, model: str, batch: Batch, out_dir: str):
        from datasets import Dataset
        from peft import LoraConfig
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl import GRPOConfig, GRPOTrainer
        from trl.trainer.utils import pad

        tok = AutoTokenizer.from_pretrained(model)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        B = len(batch.prompts)
        args = GRPOConfig(
            output_dir=out_dir, per_device_train_batch_size=B, num_generations=GENERATIONS,
            gradient_accumulation_steps=1, learning_rate=LR, beta=0.0, epsilon=EPSILON, loss_type="dapo",
            max_grad_norm=GRAD_CLIP, bf16=False, fp16=False, use_cpu=True, gradient_checkpointing=False,
            report_to=[], logging_strategy="no", save_strategy="no", disable_tqdm=True,
            max_completion_length=COMPLETION_LEN[1], log_completions=False,
        )
        peft = LoraConfig(r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                          target_modules=list(LORA["target_modules"]), bias="none", task_type="CAUSAL_LM")
        data = Dataset.from_dict({"prompt": [[{"role": "user", "content": t}] for t in PROMPTS]})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.trainer = GRPOTrainer(model=base, reward_funcs=_zero_reward, args=args, train_dataset=data,
                                       processing_class=tok, peft_config=peft)
        tr = self.trainer
        tr.model.train()
        tr.current_gradient_accumulation_steps = 1  # the training loop sets this per window; we skip the loop
        self.optimizer = tr.create_optimizer()
        self.params = [q for q in tr.model.parameters() if q.requires_grad]

        # What _generate_and_score_completions returns: prompts left-padded, completions right-padded.
        pad_id = tok.pad_token_id
        prompt_ids = pad([torch.tensor(p) for p in batch.prompts], padding_value=pad_id, padding_side="left")
        ones = lambda xs: [torch.ones(len(x), dtype=torch.long) for x in xs]  # noqa: E731
        prompt_mask = pad(ones(batch.prompts), padding_value=0, padding_side="left")
        completion_ids = pad([torch.tensor(c) for c in batch.completions], padding_value=pad_id, padding_side="right")
        completion_mask = pad(ones(batch.completions), padding_value=0, padding_side="right")
        self.inputs = {
            "prompt_ids": prompt_ids, "prompt_mask": prompt_mask,
            "completion_ids": completion_ids, "completion_mask": completion_mask,
            "advantages": batch.advantages.clone(),
            "num_items_in_batch": completion_mask.sum(),
        }
        with torch.no_grad():  # as TRL computes old_per_token_logps: its own forward, here with the adapter at 0
            old, _, _ = tr._get_per_token_logps_and_entropies(
                tr.model, torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1),
                completion_ids.size(1),
            )
        self.inputs["old_per_token_logps"] = old

    def load_adapter(self, state: dict[str, torch.Tensor]) -> None:
        """Start from our adapter's weights (LoRA A is random), so both sides follow the same trajectory."""
        mine = {n.replace(".bench.", ".default."): q for n, q in state.items()}
        theirs = {n: q for n, q in self.trainer.model.named_parameters() if "lora_" in n}
        if set(mine) != set(theirs):
            raise RuntimeError(f"adapter names differ, e.g. {sorted(set(mine) ^ set(theirs))[:3]}")
        with torch.no_grad():
            for n, q in theirs.items():
                q.copy_(mine[n])

    def step(self) -> float:
        tr = self.trainer
        loss = tr.compute_loss(tr.model, self.inputs)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, GRAD_CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float(loss.detach())


def _timed(fn) -> tuple[float, float]:
    t0 = time.perf_counter()
    loss = fn()
    return time.perf_counter() - t0, loss


def main() -> str:
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model = os.environ.get("KAIZEN_BENCH_MODEL", TINY)
    if model == TINY and not os.path.exists(os.path.join(TINY, "config.json")):
        from services.common.tiny_model import build_tiny_model  # what `kaizen tiny-model` runs

        build_tiny_model(TINY)
    threads = int(os.environ.get("KAIZEN_BENCH_THREADS", "2"))
    batch = make_batch(AutoTokenizer.from_pretrained(model))
    with tempfile.TemporaryDirectory() as d:
        ours = Ours(model, batch, threads)
        trl = TRL(model, batch, d)
        trl.load_adapter(ours.adapter_state())
        torch.set_num_threads(threads)  # after both are built: nothing either constructor did may leave it different
        sides = {"ours": ours, "trl": trl}
        losses = {name: [] for name in sides}
        seconds = {name: [] for name in sides}
        for i in range(WARMUP + ROUNDS):
            for name, side in sides.items():
                s, loss = _timed(side.step)
                losses[name].append(loss)
                if i >= WARMUP:
                    seconds[name].append(s)
        optimizer = type(trl.optimizer).__name__ + (" fused" if trl.optimizer.defaults.get("fused") else "")

    med = {name: statistics.median(xs) for name, xs in seconds.items()}
    rows = []
    for name in sides:
        rows.append([name, f"{med[name] * 1e3:.0f}", f"{batch.completion_tokens / med[name]:.0f}",
                     f"{batch.total_tokens / med[name]:.0f}", f"{losses[name][0]:+.6f}", f"{losses[name][-1]:+.6f}"])
    speedup = f"{med['trl'] / med['ours']:.2f}"  # tokens are the same, so tok/s ours/trl = seconds trl/ours
    rows.append(["ours/trl", "", speedup, speedup, "", ""])
    out = table(
        f"One GRPO step (forward + backward + optimizer), ours (LearnerWorker) vs TRL GRPOTrainer (loss_type=dapo); "
        f"tiny model, float32 CPU, {threads} torch threads, {len(batch.prompts)} seqs = {len(PROMPTS)} prompts x "
        f"{GENERATIONS}, median of {ROUNDS} interleaved rounds after {WARMUP} warm-up",
        ["side", "ms/step", "completion tok/s", "total tok/s", "loss step 1", f"loss step {WARMUP + ROUNDS}"],
        rows,
    )
    out += (f"\n(batch: {batch.completion_tokens} completion + {batch.total_tokens - batch.completion_tokens} prompt tokens; "
            f"ours/trl: throughput ratio, >= 1.00 means ours is at least as fast; "
            f"TRL optimizer: its own create_optimizer(), {optimizer}; "
            f"both start from the same adapter, so the losses should agree step by step)")
    return out


if __name__ == "__main__":
    print(main())
