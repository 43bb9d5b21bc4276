"""DemoConfig: the settings of `kaizen demo`, documented once, here."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from services.common.config import ConfigModel


class TaskSection(ConfigModel):
    train_numbers: int = Field(default=800, ge=16, description="Numbers the simulated users ask about (0..999, shuffled).")
    heldout_numbers: int = Field(default=100, ge=4, description="Numbers never used in traffic, for evaluation.")
    eval_samples: int = Field(default=4, ge=1, description="Answers sampled per held-out question (temperature 1).")
    max_tokens: int = Field(
        default=1, ge=1,
        description="Longest answer the agent may give. 'even' and 'odd' are one token each; with room for more, "
        "GRPO's negative advantages on wrong answers also push down the end-of-answer token, until the model "
        "stops ending its answers (seen with 4 after a few hundred steps).",
    )


class WarmStartSection(ConfigModel):
    enabled: bool = Field(default=True, description="A short supervised warm start that teaches the answer format, not the rule.")
    examples: int = Field(default=20, ge=1, le=800, description="Questions in the warm start, spread evenly over the last digits.")
    steps: int = Field(default=100, ge=1, description="SFT steps on them (about 0.5 s each on 2 CPU cores).")
    lr: float = Field(default=3e-3, gt=0, description="Learning rate of the warm start.")


class TrafficSection(ConfigModel):
    tasks_per_batch: int = Field(default=16, ge=1, description="Questions per round of simulated traffic.")
    repeat: int = Field(default=4, ge=1, description="Runs per question (a GRPO group).")
    concurrency: int = Field(default=16, ge=1, description="Episodes in flight at once.")
    max_backlog: int = Field(default=128, ge=1, description="Pause traffic while this many committed experiences wait for the trainer.")


class DemoConfig(ConfigModel):
    run_dir: str = Field(default="runs/demo", description="Each run gets a fresh folder under this.")
    model_path: str = Field(default=".cache/tiny-model", description="Base model; built with `kaizen tiny-model` if missing.")
    agent: str = Field(default="parity", description="Name of the agent (adapter) being trained.")
    seed: int = Field(default=0, description="Seed of the task split and the warm start.")
    duration_s: float = Field(default=300.0, gt=0, description="How long the online loop runs.")
    min_new_versions: int = Field(
        default=0, ge=0,
        description="Keep the online loop going past duration_s until its traffic was served by this many versions "
        "newer than the start one (0: stop at duration_s). For slow machines and tests.")
    max_duration_s: float | None = Field(
        default=None, gt=0,
        description="Hard limit of the online loop when min_new_versions extends it (default: 4 x duration_s).")
    progress_every_s: float = Field(default=5.0, gt=0, description="Seconds between progress lines.")
    task: TaskSection = Field(default_factory=TaskSection)
    warm_start: WarmStartSection = Field(default_factory=WarmStartSection)
    traffic: TrafficSection = Field(default_factory=TrafficSection)
    explorer: dict[str, Any] = Field(default_factory=dict, description="Extra Explorer config (merged over the demo's).")
    trainer: dict[str, Any] = Field(default_factory=dict, description="Extra Trainer config (merged over the demo's).")
