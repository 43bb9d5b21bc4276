"""One log format for every Kaizen process: text for people, or JSON lines for log pipelines.

Every line logged while the Explorer handles a request carries that request's id (the client's
``X-Request-Id``, or one the Explorer made up): ``request_id`` in JSON, ``[req-…]`` in text. The
same id is returned in the ``X-Request-Id`` header and stored with the experiences it produced.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
from datetime import datetime, timezone

request_id: contextvars.ContextVar[str | None] = contextvars.ContextVar("kaizen_request_id", default=None)

_TEXT = "%(asctime)s %(levelname).1s %(name)s:%(request_tag)s %(message)s"


class _RequestId(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rid = request_id.get()
        record.request_id = rid
        record.request_tag = f" [{rid}]" if rid else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, request_id, and the
    exception's traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if getattr(record, "request_id", None):
            out["request_id"] = record.request_id
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def setup_logging(level: str | int = "info", fmt: str = "text") -> None:
    level = os.environ.get("KAIZEN_LOG_LEVEL", level)
    fmt = os.environ.get("KAIZEN_LOG_FORMAT", fmt)
    if isinstance(level, str):
        level = getattr(logging, level.upper(), logging.INFO)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestId())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT, datefmt="%H:%M:%S"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for noisy in ("httpx", "httpcore", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(max(level, logging.WARNING))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
