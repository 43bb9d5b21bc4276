"""SmolLM2-135M-Instruct on this machine: its limits, the hf vs the vllm engine, our trainer step vs TRL's.

    python -m tests.bench.smollm2          (or: python -m tests.bench.run smollm2)
    KAIZEN_BENCH_QUICK=1 python -m tests.bench.smollm2      (smoke run: tiny totals, 1 round)

Everything below is measured in the same run, on the real model (`kaizen pretrained
smollm2-135m-instruct`, built into .cache/smollm2-135m-instruct if missing):

1. Machine limits at KAIZEN_BENCH_THREADS (default 2) torch threads: the best of a few square GEMMs
   (compute-bound) in float32 and bfloat16, and memory bandwidth (a large tensor's sum: bytes read / s;
   a copy's read + write is printed beside it). They are measured again at the start of every round,
   so their spread shows the machine's drift too. From them, SmolLM2's limits: batched decode =
   FLOP/s / (2 x params), training = FLOP/s / (6 x params) (prompt + response tokens), decode at
   concurrency 1 = read bandwidth / weight bytes, and decode at concurrency c = the roofline, the smaller
   of c x (read bandwidth / weight bytes) (every step reads the weights once for the whole batch) and
   the batched-decode compute limit. Attention over short contexts is left out, so these are slightly
   optimistic.
2. HFEngine (with its CPU fast paths, and without them: hf-stock) vs VLLMEngine (in-process, as the
   Explorer runs them; no HTTP, no recording), the
   same chat prompts, per-request seeds and max_tokens, at concurrency 1, 8 and 32, in float32 and
   bfloat16 (KAIZEN_BENCH_SMOLLM2_ENGINE_DTYPES). vLLM: enforce_eager, a 1 GiB KV cache, max_model_len
   1024, its OpenMP threads bound to every CPU this process may use (KAIZEN_BENCH_VLLM_BIND; "auto"
   leaves vLLM's own choice, which on a 2-core box reserves one core for its scheduler). Each engine
   starts once; rounds rotate the engines' order. Completion tokens/s, and as a share of the machine's
   limit: the roofline at that concurrency.
3. One GRPO step of ours (LearnerWorker.train_step) vs TRL's GRPOTrainer update, with the classes of
   tests/bench/trainer.py (same LoRA, optimizer settings, starting adapter) on a SmolLM2 batch:
   KAIZEN_BENCH_SMOLLM2_TRAIN_SEQS sequences (groups of 4) of about KAIZEN_BENCH_SMOLLM2_PROMPT_TOKENS
   prompt (a system prompt + a question; 4 lengths around the mean) and KAIZEN_BENCH_SMOLLM2_RESPONSE_TOKENS
   random response tokens (lengths spread over 0.5..1.5 x the mean), in float32 and bfloat16 (weights
   in that dtype, LoRA in float32 on both sides; KAIZEN_BENCH_SMOLLM2_TRAIN_DTYPES), the whole batch
   as one micro-batch. One dtype at a time (a step holds several GB of activations): its two sides
   are built, alternate within every round, and are freed; the ratio ours/TRL is taken per round
   (paired) and printed with its spread, beside each step's peak resident memory.

Knobs: KAIZEN_BENCH_ROUNDS (default 3), KAIZEN_BENCH_THREADS (2), KAIZEN_BENCH_SMOLLM2_PARTS
(engines,trainer; the limits are always measured), KAIZEN_BENCH_SMOLLM2_TOTALS (requests per run,
"1:2,8:8,32:32": one wave at 8 and 32), KAIZEN_BENCH_SMOLLM2_MAX_TOKENS (64),
KAIZEN_BENCH_SMOLLM2_ENGINES (hf,hf-stock,vllm: hf-stock is the hf engine without its CPU fast paths,
engines/cpu_paths.py and engines/fast_decode.py; hf-no-kernels, not in the default, is the hf engine without
engines/decode_kernels.cpp: its decode products on oneDNN, its attention and norms in torch), the dtypes above, KAIZEN_BENCH_SMOLLM2_TRAIN_WARMUP (1 step
per side), KAIZEN_BENCH_VLLM_BIND, KAIZEN_BENCH_QUICK=1 (everything small: a smoke run, ~4 min).
On an idle 2-core machine the default run takes about 11-14 minutes (the engines' part about 4-5 of them) and peaks near 10 GB of memory
(the float32 training steps); pass KAIZEN_BENCH_SMOLLM2_TRAIN_SEQS=8 to halve the trainer's share.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import logging
import os
import random
import signal
import statistics
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from tests.bench.common import LoadResult, clock_ticks_per_s, machine_busy_ticks, proc_stats, run_load, table

NAME = "smollm2-135m-instruct"
MODEL = f".cache/{NAME}"
CONCURRENCIES = (1, 8, 32)
MAX_MODEL_LEN = 1024
KV_GIB = 1
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
SHORT = {"float32": "fp32", "bfloat16": "bf16"}

QUESTIONS = [
    "Tell me about the weather in Paris in spring and what to wear.",
    "Explain how a bicycle stays upright while it is moving.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Describe three ways to make a small apartment feel larger.",
    "What are the main differences between a lake and a sea?",
    "Give me a recipe for a simple vegetable soup, step by step.",
    "Why do leaves change colour in autumn? Explain it to a child.",
    "Plan a one-day walking tour of an old European city.",
]
SYSTEM = (
    "You are a careful assistant for a small online shop. You answer customers' questions about orders, "
    "deliveries, returns and products. Be polite and brief, never invent order numbers or prices, and when "
    "you are unsure, say so and suggest contacting support by email. Use the calculator tool for any "
    "arithmetic on prices, discounts or taxes, and always state the currency. Prefer short paragraphs and "
    "plain words; do not use markdown tables. If a customer is upset, acknowledge it first, then help. "
    "Shipping takes three to five working days within the country and up to two weeks abroad; returns are "
    "free within thirty days if the item is unused and in its original packaging. Gift cards cannot be "
    "refunded. Sizes run small, so suggest one size up for shoes and jackets when asked about fit."
)
TRAIN_QUESTIONS = [
    "My order has not arrived after a week, what should I do?",
    "Can I return a jacket I wore once if it does not fit?",
    "What is 15% off a price of 84 euros, including 20% tax?",
    "Which size of running shoes should I order if I usually wear a 42?",
]


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _quick() -> bool:
    return os.environ.get("KAIZEN_BENCH_QUICK", "") not in ("", "0", "false")


def _csv(name: str, default: str) -> list[str]:
    return [x.strip() for x in os.environ.get(name, default).split(",") if x.strip()]


def spread(xs: list[float], fmt: str = "{:.0f}") -> str:
    """median (min..max); just the value when there is one."""
    if not xs:
        return "-"
    m = fmt.format(statistics.median(xs))
    return m if len(xs) == 1 else f"{m} ({fmt.format(min(xs))}..{fmt.format(max(xs))})"


# ---------------------------------------------------------------------- the machine


def _tree_ticks() -> int:
    """User + system ticks of this process and its live descendants (vLLM's engine core and worker)."""
    parent, ticks = {}, {}
    for pid, _, rest in proc_stats():
        parent[pid], ticks[pid] = int(rest[1]), int(rest[11]) + int(rest[12])
    mine, frontier = {os.getpid()}, [os.getpid()]
    while frontier:
        pid = frontier.pop()
        for child, par in parent.items():
            if par == pid and child not in mine:
                mine.add(child)
                frontier.append(child)
    return sum(ticks.get(p, 0) for p in mine)


class OthersMeter:
    """Cores that processes outside this benchmark kept busy between start() and stop()."""

    def start(self) -> None:
        self.t0, self.m0, self.o0 = time.monotonic(), machine_busy_ticks(), _tree_ticks()

    def stop(self) -> float:
        dt = time.monotonic() - self.t0
        return ((machine_busy_ticks() - self.m0) - (_tree_ticks() - self.o0)) / clock_ticks_per_s() / max(dt, 1e-9)


def _cores(xs: list[float]) -> str:
    return ", ".join(f"{x:.2f}" for x in xs) or "-"


@dataclass
class Limits:
    flops: dict[str, float]  # dtype -> FLOP/s of a square GEMM
    read_bw: float  # bytes/s of a large sum
    copy_bw: float  # bytes/s (read + write) of a large copy


def measure_limits(threads: int, *, n: int = 2048, reps: int = 5, mib: int = 512) -> Limits:
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        flops = {}
        for dtype in DTYPE_BYTES:
            dt = getattr(torch, dtype)
            a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
            c = a @ b  # warm-up (allocation, kernel selection)
            best = float("inf")
            for _ in range(reps):
                t0 = time.perf_counter()
                torch.matmul(a, b, out=c)
                best = min(best, time.perf_counter() - t0)
            flops[dtype] = 2 * n**3 / best
            del a, b, c
        x = torch.ones(mib * 2**20 // 4)
        y = torch.empty_like(x)
        y.copy_(x)
        x.sum()
        best_sum = best_copy = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            x.sum()
            best_sum = min(best_sum, time.perf_counter() - t0)
            t0 = time.perf_counter()
            y.copy_(x)
            best_copy = min(best_copy, time.perf_counter() - t0)
        return Limits(flops, x.nbytes / best_sum, 2 * x.nbytes / best_copy)
    finally:
        torch.set_num_threads(prev)


def count_params(model: str) -> int:
    """Parameters that take part in a forward (tied embeddings counted once: they are the LM head)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    return sum(p.numel() for p in m.parameters())


class ModelLimits:
    """SmolLM2's tokens/s limits on this machine, from measured GEMM FLOP/s and bandwidth."""

    def __init__(self, params: int, limits: list[Limits]):
        self.params = params
        self.flops = {d: statistics.median(x.flops[d] for x in limits) for d in DTYPE_BYTES}
        self.read_bw = statistics.median(x.read_bw for x in limits)

    def decode_batched(self, dtype: str) -> float:
        return self.flops[dtype] / (2 * self.params)

    def decode_c1(self, dtype: str) -> float:
        return self.read_bw / (self.params * DTYPE_BYTES[dtype])

    def train(self, dtype: str) -> float:
        return self.flops[dtype] / (6 * self.params)

    def decode(self, dtype: str, concurrency: int) -> float:
        """The roofline at this concurrency: each decode step reads the weights once for the whole
        batch (bandwidth-bound at small batches) and computes 2 x params per token (compute-bound)."""
        return min(concurrency * self.decode_c1(dtype), self.decode_batched(dtype))


# ---------------------------------------------------------------------- engines


def _messages(i: int) -> list[dict]:
    return [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]


class EngineTarget:
    """One engine in-process; ``one(i)`` sends request ``i`` and returns the tokens generated."""

    def __init__(self, kind: str, model: str, dtype: str, threads: int, max_tokens: int, bind: str):
        self.kind, self.model, self.dtype, self.threads, self.max_tokens, self.bind = kind, model, dtype, threads, max_tokens, bind
        self.name = f"{kind} {SHORT.get(dtype, dtype)}"
        self.engine = None
        self.error: str | None = None
        self.start_s = 0.0

    async def start(self) -> None:
        t0 = time.monotonic()
        if self.kind in ("hf", "hf-stock", "hf-no-kernels"):
            from services.explorer.serving.engines.hf import HFEngine

            stock = ({"packed_weights": False, "decode_attention": False, "fast_decode": False} if self.kind == "hf-stock"
                     else {"decode_kernels": False} if self.kind == "hf-no-kernels" else {})
            self.engine = HFEngine(model_path=self.model, dtype=self.dtype, device="cpu", max_batch_size=max(CONCURRENCIES),
                                   max_model_len=MAX_MODEL_LEN, torch_threads=self.threads, seed=0, **stock)
        else:
            from services.explorer.config import VLLMSection
            from services.explorer.serving.engines.vllm import VLLMEngine

            self.engine = VLLMEngine(model_path=self.model, dtype=self.dtype, max_batch_size=max(CONCURRENCIES),
                                     max_model_len=MAX_MODEL_LEN, seed=0,
                                     settings=VLLMSection(enforce_eager=True, kv_cache_gib=KV_GIB), name=self.name)
        try:
            with _vllm_env(self.bind) if self.kind == "vllm" else contextlib.nullcontext():
                await self.engine.start()
        except BaseException:
            with contextlib.suppress(Exception):
                await self.engine.shutdown()
            self.engine = None
            raise
        self.start_s = time.monotonic() - t0

    def prompt_ids(self, i: int) -> list[int]:
        tok = self.engine.tokenizer
        text = tok.apply_chat_template(_messages(i), add_generation_prompt=True, tokenize=False)
        return tok.encode(text, add_special_tokens=False)

    async def one(self, i: int) -> int:
        from services.explorer.serving.engines.base import GenerateRequest, SamplingParams

        req = GenerateRequest(request_id=f"{self.name}-{i}-{time.monotonic_ns()}", prompt_token_ids=self.prompt_ids(i),
                              params=SamplingParams(max_tokens=self.max_tokens, seed=i))
        n = 0
        async for ups in self.engine.generate(req):
            n += sum(len(u.token_ids) for u in ups)
        return n

    async def stop(self) -> None:
        if self.engine is not None:
            with contextlib.suppress(Exception):
                await self.engine.shutdown()
            self.engine = None


@contextlib.contextmanager
def _vllm_env(bind: str):
    """What the spawned engine core reads: its OpenMP CPU binding; the KV cache comes from kv_cache_gib."""
    saved = {k: os.environ.get(k) for k in ("VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")}
    if bind != "auto":
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bind
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(KV_GIB)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _default_bind() -> str:
    cpus = sorted(os.sched_getaffinity(0))
    return ",".join(map(str, cpus))


def _error_line(e: BaseException) -> str:
    lines = [ln for ln in traceback.format_exception_only(type(e), e) if ln.strip()]
    return " ".join(ln.strip() for ln in lines)[-600:]


async def run_engines(cfg: dict, limits: list[Limits]) -> tuple[dict, list[EngineTarget], dict]:
    targets: list[EngineTarget] = []
    for kind in cfg["engines"]:
        for dtype in cfg["engine_dtypes"]:
            targets.append(EngineTarget(kind, cfg["model"], dtype, cfg["threads"], cfg["max_tokens"], cfg["bind"]))
    started = []
    for t in targets:
        try:
            await t.start()
            started.append(t)
        except Exception as e:  # noqa: BLE001 - reported in the table, the others still run
            t.error = _error_line(e)
    info = {"same_prompt_ids": None}
    try:
        if started:
            ids = [t.prompt_ids(0) for t in started]
            info["same_prompt_ids"] = all(x == ids[0] for x in ids)
            info["prompt_tokens"] = [len(t.prompt_ids(i)) for i in range(len(QUESTIONS)) for t in started[:1]]
        for t in started:  # warm-up: first batches allocate and pick kernels
            await run_load(t.one, concurrency=4, total=4)
        results = {(t.name, c): [] for t in started for c in CONCURRENCIES}
        meter = OthersMeter()
        meter.start()
        t0 = time.monotonic()
        info["others_rounds"] = []
        for r in range(cfg["rounds"]):
            round_meter = OthersMeter()
            round_meter.start()
            limits.append(measure_limits(cfg["threads"]))
            for c in CONCURRENCIES:
                order = started[r % len(started):] + started[: r % len(started)] if started else []
                for t in order:
                    results[(t.name, c)].append(await run_load(t.one, concurrency=c, total=cfg["totals"][c]))
            info["others_rounds"].append(round_meter.stop())
        info["others"] = meter.stop()
        info["measure_s"] = time.monotonic() - t0
    finally:
        for t in targets:
            await t.stop()
    return results, targets, info


def engines_report(results: dict, targets: list[EngineTarget], info: dict, ml: ModelLimits, cfg: dict) -> str:
    rows = []
    for t in targets:
        if t.error:
            rows.append([t.name, "-", f"did not start: {t.error[:160]}", "", "", "", "", ""])
            continue
        for c in CONCURRENCIES:
            rs: list[LoadResult] = results[(t.name, c)]
            tps = [r.tokens_per_s for r in rs]
            limit = ml.decode(t.dtype, c)
            per = sum(r.tokens for r in rs) / max(1, sum(r.completions for r in rs))
            rows.append([t.name, c, spread(tps, "{:.1f}"), f"{limit:.0f}", spread([x / limit for x in tps], "{:.3f}"),
                         f"{statistics.median(r.p(0.5) for r in rs):.1f}", f"{per:.1f}", sum(r.failures for r in rs)])
    out = table(
        f"SmolLM2-135M-Instruct: HFEngine vs VLLMEngine in-process, completion tokens/s; max_tokens={cfg['max_tokens']}, "
        f"temperature 1, per-request seed, {cfg['threads']} threads; median (min..max) of {cfg['rounds']} rounds",
        ["engine", "conc", "tok/s", "limit tok/s", "share of limit", "p50 s", "tok/compl", "failed"],
        rows,
    )
    ok = [t for t in targets if not t.error]

    def paired(num: str, den: str) -> list[str]:  # engine num's tokens/s over engine den's, paired by round
        lines = []
        for dtype in cfg["engine_dtypes"]:
            a = next((t for t in ok if t.kind == num and t.dtype == dtype), None)
            b = next((t for t in ok if t.kind == den and t.dtype == dtype), None)
            for c in CONCURRENCIES if a and b else ():
                ratios = [x.tokens_per_s / y.tokens_per_s for x, y in zip(results[(a.name, c)], results[(b.name, c)])]
                lines.append(f"{SHORT[dtype]} c={c} {spread(ratios, '{:.2f}')}")
        return lines

    if pairs := paired("vllm", "hf"):
        out += "\nvllm/hf tokens/s, paired by round: " + "; ".join(pairs)
    if fast := paired("hf", "hf-stock"):
        out += "\nhf/hf-stock tokens/s (the CPU fast paths on / off), paired by round: " + "; ".join(fast)
    if kern := paired("hf", "hf-no-kernels"):
        out += "\nhf/hf-no-kernels tokens/s (engines/decode_kernels.cpp on / off), paired by round: " + "; ".join(kern)
    starts = ", ".join(f"{t.name} {t.start_s:.0f}s" for t in ok)
    out += (
        f"\n(limit: the roofline, min(concurrency x read bandwidth / weight bytes, GEMM FLOP/s / (2 x params)); "
        f"requests per run {cfg['totals']}; tok/compl = completion tokens per request (EOS may end one early); "
        f"same prompt ids in every engine: {info.get('same_prompt_ids')}; prompts {min(info.get('prompt_tokens') or [0])}-"
        f"{max(info.get('prompt_tokens') or [0])} tokens; vllm: enforce_eager, kv cache {KV_GIB} GiB, max_model_len "
        f"{MAX_MODEL_LEN}, LoRA enabled (as the Explorer starts it), VLLM_CPU_OMP_THREADS_BIND={cfg['bind']}; "
        f"engine starts: {starts}; other processes kept {info.get('others', float('nan')):.2f} cores busy while "
        f"measuring ({info.get('measure_s', 0):.0f}s), by round: {_cores(info.get('others_rounds', []))})"
    )
    return out


# ---------------------------------------------------------------------- trainer


def smollm2_batch(tokenizer, *, seqs: int, prompt_tokens: int, response_tokens: int, seed: int = 0):
    """Groups of 4 sequences sharing a prompt (system prompt + question, lengths 0.8..1.2 x the mean),
    random response tokens (lengths 0.5..1.5 x the mean), group-relative advantages."""
    from services.trainer.algorithms.group import group_relative
    from tests.bench.trainer import GENERATIONS, Batch

    if seqs % GENERATIONS:
        raise ValueError(f"KAIZEN_BENCH_SMOLLM2_TRAIN_SEQS must be a multiple of {GENERATIONS}, got {seqs}")
    rng = random.Random(seed)
    special = set(tokenizer.added_tokens_decoder)
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    words = SYSTEM.split()
    groups = seqs // GENERATIONS
    prompts, completions, gids = [], [], []
    for g in range(groups):
        target = round(prompt_tokens * (0.8 + 0.4 * g / max(1, groups - 1)))
        question = TRAIN_QUESTIONS[g % len(TRAIN_QUESTIONS)]
        ids: list[int] = []
        for k in range(1, 10 * len(words) + 1):  # the shortest system prompt (words repeat) that reaches the target
            system = " ".join(words[j % len(words)] for j in range(k))
            text = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": question}],
                                                 add_generation_prompt=True, tokenize=False)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) >= target:
                break
        lo, hi = max(1, response_tokens // 2), max(1, response_tokens * 3 // 2)
        for _ in range(GENERATIONS):
            prompts.append(ids)
            completions.append([rng.choice(vocab) for _ in range(rng.randint(lo, hi))])
            gids.append(g)
    rewards = [float(rng.random() < 0.5) for _ in prompts]
    adv = torch.tensor(group_relative(rewards, gids, std_normalize=True))
    return Batch(prompts, completions, torch.tensor(rewards), torch.tensor(gids), adv)


@contextlib.contextmanager
def _weights_dtype(dtype: str):
    """trainer.py's Ours and TRL load float32 weights; this gives both the same classes in ``dtype``:
    our config gets model.dtype, TRL's from_pretrained gets the dtype (LoRA stays float32 in both: peft
    keeps adapter weights in float32)."""
    if dtype == "float32":
        yield
        return
    from unittest import mock

    import services.common.config as config_mod
    from transformers import AutoModelForCausalLM

    load_config = config_mod.load_config
    from_pretrained = AutoModelForCausalLM.from_pretrained

    def load(model, path=None, overrides=(), **kw):
        return load_config(model, path, [*overrides, f"model.dtype={dtype}"], **kw)

    def pretrained(*args, **kw):
        return from_pretrained(*args, **{**kw, "dtype": getattr(torch, dtype)})

    with mock.patch.object(config_mod, "load_config", load), mock.patch.object(AutoModelForCausalLM, "from_pretrained", pretrained):
        yield


def _dtypes_of(params) -> str:
    return "+".join(sorted({SHORT.get(str(p.dtype).removeprefix("torch."), str(p.dtype)) for p in params}))


def _reset_peak_rss() -> None:
    """Start VmHWM again from the current RSS (Linux >= 4.0), so the next read is this step's peak."""
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")


def _peak_rss() -> float:
    """Bytes: this process's peak resident set since the last _reset_peak_rss (NaN where unknown)."""
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024.0
    return float("nan")


def _release_memory() -> None:
    gc.collect()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def run_trainer(cfg: dict, limits: list[Limits]) -> tuple[dict, dict, dict]:
    """One dtype at a time (its two sides built, measured, freed): a step on this batch holds several
    GB of activations, two dtypes' sides at once would not fit a small machine beside other work."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from tests.bench.trainer import TRL, Ours

    hf_logging.set_verbosity_error()
    threads = cfg["threads"]
    batch = smollm2_batch(AutoTokenizer.from_pretrained(cfg["model"]), seqs=cfg["train_seqs"],
                          prompt_tokens=cfg["prompt_tokens"], response_tokens=cfg["response_tokens"])
    info: dict = {"batch": batch, "errors": {}, "dtypes": {}}
    seconds: dict[tuple[str, str], list[float]] = {}
    losses: dict[tuple[str, str], list[float]] = {}
    peaks: dict[tuple[str, str], list[float]] = {}
    meter = OthersMeter()
    meter.start()
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as d, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for dtype in cfg["train_dtypes"]:
            try:
                with _weights_dtype(dtype):
                    ours = Ours(cfg["model"], batch, threads)
                    trl = TRL(cfg["model"], batch, os.path.join(d, dtype))
                trl.load_adapter(ours.adapter_state())
            except Exception as e:  # noqa: BLE001 - reported, the other dtype still runs
                info["errors"][dtype] = _error_line(e)
                _release_memory()
                continue
            base = lambda m: [p for n, p in m.named_parameters() if "lora_" not in n]  # noqa: E731
            info["dtypes"][dtype] = (f"base {_dtypes_of(base(ours.worker.policy.model))} / LoRA {_dtypes_of(ours.adapter_state().values())}",
                                     f"base {_dtypes_of(base(trl.trainer.model))} / LoRA {_dtypes_of(trl.params)}")
            sides: dict[str, Callable[[], float]] = {"ours": ours.step, "trl": trl.step}
            with _weights_dtype(dtype):  # the Trainer's own default attention, where it is not SDPA (bf16 on a CPU)
                auto = Ours(cfg["model"], batch, threads, attention="auto")
            if auto.worker.policy.attention != "sdpa":
                sides["ours-auto"] = auto.step
            for side in sides:
                seconds[(dtype, side)], losses[(dtype, side)], peaks[(dtype, side)] = [], [], []
            torch.set_num_threads(threads)  # after both constructors: neither may leave it different
            for r in range(cfg["train_warmup"] + cfg["rounds"]):
                measuring = r >= cfg["train_warmup"]
                round_meter = OthersMeter()
                round_meter.start()
                if measuring:
                    limits.append(measure_limits(threads))
                    torch.set_num_threads(threads)
                for side in list(sides) if r % 2 == 0 else list(sides)[::-1]:
                    _reset_peak_rss()
                    t1 = time.perf_counter()
                    loss = sides[side]()
                    dt = time.perf_counter() - t1
                    losses[(dtype, side)].append(loss)
                    if measuring:
                        seconds[(dtype, side)].append(dt)
                        peaks[(dtype, side)].append(_peak_rss())
                if measuring:
                    info.setdefault("others_rounds", {}).setdefault(dtype, []).append(round_meter.stop())
            del sides, ours, trl, auto
            _release_memory()
    info["others"] = meter.stop()
    info["measure_s"] = time.monotonic() - t0
    info["peaks"] = peaks
    return seconds, losses, info


def trainer_report(seconds: dict, losses: dict, info: dict, ml: ModelLimits, cfg: dict) -> str:
    from services.common.models import shared_prefix_len
    from services.trainer.config import TrainerLoopSection

    batch = info["batch"]
    total, compl = batch.total_tokens, batch.completion_tokens
    rows, ratios_txt = [], []
    for dtype in cfg["train_dtypes"]:
        if dtype in info["errors"]:
            rows.append([SHORT[dtype], "both", "-", f"did not build: {info['errors'][dtype][:160]}", "", "", "", "", ""])
            continue
        limit = ml.train(dtype)
        for side in [x for x in ("ours", "ours-auto", "trl") if (dtype, x) in seconds]:
            s = seconds[(dtype, side)]
            ls = losses[(dtype, side)]
            rows.append([SHORT[dtype], side, spread([x * 1e3 for x in s]), spread([compl / x for x in s]),
                         spread([total / x for x in s]), f"{limit:.0f}", spread([total / x / limit for x in s], "{:.3f}"),
                         f"{max(info['peaks'][(dtype, side)]) / 2**30:.1f}", f"{ls[0]:+.5f} / {ls[-1]:+.5f}"])
        ratios = [t / o for o, t in zip(seconds[(dtype, "ours")], seconds[(dtype, "trl")])]
        verdict = "meets" if statistics.median(ratios) >= 1.0 else "misses"
        ratios_txt.append(f"{SHORT[dtype]} {spread(ratios, '{:.2f}')} ({verdict} the goal >= 1.0)")
    out = table(
        f"SmolLM2-135M-Instruct: one GRPO step, ours (LearnerWorker) vs TRL GRPOTrainer (loss_type=dapo), {cfg['threads']} threads, "
        f"{len(batch.prompts)} seqs; median (min..max) of {cfg['rounds']} rounds after {cfg['train_warmup']} warm-up",
        ["dtype", "side", "ms/step", "completion tok/s", "total tok/s", "limit tok/s", "share of limit", "peak RSS GiB",
         "loss first / last"],
        rows,
    )
    plens = [len(p) for p in batch.prompts]
    rlens = [len(c) for c in batch.completions]
    out += "\nours/trl tokens/s, paired by round: " + "; ".join(ratios_txt)
    if any(side == "ours-auto" for _, side in seconds):
        out += ("\n(ours-auto: ours on the Trainer's default trainer.attention, auto, which takes plain products for "
                "bfloat16 on a CPU; ours runs SDPA, TRL's own, so that ours and trl run the same kernels)")
    shared = shared_prefix_len(batch.prompts)
    if shared >= TrainerLoopSection().shared_prefix_min_tokens:
        out += (f"\n(ours computes the {shared}-token prompt prefix all {len(batch.prompts)} sequences share once "
                f"(trainer.shared_prefix_min_tokens), so it runs {total - (len(batch.prompts) - 1) * shared} of the {total} "
                f"tokens TRL runs; that is why its share of the limit, which counts every token, can pass 1)")
    dts = "; ".join(f"{SHORT[d]}: ours {o}, trl {t}" for d, (o, t) in info["dtypes"].items())
    out += (
        f"\n(batch: {len(batch.prompts)} seqs, prompts {min(plens)}-{max(plens)} tokens (mean {statistics.fmean(plens):.0f}), "
        f"random responses {min(rlens)}-{max(rlens)} (mean {statistics.fmean(rlens):.0f}); {compl} completion + "
        f"{total - compl} prompt tokens, one micro-batch; peak RSS = the whole process's peak resident memory during a step; limit = GEMM FLOP/s / (6 x params) on prompt + response tokens (a frozen base "
        f"needs no weight gradients, nearer 4 x params: the share against that is 2/3 of the one shown); weights: {dts}; "
        f"other processes kept {info.get('others', float('nan')):.2f} cores busy while measuring ({info.get('measure_s', 0):.0f}s), "
        f"by round: " + "; ".join(f"{SHORT[d]} {_cores(xs)}" for d, xs in info.get("others_rounds", {}).items()) + ")"
    )
    return out


# ---------------------------------------------------------------------- main


def _config() -> dict:
    quick = _quick()
    totals_s = os.environ.get("KAIZEN_BENCH_SMOLLM2_TOTALS", "1:1,8:8,32:32" if quick else "1:2,8:8,32:32")
    totals = {int(k): int(v) for k, v in (x.split(":") for x in totals_s.split(","))}
    missing = [c for c in CONCURRENCIES if c not in totals]
    if missing:
        raise ValueError(f"KAIZEN_BENCH_SMOLLM2_TOTALS lacks concurrency {missing}: {totals_s!r}")
    return {
        "model": os.environ.get("KAIZEN_BENCH_SMOLLM2_MODEL", MODEL),
        "threads": _env_int("KAIZEN_BENCH_THREADS", 2),
        "rounds": _env_int("KAIZEN_BENCH_ROUNDS", 1 if quick else 3),
        "parts": _csv("KAIZEN_BENCH_SMOLLM2_PARTS", "engines,trainer"),
        "totals": totals,
        "max_tokens": _env_int("KAIZEN_BENCH_SMOLLM2_MAX_TOKENS", 16 if quick else 64),
        "engines": _csv("KAIZEN_BENCH_SMOLLM2_ENGINES", "hf,hf-stock,vllm"),
        "engine_dtypes": _csv("KAIZEN_BENCH_SMOLLM2_ENGINE_DTYPES", "float32,bfloat16"),
        "bind": os.environ.get("KAIZEN_BENCH_VLLM_BIND") or _default_bind(),
        "train_dtypes": _csv("KAIZEN_BENCH_SMOLLM2_TRAIN_DTYPES", "float32,bfloat16"),
        "train_seqs": _env_int("KAIZEN_BENCH_SMOLLM2_TRAIN_SEQS", 8 if quick else 16),
        "prompt_tokens": _env_int("KAIZEN_BENCH_SMOLLM2_PROMPT_TOKENS", 64 if quick else 128),
        "response_tokens": _env_int("KAIZEN_BENCH_SMOLLM2_RESPONSE_TOKENS", 16 if quick else 32),
        "train_warmup": _env_int("KAIZEN_BENCH_SMOLLM2_TRAIN_WARMUP", 1),
    }


def _interrupt(*_) -> None:
    raise KeyboardInterrupt


def main() -> str:
    cfg = _config()
    if cfg["model"] == MODEL:
        from services.common.pretrained import build_pretrained

        build_pretrained(NAME, Path(MODEL))  # a no-op when it is already built
    if "vllm" in cfg["engines"]:
        # vLLM logs every engine start and stop, and a warning per weight loaded in bfloat16, here and in the
        # engine core it spawns.
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        logging.getLogger("vllm").setLevel(logging.ERROR)
        try:
            import vllm  # noqa: F401
        except Exception:  # noqa: BLE001 - any import failure means: no vllm here
            cfg["engines"] = [e for e in cfg["engines"] if e != "vllm"]
    t_start, load_start = time.monotonic(), os.getloadavg()
    params = count_params(cfg["model"])
    limits: list[Limits] = [measure_limits(cfg["threads"])]
    sections = []
    if "engines" in cfg["parts"] and cfg["engines"]:
        # SIGTERM as KeyboardInterrupt: asyncio.run then cancels the run, whose finally stops the
        # engines (vLLM's engine core would outlive a plain SIGTERM).
        previous = signal.signal(signal.SIGTERM, _interrupt)
        try:
            results, targets, info = asyncio.run(run_engines(cfg, limits))
        finally:
            signal.signal(signal.SIGTERM, previous)
        sections.append(lambda ml: engines_report(results, targets, info, ml, cfg))
    if "trainer" in cfg["parts"]:
        seconds, losses, tinfo = run_trainer(cfg, limits)
        sections.append(lambda ml: trainer_report(seconds, losses, tinfo, ml, cfg))
    ml = ModelLimits(params, limits)

    g = 1e9
    out = table(
        f"This machine's limits at {cfg['threads']} torch threads: median (min..max) of {len(limits)} measurements "
        f"(one at the start, then one at the start of every round of each part)",
        ["measure", "value"],
        [["GEMM fp32 (2048^2), GFLOP/s", spread([x.flops["float32"] / g for x in limits])],
         ["GEMM bf16 (2048^2), GFLOP/s", spread([x.flops["bfloat16"] / g for x in limits])],
         ["read bandwidth (sum of 512 MiB), GB/s", spread([x.read_bw / g for x in limits], "{:.1f}")],
         ["copy bandwidth (512 MiB, read + write), GB/s", spread([x.copy_bw / g for x in limits], "{:.1f}")]],
    )
    out += table(
        f"SmolLM2-135M-Instruct's limits here ({params / 1e6:.1f}M params, tied embeddings counted once), tokens/s",
        ["dtype", "batched decode (FLOP/s / 2P)", "decode at c=1 (bandwidth / weight bytes)", "training (FLOP/s / 6P)"],
        [[SHORT[d], f"{ml.decode_batched(d):.0f}", f"{ml.decode_c1(d):.0f}", f"{ml.train(d):.0f}"] for d in DTYPE_BYTES],
    )
    for section in sections:
        out += section(ml)
    load_end = os.getloadavg()
    out += (f"\n(load average 1/5/15 min: {' '.join(f'{x:.2f}' for x in load_start)} at the start, "
            f"{' '.join(f'{x:.2f}' for x in load_end)} at the end, on {os.cpu_count()} CPUs; section wall "
            f"{time.monotonic() - t_start:.0f}s)")
    return out


if __name__ == "__main__":
    from services.common.logging import setup_logging

    setup_logging("warning")
    print(main())
