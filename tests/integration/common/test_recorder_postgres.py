"""The recorder on a real PostgreSQL server: the SQLite unit tests again, plus what only
PostgreSQL refuses (NUL in text, a value wider than its column)."""

from __future__ import annotations

import pytest

from tests.unit.explorer import test_recorder as _unit
from tests.unit.explorer.test_recorder import db  # noqa: F401 - the fixture the reused tests take

pytestmark = pytest.mark.integration

for _name in dir(_unit):
    if _name.startswith("test_") and callable(getattr(_unit, _name)):
        globals()[_name] = getattr(_unit, _name)
del _name

POSTGRES_POISON = {"NUL": "a\x00b", "257 characters in a 256-wide column": "x" * 257}


@pytest.fixture
def buffer_url(postgres_db_url) -> str:
    return postgres_db_url


@pytest.mark.parametrize("poison", list(POSTGRES_POISON.values()), ids=list(POSTGRES_POISON))
def test_what_postgresql_refuses_is_set_aside_too(db, tmp_path, poison):  # noqa: F811
    _unit.test_a_refused_record_is_set_aside_and_everyone_elses_are_written(db, tmp_path, poison)
