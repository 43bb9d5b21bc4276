"""Token quotas reserved up front and settled after (services/common/http/access.py Quotas): a burst
of concurrent requests cannot overshoot a key's tokens a minute by more than one request."""

from __future__ import annotations

import pytest

from services.common.http.access import Principal, Quotas


def key(per_min: int | None = 100) -> Principal:
    return Principal(name="k", scopes=frozenset({"chat"}), tokens_per_min=per_min)


def test_a_burst_is_admitted_only_while_its_reservations_fit():
    q, k = Quotas(), key(100)
    # four requests at once, each a 10-token prompt with max_tokens 30: 40 tokens reserved each
    admitted = [q.reserve_tokens(k, 40) is None for _ in range(4)]
    assert admitted == [True, True, False, False]  # 80 of 100 taken; a third would need 40 of the 20 left
    wait = q.reserve_tokens(k, 40)
    assert wait == pytest.approx(20 * 60 / 100, abs=0.5)  # 20 more tokens refill in 12 s
    q.settle_tokens(k, 40, 12)  # the first answer used 2 of its 30 completion tokens: 28 come back
    assert q.reserve_tokens(k, 40) is None


def test_settling_never_fills_a_bucket_past_its_capacity_and_keys_without_a_quota_take_nothing():
    q, k = Quotas(), key(100)
    assert q.reserve_tokens(k, 10) is None
    q.settle_tokens(k, 10, 0)
    q.settle_tokens(k, 500, 0)  # a settle that would overfill it stops at the capacity
    assert q.reserve_tokens(k, 100) is None and q.reserve_tokens(k, 1) is not None
    free = key(None)
    assert all(q.reserve_tokens(free, 10**6) is None for _ in range(3))


def test_a_request_larger_than_the_whole_quota_goes_through_a_full_bucket_and_the_next_waits():
    q, k = Quotas(), key(40)
    assert q.reserve_tokens(k, 90) is None  # more than a minute's worth, on a full bucket: admitted
    q.settle_tokens(k, 90, 70)  # it used 70: the bucket stands at -30
    wait = q.reserve_tokens(k, 5)
    assert wait == pytest.approx(35 * 60 / 40, abs=0.5)
    assert q.admit(k) is not None  # and the request-level check refuses before any prompt is rendered


def test_a_running_reservation_never_locks_the_key_out_of_its_other_endpoints():
    q, k = Quotas(), key(1000)
    assert q.reserve_tokens(k, 8000) is None  # no max_tokens: the rest of an 8k context, on a full bucket
    assert q.admit(k) is None  # /feedback, /commit and the rest look at what was charged, not what is held
    assert q.reserve_tokens(k, 10) is not None  # another model request waits for it
    q.settle_tokens(k, 8000, 50)  # it used 50
    assert q.admit(k) is None and q.reserve_tokens(k, 900) is None
