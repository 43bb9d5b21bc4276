"""Two agents on one base model acting in one episode, with nothing but the SDK installed.

    python -m runner_sdk.examples.two_agents http://127.0.0.1:8010 [tasks] [runs]

A proposer answers "Is N even or odd?"; a verifier reads the proposal and gives the final answer.
Both calls carry the same task_id + run_id, so they form one episode; each call names its own agent
(`model`), so each is recorded for, and trains, that agent's adapter. The team reward (is the final
answer right?) reaches both agents' calls; the proposer also gets its own reward (was its proposal
right?), sent with `agent=`. Each task is played `runs` times (a GRPO group) and then committed.

Pair it with configs/examples/two-agents-explorer.yaml and configs/examples/two-agents-trainer.yaml
(the Trainer trains them agent by agent: trainer.schedule.mode=round_robin).
"""

from __future__ import annotations

import asyncio
import random
import sys

from runner_sdk import ExplorerClient


def _says(text: str) -> str | None:
    words = text.lower()
    even, odd = "even" in words, "odd" in words
    return "even" if even and not odd else "odd" if odd and not even else None


async def episode(client: ExplorerClient, n: int, run: int) -> tuple[float, float]:
    ids = {"task_id": f"parity-{n}", "run_id": str(run)}
    question = f"Is {n} even or odd?"
    truth = "even" if n % 2 == 0 else "odd"
    proposed = await client.chat_completions(model="proposer", messages=[{"role": "user", "content": question}],
                                             max_tokens=6, metadata=ids)
    proposal = proposed["choices"][0]["message"]["content"] or ""
    checked = await client.chat_completions(
        model="verifier", max_tokens=6, metadata=ids,
        messages=[{"role": "user", "content": f"{question} A colleague says: {proposal!r}. Answer even or odd."}])
    team = float(_says(checked["choices"][0]["message"]["content"] or "") == truth)
    own = float(_says(proposal) == truth)
    await client.episode_feedback(reward=team, **ids)  # the team reward: every call of the episode
    await client.episode_feedback(reward=own, agent="proposer", **ids)  # the proposer's own, on its calls only
    return team, own


async def main(endpoint: str, tasks: int = 8, runs: int = 4) -> None:
    client = ExplorerClient(endpoint, timeout=120)
    rng = random.Random(0)
    team = own = 0.0
    try:
        for n in rng.sample(range(10, 100), tasks):
            results = await asyncio.gather(*(episode(client, n, run) for run in range(runs)))
            team += sum(t for t, _ in results)
            own += sum(o for _, o in results)
            await client.commit(task_id=f"parity-{n}")
    finally:
        await client.aclose()
    played = tasks * runs
    print(f"episodes {played}: team reward {team / played:.2f}, proposer's own reward {own / played:.2f}")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], *map(int, sys.argv[2:])))
