"""The engine bench's limit is the decode roofline: bandwidth-bound at small batches, compute-bound at large."""

from __future__ import annotations

import pytest

from tests.bench.smollm2 import Limits, ModelLimits


def test_the_decode_limit_is_the_smaller_of_bandwidth_times_batch_and_compute():
    # 100M params; bf16: 2 bytes each, so reading the weights once takes 200 MB
    ml = ModelLimits(100_000_000, [Limits(flops={"float32": 400e9, "bfloat16": 2_400e9}, read_bw=28e9, copy_bw=20e9)])
    assert ml.decode("bfloat16", 1) == pytest.approx(140)  # 28 GB/s / 200 MB
    assert ml.decode("bfloat16", 8) == pytest.approx(8 * 140)  # still bandwidth-bound: one read serves the batch
    assert ml.decode("bfloat16", 32) == pytest.approx(4_480)  # 32 x 140 < 2.4 TFLOP/s / 200 MFLOP = 12,000
    assert ml.decode("float32", 32) == pytest.approx(2_000)  # compute-bound: 400 GFLOP/s / 200 MFLOP
