"""Hermes-format tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the text.

``parse_tool_calls`` turns a finished response into OpenAI ``tool_calls`` (``parse_cut_tool_calls``
one that ``max_tokens`` cut inside a call); ``ToolCallStreamFilter`` lets a streamed response show
its plain content while holding back anything that may be a call; ``call_grammar`` is what
``tool_choice`` required / named decode under.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any, Sequence

from services.common import grammar

START = "<tool_call>"
END = "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content before the first call or None, OpenAI tool_calls). Malformed calls stay text."""
    start = text.find(START)
    if start < 0:
        return text, []
    calls = []
    for block in _BLOCK.findall(text[start:]):
        try:
            obj = json.loads(block.strip())
        except ValueError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return text, []
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(
            {
                "id": new_call_id(),
                "type": "function",
                "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)},
            }
        )
    content = text[:start].strip()
    return (content or None), calls


_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)(")?')
_ARGUMENTS = re.compile(r'"arguments"\s*:\s*')


def markup_start(text: str, *, forced: bool = False) -> int | None:
    """Where the calls' markup begins in ``text``: its first ``<tool_call>``, or a start of one that
    the text ends in; None when it holds none. ``forced``: the response was decoded under
    ``call_grammar``, so all of it is markup."""
    if forced:
        return 0
    start = text.find(START)
    if start >= 0:
        return start
    k = next((k for k in range(min(len(START) - 1, len(text)), 0, -1) if text.endswith(START[:k])), 0)
    return len(text) - k if k else None


def _cut_call(block: str, names: Sequence[str]) -> dict[str, Any] | None:
    """One call's text after its ``<tool_call>``, possibly cut anywhere: the call as far as it goes
    (arguments as generated; a cut name completed when only one of ``names`` begins so), or None
    when not even its name can be told."""
    body = block.split(END)[0]
    k = next((k for k in range(min(len(END) - 1, len(body)), 0, -1) if body.endswith(END[:k])), 0)
    body = body[: len(body) - k]
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("name"), str):
        args = obj.get("arguments", obj.get("parameters", {}))
        return {"id": new_call_id(), "type": "function",
                "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}
    m = _NAME.match(body)
    if m is None and not '{"name": "'.startswith(body.strip()):  # not a call cut before its name
        return None
    typed = m.group(1) if m else ""
    if m and m.group(2):
        name = typed
    else:
        candidates = [n for n in names if n.startswith(typed)]
        if len(candidates) != 1:
            return None
        name = candidates[0]
    args_at = _ARGUMENTS.search(body, m.end() if m else 0)
    arguments = body[args_at.end():].rstrip() if args_at else ""
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def parse_cut_tool_calls(text: str, names: Sequence[str], *, forced: bool = False) -> tuple[str | None, list[dict[str, Any]]]:
    """A response cut by ``max_tokens``, as OpenAI answers one (with finish_reason "length"): (its
    content before the first call or None, its calls, the last one cut where the tokens ran out).
    ``names``: the functions it may call; ``forced``: decoded under ``call_grammar``. The calls'
    markup never reaches the content; a response without any is its text as it is."""
    start = markup_start(text, forced=forced)
    if start is None:
        return text, []
    content = text[:start].strip() or None
    blocks = text[start:].split(START)[1:] or [""]  # [""]: cut inside the first <tool_call> itself
    calls = [c for c in (_cut_call(b, names) for b in blocks) if c is not None]
    return content, calls


def call_grammar(tools: list[dict[str, Any]], tool_choice: Any, *, parallel: bool) -> str | None:
    """The grammar a response must match under ``tool_choice`` required (a call of any offered
    tool) or named (a call of that one), in exactly the form the Hermes template renders and
    ``parse_tool_calls`` reads, each call's arguments matching its tool's parameters schema;
    several calls, one per line, when ``parallel``. None for auto and none: free text."""
    if tool_choice == "required":
        chosen = tools
    elif isinstance(tool_choice, dict):
        chosen = [t for t in tools if t["function"]["name"] == tool_choice["function"]["name"]]
    else:
        return None
    tags = [
        (f'{START}\n{{"name": {json.dumps(t["function"]["name"])}, "arguments": ',
         t["function"].get("parameters") or {"type": "object"}, f"}}\n{END}")
        for t in chosen
    ]
    return grammar.tagged_json(tags, separator="\n", first_only=not parallel)


class ToolCallStreamFilter:
    """Passes content through until a tool call may be starting; the rest waits for the end."""

    def __init__(self) -> None:
        self.text = ""
        self._emitted = 0
        self._held = False

    def feed(self, delta: str) -> str:
        self.text += delta
        if self._held:
            return ""
        start = self.text.find(START, self._emitted)
        if start >= 0:
            self._held = True
            out, self._emitted = self.text[self._emitted : start], start
            return out
        # Keep back a tail that could be the beginning of "<tool_call>".
        keep = 0
        for k in range(min(len(START) - 1, len(self.text) - self._emitted), 0, -1):
            if START.startswith(self.text[-k:]):
                keep = k
                break
        end = len(self.text) - keep
        out, self._emitted = self.text[self._emitted : end], end
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """(content not yet emitted, tool calls) once the response is complete."""
        content, calls = parse_tool_calls(self.text)
        if calls:
            return "", calls
        rest, self._emitted = self.text[self._emitted :], len(self.text)
        return rest, []

    def finish_cut(self, names: Sequence[str], *, forced: bool = False) -> tuple[str, list[dict[str, Any]]] | None:
        """``finish`` for a response that max_tokens cut inside a call: (content not yet emitted, the
        calls, the last one cut; see ``parse_cut_tool_calls``), so that no markup is ever content.
        None when the response holds no call markup, or only whole calls (``finish`` answers)."""
        start = markup_start(self.text, forced=forced)
        if start is None or parse_tool_calls(self.text)[1]:
            return None
        _, calls = parse_cut_tool_calls(self.text, names, forced=forced)
        rest, self._emitted = self.text[self._emitted : max(start, self._emitted)], len(self.text)
        return rest, calls
