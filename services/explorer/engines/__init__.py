"""Rollout engines behind one Protocol: ``hf`` (embedded default) and ``vllm``."""

from __future__ import annotations

from services.explorer.engines.base import (
    AdapterRef,
    ChoiceUpdate,
    Engine,
    EngineError,
    EngineOverloaded,
    GenerateRequest,
    SamplingParams,
)

__all__ = [
    "AdapterRef",
    "ChoiceUpdate",
    "Engine",
    "EngineError",
    "EngineOverloaded",
    "GenerateRequest",
    "SamplingParams",
    "build_engine",
]


def build_engine(config) -> Engine:
    """The engine ``config.engine.kind`` names, not yet started."""
    e = config.engine
    if e.kind == "hf":
        from services.explorer.engines.hf import HFEngine

        return HFEngine(
            model_path=config.model.path,
            dtype=config.model.dtype,
            device=e.device,
            max_batch_size=e.max_batch_size,
            max_model_len=e.max_model_len,
            max_waiting=e.max_waiting,
            torch_threads=e.torch_threads,
            seed=e.seed,
        )
    if e.kind == "vllm":
        from services.explorer.engines.vllm import build_vllm_engine

        return build_vllm_engine(config)
    raise ValueError(f"unknown engine.kind {e.kind!r}")
