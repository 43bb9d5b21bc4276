"""TrainingRunner: turns an agent's live traffic into rewarded, committed experiences.

Direct mode (the production agent itself talks to the Explorer):

    runner = TrainingRunner(endpoint=URL, model="support", selection=SamplingRate(0.3), reward=ExactMatch())
    client = runner.openai_client()               # OpenAI client on the Explorer, calls tracked
    with runner:
        with runner.run(question, expected=answer) as run:
            run.output = my_agent(client, question)

Shadow mode (production is served by another model; the trainable one learns alongside):

    runner = TrainingRunner(endpoint=URL, model="support", mode="shadow", agent=my_agent, repeat=4, ...)
    with runner:
        reply = production_agent(question)         # unchanged, never waits on the Explorer
        runner.shadow(question, expected=answer)   # selected? then my_agent runs 4x in the background

The two modes differ only in where a run comes from: the application's own request, or a replay on
the runner's loop. Both end in one place: the run is rewarded and its feedback goes into the one
``FeedbackQueue``, which sends it and later commits exactly the ids it sent. Everything that talks to
the Explorer afterwards (rewards, feedback, commits, shadow runs) happens on the runner's own event
loop thread, retried with backoff and bounded in memory, so an Explorer that is down or slow never
raises into, nor slows, the application.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import inspect
import logging
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any, Awaitable, Callable, Literal, Sequence

import httpx

from runner_sdk.client import AgentClient, ExplorerClient, tracked_async_http_client, tracked_http_client
from runner_sdk.context import run_var, running
from runner_sdk.feedback import HINT_MAX_CHARS, Feedback, FeedbackQueue
from runner_sdk.records import AgentRun, RunnerStats
from runner_sdk.rewards import Verdict
from runner_sdk.selection import RequestInfo, SamplingRate, SelectionStrategy, decide

log = logging.getLogger("runner_sdk")

AgentFn = Callable[[AgentClient, Any], Any]  # (client, input) -> output, sync or async


async def maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class _BackgroundLoop:
    """An asyncio loop in a daemon thread: the runner's work never runs on the caller's thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="kaizen-runner", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def submit(self, coro) -> Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


class _RunScope:
    """``with runner.run(...) as run:`` (or ``async with``): one request of a directly served agent."""

    def __init__(self, runner: "TrainingRunner", run: AgentRun):
        self.runner = runner
        self.run = run
        self._token: contextvars.Token | None = None

    def __enter__(self) -> AgentRun:
        self._token = run_var.set(self.run)
        return self.run

    def __exit__(self, exc_type, exc, tb) -> bool:
        run_var.reset(self._token)
        if exc is not None:
            self.run.error = f"{exc_type.__name__}: {exc}"
        self.runner._finish(self.run)
        return False  # the application's own exceptions are its own

    async def __aenter__(self) -> AgentRun:
        return self.__enter__()

    async def __aexit__(self, exc_type, exc, tb) -> bool:
        return self.__exit__(exc_type, exc, tb)


class TrainingRunner:
    def __init__(
        self,
        *,
        endpoint: str,
        model: str,
        selection: SelectionStrategy | None = None,
        reward: Callable[[AgentRun], float | Verdict | Awaitable[float | Verdict]] | None = None,
        mode: Literal["direct", "shadow"] = "direct",
        agent: AgentFn | None = None,
        repeat: int = 1,
        commit_interval: float = 60.0,
        api_key: str | None = None,
        timeout: float = 30.0,
        max_pending: int = 10_000,
        shadow_concurrency: int = 4,
        max_shadow_queue: int = 1_000,
        retry_initial: float = 0.5,
        retry_max: float = 30.0,
    ):
        if mode not in ("direct", "shadow"):
            raise ValueError(f"mode must be 'direct' or 'shadow', not {mode!r}")
        if mode == "shadow" and agent is None:
            raise ValueError("shadow mode needs agent=<function (client, input) -> output> to replay")
        if repeat < 1:
            raise ValueError("repeat must be at least 1")
        self.endpoint = endpoint.rstrip("/")
        self.model = model
        self.selection = selection or SamplingRate(1.0)
        self.reward = reward
        self.mode = mode
        self.agent = agent
        self.repeat = repeat
        self.commit_interval = commit_interval
        self.api_key = api_key
        self.timeout = timeout
        self.max_pending = max_pending
        self.shadow_concurrency = shadow_concurrency
        self.max_shadow_queue = max_shadow_queue
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self.stats = RunnerStats()
        self._lock = threading.Lock()
        self._bg: _BackgroundLoop | None = None
        self._explorer: ExplorerClient | None = None
        self._feedback = FeedbackQueue(stats=self.stats, lock=self._lock, max_pending=max_pending,
                                       retry_initial=retry_initial, retry_max=retry_max)
        self._inflight: set[Future] = set()
        self._shadow_sem: asyncio.Semaphore | None = None
        self._shadow_queued = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> "TrainingRunner":
        if self._bg is not None:
            return self
        self._bg = _BackgroundLoop()
        self._bg.start()
        self._bg.submit(self._setup()).result(timeout=30)
        return self

    async def _setup(self) -> None:
        self._explorer = ExplorerClient(self.endpoint, api_key=self.api_key, timeout=self.timeout)
        self._shadow_sem = asyncio.Semaphore(self.shadow_concurrency)
        self._feedback.start(self._explorer, commit_interval=self.commit_interval)

    def stop(self, timeout: float = 30.0) -> None:
        """Finish shadow runs and deliver pending feedback (up to ``timeout`` s), commit, shut down."""
        if self._bg is None:
            return
        deadline = time.monotonic() + timeout
        for fut in list(self._inflight):
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:
                pass
        try:
            self._bg.submit(self._shutdown(max(0.0, deadline - time.monotonic()))).result(timeout=timeout + 5)
        except Exception as e:
            log.warning("runner shutdown was not clean: %s", e)
        self._bg.stop()
        self._bg = None

    async def _shutdown(self, budget: float) -> None:
        try:
            await self._feedback.close(budget)
        finally:
            await self._explorer.aclose()

    def __enter__(self) -> "TrainingRunner":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    async def __aenter__(self) -> "TrainingRunner":
        await asyncio.to_thread(self.start)
        return self

    async def __aexit__(self, *exc) -> None:
        await asyncio.to_thread(self.stop)

    # ------------------------------------------------------------------ clients for the agent

    @property
    def base_url(self) -> str:
        return f"{self.endpoint}/v1"

    def http_client(self) -> httpx.Client:
        return tracked_http_client()

    def async_http_client(self) -> httpx.AsyncClient:
        return tracked_async_http_client()

    def openai_client(self):
        """``openai.OpenAI`` on the Explorer with tracked calls (needs the openai package)."""
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "none", http_client=self.http_client())

    def async_openai_client(self):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key or "none", http_client=self.async_http_client())

    # ------------------------------------------------------------------ what both modes share

    def _new_run(self, input: Any, expected: Any, task_id: str | None, run_id: str, metadata: dict) -> AgentRun:
        with self._lock:
            self.stats.requests += 1
        decision = decide(self.selection, RequestInfo(input=input, metadata=metadata))
        meta = {**decision.metadata, **metadata}
        task = task_id or meta.pop("task_id", None) or f"task-{uuid.uuid4().hex[:16]}"
        if decision.selected:
            with self._lock:
                self.stats.selected += 1
        return AgentRun(task_id=str(task), run_id=run_id, input=input, expected=expected, labels=decision.labels,
                        metadata=meta, selected=decision.selected)

    def _spawn(self, coro) -> bool:
        if self._bg is None:
            log.warning("TrainingRunner is not started: nothing is sent (call start() or use `with runner:`)")
            coro.close()
            return False
        fut = self._bg.submit(coro)
        self._inflight.add(fut)
        fut.add_done_callback(self._inflight.discard)
        return True

    async def _reward_and_queue(self, run: AgentRun) -> None:
        """Where every finished run of either mode ends: rewarded, then its feedback queued."""
        if self.reward is None:
            return
        try:
            verdict = await maybe_await(self.reward(run))
            if isinstance(verdict, Verdict):
                run.reward, run.hint = verdict.reward, verdict.hint
            else:
                run.reward = float(verdict)
        except Exception as e:
            with self._lock:
                self.stats.reward_errors += 1
            log.warning("reward calculator failed for %s/%s, skipping it: %r", run.task_id, run.run_id, e)
            return
        if not run.msg_ids:
            log.debug("run %s/%s made no Explorer calls: nothing to reward", run.task_id, run.run_id)
            return
        if run.reward is None and run.hint is None:
            return  # the calculator had nothing to say about this run
        self.queue_feedback(msg_ids=run.msg_ids, reward=run.reward, task_id=run.task_id, run_id=run.run_id,
                            labels=run.labels, expected=run.expected, hint=run.hint)

    # ------------------------------------------------------------------ direct mode

    def run(self, input: Any = None, *, expected: Any = None, task_id: str | None = None, **metadata: Any) -> _RunScope:
        """Scope one request of a directly served agent; set ``run.output`` inside it."""
        return _RunScope(self, self._new_run(input, expected, task_id, "0", metadata))

    def _finish(self, run: AgentRun) -> None:
        if not run.selected:
            return
        with self._lock:
            self.stats.runs += 1
        if run.error:
            log.info("run %s failed (%s): no feedback", run.task_id, run.error)
            return
        self._spawn(self._reward_and_queue(run))

    # ------------------------------------------------------------------ shadow mode

    def shadow(self, input: Any, *, expected: Any = None, task_id: str | None = None, **metadata: Any) -> bool:
        """Maybe replay ``agent`` on ``input`` ``repeat`` times against the Explorer, in the background.

        Returns at once (True if the request was selected). Production code never waits on it.
        """
        if self.mode != "shadow":
            raise RuntimeError("shadow() needs mode='shadow'")
        base = self._new_run(input, expected, task_id, "0", metadata)
        if not base.selected:
            return False
        with self._lock:
            if self._shadow_queued >= self.max_shadow_queue:
                self.stats.shadow_dropped += 1
                return True
            self._shadow_queued += 1
        if not self._spawn(self._shadow_task(base)):
            with self._lock:
                self._shadow_queued -= 1
        return True

    async def _shadow_task(self, base: AgentRun) -> None:
        try:
            await asyncio.gather(*(self._shadow_run(base, i) for i in range(self.repeat)))
        finally:
            with self._lock:
                self._shadow_queued -= 1

    async def _shadow_run(self, base: AgentRun, i: int) -> None:
        run = AgentRun(task_id=base.task_id, run_id=str(i), input=base.input, expected=base.expected,
                       labels=base.labels, metadata=dict(base.metadata), selected=True, explore=True)
        async with self._shadow_sem:
            with running(run):
                try:
                    run.output = await maybe_await(self.agent(AgentClient(self._explorer, self.model, self.api_key),
                                                              run.input))
                except Exception as e:
                    with self._lock:
                        self.stats.shadow_failures += 1
                    log.warning("shadow run %s/%s failed: %s", run.task_id, run.run_id, e)
                    return
        with self._lock:
            self.stats.shadow_runs += 1
            self.stats.runs += 1
        await self._reward_and_queue(run)

    # ------------------------------------------------------------------ feedback and commits

    def queue_feedback(self, *, msg_ids: Sequence[str], reward: float | None, task_id: str | None = None,
                       run_id: str | None = None, labels: Sequence[str] = (), comment: str | None = None,
                       source: str = "runner_sdk", expected: Any = None, hint: str | None = None,
                       correction: dict[str, Any] | None = None) -> None:
        """Queue one /feedback call, from any thread; it is sent from the runner's loop and its ids are
        committed with this runner's next commit. Oldest entries go first when the queue is full.
        Feedback in words, beside the reward or alone (``reward=None``): ``hint``, what should have
        been done; ``correction``, the assistant message (``content`` and/or ``tool_calls``) that the
        one call ``msg_ids`` names should have answered (it becomes a demonstration of its prompt; a
        ValueError here for more ids, or for a correction that is not a dict; it is sent as a body of
        its own, so an Explorer that refuses it still takes the reward)."""
        if not msg_ids:
            return  # nothing to reward (the Explorer would refuse an empty list)
        if correction is not None and (len(set(msg_ids)) != 1 or not isinstance(correction, dict)):
            raise ValueError(f"a correction is an assistant message (a dict) for one call; got a "
                             f"{type(correction).__name__} for {len(set(msg_ids))} calls")
        if hint is not None and (not hint.strip() or len(hint) > HINT_MAX_CHARS):
            if hint.strip():
                log.warning("a hint of %d characters is more than the Explorer takes (%d): the reward goes alone",
                            len(hint), HINT_MAX_CHARS)
            hint = None  # so the reward is not refused with it
        if reward is None and hint is None and correction is None:
            log.warning("feedback for %s dropped: no reward, no usable hint and no correction", task_id or msg_ids[0])
            return
        common = dict(task_id=task_id, run_id=None if run_id is None else str(run_id), labels=tuple(labels or ()),
                      comment=comment, source=source)
        if correction is not None:  # a body of its own: an Explorer that refuses it still takes the reward
            self._feedback.put(Feedback(msg_ids=(msg_ids[0],), reward=None, correction=copy.deepcopy(correction), **common))
        if reward is not None or hint is not None:
            self._feedback.put(Feedback(msg_ids=tuple(msg_ids), reward=None if reward is None else float(reward),
                                        expected=expected, hint=hint, **common))

    def commit_now(self, timeout: float = 30.0) -> None:
        """Deliver what is pending and commit what this runner delivered, now (blocks up to ``timeout``)."""
        if self._bg is None:
            return

        async def _flush():
            await self._feedback.flush(timeout)
            await self._feedback.commit()

        for fut in list(self._inflight):
            try:
                fut.result(timeout=timeout)
            except Exception:
                pass
        self._bg.submit(_flush()).result(timeout=timeout + 5)
