"""When the demonstrations-only arm stops improving (services/demo/demonstrations_only.py), worked by hand."""

from __future__ import annotations

import pytest

from services.demo.demonstrations_only import Plateau


def test_patience_counts_measurements_since_the_best():
    p = Plateau(patience=2)
    assert p.add(0, 0.10)  # best so far
    assert p.add(4, 0.30)  # better: the count restarts
    assert p.add(8, 0.25)  # one without a better score
    assert not p.add(12, 0.30)  # as good is not better: the second without, so it ends
    assert p.since_best == 2 and p.best == (4, 0.30)  # the earliest of the equal best scores


def test_a_better_score_keeps_it_going():
    p = Plateau(patience=1)
    assert p.add(0, 0.5)
    assert not p.add(4, 0.4)
    q = Plateau(patience=1)
    assert q.add(0, 0.5) and q.add(4, 0.6) and q.best == (4, 0.6)


def test_no_best_before_a_measurement():
    with pytest.raises(ValueError, match="no measurement"):
        _ = Plateau(patience=2).best
