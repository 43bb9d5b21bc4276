"""Runner SDK quickstart, with nothing but the SDK installed (no torch, no openai package).

    python -m runner_sdk.examples.quickstart http://127.0.0.1:8010 [agent]

Shadow mode: production answers come from elsewhere; each selected question is replayed twice
against the Explorer in the background, rewarded, and committed for training.
"""

from __future__ import annotations

import sys

from runner_sdk import ExactMatch, SamplingRate, TrainingRunner


async def agent(client, question: str) -> str:
    return await client.complete([{"role": "user", "content": question}], max_tokens=8)


def main(endpoint: str, model: str = "default") -> None:
    runner = TrainingRunner(endpoint=endpoint, model=model, mode="shadow", agent=agent, repeat=2,
                            selection=SamplingRate(1.0), reward=ExactMatch(), commit_interval=5)
    with runner:
        for question, answer in [("Capital of France?", "Paris"), ("2 + 2?", "4"), ("Colour of the sky?", "blue")]:
            production_answer = answer  # what the production model said; the app never waits on Kaizen
            runner.shadow(question, expected=production_answer)
    s = runner.stats
    print(f"shadow runs {s.shadow_runs}, feedback sent {s.feedback_sent}, committed {s.committed}, dropped {s.feedback_dropped}")


if __name__ == "__main__":
    main(*sys.argv[1:])
