"""An assistant reply rendered by the served chat template after its conversation, as the model
would have sampled it: what ``POST /demonstrations`` stores and what a correction (feedback that
says what a sampled call should have answered) becomes. The Explorer and an embedded
LearnableAgent render here, so a correction gives the Trainer the same ids either way."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Any

from services.common.ids import experience_id, new_id
from services.common.records import CORRECTION_LABEL, DEMONSTRATION_KIND, DEMONSTRATION_LABEL, Experience, ExperienceStatus


class ReplyError(ValueError):
    """A reply (or its conversation) that cannot be rendered; ``param`` names the field."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def assistant_reply(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message given as a dict (OpenAI's shape: ``content`` and/or ``tool_calls``, whose
    ``arguments`` may be a JSON string or an object) as the chat template takes it, like the
    Explorer's request messages: tool calls with string arguments."""
    if not isinstance(message, dict) or message.get("role", "assistant") != "assistant":
        raise ReplyError("a reply is an assistant message: a dict with role 'assistant'", param="role")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise ReplyError("a reply's content is a string or null", param="content")
    calls = []
    for j, c in enumerate(message.get("tool_calls") or []):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ReplyError(f"tool_calls.{j} needs a function with a name", param=f"tool_calls.{j}.function")
        args = fn.get("arguments", {})
        calls.append({"id": c.get("id") or f"call_{j}", "type": "function",  # the same reply, the same body
                      "function": {"name": fn["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}})
    if not content and not calls:
        raise ReplyError("a reply needs content or tool_calls", param="content")
    return {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}


def check_tool_calls(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
    """Every tool call of ``messages`` (the last one is the reply, named ``response``) names an
    offered tool and has a JSON object as its arguments."""
    names = {t["function"]["name"] for t in tools or []}
    for i, m in enumerate(messages):
        where = "response" if i == len(messages) - 1 else f"messages.{i}"
        for j, call in enumerate(m.get("tool_calls") or []):
            name = call["function"]["name"]
            if name not in names:
                known = f"the tools offered are {', '.join(sorted(names))}" if names else "no tools were offered"
                raise ReplyError(f"{where}.tool_calls.{j} calls unknown tool {name!r}: {known}",
                                 param=f"{where}.tool_calls.{j}.function.name", code="unknown_tool")
            try:
                ok = isinstance(json.loads(call["function"]["arguments"]), dict)
            except ValueError:
                ok = False
            if not ok:
                raise ReplyError(f"{where}.tool_calls.{j}.function.arguments must be a JSON object",
                                 param=f"{where}.tool_calls.{j}.function.arguments")


def render_reply(tokenizer: Any, messages: list[dict], reply: dict, tools: list[dict] | None, *, max_len: int,
                 check_conversation: bool = True) -> tuple[list[int], list[int]]:
    """(prompt ids, reply ids) of normalized messages and an assistant reply: the reply's ids are what
    the model would have sampled, its turn's closing token included and nothing after it. The
    reply's tool calls are checked against ``tools``; the conversation's too unless it was recorded
    (a sampled call may have made a bad one: it is what happened)."""
    check_tool_calls([*messages, reply] if check_conversation else [reply], tools)
    try:
        prompt = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        full = tokenizer.apply_chat_template([*messages, reply], tools=tools, add_generation_prompt=False, tokenize=False)
    except Exception as e:
        raise ReplyError(f"the model's chat template rejected this demonstration: {e}", param="messages") from None
    if not full.startswith(prompt):
        raise ReplyError("the chat template does not render this reply as a continuation of the prompt "
                         "(is the last message an assistant turn?)", param="messages")
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    reply_ids = tokenizer.encode(full[len(prompt):], add_special_tokens=False)
    if tokenizer.eos_token_id in reply_ids:  # drop what the template adds after the turn's end
        reply_ids = reply_ids[: len(reply_ids) - reply_ids[::-1].index(tokenizer.eos_token_id)]
    if len(prompt_ids) + len(reply_ids) > max_len:
        raise ReplyError(f"this model's maximum context length is {max_len} tokens; the demonstration takes "
                         f"{len(prompt_ids) + len(reply_ids)}", param="messages", code="context_length_exceeded")
    return prompt_ids, reply_ids


def correction_record(exp: Experience, reply: dict[str, Any], prompt_ids: list[int], reply_ids: list[int], *,
                      comment: str | None) -> Experience:
    """The demonstration a correction of the recorded call ``exp`` becomes: its prompt, ``reply``
    rendered (``render_reply``), committed, labelled and linked to the call it corrects."""
    cid = new_id(DEMONSTRATION_KIND)
    return Experience(
        experience_id=experience_id(cid, 0), completion_id=cid, agent=exp.agent, model_version=0,
        task_id=exp.task_id, prompt_token_ids=prompt_ids, response_token_ids=reply_ids, response_logprobs=[],
        messages=exp.messages, response=reply, tools=exp.tools, finish_reason="stop", sampling={},
        feedback={"labels": [DEMONSTRATION_LABEL, CORRECTION_LABEL], "source": "correction", "comment": comment,
                  "corrects": exp.experience_id, "prompt_as_recorded": prompt_ids == exp.prompt_token_ids,
                  "at": datetime.now(timezone.utc).isoformat()},
        status=ExperienceStatus.COMMITTED, user_id=exp.user_id, trainable=exp.trainable,
        created_at=exp.created_at,  # the user's conversation, as old as the call: retention purges both at once
    )
