"""Feedback in words: how a hint is shown to the teacher of on-policy self-distillation. The teacher
reads the call's conversation with the hint as one more message, rendered by the served chat template
up to the reply's start, exactly as the prompt the call was sampled from; the Trainer scores the
sampled reply after it (services/trainer/recipes/opd.py). The Explorer and an embedded LearnableAgent
render it here, so both give the Trainer the same prompt."""

from __future__ import annotations

from typing import Any

HINT_MAX_CHARS = 4000  # the longest hint POST /feedback takes (runner_sdk.feedback keeps its own copy)
HINT_TEMPLATE = "A note on how to answer, from a reviewer: {hint}"
HINT_ROLE = "user"


def hint_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, hint: str, *,
                    template: str = HINT_TEMPLATE, role: str = HINT_ROLE) -> list[int]:
    """The teacher's prompt ids: ``messages`` plus the hint (``template`` with {hint} replaced, as
    ``role``), with the generation prompt. Raises what the chat template raises."""
    note = {"role": role, "content": template.replace("{hint}", hint)}
    text = tokenizer.apply_chat_template([*messages, note], tools=tools or None, add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
