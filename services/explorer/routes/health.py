"""GET /health (no auth) and GET /metrics (Prometheus text format)."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

from services.explorer.deps import StateDep

router = APIRouter()  # no auth
metrics_router = APIRouter()


@router.get("/health")
async def health(k: StateDep):
    """ok; degraded (still serving, but records wait for the buffer or were set aside: 200, so a
    load balancer keeps a replica whose answers are safe in its journal); error (the engine: 503)."""
    stats = k.engine.stats()
    rec = k.recorder.health()
    rc = k.config.recorder
    problems = rec.problems(degraded_after_s=rc.degraded_after_s, set_aside_window_s=rc.set_aside_window_s)
    body = {"status": "error" if stats.error is not None else "degraded" if problems else "ok",
            "engine": {"running": stats.running, "waiting": stats.waiting}, "recorder_pending": rec.pending,
            "recorder": asdict(rec)}
    if problems:
        body["problems"] = problems
    if stats.error is not None:
        body["error"] = stats.error
        return JSONResponse(body, status_code=503)
    return body


@metrics_router.get("/metrics")
async def metrics(k: StateDep):
    stats = k.engine.stats()
    m = k.metrics
    m.engine_running.set(stats.running)
    m.engine_waiting.set(stats.waiting)
    rec = k.recorder.health()
    m.recorder_pending.set(rec.pending)
    m.recorder_oldest_pending.set(rec.oldest_pending_s)
    m.recorder_write_failures.set(k.recorder.failures)
    m.journal_segments.set(rec.journal_segments)
    m.adapter_reload_failures.set(k.registry.reload_failures)
    for a in k.registry.describe():
        m.adapter_version.labels(a["agent"]).set(a["version"])
    return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
