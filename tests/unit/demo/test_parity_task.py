"""The parity task's warm start teaches the format and where to look, and nothing about parity."""

from __future__ import annotations

from collections import Counter

from services.demo import parity_task as task


def test_warm_start_code_is_right_for_exactly_half_the_digits():
    for seed in range(20):
        code = task.warm_start_code(seed)
        assert sorted(code) == list(range(10)) and set(code.values()) == {"even", "odd"}
        assert sum(code[d] == task.answer(d) for d in range(10)) == 5


def test_warm_start_labels_carry_no_parity_information():
    s = task.split(0, 800, 100, 20)
    code = task.warm_start_code(0)
    numbers = Counter(n for n, _ in s.warm_start)
    assert len(numbers) == 20 and set(numbers.values()) == {4}  # 20 questions, 4 labels each
    assert Counter(n % 10 for n in numbers) == Counter({d: 2 for d in range(10)})  # every last digit twice
    for n in numbers:  # the code's answer 3 times, the other once
        labels = Counter(label for m, label in s.warm_start if m == n)
        assert labels[code[n % 10]] == 3 and sum(labels.values()) == 4
    right = sum(label == task.answer(n) for n, label in s.warm_start)
    assert right == len(s.warm_start) // 2  # a model that learns these labels exactly scores 0.5
    assert set(numbers) <= set(s.train) and not set(numbers) & set(s.heldout)


def test_reward_needs_the_exact_first_word():
    assert task.reward(12, "even") == 1.0 and task.reward(12, "Even, because...") == 1.0
    assert task.reward(12, "odd") == 0.0 and task.reward(12, "eveneven") == 0.0 and task.reward(12, None) == 0.0
