"""The built-in redaction patterns, case by case: what they replace and what they must leave alone."""

from __future__ import annotations

import pytest

from services.explorer.config import PrivacySection
from services.explorer.recording.privacy import Redactor


def _redact(text: str, *patterns: str) -> str:
    return Redactor(PrivacySection(redact=list(patterns or ("email", "phone", "card")))).text(text, set())


@pytest.mark.parametrize("text, expected", [
    ("write to jane.doe+kz@mail.example.co.uk today", "write to [email] today"),
    ("call +1 415-555-0100 now", "call [phone] now"),
    ("call (415) 555 0100", "call [phone]"),
    ("ring 030 1234 5678", "ring [phone]"),
    ("card 4111 1111 1111 1111, exp 12/30", "card [card], exp 12/30"),
    ("card 5500-0000-0000-0004", "card [card]"),
])
def test_what_is_redacted(text, expected):
    assert _redact(text) == expected


@pytest.mark.parametrize("text", [
    "12 + 35 = 47", "calc(1234 * 5678)", "the year 2026-11-25", "pi is 3.14159265", "order 123456789",
    "4111 1111 1111 1112",  # fails the Luhn check: not a card
    "version v1.2.3", "user@localhost", "host 192.168.100.200", "12 345 678",
])
def test_what_is_left_alone(text):
    assert _redact(text) == text


def test_only_the_chosen_patterns_and_the_hits_are_named():
    hits: set[str] = set()
    r = Redactor(PrivacySection(redact=["email"]))
    assert r.text("a@b.io or +1 415-555-0100", hits) == "[email] or +1 415-555-0100" and hits == {"email"}


def test_email_parts_are_bounded():
    """RFC 5321's lengths bound the pattern: a local part of 100 letters keeps its first 36 (and a
    long run of letters costs linear time, not quadratic)."""
    assert _redact("x" * 100 + "@example.com", "email") == "x" * 36 + "[email]"
    assert _redact("y" * 50_000, "email") == "y" * 50_000
