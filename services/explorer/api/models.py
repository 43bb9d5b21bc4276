"""GET /v1/models and GET /v1/models/{id}: the base model and every agent with the version it serves
(a key limited to some agents sees those alone; another agent is a model that does not exist)."""

from __future__ import annotations

from fastapi import APIRouter

from services.common.http.errors import APIError
from services.explorer.api.deps import PrincipalDep, StateDep

router = APIRouter()


def _models(k, principal) -> list[dict]:
    created = int(k.started_at)
    data = [{"id": k.registry.base_name, "object": "model", "created": created, "owned_by": "kaizen", "root": k.registry.base_name, "parent": None}]
    for a in k.registry.describe():
        if not principal.may_use(a["agent"]):
            continue
        data.append({
            "id": a["agent"], "object": "model", "created": int(a["loaded_at"]), "owned_by": "kaizen",
            "root": k.registry.base_name, "parent": k.registry.base_name,
            # Extensions, not in the OpenAI spec
            "version": a["version"], "adapter": a["adapter"], "reloads": a["reloads"], "last_reload_s": a["last_reload_s"],
            "release": {**k.releases.describe(a["agent"]), "canary": a["canary"]},
        })
    return data


@router.get("/v1/models")
async def list_models(k: StateDep, principal: PrincipalDep):
    return {"object": "list", "data": _models(k, principal)}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, k: StateDep, principal: PrincipalDep):
    for m in _models(k, principal):
        if m["id"] == model_id:
            return m
    raise APIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")
