"""The learning-rate schedule (optim.warmup_steps, decay_steps, decay, min_lr_ratio), worked by hand."""

import math

import pytest
from pydantic import ValidationError

from services.trainer.config import OptimSection


def test_constant_without_a_schedule():
    o = OptimSection(lr=1e-3)
    assert [o.lr_at(s) for s in (0, 1, 100)] == [1e-3, 1e-3, 1e-3]


def test_warmup_then_constant():
    o = OptimSection(lr=1e-3, warmup_steps=4)
    assert [o.lr_at(s) for s in range(6)] == pytest.approx([0.25e-3, 0.5e-3, 0.75e-3, 1e-3, 1e-3, 1e-3])


def test_linear_decay_to_the_floor_and_stays():
    # 10 steps from 1e-3 to 0.1 x: each step 0.09e-3 lower; the floor from step 10 on
    o = OptimSection(lr=1e-3, decay_steps=10, decay="linear", min_lr_ratio=0.1)
    assert o.lr_at(0) == pytest.approx(1e-3)
    assert o.lr_at(5) == pytest.approx(0.55e-3)
    assert [o.lr_at(s) for s in (10, 11, 1000)] == pytest.approx([1e-4, 1e-4, 1e-4])


def test_cosine_decay_after_warmup():
    # warm-up 2 steps (0.5, 1.0), then cosine over 4: half-way (step 2 + 2) is the mean of lr and the floor
    o = OptimSection(lr=2e-3, warmup_steps=2, decay_steps=4, min_lr_ratio=0.0)
    assert o.lr_at(0) == pytest.approx(1e-3)
    assert o.lr_at(2) == pytest.approx(2e-3)
    assert o.lr_at(3) == pytest.approx(2e-3 * (1 + math.cos(math.pi / 4)) / 2)
    assert o.lr_at(4) == pytest.approx(1e-3)
    assert o.lr_at(6) == pytest.approx(0.0)
    assert o.lr_at(7) == pytest.approx(0.0)


def test_bad_settings_are_named():
    with pytest.raises(ValidationError, match="min_lr_ratio"):
        OptimSection(decay_steps=4, min_lr_ratio=1.5)
    with pytest.raises(ValidationError, match="decay_steps"):
        OptimSection(decay_steps=0)
    with pytest.raises(ValidationError, match="decay"):
        OptimSection(decay="step")
    with pytest.raises(ValidationError, match="optim.min_lr_ratio shapes the learning rate's decay: it needs optim.decay_steps"):
        OptimSection(min_lr_ratio=0.5)
    with pytest.raises(ValidationError, match="optim.decay shapes"):
        OptimSection(decay="linear")
    with pytest.raises(ValueError, match="step must be >= 0"):
        OptimSection().lr_at(-1)


def test_a_config_dumped_whole_validates_again():
    # the Trainer sends its config to the learners as a dump naming every key
    for o in (OptimSection(), OptimSection(decay_steps=8, decay="linear", min_lr_ratio=0.0)):
        assert OptimSection.model_validate(o.model_dump(mode="json")) == o
