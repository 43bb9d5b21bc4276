"""Several engines behind one Explorer (``engine.replicas``): requests go to the least loaded one.

Each replica is a whole engine (for vLLM: its own engine-core process and GPUs). Adapters are
loaded into every replica at once, each replica loading on its own (concurrently), and a version
counts as loaded only when every replica has it, so a request may land anywhere. A request stays
on the replica it started on until it finishes.

A request that continues a recent one (its prompt starts with that one's whole prompt: the next call
of an agent's episode, after a tool result) goes to the same replica, whose prefix cache holds the
conversation so far, unless that replica has ``affinity_slack`` more sequences running than the
least loaded one. On another replica the conversation would be prefilled again from its start.
"""

from __future__ import annotations

import array
import asyncio
from collections import OrderedDict
from typing import Any, AsyncIterator, Sequence

from services.explorer.serving.engines.base import AdapterRef, ChoiceUpdate, Engine, EngineError, EngineStats, GenerateRequest


# Prompts remembered for routing the next call of a conversation: the most recent ones, and only
# prompts this long or longer (a shorter one saves too little prefill to steer the load by).
_AFFINITY_PROMPTS = 1024
_AFFINITY_MIN_TOKENS = 32


def _key(token_ids: Sequence[int]) -> bytes:
    return array.array("i", token_ids).tobytes()


class ReplicatedEngine:
    def __init__(self, engines: Sequence[Engine], affinity_slack: int | None = None):
        if not engines:
            raise ValueError("ReplicatedEngine needs at least one engine")
        self.engines = list(engines)
        self._load = [0] * len(self.engines)
        self._owner: dict[str, int] = {}
        self._recent: OrderedDict[bytes, int] = OrderedDict()  # a recent prompt -> the replica that served it
        self.routed_by_affinity = 0
        self.tokenizer: Any = None
        self.max_model_len = 0
        self.max_batch_size = min(e.max_batch_size for e in self.engines)
        self.affinity_slack = affinity_slack if affinity_slack is not None else max(1, self.max_batch_size // 4)

    async def start(self) -> None:
        # One after another: engines that spawn processes (vLLM) must not race on the environment,
        # and a failure stops the rest early.
        started = []
        try:
            for e in self.engines:
                await e.start()
                started.append(e)
        except BaseException:
            for e in started:
                await e.shutdown()
            raise
        self.tokenizer = self.engines[0].tokenizer
        self.max_model_len = min(e.max_model_len for e in self.engines)

    async def shutdown(self) -> None:
        await asyncio.gather(*(e.shutdown() for e in self.engines), return_exceptions=True)

    def _pick(self, prompt: bytes | None = None) -> int:
        healthy = [i for i, e in enumerate(self.engines) if e.stats().error is None] or list(range(len(self.engines)))
        least = min(healthy, key=lambda i: (self._load[i], i))
        if prompt is None:
            return least
        same = self._continued(prompt)
        if same is not None and same in healthy and self._load[same] - self._load[least] <= self.affinity_slack:
            self.routed_by_affinity += 1
            return same
        return least

    def _continued(self, prompt: bytes) -> int | None:
        """The replica that served the longest recent prompt this one starts with (None: none)."""
        best, found = 0, None
        for key, i in self._recent.items():
            if best < len(key) <= len(prompt) and prompt.startswith(key):
                best, found = len(key), i
        return found

    def _remember(self, prompt: bytes, replica: int) -> None:
        self._recent[prompt] = replica
        self._recent.move_to_end(prompt)
        while len(self._recent) > _AFFINITY_PROMPTS:
            self._recent.popitem(last=False)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[list[ChoiceUpdate]]:
        ids = request.prompt_token_ids
        prompt = _key(ids) if len(ids) >= _AFFINITY_MIN_TOKENS else None
        i = self._pick(prompt)
        if prompt is not None:
            self._remember(prompt, i)
        self._load[i] += request.n
        self._owner[request.request_id] = i
        try:
            async for updates in self.engines[i].generate(request):
                yield updates
        finally:
            self._load[i] -= request.n
            self._owner.pop(request.request_id, None)

    async def abort(self, request_id: str) -> None:
        i = self._owner.get(request_id)
        if i is not None:
            await self.engines[i].abort(request_id)

    async def add_adapter(self, adapter: AdapterRef) -> None:
        results = await asyncio.gather(*(e.add_adapter(adapter) for e in self.engines), return_exceptions=True)
        failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        if failed:
            # All or nothing: a version some replicas lack would fail the requests routed there.
            for i, r in enumerate(results):
                if not isinstance(r, BaseException):
                    await self.engines[i].remove_adapter(adapter)
            i, err = failed[0]
            raise EngineError(f"replica {i} could not load {adapter.name}: {err}") from err

    async def remove_adapter(self, adapter: AdapterRef) -> None:
        await asyncio.gather(*(e.remove_adapter(adapter) for e in self.engines))

    @property
    def adapters(self) -> list[str]:
        sets = [set(e.adapters) for e in self.engines]
        return sorted(set.intersection(*sets))

    def stats(self) -> EngineStats:
        per = [e.stats() for e in self.engines]
        extra: dict[str, float] = {}
        for i, s in enumerate(per):
            extra[f"replica{i}_running"] = float(s.running)
            for k, v in s.extra.items():
                extra[k] = extra.get(k, 0.0) + v
        extra["routed_by_affinity"] = float(self.routed_by_affinity)  # calls sent after their conversation, not by load
        errors = [f"replica {i}: {s.error}" for i, s in enumerate(per) if s.error]
        return EngineStats(
            running=sum(s.running for s in per),
            waiting=sum(s.waiting for s in per),
            extra=extra,
            # Serving goes on while one replica is alive; health fails only when none is.
            error="; ".join(errors) if len(errors) == len(per) else None,
        )
