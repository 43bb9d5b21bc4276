"""The Explorer's own exceptions as OpenAI-shaped errors, registered beside the handlers every
service shares (services/common/http/errors.py): the buffer's refusals of a feedback or commit,
an overloaded or failing engine, records the buffer did not take."""

from __future__ import annotations

from fastapi import FastAPI, Request

from services.common.buffer import AlreadyConsumed, IdempotencyKeyReused, UnknownIds
from services.common.http.errors import error_response, install_error_handlers, logged_error
from services.explorer.recording.recorder import RecordsNotWritten, RecordsSetAside
from services.explorer.serving.engines.base import EngineError, EngineOverloaded


def install_explorer_error_handlers(app: FastAPI) -> None:
    install_error_handlers(app)

    @app.exception_handler(UnknownIds)
    async def _unknown(_: Request, exc: UnknownIds):
        return error_response(404, str(exc), param="msg_ids", code="unknown_id")

    @app.exception_handler(AlreadyConsumed)
    async def _consumed(_: Request, exc: AlreadyConsumed):
        return error_response(409, str(exc), param="msg_ids", code="already_consumed")

    @app.exception_handler(IdempotencyKeyReused)
    async def _key_reused(_: Request, exc: IdempotencyKeyReused):
        return error_response(409, f"{exc}; nothing was changed", param="idempotency_key", code="idempotency_key_reused")

    @app.exception_handler(EngineOverloaded)
    async def _overloaded(_: Request, exc: EngineOverloaded):
        return error_response(503, f"engine overloaded: {exc}", code="overloaded", headers={"Retry-After": "1"})

    @app.exception_handler(EngineError)
    async def _engine(_: Request, exc: EngineError):
        return error_response(500, f"the engine failed on this request ({logged_error('engine error', exc)})",
                              code="engine_error")

    @app.exception_handler(RecordsNotWritten)
    async def _not_written(_: Request, exc: RecordsNotWritten):
        return error_response(503, str(exc), param="msg_ids", code="buffer_unavailable", headers={"Retry-After": "2"})

    @app.exception_handler(RecordsSetAside)
    async def _set_aside(_: Request, exc: RecordsSetAside):
        return error_response(422, str(exc), param="msg_ids", code="record_set_aside")
