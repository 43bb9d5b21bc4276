"""The running batch of the embedded engine (hf.py): a request waiting or decoding, one sequence
(a choice of a request) in the batch, and the small tensor helpers its prefill merge uses."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from services.explorer.serving.engines.base import ChoiceUpdate, GenerateRequest
from services.explorer.serving.engines.detokenizer import IncrementalDetokenizer


@dataclass
class QueuedRequest:
    """A request handed to the engine thread, with the queue its updates go back to."""

    req: GenerateRequest
    loop: asyncio.AbstractEventLoop
    out: asyncio.Queue
    aborted: bool = False
    enqueued_at: float = field(default_factory=time.monotonic)


@dataclass
class Row:
    """One sequence (a choice of a request) in the running batch."""

    request: QueuedRequest
    index: int
    generator: torch.Generator | None
    detok: IncrementalDetokenizer | None
    prompt_len: int
    out_ids: list[int] = field(default_factory=list)
    out_lps: list[float] = field(default_factory=list)
    out_top: list[list[tuple[int, float]]] = field(default_factory=list)
    emitted: int = 0  # tokens already sent to the client
    finish_reason: str | None = None
    matcher: Any = None  # xgrammar GrammarMatcher of a constrained request

    @property
    def adapter_name(self) -> str | None:
        a = self.request.req.adapter
        return a.name if a else None


def aborted_update(index: int) -> ChoiceUpdate:
    return ChoiceUpdate(index=index, token_ids=[], logprobs=[], text="", finish_reason="abort")


def pad_left(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)
