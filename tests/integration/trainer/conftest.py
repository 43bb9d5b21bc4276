"""Fixtures the Trainer's integration tests share."""

from __future__ import annotations

from pathlib import Path

import pytest

from sqlalchemy import update

from services.common import buffer
from tests.helpers import built_once
from tests.integration.trainer.data import FAULT_PROMPTS, FAULT_RESPONSES, FAULT_UNREWARDED, PROMPTS, fill_buffer


@pytest.fixture(scope="session")
def sampled_db(tiny_model, tmp_path_factory) -> Path:
    """One sampled, rewarded, committed buffer for the whole run (every test worker); each test works on
    its own copy."""
    folder = built_once(tmp_path_factory, "sampled-buffer", lambda d: fill_buffer(f"sqlite:///{d / 'buffer.db'}", tiny_model))
    return folder / "buffer.db"


@pytest.fixture(scope="session")
def faults_db(tiny_model, tmp_path_factory) -> Path:
    """60 committed experiences, 4 of them without a reward (the Trainer discards those); for the whole
    run, each test works on its own copy."""

    def build(folder: Path) -> None:
        url = f"sqlite:///{folder / 'buffer.db'}"
        records = fill_buffer(url, tiny_model, n=FAULT_RESPONSES, prompts=PROMPTS[:FAULT_PROMPTS], seed=3)
        unrewarded = [r.experience_id for r in records[5 : 5 + 4 * FAULT_UNREWARDED : 4]]
        db = buffer.create_buffer_engine(url)
        with db.begin() as conn:
            conn.execute(update(buffer.experiences).where(buffer.experiences.c.experience_id.in_(unrewarded))
                         .values(reward=None))
        db.dispose()

    return built_once(tmp_path_factory, "faults-buffer", build) / "buffer.db"
