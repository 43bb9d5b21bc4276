"""A GPU check, by hand (CI has no GPU): the opd recipe's step (the teacher's top-k, the policy's logprobs
gathered in the learner's forward) on CUDA against the same step on the CPU in float32, then four
bfloat16 steps on CUDA. Run on a CUDA machine from the repository root (needs torch, transformers, peft,
pydantic and SQLAlchemy; no Ray, no model hub: it builds the tiny model):

    OUT=/tmp/out python tests/gpu/opd_cuda.py      # writes $OUT/cuda_hints.json and prints each run

Last run (2026-11-26, one NVIDIA H200, torch 2.11.0+cu130, transformers 5.17.0, peft 0.21.0): the first
step's figures on CUDA float32 equal the CPU's to 1e-7 (teacher_kl share 0.0677601 on both, loss
0.0447571), the four steps follow the same path, and bfloat16 stays within 0.3% of them (teacher_kl share
0.0679 -> 0.0237 over four steps, against 0.0678 -> 0.0237).
"""
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.getcwd())
from services.common.tiny_model import build_tiny_model  # noqa: E402
from services.trainer.batches import Norms, TrainItem  # noqa: E402
from services.trainer.learner import LearnerWorker  # noqa: E402

OUT = os.environ.get("OUT", "/tmp/out")
os.makedirs(OUT, exist_ok=True)
path = build_tiny_model("/tmp/tiny-hints")
PREFIX = [7, 11, 13, 17, 19, 23, 29, 31]
VOCAB = json.loads((path / "config.json").read_text())["vocab_size"]


def worker(device: str, dtype: str) -> LearnerWorker:
    w = LearnerWorker({"model": {"path": str(path), "dtype": dtype}, "trainer": {"device": device, "torch_threads": 2},
                       "algorithm": {"name": "opd", "opd": {"top_k": 16, "teacher": "base"}}, "lora": {"r": 8},
                       "optim": {"lr": 1e-3, "warmup_steps": 0}, "log_level": "warning"})
    w.setup()
    w.ensure_agent("a")
    return w


rng = random.Random(0)
items = []
for i in range(16):
    prompt = [rng.randrange(10, VOCAB - 1) for _ in range(rng.randrange(8, 24))]
    response = [rng.randrange(10, VOCAB - 1) for _ in range(rng.randrange(4, 12))]
    items.append(TrainItem(experience_id=f"e{i}", task_id=f"t{i}", model_version=0, prompt_ids=prompt,
                           response_ids=response, old_logprobs=[0.0] * len(response), reward=None, temperature=1.0,
                           teacher_prompt_ids=PREFIX + prompt))


def with_old(w: LearnerWorker) -> list[TrainItem]:
    """The items with their logprobs under the policy as it is (as if sampled by it), in float32 on the CPU."""
    from services.trainer.learner import _Scorer

    lp = _Scorer(w.policy, 0).logprobs([i.prompt_ids for i in items], [i.response_ids for i in items],
                                       [1.0] * len(items)).float().cpu()
    return [TrainItem(**{**i.__dict__, "old_logprobs": lp[k, :len(i.response_ids)].tolist()}) for k, i in enumerate(items)]


result = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
          "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
runs = {}
for device, dtype in (("cpu", "float32"), ("cuda", "float32"), ("cuda", "bfloat16")):
    if device == "cuda" and not torch.cuda.is_available():
        continue
    w = worker(device, dtype)
    batch = with_old(w)
    steps = []
    for step in range(4):
        t0 = time.perf_counter()
        st = w.train_step("a", batch, Norms.of(batch), step, 0)
        if device == "cuda":
            torch.cuda.synchronize()
        rec = {k: float(v) for k, v in st.objective.items()}
        rec["loss"], rec["seconds"] = float(st.loss), time.perf_counter() - t0
        steps.append(rec)
    runs[f"{device}-{dtype}"] = steps
    print(device, dtype, json.dumps(steps[0]), "->", json.dumps(steps[-1]), flush=True)
result["runs"] = runs
if "cuda-float32" in runs:
    a, b = runs["cpu-float32"][0], runs["cuda-float32"][0]
    result["first_step_cpu_vs_cuda_fp32"] = {k: (a[k], b[k]) for k in a if k != "seconds"}
with open(os.path.join(OUT, "cuda_hints.json"), "w") as f:
    json.dump(result, f, indent=1)
