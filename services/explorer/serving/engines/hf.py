"""The embedded rollout engine: transformers + peft with continuous batching, on CPU or GPU.

One background thread owns the model. Every step it admits waiting requests (a batched prefill
whose KV cache is merged into the running batch), samples one token for every running sequence,
and runs one batched decode forward. Sequences leave the batch as soon as they finish, so short
and long requests share the model without waiting for each other. Sequences of different agents
share one forward through peft's mixed-adapter batches; adapters are loaded and removed between
steps, so a new version never disturbs a request already running on the old one.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import queue
import sys
import threading
import time
import traceback
from typing import Any, AsyncIterator

import torch

from services.common.grammar import GrammarCache
from services.common.models import (
    ModelLoadError, load_base_model, resolve_device, resolve_dtype, shared_prefix_len, stop_token_ids,
)
from services.explorer.serving.engines.base import (
    AdapterRef,
    ChoiceUpdate,
    EngineError,
    EngineOverloaded,
    EngineStats,
    GenerateRequest,
)
from services.explorer.serving.engines.detokenizer import IncrementalDetokenizer
from services.explorer.serving.engines.fast_decode import FastDecoder
from services.explorer.serving.engines.hf_batch import QueuedRequest, Row, aborted_update, pad_left
from services.explorer.serving.engines.cpu_paths import (
    default_torch_threads, linear_bytes, pack_linears, packing_budget, packing_helps, use_decode_attention,
)
from services.explorer.serving.engines.prefix_cache import Layers, PrefixCache

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.0005
_STOP_WAIT_S = 30.0  # how long shutdown waits for the engine thread to finish its step and stop


class HFEngine:
    """Continuous-batching engine over a transformers causal LM with peft LoRA adapters."""

    def __init__(
        self,
        *,
        model_path: str,
        chat_template: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        max_batch_size: int = 32,
        max_model_len: int | None = None,
        max_waiting: int = 4096,
        prefill_token_budget: int = 8192,
        torch_threads: int | None = None,
        seed: int = 0,
        shared_prefix_min_tokens: int = 32,
        prefix_cache_mb: int = 256,
        packed_weights: bool | None = None,
        decode_attention: bool = True,
        fast_decode: bool = True,
        decode_kernels: bool | None = None,
        batch_own_prefixes: bool = True,
        dedupe_prompts: bool = True,
    ):
        self.model_path = model_path
        self._chat_template = chat_template
        self._device = resolve_device(device)
        self._dtype = resolve_dtype(dtype, self._device)
        self.max_batch_size = max_batch_size
        self._max_model_len_cfg = max_model_len
        self.max_waiting = max_waiting
        self.prefill_token_budget = prefill_token_budget
        self._torch_threads = torch_threads or default_torch_threads(self._device)
        self._seed = seed
        # Requests admitted together whose prompts share at least this many leading tokens compute
        # that prefix once (0: never). Agents' prompts share their system prompt and tool list.
        self.shared_prefix_min_tokens = shared_prefix_min_tokens
        # Keys and values of prompts computed before, reused by later requests that start the same way
        # (prefix_cache.py): within this many MiB, runs of at least 32 tokens (or the sharing minimum).
        self._prefix = PrefixCache(prefix_cache_mb << 20, min_tokens=shared_prefix_min_tokens or 32)
        # requests admitted together that each continue a conversation the prefix cache holds (the next calls of
        # several episodes) are prefilled in one batch, each row on its own cached prefix (False: one by one)
        self.batch_own_prefixes = batch_own_prefixes
        # identical prompts admitted together on one adapter (a task's runs) are computed once (False: each its own)
        self.dedupe_prompts = dedupe_prompts
        # the CPU's fast paths (cpu_paths.py): linear layers on pre-packed weights (None: decided by the CPU
        # and dtype) and the decode steps' attention as plain products
        self._packed_weights = packed_weights  # None: if packing_helps and the copy fits packing_budget
        if packed_weights and self._device.type != "cpu":
            raise EngineError(f"engine.packed_weights is for the CPU; this engine runs on {self._device}")
        self._decode_attention = decode_attention and self._device.type == "cpu"
        # decode steps on the CPU through fast_decode.py's own forward (None: transformers' forward)
        self._fast_decode = fast_decode and self._device.type == "cpu"
        self.fast: FastDecoder | None = None
        self._ksample = None  # decode_kernels.sample, where the step runs on the kernels
        self.fast_decode_steps = 0
        # the fast decode step on our own kernels (decode_kernels.py; None: where they run)
        self._decode_kernels = decode_kernels
        if decode_kernels and not self._fast_decode:
            raise EngineError("engine.decode_kernels runs in the engine's own decode step: it needs engine.fast_decode "
                              f"on a CPU (fast_decode {fast_decode}, device {self._device})")
        self.packed_linears = 0
        self.decode_attention = False  # whether the model took it (an SDPA model does)
        self.tokenizer: Any = None
        self.max_model_len: int = 0
        self._base: Any = None
        self._peft: Any = None
        self._adapters: dict[str, AdapterRef] = {}
        self._active_adapter: str | None = None
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: collections.deque[QueuedRequest] = collections.deque()
        self._rows: list[Row] = []
        self._cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer: keys, values (B, KV, T, D)
        self._hf_cache: tuple[Any, list] | None = None  # (the DynamicCache a transformers step returned, the list taken from it)
        self._attn: torch.Tensor | None = None
        self._pos: torch.Tensor | None = None
        self._logits: torch.Tensor | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        # the engine thread answers every command queued before it closes the queue on stopping (under this
        # lock); a command submitted later fails at once: nothing would ever answer it
        self._queue_lock = threading.Lock()
        self._closed = False
        self._gen = torch.Generator().manual_seed(seed)
        self._eos: set[int] = set()
        self._grammar_cache: GrammarCache | None = None
        self.steps = 0
        self.tokens_generated = 0
        # seconds the engine's thread spent in each phase (prefill: admitting requests; decode: the forward of a
        # step; sample: sampling, emitting and pruning), for /metrics: what a busy engine does with its time
        self.busy_seconds = {"prefill": 0.0, "decode": 0.0, "sample": 0.0}
        self.shared_prefix_tokens_saved = 0  # prompt tokens not recomputed thanks to a shared prefix
        self.prompts_deduplicated = 0  # requests whose prompt another one admitted with them computed

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await asyncio.to_thread(self._load)
        # The engine thread holds the GIL only between torch ops, in short bursts; with Python's
        # default 5 ms switch interval it waits up to that long to get it back from the HTTP thread
        # after every op. A shorter interval hands it back sooner (the server shares one process).
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._thread = threading.Thread(target=self._run, name="hf-engine", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        try:
            self.tokenizer, model = load_base_model(self.model_path, dtype=self._dtype, device=self._device,
                                                    chat_template=self._chat_template)
        except ModelLoadError as e:
            raise EngineError(str(e)) from e
        model.eval()
        extra = linear_bytes(model)
        if self._packed_weights is None:
            self._packed_weights = packing_helps(self._dtype, self._device) and extra <= packing_budget()
        if self._packed_weights:
            try:
                self.packed_linears = pack_linears(model)
            except RuntimeError as e:
                raise EngineError(f"engine.packed_weights: oneDNN cannot pack this model's {self._dtype} weights on this "
                                  f"CPU ({e}); leave it unset or false") from e
        if self._decode_attention:
            self.decode_attention = use_decode_attention(model)
        fast_note = "off"
        if self._fast_decode:
            # the fused copies take what packing left of the budget (packing_budget: a quarter of the memory available)
            budget = packing_budget() - (extra if self.packed_linears else 0)
            self.fast, why = FastDecoder.build(model, self._device, packed=bool(self.packed_linears), fuse_budget=budget,
                                               kernels=self._decode_kernels)
            if self._decode_kernels and self.fast is None:
                raise EngineError(f"engine.decode_kernels: the engine's own decode step cannot run: {why}")
            fast_note = (f"on ({self.fast.extra_bytes / 2**20:.0f} MiB of fused and kernel weights; on decode_kernels: "
                         f"{self.fast.kernels_note()})" if self.fast else f"off: {why}")
        # the sampler on the kernels too, where the step runs on them (decode_kernels.cpp: sample)
        self._ksample = self.fast._kmod.sample if self.fast is not None and self.fast._kmod is not None else None
        self._base = model
        ctx = getattr(model.config, "max_position_embeddings", None) or 2048
        self.max_model_len = min(self._max_model_len_cfg or ctx, ctx)
        self._eos = stop_token_ids(self.tokenizer, model)
        log.info(
            "hf engine: %s on %s (%s), max_model_len %d, max_batch_size %d, %d linear layers on packed weights "
            "(%.0f MiB more memory), decode attention %s, fast decode %s, %s torch threads", self.model_path, self._device,
            self._dtype, self.max_model_len, self.max_batch_size, self.packed_linears,
            extra / 2**20 if self.packed_linears else 0.0, "as products" if self.decode_attention else "by the model's own",
            fast_note,
            self._torch_threads or torch.get_num_threads(),
        )

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self._stopping = True
        self._submit(("stop",), quiet=True)
        await asyncio.to_thread(self._thread.join, _STOP_WAIT_S)
        if self._thread.is_alive():  # left behind (a daemon thread): say so, the shutdown goes on without it
            frame = sys._current_frames().get(self._thread.ident)
            log.warning("hf engine: its thread did not stop within %.0f s (%d rows running, %d waiting); it is at\n%s",
                        _STOP_WAIT_S, len(self._rows), len(self._waiting),
                        "".join(traceback.format_stack(frame)) if frame is not None else "(no frame)")
        self._thread = None

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self._rows),
            waiting=len(self._waiting) + self._cmds.qsize(),
            extra={
                "steps": float(self.steps),
                "tokens_generated": float(self.tokens_generated),
                "shared_prefix_tokens_saved": float(self.shared_prefix_tokens_saved),
                "prompts_deduplicated": float(self.prompts_deduplicated),
                "prefix_cache_hits": float(self._prefix.hits),
                "prefix_cache_tokens_reused": float(self._prefix.tokens_reused),
                "prefix_cache_bytes": float(self._prefix.bytes),
                "fast_decode_steps": float(self.fast_decode_steps),
                "fast_decode_kernel_steps": float(fast.kernel_steps if (fast := self.fast) is not None else 0),
                **{f"busy_{phase}_seconds": seconds for phase, seconds in self.busy_seconds.items()},
            },
        )

    # ------------------------------------------------------------------ public async API

    async def generate(self, request: GenerateRequest) -> AsyncIterator[list[ChoiceUpdate]]:
        if request.n > self.max_batch_size:
            raise ValueError(f"n={request.n} exceeds the engine's max_batch_size {self.max_batch_size}")
        if len(self._waiting) >= self.max_waiting:
            raise EngineOverloaded(f"{len(self._waiting)} requests already waiting")
        if self._stopping:
            raise EngineError("engine shut down")
        if self._thread is None:
            raise EngineError("engine is not running")
        state = QueuedRequest(req=request, loop=asyncio.get_running_loop(), out=asyncio.Queue())
        self._submit(("req", state))
        remaining = request.n
        try:
            while remaining:
                item = await state.out.get()
                if isinstance(item, BaseException):
                    raise EngineError(f"engine failed: {item}") from item
                remaining -= sum(1 for u in item if u.finish_reason is not None)
                yield item
        finally:
            if remaining:
                self._submit(("abort", state), quiet=True)

    async def abort(self, request_id: str) -> None:
        self._submit(("abort_id", request_id), quiet=True)

    async def add_adapter(self, adapter: AdapterRef) -> None:
        await self._call_in_engine("add", adapter)

    @property
    def adapters(self) -> list[str]:
        """Names of the adapter versions loaded now."""
        return list(self._adapters)

    async def remove_adapter(self, adapter: AdapterRef) -> None:
        await self._call_in_engine("remove", adapter)

    async def clear_prefix_cache(self) -> None:
        """Drop every entry of the prefix cache (on the engine's thread, which alone touches it)."""
        await self._call_in_engine("clear", None)

    async def _call_in_engine(self, op: str, arg: Any) -> None:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopping:  # stopping or stopped (its thread may still run): never beside it, never on a dead engine
            raise EngineError("engine shut down")
        if self._thread is None:  # not started yet: run inline
            self._command(op, arg)
            return
        self._submit((op, arg, fut))
        await asyncio.wrap_future(fut)

    def _submit(self, cmd: tuple, *, quiet: bool = False) -> None:
        """Queue ``cmd`` for the engine thread; once it has stopped, EngineError (or nothing, ``quiet``:
        an abort or a stop has nothing left to act on)."""
        with self._queue_lock:
            if not self._closed:
                self._cmds.put(cmd)
                return
        if not quiet:
            raise EngineError("engine shut down")

    # ------------------------------------------------------------------ adapters (engine thread)

    def _command(self, op: str, arg: Any) -> None:
        if op == "clear":
            self._prefix.clear()
        else:
            getattr(self, f"_{op}_adapter")(arg)

    def _add_adapter(self, ref: AdapterRef) -> None:
        if ref.name in self._adapters:
            return
        from peft import PeftModel

        t0 = time.monotonic()
        self._prefix.drop_adapter(ref.name)  # keys and values are only ever served for the weights that computed them
        if self._peft is None:
            self._peft = PeftModel.from_pretrained(self._base, ref.path, adapter_name=ref.name)
            self._peft.eval()
        else:
            self._peft.load_adapter(ref.path, adapter_name=ref.name)
        self._peft.to(self._device)
        if self._dtype in (torch.bfloat16, torch.float16) and self._device.type == "cpu":
            # peft keeps adapters in float32 and casts every activation up to it and each sum back down,
            # three copies per adapted layer per step; nothing trains here, so the adapter takes the
            # weights' dtype (the Trainer runs its float32 adapter's products in that dtype too)
            for name, param in self._peft.named_parameters():
                if f".{ref.name}." in name and "lora_" in name:
                    param.data = param.data.to(self._dtype)
        self._active_adapter = None  # peft may have switched the active adapter
        if self.fast is not None:
            self.fast.add_adapter(ref.name, self._peft)
        self._adapters[ref.name] = ref
        log.info("loaded adapter %s from %s in %.0f ms", ref.name, ref.path, (time.monotonic() - t0) * 1e3)

    def _remove_adapter(self, ref: AdapterRef) -> None:
        if ref.name not in self._adapters:
            return
        if any(r.adapter_name == ref.name and not r.request.aborted for r in self._rows):
            raise EngineError(f"adapter {ref.name} is still in use by a running request")
        self._peft.delete_adapter(ref.name)
        if self.fast is not None:
            self.fast.remove_adapter(ref.name)
        self._prefix.drop_adapter(ref.name)
        self._active_adapter = None
        del self._adapters[ref.name]
        log.info("removed adapter %s", ref.name)

    # ------------------------------------------------------------------ engine loop

    def _run(self) -> None:
        try:
            self._loop()
        finally:  # however the loop ended, what was queued is answered and nothing waits after it
            self._close()

    def _loop(self) -> None:
        if self._torch_threads:
            torch.set_num_threads(self._torch_threads)  # per thread under OpenMP: set it here
        while not self._stopping:
            try:
                self._drain_commands(block=not self._rows and not self._waiting)
                if self._stopping:
                    break
                busy, t0 = self.busy_seconds, time.perf_counter()
                if self._waiting and len(self._rows) < self.max_batch_size:
                    self._admit()
                    t1 = time.perf_counter()
                    busy["prefill"] += t1 - t0
                    t0 = t1
                if not self._rows:
                    continue
                self._sample_and_emit()
                self._prune()
                t1 = time.perf_counter()
                busy["sample"] += t1 - t0
                if self._rows:
                    self._decode()
                    busy["decode"] += time.perf_counter() - t1
                self.steps += 1
            except Exception as e:  # never let one bad batch kill the engine
                log.exception("engine step failed; failing %d running requests", len(self._rows))
                failed = {id(r.request): r.request for r in self._rows}
                for st in failed.values():
                    self._send(st, e)
                self._reset_batch()

    def _close(self) -> None:
        """The engine thread's last act: close the queue (a command submitted from now on fails at once)
        and answer every request and adapter command still in it, or in the batch, with "engine shut down"."""
        self._stopping = True
        err = EngineError("engine shut down")
        with self._queue_lock:
            self._closed = True
            left: list[tuple] = []
            while True:
                try:
                    left.append(self._cmds.get_nowait())
                except queue.Empty:
                    break
        for cmd in left:
            if cmd[0] == "req":
                self._waiting.append(cmd[1])
            elif cmd[0] in ("add", "remove", "clear") and cmd[2].set_running_or_notify_cancel():
                cmd[2].set_exception(err)
        for r in self._rows:
            self._send(r.request, err)
        for st in self._waiting:
            self._send(st, err)

    def _drain_commands(self, block: bool) -> None:
        while True:
            try:
                cmd = self._cmds.get(block=block, timeout=None) if block else self._cmds.get_nowait()
            except queue.Empty:
                return
            block = False
            kind = cmd[0]
            if kind == "req":
                self._waiting.append(cmd[1])
            elif kind == "abort":
                cmd[1].aborted = True
            elif kind == "abort_id":
                for st in list(self._waiting) + [r.request for r in self._rows]:
                    if st.req.request_id == cmd[1]:
                        st.aborted = True
            elif kind in ("add", "remove", "clear"):
                fut = cmd[2]
                if not fut.set_running_or_notify_cancel():
                    continue  # its caller was cancelled (a shutdown, a timeout) before the command ran: it never runs
                try:
                    self._command(kind, cmd[1])
                    fut.set_result(None)
                except Exception as e:
                    fut.set_exception(e)
            elif kind == "stop":
                self._stopping = True
                return

    def _send(self, st: QueuedRequest, item: Any) -> None:
        try:
            st.loop.call_soon_threadsafe(st.out.put_nowait, item)
        except RuntimeError:
            pass  # the caller's event loop is gone

    def _reset_batch(self) -> None:
        self._rows, self._cache, self._attn, self._pos, self._logits = [], None, None, None, None
        self._hf_cache = None
        if self.fast is not None:
            self.fast.release()

    def _forward(self, input_ids, attention_mask, position_ids, cache, adapters: list[str | None]):
        """One forward pass, choosing the cheapest way to apply this batch's adapters."""
        kwargs = dict(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        with torch.inference_mode():
            if self._peft is None or not self._adapters:
                return self._base(**kwargs)
            distinct = set(adapters)
            if distinct == {None}:
                with self._peft.disable_adapter():
                    return self._peft(**kwargs)
            if len(distinct) == 1:
                name = adapters[0]
                if self._active_adapter != name:
                    self._peft.set_adapter(name)
                    self._active_adapter = name
                return self._peft(**kwargs)
            return self._peft(**kwargs, adapter_names=[a or "__base__" for a in adapters])

    def _admit(self) -> None:
        """Prefill waiting requests and merge them into the running batch."""
        budget = self.prefill_token_budget
        space = self.max_batch_size - len(self._rows)
        admitted: list[QueuedRequest] = []
        while self._waiting:
            st = self._waiting[0]
            if st.aborted:
                self._waiting.popleft()
                self._send(st, [aborted_update(i) for i in range(st.req.n)])
                continue
            cost = len(st.req.prompt_token_ids)
            if st.req.n > space or (admitted and cost > budget):
                break
            self._waiting.popleft()
            admitted.append(st)
            space -= st.req.n
            budget -= cost
        admitted = [st for st in admitted if self._grammar_ready(st)]
        for group, own in self._prefill_groups(admitted):
            self._admit_group(group, own=own)

    def _prefill_groups(self, admitted: list[QueuedRequest]) -> list[tuple[list[QueuedRequest], bool]]:
        """The requests to prefill together, each group with whether its rows start from their own cached
        prefixes. A request whose own conversation the prefix cache holds well beyond what the others
        share with it (the next call of an episode) is prefilled on top of its cached keys and values:
        all such requests in one batch, each row on its own prefix (one at a time without
        ``batch_own_prefixes``); the rest together, sharing their common prefix."""
        if len(admitted) < 2 or not self._prefix.enabled:
            return [(admitted, False)] if admitted else []
        prompts = [st.req.prompt_token_ids for st in admitted]
        adapters = [st.req.adapter.name if st.req.adapter else None for st in admitted]
        by_adapter: dict[str | None, list[list[int]]] = {}
        for p, a in zip(prompts, adapters):
            by_adapter.setdefault(a, []).append(p)
        # what each adapter's requests share among themselves (one request alone shares nothing)
        common = {a: shared_prefix_len(ps) if len(ps) > 1 else 0 for a, ps in by_adapter.items()}
        alone = [self._prefix.peek(a, p[:-1]) - common[a] >= self._prefix.min_tokens for p, a in zip(prompts, adapters)]
        together = [st for st, a in zip(admitted, alone) if not a]
        own = [st for st, a in zip(admitted, alone) if a]
        groups = [(own, True)] if self.batch_own_prefixes and own else [([st], True) for st in own]
        return groups + ([(together, False)] if together else [])

    def _admit_group(self, admitted: list[QueuedRequest], own: bool = False) -> None:
        """Prefill ``admitted`` in one batch (``own``: each on its own cached prefix) and merge them into
        the running batch."""
        # identical prompts on one adapter (the runs of one task, asked at once) are computed once: owner[k] is the
        # prompt that admitted[k] takes
        row: dict[Any, int] = {}  # a prompt (adapter, ids) -> its row in the prefill
        owner, firsts = [], []
        for k, st in enumerate(admitted):
            key = (st.req.adapter.name if st.req.adapter else None, tuple(st.req.prompt_token_ids)) if self.dedupe_prompts else k
            if key not in row:
                row[key] = len(firsts)
                firsts.append(st)
            owner.append(row[key])
        prompts = [st.req.prompt_token_ids for st in firsts]
        adapters = [st.req.adapter.name if st.req.adapter else None for st in firsts]
        try:
            out, mask = self._prefill_own(prompts, adapters) if own and len(prompts) > 1 else self._prefill(prompts, adapters)
        except Exception as e:  # fail these requests only; the running batch is untouched
            log.exception("prefill of %d requests failed", len(admitted))
            for st in admitted:
                self._send(st, e)
            return
        self.prompts_deduplicated += len(admitted) - len(prompts)
        # Each prompt was computed once; its requests and their n choices share (copies of) its cache.
        expand = torch.repeat_interleave(
            torch.tensor(owner), torch.tensor([st.req.n for st in admitted])
        ).to(self._device)
        new_layers = [(k.index_select(0, expand), v.index_select(0, expand)) for k, v, *_ in out.past_key_values]
        new_logits = out.logits[:, -1, :].float().index_select(0, expand)
        new_mask = mask.index_select(0, expand)
        new_pos = torch.tensor([len(p) for p in prompts], dtype=torch.long, device=self._device).index_select(0, expand)
        new_rows = []
        for st in admitted:
            p = st.req.params
            for i in range(st.req.n):
                gen = None
                if p.seed is not None:
                    gen = torch.Generator().manual_seed((p.seed * 1_000_003 + i) % (2**63))
                detok = IncrementalDetokenizer(self.tokenizer, p.stop) if (st.req.stream or p.stop) else None
                matcher = self._grammars().matcher(p.grammar) if p.grammar else None
                new_rows.append(Row(st, i, gen, detok, len(st.req.prompt_token_ids), matcher=matcher))
        if not self._rows:
            self._cache = new_layers
            self._attn, self._pos, self._logits = new_mask, new_pos, new_logits
        else:
            old_t, new_t = self._attn.shape[1], new_mask.shape[1]
            t = max(old_t, new_t)
            merged = []
            for (ko, vo), (kn, vn) in zip(self._cache, new_layers):
                merged.append((
                    torch.cat([pad_left(ko, t - old_t, 2), pad_left(kn, t - new_t, 2)], 0),
                    torch.cat([pad_left(vo, t - old_t, 2), pad_left(vn, t - new_t, 2)], 0),
                ))
            self._cache = merged
            self._attn = torch.cat([pad_left(self._attn, t - old_t, 1), pad_left(new_mask, t - new_t, 1)], 0)
            self._pos = torch.cat([self._pos, new_pos])
            self._logits = torch.cat([self._logits, new_logits])
        self._rows.extend(new_rows)

    def _shared_prefix_len(self, prompts: list[list[int]], adapters: list[str | None]) -> int:
        """Leading tokens common to all ``prompts`` worth computing once (0: none).

        Only when every prompt runs on the same adapter (a prefix's KV depends on it), and never
        the whole of a prompt: each one keeps at least one token of its own to compute its logits.
        """
        if self.shared_prefix_min_tokens <= 0 or len(prompts) < 2 or len(set(adapters)) != 1:
            return 0
        n = shared_prefix_len(prompts)
        return n if n >= self.shared_prefix_min_tokens else 0

    def _prefill(self, prompts: list[list[int]], adapters: list[str | None]):
        """One batched prefill of ``prompts``: (model output, attention mask on the device).

        Prompts are left-padded to one width. When they share a long enough prefix, or one prompt
        starts with tokens the prefix cache holds, that prefix is not part of the batch: its keys and
        values (from the cache, the rest of it computed once as a (1, L) forward on top) join every
        row, and only the suffixes (left-padded among themselves) are run on top of them; the mask is
        then [ones(L), suffix mask], padding in the middle, and positions come from its cumsum, so
        every token sees exactly what it would have seen in a forward of its whole prompt.
        """
        from transformers import DynamicCache

        dev = self._device
        shared, cached, layers = self._prefix_plan(prompts, adapters)
        ids, mask = self._left_padded([p[shared:] for p in prompts])
        mask = mask.to(dev)
        cache = DynamicCache()
        if shared:
            if shared > cached:  # what the cache lacks of the prefix, computed once on top of what it has
                prefix = torch.tensor([prompts[0][cached:shared]], dtype=torch.long, device=dev)
                past = DynamicCache(ddp_cache_data=layers) if layers else DynamicCache()
                pre = self._forward(prefix, torch.ones((1, shared), dtype=torch.long, device=dev),
                                    torch.arange(cached, shared, device=dev).unsqueeze(0), past, adapters[:1])
                layers = [(k, v) for k, v, *_ in pre.past_key_values]
                self._prefix.store(adapters[0], prompts[0][:shared], layers)
            rows = torch.zeros(len(prompts), dtype=torch.long, device=dev)
            cache = DynamicCache(ddp_cache_data=[(k.index_select(0, rows), v.index_select(0, rows)) for k, v in layers])
            mask = torch.cat([mask.new_ones((len(prompts), shared)), mask], dim=1)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, shared:]
        out = self._forward(ids.to(dev), mask, pos, cache, adapters)
        if shared:
            self.shared_prefix_tokens_saved += shared * (len(prompts) - 1)
        return out, mask

    def _left_padded(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, mask), each (len(seqs), longest): the sequences left-padded to one width, on the CPU."""
        pad = self.tokenizer.pad_token_id or 0
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s) :] = 1
        return ids, mask

    def _prefill_own(self, prompts: list[list[int]], adapters: list[str | None]):
        """One batched prefill of prompts that each start with tokens the prefix cache holds (the next
        calls of several episodes): (model output, attention mask on the device).

        Each row's cached keys and values, left-padded to the longest, come first, then its own
        suffix, left-padded among the suffixes; the mask is [cached part, suffix part], padding in
        both, and positions come from its cumsum, so every token sees exactly its own conversation,
        as if it had been prefilled alone on top of its cache (``_prefill`` of one prompt)."""
        from transformers import DynamicCache

        found = [self._prefix.lookup(a, p[:-1]) for p, a in zip(prompts, adapters)]
        if any(layers is None for _, layers in found):  # not what _prefill_groups saw: each as a plain prompt
            return self._prefill(prompts, adapters)
        past = max(m for m, _ in found)
        ids, tail = self._left_padded([p[m:] for p, (m, _) in zip(prompts, found)])
        head = torch.zeros((len(prompts), past), dtype=torch.long)
        layers = [(torch.cat([pad_left(rows[j][0], past - m, 2) for m, rows in found]),
                   torch.cat([pad_left(rows[j][1], past - m, 2) for m, rows in found])) for j in range(len(found[0][1]))]
        for i, (m, _) in enumerate(found):
            head[i, past - m :] = 1
        mask = torch.cat([head, tail], dim=1).to(self._device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)[:, past:]
        out = self._forward(ids.to(self._device), mask, pos, DynamicCache(ddp_cache_data=layers), adapters)
        return out, mask

    def _prefix_plan(self, prompts: list[list[int]], adapters: list[str | None]) -> tuple[int, int, Layers | None]:
        """(L, m, layers): the batch's first L tokens are its shared prefix (0: none), of which the
        prefix cache holds the first m (``layers``: their keys and values, or None)."""
        shared = self._shared_prefix_len(prompts, adapters)
        if len(prompts) == 1 and self._prefix.enabled:
            shared = len(prompts[0]) - 1  # what the cache may hold of one prompt; its last token is computed
        if shared <= 0 or len(set(adapters)) != 1:
            return 0, 0, None
        cached, layers = self._prefix.lookup(adapters[0], prompts[0][:shared])
        if len(prompts) == 1:
            return cached, cached, layers  # one prompt: what the cache lacks is its suffix
        return shared, cached, layers

    def _remember(self, rows: list[Row]) -> None:
        """Keep the keys and values of each finished row's conversation (its prompt and the tokens it
        generated, but the last, which was never fed back) in the prefix cache: the next call of a
        multi-turn episode starts with them."""
        finished = {id(r) for r in rows}
        for i, r in enumerate(self._rows):
            if id(r) not in finished:
                continue
            cols = self._attn[i].nonzero().squeeze(-1)  # this row's positions, without padding
            tokens = list(r.request.req.prompt_token_ids) + r.out_ids[:-1]
            if self._prefix.holds(r.adapter_name, tokens):
                continue
            if len(cols) != len(tokens):  # a finished row holds exactly these; anything else is left out
                log.warning("prefix cache: row of %s holds %d positions for %d tokens; not kept",
                            r.request.req.request_id, len(cols), len(tokens))
                continue
            self._prefix.store(r.adapter_name, tokens, owned=True,  # index_select copies: these tensors are the cache's own
                               layers=[(k[i : i + 1].index_select(2, cols), v[i : i + 1].index_select(2, cols)) for k, v in self._cache])

    def _grammar_ready(self, st: QueuedRequest) -> bool:
        """Compile a constrained request's grammar before it joins the batch; a grammar that fails
        fails its request only."""
        if st.req.params.grammar is None:
            return True
        try:
            self._grammars().compile(st.req.params.grammar)
            return True
        except Exception as e:
            log.error("grammar of %s failed: %s", st.req.request_id, e)
            self._send(st, EngineError(f"constrained decoding failed: {e}"))
            return False

    def _grammars(self) -> GrammarCache:
        if self._grammar_cache is None:
            self._grammar_cache = GrammarCache(self.tokenizer, self._base.config.vocab_size, stop_token_ids=self._eos)
        return self._grammar_cache

    def _constrain(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits with what each constrained row's grammar disallows at -inf (a copy)."""
        rows = [i for i, r in enumerate(self._rows) if r.matcher is not None and not r.matcher.is_terminated()]
        if not rows:
            return logits
        cache = self._grammars()
        bitmask = cache.new_bitmask(len(self._rows))
        for i in rows:
            self._rows[i].matcher.fill_next_token_bitmask(bitmask, i)
        logits = logits.clone()
        cache.apply(logits, bitmask.to(logits.device), rows)
        return logits

    def _sample_and_emit(self) -> None:
        rows = self._rows
        logits = self._constrain(self._logits)
        temps_l = [r.request.req.params.temperature for r in rows]
        temps = torch.tensor(temps_l, device=logits.device)
        greedy = temps <= 0
        top_ps = [r.request.req.params.top_p for r in rows]
        top_p_on = any(p < 1.0 for p, t in zip(top_ps, temps_l) if t > 0)  # (a greedy row's top_p changes nothing)
        k = max(r.request.req.params.top_logprobs for r in rows)
        u = torch.rand(len(rows), generator=self._gen)
        for i, r in enumerate(rows):
            if r.generator is not None:
                u[i] = torch.rand(1, generator=r.generator)
        top_vals = top_ids = None
        if self._ksample is not None and not top_p_on and k == 0 and logits.device.type == "cpu":
            # the same draw in one call: torch's exp and argmax over 8 x 49,152 logits took 0.6-1.1 ms a step on one core
            tokens, chosen = self._ksample(logits, temps, u)
        else:
            # (a division by 1 skipped: at 8 rows each op on the logits costs tens of microseconds)
            scaled = logits if all(t <= 0 or t == 1.0 for t in temps_l) else logits / torch.where(greedy, 1.0, temps).unsqueeze(-1)
            logp = torch.log_softmax(scaled, dim=-1)
            sample_lp = logp
            if top_p_on:
                top_p = torch.tensor(top_ps, device=logits.device).unsqueeze(-1)
                sorted_lp, order = logp.sort(dim=-1, descending=True)
                probs_sorted = sorted_lp.exp()
                drop = (probs_sorted.cumsum(-1) - probs_sorted) > top_p  # keeps at least the top token
                sample_lp = torch.full_like(logp, float("-inf")).scatter(-1, order, sorted_lp.masked_fill(drop, float("-inf")))
            if all(t <= 0 for t in temps_l):
                tokens = logp.argmax(-1)
            else:
                sampled = _inverse_cdf(sample_lp.exp(), u.to(logits.device))
                tokens = torch.where(greedy, logp.argmax(-1), sampled) if any(t <= 0 for t in temps_l) else sampled
            chosen = logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            if k > 0:
                tv, ti = logp.topk(k, dim=-1)
                top_vals, top_ids = tv.tolist(), ti.tolist()
        tokens_l, chosen_l = tokens.tolist(), chosen.tolist()
        self.tokens_generated += len(rows)

        by_request: dict[int, list[ChoiceUpdate]] = {}
        for i, r in enumerate(rows):
            if r.request.aborted:  # its caller learns it ended (one that went away reads nothing)
                r.finish_reason = "abort"
                by_request.setdefault(id(r.request), []).append(aborted_update(r.index))
                continue
            tok = tokens_l[i]
            r.out_ids.append(tok)
            r.out_lps.append(chosen_l[i])
            p = r.request.req.params
            if p.top_logprobs:
                r.out_top.append(list(zip(top_ids[i][: p.top_logprobs], top_vals[i][: p.top_logprobs])))
            if r.detok is not None:
                r.detok.add(tok)
            if r.matcher is not None and not r.matcher.is_terminated() and not r.matcher.accept_token(tok):
                log.error("grammar refused token %d it allowed; ending choice %d of %s", tok, r.index, r.request.req.request_id)
                r.finish_reason = "stop"
            elif tok in self._eos or (r.detok is not None and r.detok.stopped):
                r.finish_reason = "stop"
            elif len(r.out_ids) >= p.max_tokens or r.prompt_len + len(r.out_ids) >= self.max_model_len:
                r.finish_reason = "length"
            if r.request.req.stream or r.finish_reason is not None:
                by_request.setdefault(id(r.request), []).append(self._update_for(r))
        for i, r in enumerate(rows):
            ups = by_request.pop(id(r.request), None)
            if ups:
                self._send(r.request, ups)

    def _update_for(self, r: Row) -> ChoiceUpdate:
        start = r.emitted
        r.emitted = len(r.out_ids)
        final = r.finish_reason is not None
        if r.detok is not None:
            text = r.detok.take(final=final)
        else:
            text = ""
            if final:
                text = self.tokenizer.decode(r.out_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        return ChoiceUpdate(
            index=r.index,
            token_ids=r.out_ids[start:],
            logprobs=r.out_lps[start:],
            text=text,
            top_logprobs=r.out_top[start:] if r.out_top else None,
            finish_reason=r.finish_reason,
        )

    def _prune(self) -> None:
        keep = [i for i, r in enumerate(self._rows) if r.finish_reason is None]
        if len(keep) == len(self._rows):
            return
        if self._prefix.enabled:
            try:
                self._remember([r for r in self._rows if r.finish_reason in ("stop", "length") and not r.request.aborted])
            except Exception:  # the cache is an optimisation: never fail the batch for it
                log.exception("prefix cache: keeping finished rows failed; they are not kept")
        if not keep:
            self._reset_batch()
            return
        idx = torch.tensor(keep, device=self._attn.device)
        self._rows = [self._rows[i] for i in keep]
        attn = self._attn.index_select(0, idx)
        live = (attn.sum(0) > 0).nonzero()
        first = int(live[0]) if len(live) else 0  # columns that are padding for every row
        self._attn = attn[:, first:]
        self._pos = self._pos.index_select(0, idx)
        self._logits = self._logits.index_select(0, idx)
        self._cache = [(k.index_select(0, idx)[:, :, first:], v.index_select(0, idx)[:, :, first:]) for k, v in self._cache]

    def _decode(self) -> None:
        rows = self._rows
        adapters = [r.adapter_name for r in rows]
        ids = torch.tensor([r.out_ids[-1] for r in rows], dtype=torch.long, device=self._attn.device)
        attn = torch.cat([self._attn, self._attn.new_ones((len(rows), 1))], dim=1)
        done = False
        if self.fast is not None and self.fast.runs(adapters):
            try:
                self._logits, self._cache = self.fast.step(ids, attn, self._pos, self._cache, adapters)
                self.fast_decode_steps += 1
                done = True
            except Exception:  # noqa: BLE001 - a bug of this path must not fail requests transformers can serve
                log.exception("fast decode failed; this engine decodes through transformers from now on")
                self.fast = None
        if not done:
            from transformers import DynamicCache

            if self.fast is not None:
                self.fast.release()  # its buffers no longer hold the batch's cache after this step
            # the DynamicCache of the last such step while nothing replaced its layers (a new one copies them all)
            cache = self._hf_cache[0] if self._hf_cache and self._hf_cache[1] is self._cache else DynamicCache(ddp_cache_data=self._cache)
            out = self._forward(ids.unsqueeze(-1), attn, self._pos.unsqueeze(-1), cache, adapters)
            self._cache = [(k, v) for k, v, *_ in out.past_key_values]
            self._hf_cache = (out.past_key_values, self._cache)
            self._logits = out.logits[:, -1, :].float()
        self._attn = attn
        self._pos = self._pos + 1


_CDF_BLOCK = 256  # vocabulary entries a block of the two-level inverse CDF


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability reaches ``u`` (in [0, 1)) times the row's total:
    inverse-CDF sampling from unnormalised ``probs`` (B, V). Two levels (sums of blocks of ``_CDF_BLOCK``, then the
    cumulative sum within the block chosen), so the sequential sum runs over V / 256 + 256 entries a row
    instead of V: at 8 rows of SmolLM2's 49,152 it was 0.4 of 2 ms a step. The token drawn always has a
    probability above 0 (a rounding at a block's edge lands on the block's last such token)."""
    B, V = probs.shape
    blocks = -(-V // _CDF_BLOCK)
    if blocks * _CDF_BLOCK != V:
        probs = torch.nn.functional.pad(probs, (0, blocks * _CDF_BLOCK - V))
    per = probs.view(B, blocks, _CDF_BLOCK)
    cum = per.sum(-1).cumsum(-1)  # (B, blocks)
    target = (u * cum[:, -1]).clamp(min=1e-12)
    block = torch.searchsorted(cum, target.unsqueeze(-1)).squeeze(-1).clamp(max=blocks - 1)
    before = torch.where(block > 0, cum.gather(-1, (block - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1), 0.0)
    inner = per[torch.arange(B, device=probs.device), block].cumsum(-1)  # (B, _CDF_BLOCK)
    within = torch.minimum(target - before, inner[:, -1])
    pos = torch.searchsorted(inner, within.unsqueeze(-1)).squeeze(-1).clamp(max=_CDF_BLOCK - 1)
    return (block * _CDF_BLOCK + pos).clamp(max=V - 1)
