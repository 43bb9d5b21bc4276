"""The tools demo's demonstrations-only arm: the cold-start version trained on the demonstrations
alone, as the Trainer's steps replay them, with no traffic.

One trajectory gives two figures. Its point at as many steps as the online loop took is the control
arm (the equal-step comparison, ``tools.control``). Trained on until it stops improving on a
validation split (``tools.plateau``), its best point is what the demonstrations alone can reach;
the report compares the online loop with that too. The best point is chosen on the validation
problems, never on the held-out ones the report measures.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from services.common import buffer, checkpoints
from services.common.config import deep_merge
from services.common.records import CORRECTION_LABEL


@dataclass
class Plateau:
    """Whether a learning curve still improves: the best score so far and how many measurements
    since it were no better. ``patience`` measurements without a higher score end it."""

    patience: int
    points: list[tuple[int, float]] = field(default_factory=list)  # (steps, score), in order

    def add(self, steps: int, score: float) -> bool:
        """Record a measurement; True while the curve is still worth following."""
        self.points.append((steps, score))
        return self.since_best < self.patience

    @property
    def best(self) -> tuple[int, float]:
        """The earliest point with the highest score (fewer steps for the same score)."""
        if not self.points:
            raise ValueError("no measurement yet")
        top = max(score for _, score in self.points)
        return next(p for p in self.points if p[1] == top)

    @property
    def since_best(self) -> int:
        return len(self.points) - 1 - self.points.index(self.best) if self.points else 0


class DemonstrationsOnly:
    """A Trainer learner in this process that trains agent ``name`` from the cold-start version of
    ``source`` on the demonstrations alone: step ``k`` replays exactly what the Trainer's step of the
    same number replays (``demo_batch_size`` of the stored demonstrations, in turn; the same code
    path). Versions are numbered as the Trainer's steps are, so ``v<n>`` has had ``n`` steps in all."""

    def __init__(self, trainer_cfg: dict, *, db_url: str, root: Path, source: str, name: str, start_version: int,
                 model_path: str):
        from services.trainer.batches import demonstration_item
        from services.trainer.learner import LearnerWorker

        db = buffer.create_buffer_engine(db_url, create_tables=False)
        try:  # the very rows the Trainer replays, in its order
            demos = [d for d in buffer.fetch_committed(engine=db, agent=source, limit=10_000, demonstrations=True)
                     if CORRECTION_LABEL not in d.labels]  # corrections came from the traffic: not the arm's
        finally:
            db.dispose()
        self.items = [demonstration_item(d) for d in demos]
        self.batch_size = int(trainer_cfg["algorithm"]["demo_batch_size"])
        self.root, self.source, self.name, self.model_path = root, source, name, model_path
        self.start_version = self.version = start_version
        self.seconds_at = {start_version: 0.0}  # version -> seconds of training it took from the start
        self.worker = LearnerWorker(deep_merge(trainer_cfg, {"log_level": "warning"}))
        self.worker.setup()
        self.worker.ensure_agent(name, adapter_dir=str(checkpoints.version_dir(root, source, start_version)))

    def train(self, steps: int) -> int:
        """``steps`` more supervised steps, then publish; returns the version published."""
        from services.trainer.batches import Norms, in_turn

        t0 = time.monotonic()
        for _ in range(steps):
            batch = in_turn(self.items, self.batch_size, self.version)  # what the Trainer's step of this number replays
            self.worker.train_step(self.name, batch, Norms.of(batch), self.version, self.version)
            self.version += 1
        self.seconds_at[self.version] = self.seconds_at.get(self.version - steps, 0.0) + time.monotonic() - t0
        self.worker.publish(self.name, str(self.root), self.version, {
            "step": self.version, "algorithm": "supervised on the demonstrations only (the demo's demonstrations-only arm)",
            "base_model": self.model_path, "parent": f"{self.source}/v{self.start_version}", "demonstrations": len(self.items)})
        return self.version
