"""An episode's calls scored in one row (trainer.chain_calls): the same step as one row per call, on the
real learner and the tiny model in float32: the same losses, statistics and updated adapter, from
fewer rows. Each episode's second call's prompt holds its first call, that call's response and a
tool's result, as the Explorer records a tool loop."""

from __future__ import annotations

import pytest
import torch

from services.trainer.batches import Norms, TrainItem
from services.trainer.learner import LearnerWorker
from services.trainer.policy import pack

pytestmark = pytest.mark.integration

AGENT = "calc"


def _episodes(tok) -> list[TrainItem]:
    items, seq = [], 0
    for task, question in enumerate(["What is 2 plus 3?", "What is 7 times 6?"]):
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                                    tokenize=False), add_special_tokens=False)
        for run, (call, answer, reward) in enumerate([("calc(2+3)", "It is 5.", 1.0), ("calc(2*3)", "It is 6.", 0.0)]):
            first = tok.encode(call, add_special_tokens=False)
            tool = tok.encode(f" result: {answer[6:-1]} ", add_special_tokens=False)
            second_prompt = prompt + first + tool
            for k, (p, r) in enumerate([(prompt, first), (second_prompt, tok.encode(answer, add_special_tokens=False))]):
                items.append(TrainItem(experience_id=f"{task}-{run}-{k}", task_id=str(task), model_version=0, prompt_ids=p,
                                       response_ids=r, old_logprobs=[-1.0] * len(r), reward=reward, temperature=1.0,
                                       seq=seq, advantage=1.0 if reward else -1.0, run_id=str(run)))
                seq += 1
    # the demonstrations of the mixed objective: one two-call episode as well
    demo = [TrainItem(experience_id=f"d-{k}", task_id=None, model_version=0, prompt_ids=it.prompt_ids,
                      response_ids=it.response_ids, old_logprobs=[], reward=None, temperature=1.0, seq=100 + k,
                      demonstration=True) for k, it in enumerate(items[:2])]
    return items + demo


def _worker(tiny_model, chain: bool, trainer: dict, algorithm: str = "grpo") -> LearnerWorker:
    w = LearnerWorker({"model": {"path": str(tiny_model), "dtype": "float32"}, "algorithm": {"name": algorithm},
                       "optim": {"lr": 1e-3}, "trainer": {"chain_calls": chain, **trainer}, "log_level": "warning"})
    w.setup()
    w.ensure_agent(AGENT)
    return w


# the defaults (one micro-batch; the chat prompts share fewer tokens than shared_prefix_min_tokens), then
# micro-batches of 2 rows, each with its shared prefix split off and computed once
@pytest.mark.parametrize("trainer", [{}, {"micro_batch_size": 2, "shared_prefix_min_tokens": 1}], ids=["defaults", "prefix-split"])
def test_chained_calls_train_exactly_as_one_row_each(tiny_model, trainer):
    plain, chained = _worker(tiny_model, False, trainer), _worker(tiny_model, True, trainer)
    items = _episodes(chained.policy.tokenizer)
    rollouts = [i for i in items if not i.demonstration]
    start = {k: v.clone() for k, v in plain.policy.adapter_state(AGENT).items()}
    assert all(torch.equal(start[k], v) for k, v in chained.policy.adapter_state(AGENT).items())  # the same seed

    # the chained layout: each episode one row (4 episodes), the demonstrations' episode one row
    chunks = chained._length_chunks(rollouts)
    assert sum(len(c) for c in chunks) == len(rollouts)
    assert sum(chained._pack(c).input_ids.shape[0] for c in chunks) == 4
    assert len(chunks) == (1 if not trainer else 2)
    if trainer:
        assert all(chained._pack(c).prefix_len > 0 for c in chunks)
    assert plain._pack(rollouts).input_ids.shape[0] == 8 and plain._pack(rollouts).chain is None

    # the calls' order may differ by micro-batch: compare each call's own logprobs
    by_id = lambda w: {it.experience_id: lp[row, : len(it.response_ids)]  # noqa: E731
                       for chunk, (lp, _) in zip(w._length_chunks(rollouts), w._sampled_logprobs(rollouts))
                       for row, it in enumerate(chunk)}
    pa, pb = by_id(plain), by_id(chained)
    assert len(pa) == len(pb) == len(rollouts)
    for k in pa:
        torch.testing.assert_close(pb[k], pa[k], atol=1e-5, rtol=1e-5)

    sa = plain.train_step(AGENT, items, Norms.of(items), 0, 0)
    sb = chained.train_step(AGENT, items, Norms.of(items), 0, 0)
    for f in ("loss", "entropy_sum", "tokens", "demo_nll", "mismatch_sum", "grad_norm"):
        assert getattr(sb, f) == pytest.approx(getattr(sa, f), rel=1e-4, abs=1e-5), f
    # the same gradient (compared before Adam, whose first step maps a gradient element's sign, float noise
    # included, to a full lr-sized move), and an update made from it
    grads_a = [q.grad for q in plain.policy.adapter_parameters(AGENT)]
    grads_b = [q.grad for q in chained.policy.adapter_parameters(AGENT)]
    assert len(grads_a) == len(grads_b) and any(float(g.abs().max()) > 0 for g in grads_a)
    for ga, gb in zip(grads_a, grads_b):
        torch.testing.assert_close(gb, ga, atol=1e-6, rtol=1e-4)
    after = plain.policy.adapter_state(AGENT)
    assert any(not torch.equal(start[k], after[k]) for k in start)


def test_a_chained_forward_gives_what_one_row_per_call_gives(tiny_model):
    """Grammar masks, gathered ids (a hint's top-k term), the k likeliest tokens and the critic's hidden
    states come out of a chained forward as out of the plain layout, and so do the gradients through them."""
    p = _worker(tiny_model, True, {}).policy
    torch.manual_seed(0)
    with torch.no_grad():  # a trained adapter (a new one's B is 0: with the adapter off, the same model)
        for name, q in p.model.named_parameters():
            if "lora_B" in name:
                q.normal_(0.0, 0.05)
    items = [i for i in _episodes(p.tokenizer) if not i.demonstration]
    args = ([i.prompt_ids for i in items], [i.response_ids for i in items], [0.7] * len(items), p.pad_id)
    plain, chained = pack(*args), pack(*args, chain=True)
    assert plain.chain is None and chained.chain is not None and chained.input_ids.shape[0] == 4
    (B, R), V = plain.response_ids.shape, p.base.config.vocab_size
    g = torch.Generator().manual_seed(0)
    allowed = torch.rand(B, R, V, generator=g) < 0.5
    gather = torch.randint(0, V, (B, R, 3), generator=g)
    allowed.scatter_(-1, plain.response_ids.unsqueeze(-1), True).scatter_(-1, gather, True)  # the sampled and gathered ids allowed
    mask = plain.response_mask
    results = []
    for batch in (plain, chained):
        params = p.adapter_parameters(AGENT)
        for q in params:
            q.grad = None
        out = p.forward(batch, need_hidden=True, allowed=allowed, gather=gather, top_k=4, entropy_grad=True)
        loss = ((out.logprobs + out.entropy) * mask).sum() + (out.gathered.sum(-1) * mask).sum() \
            + (out.hidden.sum(-1) * mask).sum() * 1e-2
        loss.backward()
        results.append((out, [q.grad.clone() for q in params]))
    (a, grads_a), (b, grads_b) = results
    # both run the body, then the LM head on the response tokens alone: the plain one against the model's own logits
    with torch.no_grad():
        logits = p.model(**p._inputs(plain), logits_to_keep=R + 1).logits[:, :R].float() / 0.7
        want = torch.log_softmax(logits.masked_fill(~allowed, float("-inf")), -1).gather(-1, plain.response_ids.unsqueeze(-1))
    torch.testing.assert_close(a.logprobs.detach() * mask, want.squeeze(-1) * mask, atol=1e-5, rtol=1e-5)
    p.chains = False  # as for a model whose forward changes its logits after the head: its own forward, no chains
    with torch.no_grad():
        own = p.forward(plain, need_hidden=True, allowed=allowed, gather=gather, top_k=4)
        with pytest.raises(ValueError, match="not the LM head's product"):
            p.forward(chained, need_hidden=False)
    p.chains = True
    for x, y in [(own.logprobs, a.logprobs), (own.entropy, a.entropy)]:
        torch.testing.assert_close(x * mask, y.detach() * mask, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(own.gathered * mask.unsqueeze(-1), a.gathered.detach() * mask.unsqueeze(-1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(own.hidden * mask.unsqueeze(-1), a.hidden.detach() * mask.unsqueeze(-1), atol=1e-5, rtol=1e-5)
    m3 = mask.unsqueeze(-1)
    for name, x, y in [("logprobs", a.logprobs * mask, b.logprobs * mask), ("entropy", a.entropy * mask, b.entropy * mask),
                       ("gathered", a.gathered * m3, b.gathered * m3), ("hidden", a.hidden * m3, b.hidden * m3),
                       ("top", a.top[0] * m3, b.top[0] * m3)]:
        torch.testing.assert_close(y, x, atol=1e-5, rtol=1e-5, msg=name)
    assert float((a.logprobs * mask).abs().sum()) > 0 and any(float(g.abs().max()) > 0 for g in grads_a)
    for ga, gb in zip(grads_a, grads_b):  # float32 sums in another order: within 1e-5 of each tensor's largest element
        torch.testing.assert_close(gb, ga, atol=1e-5 * float(ga.abs().max()), rtol=1e-4)
    # the reference policy (the adapter off: the KL term) as well, and it differs from the policy
    with torch.no_grad():
        ref_a, ref_b = (p.forward(batch, need_hidden=False, adapter=False).logprobs * mask for batch in (plain, chained))
    torch.testing.assert_close(ref_b, ref_a, atol=1e-5, rtol=1e-5)
    assert float((ref_a - a.logprobs.detach() * mask).abs().max()) > 1e-3


def test_a_critics_step_chained_is_the_same_step(tiny_model):
    """PPO (a value head on the calls' hidden states, whole episodes per micro-batch): the same loss,
    value loss and gradients, policy and critic, from one row per episode."""
    plain, chained = _worker(tiny_model, False, {}, "ppo"), _worker(tiny_model, True, {}, "ppo")
    items = [i for i in _episodes(chained.policy.tokenizer) if not i.demonstration]
    assert [chained._pack(c).input_ids.shape[0] for c in chained._micro_batches(items)] == [4]
    for w in (plain, chained):  # the same value head on both (each worker drew its own)
        w.policy.value_heads[AGENT].load_state_dict(plain.policy.value_heads[AGENT].state_dict())
    sa = plain.train_step(AGENT, items, Norms.of(items), 0, 0)
    sb = chained.train_step(AGENT, items, Norms.of(items), 0, 0)
    assert "value_loss" in sa.objective
    for f in ("loss", "entropy_sum", "tokens", "grad_norm"):
        assert getattr(sb, f) == pytest.approx(getattr(sa, f), rel=1e-4, abs=1e-5), f
    for k, v in sa.objective.items():
        assert sb.objective[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k
    for part in (lambda w: w.policy.adapter_parameters(AGENT), lambda w: list(w.policy.value_heads[AGENT].parameters())):
        ga, gb = [q.grad for q in part(plain)], [q.grad for q in part(chained)]
        assert ga and all(g is not None for g in ga + gb) and any(float(g.abs().max()) > 0 for g in ga)
        for x, y in zip(ga, gb):
            torch.testing.assert_close(y, x, atol=1e-6, rtol=1e-4)


def test_a_chained_batch_without_response_tokens_still_gives_every_output(tiny_model):
    p = _worker(tiny_model, True, {}).policy
    batch = pack([[1, 2, 3], [1, 2, 3, 4]], [[], []], [1.0, 1.0], p.pad_id, chain=True)
    assert batch.chain is not None and tuple(batch.response_ids.shape) == (2, 0)
    out = p.forward(batch, need_hidden=True, gather=torch.zeros(2, 0, 3, dtype=torch.long), top_k=2)
    assert tuple(out.logprobs.shape) == (2, 0) and tuple(out.gathered.shape) == (2, 0, 3)
    assert tuple(out.top[0].shape) == (2, 0, 2) and tuple(out.hidden.shape[:2]) == (2, 0)
    (out.logprobs.sum() + out.gathered.sum()).backward()  # a loss over nothing still backpropagates
