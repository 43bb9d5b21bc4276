"""The learner workers as one group of Ray actors, and how a batch is split between them."""

from __future__ import annotations

import logging
import time
from typing import Any

from services.trainer.batches import Norms, TrainItem, episodes_of
from services.trainer.config import TrainerConfig
from services.trainer.stats import StepStats

log = logging.getLogger("kaizen.trainer")

_PEER_GRACE_S = 30.0  # after one learner's call failed, how long the others may take to show a death


class LearnersLost(RuntimeError):
    """A learner worker died (its process, or the Ray node it ran on): the group is no longer whole."""


class LearnersUnavailable(RuntimeError):
    """Ray could not place the learner workers (the cluster lacks the resources, for now)."""


class LearnerActor:
    """One learner worker as a Ray actor. The driver names this class, so it loads no torch (about 2 s
    of every Trainer start); the worker itself (``services.trainer.learner.LearnerWorker``: torch, the
    model, the optimizers) is built in the actor's own process."""

    def __init__(self, config: dict[str, Any], rank: int, world_size: int):
        from services.trainer.learner import LearnerWorker

        self.worker = LearnerWorker(config, rank, world_size)

    def rendezvous_address(self) -> tuple[str, int]:
        return self.worker.rendezvous_address()

    def setup(self, master_addr: str | None, master_port: int | None) -> dict[str, Any]:
        return self.worker.setup(master_addr, master_port)

    def ensure_agent(self, agent: str, *, state_dir: str | None = None, adapter_dir: str | None = None) -> bool:
        return self.worker.ensure_agent(agent, state_dir=state_dir, adapter_dir=adapter_dir)

    def load_state(self, agent: str, path: str) -> dict[str, Any]:
        return self.worker.load_state(agent, path)

    def adopt_adapter(self, agent: str, adapter_dir: str) -> None:
        self.worker.adopt_adapter(agent, adapter_dir)

    def reset_agent(self, agent: str) -> None:
        self.worker.reset_agent(agent)

    def save_state(self, agent: str, path: str, meta: dict[str, Any]) -> str:
        return self.worker.save_state(agent, path, meta)

    def write_version(self, agent: str, root: str, version: int, manifest: dict[str, Any]) -> str:
        return self.worker.write_version(agent, root, version, manifest)

    def train_step(self, agent: str, items: list[TrainItem], norms: Norms, step: int, current_version: int,
                   guard: list[TrainItem] | None = None) -> StepStats:
        return self.worker.train_step(agent, items, norms, step, current_version, guard)


class LearnerGroup:
    """The learner workers as Ray actors in one placement group (``ray.placement``: PACK fills a node
    first, STRICT_SPREAD one worker a node); rank 0 writes files. A worker that dies makes every
    call raise ``LearnersLost``; the Trainer then builds a new group (services/trainer/service.py)."""

    def __init__(self, cfg: TrainerConfig, *, wait_s: float | None = None):
        import ray
        from ray.exceptions import GetTimeoutError
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        r = cfg.ray
        bundle = {"CPU": r.num_cpus_per_worker, **({"GPU": r.num_gpus_per_worker} if r.num_gpus_per_worker else {})}
        self.group = placement_group([dict(bundle) for _ in range(r.workers)], strategy=r.placement)
        self.workers: list[Any] = []
        wait = r.placement_timeout_s if wait_s is None else wait_s
        try:
            try:
                ray.get(self.group.ready(), timeout=wait)
            except GetTimeoutError:
                raise LearnersUnavailable(
                    f"Ray could not place {r.workers} learner worker(s) of {bundle} each ({r.placement}) within "
                    f"{wait:.0f}s; the cluster has {ray.cluster_resources()} in all, {ray.available_resources()} free"
                ) from None
            remote = ray.remote(num_cpus=r.num_cpus_per_worker, num_gpus=r.num_gpus_per_worker)(LearnerActor)
            payload = cfg.model_dump(mode="json")
            self.workers = [remote.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=rank)).remote(payload, rank, r.workers)
                for rank in range(r.workers)]
            addr, port = self._all([self.workers[0].rendezvous_address.remote()])[0] if r.workers > 1 else (None, None)
            self.info = self._all([w.setup.remote(addr, port) for w in self.workers])
        except BaseException:
            self.shutdown()  # the workers made so far, and the placement group
            raise
        log.info("learners ready: %s", self.info)

    def _all(self, calls) -> list[Any]:
        """Every call's result; ``LearnersLost`` as soon as one worker is found dead. A worker whose
        call failed otherwise may have failed for a dead peer (a collective whose other end closed):
        the others get ``_PEER_GRACE_S`` to show a death before that error is raised as it is."""
        import ray
        from ray.exceptions import NodeDiedError, ObjectLostError, RayActorError, WorkerCrashedError

        pending = list(calls)
        failed: Exception | None = None
        deadline = None
        while pending:
            done, pending = ray.wait(pending, num_returns=1,
                                     timeout=None if deadline is None else max(0.0, deadline - time.monotonic()))
            if not done:
                break  # the others still run (or wait in a collective) after a failure of their peer's own
            try:
                ray.get(done)
            except (RayActorError, WorkerCrashedError, NodeDiedError, ObjectLostError) as e:
                text = str(e).strip()
                raise LearnersLost(f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}") from e
            except Exception as e:
                if failed is None:
                    failed, deadline = e, time.monotonic() + _PEER_GRACE_S
        if failed is not None:
            raise failed
        return ray.get(calls)

    def shutdown(self) -> None:
        """Kill the workers and free their placement group (what is left of them after a loss)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for w in self.workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # already dead
                pass
        self.workers = []
        try:
            remove_placement_group(self.group)
        except Exception:
            pass

    def ensure_agent(self, agent: str, *, state_dir: str | None = None, adapter_dir: str | None = None) -> None:
        self._all([w.ensure_agent.remote(agent, state_dir=state_dir, adapter_dir=adapter_dir) for w in self.workers])

    def load_state(self, agent: str, path: str) -> None:
        self._all([w.load_state.remote(agent, path) for w in self.workers])

    def adopt_adapter(self, agent: str, adapter_dir: str) -> None:
        self._all([w.adopt_adapter.remote(agent, adapter_dir) for w in self.workers])

    def reset_agent(self, agent: str) -> None:
        self._all([w.reset_agent.remote(agent) for w in self.workers])

    def save_state(self, agent: str, path: str, meta: dict[str, Any]) -> None:
        """Rank 0 writes files: every replica holds the same weights."""
        self._all([self.workers[0].save_state.remote(agent, path, meta)])

    def write_version(self, agent: str, root: str, version: int, manifest: dict[str, Any]) -> str:
        return self._all([self.workers[0].write_version.remote(agent, root, version, manifest)])[0]

    def train(self, agent: str, shards: list[list[TrainItem]], norms: Norms, step: int, version: int,
              guard: list[TrainItem]) -> list[StepStats]:
        return self._all([w.train_step.remote(agent, s, norms, step, version, guard) for w, s in zip(self.workers, shards)])


def shard(items: list[TrainItem], n: int) -> list[list[TrainItem]]:
    """Split items into n shards of similar token counts, whole episodes each (their calls are
    credited together): longest episode first, to the lightest shard."""
    shards: list[list[TrainItem]] = [[] for _ in range(n)]
    loads = [0] * n
    size = lambda calls: sum(len(i.prompt_ids) + len(i.response_ids) for i in calls)  # noqa: E731
    for calls in sorted(episodes_of(items), key=lambda c: -size(c)):
        k = loads.index(min(loads))
        shards[k].extend(calls)
        loads[k] += size(calls)
    return shards
