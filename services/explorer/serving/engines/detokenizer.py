"""Incremental detokenization with stop strings, shared by the engines.

Decoding the whole output at every step is quadratic; instead we decode a short window of recent
tokens (the prefix/read offsets trick) and hold back text that may still be the start of a stop
string, so a streamed client never sees text that is later cut.
"""

from __future__ import annotations

from typing import Any, Sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        self.text = ""  # all text decoded so far (cut at a stop string once one is found)
        self._emitted = 0
        self._stop = tuple(s for s in stop if s)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.stopped = False

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> None:
        """Append one sampled token; sets ``stopped`` when a stop string appears."""
        if self.stopped:
            return
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return  # a special token, or an incomplete UTF-8 sequence: wait for more tokens
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        start = max(0, len(self.text) - self._holdback)
        self.text += delta
        if self._stop:
            hits = [p for p in (self.text.find(s, start) for s in self._stop) if p >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True

    def _flush(self) -> None:
        """At the end, keep the text of trailing tokens that never formed a whole character."""
        if not self.stopped and self._read < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix : self._read])
            self.text += self._decode(self._ids[self._prefix :])[len(prefix_text) :]
            self._prefix = self._read = len(self._ids)

    def take(self, final: bool = False) -> str:
        """Text that is safe to show now (everything, once ``final``)."""
        if final:
            self._flush()
        end = len(self.text) if (final or self.stopped) else max(self._emitted, len(self.text) - self._holdback)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
