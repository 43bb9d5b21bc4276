"""Chaining an episode's calls into one row (policy.chain_rows, pack(chain=True)): which calls share a
row, and where each call's response positions sit in it. Worked by hand on short token lists."""

from __future__ import annotations

import torch

from services.trainer.policy import chain_rows, head_is_last, pack

# an episode: call 0 (prompt [1 2 3], response [4 5]), then the tool's result [6] and call 1
# (prompt [1 2 3 4 5 6], response [7 8 9]); call 2 is unrelated; call 3 repeats call 0's prompt
# with another response (a GRPO sibling: not inside call 1)
PROMPTS = [[1, 2, 3], [1, 2, 3, 4, 5, 6], [1, 2, 9], [1, 2, 3]]
RESPONSES = [[4, 5], [7, 8, 9], [3], [4, 7]]


def test_a_call_inside_another_shares_its_row_and_nothing_else_does():
    assert chain_rows(PROMPTS, RESPONSES, [1.0] * 4) == [[1, 0], [2], [3]]  # rows by their longest call's index


def test_a_call_at_another_temperature_keeps_its_own_row():
    assert chain_rows(PROMPTS, RESPONSES, [0.7, 1.0, 1.0, 1.0]) == [[0], [1], [2], [3]]


def test_a_call_equal_to_the_start_of_a_longer_response_is_inside_it():
    # call 1 answered [4 5 6 7]: call 0 (prompt [1 2 3] + [4 5]) is its first tokens, and its prompt is shorter
    assert chain_rows([[1, 2, 3, 4], [1, 2, 3]], [[5, 6, 7], [4, 5]], [1.0, 1.0]) == [[0, 1]]


def test_copies_of_one_call_fill_a_row_up_to_its_length_then_begin_another():
    # a group's identical samples: prompt [1 2 3 4], response [5 6] (a row of 6 tokens scores at most 6,
    # so three copies a row); an episode's calls, each a span of its own, always share their row
    assert chain_rows([[1, 2, 3, 4]] * 7, [[5, 6]] * 7, [1.0] * 7) == [[0, 1, 2], [3, 4, 5], [6]]
    assert chain_rows([[1, 9], [1, 9, 2, 3]], [[2, 3], [4, 5]], [1.0, 1.0]) == [[1, 0]]


def test_the_chained_layout_by_hand():
    b = pack(PROMPTS, RESPONSES, [1.0] * 4, pad_id=0, chain=True)
    # three rows; the episode's row runs from call 0's prompt ([1 2 3]) to call 1's end
    assert b.input_ids.shape[0] == 3 and b.chain is not None
    assert b.chain.response_len == 6  # [4 5 6 7 8 9]
    assert b.chain.response_ids.tolist() == [[4, 5, 6, 7, 8, 9], [3, 0, 0, 0, 0, 0], [4, 7, 0, 0, 0, 0]]
    assert b.prompt_len == 3 and b.input_ids[0].tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    # the calls' own fields are the calls' (4 rows, R = 3), and each call's positions in the rows' 3 x 6
    assert b.response_len == 3 and b.response_ids.tolist() == [[4, 5, 0], [7, 8, 9], [3, 0, 0], [4, 7, 0]]
    assert b.response_mask.tolist() == [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]]
    index = b.chain.index.tolist()
    assert [index[0][:2], index[1], index[2][:1], index[3][:2]] == [[0, 1], [3, 4, 5], [6], [12, 13]]
    flat = b.chain.response_ids.reshape(-1)
    assert torch.equal(flat[b.chain.index] * b.response_mask.long(), b.response_ids)  # every call's tokens where it says


def test_without_chains_the_layout_is_the_plain_one():
    b = pack([[1, 2], [3]], [[4], [5, 6]], [1.0, 1.0], pad_id=0, chain=True)
    assert b.chain is None and b.input_ids.tolist() == [[1, 2, 4, 0], [0, 3, 5, 6]]


def test_a_model_that_changes_its_logits_after_the_head_keeps_one_row_per_call():
    from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM

    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8)

    class Scaled(LlamaForCausalLM):  # a transform after the head that its config does not name
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits * 10
            return out

    torch.manual_seed(0)
    assert head_is_last(LlamaForCausalLM(LlamaConfig(**small)))
    assert not head_is_last(Gemma2ForCausalLM(Gemma2Config(**small)))  # final_logit_softcapping
    assert not head_is_last(Scaled(LlamaConfig(**small)))
    # a vision-language model: on token ids alone its logits are its head's, but its forward builds other
    # inputs for its decoder once an image comes, so its config of several parts refuses it
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=8,
                              patch_size=4, projection_dim=16)
    llava = LlavaForConditionalGeneration(LlavaConfig(text_config=LlamaConfig(**small), vision_config=vision, image_token_index=63))
    assert not head_is_last(llava)
