"""The dashboard's rollups and live refresh on a real uvicorn server over a real SQLite buffer, with
traffic written while it runs: the API's overview follows the buffer within a pass, and an overview
or Trainer page open in a real headless Chromium draws itself again with the new figures, without a
reload."""

from __future__ import annotations

import time

import httpx
import pytest

from services.common import buffer
from services.common.records import Experience
from services.dashboard.app import create_app
from services.dashboard.config import DashboardConfig
from tests.helpers import ThreadedServer, chromium

pytestmark = pytest.mark.integration


def _exp(i: int) -> Experience:
    return Experience(experience_id=f"c{i}-0", completion_id=f"c{i}", agent="a", model_version=0, prompt_token_ids=[1],
                      response_token_ids=[4], response_logprobs=[-0.5], messages=[{"role": "user", "content": "q"}],
                      response={"role": "assistant", "content": "a"}, sampling={})


@pytest.fixture
def served(tmp_path):
    url = f"sqlite:///{tmp_path}/b.db"
    db = buffer.create_buffer_engine(url)
    buffer.insert_experiences(engine=db, records=[_exp(i) for i in range(5)])
    config = DashboardConfig.model_validate({"buffer": {"url": url}, "checkpoints": {"root": str(tmp_path / "cp")},
                                             "dashboard": {"refresh_s": 0.5}})
    with ThreadedServer(create_app(config)) as server:
        yield server.url, db
    db.dispose()


def _overview(url: str) -> dict:
    r = httpx.get(url + "/api/overview", params={"agent": "a"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _until(check, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while not (got := check()):
        assert time.monotonic() < deadline, "not within the time allowed"
        time.sleep(0.1)
    return got


def test_the_overview_follows_the_buffer_from_its_rollups(served):
    url, db = served
    o = _until(lambda: (o := _overview(url))["rollups"]["state"] == "ready" and o)
    assert o["statuses"]["recorded"] == 5
    buffer.insert_experiences(engine=db, records=[_exp(i) for i in range(5, 8)])
    buffer.apply_feedback(engine=db, msg_ids=["c0", "c1"], reward=1.0, feedback={})
    o = _until(lambda: (o := _overview(url))["statuses"]["rewarded"] == 2 and o)
    assert o["statuses"]["recorded"] == 6 and o["rollups"]["state"] == "ready"
    assert o["versions"][0]["reward"] == {"mean": 1.0, "low": 1.0, "high": 1.0, "n": 2}
    assert httpx.get(url + "/api/me", timeout=30).json()["refresh_s"] == 0.5


def test_an_open_overview_draws_the_new_figures_without_a_reload(served):
    url, db = served
    _until(lambda: _overview(url)["rollups"]["state"] == "ready")
    with chromium() as browser:
        page = browser.new_page()
        errors = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(f"{url}/?agent=a")
        page.wait_for_selector("body[data-ready='1']", timeout=30_000)
        assert page.get_attribute("[data-figure='status-recorded']", "data-value") == "5"
        assert page.inner_text("#live").startswith("live · figures of ")
        drawn = int(page.get_attribute("body", "data-drawn"))
        page.evaluate("window.kaizenMark = 1")  # gone if the page reloads
        buffer.insert_experiences(engine=db, records=[_exp(i) for i in range(5, 9)])
        _until(lambda: page.get_attribute("[data-figure='status-recorded']", "data-value") == "9")
        assert int(page.get_attribute("body", "data-drawn")) > drawn
        assert page.evaluate("window.kaizenMark") == 1 and page.evaluate("Chart.getChart('chart-status').data.datasets[0].data[0]") == 9
        # the Trainer page is live too: a step recorded while it is open appears
        page.goto(f"{url}/trainer?agent=a")
        page.wait_for_selector("body[data-ready='1']", timeout=30_000)
        assert page.get_attribute("[data-figure='steps']", "data-value") == "0"
        buffer.apply_feedback(engine=db, msg_ids=["c0"], reward=1.0, feedback={})
        buffer.commit_experiences(engine=db, msg_ids=["c0"])
        buffer.consume_batch(engine=db, agent="a", step=1, version=1, consumed={"c0-0": 1.0}, discarded=[], state_ref=None,
                             metrics={"loss": 0.5})
        _until(lambda: page.get_attribute("[data-figure='steps']", "data-value") == "1")
        assert page.get_attribute("#steps tr[data-step='1'] td[data-col='loss']", "data-value") == "0.5"
        assert errors == []
