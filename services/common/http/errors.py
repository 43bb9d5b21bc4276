"""One mapping from exceptions to OpenAI-shaped error JSON: {"error": {message, type, param, code}}.

The handlers every service needs (APIError, request validation, HTTP errors, an unavailable
database) are installed by ``install_error_handlers``; each service then registers the mappings of
its own exceptions beside them (the Explorer's engine and recorder errors, for one)."""

from __future__ import annotations

import logging
import secrets
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from starlette.responses import JSONResponse

from services.common.storable import find_unstorable


log = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class APIError(Exception):
    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param, "code": code}}


def logged_error(what: str, exc: BaseException) -> str:
    """Log ``exc`` in full under a fresh error id and return "error id <id>" for the client: a 500
    names no paths, SQL or other internals, and an operator finds the details by the id."""
    error_id = secrets.token_hex(6)
    log.error("%s %s: %s", what, error_id, exc, exc_info=exc)
    return f"error id {error_id}"


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param=param, code=code), status_code=status, headers=headers)


def check_storable(value: Any, param: str) -> None:
    """400 naming the first string in ``value`` that the buffer cannot store."""
    bad = find_unstorable(value, param)
    if bad is not None:
        where, why = bad
        raise APIError(
            400, f"invalid value for {where!r}: the string {why}; Kaizen records every request and no "
            "database can store it (send valid Unicode without NUL characters)",
            param=where, code="invalid_string",
        )


_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict", "literal"}


def _is_type_tag(part) -> bool:
    """Pydantic puts the union member it tried into ``loc`` (``str``, ``list[...]``, model names)."""
    if not isinstance(part, str):
        return False
    return part in _TYPE_TAGS or "[" in part or part[:1].isupper()


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"request body is not valid JSON: {ctx.get('error', first.get('msg'))}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _is_type_tag(p)]
    if not loc and isinstance(first.get("input"), (bytes, str)):
        return "request body must be a JSON object sent with Content-Type: application/json", None
    param = ".".join(loc) or None
    if first.get("type") == "missing" and param:
        msg = f"missing required parameter {param!r}"
    elif param:
        msg = f"invalid value for {param!r}: {first.get('msg')}"
    else:
        msg = f"invalid request body: {first.get('msg')}"
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})"
    return msg, param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(400, message, param=param, code="invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        message = exc.detail if isinstance(exc.detail, str) else "request failed"
        if exc.status_code == 404 and message == "Not Found":
            message = "no such endpoint"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(DBAPIError)
    async def _database(_: Request, exc: DBAPIError):
        # A database that is down or write-locked is a passing condition, not a server bug.
        if exc.connection_invalidated or isinstance(exc, (OperationalError, InterfaceError)):
            log.warning("buffer unavailable: %s", exc)
            return error_response(503, f"the experience buffer is unavailable ({type(exc.orig).__name__}); retry later",
                                  code="buffer_unavailable", headers={"Retry-After": "1"})
        return error_response(500, f"database error ({logged_error('database error', exc)})", code="internal_error")

    # Any other exception is answered by the service's own middleware (a 500 with an error id).
