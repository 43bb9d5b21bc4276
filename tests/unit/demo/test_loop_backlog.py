"""The online loop pauses traffic on the Trainer's backlog of rollouts, not on demonstrations (which
stay committed for good: a correction is one, so counting them paused the corrections run for ever)."""

from __future__ import annotations

from types import SimpleNamespace

from services.common import buffer
from services.common.records import Experience, ExperienceStatus
from services.demo.loop import OnlineLoop


def _row(cid: str) -> Experience:
    return Experience(experience_id=f"{cid}-0", completion_id=cid, agent="calc", model_version=0, task_id="t",
                      prompt_token_ids=[1], response_token_ids=[2], response_logprobs=[], messages=[], response={},
                      sampling={}, status=ExperienceStatus.COMMITTED)


def test_demonstrations_and_corrections_never_fill_the_backlog(tmp_path):
    db = buffer.create_buffer_engine(f"sqlite:///{tmp_path}/b.db")
    loop = OnlineLoop(SimpleNamespace(), SimpleNamespace(agent="calc"), start_version=0, max_backlog=4,
                      one_round=None)
    buffer.insert_experiences(engine=db, records=[_row(f"demo-{k}") for k in range(10)])  # demonstrations, corrections
    assert not loop.backlog_full(db)
    buffer.insert_experiences(engine=db, records=[_row(f"chatcmpl-{k}") for k in range(3)])
    assert not loop.backlog_full(db)
    buffer.insert_experiences(engine=db, records=[_row("chatcmpl-3")])  # the fourth rollout waiting
    assert loop.backlog_full(db)
    db.dispose()
