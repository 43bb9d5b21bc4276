"""DemoConfig: the settings of `kaizen demo`, documented once, here.

Two tasks: ``tools`` (the default: SmolLM2-135M-Instruct learns to answer word problems with a
calculator tool, services/demo/tools_demo.py) and ``parity`` (the tiny random model learns "Is N
even or odd?" in a few minutes, the fast loop CI runs, services/demo/parity_demo.py). Settings
of one task live in its section; the Trainer's and the Explorer's own keys are set through
``trainer`` and ``explorer`` (merged over what the demo sets).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from services.common.config import AdaptiveRunsSection, ConfigModel


class TrafficSection(AdaptiveRunsSection):
    """Each task has its own defaults (``_PARITY_TRAFFIC``, ``_TOOLS_TRAFFIC``); keys given fill in over them."""

    section = "traffic"

    tasks_per_batch: int = Field(default=16, ge=1, description="Questions per round of simulated traffic.")
    repeat: int = Field(default=4, ge=1, description="Runs (episodes) per question: a GRPO group.")
    concurrency: int = Field(default=16, ge=1, description="Episodes in flight at once.")
    max_backlog: int = Field(default=128, ge=1, description="Pause traffic while this many committed experiences wait for the trainer.")


_PARITY_TRAFFIC = {"tasks_per_batch": 16, "repeat": 4, "concurrency": 16, "max_backlog": 128}
_TOOLS_TRAFFIC = {"tasks_per_batch": 2, "repeat": 8, "concurrency": 16, "max_backlog": 32}


def _traffic_over(defaults: dict[str, int]):
    """A ``mode="before"`` validator: a partial traffic section keeps the task's defaults for the keys it leaves out."""

    def fill(cls, value: Any) -> Any:
        return {**defaults, **value} if isinstance(value, dict) else value

    return field_validator("traffic", mode="before")(classmethod(fill))


class WarmStartSection(ConfigModel):
    enabled: bool = Field(default=True, description="A short supervised warm start that teaches the answer format, not the rule.")
    examples: int = Field(default=20, ge=1, le=800, description="Questions in the warm start, spread evenly over the last digits.")
    steps: int = Field(default=100, ge=1, description="SFT steps on them (about 0.5 s each on 2 CPU cores).")
    lr: float = Field(default=3e-3, gt=0, description="Learning rate of the warm start.")


class ParitySection(ConfigModel):
    train_numbers: int = Field(default=800, ge=16, description="Numbers the simulated users ask about (0..999, shuffled).")
    heldout_numbers: int = Field(default=100, ge=4, description="Numbers never used in traffic, for evaluation.")
    eval_samples: int = Field(default=4, ge=1, description="Answers sampled per held-out question (temperature 1).")
    max_tokens: int = Field(
        default=1, ge=1,
        description="Longest answer the agent may give. 'even' and 'odd' are one token each; with room for more, "
        "GRPO's negative advantages on wrong answers also push down the end-of-answer token, until the model "
        "stops ending its answers (seen with 4 after a few hundred steps).",
    )
    warm_start: WarmStartSection = Field(default_factory=WarmStartSection)
    traffic: TrafficSection = Field(default_factory=lambda: TrafficSection(**_PARITY_TRAFFIC))

    fill_traffic = _traffic_over(_PARITY_TRAFFIC)


# The traffic's sampling temperature by default: the agent's own traffic paid at 1.3 and not at 1 (python -m
# tests.bench.learning --settings base explore, seeds 3-6; docs/DEMO.md)
EXPLORE_TEMPERATURE = 1.3

# Whether `make demo` turns the levers on: off until `python -m tests.bench.learning` shows they pay (see the issue 29 note).
LEVERS_DEFAULT = False


class PlateauSection(ConfigModel):
    """The demonstrations-only arm trained on until it stops improving (services/demo/demonstrations_only.py)."""

    max_steps: int = Field(
        default=0, ge=0,
        description="Supervised steps on the demonstrations alone at most, counted from the cold start (0: off). "
        "The report then compares the online loop with the best the demonstrations alone reached.")
    every: int = Field(default=4, ge=1, description="Steps between measurements on the validation problems (the arm's, and "
                       "with tools.keep_best the online loop's).")
    patience: int = Field(default=2, ge=1, description="Stop after this many measurements without a higher validation score.")
    validation: int = Field(
        default=40, ge=4,
        description="Validation problems (apart from the traffic and the held-out ones): the arm's best version (and with "
        "tools.keep_best the online loop's) is chosen on them, then measured on the held-out problems.")


class ToolsSection(ConfigModel):
    task: Literal["calculator", "units"] = Field(
        default="calculator",
        description="calculator: arithmetic word problems answered with a calculator tool (services/demo/tools_task.py); "
        "units: questions about measures answered with a unit converter, scored 1 for the number within 1% with its unit, "
        "0.5 without the unit (services/demo/units_task.py).")
    heldout: int = Field(default=80, ge=4, description="Held-out problems (never asked in traffic), one episode each per evaluation.")
    traffic_problems: int = Field(default=2000, ge=16, description="Problems the simulated users draw from.")
    demonstrations: int = Field(
        default=16, ge=2, le=16,
        description="Hand-written demonstrations posted for the cold start (two per episode: the call, then the answer).")
    demonstrated_operations: str | None = Field(
        default=None,
        description="Which kinds of problem the demonstrations show (8 problems, as many of each): some of * + - / "
        "(calculator) or of l m v t (units: length, mass, volume, temperature); default: all. The others are learnt "
        "from traffic alone, and the report splits held-out success by them.")
    max_turns: int = Field(default=3, ge=2, description="Calls per episode at most; an episode without a final answer scores 0.")
    max_tokens: int | None = Field(
        default=None, ge=8,
        description="Tokens per call at most. Default: the task's (calculator 40: its call takes 36-38 with the tags; units 52: 41-48).")
    temperature: float = Field(default=1.0, ge=0, description="Sampling temperature of the evaluations, and of the traffic unless explore_temperature is set.")
    explore_temperature: float | None = Field(
        default=EXPLORE_TEMPERATURE, gt=0, le=2,
        description="Sample the traffic (never the evaluations) at this temperature: its calls are exploration runs "
        "(metadata.explore) and the Explorer gets agents.exploration_temperature for the agent, so the records hold "
        "the temperature sampled at and the Trainer scores them at it. null: the traffic samples at `temperature`. "
        "The demo's traffic is all repeated runs that no user reads: a production agent explores in its shadow runs.")
    call_credit: float = Field(
        default=0.0, ge=0, le=0.5,
        description="The traffic's rewards only (never the evaluations'): an episode whose answer scored less is rewarded "
        "this much when one of its tool calls computed the answer, half as much when one only had the right form (the "
        "calculator: the problem's operators; the converter: its two units). A signal for the call itself: a group "
        "whose runs all answered wrong still tells the right operation from a wrong one. 0: the answer alone.")
    eval_concurrency: int = Field(default=16, ge=1, description="Held-out episodes in flight at once.")
    control: bool = Field(
        default=True,
        description="A supervised-only control arm, measured beside the online loop: the cold-start adapter trained, in "
        "the demo process, for as many more steps as the online loop's Trainer took, on the same replayed "
        "demonstrations and nothing else; so the report can say which part of the online gain GRPO on the traffic "
        "gave, and which the replayed demonstrations would have given alone.")
    levers: bool = Field(
        default=LEVERS_DEFAULT,
        description="The Trainer's levers for learning from the traffic (services/demo/tools_demo.py LEVERS: the agent's "
        "successes replayed, the demonstrations decaying and replayed where groups failed, flat groups against a "
        "baseline, importance correction); false: GRPO with the demonstrations replayed every step and flat groups "
        "set aside (kept with words=hints). "
        "`python -m tests.bench.learning` compares the two.")
    words: Literal["off", "hints", "corrections"] = Field(
        default="off",
        description="Feedback in words from the simulated users, after a wrong answer, beside its reward: hints "
        "(\"call the calculator with ...\": the Trainer adds hint_coef times the self-distillation advantage on those "
        "calls) or corrections (the episode's first call as it should have been: a new demonstration).")
    hint_coef: float = Field(default=1.0, gt=0, description="words=hints: the Trainer's algorithm.grpo.hint_coef.")
    hint_calls: Literal["episode", "tool"] = Field(
        default="episode",
        description="words=hints: which calls of a wrong episode get the hint (the reward goes to all of them): every call "
        "(episode), or only its first call, the tool call the hint names, and only when that call did not compute the "
        "answer (tool).")
    correct_runs: Literal["seen", "all"] = Field(
        default="seen",
        description="words=corrections: which runs of a task a user corrects: the one served to them (seen: run 0; the "
        "others are the repeat runs the Explorer makes beside it), or every wrong run (all, as measured before "
        "2026-11-28: up to `repeat` copies of one correction a task, which crowd the 16 demonstrations out of the "
        "Trainer's in-turn replay).")
    keep_best: bool = Field(
        default=False,
        description="The online loop keeps its best version, as a release gate on a validation suite would: after the loop "
        "its versions are measured on the validation problems (tools.plateau.validation of them, every tools.plateau.every "
        "steps from the cold start, and its last), and the earliest with the highest score is measured on the held-out "
        "problems (the report's \"online loop, best on validation\"). The demonstrations-only arm's best is chosen by "
        "the same rule, on its own curve (which stops at its plateau).")
    gate_every: int | None = Field(
        default=None, ge=0,
        description="The online loop's versions go through the Explorer's release gate (release.mode gated, "
        "release.gate.every): every this many versions the Trainer publishes, the Nth is measured against the version "
        "the gate last measured (or the best it measured: gate_against), greedily on the gate's 32 problems (the release "
        "check's suite), and a rejection rolls the loop back to that version (the Trainer continues from its state); the "
        "versions between serve unmeasured. The cold start's versions are measured the same way, the first against the "
        "base model. 0: every version serves at once (release.mode immediate). Default: the task's (calculator 4, "
        "units 0: docs/DEMO.md).")
    gate_rule: Literal["non_inferiority", "no_harm"] = Field(
        default="no_harm",
        description="The demo gate's release.gate.rule (the loop's versions with tools.gate_every, and the release "
        "check's candidates): non_inferiority (tolerance 0.1): a version is promoted only if shown not worse than "
        "0.1 below the one it is measured against; no_harm (tolerance 0): it is rejected only if shown worse. On 32 "
        "problems the first refused versions that differed without being worse (docs/DEMO.md).")
    gate_against: Literal["last", "best"] = Field(
        default="best",
        description="The demo gate's release.gate.against (with tools.gate_every): each measured version against the "
        "one the gate last measured (last), or against the best it has measured, a rejection rolling the loop back "
        "to that one (best: a walk down in steps too small to show each is still caught).")
    plateau: PlateauSection = Field(default_factory=PlateauSection)
    traffic: TrafficSection = Field(default_factory=lambda: TrafficSection(**_TOOLS_TRAFFIC))

    fill_traffic = _traffic_over(_TOOLS_TRAFFIC)

    @model_validator(mode="after")
    def _task_defaults(self) -> "ToolsSection":
        from services.demo import tasks

        job = tasks.get(self.task)
        kinds = job.operations
        self.demonstrated_operations = kinds if self.demonstrated_operations is None else self.demonstrated_operations
        if not self.demonstrated_operations or set(self.demonstrated_operations) - set(kinds):
            raise ValueError(f"demonstrated_operations must be some of {kinds!r} for task {self.task}, "
                             f"got {self.demonstrated_operations!r}")
        self.max_tokens = self.max_tokens or job.max_tokens
        self.gate_every = job.gate_every if self.gate_every is None else self.gate_every  # 0: immediate
        return self

    @model_validator(mode="after")
    def _hint_scope(self) -> "ToolsSection":
        if self.hint_calls != "episode" and self.words != "hints":
            raise ValueError(f"hint_calls={self.hint_calls} says which calls get a hint: it needs words=hints, not words={self.words}")
        if self.correct_runs != "seen" and self.words != "corrections":
            raise ValueError(f"correct_runs={self.correct_runs} says which runs get a correction: it needs words=corrections, "
                             f"not words={self.words}")
        return self


_DEFAULTS = {  # task -> (model_path, agent, duration_s, min_new_versions, max_duration_s)
    # tools: at least 7 minutes and until traffic was served by 24 new versions, at most the tool task's loop_cap_s (the
    # calculator's 11.5 minutes; docs/DEMO.md: the loop sets its flat groups aside, which pays per version, and gets 13-17
    # of them in 7 minutes on 2 cores, 24 in 601-667 s)
    "tools": (".cache/smollm2-135m-instruct", "calculator", 420.0, 24, None),
    "parity": (".cache/tiny-model", "parity", 300.0, 0, None),
}


class DemoConfig(ConfigModel):
    task: Literal["tools", "parity"] = Field(
        default="tools",
        description="tools: SmolLM2-135M-Instruct learns a calculator tool (built with `kaizen pretrained` if missing); "
        "parity: the tiny random model learns parity (fast; what CI runs).")
    run_dir: str = Field(default="runs/demo", description="Each run gets a fresh folder under this.")
    model_path: str | None = Field(
        default=None, description="Base model. Default: .cache/smollm2-135m-instruct (tools), .cache/tiny-model (parity); "
        "either is built if missing.")
    agent: str | None = Field(default=None, description="Name of the agent (adapter) being trained. Default: calculator "
                              "(converter with tools.task=units) / parity.")
    seed: int = Field(default=0, description="Seed of the task split and the warm start.")
    duration_s: float | None = Field(
        default=None, gt=0,
        description="How long the online loop runs at least (and, unless min_new_versions is set too, at most). Default: "
        "420 (tools: then on until 24 new versions, see min_new_versions), 300 (parity).")
    min_new_versions: int | None = Field(
        default=None, ge=0,
        description="Keep the online loop going past duration_s until its traffic was served by this many versions "
        "newer than the start one (0: stop at duration_s). Default: 24 (tools, unless duration_s is set), else 0.")
    max_duration_s: float | None = Field(
        default=None, gt=0,
        description="Hard limit of the online loop when min_new_versions extends it. Default (tools, unless duration_s is "
        "set): 690 for the calculator, 640 for units (tools.task), which keeps the whole demo within 15 minutes on 2 cores; "
        "else 4 x duration_s.")
    progress_every_s: float = Field(default=5.0, gt=0, description="Seconds between progress lines.")
    release_check: bool = Field(
        default=True,
        description="At the end, publish a deliberately broken copy and an exact copy of the serving adapter as "
        "candidates and show the Explorer's release gate deciding each (the online loop itself runs in release.mode "
        "immediate, unless tools.gate_every).")
    tools: ToolsSection = Field(default_factory=ToolsSection)
    parity: ParitySection = Field(default_factory=ParitySection)
    explorer: dict[str, Any] = Field(default_factory=dict, description="Extra Explorer config (merged over the demo's).")
    trainer: dict[str, Any] = Field(default_factory=dict, description="Extra Trainer config (merged over the demo's).")

    @model_validator(mode="after")
    def _task_defaults(self) -> "DemoConfig":
        model_path, agent, duration_s, min_new_versions, max_duration_s = _DEFAULTS[self.task]
        self.model_path = self.model_path or model_path
        self.agent = self.agent or ("converter" if self.task == "tools" and self.tools.task == "units" else agent)
        own = self.duration_s is not None
        if not own:  # the task's own loop; a duration of one's own stops at it unless told otherwise
            self.duration_s = duration_s
            self.min_new_versions = min_new_versions if self.min_new_versions is None else self.min_new_versions
            if self.task == "tools":
                from services.demo import tasks

                max_duration_s = tasks.get(self.tools.task).loop_cap_s
            self.max_duration_s = self.max_duration_s or max_duration_s
        self.min_new_versions = self.min_new_versions or 0
        self.max_duration_s = self.max_duration_s or 4 * self.duration_s
        if self.max_duration_s < self.duration_s:
            raise ValueError(f"max_duration_s={self.max_duration_s:g} is shorter than duration_s={self.duration_s:g}"
                             + ("" if own else f" (the {self.task} task's default: set duration_s too)"))
        return self
