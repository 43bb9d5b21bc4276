"""Keys and values of prompts the hf engine already computed, reused by later requests.

An agent's requests repeat themselves: every one starts with the same system prompt and tool list
(about 170 of the demo's 250 prompt tokens), and each call of a multi-turn episode starts with the
whole conversation so far, which the previous call computed. The engine keeps the keys and values of
what it computed, per adapter (a prefix's keys and values depend on the adapter that computed them),
and a later prompt that starts with the same token ids takes them instead of computing them again.

A causal model's keys and values at position i depend only on the tokens up to i, so an entry
serves any prompt that shares a leading run of ids with it, up to the first id that differs: the
lookup takes the longest such run over the adapter's entries, not only whole entries. What is
reused is exactly what a fresh prefill computes, up to float rounding (the same arithmetic on other
batch shapes).

Entries are tensors shaped (1, heads, tokens, head_dim) per layer, on the engine's device, held
within a byte budget and dropped least recently used first; an entry another one extends is
dropped for it. Everything here runs on the engine's own thread.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

Layers = list[tuple[torch.Tensor, torch.Tensor]]


def common_prefix_len(a: np.ndarray, b: np.ndarray) -> int:
    """Leading positions where ``a`` and ``b`` hold the same id."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if len(differ) else n


@dataclass
class _Entry:
    adapter: str | None
    tokens: np.ndarray  # int64, one id per cached position
    layers: Layers
    nbytes: int


class PrefixCache:
    def __init__(self, max_bytes: int, min_tokens: int = 1):
        self.max_bytes = max_bytes
        self.min_tokens = max(1, min_tokens)
        self._entries: collections.OrderedDict[int, _Entry] = collections.OrderedDict()  # least recently used first
        self._next_key = 0
        self.bytes = 0
        self.hits = 0
        self.tokens_reused = 0  # prompt tokens taken from the cache instead of computed

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, adapter: str | None, tokens: Sequence[int]) -> tuple[int, Layers | None]:
        """(m, layers): the keys and values of ``tokens[:m]``, the longest leading run any entry of
        ``adapter`` shares with ``tokens`` (at least ``min_tokens``), each (1, heads, m, head_dim);
        (0, None) when none does. The caller keeps at least one token of its prompt out of ``tokens``
        (its logits come from computing it)."""
        best, best_key = self._longest(adapter, tokens)
        if best_key is None:
            return 0, None
        self._entries.move_to_end(best_key)
        self.hits += 1
        self.tokens_reused += best
        layers = self._entries[best_key].layers
        return best, [(k[:, :, :best], v[:, :, :best]) for k, v in layers]

    def holds(self, adapter: str | None, tokens: Sequence[int]) -> bool:
        """Whether an entry of ``adapter`` already holds all of ``tokens`` (storing them would add nothing)."""
        return len(tokens) > 0 and self._longest(adapter, tokens)[0] == len(tokens)

    def peek(self, adapter: str | None, tokens: Sequence[int]) -> int:
        """What ``lookup`` would return as m, without taking anything or counting a hit."""
        return self._longest(adapter, tokens)[0]

    def _longest(self, adapter: str | None, tokens: Sequence[int]) -> tuple[int, int | None]:
        """(m, key) of the entry sharing the longest leading run with ``tokens``; (0, None) below min_tokens."""
        if not self.enabled or len(tokens) < self.min_tokens:
            return 0, None
        query = np.asarray(tokens, dtype=np.int64)
        best, best_key = 0, None
        for key, e in self._entries.items():
            if e.adapter == adapter:
                m = common_prefix_len(e.tokens, query)
                if m > best:
                    best, best_key = m, key
        return (best, best_key) if best >= self.min_tokens else (0, None)

    def store(self, adapter: str | None, tokens: Sequence[int], layers: Layers, *, owned: bool = False) -> None:
        """Keep ``layers`` (each (1, heads, len(tokens), head_dim)) as the keys and values of
        ``tokens`` under ``adapter``. An entry these tokens extend is dropped; when an entry already
        holds them (or more), it is only marked as recently used."""
        if not self.enabled or len(tokens) < self.min_tokens:
            return
        if any(k.shape[2] != len(tokens) or v.shape[2] != len(tokens) for k, v in layers):
            raise ValueError(f"cached keys and values cover {layers[0][0].shape[2]} positions, not the {len(tokens)} tokens given")
        nbytes = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in layers)
        if nbytes > self.max_bytes:  # never held; what it would extend stays
            return
        new = np.asarray(tokens, dtype=np.int64)
        for key, e in list(self._entries.items()):
            if e.adapter != adapter:
                continue
            m = common_prefix_len(e.tokens, new)
            if m == len(new):  # already held
                self._entries.move_to_end(key)
                return
            if m == len(e.tokens):  # the new entry extends this one
                self._drop(key)
        while self.bytes + nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        # own storage: a slice of a batch's cache would keep the whole batch's tensors alive (``owned``:
        # the caller made these tensors for the cache alone)
        if not owned:
            layers = [(k.contiguous().clone(), v.contiguous().clone()) for k, v in layers]
        self._entries[self._next_key] = _Entry(adapter, new, layers, nbytes)
        self._next_key += 1
        self.bytes += nbytes

    def drop_adapter(self, adapter: str | None) -> None:
        for key in [k for k, e in self._entries.items() if e.adapter == adapter]:
            self._drop(key)

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0

    def _drop(self, key: int) -> None:
        self.bytes -= self._entries.pop(key).nbytes
