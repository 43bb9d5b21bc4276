"""Configuration loading shared by every Kaizen service.

Each service has one pydantic model (``ExplorerConfig``, ``TrainerConfig``). A config is built from
YAML, then ``KAIZEN_`` environment variables, then dotted ``key=value`` overrides from the command
line, and unknown keys are errors that name the key.

Environment variables use ``__`` between levels: ``KAIZEN_BUFFER__URL=sqlite:///b.db`` sets
``buffer.url``, ``KAIZEN_TRAIN_BATCH_SIZE=16`` sets ``train_batch_size``. The same environment is
often shared by the Explorer and the Trainer, so a variable whose first level is not a section of
this service is skipped (and logged); inside a section this service has, an unknown key is an error.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from runner_sdk.groups import AdaptiveRepeat
from services.common.chat_templates import resolve_chat_template
from services.common.config_error import ConfigError

log = logging.getLogger(__name__)

ENV_PREFIX = "KAIZEN_"

T = TypeVar("T", bound="ConfigModel")


class ConfigModel(BaseModel):
    """Base of every config section: unknown keys are rejected."""

    model_config = ConfigDict(extra="forbid", validate_default=True)


class AdaptiveRunsSection(ConfigModel):
    """A section whose ``repeat`` runs per task may come in stages (runner_sdk AdaptiveRepeat): first_runs
    each, more where they disagree or all failed. ``section`` names it in errors."""

    section: ClassVar[str] = ""
    repeat: int
    first_runs: int | None = Field(
        default=None, ge=1, description="Adaptive groups (runner_sdk AdaptiveRepeat): each task gets this many runs "
        "first; one whose runs disagree or all failed is completed to `repeat`, one every run solved stops there. "
        "None: `repeat` runs each, at once.")
    failed_runs: int | None = Field(
        default=None, ge=1, description="With first_runs: a task every one of whose `repeat` runs failed goes on to "
        "this many (more tries where the agent rarely succeeds). None: `repeat`.")

    @model_validator(mode="after")
    def _adaptive(self):
        s = self.section
        if self.first_runs is None and self.failed_runs is not None:
            raise ValueError(f"{s}.failed_runs needs {s}.first_runs (adaptive groups)")
        if self.first_runs is not None and self.first_runs > self.repeat:
            raise ValueError(f"{s}.first_runs ({self.first_runs}) must be at most {s}.repeat ({self.repeat})")
        if self.failed_runs is not None and self.failed_runs < self.repeat:
            raise ValueError(f"{s}.failed_runs ({self.failed_runs}) must be at least {s}.repeat ({self.repeat})")
        return self

    @property
    def group_size(self) -> int | None:
        """The Trainer's algorithm.grpo.group_size: ``repeat``, or none with adaptive groups (sizes vary; each
        round commits its groups whole)."""
        return self.repeat if self.first_runs is None else None

    def adaptive(self) -> AdaptiveRepeat:
        """The runs each task gets: ``repeat`` each, at once, without first_runs."""
        if self.first_runs is None:
            return AdaptiveRepeat.fixed(self.repeat)
        return AdaptiveRepeat(first=self.first_runs, full=self.repeat, failed=self.failed_runs)


class ModelSection(ConfigModel):
    path: str = Field(description="Base model: a local directory or a hub id.")
    name: str | None = Field(
        default=None,
        description="Name under which the base model is served in /v1/models; "
        "defaults to the last part of model.path.",
    )
    dtype: str = Field(
        default="auto",
        description="Weights dtype: auto (bfloat16 on GPU, float32 on CPU), float32, bfloat16, float16.",
    )
    chat_template: str | None = Field(
        default=None,
        description="Replaces the model's own chat template wherever prompts are rendered (Explorer, "
        "Trainer, demo): a built-in name (hermes-tools: ChatML turns with Hermes <tool_call> tools) "
        "or a Jinja file. Absent: the model's own template.",
    )

    @field_validator("chat_template")
    @classmethod
    def _known_template(cls, value: str | None) -> str | None:
        if value is not None:
            resolve_chat_template(value)  # a ConfigError (a ValueError) names the key
        return value

    @property
    def served_name(self) -> str:
        return self.name or Path(self.path.rstrip("/")).name


class BufferSection(ConfigModel):
    url: str = Field(
        default="sqlite:///kaizen-buffer.db",
        description="SQLAlchemy URL of the experience buffer (sqlite:///... or postgresql://...).",
    )


class CheckpointsSection(ConfigModel):
    root: str = Field(
        default="checkpoints",
        description="Shared checkpoint directory: <root>/<agent>/v<N>/ and <root>/<agent>/LATEST.",
    )


def _parse_scalar(text: str) -> Any:
    """Parse an override value the way YAML would (``5`` -> int, ``[a, b]`` -> list)."""
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def _set_dotted(data: dict, dotted: str, value: Any, *, origin: str) -> None:
    parts = [p for p in dotted.split(".")]
    if not all(parts):
        raise ConfigError(f"{origin}: malformed key {dotted!r}")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(
                f"{origin}: cannot set {dotted!r}: {'.'.join(parts[: i + 1])!r} is not a section"
            )
        node = child
    node[parts[-1]] = value


def parse_overrides(overrides: Sequence[str]) -> list[tuple[str, Any]]:
    """Split ``key=value`` strings; a missing ``=`` is an error naming the argument."""
    pairs = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form dotted.key=value")
        pairs.append((key.strip(), _parse_scalar(value)))
    return pairs


def _env_pairs(model: type[ConfigModel], env: Mapping[str, str]) -> list[tuple[str, Any]]:
    pairs = []
    for name, raw in sorted(env.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        dotted = ".".join(p.lower() for p in name[len(ENV_PREFIX):].split("__"))
        if dotted.split(".")[0] not in model.model_fields:
            log.debug("ignoring %s: %s has no section %r", name, model.__name__, dotted)
            continue
        pairs.append((dotted, _parse_scalar(raw)))
    return pairs


def _format_validation_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        if err["type"] == "extra_forbidden":
            lines.append(f"unknown config key {key!r}")
        elif err["type"] == "missing":
            lines.append(f"missing config key {key!r}")
        else:
            lines.append(f"config key {key!r}: {err['msg']} (got {err.get('input')!r})")
    return "; ".join(lines)


def read_yaml_mapping(path: str | os.PathLike) -> dict[str, Any]:
    """The mapping a YAML config file holds; ConfigError naming the file otherwise."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        loaded = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(p)!r} is not valid YAML: {e}") from e
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping at the top level")
    return loaded


def load_config(
    model: type[T],
    path: str | os.PathLike | None = None,
    overrides: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    base: Mapping[str, Any] | None = None,
) -> T:
    """Build ``model`` from YAML at ``path``, then the environment, then dotted overrides."""
    data: dict = dict(base or {})
    if path is not None:
        data.update(read_yaml_mapping(path))
    for key, value in _env_pairs(model, os.environ if env is None else env):
        _set_dotted(data, key, value, origin="environment")
    for key, value in parse_overrides(overrides):
        _set_dotted(data, key, value, origin="command line")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e)) from None


_SECRET_KEYS = {"api_key", "api_keys", "password"}
_URL_PASSWORD = re.compile(r"(://[^:/@]+:)[^@]*@")


def _redact(node: Any) -> Any:
    if isinstance(node, dict):
        return {
            k: ("***" if k in _SECRET_KEYS and v else _redact(v)) for k, v in node.items()
        }
    if isinstance(node, list):
        return [_redact(v) for v in node]
    if isinstance(node, str):
        return _URL_PASSWORD.sub(r"\1***@", node)
    return node


def dump_config(config: BaseModel) -> str:
    """The resolved config as YAML for the start-up log, with keys and passwords hidden."""
    return yaml.safe_dump(_redact(config.model_dump(mode="json")), sort_keys=False).rstrip()


def deep_merge(base: Mapping[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``extra`` laid over it: a mapping in both is merged key by key, anything else in
    ``extra`` replaces the value in ``base``. Neither argument is changed."""
    out = dict(base)
    for k, v in extra.items():
        out[k] = deep_merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out
