// The fleet dashboard: reads the gateway's server-sent events with fetch (so the API key goes
// in an Authorization header, never in a URL) and renders them. Every value reaches the page
// as text (textContent), never as HTML.
"use strict";

(() => {
  const KEY_STORE = "coordinator.dashboard.key";
  const STREAM = "/dashboard/stream";
  const QUIET_S = 40; // the server writes at least every 15 s: silence this long is a dead link
  const SAMPLES = 2000;
  const DONE_SHOWN = 10;
  const FAILURES_SHOWN = 12;
  const PALETTE = [
    "#2f6fdb", "#e0761a", "#1f9d6b", "#c0262d", "#8a4fd3",
    "#0b8aa8", "#b8860b", "#d6459b", "#5d6778", "#6a9e1f",
  ];

  const state = {
    summary: null, workers: [], models: null, tasks: null, figures: null, bench: [], config: null,
    samples: [], skew: 0, // server clock minus this one, in seconds
  };
  const charts = {};

  // -- small helpers -------------------------------------------------------------------------

  const $ = (id) => document.getElementById(id);

  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(props || {})) {
      if (value === undefined || value === null || value === false) continue;
      if (name === "class") node.className = value;
      else if (name === "label") node.dataset.label = value;
      else if (name.startsWith("data-")) node.setAttribute(name, value);
      else node[name] = value;
    }
    for (const child of children) {
      if (child === undefined || child === null || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  const now = () => Date.now() / 1000 + state.skew;
  const badge = (text, cls) => el("span", { class: `badge ${cls || text}` }, text);
  const short = (id) => (id && id.length > 12 ? id.slice(0, 12) + "…" : id || "–");

  function ago(t) {
    if (t === null || t === undefined) return "–";
    const s = Math.max(0, now() - t);
    if (s < 10) return `${s.toFixed(1)} s ago`;
    if (s < 90) return `${Math.round(s)} s ago`;
    if (s < 5400) return `${Math.round(s / 60)} min ago`;
    if (s < 172800) return `${Math.round(s / 3600)} h ago`;
    return new Date(t * 1000).toLocaleDateString();
  }

  function span(seconds) {
    if (seconds === null || seconds === undefined) return "–";
    if (seconds < 60) return `${seconds.toFixed(1)} s`;
    if (seconds < 3600) return `${Math.floor(seconds / 60)} min ${Math.round(seconds % 60)} s`;
    return `${Math.floor(seconds / 3600)} h ${Math.round((seconds % 3600) / 60)} min`;
  }

  function ms(value) {
    if (value === null || value === undefined) return "–";
    if (value >= 10000) return `${(value / 1000).toFixed(1)} s`;
    if (value >= 1000) return `${(value / 1000).toFixed(2)} s`;
    return `${Math.round(value)} ms`;
  }

  const num = (v, digits = 1) => (v === null || v === undefined ? "–" : v.toFixed(digits));
  const clock = (t) => new Date(t * 1000).toLocaleTimeString([], { hour12: false });

  function bytes(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
  }

  function fill(tableId, rows, emptyText, columns) {
    const body = $(tableId).tBodies[0];
    body.replaceChildren(...(rows.length ? rows : [
      el("tr", {}, el("td", { class: "empty", colSpan: columns }, emptyText)),
    ]));
  }

  // -- sections --------------------------------------------------------------------------------

  function renderSummary() {
    const s = state.summary;
    if (!s) return;
    const chips = [
      el("li", {}, el("b", {}, `${s.live}`), ` / ${s.workers} workers live`),
      el("li", { class: s.degraded ? "warn" : "" }, el("b", {}, `${s.degraded}`), " degraded"),
      el("li", {}, el("b", {}, `${s.queued}`), " queued"),
      el("li", {}, el("b", {}, `${s.running}`), " running"),
    ];
    if (s.stats_lag !== null) {
      chips.push(el("li", { class: s.stats_lag > 1000 ? "warn" : "" },
        "stats lag ", el("b", {}, `${s.stats_lag}`)));
    }
    if (!s.reaper) chips.push(el("li", { class: "bad" }, "reaper not answering"));
    else if (s.reaper.settling) chips.push(el("li", { class: "warn" }, "reaper settling"));
    $("summary").replaceChildren(...chips);

    const warnings = Object.entries(s.unavailable || {}).map(
      ([source, why]) => el("div", {}, el("b", {}, source), `: ${why}`));
    $("warnings").replaceChildren(...warnings);
    $("warnings").hidden = warnings.length === 0;

    const r = s.reaper;
    $("reaper-status").textContent = r
      ? `Since it started: moved ${r.moved}, failed ${r.failed}, duplicates reported ` +
        `${r.duplicates}; following ${Object.values(r.open_tasks || {}).reduce((a, b) => a + b, 0)}` +
        ` open tasks.`
      : "The reaper does not answer coordinator.reaper.status.";
    const log = s.event_log;
    $("log-line").textContent = log
      ? `event log: ${log.messages.toLocaleString()} events, ${bytes(log.bytes)}, last #${log.last_seq}` +
        ` · read up to #${s.projected_seq}`
      : "event log: not readable";
  }

  function renderWorkers() {
    const rows = state.workers.map((w) => {
      const dead = w.state === "lost" || w.state === "gone";
      // What a worker that is not there holds in memory is not known.
      const resident = new Set(dead ? [] : w.resident || (w.current_model ? [w.current_model] : []));
      const models = el("div", { class: "models" }, ...w.models.map((m) =>
        el("span", {
          class: resident.has(m) ? "model resident" : "model",
          title: resident.has(m) ? "in memory" : "",
        }, m)));
      // "" is a task of another key's: running, its id not told to this one.
      const task = w.current_task != null
        ? el("td", { label: "task" },
          el("span", {}, w.current_model || ""),
          el("span", { class: "sub id", title: w.current_task },
            w.current_task === "" ? "another key's" : short(w.current_task)),
          el("span", { class: "sub" }, w.task_started_at ? `for ${span(now() - w.task_started_at)}` : "running"))
        : el("td", { label: "task", class: "none" }, "–");
      return el("tr", { "data-worker": w.worker_id, class: dead ? "dead" : "" },
        el("td", { label: "worker" }, el("b", {}, w.worker_id), el("span", { class: "sub" }, w.host)),
        el("td", { label: "tier" }, w.tier),
        el("td", { label: "state", class: "state" }, badge(w.state)),
        el("td", { label: "health", class: "health" }, badge(w.health),
          w.health_reason ? el("span", { class: "sub msg" }, w.health_reason) : null),
        el("td", { label: "models" }, models),
        task,
        el("td", { label: "queue", class: "num" }, w.queue_depth === null ? "–" : `${w.queue_depth}`),
        el("td", { label: "heartbeat", class: "num" }, ago(w.last_heartbeat)),
        el("td", { label: "problems", class: "problem" }, (w.problems || []).join("; ")),
      );
    });
    fill("workers", rows, "No worker has registered.", 9);
  }

  function renderModels() {
    const m = state.models;
    if (!m) return;
    const rows = [];
    for (const row of m.models) {
      row.copies.forEach((c, n) => rows.push(el("tr", { "data-model": row.model, "data-worker": c.worker },
        el("td", { label: "model" }, n === 0 ? el("b", {}, row.model) : ""),
        el("td", { label: "worker" }, c.worker, el("span", { class: "sub" }, c.host)),
        el("td", { label: "size", class: "num" }, c.size ? bytes(c.size) : "–"),
        el("td", { label: "quantisation" }, c.quantization || "–",
          c.parameter_size ? el("span", { class: "sub" }, c.parameter_size) : null),
        el("td", { label: "digest", class: "id", title: c.digest }, c.digest ? c.digest.slice(0, 12) : "–"),
        el("td", { label: "in memory" }, c.loaded === null ? "–" : badge(c.loaded ? "loaded" : "not loaded", c.loaded ? "idle" : "")),
        el("td", { label: "last used", class: "num" }, m.figures ? (c.last_used ? ago(c.last_used) : "never") : "?"),
        el("td", { label: "tokens/s", class: "num" }, num(c.tokens_per_s)),
      )));
      if (row.digests_differ) {
        rows.push(el("tr", { class: "differs", "data-model": row.model },
          el("td", { class: "problem", colSpan: 8 },
            `${row.model} differs by digest between workers: `,
            row.copies.filter((c) => c.digest).map((c) => `${c.worker} ${c.digest.slice(0, 12)}`).join(", "))));
      }
    }
    fill("models", rows, "No live worker serves a model.", 8);
  }

  function renderTasks() {
    const t = state.tasks;
    if (!t) return;
    const total = (state.summary ? state.summary.queued + state.summary.running : t.open.length);
    $("open-count").textContent = total ? `(${total})` : "";
    fill("open-tasks", t.open.map((task) => el("tr", { "data-task": task.task_id },
      el("td", { label: "task", class: "id", title: task.task_id }, short(task.task_id)),
      el("td", { label: "model" }, task.model, task.kind !== "inference" && task.kind !== "unknown"
        ? el("span", { class: "sub" }, task.kind) : null),
      el("td", { label: "status", class: "status" }, badge(task.status),
        task.attempt > 1 ? el("span", { class: "sub" }, `attempt ${task.attempt}`) : null),
      el("td", { label: "worker" }, task.worker || "–"),
      el("td", { label: "for", class: "num" },
        span(now() - (task.started_at || task.submitted_at))),
    )), "Nothing queued or running.", 5);
    fill("done-tasks", t.done.slice(0, DONE_SHOWN).map((end) => el("tr", { "data-task": end.task_id },
      el("td", { label: "at", class: "num" }, clock(end.at)),
      el("td", { label: "task", class: "id", title: end.task_id }, short(end.task_id)),
      el("td", { label: "model" }, end.model),
      el("td", { label: "worker" }, end.worker),
      el("td", { label: "took", class: "num" }, ms(end.total_ms)),
    )), "No task has ended yet.", 5);
    fill("failures", t.failures.slice(0, FAILURES_SHOWN).map((end) => el("tr", { "data-task": end.task_id },
      el("td", { label: "at", class: "num" }, clock(end.at)),
      el("td", { label: "task" }, el("span", { class: "id", title: end.task_id }, short(end.task_id)),
        el("span", { class: "sub" }, end.model)),
      el("td", { label: "worker" }, end.worker),
      el("td", { label: "failure", class: "failure" }, badge(end.outcome, "code"),
        end.retryable ? " retryable" : null, el("span", { class: "sub msg" }, end.message)),
    )), "No failure lately.", 4);
    fill("actions", t.actions.map((a) => el("tr", {},
      el("td", { label: "at", class: "num" }, clock(a.at)),
      el("td", { label: "action" }, badge(a.action)),
      el("td", { label: "task", class: "id", title: a.task_id || "" },
        a.task_id ? `${short(a.task_id)}${a.attempt ? ` #${a.attempt}` : ""}` : "–"),
      el("td", { label: "worker" }, a.worker || "–"),
      el("td", { label: "reason", class: "msg" }, a.reason),
    )), "The reaper has not acted lately.", 5);
  }

  function renderFigures() {
    const f = state.figures;
    if (!f) return;
    fill("figures", f.figures.map((x) => el("tr", {},
      el("td", { label: "model" }, x.model),
      el("td", { label: "domain" }, x.domain),
      el("td", { label: "worker" }, x.worker),
      el("td", { label: "tasks", class: "num" }, `${x.count}`),
      el("td", { label: "failed", class: "num" }, `${x.failures}`),
      el("td", { label: "p50", class: "num" }, ms(x.p50_ms)),
      el("td", { label: "p95", class: "num" }, ms(x.p95_ms)),
      el("td", { label: "warm p50", class: "num" }, ms(x.warm_p50_ms)),
      el("td", { label: "cold load p50", class: "num" }, ms(x.cold_load_ms_p50)),
      el("td", { label: "tokens/s", class: "num" }, num(x.tokens_per_s)),
      el("td", { label: "first token", class: "num" }, ms(x.first_token_ms_p50)),
      el("td", { label: "quality", class: "num" },
        x.quality_count ? `${num(x.quality_mean, 2)} (${x.quality_count})` : "–"),
    )), "No figures yet (is the stats service running?).", 12);
    fill("cold-loads", f.cold_loads.map((c) => el("tr", {},
      el("td", { label: "model" }, c.model),
      el("td", { label: "worker" }, c.worker),
      el("td", { label: "cold loads", class: "num" }, `${c.count}`),
    )), "No cold load lately.", 3);
  }

  function renderConfig() {
    const c = state.config;
    if (!c) return;
    fill("exclusions", c.exclusions.map((x) => el("tr", {},
      el("td", { label: "id", class: "id" }, x.exclusion_id),
      el("td", { label: "worker" }, x.worker),
      el("td", { label: "model" }, x.model || "every model"),
      el("td", { label: "since", class: "num" }, new Date(x.since * 1000).toLocaleString()),
      el("td", { label: "until", class: "num" },
        x.until ? new Date(x.until * 1000).toLocaleString() : "open"),
      el("td", { label: "reason", class: "msg" }, x.reason),
    )), "No exclusion in force.", 6);
    fill("aliases", Object.entries(c.aliases).map(([alias, canonical]) => el("tr", {},
      el("td", { label: "name", class: "id" }, alias),
      el("td", { label: "stands for", class: "id" }, canonical),
    )), "No alias.", 2);
  }

  // -- charts ----------------------------------------------------------------------------------

  function cssVar(name) {
    return getComputedStyle(document.documentElement).getPropertyValue(name).trim();
  }

  function axes(yLabel) {
    const ink = cssVar("--muted");
    const grid = { stroke: cssVar("--grid"), width: 1 };
    return [
      { stroke: ink, grid, ticks: grid },
      { stroke: ink, grid, ticks: grid, label: yLabel, size: 56 },
    ];
  }

  // One chart in the box `id`, made again when its series change, else given new data.
  function draw(id, names, data, makeSeries, yLabel) {
    const box = $(id);
    const signature = names.join("\u0001");
    let chart = charts[id];
    if (!names.length || data[0].length === 0) {
      if (chart) { chart.destroy(); delete charts[id]; }
      if (!box.querySelector(".nodata")) box.replaceChildren(el("div", { class: "nodata" }, "No data yet."));
      return;
    }
    if (chart && chart.signature === signature) {
      chart.setData(data);
      return;
    }
    if (chart) chart.destroy();
    box.replaceChildren();
    chart = new uPlot({
      width: Math.max(280, box.clientWidth),
      height: 240,
      series: [{}, ...makeSeries(names)],
      axes: axes(yLabel),
      legend: { live: false },
      cursor: { drag: { x: false, y: false } },
      scales: { x: { time: true } },
    }, data, box);
    chart.signature = signature;
    charts[id] = chart;
    // Series marked aux (a baseline, the slow marks) keep out of the legend.
    const rows = box.querySelectorAll(".u-legend .u-series");
    const offset = chart.series.length - rows.length; // the x series has no row when not live
    chart.series.forEach((s, i) => {
      if (s.aux && rows[i - offset]) rows[i - offset].style.display = "none";
    });
  }

  function lines(names) {
    return names.map((name, i) => ({
      label: name, stroke: PALETTE[i % PALETTE.length], width: 2, spanGaps: true,
      points: { show: true, size: 4 },
    }));
  }

  // Aligned columns for uPlot: x (seconds) and one column per key, null where it has no point.
  function aligned(rows, keyOf, valueOf) {
    const names = [...new Set(rows.map(keyOf))].sort();
    const xs = [...new Set(rows.map((r) => r[1]))].sort((a, b) => a - b);
    const at = new Map(xs.map((x, i) => [x, i]));
    const columns = names.map(() => new Array(xs.length).fill(null));
    for (const row of rows) {
      const v = valueOf(row);
      if (v !== null && v !== undefined) columns[names.indexOf(keyOf(row))][at.get(row[1])] = v;
    }
    return { names, data: [xs, ...columns] };
  }

  function renderCharts() {
    if (typeof uPlot === "undefined") return;
    // A sample: [index, at, model, worker, total_ms, p50_ms, p95_ms, tokens_per_s, first_token_ms, load_ms]
    const key = (s) => `${s[2]} @ ${s[3]}`;
    const p50 = aligned(state.samples, key, (s) => s[5]);
    draw("chart-p50", p50.names, p50.data, lines, "ms");
    const p95 = aligned(state.samples, key, (s) => s[6]);
    draw("chart-p95", p95.names, p95.data, lines, "ms");
    const tps = aligned(state.samples.filter((s) => s[7] !== null), key, (s) => s[7]);
    draw("chart-tps", tps.names, tps.data, lines, "tokens/s");
    renderBench();
  }

  function renderBench() {
    const series = state.bench.filter((b) => b.points.some((p) => p.median_ms !== null));
    const xs = [...new Set(series.flatMap((b) => b.points.map((p) => p.at)))].sort((a, b) => a - b);
    const names = [];
    const columns = [];
    const specs = [];
    series.forEach((b, i) => {
      const color = PALETTE[i % PALETTE.length];
      const byAt = new Map(b.points.map((p) => [p.at, p]));
      const name = `${b.model} @ ${b.worker}`;
      names.push(name);
      columns.push(xs.map((x) => (byAt.has(x) ? byAt.get(x).median_ms : null)));
      specs.push({ label: name, stroke: color, width: 2, spanGaps: true, points: { show: true, size: 6 } });
      if (b.baseline_ms !== null) {
        names.push(`${name} baseline`);
        columns.push(xs.map(() => b.baseline_ms));
        specs.push({
          label: `${name} baseline`, stroke: color, width: 1, dash: [6, 4], points: { show: false }, aux: true,
        });
      }
      names.push(`${name} slow`);
      columns.push(xs.map((x) => (byAt.has(x) && byAt.get(x).slow ? byAt.get(x).median_ms : null)));
      specs.push({
        label: `${name} slow`, stroke: "#d62828", width: 0, paths: () => null, aux: true,
        points: { show: true, size: 12, fill: "#d62828", stroke: "#d62828" },
      });
    });
    draw("chart-bench", names, [xs, ...columns], () => specs, "ms");
  }

  function resizeCharts() {
    for (const [id, chart] of Object.entries(charts)) {
      chart.setSize({ width: Math.max(280, $(id).clientWidth), height: 240 });
    }
  }

  // -- the feed --------------------------------------------------------------------------------

  let chartsDue = false;
  function chartsSoon() {
    if (chartsDue) return;
    chartsDue = true;
    requestAnimationFrame(() => { chartsDue = false; renderCharts(); });
  }

  const handlers = {
    summary(data) {
      state.summary = data;
      state.skew = data.now - Date.now() / 1000;
      renderSummary();
      renderTasks();
    },
    workers(data) { state.workers = data; renderWorkers(); },
    models(data) { state.models = data; renderModels(); },
    tasks(data) { state.tasks = data; renderTasks(); },
    figures(data) { state.figures = data; renderFigures(); },
    bench(data) { state.bench = data; chartsSoon(); },
    config(data) { state.config = data; renderConfig(); },
    series(data) { state.samples = data; chartsSoon(); },
    samples(data) {
      state.samples = state.samples.concat(data).slice(-SAMPLES);
      chartsSoon();
    },
  };

  function dispatch(block) {
    let event = "message";
    const data = [];
    for (const line of block.split("\n")) {
      if (line.startsWith("event:")) event = line.slice(6).trim();
      else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
    }
    if (!data.length || !handlers[event]) return;
    handlers[event](JSON.parse(data.join("\n")));
  }

  function setLink(text, cls) {
    const link = $("link");
    link.textContent = text;
    link.className = `badge link-${cls}`;
  }

  function askKey(message) {
    sessionStorage.removeItem(KEY_STORE);
    $("key-form").hidden = false;
    $("main").hidden = true;
    $("forget-key").hidden = true;
    $("key-error").hidden = !message;
    $("key-error").textContent = message || "";
    setLink("needs a key", "down");
    $("key-input").focus();
  }

  let retryMs = 1000;
  async function connect() {
    const key = sessionStorage.getItem(KEY_STORE);
    const headers = { Accept: "text/event-stream" };
    if (key) headers.Authorization = `Bearer ${key}`;
    const abort = new AbortController();
    let heard = Date.now();
    const watchdog = setInterval(() => {
      if (Date.now() - heard > QUIET_S * 1000) abort.abort();
    }, 5000);
    try {
      const response = await fetch(STREAM, { headers, signal: abort.signal, cache: "no-store" });
      if (response.status === 401) {
        let message = "";
        try { message = (await response.json()).error.message; } catch (e) { /* not JSON */ }
        askKey(key ? message : "");
        return;
      }
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      $("key-form").hidden = true;
      $("main").hidden = false;
      $("forget-key").hidden = !key;
      setLink("live", "live");
      retryMs = 1000;
      const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        heard = Date.now();
        buffer += value;
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          dispatch(buffer.slice(0, end));
          buffer = buffer.slice(end + 2);
        }
      }
      setLink("reconnecting", "connecting");
    } catch (error) {
      setLink("reconnecting", "down");
    } finally {
      clearInterval(watchdog);
    }
    setTimeout(connect, retryMs);
    retryMs = Math.min(retryMs * 2, 15000);
  }

  function start() {
    $("key-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const key = $("key-input").value.trim();
      if (!key) return;
      sessionStorage.setItem(KEY_STORE, key);
      $("key-input").value = "";
      $("key-form").hidden = true;
      setLink("connecting", "connecting");
      connect();
    });
    $("forget-key").addEventListener("click", () => {
      sessionStorage.removeItem(KEY_STORE);
      location.reload();
    });
    // Ages and elapsed times move with the clock.
    setInterval(() => { renderWorkers(); renderTasks(); }, 1000);
    let resizing = 0;
    window.addEventListener("resize", () => {
      clearTimeout(resizing);
      resizing = setTimeout(resizeCharts, 150);
    });
    connect();
  }

  document.addEventListener("DOMContentLoaded", start);
})();
