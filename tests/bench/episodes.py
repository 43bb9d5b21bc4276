"""`make bench` section episodes: the demo's Trainer step on two-call episodes, each episode's calls
scored in one row (trainer.chain_calls, the default) against one row per call, side by side; and where
trainer.attention's auto picks plain products (bfloat16 on a CPU), the chained step on torch's SDPA.

    python -m tests.bench.run episodes      # KAIZEN_BENCH_ROUNDS=3 KAIZEN_BENCH_THREADS=1

The batch is shaped as the demo's (services/demo/tools_demo.py): SmolLM2-135M-Instruct in the demo's
Trainer dtype (bfloat16 where its products run at least as fast as float32's, else float32:
tools_demo.trainer_dtype), LoRA r=16, lr 1e-3, micro-batches of 8 rows, one torch thread (the demo's
Trainer), GRPO over 2 questions x 8 runs of two calls (the calculator call, then the answer after the tool's result: 32 calls), 4 demonstrations replayed (the
mixed objective) and the guard scoring the 16 demonstrations around the update. Every call is rendered
by the model's chat template with the calculator tool, as the Explorer's /demonstrations renders
one (services/explorer/serving/demonstrations.py), so an episode's second prompt holds its first call
token for token. The workers start from the same adapter; rounds alternate them. A last line times the
chained step on the same batch with its first group flat (all 8 runs right: advantage 0), its calls scored
without gradients (the default) against a backward for them too (`trainer.inert_backward`).
"""

from __future__ import annotations

import os
import random
import statistics
import time

from services.demo import tools_task
from services.demo.tools_demo import trainer_dtype
from services.trainer.batches import Norms, TrainItem
from services.trainer.learner import LearnerWorker
from tests.bench.common import table
from tests.bench.smollm2 import MODEL, spread

AGENT = "calculator"


def _render(tok, turn: dict) -> tuple[list[int], list[int]]:
    prompt = tok.apply_chat_template(turn["messages"], tools=turn["tools"], add_generation_prompt=True, tokenize=False)
    full = tok.apply_chat_template([*turn["messages"], turn["response"]], tools=turn["tools"], tokenize=False)
    reply = tok.encode(full[len(prompt):], add_special_tokens=False)
    if tok.eos_token_id in reply:
        reply = reply[: len(reply) - reply[::-1].index(tok.eos_token_id)]
    return tok.encode(prompt, add_special_tokens=False), reply


def _episodes(tok, tasks: int, *, runs: int, seed: int, flat: int = 0) -> list[TrainItem]:
    """``runs`` episodes of each of ``tasks`` groups, rewarded at random, advantages around the group's
    mean; the first ``flat`` groups' runs all rewarded 1 (advantage 0). Every episode is a different
    problem (sampled runs differ; identical ones would share a row)."""
    rng, items = random.Random(seed), []
    for task in range(tasks):
        rewards = [float(rng.random() < 0.5) for _ in range(runs)]
        if task < flat:
            rewards = [1.0] * runs
        mean = statistics.fmean(rewards)
        for run, reward in enumerate(rewards):
            for turn in tools_task.demonstration_turns(tools_task.make_problem(rng)):
                prompt, reply = _render(tok, turn)
                items.append(TrainItem(experience_id=f"{task}-{run}-{len(items)}", task_id=str(task), model_version=0,
                                       prompt_ids=prompt, response_ids=reply, old_logprobs=[-0.5] * len(reply),
                                       reward=reward, temperature=1.0, seq=len(items), advantage=reward - mean,
                                       run_id=str(run), weight=0.5))
    return items


def _demonstrations(tok, n: int) -> list[TrainItem]:
    out = []
    for k, turn in enumerate(tools_task.demonstrations(n)):
        prompt, reply = _render(tok, turn)
        out.append(TrainItem(experience_id=f"demo-{k}", task_id=None, model_version=0, prompt_ids=prompt, response_ids=reply,
                             old_logprobs=[], reward=None, temperature=1.0, seq=1000 + k, demonstration=True))
    return out


# the layouts and attentions compared: (chain_calls, trainer.attention, trainer.inert_backward)
CHAINED, PLAIN, SDPA, INERT = (True, "auto", False), (False, "auto", False), (True, "sdpa", False), (True, "auto", True)
LABELS = {CHAINED: "chained (trainer.chain_calls)", PLAIN: "one row per call", SDPA: "chained, torch's SDPA attention",
          INERT: "chained, a backward for the flat group too (trainer.inert_backward)"}


def main() -> str:
    rounds = int(os.environ.get("KAIZEN_BENCH_ROUNDS", 3))
    threads = int(os.environ.get("KAIZEN_BENCH_THREADS", 1))
    dtype = trainer_dtype()
    workers = {}
    for chain, attention, inert in (CHAINED, PLAIN, SDPA, INERT):
        if (chain, attention, inert) == SDPA and workers[CHAINED].policy.attention == "sdpa":
            continue  # auto is SDPA here (float32, or a GPU): nothing to compare
        w = LearnerWorker({"model": {"path": MODEL, "dtype": dtype}, "algorithm": {"name": "grpo", "kl_metric": False},
                           "lora": {"r": 16, "alpha": 32}, "optim": {"lr": 1e-3}, "log_level": "warning",
                           "trainer": {"micro_batch_size": 8, "torch_threads": threads, "chain_calls": chain,
                                       "attention": attention, "inert_backward": inert}})
        w.setup()
        w.ensure_agent(AGENT)
        workers[(chain, attention, inert)] = w
    tok = workers[CHAINED].policy.tokenizer
    rollouts = _episodes(tok, 2, runs=8, seed=0)
    guard = _demonstrations(tok, 16)
    items = rollouts + guard[:4]
    # the same, its first group's runs all right: no signal (in the demo's loop 20 of 50 groups, 11-29)
    flat = _episodes(tok, 2, runs=8, seed=0, flat=1) + guard[:4]
    times: dict[tuple, list[float]] = {k: [] for k in workers}
    flat_times: list[float] = []
    for r in range(rounds + 1):  # the first round warms them up
        sides = [*[(k, items) for k in workers if k != INERT], (CHAINED, flat), (INERT, flat)]
        for k, batch in (sides if r % 2 == 0 else sides[::-1]):
            t0 = time.perf_counter()
            workers[k].train_step(AGENT, batch, Norms.of(batch), r, 0, guard=guard)
            if r:
                (flat_times if batch is flat and k == CHAINED else times[k]).append(time.perf_counter() - t0)
    shown = [k for k in workers if k != INERT]
    rows_of = {k: sum(workers[k]._pack(c).input_ids.shape[0] for c in workers[k]._length_chunks(rollouts)) for k in shown}
    tokens = {k: sum(int(workers[k]._pack(c).attention_mask.sum()) + (workers[k]._pack(c).prefix_len or 0)
                     for c in workers[k]._length_chunks(rollouts)) for k in shown}
    rows = [[LABELS[k], workers[k].policy.attention, rows_of[k], tokens[k], spread([t * 1000 for t in times[k]])]
            for k in shown]
    out = table(f"The demo's Trainer step on SmolLM2 ({dtype}, {threads} thread(s)): {len(rollouts)} calls in "
                f"{len(rollouts) // 2} two-call episodes + 4 demonstrations, guard on 16; median (min..max) of {rounds} "
                f"alternating rounds after a warm-up", ["layout", "attention", "rollout rows", "rollout tokens run", "ms/step"],
                rows)

    def paired(slow: tuple, fast: tuple) -> str:
        return spread([b / a for a, b in zip(times[fast], times[slow])], "{:.2f}")

    out += f"\none row per call / chained, paired by round: {paired(PLAIN, CHAINED)}x"
    out += (f"\none of the two groups flat (its 16 calls advantage 0), chained: {spread([t * 1000 for t in flat_times])} ms/step "
            f"scored without gradients (the default) against {spread([t * 1000 for t in times[INERT]])} with a backward "
            f"(trainer.inert_backward), paired by round: "
            f"{spread([b / a for a, b in zip(flat_times, times[INERT])], '{:.2f}')}x")
    if SDPA in workers:
        out += f"\nchained: SDPA / {workers[CHAINED].policy.attention} attention (trainer.attention auto), paired by round: " \
               f"{paired(SDPA, CHAINED)}x"
    return out


if __name__ == "__main__":
    print(main())
