"""The suite's own scheduling list names files that exist (a renamed file would quietly start late)."""

from __future__ import annotations

from tests.conftest import LONGEST_FIRST
from tests.helpers import REPO


def test_every_file_started_first_exists_once():
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    missing = [path for path in LONGEST_FIRST if not (REPO / path).is_file()]
    assert not missing, missing
