"""GET /health (no auth), GET /metrics (Prometheus text format; JSON on request) and GET /openapi.json."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter, Request
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import JSONResponse, Response

from services.explorer.api.deps import StateDep

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
    if "routed_by_affinity" in stats.extra:  # engine.replicas: calls sent to the replica that served their conversation
        body["engine"]["routed_by_affinity"] = int(stats.extra["routed_by_affinity"])
    if problems:
        body["problems"] = problems
    if stats.error is not None:
        body["error"] = stats.error
        return JSONResponse(body, status_code=503)
    return body


def _wants_json(request: Request) -> bool:
    """JSON for ``?format=json`` or an Accept header that names application/json before any
    text format (Prometheus names text/plain or OpenMetrics; a bare */* keeps the text)."""
    if request.query_params.get("format") == "json":
        return True
    for item in request.headers.get("accept", "").split(","):
        kind = item.split(";")[0].strip().lower()
        if kind == "application/json":
            return True
        if kind.startswith("text/") or kind.startswith("application/openmetrics"):
            return False
    return False


def _as_json(k, text: str) -> dict:
    """Every sample by name (labelled ones as ``name{label=value}``), and the keys Trinity-RFT's
    ProxyClient.get_metrics reads, so its dashboards work unchanged."""
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{a}={b}" for a, b in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value

    def total(name: str) -> float:
        return sum(v for key, v in samples.items() if key == name or key.startswith(name + "{"))

    out: dict = {"rollout/total_request_count": total("kaizen_completions_total"),
                 "rollout/total_experience_count": total("kaizen_experiences_recorded_total"),
                 "rollout/ready_experience_count": total("kaizen_committed_total")}
    for i, a in enumerate(k.registry.describe()):
        out[f"rollout/model_{i}/agent"] = a["agent"]
        out[f"rollout/model_{i}/model_version"] = a["version"]
        out[f"rollout/model_{i}/total_request_count"] = samples.get(f"kaizen_completions_total{{agent={a['agent']}}}", 0.0)
    out["metrics"] = samples
    return out


@metrics_router.get("/metrics")
async def metrics(k: StateDep, request: Request):
    stats = k.engine.stats()
    m = k.metrics
    m.engine_running.set(stats.running)
    m.engine_waiting.set(stats.waiting)
    for key, value in stats.extra.items():  # replicas: their sums
        if key.startswith("busy_") and key.endswith("_seconds"):
            m.engine_busy.labels(key[len("busy_"):-len("_seconds")]).set(value)
    rec = k.recorder.health()
    m.recorder_pending.set(rec.pending)
    m.recorder_oldest_pending.set(rec.oldest_pending_s)
    m.recorder_write_failures.set(k.recorder.failures)
    m.journal_segments.set(rec.journal_segments)
    m.adapter_reload_failures.set(k.registry.reload_failures)
    m.episode_pins.set(len(k.chat.episodes))
    m.episode_pin_misses.set(k.chat.episodes.misses)
    for a in k.registry.describe():
        m.adapter_version.labels(a["agent"]).set(a["version"])
    text = m.render()
    if _wants_json(request):
        return _as_json(k, text.decode())
    return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")


@metrics_router.get("/openapi.json", include_in_schema=False)
async def openapi(request: Request):
    return request.app.openapi()
