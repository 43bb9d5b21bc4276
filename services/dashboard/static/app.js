// Kaizen dashboard: one page shell, four views, data from /api (JSON). Recorded text is always put
// into the page as text (textContent), never as markup. Each figure a test may check carries its
// exact value in data-value beside the formatted text.
"use strict";

const KEY = "kaizen-dashboard-key";
const STATUSES = ["recorded", "rewarded", "committed", "consumed", "discarded"];
const COLORS = { recorded: "#98a2b3", rewarded: "#f79009", committed: "#2f6fde", consumed: "#12b76a", discarded: "#f04438" };
const TRAINER_CHARTS = [
  ["reward_mean", "reward (batch mean)"], ["loss", "loss"], ["kl", "KL to reference"], ["entropy", "entropy / token"],
  ["logprob_mismatch", "logprob mismatch |sampling − trainer|"],
  ["staleness_mean", "staleness (versions)"], ["tokens_per_s", "tokens / s"],
];

class HttpError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, params = {}) {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) if (v !== null && v !== undefined && v !== "") q.set(k, v);
  const headers = {};
  const key = sessionStorage.getItem(KEY);
  if (key) headers["Authorization"] = "Bearer " + key;
  const r = await fetch(path + (q.toString() ? "?" + q : ""), { headers });
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new HttpError(r.status, (body.error && body.error.message) || r.statusText);
  return body;
}

function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? "" : String(v));
  }
  return put(e, ...children);
}

// Append children (nested arrays flattened; null, undefined and false skipped) to parent.
function put(parent, ...children) {
  for (const c of children.flat(Infinity)) if (c !== null && c !== undefined && c !== false) parent.append(c instanceof Node ? c : String(c));
  return parent;
}

const fmt = (x, d = 3) => (x === null || x === undefined || Number.isNaN(x) ? "–" : Number(x).toFixed(d));
const fmtInt = (x) => (x === null || x === undefined ? "–" : Number(x).toLocaleString("en-US"));
const fmtTime = (t) => (t === null || t === undefined ? "–" : new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19));
const fmtShortTime = (t) => new Date(t * 1000).toISOString().slice(11, 19);

function card(label, value, shown, figure) {
  return el("div", { class: "card" }, el("div", { class: "label", text: label }),
    el("div", { class: "value", "data-figure": figure, "data-value": value === null || value === undefined ? "" : value, text: shown }));
}

function panel(title, ...children) { return el("div", { class: "panel" }, el("h2", { text: title }), ...children); }

function chartBox(id) { return el("div", { class: "chart" }, el("canvas", { id })); }

const charts = [];
function chart(id, config) {
  const canvas = document.getElementById(id);
  config.options = Object.assign({ animation: false, maintainAspectRatio: false, responsive: true }, config.options || {});
  const c = new Chart(canvas, config);
  charts.push(c);
  return c;
}

// A mean line with its 95% band: three datasets (upper bound, lower bound filled up to it, mean).
function banded(label, points, color) {
  const band = color + "33";
  return [
    { label: label + " 95% high", data: points.map((p) => ({ x: p.x, y: p.high })), borderWidth: 0, pointRadius: 0, fill: false, spanGaps: true },
    { label: label + " 95% band", data: points.map((p) => ({ x: p.x, y: p.low })), borderWidth: 0, pointRadius: 0, backgroundColor: band, fill: "-1", spanGaps: true },
    { label, data: points.map((p) => ({ x: p.x, y: p.mean })), borderColor: color, backgroundColor: color, pointRadius: 2, spanGaps: true },
  ];
}

const hideBandLegend = { labels: { filter: (item) => !/95%/.test(item.text) } };

function setActive(page) {
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("active", a.dataset.page === page);
}

function linkWithAgent(path, params = {}) {
  const agent = currentAgent();
  const q = new URLSearchParams(Object.assign(agent ? { agent } : {}, params));
  return path + (q.toString() ? "?" + q : "");
}

function currentAgent() { return new URLSearchParams(location.search).get("agent") || ""; }

async function pickAgent(agents, page) {
  const select = document.getElementById("agent");
  select.replaceChildren(...agents.map((a) => el("option", { value: a.name, text: a.name })));
  let agent = currentAgent();
  if (!agents.some((a) => a.name === agent)) {
    agent = agents.length ? agents[0].name : "";
    // the experiences page searches what its address says (every agent, or one the key cannot see: none)
    if (agent && page !== "experiences") history.replaceState(null, "", linkWithAgentFor(agent));
  }
  select.value = agent;
  select.onchange = () => { location.href = linkWithAgentFor(select.value); };
  for (const a of document.querySelectorAll("nav a")) a.href = a.getAttribute("href").split("?")[0] + (agent ? "?agent=" + encodeURIComponent(agent) : "");
  return agent;
}

function linkWithAgentFor(agent) {
  const q = new URLSearchParams(location.search);
  q.set("agent", agent);
  return location.pathname + "?" + q;
}

// ---- live pages ----------------------------------------------------------------------------

let refreshS = 0; // the dashboard's refresh_s (from /api/me): how often a watched page asks again

// Draw a page from load()'s figures, then, every refreshS while the browser shows it, load them
// again and draw the page again in place (scroll kept) when they changed. body[data-drawn] counts
// the drawings and #live says when the figures were read.
async function live(main, load, draw) {
  let shown = null;
  const note = document.getElementById("live");
  const show = (data) => {
    // figures from the rollups are as of their last pass; read from the rows, as of now
    const at = data.rollups && data.rollups.state === "ready" ? data.rollups.as_of : data.generated_at || Date.now() / 1000;
    note.dataset.value = String(at);
    note.textContent = (refreshS ? "live · " : "") + "figures of " + fmtShortTime(at) + " UTC";
    note.classList.remove("failed");
    const key = JSON.stringify(data, (k, v) => (k === "generated_at" || k === "rollups" ? undefined : v));
    if (key === shown) return;
    for (const c of charts.splice(0)) c.destroy();
    const y = window.scrollY;
    main.replaceChildren();
    draw(data);
    shown = key; // only once drawn: a drawing that failed is tried again on the next tick
    window.scrollTo(0, y);
    document.body.dataset.drawn = String(Number(document.body.dataset.drawn || 0) + 1);
  };
  show(await load());
  if (!refreshS) return;
  const tick = async () => {
    if (document.visibilityState === "visible") {
      try { show(await load()); } catch (e) {
        if (e.status === 401 || e.status === 403) { // the key was revoked or narrowed: stop asking
          note.textContent = "stopped: " + e.message;
          note.classList.add("failed");
          if (e.status === 401) { sessionStorage.removeItem(KEY); login(main, e.message); }
          return;
        }
        note.textContent = "refresh failed (" + e.message + "); trying again";
        note.classList.add("failed");
      }
    }
    setTimeout(tick, refreshS * 1000);
  };
  setTimeout(tick, refreshS * 1000);
}

// ---- overview ------------------------------------------------------------------------------

async function overview(main, agent) {
  await live(main, () => api("/api/overview", { agent }), (o) => drawOverview(main, agent, o));
}

function drawOverview(main, agent, o) {
  const total = STATUSES.reduce((s, k) => s + o.statuses[k], 0);
  const rewarded = o.versions.reduce((s, v) => s + v.reward.n, 0);
  put(main,
    el("h1", { text: `Overview · ${agent}` }),
    el("div", { class: "cards" },
      card("serving version", o.serving, o.serving === null ? "–" : "v" + o.serving, "serving"),
      card("candidate", o.candidate, o.candidate === null ? "none" : "v" + o.candidate, "candidate"),
      card("experiences", total, fmtInt(total), "experiences"),
      card("with a reward", rewarded, fmtInt(rewarded), "rewarded"),
      ...STATUSES.map((s) => card(s, o.statuses[s], fmtInt(o.statuses[s]), "status-" + s)),
    ),
    el("div", { class: "grid" },
      panel(`Reward over time (mean per ${o.over_time.bucket_s || "–"} s, 95% band) and traffic`, chartBox("chart-reward-time")),
      panel("Reward per version (mean, 95% band)", chartBox("chart-reward-version")),
    ),
    el("div", { class: "grid" },
      panel("Experiences by status", chartBox("chart-status")),
      panel("Versions that served (first request = reload seen in traffic)", versionTable(o.versions, o.serving)),
    ),
  );
  const pts = o.over_time.points.map((p) => ({ x: p.t, mean: p.reward.mean, low: p.reward.low, high: p.reward.high }));
  const reloads = o.reloads.map((r) => ({ x: r.at, y: 1, version: r.version }));
  chart("chart-reward-time", {
    type: "line",
    data: {
      datasets: [
        ...banded("reward", pts, "#2f6fde").map((d) => Object.assign(d, { type: "line", yAxisID: "y" })),
        { type: "bar", label: "experiences", data: o.over_time.points.map((p) => ({ x: p.t, y: p.experiences })), yAxisID: "traffic", backgroundColor: "#98a2b355" },
        { type: "scatter", label: "reload (new version's first request)", data: reloads, yAxisID: "marks", pointStyle: "triangle", pointRadius: 6, backgroundColor: "#12b76a" },
      ],
    },
    options: {
      parsing: true,
      scales: {
        x: { type: "linear", ticks: { callback: (v) => fmtShortTime(v), maxTicksLimit: 8 } },
        y: { title: { display: true, text: "reward" } },
        traffic: { position: "right", grid: { drawOnChartArea: false }, title: { display: true, text: "experiences" } },
        marks: { display: false, min: 0, max: 1.1 },
      },
      plugins: { legend: hideBandLegend, tooltip: { callbacks: { title: (items) => fmtTime(items[0].parsed.x),
        afterLabel: (item) => (item.raw.version !== undefined ? "v" + item.raw.version : "") } } },
    },
  });
  const served = o.versions.filter((v) => v.reward.n > 0);
  chart("chart-reward-version", {
    type: "line",
    data: { datasets: banded("mean reward", served.map((v) => ({ x: v.version, ...v.reward })), "#7a5af8") },
    options: { scales: { x: { type: "linear", title: { display: true, text: "version" }, ticks: { stepSize: 1, precision: 0 } },
      y: { title: { display: true, text: "reward" } } }, plugins: { legend: hideBandLegend } },
  });
  chart("chart-status", {
    type: "bar",
    data: { labels: STATUSES, datasets: [{ label: "experiences", data: STATUSES.map((s) => o.statuses[s]), backgroundColor: STATUSES.map((s) => COLORS[s]) }] },
    options: { indexAxis: "y", plugins: { legend: { display: false } } },
  });
}

function versionTable(versions, serving) {
  return el("table", { id: "served-versions" },
    el("thead", {}, el("tr", {}, el("th", { text: "version" }), el("th", { class: "num", text: "experiences" }),
      el("th", { class: "num", text: "rewarded" }), el("th", { class: "num", text: "mean reward" }), el("th", { text: "95% band" }),
      el("th", { text: "first request" }))),
    el("tbody", {}, versions.slice().reverse().map((v) => el("tr", { "data-version": v.version },
      el("td", {}, el("a", { href: linkWithAgent("/experiences", { version: v.version }), text: "v" + v.version }),
        v.version === serving ? el("span", { class: "badge serving", text: "serving" }) : null),
      el("td", { class: "num", "data-value": v.experiences, text: fmtInt(v.experiences) }),
      el("td", { class: "num", "data-value": v.reward.n, text: fmtInt(v.reward.n) }),
      el("td", { class: "num", "data-value": v.reward.mean ?? "", text: fmt(v.reward.mean) }),
      el("td", { class: "muted", text: v.reward.low === null ? "–" : `${fmt(v.reward.low)} … ${fmt(v.reward.high)}` }),
      el("td", { text: fmtTime(v.first_at) }),
    ))));
}

// ---- trainer -------------------------------------------------------------------------------

async function trainer(main, agent) {
  await live(main, () => api("/api/trainer", { agent }), (t) => drawTrainer(main, agent, t));
}

function drawTrainer(main, agent, t) {
  // The objective's own figures (its recipe's statistics) come after the shared ones, named by their keys.
  const charts = TRAINER_CHARTS.concat((t.objective_figures || []).map((k) => [k, k.replaceAll("_", " ")]));
  const last = t.steps[t.steps.length - 1] || {};
  put(main,
    el("h1", { text: `Trainer · ${agent}` }),
    el("div", { class: "cards" },
      card("steps", t.total_steps, fmtInt(t.total_steps), "steps"),
      card("last step", last.step ?? null, last.step ?? "–", "last-step"),
      card("last version", last.version ?? null, last.version === undefined ? "–" : "v" + last.version, "last-version"),
      card("consumed", t.steps.reduce((s, x) => s + x.consumed, 0), fmtInt(t.steps.reduce((s, x) => s + x.consumed, 0)), "consumed"),
      card("discarded", t.steps.reduce((s, x) => s + x.discarded, 0), fmtInt(t.steps.reduce((s, x) => s + x.discarded, 0)), "discarded"),
    ),
    t.steps.length ? null : el("p", { class: "muted", text: "No Trainer step recorded for this agent yet." }),
    el("div", { class: "grid small" }, charts.map(([k, label]) => panel(label, chartBox("chart-" + k)))),
    panel("Last steps", stepsTable(t.steps.slice(-25).reverse(), t.objective_figures || [])),
  );
  for (const [k, label] of charts) {
    if (t.steps.length && !t.steps.some((s) => s[k] !== undefined)) {
      document.getElementById("chart-" + k).parentElement.replaceChildren(el("p", { class: "muted", text: "not recorded by this Trainer's algorithm" }));
      continue;
    }
    chart("chart-" + k, {
      type: "line",
      data: { datasets: [{ label, data: t.steps.filter((s) => s[k] !== undefined).map((s) => ({ x: s.step, y: s[k] })), borderColor: "#2f6fde", pointRadius: 1.5 }] },
      options: { scales: { x: { type: "linear", title: { display: true, text: "step" } } }, plugins: { legend: { display: false } } },
    });
  }
}

function stepsTable(steps, objective) {
  const cols = ["reward_mean", "loss", "kl", "entropy", ...objective, "logprob_mismatch", "staleness_mean", "tokens_per_s"];
  return el("table", { id: "steps" },
    el("thead", {}, el("tr", {}, el("th", { text: "step" }), el("th", { text: "version" }), el("th", { class: "num", text: "consumed" }),
      el("th", { class: "num", text: "discarded" }), cols.map((c) => el("th", { class: "num", text: c })), el("th", { text: "time" }))),
    el("tbody", {}, steps.map((s) => el("tr", { "data-step": s.step },
      el("td", { text: s.step }), el("td", { text: "v" + s.version }), el("td", { class: "num", "data-value": s.consumed, text: s.consumed }),
      el("td", { class: "num", "data-value": s.discarded, text: s.discarded }),
      cols.map((c) => el("td", { class: "num", "data-col": c, "data-value": s[c] ?? "", text: fmt(s[c], c === "tokens_per_s" ? 0 : 4) })),
      el("td", { text: fmtTime(s.at) }),
    ))));
}

// ---- versions ------------------------------------------------------------------------------

async function versions(main, agent) {
  const v = await api("/api/versions", { agent });
  put(main,
    el("h1", { text: `Versions · ${agent}` }),
    el("div", { class: "cards" },
      card("serving", v.serving, v.serving === null ? "–" : "v" + v.serving, "serving"),
      card("candidate", v.candidate, v.candidate === null ? "none" : "v" + v.candidate, "candidate"),
      card("versions", v.versions.length, v.versions.length, "versions"),
      card("release decisions", v.versions.reduce((s, x) => s + x.decisions.length, 0), v.versions.reduce((s, x) => s + x.decisions.length, 0), "decisions"),
    ),
    panel("Timeline: published (circle) and first served (triangle)", chartBox("chart-timeline")),
    el("div", { style: "height:16px" }),
    panel("Lineage", el("table", { id: "versions" },
      el("thead", {}, el("tr", {}, ["version", "published", "parent", "step", "trained on", "served", "mean reward", "decisions"].map((h) => el("th", { text: h })))),
      el("tbody", {}, v.versions.slice().reverse().map((x) => el("tr", { "data-version": x.version },
        el("td", {}, "v" + x.version, " ", x.version === v.serving ? el("span", { class: "badge serving", text: "serving" }) : null,
          x.version === v.candidate ? el("span", { class: "badge candidate", text: "candidate" }) : null,
          x.version === 0 ? el("span", { class: "badge", text: "base model" })
            : x.on_disk ? null : el("span", { class: "badge", text: "deleted by retention" }),
          x.source === "publish" ? el("span", { class: "badge", text: "kaizen publish" }) : null),
        el("td", { text: fmtTime(x.created_at) }),
        el("td", { text: x.parent === null || x.parent === undefined ? "–" : "v" + x.parent }),
        el("td", { text: x.step ?? "–" }),
        el("td", { "data-col": "trained_on", "data-value": x.trained_on },
          x.trained_on ? el("a", { href: linkWithAgent("/experiences", { trained_in: x.version }), text: fmtInt(x.trained_on) + " experiences" }) : "–",
          x.guard && x.guard.guard_refused ? el("span", { class: "badge alarm", text: "guard refused an update" }) : null),
        el("td", { "data-col": "served", "data-value": x.served },
          x.served ? el("a", { href: linkWithAgent("/experiences", { version: x.version }), text: fmtInt(x.served) }) : "0"),
        el("td", { text: x.reward ? `${fmt(x.reward.mean)} (n=${x.reward.n})` : "–" }),
        el("td", {}, x.decisions.map((d) => el("div", { class: "decision", "data-decision": d.decision },
          el("span", { class: "badge " + d.decision, text: d.decision.replace("_", " ") }),
          `by ${d.actor}`, d.reason ? el("span", { class: "muted", text: " · " + d.reason }) : null))),
      )))),
    ),
  );
  const published = v.versions.filter((x) => x.created_at).map((x) => ({ x: x.created_at, y: x.version }));
  const served = v.versions.filter((x) => x.first_served_at).map((x) => ({ x: x.first_served_at, y: x.version }));
  chart("chart-timeline", {
    type: "scatter",
    data: { datasets: [
      { label: "published", data: published, backgroundColor: "#2f6fde", pointRadius: 4 },
      { label: "first served", data: served, backgroundColor: "#12b76a", pointStyle: "triangle", pointRadius: 6 },
    ] },
    options: { scales: { x: { type: "linear", ticks: { callback: (t) => fmtShortTime(t), maxTicksLimit: 8 } },
      y: { title: { display: true, text: "version" }, ticks: { precision: 0 } } },
      plugins: { tooltip: { callbacks: { label: (i) => `v${i.parsed.y} at ${fmtTime(i.parsed.x)}` } } } },
  });
}

// ---- experiences ---------------------------------------------------------------------------

const FILTERS = [["agent", "agent"], ["task_id", "task"], ["run_id", "run"], ["version", "version"], ["status", "status"],
  ["trained_in", "trained in"], ["min_reward", "reward ≥"], ["max_reward", "reward ≤"]];

async function experiences(main) {
  const params = Object.fromEntries(new URLSearchParams(location.search));
  const form = el("form", { class: "filters", method: "get", action: "/experiences" },
    FILTERS.map(([k, label]) => el("label", {}, label, k === "status"
      ? el("select", { name: k }, el("option", { value: "", text: "any" }), STATUSES.map((s) => el("option", { value: s, text: s, selected: params[k] === s })))
      : el("input", { name: k, value: params[k] || "", size: k.endsWith("reward") || k === "version" || k === "trained_in" ? 6 : 14 }))),
    el("button", { type: "submit", text: "Search" }));
  form.addEventListener("submit", (ev) => { // drop empty fields from the address
    ev.preventDefault();
    const q = new URLSearchParams();
    for (const [k, v] of new FormData(form)) if (v) q.set(k, v);
    location.href = "/experiences?" + q;
  });
  put(main, el("h1", { text: "Experiences" }), form);
  const page = await api("/api/experiences", params);
  const rows = page.experiences.map((x) => el("tr", { "data-experience": x.experience_id },
    el("td", {}, el("a", { href: "/experiences/" + encodeURIComponent(x.experience_id) + (params.agent ? "?agent=" + encodeURIComponent(params.agent) : ""), text: x.experience_id })),
    el("td", { text: x.agent }), el("td", { text: "v" + x.model_version }), el("td", { text: x.task_id ?? "–" }),
    el("td", { text: x.run_id ?? "–" }), el("td", {}, el("span", { class: "badge", text: x.status })),
    el("td", { class: "num", "data-value": x.reward ?? "", text: fmt(x.reward) }),
    el("td", { text: x.trained_in === null ? "–" : "v" + x.trained_in }), el("td", { text: fmtTime(x.created_at) })));
  put(main, el("table", { id: "experiences" },
    el("thead", {}, el("tr", {}, ["experience", "agent", "version", "task", "run", "status", "reward", "trained in", "created"].map((h) => el("th", { text: h })))),
    el("tbody", {}, rows)));
  if (!rows.length) main.append(el("p", { class: "muted", text: "No experience matches." }));
  if (page.next_before !== null) {
    const q = new URLSearchParams(params);
    q.set("before", page.next_before);
    put(main, el("p", {}, el("a", { id: "older", href: "/experiences?" + q, text: "Older →" })));
  }
}

function tokenColor(logprob) {
  if (logprob === null || logprob === undefined) return "#eef2f6"; // not sampled (a demonstration)
  const p = Math.exp(Math.max(-30, logprob));
  return `hsl(${Math.round(120 * p)}, 75%, ${Math.round(80 + 8 * p)}%)`;
}

function contentText(content) {
  if (content === null || content === undefined) return "";
  if (typeof content === "string") return content;
  if (Array.isArray(content)) return content.map((p) => (p && typeof p.text === "string" ? p.text : JSON.stringify(p))).join("\n");
  return JSON.stringify(content, null, 2);
}

function message(m, index) {
  return el("div", { class: "msg", "data-message": index },
    el("div", { class: "role", text: m.role + (m.name ? ` · ${m.name}` : "") + (m.tool_call_id ? ` · ${m.tool_call_id}` : "") }),
    el("pre", { text: contentText(m.content) }),
    m.tool_calls && m.tool_calls.length ? el("pre", { class: "json tool-calls", text: "tool calls: " + JSON.stringify(m.tool_calls, null, 2) }) : null);
}

async function experience(main, id) {
  const x = await api("/api/experiences/" + encodeURIComponent(id));
  const kv = [["agent", x.agent], ["version", "v" + x.model_version], ["task", x.task_id], ["run", x.run_id], ["status", x.status],
    ["reward", x.reward === null ? null : String(x.reward)], ["trained in", x.trained_in === null ? null : "v" + x.trained_in],
    ["finish reason", x.finish_reason], ["completion", x.completion_id], ["request id", x.request_id], ["user", x.user_id],
    ["created", fmtTime(x.created_at)], ["prompt tokens", x.prompt_tokens], ["response tokens", x.tokens.length]];
  const sampled = x.tokens.filter((t) => t.logprob !== null);
  const mean = sampled.length ? sampled.reduce((s, t) => s + t.logprob, 0) / sampled.length : null;
  put(main,
    el("h1", { text: "Experience " + x.experience_id }),
    el("dl", { class: "kv" }, kv.map(([k, v]) => [el("dt", { text: k }), el("dd", { "data-field": k, text: v === null || v === undefined ? "–" : v })])),
    el("h2", { text: "Response, token by token, coloured by its sampling probability" }),
    el("div", { class: "legend" }, "p = 0", el("span", { class: "swatch", style: "background:linear-gradient(90deg," + [0, 0.25, 0.5, 0.75, 1].map((p) => tokenColor(Math.log(Math.max(p, 1e-9)))).join(",") + ")" }), "p = 1",
      el("span", { "data-figure": "mean-logprob", "data-value": mean ?? "", text: ` · mean logprob ${fmt(mean)}` }),
      x.tokens_as_text ? null : el("span", { text: " · token ids (no tokenizer: set model.path)" })),
    el("div", { class: "tokens", id: "tokens" }, x.tokens.map((t, i) => el("span", {
      class: "tok", "data-i": i, "data-id": t.id, "data-logprob": t.logprob ?? "", style: "background:" + tokenColor(t.logprob),
      title: t.logprob === null ? `token ${t.id} · not sampled (a demonstration)` : `token ${t.id} · logprob ${t.logprob.toFixed(4)} · p ${Math.exp(t.logprob).toFixed(3)}`,
      text: t.text === null ? `⟨${t.id}⟩` : t.text }))),
    x.purged_at ? el("p", { class: "muted", text: "Its raw text was purged by retention at " + fmtTime(x.purged_at) + "." }) : null,
    el("h2", { text: "Messages (the prompt)" }),
    el("div", { id: "messages" }, (x.messages || []).map(message)),
    el("h2", { text: "Response message" }),
    el("div", { id: "response" }, x.response && Object.keys(x.response).length ? message(Object.assign({ role: "assistant" }, x.response), "response") : el("p", { class: "muted", text: "–" })),
    x.tools && x.tools.length ? [el("h2", { text: "Tools offered" }), el("pre", { class: "json msg", text: JSON.stringify(x.tools, null, 2) })] : null,
    el("h2", { text: "Feedback" }),
    el("pre", { class: "json msg", id: "feedback", text: x.feedback ? JSON.stringify(x.feedback, null, 2) : "none" }),
    x.hint ? [el("h2", { text: "Hint (feedback in words)" }), el("pre", { class: "json msg", id: "hint", text: JSON.stringify(x.hint, null, 2) })] : null,
    x.reward_history && x.reward_history.length ? [el("h2", { text: "Rewards, as they came" }),
      el("table", { id: "reward-history" },
        el("thead", {}, el("tr", {}, ["reward", "source", "sent by", "came", "status then", "outcome", "at"].map((h) => el("th", { text: h })))),
        el("tbody", {}, x.reward_history.map((h) => el("tr", {}, [String(h.reward), h.source ?? "–", h.actor ?? "–",
          h.late ? (h.trained_in === null ? "late (discarded)" : "late (trained in v" + h.trained_in + ")") : "before training", h.status_at, h.outcome ?? "–", fmtTime(h.created_at)]
          .map((v) => el("td", { text: v }))))))] : null,
    el("h2", { text: "Sampling" }),
    el("pre", { class: "json msg", text: JSON.stringify(x.sampling, null, 2) }),
    x.privacy ? [el("h2", { text: "Privacy" }), el("pre", { class: "json msg", text: JSON.stringify(x.privacy, null, 2) })] : null,
  );
}

// ---- shell ---------------------------------------------------------------------------------

function login(main, message) {
  const input = el("input", { type: "password", id: "key", placeholder: "kz-…", autocomplete: "off" });
  main.replaceChildren(el("form", { class: "login", id: "login", onsubmit: (ev) => {
    ev.preventDefault();
    sessionStorage.setItem(KEY, input.value.trim());
    location.reload();
  } }, el("h2", { text: "API key" }), el("p", { class: "muted", text: message }), input, el("button", { type: "submit", text: "Open" })));
}

async function route() {
  const main = document.getElementById("main");
  const path = location.pathname;
  const page = path === "/" ? "overview" : path.split("/")[1];
  setActive(page);
  try {
    const me = await api("/api/me");
    refreshS = me.refresh_s || 0;
    document.getElementById("who").textContent = me.auth ? "key: " + me.name : "";
    const { agents } = await api("/api/agents");
    const agent = await pickAgent(agents, page);
    main.replaceChildren();
    if (page === "experiences" && path.split("/")[2]) await experience(main, decodeURIComponent(path.split("/")[2]));
    else if (page === "experiences") await experiences(main);
    else if (!agent) main.append(el("p", { class: "muted", text: "No agent has experiences, Trainer steps or versions yet." }));
    else if (page === "trainer") await trainer(main, agent);
    else if (page === "versions") await versions(main, agent);
    else await overview(main, agent);
  } catch (e) {
    if (e.status === 401) { login(main, e.message); sessionStorage.removeItem(KEY); }
    else main.replaceChildren(el("div", { class: "error", id: "error", text: e.message }));
    document.body.dataset.error = String(e.status || "error");
  }
  document.body.dataset.ready = "1";
}

document.addEventListener("DOMContentLoaded", route);
