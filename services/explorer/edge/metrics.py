"""Prometheus metrics of one Explorer (its own registry, so several apps can live in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ExplorerMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kaizen_requests", "HTTP requests by route and status", ["route", "status"], registry=r)
        self.completions = Counter("kaizen_completions", "Chat completions served", ["agent"], registry=r)
        self.backlog = Gauge("kaizen_backlog", "Committed experiences waiting for the Trainer", ["agent"], registry=r)
        self.backpressure = Gauge("kaizen_backpressure", "1 while the agent is under back-pressure (mode: reject or "
                                  "unrecorded)", ["agent", "mode"], registry=r)
        self.unrecorded = Counter("kaizen_unrecorded_completions", "Answers not recorded (back-pressure)", ["agent"],
                                  registry=r)
        self.purged_experiences = Counter("kaizen_purged_experiences", "Experiences whose raw text retention purged",
                                          registry=r)
        self.deleted_experiences = Counter("kaizen_deleted_experiences", "Experiences deleted on request (user data)",
                                           registry=r)
        self.quota_refusals = Counter("kaizen_quota_refusals", "Requests refused with 429 by their API key's quota", ["key"],
                                      registry=r)
        self.prompt_tokens = Counter("kaizen_prompt_tokens", "Prompt tokens consumed", ["agent"], registry=r)
        self.completion_tokens = Counter("kaizen_completion_tokens", "Tokens generated", ["agent"], registry=r)
        self.latency = Histogram(
            "kaizen_request_latency_seconds", "Chat completion latency", ["stream"], buckets=_LATENCY_BUCKETS, registry=r
        )
        self.experiences_recorded = Counter("kaizen_experiences_recorded", "Experiences written to the buffer", registry=r)
        self.recorder_flush = Histogram(
            "kaizen_recorder_flush_seconds", "Time to write one batch of experiences", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.record_handoff = Histogram(
            "kaizen_record_handoff_seconds", "Time a request spends building its records and queueing them (its only "
            "recording cost on the hot path; the writes happen in the background)",
            buckets=(1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 0.1), registry=r,
        )
        self.recorder_pending = Gauge("kaizen_recorder_pending", "Experiences waiting to be written", registry=r)
        self.recorder_oldest_pending = Gauge(
            "kaizen_recorder_oldest_pending_seconds", "Age of the oldest experience waiting to be written", registry=r
        )
        self.recorder_set_aside = Counter(
            "kaizen_recorder_set_aside", "Experiences the buffer refused, set aside in the dead-letter file", registry=r
        )
        self.recorder_write_failures = Gauge(
            "kaizen_recorder_write_failures", "Batch writes that failed because the buffer was unavailable", registry=r
        )
        self.journal_segments = Gauge("kaizen_journal_segments", "Journal segment files this Explorer holds", registry=r)
        self.feedback = Counter("kaizen_feedback", "Experiences given a reward", registry=r)
        self.late_rewards = Counter("kaizen_late_rewards", "Rewards for experiences already trained on or discarded (recorded late)",
                                    registry=r)
        self.committed = Counter("kaizen_committed", "Experiences committed for training", registry=r)
        self.engine_running = Gauge("kaizen_engine_running", "Sequences in the running batch", registry=r)
        self.engine_waiting = Gauge("kaizen_engine_waiting", "Requests waiting for the engine", registry=r)
        self.engine_busy = Gauge(
            "kaizen_engine_busy_seconds", "Seconds the engine's thread spent in each phase since it started (the hf engine: "
            "prefill, decode, sample); its rate over time is the engine's load", ["phase"], registry=r)
        self.adapter_version = Gauge("kaizen_adapter_version", "Version each agent serves", ["agent"], registry=r)
        self.adapter_reloads = Counter("kaizen_adapter_reloads", "Adapter versions hot-loaded", ["agent"], registry=r)
        self.adapter_reload_failures = Gauge(
            "kaizen_adapter_reload_failures", "Published versions refused (broken or unloadable)", registry=r
        )
        self.episode_pins = Gauge("kaizen_episode_pins", "Episodes held on the version their first call used", registry=r)
        self.episode_pin_misses = Gauge(
            "kaizen_episode_pin_misses", "Episodes whose version was deleted before they ended (they moved on)", registry=r
        )
        self.release_candidate = Gauge(
            "kaizen_release_candidate_version", "Version awaiting its release decision (0: none)", ["agent"], registry=r)
        self.release_decisions = Counter(
            "kaizen_release_decisions", "Release decisions this replica took or carried out", ["agent", "decision"], registry=r)
        self.release_alarm = Gauge(
            "kaizen_release_alarm", "1 while the guard's alarm is up for the serving version (immediate mode)", ["agent"],
            registry=r)
        self.canary_share = Gauge("kaizen_canary_share", "Share of the traffic routed to the candidate", ["agent"], registry=r)
        self.canary_requests = Gauge(
            "kaizen_canary_requests", "Calls this replica routed since the canary began", ["agent", "arm"], registry=r)
        self.canary_episodes = Gauge(
            "kaizen_canary_episodes", "Rewarded episodes since the canary began (all replicas)", ["agent", "arm"], registry=r)
        self.canary_reward = Gauge("kaizen_canary_reward_mean", "Mean episode reward since the canary began", ["agent", "arm"],
                                   registry=r)
        self.canary_bound = Gauge(
            "kaizen_canary_difference_bound", "Confidence bounds of candidate minus serving reward", ["agent", "bound"],
            registry=r)
        self.adapter_reload_seconds = Histogram(
            "kaizen_adapter_reload_seconds", "Time to load a new adapter version", buckets=_LATENCY_BUCKETS, registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
