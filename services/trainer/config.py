"""TrainerConfig: every setting of the Trainer service, documented once, here."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from services.common.config import BufferSection, CheckpointsSection, ConfigModel, ModelSection
from services.common.release import ReleaseSection


class AlgorithmSection(ConfigModel):
    name: str = Field(default="grpo", description="Objective (a recipe in services/trainer/recipes/): ppo, grpo or sft.")
    level: Literal["token", "sequence"] = Field(
        default="token", description="token: every token is an action; sequence: the whole response is one action (MARFT)."
    )
    sequence_logprob: Literal["sum", "mean"] = Field(
        default="mean", description="Sequence level: log-prob of a response as the sum (true) or mean (GSPO) of its tokens."
    )
    clip_low: float = Field(default=0.2, ge=0, description="Ratio clipped below at 1 - clip_low.")
    clip_high: float = Field(default=0.2, ge=0, description="Ratio clipped above at 1 + clip_high (DAPO: raise it).")
    kl_coef: float = Field(default=0.0, ge=0, description="Weight of the KL penalty to the base model (adapter off).")
    entropy_coef: float = Field(default=0.0, ge=0, description="Weight of an entropy bonus.")
    kl_metric: bool = Field(
        default=True, description="Log the KL to the base model every step even when kl_coef is 0 (one forward without gradients)."
    )
    # PPO
    gamma: float = Field(default=1.0, ge=0, le=1, description="ppo: discount.")
    lam: float = Field(default=0.95, ge=0, le=1, description="ppo: GAE lambda.")
    value_clip: float = Field(default=0.2, gt=0, description="ppo: value-loss clipping range.")
    vf_coef: float = Field(default=0.5, ge=0, description="ppo: weight of the value loss.")
    critic_lr: float = Field(default=1e-3, gt=0, description="ppo: learning rate of the value head.")
    # GRPO
    std_normalize: bool = Field(default=True, description="grpo: divide group-centred rewards by the group std.")
    min_group_size: int = Field(default=2, ge=1, description="grpo: smallest group trained as a group.")
    group_size: int | None = Field(
        default=None, ge=1, description="grpo: a group this large is complete at once; smaller ones wait group_wait_s."
    )
    group_wait_s: float = Field(default=30.0, ge=0, description="grpo: how long an incomplete group waits for more runs.")
    small_groups: Literal["wait", "discard", "batch"] = Field(
        default="batch",
        description="grpo: after group_wait_s, groups under min_group_size keep waiting, are discarded, "
        "or are trained against the batch mean.",
    )
    team_credit: bool = Field(
        default=True,
        description="Episodes several agents act in: grpo's group statistics count every rewarded episode of the team "
        "for the task (also those this agent sat out, at their team reward, the reward of their last call), and ppo's "
        "GAE runs through every turn of the joint episode (teammates' turns valued by this agent's critic). false: "
        "each agent sees only its own calls. One agent alone: the same either way.",
    )
    # Demonstrations (POST /demonstrations): supervised terms only, in any objective
    sft_coef: float = Field(
        default=1.0, ge=0,
        description="Weight of the supervised term on demonstrations added to every step (0: demonstrations unused).",
    )
    demo_batch_size: int = Field(default=16, ge=1, description="Demonstrations per step (taken in turn when there are more).")
    cold_start_steps: int = Field(
        default=0, ge=0,
        description="While no batch of rollouts is ready, train the first this many steps on demonstrations alone.",
    )
    # SFT
    sft_min_reward: float | None = Field(default=1.0, description="sft: train on experiences with at least this reward.")
    sft_label: str | None = Field(default="demonstration", description="sft: also train on experiences with this feedback label.")

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        from services.trainer.recipes import REGISTRY  # the recipes import torch: only when a trainer config is read

        if v not in REGISTRY:
            raise ValueError(f"unknown algorithm {v!r}; use one of {', '.join(sorted(REGISTRY))}")
        return v


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


class GuardSection(ConfigModel):
    """A step that makes the agent much worse at its own demonstrations is undone before it is
    published: their per-token NLL is measured before and after each update (needs demonstrations)."""

    demonstrations: int = Field(
        default=64, ge=0, description="The agent's first this many demonstrations are scored around every step (0: no guard).",
    )
    max_ratio: float = Field(
        default=2.0, ge=1, description="An update is refused when their NLL after it exceeds max_ratio x before + slack.",
    )
    slack: float = Field(default=0.002, ge=0, description="Nats per token an update may add on top of max_ratio.")
    retries: int = Field(
        default=1, ge=0, description="A refused update is redone this many times, each at half the learning rate of the "
        "last; when all are refused the step keeps the weights it started from (its data is consumed).",
    )


class StalenessSection(ConfigModel):
    max_staleness: int = Field(default=4, ge=0, description="Experiences from more versions back than this are stale.")
    policy: Literal["discard", "downweight"] = Field(default="discard", description="What happens to stale experiences.")
    downweight: float = Field(default=0.5, gt=0, le=1, description="downweight: factor per version beyond max_staleness.")
    catch_up_max_rows: int = Field(
        default=1024, ge=0,
        description="Catch-up on a backlog (a Trainer that was down, or slower than the traffic): while more committed "
        "experiences wait than the coming steps can take before they pass max_staleness, a step takes as many as "
        "it needs so that every one is trained in time, up to this many (train_batch_size at least). No trained "
        "batch is ever more than max_staleness versions off the policy that made it; what still cannot be "
        "trained in time is stale as before. 0: off (steps of train_batch_size, a backlog mostly goes stale).",
    )


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
    micro_batch_size: int = Field(default=8, ge=1, description="Sequences per forward/backward (gradient accumulation).")
    shared_prefix_min_tokens: int = Field(
        default=32, ge=0,
        description="A prompt prefix every sequence of a micro-batch shares (a system prompt, tool descriptions) is "
        "computed once when it is at least this long; same losses and gradients, less work. 0: never.")
    epochs: int = Field(default=1, ge=1, description="Optimizer updates per batch.")
    torch_threads: int | None = Field(default=None, ge=1, description="torch intra-op threads of each learner.")
    progress: bool = Field(default=True, description="Show a progress line on a terminal.")
    schedule: ScheduleSection = Field(default_factory=ScheduleSection)


class RaySection(ConfigModel):
    address: str | None = Field(default=None, description="Join this Ray cluster (e.g. auto, ray://host:10001); absent: start a local one.")
    workers: int = Field(default=1, ge=1, description="Data-parallel learner workers (gradients all-reduced).")
    num_cpus_per_worker: float = Field(default=1, gt=0, description="CPUs Ray reserves for each learner worker.")
    num_gpus_per_worker: float = Field(default=0, ge=0, description="GPUs Ray reserves for each learner worker.")


class TrainerConfig(ConfigModel):
    model: ModelSection
    buffer: BufferSection = Field(default_factory=BufferSection)
    checkpoints: CheckpointsTrainerSection = Field(default_factory=CheckpointsTrainerSection)
    algorithm: AlgorithmSection = Field(default_factory=AlgorithmSection)
    lora: LoraSection = Field(default_factory=LoraSection)
    optim: OptimSection = Field(default_factory=OptimSection)
    staleness: StalenessSection = Field(default_factory=StalenessSection)
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
        sch = self.trainer.schedule
        if sch.mode == "round_robin":
            if not (sch.order or self.trainer.agents):
                raise ValueError("trainer.schedule.mode=round_robin needs the agents' order: set trainer.schedule.order "
                                 "(or trainer.agents)")
            if sch.order and self.trainer.agents and set(sch.order) - set(self.trainer.agents):
                raise ValueError(f"trainer.schedule.order names agents outside trainer.agents: "
                                 f"{sorted(set(sch.order) - set(self.trainer.agents))}")
        if self.algorithm.name == "sft" and self.algorithm.sft_min_reward is None and not self.algorithm.sft_label:
            raise ValueError("sft needs algorithm.sft_min_reward or algorithm.sft_label to pick demonstrations")
        return self
