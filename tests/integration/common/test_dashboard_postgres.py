"""The dashboard's queries on a real PostgreSQL server: the SQLite tests again (epoch and bucket
arithmetic, aggregates and keyset pages in PostgreSQL's dialect)."""

from __future__ import annotations

import pytest

from tests.unit.common import test_dashboard_queries as _unit
from tests.unit.common.test_dashboard_queries import filled  # noqa: F401 - the fixture the reused tests take

pytestmark = pytest.mark.integration

for _name in ("test_overview_counts_rewards_and_buckets", "test_trainer_and_versions_lineage",
              "test_search_filters_and_keyset_pages"):
    globals()[_name] = getattr(_unit, _name)
del _name


@pytest.fixture
def buffer_url(postgres_db_url) -> str:
    return postgres_db_url
