"""`kaizen dashboard` on the buffer, checkpoints and Trainer steps of a real short run (the parity demo).

The dashboard runs as a user runs it (``kaizen dashboard --config <run>/explorer.yaml``), with the
Explorer and the Trainer gone. Its figures are checked against the run's SQLite file read here
with plain SQL, through its API and in a real headless Chromium (Debian's chromium, driven by
Playwright), which also takes a screenshot of every page into test-output/dashboard/ (or
$KAIZEN_TEST_OUTPUT/dashboard/).
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
from collections import defaultdict
from pathlib import Path

import httpx
import pytest
import yaml

from services.common.http.access import key_digest
from tests.helpers import REPO, chromium, free_port, kaizen_process, wait_http
from tests.integration.demo.conftest import AGENT

pytestmark = pytest.mark.integration

READ_KEY, CHAT_KEY, OTHER_KEY = "kz-test-read", "kz-test-chat", "kz-test-other-agent"


def _start(run: Path, log: Path, *overrides: str):
    port = free_port()
    ctx = kaizen_process("dashboard", "--config", str(run / "explorer.yaml"), "--port", str(port), *overrides,
                         log_path=log)
    proc = ctx.__enter__()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", timeout=60, proc=proc)
    except Exception:
        ctx.__exit__(None, None, None)
        raise AssertionError(f"the dashboard did not start:\n{log.read_text(errors='replace')[-3000:]}")
    return ctx, url


@pytest.fixture(scope="module")
def dashboard(demo_run):
    ctx, url = _start(demo_run, demo_run / "dashboard.log")
    yield url
    ctx.__exit__(None, None, None)


@pytest.fixture(scope="module")
def keyed_dashboard(demo_run):
    keys = [{"name": "reader", "sha256": key_digest(READ_KEY), "scopes": ["read"]},
            {"name": "chatter", "sha256": key_digest(CHAT_KEY), "scopes": ["chat"]},
            {"name": "other", "sha256": key_digest(OTHER_KEY), "scopes": ["read"], "agents": ["someone-else"]}]
    ctx, url = _start(demo_run, demo_run / "dashboard-keyed.log", "auth.keys=" + json.dumps(keys))
    yield url
    ctx.__exit__(None, None, None)


@pytest.fixture(scope="module")
def db(demo_run):
    conn = sqlite3.connect(f"file:{demo_run / 'buffer.db'}?mode=ro", uri=True)
    yield conn
    conn.close()


def _get(url: str, path: str, key: str | None = None, **params) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.get(url + path, params=params, headers=headers, timeout=30)


def _json(url: str, path: str, **params) -> dict:
    r = _get(url, path, **params)
    assert r.status_code == 200, (path, r.status_code, r.text)
    return r.json()


def _ci95(values: list[float]) -> tuple[float, float, float]:
    n = len(values)
    mean = sum(values) / n
    half = 1.959964 * math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1) / n)
    return mean, mean - half, mean + half


def test_overview_shows_what_the_buffer_and_checkpoints_hold(dashboard, db, demo_run):
    o = _json(dashboard, "/api/overview", agent=AGENT)
    statuses = dict(db.execute("SELECT status, count(*) FROM experiences WHERE agent = ? GROUP BY status", (AGENT,)))
    assert {s: n for s, n in o["statuses"].items() if n} == statuses
    assert o["serving"] == int((demo_run / "checkpoints" / AGENT / "LATEST").read_text())
    rewards = defaultdict(list)
    counts = defaultdict(int)
    for version, reward in db.execute("SELECT model_version, reward FROM experiences WHERE agent = ?", (AGENT,)):
        counts[version] += 1
        if reward is not None:
            rewards[version].append(reward)
    assert [v["version"] for v in o["versions"]] == sorted(counts)
    for v in o["versions"]:
        assert v["experiences"] == counts[v["version"]]
        assert v["reward"]["n"] == len(rewards[v["version"]])
        if len(rewards[v["version"]]) >= 2:
            mean, low, high = _ci95(rewards[v["version"]])
            assert v["reward"]["mean"] == pytest.approx(mean) and v["reward"]["low"] == pytest.approx(low)
            assert v["reward"]["high"] == pytest.approx(high)
    # over time: every experience in exactly one bucket, the buckets' rewards add up to the buffer's
    points = o["over_time"]["points"]
    assert sum(p["experiences"] for p in points) == sum(counts.values())
    assert sum(p["reward"]["n"] for p in points) == sum(len(r) for r in rewards.values())
    total = sum(p["reward"]["mean"] * p["reward"]["n"] for p in points if p["reward"]["n"])
    assert total == pytest.approx(sum(sum(r) for r in rewards.values()))
    assert [p["t"] for p in points] == sorted(p["t"] for p in points)
    # reloads: each version's first experience, in time order (at least the versions that served traffic)
    assert len(o["reloads"]) == len(counts) and [r["at"] for r in o["reloads"]] == sorted(r["at"] for r in o["reloads"])


def test_trainer_and_versions_show_every_step_and_the_lineage(dashboard, db, demo_run):
    t = _json(dashboard, "/api/trainer", agent=AGENT)
    rows = db.execute("SELECT step, version, consumed, discarded, metrics FROM trainer_steps WHERE agent = ? ORDER BY id",
                      (AGENT,)).fetchall()
    assert t["total_steps"] == len(rows) > 0
    assert [(s["step"], s["version"], s["consumed"], s["discarded"]) for s in t["steps"]] == [r[:4] for r in rows]
    for s, r in zip(t["steps"], rows):
        m = json.loads(r[4])
        for k in ("loss", "entropy", "clip_frac", "logprob_mismatch", "staleness_mean", "tokens_per_s", "reward_mean"):
            assert s.get(k) == m.get(k), (k, s, m)

    v = _json(dashboard, "/api/versions", agent=AGENT)
    by = {x["version"]: x for x in v["versions"]}
    trained = dict(db.execute("SELECT trained_in, count(*) FROM experiences WHERE agent = ? AND status = 'consumed' "
                              "AND trained_in IS NOT NULL GROUP BY trained_in", (AGENT,)))
    root = demo_run / "checkpoints" / AGENT
    on_disk = sorted(int(p.name[1:]) for p in root.glob("v*") if p.is_dir())
    assert set(on_disk) <= set(by)
    for n in on_disk:
        manifest = json.loads((root / f"v{n}" / "manifest.json").read_text())
        assert by[n]["parent"] == manifest.get("parent_version") and by[n]["created_at"] == manifest["created_at"]
        assert by[n]["trained_on"] == trained.get(n, 0)
        if "experience_ids" in manifest:  # the lineage the manifest names is what the buffer says trained it
            assert by[n]["trained_on"] == len(manifest["experience_ids"]), n
    decisions = db.execute("SELECT version, decision, actor FROM release_decisions WHERE agent = ? ORDER BY id",
                           (AGENT,)).fetchall()
    shown = [(x["version"], d["decision"], d["actor"]) for x in v["versions"] for d in x["decisions"]]
    assert sorted(shown) == sorted(decisions) and any(d[1] == "rejected" for d in decisions)


def test_experience_search_pages_through_every_experience_once(dashboard, db):
    expected = [r[0] for r in db.execute("SELECT experience_id FROM experiences WHERE agent = ? ORDER BY seq DESC", (AGENT,))]
    seen, before = [], None
    while True:
        page = _json(dashboard, "/api/experiences", agent=AGENT, limit=200, **({"before": before} if before else {}))
        seen += [x["experience_id"] for x in page["experiences"]]
        before = page["next_before"]
        if before is None:
            break
    assert seen == expected
    # filters: a version, a status and a reward range, each as the buffer answers them
    version, status = db.execute("SELECT model_version, status FROM experiences WHERE agent = ? AND reward IS NOT NULL "
                                 "ORDER BY seq LIMIT 1", (AGENT,)).fetchone()
    page = _json(dashboard, "/api/experiences", agent=AGENT, version=version, status=status, min_reward=0.5, limit=200)
    want = [r[0] for r in db.execute("SELECT experience_id FROM experiences WHERE agent = ? AND model_version = ? AND "
                                     "status = ? AND reward >= 0.5 ORDER BY seq DESC LIMIT 200", (AGENT, version, status))]
    assert [x["experience_id"] for x in page["experiences"]] == want
    trained_in = db.execute("SELECT trained_in FROM experiences WHERE trained_in IS NOT NULL LIMIT 1").fetchone()[0]
    page = _json(dashboard, "/api/experiences", trained_in=trained_in, limit=200)
    assert {x["trained_in"] for x in page["experiences"]} == {trained_in} and page["experiences"]


def test_one_experience_token_by_token(dashboard, db, demo_run):
    from transformers import AutoTokenizer

    xid, ids, logprobs, messages, version = db.execute(
        "SELECT experience_id, response_token_ids, response_logprobs, messages, model_version FROM experiences "
        "WHERE agent = ? AND reward IS NOT NULL ORDER BY seq DESC LIMIT 1", (AGENT,)).fetchone()
    x = _json(dashboard, f"/api/experiences/{xid}")
    assert [t["id"] for t in x["tokens"]] == json.loads(ids) and [t["logprob"] for t in x["tokens"]] == json.loads(logprobs)
    assert x["messages"] == json.loads(messages) and x["model_version"] == version and x["tokens_as_text"]
    model = yaml.safe_load((demo_run / "explorer.yaml").read_text())["model"]["path"]
    tok = AutoTokenizer.from_pretrained(model)
    assert [t["text"] for t in x["tokens"]] == [tok.decode([i]) for i in json.loads(ids)]
    history = [(h["reward"], h["late"], h["outcome"]) for h in x["reward_history"]]
    assert history and history[-1] == (x["reward"], False, "applied")  # the latest is the reward


def test_bad_input_gets_a_clear_error_in_openai_shape(dashboard):
    cases = [
        ("/api/experiences", {"status": "finished"}, 400, "status"),
        ("/api/experiences", {"limit": 0}, 400, "limit"),
        ("/api/experiences", {"before": 2**63}, 400, "before"),
        ("/api/experiences", {"min_reward": "nan"}, 400, "min_reward"),
        ("/api/experiences", {"task_id": "a\x00b"}, 400, "task_id"),
        ("/api/overview", {}, 400, "agent"),
        ("/api/overview", {"agent": "nobody"}, 404, "agent"),
        ("/api/experiences/chatcmpl-none-0", {}, 404, "experience_id"),
    ]
    for path, params, status, param in cases:
        r = _get(dashboard, path, **params)
        assert r.status_code == status, (path, params, r.status_code, r.text)
        err = r.json()["error"]
        assert err["param"] in (param, f"query.{param}") and err["message"] and err["type"], (path, params, err)
        assert "/tmp" not in r.text and str(REPO) not in r.text


def test_keys_need_the_read_scope_and_see_only_their_agents(keyed_dashboard):
    url = keyed_dashboard
    assert _get(url, "/").status_code == 200  # the page shell holds no data
    r = _get(url, "/api/agents")
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert _get(url, "/api/agents", key="kz-wrong").status_code == 401
    r = _get(url, "/api/overview", key=CHAT_KEY, agent=AGENT)
    assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"
    assert [a["name"] for a in _get(url, "/api/agents", key=READ_KEY).json()["agents"]] == [AGENT]
    assert _get(url, "/api/overview", key=READ_KEY, agent=AGENT).status_code == 200
    # a key limited to another agent sees none of this one's data
    assert _get(url, "/api/agents", key=OTHER_KEY).json()["agents"] == []
    assert _get(url, "/api/overview", key=OTHER_KEY, agent=AGENT).status_code == 403
    assert _get(url, "/api/experiences", key=OTHER_KEY).json()["experiences"] == []
    some = _get(url, "/api/experiences", key=READ_KEY, limit=1).json()["experiences"][0]["experience_id"]
    assert _get(url, f"/api/experiences/{some}", key=READ_KEY).status_code == 200
    assert _get(url, f"/api/experiences/{some}", key=OTHER_KEY).status_code == 404


# ---- in a real headless Chromium -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    with chromium() as b:
        yield b


@pytest.fixture(scope="module")
def shots() -> Path:
    out = Path(os.environ.get("KAIZEN_TEST_OUTPUT", REPO / "test-output")) / "dashboard"
    out.mkdir(parents=True, exist_ok=True)
    return out


def _open(page, url: str):
    page.goto(url)
    page.wait_for_selector("body[data-ready='1']", timeout=30_000)
    assert page.get_attribute("body", "data-error") is None, page.inner_text("main")


def _figure(page, name: str) -> str:
    return page.get_attribute(f"[data-figure='{name}']", "data-value")


def test_pages_in_chromium_show_the_database_figures(browser, dashboard, db, demo_run, shots):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))

    _open(page, f"{dashboard}/?agent={AGENT}")
    page.screenshot(path=str(shots / "overview.png"), full_page=True)
    statuses = dict(db.execute("SELECT status, count(*) FROM experiences WHERE agent = ? GROUP BY status", (AGENT,)))
    for status in ("recorded", "rewarded", "committed", "consumed", "discarded"):
        assert int(_figure(page, f"status-{status}")) == statuses.get(status, 0), status
    assert int(_figure(page, "experiences")) == sum(statuses.values())
    assert int(_figure(page, "serving")) == int((demo_run / "checkpoints" / AGENT / "LATEST").read_text())
    rewarded = db.execute("SELECT count(*) FROM experiences WHERE agent = ? AND reward IS NOT NULL", (AGENT,)).fetchone()[0]
    assert int(_figure(page, "rewarded")) == rewarded
    row = db.execute("SELECT model_version, count(*), avg(reward) FROM experiences WHERE agent = ? GROUP BY model_version "
                     "ORDER BY count(reward) DESC LIMIT 1", (AGENT,)).fetchone()
    cells = page.locator(f"#served-versions tr[data-version='{row[0]}'] td.num")
    assert int(cells.nth(0).get_attribute("data-value")) == row[1]
    assert float(cells.nth(2).get_attribute("data-value")) == pytest.approx(row[2])
    for chart in ("chart-reward-time", "chart-reward-version", "chart-status"):  # Chart.js drew on each canvas
        assert page.evaluate(f"Chart.getChart('{chart}').data.datasets.length") > 0, chart

    _open(page, f"{dashboard}/trainer?agent={AGENT}")
    page.screenshot(path=str(shots / "trainer.png"), full_page=True)
    steps = db.execute("SELECT step, metrics FROM trainer_steps WHERE agent = ? ORDER BY id", (AGENT,)).fetchall()
    assert int(_figure(page, "steps")) == len(steps)
    last_step, metrics = steps[-1][0], json.loads(steps[-1][1])
    assert float(page.get_attribute(f"#steps tr[data-step='{last_step}'] td[data-col='loss']", "data-value")) == \
        pytest.approx(metrics["loss"])
    assert page.evaluate("Chart.getChart('chart-loss').data.datasets[0].data.length") == len(steps)

    _open(page, f"{dashboard}/versions?agent={AGENT}")
    page.screenshot(path=str(shots / "versions.png"), full_page=True)
    versions = sorted(int(p.name[1:]) for p in (demo_run / "checkpoints" / AGENT).glob("v*") if p.is_dir())
    shown = [int(v) for v in page.locator("#versions tbody tr").evaluate_all("rows => rows.map(r => r.dataset.version)")]
    assert set(versions) <= set(shown)
    assert page.locator("[data-decision='rejected']").count() == db.execute(
        "SELECT count(*) FROM release_decisions WHERE agent = ? AND decision = 'rejected'", (AGENT,)).fetchone()[0] > 0

    _open(page, f"{dashboard}/experiences?agent={AGENT}")
    page.screenshot(path=str(shots / "experiences.png"), full_page=True)
    newest = db.execute("SELECT experience_id FROM experiences WHERE agent = ? ORDER BY seq DESC LIMIT 50", (AGENT,)).fetchall()
    assert page.locator("#experiences tbody tr").evaluate_all("rows => rows.map(r => r.dataset.experience)") == \
        [r[0] for r in newest]

    # the trained ones (a filter), then one experience: follow its link, see its tokens with their logprobs
    _open(page, f"{dashboard}/experiences?agent={AGENT}&status=consumed")
    assert page.input_value("select[name='status']") == "consumed"
    xid = db.execute("SELECT experience_id FROM experiences WHERE agent = ? AND status = 'consumed' ORDER BY seq DESC "
                     "LIMIT 1", (AGENT,)).fetchone()[0]
    assert page.locator("#experiences tbody tr").first.get_attribute("data-experience") == xid
    page.click(f"#experiences tr[data-experience='{xid}'] a")
    page.wait_for_url(f"**/experiences/{xid}*")
    page.wait_for_selector("body[data-ready='1']")
    page.screenshot(path=str(shots / "experience.png"), full_page=True)
    ids, logprobs, reward = db.execute("SELECT response_token_ids, response_logprobs, reward FROM experiences "
                                       "WHERE experience_id = ?", (xid,)).fetchone()
    tokens = page.locator("#tokens .tok")
    assert [int(i) for i in tokens.evaluate_all("ts => ts.map(t => t.dataset.id)")] == json.loads(ids)
    assert [float(v) for v in tokens.evaluate_all("ts => ts.map(t => t.dataset.logprob)")] == \
        pytest.approx(json.loads(logprobs))
    assert float(page.inner_text("[data-field='reward']")) == reward
    # every reward it was sent, as they came (here one, before training)
    history = page.locator("#reward-history tbody tr")
    assert history.count() >= 1 and float(history.last.locator("td").first.inner_text()) == reward
    assert errors == [], errors


def test_chromium_asks_for_a_key_and_opens_with_a_read_key(browser, keyed_dashboard, shots):
    page = browser.new_page(viewport={"width": 1200, "height": 700})
    _open_login = f"{keyed_dashboard}/?agent={AGENT}"
    page.goto(_open_login)
    page.wait_for_selector("body[data-ready='1']")
    assert page.locator("#login").count() == 1 and page.locator("canvas").count() == 0
    page.fill("#key", READ_KEY)
    page.click("#login button")
    page.wait_for_selector("[data-figure='experiences']", timeout=30_000)
    assert "reader" in page.inner_text("#who")
    page.screenshot(path=str(shots / "overview-with-key.png"))


def test_the_demo_says_how_to_open_its_run_in_the_dashboard(demo_run):
    out = (demo_run.parent.parent / "demo.out").read_text()
    assert f"kaizen dashboard --config {demo_run / 'explorer.yaml'}" in out
