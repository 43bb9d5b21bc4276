"""A small hand-written engine for unit tests of the Explorer's services: a character tokenizer
and scripted replies, one token per character, generated at a set pace."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from services.explorer.serving.engines.base import AdapterRef, ChoiceUpdate, EngineStats, GenerateRequest


class CharTokenizer:
    """Token id = code point. A chat renders as ``role: content`` lines, then ``assistant:``."""

    eos_token_id = 0
    pad_token_id = 0

    def apply_chat_template(self, messages, tools=None, add_generation_prompt=True, tokenize=False) -> str:
        lines = [f"tools: {[t['function']['name'] for t in tools]}"] if tools else []
        for m in messages:
            lines.append(f"{m['role']}: {m.get('content') or ''}")
        return "\n".join(lines) + ("\nassistant:" if add_generation_prompt else "")

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


@dataclass
class FakeEngine:
    replies: list[str] = field(default_factory=lambda: ["hello"])  # choice i answers replies[i % len]
    seconds_per_token: float = 0.0
    max_model_len: int = 4096
    max_batch_size: int = 32
    tokenizer: Any = field(default_factory=CharTokenizer)
    requests: list[GenerateRequest] = field(default_factory=list)
    aborted: set[str] = field(default_factory=set)
    loaded: dict[str, AdapterRef] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)

    async def start(self) -> None: ...

    async def shutdown(self) -> None: ...

    async def generate(self, request: GenerateRequest) -> AsyncIterator[list[ChoiceUpdate]]:
        self.requests.append(request)
        texts = [self.replies[i % len(self.replies)][: request.params.max_tokens] for i in range(request.n)]
        done = [False] * request.n
        acc: dict[int, ChoiceUpdate] = {}
        step = 0
        while not all(done):
            if self.seconds_per_token:
                await asyncio.sleep(self.seconds_per_token)
            updates = []
            for i, text in enumerate(texts):
                if done[i]:
                    continue
                if request.request_id in self.aborted:
                    done[i] = True
                    updates.append(ChoiceUpdate(i, [], [], "", finish_reason="abort"))
                    continue
                ch = text[step] if step < len(text) else ""
                last = step + 1 >= len(text)
                done[i] = last
                updates.append(ChoiceUpdate(i, [ord(ch)] if ch else [], [-0.5] if ch else [], ch,
                                            finish_reason=("length" if len(text) == request.params.max_tokens else "stop") if last else None))
            step += 1
            if request.stream:
                yield updates
            else:  # once per choice, at its end
                for u in updates:
                    a = acc.setdefault(u.index, ChoiceUpdate(u.index, [], [], ""))
                    a.token_ids += u.token_ids
                    a.logprobs += u.logprobs
                    a.text += u.text
                    a.finish_reason = u.finish_reason
                finished = [acc.pop(u.index) for u in updates if u.finish_reason]
                if finished:
                    yield finished

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    async def add_adapter(self, adapter: AdapterRef) -> None:
        self.loaded[adapter.name] = adapter

    async def remove_adapter(self, adapter: AdapterRef) -> None:
        self.loaded.pop(adapter.name)
        self.removed.append(adapter.name)

    @property
    def adapters(self) -> list[str]:
        return list(self.loaded)

    def stats(self) -> EngineStats:
        return EngineStats()
