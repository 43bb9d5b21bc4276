"""GET /v1/models: the base model and every agent with the version it serves."""

from __future__ import annotations

from fastapi import APIRouter

from services.explorer.deps import StateDep

router = APIRouter()


@router.get("/v1/models")
async def list_models(k: StateDep):
    created = int(k.started_at)
    data = [{"id": k.registry.base_name, "object": "model", "created": created, "owned_by": "kaizen", "root": k.config.model.path, "parent": None}]
    for a in k.registry.describe():
        data.append({
            "id": a["agent"], "object": "model", "created": int(a["loaded_at"]), "owned_by": "kaizen",
            "root": k.config.model.path, "parent": k.registry.base_name,
            # Extensions, not in the OpenAI spec
            "version": a["version"], "adapter": a["adapter"], "reloads": a["reloads"], "last_reload_s": a["last_reload_s"],
        })
    return {"object": "list", "data": data}
