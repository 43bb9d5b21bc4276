"""The dashboard's configuration: where to read (buffer, checkpoints, the model's tokenizer), where
to listen, and the API keys it accepts.

Its sections carry the names the Explorer's config gives them (``buffer``, ``checkpoints``, ``auth``,
``model``), so ``kaizen dashboard --config explorer.yaml`` reads the same buffer and checkpoints
with the same keys; the sections only the Explorer or the Trainer use are skipped, and what belongs
to neither is an error naming the key.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Sequence

from pydantic import Field

from services.common.config import BufferSection, ConfigModel, load_config, read_yaml_mapping
from services.common.http.access import AuthSection

log = logging.getLogger(__name__)


class DashboardModelSection(ConfigModel):
    path: str | None = Field(
        default=None,
        description="The base model's directory: its tokenizer shows each recorded token as text (absent: token ids).",
    )
    name: str | None = None
    dtype: str | None = None
    chat_template: str | None = None


class DashboardCheckpoints(ConfigModel):
    root: str = Field(default="checkpoints", description="The shared checkpoint directory the Trainer publishes to.")


class DashboardServer(ConfigModel):
    host: str = Field(default="127.0.0.1", description="Address to listen on (loopback by default).")
    port: int = Field(default=8300, ge=0, le=65535, description="Port (0: any free port).")
    log_level: str = Field(default="warning", description="debug, info, warning, error.")
    refresh_s: float = Field(
        default=5.0, ge=0.5, le=3600,
        description="How often the rollups read the buffer's changes, and an open overview or Trainer page asks for "
                    "fresh figures (while the browser shows it).")
    rollups: bool = Field(
        default=True,
        description="Keep per-minute rollups of the experiences in memory (built from the rows when the dashboard "
                    "starts, then from what changed), so an overview costs an agent's hours with traffic, not its "
                    "rows; false: every overview reads the rows.")
    change_margin_s: float = Field(
        default=120.0, ge=0, le=86400,
        description="Each rollup pass reads the changes stamped since the previous pass began, less this: more than "
                    "the writers' clocks may run behind this host's, plus the longest a write waits for a lock (plus the "
                    "replication lag, when buffer.url names a read replica).")
    rebuild_s: float = Field(
        default=0.0, ge=0,
        description="Compute every rollup again from the rows this often (0: only at start), for deployments whose "
                    "writers' clocks cannot be bounded by change_margin_s.")


class DashboardConfig(ConfigModel):
    buffer: BufferSection = Field(default_factory=BufferSection)
    checkpoints: DashboardCheckpoints = Field(default_factory=DashboardCheckpoints)
    auth: AuthSection = Field(
        default_factory=AuthSection,
        description="The Explorer's keys: a key needs the read scope; a key limited to agents sees only those.")
    model: DashboardModelSection = Field(default_factory=DashboardModelSection)
    dashboard: DashboardServer = Field(default_factory=DashboardServer)


# The top-level keys of an Explorer's or a Trainer's config that the dashboard does not read, named
# here so that the dashboard imports neither service (a unit test keeps the list true to their models).
OTHER_SERVICES_SECTIONS = frozenset({
    # the Explorer's
    "engine", "server", "agents", "reload", "recorder", "release", "privacy", "backpressure", "log_level",
    "log_format",
    # the Trainer's
    "algorithm", "lora", "optim", "staleness", "late_rewards", "guard", "train_batch_size", "save_interval", "trainer", "ray",
})


def load_dashboard_config(path: str | os.PathLike | None, overrides: Sequence[str] = ()) -> DashboardConfig:
    """A dashboard config, an Explorer config or a Trainer config (their other sections skipped)."""
    data: dict[str, Any] = {}
    if path is not None:
        loaded = read_yaml_mapping(path)
        skipped = sorted(k for k in loaded if k in OTHER_SERVICES_SECTIONS)
        if skipped:
            log.info("config sections of the Explorer or the Trainer skipped: %s", ", ".join(skipped))
        data = {k: v for k, v in loaded.items() if k not in skipped}
        if isinstance(data.get("checkpoints"), dict):  # the Trainer's has retention settings too
            data["checkpoints"] = {k: v for k, v in data["checkpoints"].items() if k == "root"}
    return load_config(DashboardConfig, None, overrides, base=data)
