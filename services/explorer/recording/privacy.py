"""What the buffer keeps of a user's traffic: redaction at record time, consent, and who it was.

Redaction replaces e-mail addresses, phone numbers and card numbers (``privacy.redact``) and
whatever a user-supplied function changes (``privacy.redactor``) in the stored messages, tool call
arguments and response text. The answer the client gets is never changed. Token ids decode to the
unredacted text, so an experience whose text changed follows one stated rule
(``privacy.redacted_ids``): ``drop`` stores no ids and logprobs and never trains on it; ``keep``
stores them and trains, and its ``privacy`` record says the text and the ids differ. Never a
silent mismatch.

Consent: ``metadata.train: false`` (or an API key whose ``train`` is false) records the call for
audit but it is never trained on (its commit discards it).
"""

from __future__ import annotations

import re
from typing import Any, Callable

from services.common.plugins import load_object
from services.common.records import Experience
from services.explorer.config import PrivacySection

# Bounded parts (RFC 5321's lengths): unbounded ones made a long run of letters cost quadratic time.
_EMAIL = re.compile(r"[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9-]{1,63}(?:\.[A-Za-z0-9-]{1,63}){0,8}\.[A-Za-z]{2,24}")
# A phone number: an optional +country code, then digit groups with separators; 9 to 15 digits in all.
_PHONE = re.compile(r"(?<![\w+])\+?\(?\d{1,4}\)?(?:[ .-]?\(?\d{2,4}\)?){2,5}(?![\w])")
_CARD = re.compile(r"(?<!\d)\d(?:[ -]?\d){12,18}(?!\d)")


def _luhn(digits: str) -> bool:
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def _card(m: re.Match) -> str:
    digits = re.sub(r"\D", "", m.group())
    return "[card]" if 13 <= len(digits) <= 19 and _luhn(digits) else m.group()


def _phone(m: re.Match) -> str:
    text = m.group()
    digits = re.sub(r"\D", "", text)
    seps = re.findall(r"[ .()-]+", text)
    # A leading + or an area code in parentheses, else at least two separators not all dots (a decimal
    # number or an IP address has only dots; a long id none).
    grouped = text.startswith("+") or "(" in text or (len(seps) >= 2 and any(s.strip(".") for s in seps))
    return "[phone]" if 9 <= len(digits) <= 15 and grouped else text


PATTERNS: dict[str, Callable[[str], str]] = {
    "email": lambda t: _EMAIL.sub("[email]", t) if "@" in t else t,
    "card": lambda t: _CARD.sub(_card, t),  # before phone: a card number also looks like digit groups
    "phone": lambda t: _PHONE.sub(_phone, t),
}


class Redactor:
    def __init__(self, cfg: PrivacySection):
        self.cfg = cfg
        self._steps = [(name, PATTERNS[name]) for name in ("email", "card", "phone") if name in cfg.redact]
        if cfg.redactor:
            fn = load_object(cfg.redactor)
            if not callable(fn):
                from services.common.config import ConfigError

                raise ConfigError(f"privacy.redactor {cfg.redactor!r} is not callable")
            self._steps.append(("custom", fn))

    @property
    def enabled(self) -> bool:
        return bool(self._steps)

    def text(self, value: str, hits: set[str]) -> str:
        for name, step in self._steps:
            new = step(value)
            if not isinstance(new, str):
                raise TypeError(f"privacy.redactor returned {type(new).__name__}, not str")
            if new != value:
                hits.add(name)
                value = new
        return value

    def _message(self, m: dict[str, Any], hits: set[str]) -> dict[str, Any]:
        out = dict(m)
        if isinstance(out.get("content"), str):
            out["content"] = self.text(out["content"], hits)
        if out.get("tool_calls"):
            out["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": self.text(c["function"]["arguments"], hits)}}
                if isinstance(c.get("function", {}).get("arguments"), str) else c
                for c in out["tool_calls"]
            ]
        return out

    def apply(self, records: list[Experience]) -> list[Experience]:
        """``records`` (the choices of one request, which share their messages) as they may be
        stored; the messages are redacted once, not once per choice."""
        if not self._steps or not records:
            return records
        prompt_hits: set[str] = set()
        messages = [self._message(m, prompt_hits) for m in records[0].messages]
        return [self._one(e, messages, prompt_hits) for e in records]

    def _one(self, e: Experience, messages: list[dict[str, Any]], prompt_hits: set[str]) -> Experience:
        hits = set(prompt_hits)
        response = self._message(e.response, hits)
        if not hits:
            return e
        privacy = {**(e.privacy or {}), "redacted": sorted(hits), "ids": "dropped" if self.cfg.redacted_ids == "drop"
                   else "kept (they decode to the unredacted text)"}
        update: dict[str, Any] = {"messages": messages, "response": response, "privacy": privacy}
        if self.cfg.redacted_ids == "drop":
            update.update(prompt_token_ids=[], response_token_ids=[], response_logprobs=[], trainable=False)
        return e.model_copy(update=update)


def consent(metadata: dict[str, Any] | None, default: bool) -> bool:
    """metadata.train (true/false), else the key's default."""
    value = (metadata or {}).get("train", default)
    if isinstance(value, str) and value.lower() in ("true", "false"):
        value = value.lower() == "true"
    if not isinstance(value, bool):
        from services.common.http.errors import APIError

        raise APIError(400, "metadata.train must be true or false", param="metadata.train")
    return value
