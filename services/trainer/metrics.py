"""Where the Trainer's per-step metrics go: JSONL and TensorBoard in the run dir, the terminal, and
Prometheus (``trainer.metrics_port``: ``kaizen_trainer_*`` on ``/metrics``)."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("kaizen.trainer")


def _guard_note(record: dict[str, Any]) -> str:
    """What the guard did, when it did something."""
    figures = []
    if "guard_nll_before" in record:
        figures.append(f"demonstrations' nll {record['guard_nll_before']:.4f} -> {record['guard_nll_after']:.4f}")
    if "guard_kl" in record:
        figures.append(f"kl on its samples {record['guard_kl']:.4f}")
    if record.get("guard_refused"):
        return f" | GUARD REFUSED {record['guard_attempts']} update(s): {', '.join(figures)}; weights unchanged"
    if record.get("guard_attempts", 1) > 1:
        return f" | guard: redone at lr {record['lr']:.2g} ({', '.join(figures)})"
    return ""


# Step-record fields served as per-agent Prometheus gauges: (record key, metric name, help).
_GAUGES = (
    ("version", "kaizen_trainer_version", "The version the agent's last step went into"),
    ("reward_mean", "kaizen_trainer_reward_mean", "Mean reward of the last step's batch"),
    ("loss", "kaizen_trainer_loss", "Loss of the last step"),
    ("kl", "kaizen_trainer_kl", "KL to the reference of the last step"),
    ("entropy", "kaizen_trainer_entropy", "Mean token entropy of the last step"),
    ("logprob_mismatch", "kaizen_trainer_logprob_mismatch", "Mean |sampling - trainer| logprob of the last step"),
    ("staleness_mean", "kaizen_trainer_staleness", "Mean versions between the batch's policy and the trained one"),
    ("tokens_per_s", "kaizen_trainer_tokens_per_second", "Tokens a second of the last step"),
    ("step_seconds", "kaizen_trainer_step_seconds", "Seconds the last step took"),
    ("grad_norm", "kaizen_trainer_grad_norm", "Gradient norm of the last step"),
    ("batch_size", "kaizen_trainer_batch_size", "Experiences the last step consumed"),
)


class PrometheusMetrics:
    """The Trainer's metrics on an HTTP port of their own, updated from each step record."""

    def __init__(self, host: str, port: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

        r = self.registry = CollectorRegistry()
        self.steps = Counter("kaizen_trainer_steps", "Training steps", ["agent"], registry=r)
        self.experiences = Counter("kaizen_trainer_experiences", "Experiences taken from the buffer", ["agent", "outcome"],
                                   registry=r)
        self.last_step = Gauge("kaizen_trainer_last_step_timestamp_seconds", "When the agent's last step ended", ["agent"],
                               registry=r)
        self.waiting = Gauge("kaizen_trainer_waiting", "1 while the Trainer waits for committed experiences", registry=r)
        self.learners_lost = Counter("kaizen_trainer_learners_lost", "Learner groups rebuilt after a worker (its process "
                                     "or its Ray node) died; each cost the step in flight", registry=r)
        self.gauges = {key: Gauge(name, doc, ["agent"], registry=r) for key, name, doc in _GAUGES}
        self.objective = Gauge("kaizen_trainer_objective", "The objective's own figures of the last step (its recipe's "
                               "statistics, e.g. clip_frac, policy_loss)", ["agent", "figure"], registry=r)
        self.server, _thread = start_http_server(port, addr=host, registry=r)
        self.port = self.server.server_port
        log.info("Prometheus metrics on http://%s:%d/metrics", host, self.port)

    def step(self, record: dict[str, Any]) -> None:
        agent = record["agent"]
        self.steps.labels(agent).inc()
        self.experiences.labels(agent, "consumed").inc(record.get("batch_size") or 0)
        self.experiences.labels(agent, "discarded").inc(record.get("discarded") or 0)
        self.last_step.labels(agent).set(record["time"])
        self.waiting.set(0)
        for key, _name, _doc in _GAUGES:
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.gauges[key].labels(agent).set(value)
        for key in record.get("objective_figures", ()):
            value = record.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.objective.labels(agent, key).set(value)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class TensorBoardScalars:
    """A step record's numbers as TensorBoard scalars (``<agent>/<key>``), written with tensorboard's own
    event writer: torch's SummaryWriter would load torch into the driver, which otherwise has none."""

    def __init__(self, logdir: Path):
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        self._writer = EventFileWriter(str(logdir))

    def add(self, tags: dict[str, float], step: int, wall_time: float) -> None:
        values = [self._summary.Value(tag=tag, simple_value=value) for tag, value in tags.items()]
        self._writer.add_event(self._event(wall_time=wall_time, step=step, summary=self._summary(value=values)))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _drop_torn_line(path: Path) -> None:
    """A process killed while writing a line leaves it without its newline: cut it off, so every
    line of the file stays one JSON object (the step it belonged to is written again: ``last_step``).
    A whole line that only lacks its newline (written by hand, or by something else) is ended instead."""
    if not path.exists():
        return
    with open(path, "rb+") as f:
        size = end = f.seek(0, 2)
        tail = b""
        while end > 0:  # back to the last newline, in chunks (lines are a few kilobytes)
            start = max(0, end - 65536)
            f.seek(start)
            chunk = f.read(end - start)
            i = chunk.rfind(b"\n")
            tail = chunk[i + 1:] + tail
            if i >= 0:
                break
            end = start
        if not tail:
            return
        try:
            json.loads(tail)
            f.seek(size)
            f.write(b"\n")
            return
        except ValueError:
            f.truncate(size - len(tail))
        log.warning("%s: cut off a line a killed Trainer left unfinished (%d bytes)", path, len(tail))


class MetricsSink:
    def __init__(self, run_dir: str | Path, *, progress: bool = True, prometheus: tuple[str, int] | None = None):
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / "metrics.jsonl"
        _drop_torn_line(self.path)
        self._jsonl = open(self.path, "a", buffering=1)
        self._last_steps: dict[str, int] | None = None  # agent -> newest step with a line (last_step), read once
        self._tb = None
        try:
            self._tb = TensorBoardScalars(self.dir / "tensorboard")
        except Exception as e:  # tensorboard missing or broken: JSONL still has everything
            log.warning("TensorBoard logging disabled: %s", e)
        self._tty = progress and sys.stderr.isatty()
        self._waiting_since: float | None = None
        self.prometheus = PrometheusMetrics(*prometheus) if prometheus is not None else None

    def last_step(self, agent: str) -> int | None:
        """The newest step of ``agent`` this run folder's metrics.jsonl has a line for (None: none). The
        file is read once, at the first call; the lines written since are counted as they are written."""
        if self._last_steps is None:
            self._last_steps = {}
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    try:
                        r = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(r, dict) and isinstance(r.get("step"), int):
                        self._note(r)
        return self._last_steps.get(agent)

    def _note(self, record: dict[str, Any]) -> None:
        if self._last_steps is not None and isinstance(record.get("step"), int):
            agent = record.get("agent")
            self._last_steps[agent] = max(self._last_steps.get(agent, record["step"]), record["step"])

    def step(self, record: dict[str, Any], at: float | None = None) -> None:
        """One step's line; ``at``: when the step ended (a line written late, after a restart), else now."""
        record = {"time": time.time() if at is None else at, **record}
        self._jsonl.write(json.dumps(record) + "\n")
        self._note(record)
        if self.prometheus is not None:
            self.prometheus.step(record)
        if self._tb is not None:
            self._tb.add({f"{record['agent']}/{k}": v for k, v in record.items() if isinstance(v, (int, float))
                          and not isinstance(v, bool) and k not in ("step", "time")}, record["step"], record["time"])
        self._waiting_since = None
        line = (
            f"step {record['step']:>5} {record['agent']} -> v{record['version']}"
            f"{' (published)' if record.get('published') else ''}"
            + (f" | reward {record['reward_mean']:+.3f}±{record['reward_std']:.3f}" if record["reward_mean"] is not None
               else f" | demonstrations only ({record.get('demonstrations', 0)})")
            + (f" | demo nll {record['demo_nll']:.4f}" if record.get("demo_nll") is not None else "")
            + f" | loss {record['loss']:+.4f} kl {record.get('kl', 0.0):.4f} ent {record['entropy']:.3f}"
            f" clip {record.get('clip_frac', 0.0):.2f} | {record['tokens_per_s']:.0f} tok/s"
            f" | stale {record['staleness_mean']:.1f}"
            + _guard_note(record)
        )
        if self._tty:
            sys.stderr.write("\r\033[K" + line + "\n")
            sys.stderr.flush()
        else:
            log.info(line)

    def learners_lost(self) -> None:
        if self.prometheus is not None:
            self.prometheus.learners_lost.inc()

    def waiting(self, message: str) -> None:
        """A quiet note that the trainer is idle (a live line on a terminal, one log line a minute otherwise)."""
        now = time.time()
        if self.prometheus is not None:
            self.prometheus.waiting.set(1)
        if self._tty:
            sys.stderr.write("\r\033[K" + time.strftime("%H:%M:%S ") + message)
            sys.stderr.flush()
        elif self._waiting_since is None or now - self._waiting_since > 60:
            log.info(message)
            self._waiting_since = now
        if self._waiting_since is None:
            self._waiting_since = now

    def close(self) -> None:
        if self.prometheus is not None:
            self.prometheus.close()
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
