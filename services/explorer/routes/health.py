"""GET /health (no auth) and GET /metrics (Prometheus text format)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

router = APIRouter()  # no auth
metrics_router = APIRouter()


@router.get("/health")
async def health(request: Request):
    k = request.app.state.kaizen
    stats = k.engine.stats()
    body = {"status": "ok" if stats.error is None else "error",
            "engine": {"running": stats.running, "waiting": stats.waiting}, "recorder_pending": k.recorder.pending}
    if stats.error is not None:
        body["error"] = stats.error
        return JSONResponse(body, status_code=503)
    return body


@metrics_router.get("/metrics")
async def metrics(request: Request):
    k = request.app.state.kaizen
    stats = k.engine.stats()
    m = k.metrics
    m.engine_running.set(stats.running)
    m.engine_waiting.set(stats.waiting)
    m.recorder_pending.set(k.recorder.pending)
    m.adapter_reload_failures.set(k.registry.reload_failures)
    for a in k.registry.describe():
        m.adapter_version.labels(a["agent"]).set(a["version"])
    return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
