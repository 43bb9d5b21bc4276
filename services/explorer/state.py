"""ExplorerState: the objects of one running Explorer, built once by ``create_app`` (app.py) and
reached by the routes through ``request.app.state.kaizen`` (api/deps.py)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from sqlalchemy.engine import Engine as DBEngine

from services.common.http.access import Access
from services.explorer.config import ExplorerConfig
from services.explorer.edge.metrics import ExplorerMetrics
from services.explorer.edge.middleware import ServedAddress
from services.explorer.recording.feedback import FeedbackService
from services.explorer.recording.recorder import Recorder
from services.explorer.release.controller import ReleaseController
from services.explorer.serving.adapters import AdapterRegistry
from services.explorer.serving.chat import ChatService
from services.explorer.serving.demonstrations import DemonstrationService
from services.explorer.serving.engines import Engine
from services.explorer.translate.completions import CompletionsService
from services.explorer.translate.messages import MessagesService
from services.explorer.translate.responses import ResponsesService


@dataclass
class ExplorerState:
    config: ExplorerConfig
    engine: Engine
    db: DBEngine
    metrics: ExplorerMetrics
    recorder: Recorder
    registry: AdapterRegistry
    chat: ChatService
    responses: ResponsesService
    messages: MessagesService
    completions: CompletionsService
    feedback: FeedbackService
    demonstrations: DemonstrationService
    releases: ReleaseController
    access: Access
    served: ServedAddress  # where this Explorer is reached (the release gate calls itself there)
    started_at: float = field(default_factory=time.time)
    tasks: list[asyncio.Task] = field(default_factory=list)

    def self_url(self) -> str | None:
        return self.served.self_url()
