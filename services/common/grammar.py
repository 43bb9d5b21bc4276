"""Constrained decoding: grammars for structured outputs, compiled and matched with xgrammar.

A constraint travels as EBNF text (xgrammar's dialect): the Explorer builds it from a request
(``response_format`` json_object / json_schema, ``tool_choice`` required / named), the engine
compiles it once per distinct text and masks every sampling step to the tokens it allows, and the
record keeps it (``sampling.grammar``) so that the Trainer can rebuild the same masks and compute
its logprobs over the same allowed sets as the engine sampled from (``token_masks``).

Logprob convention under a constraint: ``log_softmax`` of ``logits / T`` with disallowed tokens at
-inf, i.e. the distribution the token was really drawn from. A token the grammar forces has
logprob 0. Both engines and the Trainer follow it, so importance ratios stay exact.

xgrammar is imported lazily: without it, the server starts and only constrained requests fail.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any, Iterable

import torch


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled (the HTTP edge answers 400)."""


def _xgr():
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - xgrammar is a server dependency
        raise GrammarError("structured outputs need the xgrammar package (pip install xgrammar)") from e
    return xgrammar


def json_object_grammar() -> str:
    """Any JSON object (``response_format: {"type": "json_object"}``)."""
    xgr = _xgr()
    return str(xgr.Grammar.from_json_schema(json.dumps({"type": "object"}), any_whitespace=False))


def json_schema_grammar(schema: dict[str, Any], *, strict: bool = True) -> str:
    """JSON that matches ``schema``; strict: no properties beyond the schema's."""
    xgr = _xgr()
    try:
        return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=strict))
    except Exception as e:
        raise GrammarError(f"the JSON schema cannot be used for constrained decoding: {e}") from None


def tagged_json(tags: list[tuple[str, dict[str, Any], str]], *, separator: str, first_only: bool) -> str:
    """One or more ``begin + JSON matching schema + end`` blocks (any of ``tags`` each time),
    separated by ``separator``; ``first_only``: exactly one block."""
    xgr = _xgr()
    # Each schema as a grammar of its own: compact JSON (", " and ": ", as json.dumps writes it and
    # the chat template renders calls), where the structural tag's own JSON would allow any
    # whitespace, which a weak model can loop in forever.
    tag = {"type": "structural_tag", "format": {
        "type": "tags_with_separator", "separator": separator, "at_least_one": True, "stop_after_first": first_only,
        "tags": [{"type": "tag", "begin": begin, "content": {"type": "grammar", "grammar": json_schema_grammar(schema)},
                  "end": end} for begin, schema, end in tags],
    }}
    try:
        return str(xgr.Grammar.from_structural_tag(json.dumps(tag)))
    except Exception as e:
        raise GrammarError(f"these tools cannot be used for constrained decoding: {e}") from None


def either(*ebnf: str) -> str:
    """A grammar that matches what any of ``ebnf`` matches."""
    xgr = _xgr()
    return str(xgr.Grammar.union(*[xgr.Grammar.from_ebnf(g) for g in ebnf]))


class GrammarCache:
    """Compiled grammars of one tokenizer, by EBNF text (least recently used go first)."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, stop_token_ids: Iterable[int] | None = None,
                 capacity: int = 256):
        xgr = _xgr()
        self._xgr = xgr
        self.vocab_size = vocab_size
        stops = sorted(stop_token_ids) if stop_token_ids else None  # a finished grammar allows only these
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stops)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()

    def compile(self, ebnf: str) -> Any:
        with self._lock:
            if ebnf in self._compiled:
                self._compiled.move_to_end(ebnf)
                return self._compiled[ebnf]
        try:
            compiled = self._compiler.compile_grammar(ebnf)
        except Exception as e:
            raise GrammarError(f"invalid grammar: {e}") from None
        with self._lock:
            self._compiled[ebnf] = compiled
            while len(self._compiled) > self._capacity:
                self._compiled.popitem(last=False)
        return compiled

    def matcher(self, ebnf: str) -> Any:
        return self._xgr.GrammarMatcher(self.compile(ebnf))

    def new_bitmask(self, rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Disallowed tokens of ``rows`` to -inf, in place. logits (B, V) float on the CPU."""
        self._xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)


def allowed(cache: GrammarCache, ebnf: str, token_ids: list[int], vocab: int) -> torch.Tensor:
    """(R, vocab) bool: which tokens the grammar allowed before each of ``token_ids``.

    Rows after the grammar ended (or after a token it refused) allow everything: such a response
    was cut or not produced under this grammar, and its tokens are trained unconstrained.
    """
    m = cache.matcher(ebnf)
    bitmask = cache.new_bitmask(1)
    out = torch.ones((len(token_ids), vocab), dtype=torch.bool)
    probe = torch.zeros((1, cache.vocab_size))
    for i, t in enumerate(token_ids):
        if m.is_terminated():
            break
        m.fill_next_token_bitmask(bitmask)
        probe.zero_()
        cache.apply(probe, bitmask, [0])
        out[i, : cache.vocab_size] = probe[0] == 0
        if cache.vocab_size < vocab:
            out[i, cache.vocab_size :] = False
        if not m.accept_token(t):
            out[i] = True
            break
    return out
