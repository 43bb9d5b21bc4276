"""AdapterRegistry on a hand-written engine: a new version serves new requests at once, the old
one stays loaded until its last lease ends, pinned versions get fresh names, and the serving files
tell the Trainer what is still read."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from services.common import checkpoints
from services.explorer.serving.adapters import AdapterRegistry, UnknownModel
from tests.unit.explorer.fakes import FakeEngine


def _publish(root: Path, agent: str, version: int) -> None:
    def write(d: Path) -> None:
        (d / "adapter_config.json").write_text("{}")
        (d / "adapter_model.safetensors").write_bytes(b"x")

    checkpoints.publish_version(root, agent, version, write, {"step": version})


def _serving(root: Path, agent: str) -> list[int]:
    (f,) = (root / agent / ".serving").glob("*.json")
    return json.loads(f.read_text())["versions"]


def test_versions_are_swapped_under_leases_and_released_after_the_last_one(tmp_path):
    engine = FakeEngine()
    _publish(tmp_path, "default", 1)
    registry = AdapterRegistry(engine=engine, checkpoints_root=str(tmp_path), base_name="base", agents=[],
                               default_agent="default")

    async def go():
        await registry.start()
        old = await registry.acquire("default")
        assert (old.version, old.ref.name) == (1, "default-v1")
        _publish(tmp_path, "default", 2)
        assert await registry.sync("default")
        new = await registry.acquire("base")  # the base model's name means the default agent
        assert new.version == 2 and set(engine.loaded) == {"default-v1", "default-v2"}
        assert _serving(tmp_path, "default") == [1, 2]  # v1 is still read by a running request
        registry.release(old)
        await asyncio.sleep(0.05)
        assert engine.removed == ["default-v1"] and _serving(tmp_path, "default") == [2]
        pinned = await registry.acquire("default@v1")  # loaded again, under a name never used before
        assert pinned.version == 1 and pinned.ref.name != "default-v1"
        registry.release(pinned)
        registry.release(new)
        await asyncio.sleep(0.05)
        assert set(engine.loaded) == {"default-v2"}
        base = await registry.acquire("default@v0")
        assert base.ref is None
        with pytest.raises(UnknownModel):
            await registry.acquire("default@v9")
        with pytest.raises(UnknownModel):
            await registry.acquire("nobody")

    asyncio.run(go())


def test_a_broken_latest_is_refused_and_the_current_version_keeps_serving(tmp_path):
    engine = FakeEngine()
    _publish(tmp_path, "default", 1)
    registry = AdapterRegistry(engine=engine, checkpoints_root=str(tmp_path), base_name="base", agents=[],
                               default_agent="default")

    async def go():
        await registry.start()
        (tmp_path / "default" / "v2").mkdir()  # no files: incomplete
        checkpoints.write_text_atomic(tmp_path / "default" / "LATEST", "2\n")
        assert not await registry.sync("default")
        assert (await registry.acquire("default")).version == 1
        assert registry.reload_failures == 1

    asyncio.run(go())
