"""Hermes-format tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` in the text.

``parse_tool_calls`` turns a finished response into OpenAI ``tool_calls``; ``ToolCallStreamFilter``
lets a streamed response show its plain content while holding back anything that may be a call;
``call_grammar`` is what ``tool_choice`` required / named decode under.
"""

from __future__ import annotations

import json
import re
import secrets
from typing import Any

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
