"""TrainerConfig: every setting of the Trainer service, documented once: here, in
services/trainer/sections.py (what the objectives and batch rules read) and in each recipe's own
section (services/trainer/recipes/)."""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

from pydantic import ConfigDict, Field, ValidationError, model_validator

from services.common.config import BufferSection, CheckpointsSection, ConfigModel, ModelSection
from services.common.release import ReleaseSection
from services.trainer.recipes import REGISTRY, Recipe, RecipeConfig, build_recipe, recipe_class
from services.trainer.sections import GuardSection, LateRewardsSection, ObjectiveSection, StalenessSection

log = logging.getLogger(__name__)


class AlgorithmSection(ObjectiveSection):
    """The objective: ``name`` picks a recipe (services/trainer/recipes/), whose own settings are the
    section named after it (``algorithm.grpo.group_size``, ``algorithm.ppo.gamma``, ...); the keys
    every objective shares are here. Sections of recipes not chosen may stay in a file (checked, unused)."""

    model_config = ConfigDict(extra="allow", validate_default=True)

    name: str = Field(
        default="grpo",
        description="Objective: ppo, grpo, sft (labelled rows), rft (rewarded traffic), or module:RecipeClass for one "
        "of your own (loaded in the Trainer and every learner).",
    )

    @model_validator(mode="before")
    @classmethod
    def _sections(cls, data: Any) -> Any:
        """Validate the recipe sections, and move the flat keys of older configs (algorithm.group_size)
        into the section of the recipe that owns them (algorithm.grpo.group_size), with a warning."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        name = data.get("name", cls.model_fields["name"].default)
        chosen = recipe_class(name)  # a ValueError names an unknown one
        owners = [chosen] + [r for r in REGISTRY.values() if r is not chosen]
        for key in [k for k in data if k not in cls.model_fields and k not in REGISTRY and k != chosen.name]:
            owner = next((r for r in owners if key in r.legacy_keys), None)
            if owner is None:
                continue  # an unknown key: named by the check after validation
            section = dict(data.get(owner.name) or {})
            section.setdefault(owner.legacy_keys[key], data.pop(key))
            data[owner.name] = section
            log.warning("config key algorithm.%s is now algorithm.%s.%s", key, owner.name, owner.legacy_keys[key])
        return data

    @model_validator(mode="after")
    def _check_sections(self) -> "AlgorithmSection":
        chosen = recipe_class(self.name)
        extra = self.__pydantic_extra__  # a dict: extra="allow"
        for key, value in list(extra.items()):
            recipe = chosen if key == chosen.name else REGISTRY.get(key)
            if recipe is None:
                raise ValueError(f"unknown key algorithm.{key}; the recipes' sections are "
                                 f"{', '.join(sorted(set(REGISTRY) | {chosen.name}))}")
            if not isinstance(value, recipe.Config):
                try:
                    extra[key] = recipe.Config.model_validate(value or {})
                except ValidationError as e:
                    raise ValueError(f"algorithm.{key}: {e}") from None
        if chosen.name not in extra:
            extra[chosen.name] = chosen.Config()
        self.recipe()  # the recipe's own checks of its settings against the shared ones (a ValueError names them)
        return self

    def section(self) -> RecipeConfig:
        """The chosen recipe's own settings."""
        return self.__pydantic_extra__[recipe_class(self.name).name]

    def recipe(self) -> Recipe:
        """The chosen objective, built with its settings."""
        return build_recipe(self.name, self.section(), self)


class LoraSection(ConfigModel):
    r: int = Field(default=16, ge=1, description="LoRA rank (the vllm engine needs 1, 8, 16, 32, 64, ...).")
    alpha: float = Field(default=32, gt=0, description="LoRA alpha.")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="LoRA dropout.")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="Modules that get LoRA weights.",
    )


class OptimSection(ConfigModel):
    lr: float = Field(default=1e-4, gt=0, description="AdamW learning rate of the adapter.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW betas.")
    grad_clip: float = Field(default=1.0, gt=0, description="Clip the global gradient norm to this.")
    warmup_steps: int = Field(default=0, ge=0, description="Linear learning-rate warm-up steps.")
    decay_steps: int | None = Field(
        default=None, ge=1, description="After the warm-up, the learning rate falls to min_lr_ratio x lr over this many "
        "of the agent's steps, then stays there (absent: constant). The value head of ppo keeps critic_lr.")
    decay: Literal["cosine", "linear"] = Field(default="cosine", description="The shape of the decay.")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1, description="The learning rate at the decay's end, "
                                "as a fraction of lr (0: an online learner stops learning there).")

    @model_validator(mode="after")
    def _decay_needs_steps(self) -> "OptimSection":
        # by value, not by the keys given: a config dumped whole (to the learners) names every key
        defaults = {k: type(self).model_fields[k].default for k in ("decay", "min_lr_ratio")}
        if self.decay_steps is None and (given := sorted(k for k, v in defaults.items() if getattr(self, k) != v)):
            raise ValueError(f"optim.{given[0]} shapes the learning rate's decay: it needs optim.decay_steps")
        return self

    def lr_at(self, step: int) -> float:
        """The learning rate of the agent's step ``step`` (0 the first): warm-up, then decay, then the floor."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.warmup_steps and step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.decay_steps is None:
            return self.lr
        done = min(1.0, (step - self.warmup_steps) / self.decay_steps)
        fall = done if self.decay == "linear" else (1 - math.cos(math.pi * done)) / 2
        return self.lr * (1 - (1 - self.min_lr_ratio) * fall)


class CheckpointsTrainerSection(CheckpointsSection):
    keep_versions: int = Field(default=5, ge=1, description="Newest published versions kept on disk.")
    delete_grace_s: float = Field(
        default=600.0, ge=0, description="An old version is deleted only this long after a newer one appeared, "
        "and never while an Explorer replica reports it in use.",
    )
    keep_states: int = Field(default=2, ge=1, description="Trainer state snapshots kept (the newest is the resume point).")


class ScheduleSection(ConfigModel):
    """Which agents train when (MARFT's agent-by-agent schedule). The turn is derived from the
    buffer's trainer_steps, so it survives restarts."""

    mode: Literal["simultaneous", "round_robin"] = Field(
        default="simultaneous", description="simultaneous: every agent with data trains; round_robin: one agent trains "
        "for `interval` steps while the others stay frozen, in `order`.")
    interval: int = Field(default=1, ge=1, description="round_robin: steps per turn (MARFT's agent_iteration_interval).")
    order: list[str] = Field(
        default_factory=list, description="round_robin: the agents' order (empty: trainer.agents, else every agent with "
        "data or steps, by name).")
    frozen_experiences: Literal["keep", "discard"] = Field(
        default="keep", description="round_robin: what an agent's experiences recorded before its turn began (while a "
        "teammate was still changing) become when the turn comes: keep (trained as usual, subject to staleness) "
        "or discard (off-policy for the team).")
    turn_timeout_s: float | None = Field(
        default=None, gt=0, description="round_robin: an agent whose turn it is but which has no batch ready for this "
        "long passes the turn on (absent: the others wait for it).")


class TrainerLoopSection(ConfigModel):
    max_steps: int | None = Field(default=None, ge=1, description="Stop after this many steps in this run (absent: forever).")
    poll_interval_s: float = Field(default=1.0, gt=0, description="How often the buffer is polled when idle.")
    run_dir: str = Field(default="runs/trainer", description="Metrics (JSONL, TensorBoard) go here.")
    metrics_port: int | None = Field(
        default=None, ge=0, le=65535,
        description="Serve Prometheus metrics (/metrics) on this port (0: any free port, logged); absent: none.")
    metrics_host: str = Field(default="127.0.0.1", description="Address the Prometheus metrics listen on.")
    device: str = Field(default="auto", description="cpu, cuda or auto.")
    seed: int = Field(default=0, description="Seed of adapter init and data order.")
    agents: list[str] = Field(default_factory=list, description="Train only these agents (empty: every agent with data).")
    micro_batch_size: int = Field(default=8, ge=1, description="Rows per forward/backward (gradient accumulation): a "
                                  "sequence each, or an episode's calls scored in one row (chain_calls).")
    micro_batch_tokens: int | None = Field(
        default=None, ge=1,
        description="Also keep each micro-batch within this many padded positions (rows x (longest prompt + longest "
        "response)): many short sequences share a forward, long ones go few at a time, so memory follows tokens, not "
        "rows. With a large micro_batch_size it sizes micro-batches by tokens alone (on a GPU: fewer, fuller "
        "forwards). A sequence longer than this is a micro-batch alone. Absent: micro_batch_size alone. The gradient "
        "is the same however the batch is cut. A critic's recipe cuts by episodes and micro_batch_size alone.")
    shared_prefix_min_tokens: int = Field(
        default=32, ge=0,
        description="A prompt prefix every sequence of a micro-batch shares (a system prompt, tool descriptions) is "
        "computed once when it is at least this long; same losses and gradients, less work. 0: never.")
    chain_calls: bool = Field(
        default=True,
        description="Score a call whose prompt and response begin another call's sequence (an episode's earlier "
        "call, inside the next call's prompt) within that call's forward: a multi-call episode costs about one "
        "forward, not one per call; the same losses and gradients up to float rounding, for every recipe (grammars, "
        "hints and critics included). Only on models whose logits are the LM head's product alone (not Gemma 2's "
        "soft-capping, say). false: one row per call.")
    inert_backward: bool = Field(
        default=False,
        description="Calls whose term of the loss is exactly zero whatever the weights (a GRPO group whose runs all "
        "scored alike, with flat_groups=keep, no KL penalty, entropy bonus or hints) are scored in micro-batches of "
        "their own without gradients: the step's figures count them, its backward passes skip them, its update is the "
        "same (their count: inert_calls in the step record). true: a backward for them too, as before 11-29.")
    epochs: int = Field(default=1, ge=1, description="Optimizer updates per batch.")
    torch_threads: int | None = Field(default=None, ge=1, description="torch intra-op threads of each learner.")
    attention: Literal["auto", "sdpa", "eager"] = Field(
        default="auto",
        description="The attention of the learners' forward and backward: sdpa (torch's fused kernel) or eager (plain "
        "products, softmax in float32, its scores kept for the backward). auto: eager for bfloat16 weights on a CPU, "
        "where torch's fused CPU kernel made the demo's Trainer step about 1.2x slower (docs/TRAINER.md), for each "
        "forward whose scores (rows x heads x queries x keys) stay within 8 Mi; longer rows, and everything else, sdpa.")
    progress: bool = Field(default=True, description="Show a progress line on a terminal.")
    schedule: ScheduleSection = Field(default_factory=ScheduleSection)


class RaySection(ConfigModel):
    address: str | None = Field(default=None, description="Join this Ray cluster (e.g. auto, ray://host:10001); absent: start a local one.")
    workers: int = Field(default=1, ge=1, description="Data-parallel learner workers (gradients all-reduced).")
    num_cpus_per_worker: float = Field(default=1, gt=0, description="CPUs Ray reserves for each learner worker.")
    num_gpus_per_worker: float = Field(default=0, ge=0, description="GPUs Ray reserves for each learner worker.")
    placement: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        default="PACK",
        description="How the learner workers' placement group spreads them over Ray nodes: PACK fills a node first, "
        "STRICT_SPREAD puts each on a node of its own, STRICT_PACK all on one node.")
    placement_timeout_s: float = Field(
        default=300.0, gt=0, description="How long the Trainer waits at start for Ray to place the learner workers "
        "before it stops with an error naming the resources it lacks.")
    recover_timeout_s: float = Field(
        default=600.0, ge=0,
        description="A learner worker that dies (its process or its node) costs the step in flight: the Trainer builds "
        "the workers again and resumes each agent from its last saved state, waiting this long for the cluster to "
        "place them (a node to come back); then it stops with an error, for its supervisor to restart it.")


class TrainerConfig(ConfigModel):
    model: ModelSection
    buffer: BufferSection = Field(default_factory=BufferSection)
    checkpoints: CheckpointsTrainerSection = Field(default_factory=CheckpointsTrainerSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    lora: LoraSection = Field(default_factory=LoraSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    staleness: StalenessSection = Field(default_factory=StalenessSection)
    late_rewards: LateRewardsSection = Field(default_factory=LateRewardsSection)
    guard: GuardSection = Field(default_factory=GuardSection)
    train_batch_size: int = Field(default=16, ge=1, description="Experiences per training step (per agent).")
    save_interval: int = Field(default=1, ge=1, description="Steps per published adapter version.")
    trainer: TrainerLoopSection = Field(default_factory=TrainerLoopSection)
    ray: RaySection = Field(default_factory=RaySection)
    release: ReleaseSection = Field(
        default_factory=ReleaseSection,
        description="The release policy, the same as the Explorer's: immediate publishes to LATEST; gated and canary "
        "publish a candidate and train on only once it is decided.",
    )
    log_level: str = Field(default="info", description="debug, info, warning, error.")
    log_format: Literal["text", "json"] = Field(
        default="text", description="text, or json: one object a line with time, level, logger, message.")

    @model_validator(mode="after")
    def _check(self) -> "TrainerConfig":
        late = self.late_rewards
        if "retrain" in {late.mode, *late.agents.values()}:
            if not self.algorithm.recipe().retrains_late:
                raise ValueError(f"late_rewards: retrain needs an objective that can train a late reward again (grpo); "
                                 f"{self.algorithm.name} cannot")
            if self.algorithm.level != "token":
                raise ValueError("late_rewards: retrain corrects a late call's tokens by importance weights: it needs "
                                 "algorithm.level token")
        sch = self.trainer.schedule
        if sch.mode == "round_robin":
            if not (sch.order or self.trainer.agents):
                raise ValueError("trainer.schedule.mode=round_robin needs the agents' order: set trainer.schedule.order "
                                 "(or trainer.agents)")
            if sch.order and self.trainer.agents and set(sch.order) - set(self.trainer.agents):
                raise ValueError(f"trainer.schedule.order names agents outside trainer.agents: "
                                 f"{sorted(set(sch.order) - set(self.trainer.agents))}")
        return self
