// autoloop serve: the live page. Every element is built with DOM calls and every text
// from a trial or a model goes in through textContent (the page runs under Trusted Types
// with no policy: an innerHTML assignment would throw). Updates: the server's event
// stream says "changed"; the page then fetches what it shows, the run page's views in one
// request (/api/runs/TAG/page) that leaves out every view whose fingerprint it already has.
"use strict";
(function () {
  const SVGNS = "http://www.w3.org/2000/svg";
  const STATUSES = ["keep", "discard", "crash", "timeout", "invalid", "interrupted", "running"];
  const COLOURS = { keep: "#1a9850", discard: "#9e9e9e", crash: "#d73027", timeout: "#f46d43", invalid: "#984ea3",
    interrupted: "#e6ab02", running: "#2c7fb8", baseline: "#2c7fb8", incumbent: "#1a9850" };
  const main = document.getElementById("main");
  const select = document.getElementById("run-select");
  const tabs = document.getElementById("tabs");
  const dot = document.getElementById("live-dot");
  const state = { tag: null, view: "run", number: null, offset: 0, limit: 50, status: "", parent: "",
    session: { can_write: false }, runs: [], last: {}, es: null, es_tag: undefined, charts: {}, busy: {}, again: {},
    summary: null, lastEvent: 0, hashes: {} };

  // Count what would mean the page is broken or under attack; the browser test reads these.
  document.addEventListener("securitypolicyviolation", () => bump("cspViolations"));
  window.addEventListener("error", () => bump("jsErrors"));
  function bump(name) { document.body.dataset[name] = String(Number(document.body.dataset[name] || 0) + 1); }

  // ------------------------------------------------------------------ DOM helpers

  function h(tag, attrs, ...kids) {
    const el = document.createElement(tag);
    setAttrs(el, attrs);
    append(el, kids);
    return el;
  }
  function s(tag, attrs, ...kids) {
    const el = document.createElementNS(SVGNS, tag);
    setAttrs(el, attrs);
    append(el, kids);
    return el;
  }
  function setAttrs(el, attrs) {
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") el.setAttribute("class", v);
      else if (k.startsWith("on")) el.addEventListener(k.slice(2), v);
      else if (k === "data") for (const [dk, dv] of Object.entries(v)) el.dataset[dk] = String(dv);
      else el.setAttribute(k, String(v));
    }
  }
  function append(el, kids) {
    for (const kid of kids.flat(Infinity)) {
      if (kid === null || kid === undefined || kid === false) continue;
      el.append(kid instanceof Node ? kid : document.createTextNode(String(kid)));
    }
  }
  function fill(el, ...kids) { el.replaceChildren(); append(el, kids); return el; }
  function byId(id) { return document.getElementById(id); }

  const TRIAL_INCRS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000];
  const fmt = (v, d = 4) => (v === null || v === undefined ? "–" : Number(v).toFixed(d));
  const signed = (v, d = 4) => (v === null || v === undefined ? "–" : (v > 0 ? "+" : "") + Number(v).toFixed(d));
  const pct = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + "%");
  function dur(sec) {
    if (sec === null || sec === undefined) return "–";
    if (sec < 90) return Math.round(sec) + " s";
    if (sec < 5400) return (sec / 60).toFixed(1) + " min";
    return (sec / 3600).toFixed(1) + " h";
  }
  function ago(iso) {
    if (!iso) return "";
    const t = Date.parse(iso);
    return isNaN(t) ? "" : dur(Math.max(0, (Date.now() - t) / 1000)) + " ago";
  }
  const runHref = (tag, rest) => "#/r/" + encodeURIComponent(tag) + (rest || "");
  const trialHref = (n) => runHref(state.tag, "/t/" + Number(n));
  const statusSpan = (st) => h("span", { class: "status " + st }, st);
  // A keep's tier and an early stop, marked as `autoloop log` marks them (keep ✓, stop@N%).
  const TIER_TITLES = { confirmed: "confirmed: the sequential test against the run's noise says so",
    adopted: "adopted: the branch moved on the paired mean, not confirmed" };
  const trialMarks = (t) => [
    t.status === "keep" && t.tier === "confirmed" ? h("span", { class: "tier", title: TIER_TITLES.confirmed }, " ✓") : null,
    t.stopped_at !== null && t.stopped_at !== undefined
      ? h("span", { class: "stopped", title: "a clear loser, stopped early at this share of its budget" },
        " stop@" + Math.round(100 * t.stopped_at) + "%") : null];
  const statusCell = (t) => {
    const span = statusSpan(t.status);
    if (t.status === "keep" && TIER_TITLES[t.tier]) span.title = TIER_TITLES[t.tier];
    return [span, ...trialMarks(t)];
  };
  const deltaClass = (v) => (v === null || v === undefined || v === 0 ? "" : v < 0 ? "better" : "worse");

  // ------------------------------------------------------------------ server

  async function api(path, options) {
    const response = await fetch(path, Object.assign({ credentials: "same-origin", cache: "no-store" }, options || {}));
    let body = null;
    try { body = await response.json(); } catch (e) { body = { error: "HTTP " + response.status }; }
    if (!response.ok) throw new Error((body && body.error) || "HTTP " + response.status);
    return body;
  }
  function post(path, data) {
    return api(path, { method: "POST", body: JSON.stringify(data || {}),
      headers: { "Content-Type": "application/json", "X-Autoloop-Request": "1" } });
  }
  const runApi = (what) => "/api/runs/" + encodeURIComponent(state.tag) + "/" + what;

  // One fetch per section at a time; a change that arrives meanwhile runs it once more.
  async function once(name, job) {
    if (state.busy[name]) { state.again[name] = true; return; }
    state.busy[name] = true;
    try { await job(); } catch (e) { showError(name, e); }
    finally {
      state.busy[name] = false;
      if (state.again[name]) { state.again[name] = false; once(name, job); }
    }
    document.body.dataset.updated = String(Date.now());
  }
  function showError(name, e) {
    const el = byId("err-" + name) || byId("page-error");
    if (el) fill(el, h("div", { class: "banner bad" }, String(e.message || e)));
  }

  // ------------------------------------------------------------------ routing

  function parse() {
    const m = location.hash.match(/^#\/r\/([^/?]+)(?:\/(tree|t\/(\d+)))?(?:\?(.*))?$/);
    if (!m) return null;
    const params = new URLSearchParams(m[4] || "");
    return { tag: decodeURIComponent(m[1]), view: m[2] === "tree" ? "tree" : m[3] ? "trial" : "run",
      number: m[3] ? Number(m[3]) : null, parent: params.get("parent") || "" };
  }

  async function route() {
    const where = parse();
    if (!where) {
      const runs = await loadRuns();
      if (runs.length) { location.replace(runHref(runs[0].tag)); return; }
      renderEmpty();
      connect(null);
      return;
    }
    const changedRun = where.tag !== state.tag;
    Object.assign(state, where);
    if (changedRun) { state.offset = 0; state.status = ""; state.summary = null; }
    state.hashes = {};  // a new view draws every part afresh
    if (where.view === "run" && where.parent) state.offset = 0;
    destroyCharts();
    renderTabs();
    if (state.view === "run") renderRunPage();
    else if (state.view === "tree") renderTreePage();
    else renderTrialPage();
    connect(state.tag);
    refresh(true, true);
    if (state.view !== "run") loadRuns();
  }

  function renderTabs() {
    fill(tabs,
      h("a", { href: runHref(state.tag), class: state.view === "run" ? "on" : "" }, "Run"),
      h("a", { href: runHref(state.tag, "/tree"), class: state.view === "tree" ? "on" : "" }, "Tree"));
  }

  async function loadRuns() {
    try {
      const data = await api("/api/runs");
      state.runs = data.runs || [];
      state.missing = data.missing || null;
    } catch (e) { state.runs = []; }
    return showRuns(state.runs);
  }
  function showRuns(runs) {
    state.runs = runs;
    fill(select, state.runs.map((r) => h("option", { value: r.tag, selected: r.tag === state.tag },
      r.tag + " (" + r.status + ", " + r.trials + " trials)")));
    return state.runs;
  }
  select.addEventListener("change", () => { location.hash = runHref(select.value); });

  function renderEmpty() {
    fill(main, h("h1", {}, "autoloop"),
      h("p", { class: "banner" }, state.missing || "This database has no runs yet: start one with `autoloop run`."),
      h("p", { class: "muted" }, "The page updates by itself when the run starts."));
  }

  // ------------------------------------------------------------------ live updates

  function connect(tag) {
    if (state.es && state.es_tag === tag) return;
    if (state.es) state.es.close();
    state.es_tag = tag;
    const es = new EventSource("/api/stream" + (tag ? "?run=" + encodeURIComponent(tag) : ""));
    es.addEventListener("change", (event) => {
      let now;
      try { now = JSON.parse(event.data); } catch (e) { return; }
      state.lastEvent = Date.now();
      const db = now.db !== state.last.db, live = now.live !== state.last.live;
      state.last = now;
      if (!state.tag) { route(); return; }
      refresh(db, live);
    });
    es.onopen = () => { dot.className = "dot on"; dot.title = "live: updates arrive by themselves"; };
    es.onerror = () => { dot.className = "dot off"; dot.title = "reconnecting…"; };
    state.es = es;
  }
  // If the stream is down (a proxy that buffers it), poll instead.
  setInterval(() => {
    if (state.tag && (!state.es || state.es.readyState !== 1) && Date.now() - state.lastEvent > 2000) refresh(true, true);
  }, 2000);

  function refresh(db, live) {
    if (!state.tag) return;
    if (state.view === "run") {
      if (db) once("page", () => loadParts(RUN_PARTS));
      else if (live) once("live", () => loadParts(["live"]));
    } else if (state.view === "tree") {
      if (db) once("tree", loadTree);
    } else if (db || live) once("trial", loadTrial);
  }

  // ------------------------------------------------------------------ charts (uPlot)

  function destroyCharts() {
    for (const chart of Object.values(state.charts)) chart.destroy();
    state.charts = {};
  }
  function chartWidth(el) { return Math.max(280, Math.floor(el.getBoundingClientRect().width) - 4); }

  function keyed(name, el, make, data, signature) {
    const old = state.charts[name];
    if (old && old._signature === signature && old.root.parentNode === el) { old.setData(data); return old; }
    if (old) old.destroy();
    el.replaceChildren();
    const chart = make();
    chart._signature = signature;
    state.charts[name] = chart;
    return chart;
  }

  function progressChart(el, p, summary) {
    const n = p.number.length;
    if (!n || !p.metric.some((m) => m !== null)) { fill(el, h("p", { class: "muted" }, "No trial has a metric yet.")); return; }
    const keep = p.statuses.indexOf("keep"), discard = p.statuses.indexOf("discard");
    const baseline = summary && summary.headline ? summary.headline.baseline_metric : null;
    const metrics = p.metric.filter((m) => m !== null).sort((a, b) => a - b);
    const lo = metrics[0];
    const hi = Math.max(baseline !== null ? baseline : metrics[metrics.length - 1], metrics[Math.floor(0.9 * (metrics.length - 1))]);
    const span = hi - lo || Math.abs(hi) * 0.01 || 0.01;
    const top = hi + 0.12 * span, bottom = lo - 0.12 * span;
    const xs = p.number, shown = [], kept = [], best = [], base = [];
    let running = null;
    for (let i = 0; i < n; i++) {
      const m = p.metric[i], st = p.status[i];
      kept.push(m !== null && st === keep ? m : null);
      if (m !== null && st === keep && (running === null || m < running)) running = m;
      best.push(running);
      shown.push(m !== null && st === discard ? Math.min(m, top - 0.01 * span) : null);
      base.push(baseline);
    }
    const labels = [];
    const keptIdx = [];
    for (let i = 0; i < n; i++) if (kept[i] !== null) keptIdx.push(i);
    const label = (i) => "#" + xs[i] + " " + (p.labels[String(xs[i])] || "");
    (keptIdx.length > 12 ? keptIdx.slice(-12) : keptIdx).forEach((i) => labels.push(i));
    const opts = {
      width: chartWidth(el), height: 330,
      scales: { x: { time: false }, y: { range: () => [bottom, top] } },
      // Trial numbers are integers: ticks step by whole trials only (uPlot would put them at 1.1, 1.2).
      axes: [{ label: "trial", incrs: TRIAL_INCRS, values: (u, v) => v.map((x) => String(Math.round(x))) },
        { label: "val_bpb (lower is better)", size: 70, values: (u, v) => v.map((x) => x.toFixed(3)) }],
      series: [
        { label: "trial" },
        { label: "discarded", stroke: COLOURS.discard, paths: () => null, points: { show: true, size: 5, fill: COLOURS.discard, stroke: COLOURS.discard } },
        { label: "kept", stroke: COLOURS.keep, paths: () => null, points: { show: true, size: 10, width: 1, fill: COLOURS.keep, stroke: "#14532d" } },
        { label: "best so far", stroke: COLOURS.keep, width: 2, paths: uPlot.paths.stepped({ align: 1 }), points: { show: false } },
        { label: "baseline", stroke: COLOURS.baseline, width: 1.2, dash: [6, 4], points: { show: false } },
      ],
      legend: { live: false },
      hooks: {
        draw: [(u) => {
          const ctx = u.ctx;
          ctx.save();
          ctx.font = `${Math.round(11 * devicePixelRatio)}px sans-serif`;
          ctx.fillStyle = "#14532d";
          ctx.textBaseline = "bottom";
          let previous = -Infinity;
          const angle = 0.5, edge = u.bbox.left + u.bbox.width + 8 * devicePixelRatio;
          for (const i of labels) {
            const x = u.valToPos(xs[i], "x", true), y = u.valToPos(kept[i], "y", true);
            if (x - previous < 60 * devicePixelRatio) continue;  // labels closer than that would overlap
            // Every label goes up and to the right at one angle (parallel lines never cross),
            // cut to the room left before the chart's right edge.
            const room = (edge - x - 6 * devicePixelRatio) / Math.cos(angle);
            let text = label(i);
            while (text.length > 3 && ctx.measureText(text).width > room) text = text.slice(0, -2) + "…";
            if (ctx.measureText(text).width > room) continue;
            previous = x;
            ctx.save();
            ctx.textAlign = "left";
            ctx.translate(x + 6 * devicePixelRatio, y - 5 * devicePixelRatio);
            ctx.rotate(-angle);
            ctx.fillText(text, 0, 0);  // canvas text: never parsed as HTML
            ctx.restore();
          }
          ctx.restore();
        }],
        ready: [(u) => u.over.addEventListener("click", () => {
          const i = u.cursor.idx;
          if (i !== null && i !== undefined) location.hash = trialHref(xs[i]);
        })],
      },
    };
    const data = [xs, shown, kept, best, base];
    keyed("progress", el, () => new uPlot(opts, data, el), data, "p" + labels.join(",") + ":" + bottom.toFixed(5) + top.toFixed(5));
  }

  function curveChart(name, el, mine, reference, label, refLabel, height) {
    if (!mine.length && !(reference && reference.length)) { fill(el, h("p", { class: "muted" }, "No loss curve yet.")); return; }
    const sets = [[mine.map((p) => p[0]), mine.map((p) => p[1])]];
    if (reference && reference.length) sets.push([reference.map((p) => p[0]), reference.map((p) => p[1])]);
    const data = uPlot.join(sets);
    const series = [{ label: "step" }, { label: label, stroke: COLOURS.running, width: 2, spanGaps: true }];
    if (sets.length > 1) series.push({ label: refLabel, stroke: COLOURS.incumbent, width: 1.5, dash: [5, 3], spanGaps: true });
    const opts = { width: chartWidth(el), height: height || 170, scales: { x: { time: false } }, series: series,
      axes: [{ label: "step" }, { label: "training loss", size: 56 }], legend: { live: false } };
    keyed(name, el, () => new uPlot(opts, data, el), data, "c" + series.length);
  }

  // ------------------------------------------------------------------ the run page

  // The run page's views, drawn in this order (the chart reads the summary's figures).
  const RUN_PARTS = ["runs", "summary", "progress", "live", "events", "ideas", "trials"];
  const SHOW = { runs: (d) => showRuns(d), summary: (d) => showSummary(d), progress: (d) => showProgress(d),
    live: (d) => showLive(d), events: (d) => showEvents(d), ideas: (d) => showIdeas(d), trials: (d) => showTrials(d) };
  function trialParams() {
    const params = new URLSearchParams({ offset: state.offset, limit: state.limit });
    if (state.status) params.set("status", state.status);
    if (state.parent) params.set("parent", state.parent);
    return params;
  }
  async function loadParts(parts) {
    const params = trialParams();
    const asked = params.toString();
    params.set("parts", parts.join(","));
    const have = parts.filter((p) => state.hashes[p]).map((p) => p + ":" + state.hashes[p]);
    if (have.length) params.set("have", have.join(","));
    const reply = await api(runApi("page") + "?" + params.toString());
    for (const name of RUN_PARTS) {
      const part = reply.parts[name];
      if (!part) continue;
      // A table page asked for before the pager moved is not the page shown now.
      if (name === "trials" && trialParams().toString() !== asked) continue;
      if (part.error) { state.hashes[name] = null; showError(name, new Error(part.error)); continue; }
      if (part.data === undefined) continue;  // unchanged: what is drawn is current
      try { SHOW[name](part.data); state.hashes[name] = part.hash; }
      catch (e) { state.hashes[name] = null; showError(name, e); }
    }
  }

  function renderRunPage() {
    fill(main,
      h("div", { id: "page-error" }),
      h("div", { id: "run-head" }),
      h("div", { id: "err-summary" }),
      h("section", { class: "stats", id: "stats" }),
      h("div", { class: "grid2" },
        h("div", {}, h("h2", {}, "Progress"), h("div", { id: "err-progress" }), h("div", { id: "progress", class: "chart" })),
        h("div", {}, h("h2", {}, "Running now"), h("div", { id: "err-live" }), h("div", { id: "live" }))),
      h("div", { class: "grid2e" },
        h("div", {}, h("h2", {}, "Recent events"), h("div", { id: "err-events" }), h("div", { id: "events" })),
        h("div", {}, h("h2", {}, "Idea queue ", h("span", { class: "count", id: "ideas-count" })), h("div", { id: "err-ideas" }),
          h("div", { id: "ideas" }), h("div", { id: "seed" }))),
      h("h2", { id: "trials-title" }, "Trials ", h("span", { class: "count", id: "trials-count" })),
      h("div", { id: "err-trials" }),
      h("div", { id: "trials-controls" }),
      h("div", { id: "trials" }));
    renderSeedForm();
  }

  // Dollars as autoloop.loop.cost writes them: $2.30, and a sum below a cent with its first figures.
  function usd(x) {
    return x === 0 || Math.abs(x) >= 0.01 ? "$" + x.toFixed(2) : "$" + x.toPrecision(2);
  }

  function costNote(cost) {
    const parts = [usd(cost.tokens_usd) + " model tokens",
      // the machine's hours, named as the headline names them (a CPU run never says GPU)
      usd(cost.gpu_usd) + " " + (cost.compute || "GPU") + " time" +
        (cost.gpu_hour_price ? " at $" + cost.gpu_hour_price + "/" + (cost.compute || "GPU") + "-hour" : " (no gpu-hour-price set)")];
    if (cost.usd_per_bpb !== null && cost.usd_per_bpb !== undefined) parts.push(usd(cost.usd_per_bpb) + " per bpb gained");
    if (cost.max_cost !== null && cost.max_cost !== undefined) parts.push("cap $" + cost.max_cost);
    return parts.join("; ");
  }

  function stat(label, value, note, cls) {
    return h("div", { class: "stat" + (cls ? " " + cls : "") }, h("div", { class: "label" }, label),
      h("div", { class: "value", title: String(value) }, value), note ? h("div", { class: "note" }, note) : null);
  }

  function showSummary(summary) {
    state.summary = summary;
    const head = summary.headline, best = summary.best;
    const status = summary.status;
    const controller = summary.controller;
    const stopButton = state.session.can_write && status === "active" && !summary.stop_requested
      ? h("button", { class: "danger", id: "stop", onclick: stopClicked }, "Stop after the current trial") : null;
    fill(byId("run-head"),
      h("h1", {}, "run ", h("span", { class: "tag" }, summary.run), " ", h("span", { class: "pill " + status }, status),
        " ", stopButton, h("span", { id: "stop-msg", class: "msg" })),
      h("div", { class: "muted" }, "branch ", h("code", {}, summary.branch || "–"),
        controller ? " · controller pid " + controller.pid + " runs '" + (controller.tag || "?") + "'" : " · no controller running in this project",
        summary.host ? " · host " + summary.host : "", summary.gpu ? " · " + summary.gpu : ""),
      status === "paused" ? h("div", { class: "banner bad", id: "pause" }, "Paused: ", summary.pause_reason || "") : null,
      summary.stop_requested ? h("div", { class: "banner" }, "Stop requested: the run stops after its current trial.") : null,
      ...(summary.outages || []).map((line) => h("div", { class: "banner bad outage" }, "Unavailable: ", line)));
    const cards = [];
    if (best) {
      // One pair, signed as every command signs it (autoloop/review/figures.py): re-measured where it was.
      const change = best.change || {};
      const reMeasured = summary.change_source === "reserve";
      cards.push(stat("baseline → best", fmt(change.baseline !== undefined ? change.baseline : best.baseline_metric) + " → " +
        (reMeasured ? fmt(change.best) : (summary.best_estimate || fmt(best.metric))),
        "trial " + best.baseline_trial + " → trial " + best.best_trial + (reMeasured ? ", re-measured at fresh seeds" : "") +
        (best.description ? ": " + best.description : ""), "wide"));
      cards.push(stat("change vs baseline", summary.change_percent || "–", summary.change_text || "", "gain"));
      if (summary.best_comparison) cards.push(stat("best vs its incumbent", summary.best_comparison, "paired, at the same seeds", "wide text"));
      cards.push(stat("held-out", best.heldout_metric !== null ? fmt(best.heldout_metric) : "–",
        best.baseline_heldout_metric !== null ? "baseline " + fmt(best.baseline_heldout_metric) : "not verified"));
    } else {
      cards.push(stat("best", "–", "no successful trial yet", "wide"));
    }
    cards.push(stat("trials", String(head.trials), [head.discarded + " discarded", head.crashed + " crashed",
      head.invalid + " invalid", head.running ? head.running + " running" : null].filter(Boolean).join(" · ")));
    cards.push(stat("kept", String(head.kept), head.keep_rate !== null ? pct(head.keep_rate) + " of " + head.decided + " decided" : ""));
    cards.push(stat("trials / hour", summary.trials_per_hour !== null ? summary.trials_per_hour.toFixed(1) : "–",
      head.compute_hours.toFixed(2) + " " + head.compute + " hours"));
    if (head.cost) cards.push(stat("spent", usd(head.cost.spent_usd), costNote(head.cost)));
    cards.push(stat("noise", summary.noise || "not measured yet", summary.decision_rule ? "rule: " + summary.decision_rule : "", "wide text"));
    // The scale ladder (--ladder): what the best is worth at each rung, and which kept changes held there.
    (summary.ladder || []).forEach((rung) => cards.push(stat("at " + rung.spec, rung.headline, rung.tags, "wide text ladder")));
    fill(byId("stats"), cards);
    renderSeedForm();
    fill(byId("err-summary"));
  }

  let stopArmed = false;
  async function stopClicked(event) {
    const button = event.target;
    if (!stopArmed) { stopArmed = true; button.textContent = "Really stop? Click again"; setTimeout(() => { stopArmed = false; }, 5000); return; }
    stopArmed = false;
    button.disabled = true;
    const msg = byId("stop-msg");
    try {
      const reply = await post(runApi("stop"), {});
      fill(msg, reply.message); msg.className = "msg ok";
    } catch (e) { fill(msg, "error: " + e.message); msg.className = "msg err"; button.disabled = false; }
  }

  function showProgress(p) {
    progressChart(byId("progress"), p, state.summary);
    if (p.left_out) byId("progress").append(h("p", { class: "muted" }, "The first " + p.left_out + " trials are left out of the chart."));
    fill(byId("err-progress"));
  }

  function showLive(data) {
    const el = byId("live");
    const running = data.running || [];
    for (const name of Object.keys(state.charts)) if (name.startsWith("live-") && !running.some((r) => "live-" + r.number === name)) {
      state.charts[name].destroy(); delete state.charts[name];
    }
    const again = data.remeasuring;
    if (!running.length && again) {
      fill(el, h("p", { id: "remeasuring" }, "Re-measuring the best (trial " + again.trial + ") at fresh seeds for the reported figures: " +
        again.done + " of " + again.of + " runs done."));
      return;
    }
    if (!running.length) { fill(el, h("p", { class: "muted", id: "nothing-running" }, "Nothing is running.")); return; }
    const cards = running.map((r) => {
      const card = byId("live-card-" + r.number) || h("div", { class: "card", id: "live-card-" + r.number, data: { trial: r.number } },
        h("h3", { class: "title" }), h("div", { class: "what" }), h("div", { class: "meta" }), h("div", { class: "chart" }));
      const left = r.steps_left !== null ? r.steps_left + " steps left"
        : r.seconds_left !== null ? dur(r.seconds_left) + " of training left" : null;
      fill(card.querySelector(".title"), r.worker ? "[" + r.worker + "] " : "",
        h("a", { href: trialHref(r.number) }, "trial " + r.number), " · " + r.kind);
      fill(card.querySelector(".what"), r.description || "");
      fill(card.querySelector(".meta"), [r.step !== null ? "step " + r.step : "starting",
        r.loss !== null ? "loss " + fmt(r.loss) : null, left, r.seed !== null ? "seed " + r.seed : null,
        r.runs_done ? r.runs_done + " run(s) done" : null, r.elapsed_seconds !== null ? dur(r.elapsed_seconds) + " elapsed" : null,
        r.measuring ? "measuring " + r.measuring : null].filter(Boolean).join(" · "));
      return { card: card, r: r };
    });
    fill(el, cards.map((c) => c.card));
    for (const { card, r } of cards) {
      const ref = r.reference;
      const refLabel = ref ? "incumbent #" + ref.trial + (ref.seed !== null ? " (seed " + ref.seed + ")" : " (its last run)") : "";
      curveChart("live-" + r.number, card.querySelector(".chart"), r.curve || [], ref ? ref.points : null,
        "trial " + r.number, refLabel, 160);
    }
    fill(byId("err-live"));
  }

  function showEvents(events) {
    const el = byId("events");
    if (!events.length) { fill(el, h("p", { class: "muted" }, "No events: no pause, drift, overfitting or lost worker so far.")); return; }
    fill(el, h("ul", { class: "events" }, events.map((e) => h("li", { data: { event: e.id } },
      h("span", { class: "kind" }, e.kind), e.trial !== null ? h("a", { href: trialHref(e.trial) }, "#" + e.trial + " ") : null,
      e.message || "", h("span", { class: "when" }, ago(e.created_at))))));
    fill(byId("err-events"));
  }

  function showIdeas(data) {
    fill(byId("ideas-count"), data.pending ? data.pending + " waiting" : "");
    const rows = data.queue.map((i) => h("tr", { data: { idea: i.id } }, h("td", { class: "num" }, String(i.priority)),
      h("td", { class: "desc" }, i.text), h("td", {}, h("code", {},
        [...(i.has_patch ? ["patch"] : []), ...Object.entries(i.sets || {}).map(([k, v]) => k + "=" + v)].join(", ") || "text only"))));
    const recent = data.recent.map((i) => h("li", {}, h("a", { href: trialHref(i.trial) }, "#" + i.trial), " ", statusSpan(i.trial_status || ""),
      i.trial_delta !== null ? " " + signed(i.trial_delta) + " " : " ", i.text));
    fill(byId("ideas"),
      rows.length ? h("table", {}, h("thead", {}, h("tr", {}, h("th", { class: "num" }, "prio"), h("th", {}, "idea"), h("th", {}, "edit"))),
        h("tbody", {}, rows)) : h("p", { class: "muted" }, "The queue is empty: the proposers decide what comes next."),
      recent.length ? [h("div", { class: "muted" }, "latest ideas tried"), h("ul", { class: "events" }, recent)] : null);
    fill(byId("err-ideas"));
  }

  function renderSeedForm() {
    const el = byId("seed");
    if (!el) return;
    if (!state.session.can_write) {
      if (!el.dataset.readonly) fill(el, h("p", { class: "muted" }, "To seed ideas and stop the run from here, open the link `autoloop serve` printed (it ends in ?token=…)."));
      el.dataset.readonly = "1";
      return;
    }
    if (el.dataset.form) return;
    el.dataset.form = "1";
    delete el.dataset.readonly;
    const description = h("input", { name: "description", placeholder: "what to try, in a sentence", required: true });
    const sets = h("textarea", { name: "sets", rows: 2, placeholder: "NAME=VALUE, one per line (like --set), e.g. MATRIX_LR=0.03" });
    const patch = h("textarea", { name: "patch", rows: 3, class: "mono", placeholder: "or a unified diff against train.py (optional)" });
    const priority = h("input", { name: "priority", type: "number", value: "0", style: null });
    priority.className = "mono";
    const onlyThis = h("input", { type: "checkbox", name: "only" });
    const msg = h("div", { class: "msg", id: "seed-msg" });
    const form = h("form", { class: "seed", id: "seed-form", onsubmit: async (event) => {
      event.preventDefault();
      fill(msg, "checking…"); msg.className = "msg";
      try {
        const reply = await post("/api/seed", { description: description.value,
          sets: sets.value.split("\n").map((x) => x.trim()).filter(Boolean), patch: patch.value.trim() ? patch.value : null,
          priority: Number(priority.value || 0), tag: onlyThis.checked ? state.tag : null });
        fill(msg, reply.message); msg.className = "msg ok";
        description.value = ""; sets.value = ""; patch.value = "";
      } catch (e) { fill(msg, "error: " + e.message); msg.className = "msg err"; }
    } },
    h("strong", {}, "Seed an idea"), description, sets, patch,
    h("div", { class: "row" }, h("label", {}, "priority ", priority), h("label", {}, onlyThis, " only this run"),
      h("button", { type: "submit" }, "Seed")), msg);
    fill(el, form);
  }

  function loadTrials() { state.hashes.trials = null; return loadParts(["trials"]); }
  function showTrials(page) {
    fill(byId("trials-count"), page.total + (state.status || state.parent ? " matching" : ""));
    const statusPick = h("select", { "aria-label": "status", onchange: (e) => { state.status = e.target.value; state.offset = 0; once("trials", loadTrials); } },
      h("option", { value: "" }, "every status"), STATUSES.map((st) => h("option", { value: st, selected: st === state.status }, st)));
    const first = page.total ? page.offset + 1 : 0, last = Math.min(page.offset + page.rows.length, page.total);
    const go = (offset) => () => { state.offset = Math.max(0, offset); once("trials", loadTrials); };
    fill(byId("trials-controls"), h("div", { class: "pager" }, statusPick,
      state.parent ? h("span", { class: "pill" }, "proposed from " + state.parent.slice(0, 10) + " ",
        h("a", { href: runHref(state.tag) }, "✕")) : null,
      h("button", { onclick: go(0), disabled: page.offset === 0 }, "newest"),
      h("button", { onclick: go(page.offset - page.limit), disabled: page.offset === 0 }, "‹ newer"),
      h("span", { class: "muted" }, first + "–" + last + " of " + page.total),
      h("button", { onclick: go(page.offset + page.limit), disabled: last >= page.total }, "older ›"),
      h("button", { onclick: go(Math.floor((page.total - 1) / page.limit) * page.limit), disabled: last >= page.total }, "oldest")));
    const rows = page.rows.map((t) => {
      let delta = signed(t.delta);
      if (t.near_miss) delta += "~"; else if (t.distinguishable === false) delta += "≈";
      return h("tr", { class: "clickable", data: { trial: t.number }, onclick: () => { location.hash = trialHref(t.number); } },
        h("td", { class: "num" }, h("a", { href: trialHref(t.number) }, String(t.number))),
        h("td", {}, t.kind), h("td", {}, statusCell(t), t.flagged ? " ⚑" : ""),
        h("td", { class: "num" }, t.estimate || "–"), h("td", { class: "num " + deltaClass(t.delta) }, delta),
        h("td", { class: "num" }, t.minutes !== null ? t.minutes.toFixed(1) : "–"),
        h("td", { class: "desc" }, h("div", { class: "description" }, t.description || ""), t.reason ? h("div", { class: "reason" }, t.reason) : null),
        h("td", {}, t.worker || (t.lineage !== "main" ? t.lineage : "")));
    });
    fill(byId("trials"), h("table", { id: "trials-table" }, h("thead", {}, h("tr", {},
      h("th", { class: "num" }, "#"), h("th", {}, "kind"), h("th", {}, "status"), h("th", { class: "num" }, "val_bpb"),
      h("th", { class: "num" }, "Δ"), h("th", { class: "num" }, "min"), h("th", {}, "description / reason"), h("th", {}, "worker"))),
      h("tbody", {}, rows)),
      h("p", { class: "muted" }, "Δ: against the incumbent of its time (negative is better); ≈ within the noise; ~ near miss; ⚑ the curve was flagged."));
    fill(byId("err-trials"));
  }

  // ------------------------------------------------------------------ the tree

  function renderTreePage() {
    fill(main, h("div", { id: "page-error" }), h("h1", {}, "experiment tree ", h("span", { class: "tag" }, state.tag)),
      h("p", { class: "muted" }, "Every trial under the commit it was proposed from: kept trials continue the trunk, the rest hang below " +
        "their parent as leaves (newest first), islands are lanes. Click a node for its trial."),
      h("div", { class: "legend" }, ["baseline", "keep", "discard", "crash", "timeout", "invalid", "interrupted", "running", "drift", "ablation"]
        .map((k) => h("span", {}, h("span", { class: "sw " + k }), k))),
      h("div", { id: "err-tree" }), h("div", { class: "tree-wrap", id: "tree" }, h("p", { class: "muted" }, "loading…")),
      h("p", { class: "muted", id: "tree-note" }));
  }

  async function loadTree() {
    const t = await api(runApi("tree"));
    const root = s("svg", { width: t.width, height: t.height, viewBox: "0 0 " + t.width + " " + t.height, id: "tree-svg" });
    for (const lane of t.lanes) root.append(s("text", { x: 6, y: lane.y + 4, "font-size": 12, fill: "#656d76" }, lane.name));
    for (const e of t.edges) {
      const colour = e.kind === "trunk" ? "#1a9850" : e.kind === "lane" ? "#2c7fb8" : "#c8ccd1";
      root.append(s("line", { x1: e.x1, y1: e.y1, x2: e.x2, y2: e.y2, stroke: colour, "stroke-width": e.kind === "trunk" ? 2.5 : 1.2,
        "stroke-dasharray": e.kind === "lane" ? "4 3" : null }));
    }
    for (const n of t.nodes) {
      const circle = s("circle", { cx: n.x, cy: n.y, r: n.r, fill: n.fill, stroke: n.keep ? "#1f2328" : n.ghost ? "#2c7fb8" : null,
        "stroke-width": n.keep ? 0.8 : n.ghost ? 1.2 : null, data: { status: n.status } }, s("title", {}, n.title));
      root.append(n.number !== null && !n.ghost ? s("a", { href: trialHref(n.number), data: { trial: n.number } }, circle) : circle);
      if (n.label) {
        const x = n.x + 4, y = n.y - 11;
        root.append(s("text", { x: x, y: y, "font-size": 11, fill: "#1f2328", transform: "rotate(-40 " + x + " " + y + ")" }, n.label));
      }
    }
    for (const m of t.more) {
      const label = s("text", { x: m.x, y: m.y + 8, "font-size": 10, fill: "#0969da", "text-anchor": "middle" }, "+" + m.count,
        s("title", {}, m.count + " more trials proposed from this commit: list them"));
      root.append(m.parent ? s("a", { href: runHref(state.tag, "?parent=" + encodeURIComponent(m.parent)) }, label) : label);
    }
    fill(byId("tree"), root);
    fill(byId("tree-note"), t.trials + " trials, " + t.keeps + " kept" + (t.hidden_keeps ? "; the " + t.hidden_keeps + " oldest kept commits are not drawn" : "")
      + "; at most " + t.leaf_cap + " leaves per commit are drawn.");
    fill(byId("err-tree"));
  }

  // ------------------------------------------------------------------ one trial

  function renderTrialPage() {
    fill(main, h("div", { id: "page-error" }), h("p", {}, h("a", { href: runHref(state.tag) }, "← run " + state.tag), " · ",
      h("a", { href: trialHref(Math.max(1, state.number - 1)) }, "‹ previous"), " · ", h("a", { href: trialHref(state.number + 1) }, "next ›")),
    h("div", { id: "err-trial" }), h("div", { id: "trial-head" }), h("div", { id: "trial-chart", class: "chart" }),
    h("h2", {}, "What `autoloop show " + state.number + "` shows"), h("pre", { class: "block", id: "trial-text" }),
    h("h2", {}, "Diff"), h("div", { id: "trial-diff" }), h("h2", {}, "Log"), h("div", { id: "trial-log" }));
  }

  function diffBlock(text) {
    const pre = h("pre", { class: "block diff", id: "diff" });
    for (const line of text.replace(/\n$/, "").split("\n")) {
      const cls = line.startsWith("+++") || line.startsWith("---") || line.startsWith("diff ") ? "file"
        : line.startsWith("+") ? "add" : line.startsWith("-") ? "del" : line.startsWith("@@") ? "hunk" : null;
      pre.append(h("span", { class: cls }, line), "\n");
    }
    return pre;
  }

  async function loadTrial() {
    const t = await api(runApi("trials/" + state.number));
    fill(byId("trial-head"), h("h1", {}, "trial " + t.number + " ", h("span", { class: "muted" }, "[" + t.kind + "] "), statusCell(t)),
      t.description ? h("p", { class: "description" }, t.description) : null);
    const ref = t.reference;
    curveChart("trial", byId("trial-chart"), t.curve || [], ref ? ref.points : null, "trial " + t.number,
      ref ? "incumbent #" + ref.trial + (ref.seed !== null ? " (seed " + ref.seed + ")" : "") : "", 220);
    fill(byId("trial-text"), t.text);
    fill(byId("trial-diff"), t.diff ? [diffBlock(t.diff), t.diff_cut ? h("p", { class: "muted" }, "The diff is cut here: `autoloop diff " + t.number + "` has all of it.") : null]
      : h("p", { class: "muted" }, "No diff: " + (t.no_diff || "")));
    const log = t.log_tail && t.log_tail.length ? t.log_tail.join("\n") : t.error_tail;
    fill(byId("trial-log"), log ? [h("p", { class: "muted" }, t.log_file ? "last lines of " + t.log_file : "error tail"),
      h("pre", { class: "block", id: "log" }, log)] : h("p", { class: "muted" }, "No log."));
    fill(byId("err-trial"));
  }

  // ------------------------------------------------------------------ start

  window.addEventListener("hashchange", route);
  window.addEventListener("resize", () => {
    for (const [name, chart] of Object.entries(state.charts)) {
      const el = chart.root.parentNode;
      if (el) chart.setSize({ width: chartWidth(el), height: chart.height });
    }
  });
  api("/api/session").then((session) => { state.session = session; }).catch(() => {}).finally(route);
})();
