"""The learner workers as one group of Ray actors, and how a batch is split between them."""

from __future__ import annotations

import logging
from typing import Any

from services.trainer.batches import Norms, TrainItem, episodes_of
from services.trainer.config import TrainerConfig
from services.trainer.stats import StepStats

log = logging.getLogger("kaizen.trainer")


class LearnerGroup:
    """The learner workers as Ray actors; rank 0 writes files."""

    def __init__(self, cfg: TrainerConfig):
        import ray

        from services.trainer.learner import LearnerWorker

        r = cfg.ray
        remote = ray.remote(num_cpus=r.num_cpus_per_worker, num_gpus=r.num_gpus_per_worker)(LearnerWorker)
        payload = cfg.model_dump(mode="json")
        self.workers = [remote.remote(payload, rank, r.workers) for rank in range(r.workers)]
        addr, port = ray.get(self.workers[0].rendezvous_address.remote()) if r.workers > 1 else (None, None)
        info = ray.get([w.setup.remote(addr, port) for w in self.workers])
        log.info("learners ready: %s", info)

    def _all(self, calls) -> list[Any]:
        import ray

        return ray.get(calls)

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
