"""Rollout engines behind one Protocol: ``hf`` (embedded default) and ``vllm``."""

from __future__ import annotations

from services.explorer.serving.engines.base import (
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
    """The engine ``config.engine.kind`` names (``engine.replicas`` of them behind one), not yet started."""
    replicas = config.engine.replicas
    engines = [_build_one(config, i) for i in range(replicas)]
    if replicas == 1:
        return engines[0]
    from services.explorer.serving.engines.replicas import ReplicatedEngine

    return ReplicatedEngine(engines)


def _build_one(config, replica: int) -> Engine:
    e = config.engine
    if e.kind == "hf":
        from services.explorer.serving.engines.hf import HFEngine

        device = e.device
        if e.replicas > 1 and device == "cuda":
            device = f"cuda:{replica}"  # one GPU per replica
        return HFEngine(
            model_path=config.model.path,
            chat_template=config.model.chat_template,
            dtype=config.model.dtype,
            device=device,
            max_batch_size=e.max_batch_size,
            max_model_len=e.max_model_len,
            max_waiting=e.max_waiting,
            torch_threads=e.torch_threads,
            seed=e.seed + replica,
            shared_prefix_min_tokens=e.shared_prefix_min_tokens,
            prefix_cache_mb=e.prefix_cache_mb,
            packed_weights=e.packed_weights,
            decode_attention=e.cpu_decode_attention,
            fast_decode=e.fast_decode,
            decode_kernels=e.decode_kernels,
        )
    if e.kind == "vllm":
        from services.explorer.serving.engines.vllm import build_vllm_engine

        return build_vllm_engine(config, replica=replica)
    raise ValueError(f"unknown engine.kind {e.kind!r}")
