"""The CPU's dtype choices: bfloat16 for training only where its products are measured at least as
fast as float32's; for decoding wherever the CPU computes it natively (services/common/models.py,
services/demo/tools_demo.py)."""

import pytest

from services.common import models
from services.demo import tools_demo


@pytest.fixture
def speedup(monkeypatch):
    """Set the process's measured bfloat16/float32 product speed ratio."""
    def put(value: float) -> None:
        monkeypatch.setattr(models, "_BF16_SPEEDUP", [value])
    return put


@pytest.mark.parametrize(("ratio", "dtype"), [(6.5, "bfloat16"), (1.0, "bfloat16"), (0.56, "float32"), (0.0, "float32")])
def test_training_takes_bfloat16_only_where_its_products_are_as_fast(speedup, ratio, dtype):
    speedup(ratio)
    assert models.cpu_training_dtype() == dtype
    assert tools_demo.trainer_dtype() == dtype


def test_without_native_bfloat16_nothing_is_measured(monkeypatch):
    monkeypatch.setattr(models, "_BF16_SPEEDUP", [])
    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(models, "_measure_bf16_speedup", lambda: pytest.fail("measured emulated bfloat16"))
    assert models.bf16_products_speedup() == 0.0
    assert models.cpu_training_dtype() == "float32"


def test_the_measurement_runs_once_a_process(monkeypatch):
    calls = []
    monkeypatch.setattr(models, "_BF16_SPEEDUP", [])
    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(models, "_measure_bf16_speedup", lambda: calls.append(1) or 0.7)
    assert models.bf16_products_speedup() == models.bf16_products_speedup() == 0.7
    assert calls == [1]


def test_the_real_measurement_is_a_ratio_of_two_timed_products():
    ratio = models._measure_bf16_speedup()
    assert 0.0 < ratio < 100.0


def test_the_engine_decodes_in_bfloat16_wherever_it_is_native(speedup, monkeypatch):
    speedup(0.56)  # the Xeon whose AMX is hidden: the Trainer in float32, the engine still in bfloat16
    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: True)
    assert (tools_demo.engine_dtype(), tools_demo.trainer_dtype()) == ("bfloat16", "float32")
    assert tools_demo.dtype_note("bfloat16", "float32") == (
        "the Explorer in bfloat16, the Trainer in float32 (bfloat16 products 0.56x float32's on this CPU)")
    monkeypatch.setattr(models, "cpu_has_native_bf16", lambda: False)
    speedup(0.0)
    assert (tools_demo.engine_dtype(), tools_demo.trainer_dtype()) == ("float32", "float32")
    assert tools_demo.dtype_note("float32", "float32").endswith("(no native bfloat16 on this CPU)")
