"""LearnableAgent: the MARSYS surface on a local tiny model, a recorded ReAct tool loop, learning
through the real Trainer, and the same agent run through a real Explorer."""

from __future__ import annotations

import json

import pytest
import torch

from services.agents import LearnableAgent, LearnableAgentError
from services.common import buffer, checkpoints
from services.common.checkpoints import CheckpointError
from tests.integration.adapters import train_reply_adapter

pytestmark = pytest.mark.integration

TASK = "What is the value of a?"
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "a"}}\n</tool_call>'
HEAD = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "bias": "none",
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
looked_up: list[str] = []


def lookup(key: str) -> str:
    """Look a key up in the table.

    Args:
        key: The key to look up.
    """
    looked_up.append(key)
    return f"value of {key} is 42"


def _agent(tiny_model, tmp_path, **kw) -> LearnableAgent:
    args = dict(model_config={"name": str(tiny_model)}, name="helper", goal="Answer from the table.",
                instruction="Use the lookup tool.", tools={"lookup": lookup}, learning_head="peft",
                learning_head_config=HEAD, workdir=tmp_path / "agent", max_tokens=24)
    return LearnableAgent(**{**args, **kw})


@pytest.fixture(scope="module")
def calling_adapter(tiny_model, tmp_path_factory):
    """An adapter (trained with plain peft) that answers TASK with a call of lookup(key="a")."""
    probe = _agent(tiny_model, tmp_path_factory.mktemp("probe"))
    messages = [*probe._system(), {"role": "user", "content": TASK}]
    out = tmp_path_factory.mktemp("adapter") / "calls-lookup"
    train_reply_adapter(tiny_model, messages, CALL, tools=probe.tool_schemas).save_pretrained(out)
    probe.close()
    return out


def test_marsys_surface_and_a_recorded_tool_loop(tiny_model, tmp_path, calling_adapter):
    from peft import PeftModel

    agent = _agent(tiny_model, tmp_path, temperature=0.0, max_steps=2)
    assert isinstance(agent.model.trainable_model, PeftModel)
    assert agent.model.base_model.config.hidden_size == 256 and agent.model.tokenizer.eos_token
    assert agent.tool_schemas[0]["function"]["parameters"]["properties"]["key"]["type"] == "string"
    agent.load_adapter(calling_adapter)
    looked_up.clear()
    agent.run(TASK, task_id="t1", run_id="0")
    assert looked_up == ["a"]  # the model called the tool; the agent ran it
    run = agent.last_run
    assert [m["role"] for m in run.messages][:5] == ["system", "user", "assistant", "tool", "assistant"]
    assert run.messages[3]["content"] == "value of a is 42"

    db = buffer.create_buffer_engine(agent.buffer_url)
    rows = [buffer.get_experience(engine=db, experience_id=e) for e in run.experience_ids]
    db.dispose()
    assert len(rows) == 2 and all((r.task_id, r.run_id, r.agent) == ("t1", "0", "helper") for r in rows)
    first, second = rows
    assert first.response["tool_calls"][0]["function"] == {"name": "lookup", "arguments": json.dumps({"key": "a"})}
    assert first.finish_reason == "tool_calls" and first.tools == agent.tool_schemas
    assert second.messages[-1] == {"role": "tool", "tool_call_id": first.response["tool_calls"][0]["id"],
                                   "name": "lookup", "content": "value of a is 42"}
    # the recorded logprobs are the model's, token for token (teacher-forced check)
    for row in rows:
        ids = torch.tensor([row.prompt_token_ids + row.response_token_ids])
        with torch.no_grad():
            logits = agent.model.trainable_model(input_ids=ids).logits[0, len(row.prompt_token_ids) - 1: -1].float()
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(row.response_token_ids)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(row.response_logprobs), expected, atol=1e-4, rtol=1e-4)

    # a hint alone: each call keeps the teacher's prompt, its conversation and the note, by the same template
    with pytest.raises(LearnableAgentError, match="needs a reward, a non-empty hint or a correction"):
        agent.feedback(hint=" ")
    assert agent.feedback(hint="Look the key up first.", commit=False) == 2
    db = buffer.create_buffer_engine(agent.buffer_url)
    hinted = [buffer.get_experience(engine=db, experience_id=e) for e in run.experience_ids]
    db.dispose()
    for row in hinted:
        assert row.reward is None and row.status.value == "rewarded" and row.hint["source"] == "learnable-agent"
        teacher = agent.model.tokenizer.decode(row.hint["prompt_token_ids"])
        assert teacher.startswith(agent.model.tokenizer.decode(row.prompt_token_ids).rsplit("<|im_start|>", 1)[0])
        assert "A note on how to answer, from a reviewer: Look the key up first." in teacher

    # a correction of the run's second call (its answer): a demonstration of that very prompt, linked and labelled
    answer = {"role": "assistant", "content": "The value of a is 42."}
    with pytest.raises(LearnableAgentError, match="correction of call 2: this run made 2 call"):
        agent.feedback(correction=answer, call=2)
    with pytest.raises(LearnableAgentError, match="^correction.tool_calls.0 calls unknown tool 'search'"):
        agent.feedback(correction={"tool_calls": [{"function": {"name": "search", "arguments": {"q": "a"}}}]})
    with pytest.raises(LearnableAgentError, match="correction: a reply needs content or tool_calls"):
        agent.feedback(correction={"role": "assistant"})
    db = buffer.create_buffer_engine(agent.buffer_url)
    assert buffer.fetch_committed(engine=db, agent="helper", limit=10, demonstrations=True) == []  # nothing stored
    with pytest.raises(LearnableAgentError, match="a hint must not be empty"):
        agent.feedback(hint=" ", correction=answer)
    assert agent.feedback(correction=answer, call=-1, commit=False) == 0  # the last call; no reward, no hint: as they were
    (demo,) = buffer.fetch_committed(engine=db, agent="helper", limit=10, demonstrations=True)
    corrected = buffer.get_experience(engine=db, experience_id=run.experience_ids[1])
    db.dispose()
    assert demo.feedback["corrects"] == corrected.experience_id and demo.feedback["prompt_as_recorded"] is True
    assert demo.feedback["labels"] == ["demonstration", "correction"] and demo.prompt_token_ids == corrected.prompt_token_ids
    tok = agent.model.tokenizer
    assert tok.decode(demo.response_token_ids).startswith("The value of a is 42.") and demo.response_logprobs == []
    assert demo.response_token_ids[-1] == tok.eos_token_id and corrected.hint["text"] == "Look the key up first."

    agent.save_pretrained(tmp_path / "saved")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "saved").iterdir()}
    agent.close()


def test_learn_trains_with_the_trainers_objective_and_loads_the_result(tiny_model, tmp_path, ray_address):
    agent = _agent(tiny_model, tmp_path, tools=None, max_steps=1)
    with pytest.raises(LearnableAgentError, match="no run to reward yet"):
        agent.feedback(1.0)
    for task in range(4):
        for run in range(4):  # a GRPO group: four runs of one task
            answer = agent.run(f"Say a word about topic {task}.", task_id=f"topic-{task}", run_id=str(run))
            agent.feedback(float(len(answer or "") % 2))  # any reward with some spread
    with pytest.raises(LearnableAgentError, match="16 committed experiences, and a step trains on train_batch_size=32"):
        agent.learn(1, ray_address=ray_address, train_batch_size=32)
    before = {k: v.clone() for k, v in agent.model.trainable_model.state_dict().items() if "lora_B" in k}
    version = agent.learn(1, ray_address=ray_address, optim={"lr": 1e-2})
    assert version == 2  # v1: the weights it started from (published first), v2: the Trainer's step
    root = agent.checkpoints_root
    assert checkpoints.validate_version(root, "helper", 1).manifest()["source"] == "publish"
    assert checkpoints.validate_version(root, "helper", 2).manifest()["algorithm"] == "grpo"
    after = {k: v for k, v in agent.model.trainable_model.state_dict().items() if "lora_B" in k}
    assert any(not torch.equal(before[k], after[k]) for k in before)  # the loaded result is the trained adapter
    from safetensors.torch import load_file

    published = load_file(str(checkpoints.version_dir(root, "helper", 2) / "adapter_model.safetensors"))
    b_key = next(k for k in published if "lora_B" in k)
    live = next(v for k, v in after.items() if k.replace(".default", "") == b_key)
    torch.testing.assert_close(live, published[b_key])
    db = buffer.create_buffer_engine(agent.buffer_url)
    assert buffer.count_by_status(engine=db, agent="helper").get("consumed") == 16
    db.dispose()
    agent.close()


def test_the_same_agent_through_an_explorer(explorer, tmp_path):
    agent = LearnableAgent(model_config={"name": "unused"}, name="default", instruction="Be brief.",
                           tools={"lookup": lookup}, endpoint=explorer.url, max_tokens=8)
    agent.run(TASK, task_id="remote", run_id="1")
    assert agent.feedback(1.0) == len(agent.last_run.experience_ids) >= 1
    rows = explorer.http.get("/experiences", params={"task_id": "remote"}).json()["data"]
    assert {(r["run_id"], r["reward"], r["status"]) for r in rows} == {("1", 1.0, "committed")}
    agent.run(TASK, task_id="remote", run_id="2")
    agent.feedback(hint="Use the lookup tool.")
    hinted = explorer.http.get("/experiences", params={"task_id": "remote"}).json()["data"]
    assert {(r["run_id"], r["reward"], (r["hint"] or {}).get("text")) for r in hinted} == {
        ("1", 1.0, None), ("2", None, "Use the lookup tool.")}
    assert rows[0]["tools"][0]["function"]["name"] == "lookup"
    # a correction of run 2's first call, through the Explorer: a demonstration of its prompt
    with pytest.raises(LearnableAgentError, match="/feedback answered 400: correction.tool_calls.0 calls unknown tool 'search'"):
        agent.feedback(correction={"tool_calls": [{"function": {"name": "search", "arguments": {"q": "a"}}}]}, commit=False)
    for _ in range(2):  # sent again (a retry): stored once, under the same idempotency key
        assert agent.feedback(correction={"tool_calls": [{"function": {"name": "lookup", "arguments": {"key": "a"}}}]},
                              commit=False) == 0
    corrections = [r for r in explorer.http.get("/experiences", params={"task_id": "remote"}).json()["data"]
                   if "correction" in ((r.get("feedback") or {}).get("labels") or [])]
    assert [(c["feedback"]["corrects"], c["response"]["tool_calls"][0]["function"]["arguments"]) for c in corrections] == [
        (agent.last_run.experience_ids[0], json.dumps({"key": "a"}))]
    with pytest.raises(LearnableAgentError, match="its weights are there"):
        agent.model
    with pytest.raises(LearnableAgentError, match="learns through the service"):
        agent.learn(1)
    agent.close()


def _undocumented(key: str) -> str:
    return key


@pytest.mark.parametrize("kw, message", [
    ({"learning_head": "full"}, "learning_head 'full' is not supported"),
    ({"learning_head_config": {"rank": 8}}, r"unknown keys \['rank'\]"),
    ({"learning_head_config": {"bias": "all"}}, "bias must be 'none'"),
    ({"tools": {"t": _undocumented}}, "tool 't' needs type hints and a docstring"),
    ({"name": "no/slash"}, "invalid agent name"),
    ({"model_config": {}}, "model_config needs 'name'"),
])
def test_bad_setups_get_clear_errors(kw, message, tiny_model, tmp_path):
    args = {"model_config": {"name": str(tiny_model)}, "name": "helper", "workdir": tmp_path, **kw}
    with pytest.raises((LearnableAgentError, CheckpointError), match=message):
        LearnableAgent(**args)
