"""The dashboard's queries and rollups on a real PostgreSQL server: the SQLite tests again (epoch and
bucket arithmetic, aggregates, keyset pages and the changes read by updated_at and tombstones, in
PostgreSQL's dialect)."""

from __future__ import annotations

import pytest

from tests.unit.common import test_dashboard_queries as _unit
from tests.unit.common import test_dashboard_rollups as _rollups
from tests.unit.common.test_dashboard_queries import filled  # noqa: F401 - the fixture the reused tests take

pytestmark = pytest.mark.integration

for _name in ("test_overview_counts_rewards_and_buckets", "test_trainer_and_versions_lineage",
              "test_search_filters_and_keyset_pages"):
    globals()[_name] = getattr(_unit, _name)
for _name in ("test_every_kind_of_write_is_rolled_up_exactly", "test_a_pass_reads_only_the_changed_cells_and_a_rebuild_reads_all",
              "test_a_write_stamped_before_the_margin_is_missed_until_a_rebuild",
              "test_a_clock_set_back_never_rebuilds_an_old_hour_from_part_of_its_cells",
              "test_a_late_write_stamped_in_the_same_microsecond_as_one_taken_in_is_still_seen",
              "test_a_deletion_naming_no_cell_rebuilds_once",
              "test_a_buffer_an_older_kaizen_made_keeps_the_rollups_off_until_it_is_upgraded"):
    globals()[_name] = getattr(_rollups, _name)
del _name


@pytest.fixture
def buffer_url(postgres_db_url) -> str:
    return postgres_db_url
