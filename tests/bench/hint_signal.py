"""Does the agent, reading a hint, prefer what the hint asks? Scored on a `kaizen demo tools.words=hints`
run's own hinted calls: `python -m tests.bench.hint_signal RUN_FOLDER [--version 4] [--calls 40]`.

For each hinted call (first calls, then answer turns), with the run's adapter ``--version`` (the cold
start's by default): the log-probability of the right reply (the calculator call with the hint's
expression; "The answer is N." after its result) without and with the hint (the teacher's prompt the
Explorer rendered), and the same for the reply actually sampled, with the mean per-token gap (the
distillation advantage the Trainer gives those tokens), and the probability of the right reply's first
token (for a first call, the one that opens the calculator call) without and with the hint, and the
right reply's log-probability past that token (what a teacher could teach once the call is opened). A teacher
that prefers the right reply and disfavours the sampled one carries the signal self-distillation
needs; one that, reading the hint, is less sure to call the calculator at all teaches the agent to
answer in words.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sqlite3
import statistics
from pathlib import Path

import torch

from services.demo.tools_task import calculate, final_reply


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", type=Path, help="the run folder (with buffer.db, explorer.yaml, checkpoints/)")
    ap.add_argument("--version", type=int, default=4)
    ap.add_argument("--calls", type=int, default=40)
    args = ap.parse_args()
    import yaml
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    cfg = yaml.safe_load((args.run / "explorer.yaml").read_text())
    agent = cfg["agents"]["default"]
    tok = AutoTokenizer.from_pretrained(cfg["model"]["path"])
    base = AutoModelForCausalLM.from_pretrained(cfg["model"]["path"], dtype=torch.float32)
    model = PeftModel.from_pretrained(base, args.run / "checkpoints" / agent / f"v{args.version}").eval()
    db = sqlite3.connect(args.run / "buffer.db")
    call_text = tok.decode(next(json.loads(r[0]) for r in db.execute(
        "select response_token_ids from experiences where completion_id like 'demo-%' and response like '%tool_calls%' limit 1")))
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def logprobs(prompt: list[int], reply: list[int]) -> torch.Tensor:
        """Each reply token's log-probability after the prompt and the reply's tokens before it."""
        with torch.no_grad():
            logits = model(torch.tensor([prompt + reply])).logits[0, len(prompt) - 1: -1].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(reply).unsqueeze(-1)).squeeze(-1)

    rows = db.execute("select prompt_token_ids, hint, messages, response_token_ids from experiences "
                      "where hint is not null and hint != 'null' order by seq").fetchall()
    for turn in ("first calls", "answer turns"):
        out = []
        for prompt, hint, messages, sampled in rows:
            prompt, hint, messages, sampled = map(json.loads, (prompt, hint, messages, sampled))
            if any(m.get("role") == "tool" for m in messages) != (turn == "answer turns"):
                continue
            expr = re.search(r"expression (.+), then", hint["text"]).group(1)
            right = (tok.encode(re.sub(r'"expression": "[^"]*"', f'"expression": "{expr}"', call_text), add_special_tokens=False)
                     if turn == "first calls" else tok.encode(final_reply(calculate(expr)), add_special_tokens=False) + [end])
            teacher = hint["prompt_token_ids"]
            student, reading = logprobs(prompt, right), logprobs(teacher, right)
            out.append((student.sum().item(), reading.sum().item(), logprobs(prompt, sampled).sum().item(),
                        logprobs(teacher, sampled).sum().item(), len(sampled), student[0].item(), reading[0].item(),
                        student[1:].sum().item(), reading[1:].sum().item()))
            if len(out) >= args.calls:
                break
        if not out:
            print(f"{turn}: none hinted")
            continue
        med = lambda k: statistics.median(o[k] for o in out)  # noqa: E731
        print(f"{turn} ({len(out)} hinted, v{args.version}): right reply {med(0):.2f} without the hint, {med(1):.2f} "
              f"reading it (higher in {sum(o[1] > o[0] for o in out)}); sampled reply {med(2):.2f} without, {med(3):.2f} "
              f"reading it; mean per-token gap on the sampled tokens {sum(o[3] - o[2] for o in out) / sum(o[4] for o in out):+.3f}; "
              f"the right reply's first token ({tok.decode(right[:1])!r}) has probability {math.exp(med(5)):.2f} without the "
              f"hint, {math.exp(med(6)):.2f} reading it (lower in {sum(o[6] < o[5] for o in out)}); the right reply past "
              f"that token {med(7):.2f} without, {med(8):.2f} reading it (higher in {sum(o[8] > o[7] for o in out)})")


if __name__ == "__main__":
    main()
