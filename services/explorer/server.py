"""Runs the Explorer under uvicorn: ``kaizen explorer --config configs/explorer.yaml``."""

from __future__ import annotations

import logging

import uvicorn

from services.explorer.app import create_app
from services.explorer.config import ExplorerConfig

log = logging.getLogger(__name__)


def build_server(config: ExplorerConfig) -> uvicorn.Server:
    app = create_app(config)
    uv_config = uvicorn.Config(
        app,
        host=config.server.host,
        port=config.server.port,
        log_level=config.server.log_level,
        access_log=config.server.log_level == "debug",
        timeout_graceful_shutdown=30,
        timeout_keep_alive=config.server.keep_alive_s,
        lifespan="on",
        log_config=None,  # uvicorn's loggers go through Kaizen's handler (text or JSON, request ids)
    )
    return uvicorn.Server(uv_config)


def serve(config: ExplorerConfig) -> None:
    server = build_server(config)
    server.run()
