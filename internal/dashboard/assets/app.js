"use strict";
// prefixlb dashboard: polls state.json every second and redraws. No
// libraries; charts are inline SVG. Errors are shown in #errors (and the
// browser tests read them there).
(function () {
  const POLL_MS = 1000;
  const HISTORY = 120; // samples kept for the charts (two minutes)
  const PALETTE = ["#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
    "#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac"];
  const BRANCH_COLORS = { exploit: "#59a14f", explore: "#4e79a7", mixing: "#edc948", rebalance: "#e15759" };
  const SVGNS = "http://www.w3.org/2000/svg";

  const $ = (id) => document.getElementById(id);
  const errors = [];
  function showError(msg) {
    errors.push(String(msg));
    const el = $("errors");
    el.hidden = false;
    el.textContent = errors.slice(-5).join("\n");
  }
  window.addEventListener("error", (e) => showError("error: " + e.message));
  window.addEventListener("unhandledrejection", (e) => showError("error: " + e.reason));

  // The admin token, when the router has one, comes in the page's URL
  // (?token=...) and goes to state.json as a bearer token.
  const token = new URLSearchParams(location.search).get("token");
  const headers = token ? { Authorization: "Bearer " + token } : {};

  const replicaColor = {};
  function colorOf(name) {
    if (!(name in replicaColor)) replicaColor[name] = PALETTE[Object.keys(replicaColor).length % PALETTE.length];
    return replicaColor[name];
  }
  const branchColor = {};
  function colorOfBranch(b) {
    if (!(b in branchColor)) branchColor[b] = BRANCH_COLORS[b] || PALETTE[(Object.keys(branchColor).length + 5) % PALETTE.length];
    return branchColor[b];
  }

  // History of the charted series: name -> array of [t, v].
  const hist = { inflight: {}, branches: {}, cache: {}, hit: {}, queue: {} };
  function push(group, name, t, v) {
    const s = group[name] || (group[name] = []);
    s.push([t, v]);
    if (s.length > HISTORY) s.shift();
  }
  let prevCache = null;
  let prevPlacement = null; // prefix id -> assigned names
  let prevUp = null;        // replica -> up

  function el(tag, props, ...children) {
    const e = document.createElement(tag);
    if (props) for (const [k, v] of Object.entries(props)) {
      if (k === "class") e.className = v; else if (k === "dataset") Object.assign(e.dataset, v); else e[k] = v;
    }
    for (const c of children) e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    return e;
  }
  function svg(tag, attrs) {
    const e = document.createElementNS(SVGNS, tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    return e;
  }
  function bar(frac, text) {
    const inner = el("span");
    inner.style.width = Math.round(Math.max(0, Math.min(1, frac)) * 100) + "%";
    return el("td", { class: "num" }, el("span", { class: "bar" }, inner), text);
  }
  const num = (v, d) => (v < 0 ? "?" : Number(v).toFixed(d || 0));
  const pct = (v) => (v < 0 ? "?" : (100 * v).toFixed(0) + "%");
  function human(n) {
    if (n >= 1e9) return (n / 1e9).toFixed(2) + "G";
    if (n >= 1e6) return (n / 1e6).toFixed(2) + "M";
    if (n >= 1e4) return (n / 1e3).toFixed(1) + "k";
    return String(n);
  }

  // niceStep returns the y-axis step for values up to max: the smallest
  // 1, 2 or 5 × 10^k giving at most four steps (at least 1 for a series of
  // integers), so that ticks are round numbers and no two read the same.
  function niceStep(max, integer) {
    const raw = max / 4;
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    let step = 10 * mag;
    for (const m of [1, 2, 5]) if (m * mag >= raw * (1 - 1e-9)) { step = m * mag; break; }
    return integer ? Math.max(1, Math.round(step)) : step;
  }
  // tickLabel formats tick v of a scale with step: with as many decimals as
  // the step needs (so adjacent ticks differ), in k or M when the top is
  // large, as a percentage for a ratio, with the unit appended.
  function tickLabel(v, step, top, opts) {
    let div = 1, suffix = "";
    if (opts.percent) { div = 0.01; suffix = "%"; }
    else if (top >= 1e6) { div = 1e6; suffix = "M"; }
    else if (top >= 1e4) { div = 1e3; suffix = "k"; }
    const decimals = Math.max(0, -Math.floor(Math.log10(step / div) + 1e-9));
    if (v === 0) return (opts.percent ? "0%" : "0") + (opts.unit || ""); // not "0.00k"
    return (v / div).toFixed(decimals) + suffix + (opts.unit || "");
  }

  // lineChart draws series (name -> [[t,v]]) into an SVG with a y axis from
  // 0. opts: max (a fixed top), integer (integer series: integer ticks),
  // percent (ratios in [0,1] shown as %), unit (appended to ticks), fmt
  // (formats a legend's latest value), dashed (name -> dashed line).
  function lineChart(root, legend, series, colorFn, opts) {
    const W = 560, H = Number(root.getAttribute("viewBox").split(" ")[3]), L = 48, R = 8, T = 8, B = 18;
    root.replaceChildren();
    let tmin = Infinity, tmax = -Infinity, vmax = 0;
    for (const pts of Object.values(series)) for (const [t, v] of pts) {
      tmin = Math.min(tmin, t); tmax = Math.max(tmax, t); vmax = Math.max(vmax, v);
    }
    if (!isFinite(tmin)) { tmin = 0; tmax = 1; }
    if (tmax - tmin < 10000) tmin = tmax - 10000;
    if (!(vmax > 0)) vmax = 1;
    if (opts.max) vmax = opts.max;
    const step = opts.max ? opts.max / 4 : niceStep(vmax, opts.integer);
    const n = Math.max(1, Math.ceil(vmax / step - 1e-9));
    const top = n * step;
    const sx = (t) => L + (t - tmin) / (tmax - tmin) * (W - L - R);
    const sy = (v) => H - B - v / top * (H - T - B);
    for (let i = 0; i <= n; i++) {
      const v = i * step, y = sy(v);
      root.append(svg("line", { x1: L, x2: W - R, y1: y, y2: y, class: "grid" }));
      const lab = svg("text", { x: L - 4, y: y + 3, "text-anchor": "end", class: "axis ytick" });
      lab.textContent = tickLabel(v, step, top, opts);
      root.append(lab);
    }
    const ago = svg("text", { x: L, y: H - 4, class: "axis" });
    ago.textContent = "−" + Math.round((tmax - tmin) / 1000) + " s";
    const now = svg("text", { x: W - R, y: H - 4, "text-anchor": "end", class: "axis" });
    now.textContent = "now";
    root.append(ago, now);
    legend.replaceChildren();
    for (const [name, pts] of Object.entries(series)) {
      if (pts.length === 0) continue;
      const color = colorFn(name);
      const d = pts.map(([t, v], i) => (i ? "L" : "M") + sx(t).toFixed(1) + " " + sy(v).toFixed(1)).join(" ");
      const p = svg("path", { d: d, fill: "none", stroke: color, "stroke-width": 2, "data-series": name });
      if (opts.dashed && opts.dashed(name)) p.setAttribute("stroke-dasharray", "5 3");
      root.append(p);
      const sw = el("i");
      sw.style.background = color;
      const last = pts[pts.length - 1][1];
      legend.append(el("span", null, sw, name + " " + (opts.fmt ? opts.fmt(last) : last.toFixed(1))));
    }
  }

  // roleBadge names a replica's role in a disaggregated cluster (none for
  // an aggregated replica), with its KV transfers in flight.
  function roleBadge(r) {
    if (!r.role || r.role === "both") return "";
    const text = r.role + (r.transfers > 0 ? " · " + r.transfers + " KV moving" : "");
    return el("span", { class: "tag kind", title: r.role === "prefill" ?
      "prefill replica: runs the prefill leg of disaggregated requests" :
      "decode replica: decodes disaggregated requests from KV it pulls" }, text);
  }

  // kindBadge names a replica's engine, and its slots for a slot cache
  // (llama.cpp: -np prompts cached at a time).
  function kindBadge(r) {
    const known = r.kind && r.kind !== "unknown";
    const text = (known ? r.kind : "kind ?") + (r.slots > 0 ? " · " + r.slots + " slot" + (r.slots === 1 ? "" : "s") : "");
    const title = !known ? "engine kind not detected" : r.slots > 0 ?
      "slot cache: the engine keeps the last prompt of each of its " + r.slots + " slots" : "block cache";
    return el("span", { class: "tag kind" + (known ? "" : " unknown"), title: title }, text);
  }
  // signed formats a token count with its sign: +120, −35, 0.
  function signed(v) {
    const n = Math.round(v);
    return n > 0 ? "+" + human(n) : n < 0 ? "−" + human(-n) : "0";
  }

  // secs formats a time in seconds as [number, unit]: in ms below a
  // second, else in s, to three significant digits.
  function secs(v) {
    if (!(v > 0)) return ["?", ""];
    const ms = v < 0.9995;
    return [String(Number((ms ? 1e3 * v : v).toPrecision(3))), ms ? "ms" : "s"];
  }
  // speedFigure is one priced time, with the profile's beside it when
  // showProfile ("prefill 96 ms/1k (profile 31)"), the unit repeated only
  // when the profile's is another.
  function speedFigure(label, fitted, profile, per, showProfile) {
    const [f, fu] = secs(fitted), [p, pu] = secs(profile);
    return label + " " + f + " " + fu + per + (showProfile ? " (profile " + p + (pu !== fu ? " " + pu : "") + ")" : "");
  }
  // speedRow is the line under a replica's row: the prefill (a cold
  // 1,000-token prompt) and decode step (one sequence, 1,000 tokens of
  // context) the router prices it with, fitted when it calibrates, with
  // the profile's figures and the fit's recent error.
  function speedRow(r, span) {
    const learnt = r.calibrated && r.calibration_samples > 0;
    const part = (text, title) => el("span", title ? { class: "part", title: title } : { class: "part" }, text);
    const parts = [
      part(speedFigure("prefill", r.prefill_s_per_1k, r.profile_prefill_s_per_1k, "/1k", learnt),
        "a cold prefill of 1,000 tokens" + (learnt ? ": fitted (profile " + r.profile + ")" : "")),
      part(speedFigure("decode", r.decode_step_s, r.profile_decode_step_s, "", learnt),
        "one decode step of one sequence with 1,000 tokens of context" + (learnt ? ": fitted (profile " + r.profile + ")" : ""))];
    if (learnt) {
      parts.push(part("fit error " + pct(Math.max(r.prefill_error, r.decode_error)),
        "recent |predicted/observed − 1| of the fit: prefill " + pct(r.prefill_error) + ", decode " + pct(r.decode_error)));
      parts.push(part(human(r.calibration_samples) + " sample" + (r.calibration_samples === 1 ? "" : "s"),
        "prefill and decode observations the fit learnt from"));
      parts.push(part("profile " + (r.profile || "?")));
    } else if (r.calibrated) {
      parts.push(part("learning: no samples yet", "calibrating: the profile's figures until the replica has served requests"));
      parts.push(part("profile " + (r.profile || "?")));
    } else {
      parts.push(part("profile only: " + (r.profile || "?"), "calibration is off: the router prices the replica with its profile"));
    }
    const td = el("td", { colSpan: span }, el("span", { class: "label" }, "speed"), " ");
    parts.forEach((p, i) => td.append(...(i ? [" · ", p] : [p])));
    return el("tr", { class: "speed" + (r.up ? "" : " down"), dataset: { speed: r.name } }, td);
  }

  function renderReplicas(s) {
    const body = $("replicas").tBodies[0];
    const span = $("replicas").tHead.rows[0].cells.length;
    const rows = s.replicas.flatMap((r) => {
      const maxIn = Math.max(1, ...s.replicas.map((x) => x.in_flight));
      const tr = el("tr", { class: r.up ? "up" : "down", dataset: { replica: r.name, up: String(r.up) } },
        el("td", null, r.name, " ", kindBadge(r), roleBadge(r)),
        el("td", null, el("span", { class: "badge " + (r.up ? "up" : "down") }, r.up ? "up" : "down")),
        bar(r.in_flight / maxIn, r.in_flight),
        el("td", { class: "num" }, num(r.waiting)),
        el("td", { class: "num" }, num(r.running)),
        bar(r.kv_usage, pct(r.kv_usage)),
        bar(r.hit_ratio, pct(r.hit_ratio)),
        el("td", { class: "num" }, r.load_seconds.toFixed(3)),
        el("td", { class: "num" }, r.pending_prefill_s.toFixed(3)),
        el("td", { class: "num" }, human(r.cached_blocks)),
        el("td", { class: "num", dataset: { field: "prediction_error_tokens" } }, signed(r.prediction_error_tokens)),
        el("td", { class: "num" }, r.capacity_tokens > 0 ? human(r.capacity_tokens) : "–"),
        el("td", { class: "num" }, r.corrections));
      tr.cells[2].dataset.field = "in_flight";
      return [tr, speedRow(r, span)];
    });
    body.replaceChildren(...rows);
  }

  function logEvent(kind, text, t) {
    const list = $("events");
    list.prepend(el("li", { class: kind }, new Date(t).toLocaleTimeString() + "  " + text));
    while (list.children.length > 100) list.lastChild.remove();
  }

  function renderPrefixes(s, t) {
    const body = $("prefixes").tBodies[0];
    body.replaceChildren(...s.prefixes.map((p) => {
      const assigned = el("td", { class: "chips" });
      for (const n of p.assigned) {
        const c = el("span", { class: "chip" }, n);
        c.style.background = colorOf(n);
        assigned.append(c);
      }
      const cached = el("td", { class: "chips" });
      for (const n of p.cached_on) {
        const c = el("span", { class: "chip cached" }, n);
        c.style.color = colorOf(n);
        cached.append(c);
      }
      return el("tr", { class: p.assigned.length > 1 ? "replicated" : "", dataset: { prefix: p.id } },
        el("td", { title: p.id }, p.id.slice(0, 10)),
        el("td", { class: "num" }, human(p.tokens)),
        el("td", { class: "num" }, p.requests_per_s.toFixed(2)),
        el("td", { class: "num" }, p.requests), assigned, cached);
    }));
    $("prefixes-empty").hidden = s.prefixes.length > 0;
    // Placement changes: replication appearing and disappearing.
    const now = {};
    for (const p of s.prefixes) now[p.id] = p;
    if (prevPlacement) {
      for (const [id, p] of Object.entries(now)) {
        const before = prevPlacement[id];
        if (!before) continue;
        for (const n of p.assigned) if (!before.includes(n))
          logEvent("add", "prefix " + id.slice(0, 10) + " (" + human(p.tokens) + " tok) " +
            (before.length ? "replicated to " : "assigned to ") + n + " → [" + p.assigned.join(", ") + "]", t);
        for (const n of before) if (!p.assigned.includes(n))
          logEvent("remove", "prefix " + id.slice(0, 10) + " left " + n + " → [" + p.assigned.join(", ") + "]", t);
      }
    }
    prevPlacement = {};
    for (const [id, p] of Object.entries(now)) prevPlacement[id] = p.assigned.slice();
    const ups = {};
    for (const r of s.replicas) {
      ups[r.name] = r.up;
      if (prevUp && r.name in prevUp && prevUp[r.name] !== r.up)
        logEvent(r.up ? "add" : "down", "replica " + r.name + (r.up ? " is back up" : " went down"), t);
    }
    prevUp = ups;
  }

  function renderRecent(s) {
    $("recent").tBodies[0].replaceChildren(...s.recent.slice(0, 25).map((d) =>
      el("tr", null,
        el("td", null, new Date(d.time).toLocaleTimeString()),
        el("td", null, d.replica),
        el("td", null, d.branch),
        el("td", { class: "num" }, d.matched_tokens + " / " + d.prompt_tokens),
        el("td", { class: "explain" }, d.explain))));
  }

  // renderQueue shows the router-side queue (absent when it is off): what
  // waits now per priority and tenant, and the requests shed by reason.
  function renderQueue(s, t) {
    const q = s.queue;
    $("queue-card").hidden = !q;
    if (!q) return;
    $("queue-state").textContent = q.saturated ? "saturated: arrivals wait" : "not saturated: requests pass";
    $("queue-waiting").textContent = human(q.waiting);
    $("queue-dispatched").textContent = human(q.dispatched);
    const shed = Object.values(q.shed || {}).reduce((a, b) => a + b, 0);
    $("queue-shed").textContent = human(shed);
    $("queue-flows").tBodies[0].replaceChildren(...q.flows.slice(0, 20).map((f) =>
      el("tr", null,
        el("td", { class: "num" }, String(f.priority)),
        el("td", null, f.tenant),
        el("td", { class: "num" }, String(f.waiting)),
        el("td", { class: "num" }, f.oldest_wait_s.toFixed(2)))));
    $("queue-shed-reasons").textContent = "shed by reason: " + Object.entries(q.shed || {}).map(([r, n]) => r + " " + n).join(" · ") +
      " · cancelled " + q.cancelled + " · passed " + q.passed;
    const byPrio = {};
    for (const f of q.flows) byPrio["priority " + f.priority] = (byPrio["priority " + f.priority] || 0) + f.waiting;
    for (const n of Object.keys(hist.queue)) if (!(n in byPrio)) push(hist.queue, n, t, 0);
    for (const [n, v] of Object.entries(byPrio)) push(hist.queue, n, t, v);
    lineChart($("chart-queue"), $("legend-queue"), hist.queue, colorOf, { integer: true, fmt: (v) => v.toFixed(0) });
  }

  function render(s) {
    const t = Date.parse(s.time) || Date.now();
    $("policy").textContent = "policy " + s.policy;
    $("totals").textContent = "routed " + s.totals.routed + " · in flight " + s.totals.in_flight +
      " · finished " + s.totals.finished + " · failed " + s.totals.failed;
    $("updated").textContent = "updated " + new Date(t).toLocaleTimeString();
    renderReplicas(s);
    renderPrefixes(s, t);
    renderRecent(s);
    renderQueue(s, t);
    for (const r of s.replicas) {
      push(hist.inflight, r.name, t, r.in_flight);
      push(hist.hit, r.name, t, r.hit_ratio);
    }
    const seen = new Set(Object.keys(s.branches));
    for (const b of Object.keys(hist.branches)) if (!seen.has(b)) push(hist.branches, b, t, 0);
    for (const [b, v] of Object.entries(s.branches)) push(hist.branches, b, t, v);
    $("rate-total").textContent = s.decisions_per_s.toFixed(1) + " decisions/s (last " + s.rate_window_s.toFixed(0) + " s)";
    const c = s.cache_prediction;
    $("cache-predicted").textContent = human(c.predicted_tokens);
    $("cache-reported").textContent = human(c.reported_tokens);
    $("cache-exact").textContent = c.checked ? pct(c.exact_ratio) : "–";
    if (prevCache) {
      const dt = Math.max((t - prevCache.t) / 1000, 1e-3);
      push(hist.cache, "predicted", t, Math.max(0, c.predicted_tokens - prevCache.p) / dt);
      push(hist.cache, "reported", t, Math.max(0, c.reported_tokens - prevCache.r) / dt);
    }
    prevCache = { t: t, p: c.predicted_tokens, r: c.reported_tokens };
    lineChart($("chart-inflight"), $("legend-inflight"), hist.inflight, colorOf, { integer: true, fmt: (v) => v.toFixed(0) });
    lineChart($("chart-branches"), $("legend-branches"), hist.branches, colorOfBranch, { unit: "/s", fmt: (v) => v.toFixed(1) + "/s" });
    lineChart($("chart-cache"), $("legend-cache"), hist.cache,
      (n) => (n === "predicted" ? "#4e79a7" : "#f28e2b"), { unit: "/s", fmt: (v) => human(Math.round(v)) + "/s", dashed: (n) => n === "predicted" });
    lineChart($("chart-hit"), $("legend-hit"), hist.hit, colorOf, { max: 1, percent: true, fmt: (v) => (100 * v).toFixed(0) + "%" });
    const app = $("app");
    app.dataset.updates = String(Number(app.dataset.updates) + 1);
  }

  async function poll() {
    try {
      const resp = await fetch("state.json", { headers: headers, cache: "no-store" });
      if (!resp.ok) throw new Error("state.json: HTTP " + resp.status);
      render(await resp.json());
      $("status").className = "status ok";
      $("status").textContent = "live";
    } catch (e) {
      $("status").className = "status err";
      $("status").textContent = String(e.message || e);
    } finally {
      setTimeout(poll, POLL_MS);
    }
  }
  poll();
})();
