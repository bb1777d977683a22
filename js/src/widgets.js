// Genie widgets: one ES module for anywidget. The pure functions (formatting, colours, the
// sparkline's points, event filtering) are exported for node's test runner; `render` draws.

export function formatBytes(n) {
  if (n === null || n === undefined) return "unknown";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i >= 3 ? 1 : 0)} ${units[i]}`;
}

export function formatNumber(value, unit, digits = 0) {
  return value === null || value === undefined ? "unknown" : `${Number(value).toFixed(digits)}${unit}`;
}

export function level(pct) {
  if (pct === null || pct === undefined) return "unknown";
  return pct >= 90 ? "high" : pct >= 70 ? "warm" : "ok";
}

export function gaugeRows(gpu) {
  const mem = gpu.memory_total ? (100 * gpu.memory_used) / gpu.memory_total : null;
  const temp = gpu.temperature;
  const tempPct = temp === null || temp === undefined ? null : (100 * temp) / (gpu.temperature_slowdown || 90);
  const power = gpu.power_draw !== null && gpu.power_draw !== undefined && gpu.power_limit ? (100 * gpu.power_draw) / gpu.power_limit : null;
  return [
    { name: "utilization", pct: gpu.utilization ?? null, text: formatNumber(gpu.utilization, "%") },
    { name: "memory", pct: mem, text: gpu.memory_total ? `${formatBytes(gpu.memory_used)} / ${formatBytes(gpu.memory_total)}` : "unknown" },
    { name: "temperature", pct: tempPct, text: formatNumber(temp, " °C") },
    { name: "power", pct: power, text: power === null ? "unknown" : `${formatNumber(gpu.power_draw, " W")} / ${formatNumber(gpu.power_limit, " W")}` },
  ];
}

// Points of an SVG polyline for values in [0, top], oldest first, in a width x height box.
export function sparklinePoints(values, width, height, top = 100) {
  const finite = values.filter((v) => Number.isFinite(v));
  if (finite.length < 2) return "";
  const step = width / (values.length - 1);
  return values
    .map((v, i) => (Number.isFinite(v) ? `${(i * step).toFixed(1)},${(height - (Math.min(v, top) / top) * height).toFixed(1)}` : null))
    .filter(Boolean)
    .join(" ");
}

// History arrives as a little-endian float32 buffer of shape [gpus, metrics, points]; NaN = no reading.
export function historySeries(buffer, shape, gpu, metric) {
  const [, metrics, points] = shape;
  if (!buffer || !points) return [];
  const view = new Float32Array(buffer.buffer ?? buffer, buffer.byteOffset ?? 0, (buffer.byteLength ?? buffer.length) / 4);
  const start = (gpu * metrics + metric) * points;
  return Array.from(view.subarray(start, start + points));
}

// "-5 min", "-30 s", "now": how long before the newest reading a point of the history chart is.
export function timeLabel(secondsAgo) {
  if (secondsAgo < 0.5) return "now";
  if (secondsAgo < 90) return `-${Math.round(secondsAgo)} s`;
  const minutes = secondsAgo / 60;
  return `-${Number.isInteger(Math.round(minutes * 10) / 10) ? Math.round(minutes) : minutes.toFixed(1)} min`;
}

// Who holds a GPU, one line per process (named by its session when it is one).
export function processLines(gpu) {
  return (gpu.processes || []).map((p) => {
    const mem = p.memory_used === null || p.memory_used === undefined ? "memory unknown" : formatBytes(p.memory_used);
    const sm = p.sm_util === null || p.sm_util === undefined ? "" : ` · SM ${Math.round(p.sm_util)}%`;
    const who = p.session ? `session ${p.name ? `'${p.name}'` : p.session} (${p.user || "?"}@${p.host || "?"})` : "not a genie session";
    return `pid ${p.pid} · ${mem}${sm} · ${who}`;
  });
}

export function visibleEvents(events, filter, limit = 200) {
  const wanted = (filter || "").split(",").map((s) => s.trim().toUpperCase()).filter(Boolean);
  return events.filter((e) => wanted.length === 0 || wanted.includes(e.type)).slice(0, limit);
}

export function ago(seconds) {
  if (seconds < 60) return `${Math.round(seconds)} s ago`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
  return `${Math.round(seconds / 3600)} h ago`;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v; else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : document.createTextNode(String(c)));
  return node;
}

const SVG = "http://www.w3.org/2000/svg";

function svg(tag, attrs = {}, text = null) {
  const node = document.createElementNS(SVG, tag);
  for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
  if (text !== null) node.textContent = text;
  return node;
}

// The last minutes of a GPU's utilization and memory (percent), with axes and units, as
// jupyterlab-nvdashboard draws them. `span`: seconds from the oldest point to the newest.
function historyChart(gpu, series, span) {
  const [W, H, left, right, top, bottom] = [420, 120, 40, 8, 8, 20];
  const w = W - left - right, h = H - top - bottom;
  const chart = svg("svg", { viewBox: `0 0 ${W} ${H}`, class: "genie-chart", role: "img",
    "aria-label": `GPU ${gpu.index}: utilization and memory, last ${timeLabel(span).replace("-", "")}` });
  for (const pct of [0, 50, 100]) {
    const y = top + h - (pct / 100) * h;
    chart.append(svg("line", { x1: left, x2: left + w, y1: y, y2: y, class: "genie-grid" }));
    chart.append(svg("text", { x: left - 4, y: y + 4, "text-anchor": "end", class: "genie-axis" }, `${pct}%`));
  }
  [[0, span], [0.5, span / 2], [1, 0]].forEach(([at, ago]) => {
    chart.append(svg("text", { x: left + at * w, y: H - 4, "text-anchor": at === 0 ? "start" : at === 1 ? "end" : "middle",
      class: "genie-axis" }, timeLabel(ago)));
  });
  const plot = svg("g", { transform: `translate(${left},${top})` });
  series.forEach(({ name, values }) => plot.append(svg("polyline", { points: sparklinePoints(values, w, h), class: `genie-series genie-series-${name}` })));
  chart.append(plot);
  const legend = svg("text", { x: left + w, y: top + 10, "text-anchor": "end", class: "genie-axis" });
  for (const { name } of series) legend.append(svg("tspan", { class: `genie-legend-${name}`, dx: 8 }, `— ${name}`));
  chart.append(legend);
  return chart;
}

function drawGauges(model) {
  const gpus = model.get("gpus") || [];
  const box = el("section", { class: "genie-gauges", "aria-label": "GPU gauges" });
  if (gpus.length === 0) {
    box.append(el("p", { class: "genie-muted" }, `CPU-only server: ${model.get("cpu_only_reason") || "no GPU"}`));
    return box;
  }
  const shape = model.get("history_shape") || [0, 0, 0];
  const history = model.get("history");
  gpus.forEach((gpu, g) => {
    const card = el("div", { class: `genie-gauge${gpu.lost ? " genie-lost" : ""}`, "data-gpu": String(gpu.index) });
    card.append(el("div", { class: "genie-gauge-title" }, `GPU ${gpu.index} · ${gpu.name || "unknown"}`));
    if (gpu.lost) card.append(el("div", { class: "genie-bad" }, "cannot be read (fallen off the bus?)"));
    gaugeRows(gpu).forEach((row, m) => {
      const bar = el("div", { class: "genie-bar", role: "meter", "aria-label": `GPU ${gpu.index} ${row.name}`,
        "aria-valuemin": "0", "aria-valuemax": "100", "aria-valuenow": row.pct === null ? "0" : String(Math.round(row.pct)) });
      bar.append(el("div", { class: `genie-fill genie-${level(row.pct)}`, style: `width:${row.pct === null ? 0 : Math.min(100, row.pct)}%` }));
      card.append(el("div", { class: "genie-row" }, el("span", { class: "genie-label" }, row.name), bar,
        el("span", { class: "genie-value", "data-metric": row.name }, row.text)));
    });
    if (shape[2] > 0 && shape[1] >= 2) {
      card.append(historyChart(gpu, [
        { name: "utilization", values: historySeries(history, shape, g, 0) },
        { name: "memory", values: historySeries(history, shape, g, 1) },
      ], model.get("history_span") || 0));
    }
    const held = processLines(gpu);
    if (held.length) {
      const list = el("ul", { class: "genie-processes", "aria-label": `processes on GPU ${gpu.index}` });
      held.forEach((line) => list.append(el("li", {}, line)));
      card.append(list);
    }
    box.append(card);
  });
  return box;
}

function drawHealth(model) {
  const report = model.get("health") || {};
  const grade = report.grade || "UNKNOWN";
  const box = el("section", { class: "genie-health", "aria-label": "health" });
  box.append(el("span", { class: `genie-badge genie-grade-${grade.toLowerCase()}`, role: "status" }, grade));
  const list = el("ul", { class: "genie-checks" });
  for (const c of report.checks || []) list.append(el("li", { class: `genie-grade-${c.grade.toLowerCase()}` }, `${c.grade === "HEALTHY" ? "✓" : "!"} ${c.reason}`));
  box.append(list);
  return box;
}

function drawBackend(model) {
  const report = model.get("backend") || {};
  const box = el("section", { class: "genie-backend", "aria-label": "network backend" });
  box.append(el("div", { class: "genie-backend-chosen" }, `backend: ${report.chosen || "unknown"}`));
  box.append(el("div", { class: "genie-muted" }, report.reason || ""));
  const table = el("table", { class: "genie-candidates" });
  table.append(el("tr", {}, el("th", {}, "backend"), el("th", {}, "round trip"), el("th", {}, "bandwidth"), el("th", {}, "why")));
  for (const c of report.candidates || []) {
    table.append(el("tr", { class: c.available ? "" : "genie-muted" }, el("td", {}, c.name),
      el("td", {}, c.rtt_s ? `${(c.rtt_s * 1000).toFixed(2)} ms` : "—"),
      el("td", {}, c.bandwidth ? `${formatBytes(c.bandwidth)}/s` : "—"),
      el("td", {}, c.available && c.bandwidth ? "" : c.reason)));
  }
  box.append(table);
  return box;
}

function drawEvents(model) {
  const box = el("section", { class: "genie-events", "aria-label": "event log" });
  const input = el("input", { class: "genie-filter", placeholder: "filter by type, e.g. GPU_OVERHEATED", "aria-label": "filter events by type" });
  input.value = model.get("event_filter") || "";
  input.addEventListener("change", () => { model.set("event_filter", input.value); model.save_changes(); });
  box.append(input);
  const list = el("ul", { class: "genie-event-list" });
  for (const e of visibleEvents(model.get("events") || [], model.get("event_filter"))) {
    const when = new Date(e.time * 1000).toLocaleTimeString();
    list.append(el("li", { class: `genie-event genie-sev-${e.severity}` }, el("span", { class: "genie-event-time" }, when),
      el("span", { class: "genie-event-type" }, e.type), el("span", { class: "genie-event-message" }, (e.data && e.data.message) || "")));
  }
  box.append(list);
  return box;
}

function drawInit(model) {
  const box = el("section", { class: "genie-init", "aria-label": "initialization" });
  const list = el("ol", {});
  for (const p of model.get("phases") || []) list.append(el("li", {}, `✓ ${p.name} (${(p.seconds * 1000).toFixed(0)} ms)`));
  box.append(list);
  if (model.get("summary")) box.append(el("div", { class: "genie-summary" }, model.get("summary")));
  return box;
}

function drawJobs(model) {
  const box = el("section", { class: "genie-jobs", "aria-label": "background jobs" });
  const jobs = model.get("jobs") || [];
  if (jobs.length === 0) box.append(el("div", {}, "No background jobs (start one with %%remote --bg)."));
  for (const job of jobs) {
    const row = el("div", { class: `genie-job genie-job-${job.state}` });
    row.append(el("span", { class: "genie-job-name" }, job.name));
    row.append(el("span", { class: "genie-job-state" }, job.state));
    row.append(el("span", { class: "genie-job-elapsed" }, `${job.elapsed.toFixed(1)} s`));
    box.append(row);
    if (job.tail) box.append(el("pre", { class: "genie-job-tail" }, job.tail));
  }
  return box;
}

// The pool's nodes in the order asked ("free": most free GPUs first; "busy": busiest first; "name"),
// only those with GPUs of `type` when one is given.
export function poolNodes(nodes, sort = "free", type = "") {
  const busy = (n) => (Number.isFinite(n.utilization) ? n.utilization : -1);  // the node's mean, sent for every node
  const order = {
    free: (a, b) => b.free - a.free || a.name.localeCompare(b.name),
    busy: (a, b) => busy(b) - busy(a) || a.name.localeCompare(b.name),
    name: (a, b) => a.name.localeCompare(b.name),
  }[sort] || ((a, b) => a.name.localeCompare(b.name));
  return nodes.filter((n) => !type || n.type === type).slice().sort(order);
}

export function gpuTypes(nodes) {
  return [...new Set(nodes.map((n) => n.type).filter(Boolean))].sort();
}

// One GPU's history rows ([utilization, memory] series) from the float32 buffer, by node and index.
export function poolSeries(buffer, shape, rows, nodeId, index) {
  const row = rows.findIndex(([n, i]) => n === nodeId && i === index);
  if (row < 0 || !shape[2]) return null;
  return [historySeries(buffer, shape, row, 0), historySeries(buffer, shape, row, 1)];
}

function meter(label, pct, text) {
  const bar = el("div", { class: "genie-bar", role: "meter", "aria-label": label, "aria-valuemin": "0", "aria-valuemax": "100",
    "aria-valuenow": pct === null || pct === undefined ? "0" : String(Math.round(pct)) });
  bar.append(el("div", { class: `genie-fill genie-${level(pct)}`, style: `width:${pct === null || pct === undefined ? 0 : Math.min(100, pct)}%` }));
  return [bar, el("span", { class: "genie-value" }, text)];
}

function drawPool(model) {
  const t0 = performance.now();
  const view = model.get("pool") || {};
  const box = el("section", { class: "genie-pool", "aria-label": "GPU pool" });
  if (!view.nodes) { box.append(el("p", { class: "genie-muted" }, "pool: no reading yet")); return box; }
  const controls = model.get("controls") || {};
  const queue = view.queue || { length: 0, yours: [] };
  box.append(el("div", { class: "genie-pool-title" }, `pool at ${view.address} · ${view.free} of ${view.total} GPUs free` +
    (queue.length ? ` · ${queue.length} waiting${queue.yours.length ? ` (you: ${queue.yours.join(", ")})` : ""}` : "")));
  const sort = el("select", { class: "genie-pool-sort", "aria-label": "sort nodes" });
  for (const [v, label] of [["free", "free GPUs first"], ["busy", "busiest first"], ["name", "by name"]]) {
    const o = el("option", { value: v }, label); if ((controls.sort || "free") === v) o.selected = true; sort.append(o);
  }
  const type = el("select", { class: "genie-pool-type", "aria-label": "GPU type" });
  type.append(el("option", { value: "" }, "all GPU types"));
  for (const name of gpuTypes(view.nodes)) { const o = el("option", { value: name }, name); if (controls.type === name) o.selected = true; type.append(o); }
  const change = () => { model.set("controls", { sort: sort.value, type: type.value }); model.save_changes(); };
  sort.addEventListener("change", change); type.addEventListener("change", change);
  box.append(el("div", { class: "genie-pool-controls" }, sort, type));
  if ((view.mine || []).length) {
    const mine = el("ul", { class: "genie-pool-mine", "aria-label": "your sessions" });
    for (const m of view.mine) mine.append(el("li", {}, `you: GPU ${m.gpu} on ${m.node} (${m.session}) · ` +
      `${formatNumber(m.utilization, "%")} busy · memory ${formatNumber(m.memory, "%")}`));
    box.append(mine);
  }
  const list = el("div", { class: "genie-pool-nodes" });  // scrolls: a hundred nodes stay a screenful
  box.append(list);
  const expanded = new Set(model.get("expanded") || []);
  const [buffer, shape, rows] = [model.get("pool_history"), model.get("pool_history_shape") || [0, 2, 0], model.get("pool_history_rows") || []];
  for (const node of poolNodes(view.nodes, controls.sort, controls.type)) {
    const details = el("details", { class: `genie-pool-node${node.alive ? "" : " genie-lost"}`, "data-node": node.id });
    details.open = expanded.has(node.id);
    const grade = node.grade.toLowerCase().replace(" ", "-");
    details.append(el("summary", {}, el("span", { class: "genie-pool-node-name" }, node.name),
      el("span", { class: `genie-badge genie-grade-${grade}` }, node.grade),
      el("span", { class: "genie-muted" }, ` ${node.free} of ${node.gpu_count} free · ${node.type || "no GPU reading"}${node.simulated ? " · simulated" : ""}`)));
    details.addEventListener("toggle", () => {
      const now = new Set(model.get("expanded") || []);
      if (details.open) now.add(node.id); else now.delete(node.id);
      model.set("expanded", [...now]); model.save_changes();
    });
    if (details.open) {  // a closed node costs one line: the GPUs of 100 nodes are not drawn unless opened
      for (const reason of node.reasons) details.append(el("div", { class: "genie-bad" }, `! ${reason}`));
      for (const g of node.gpus) {
        const mem = g.memory_total ? (100 * g.memory_used) / g.memory_total : null;
        const row = el("div", { class: "genie-pool-gpu", "data-gpu": String(g.index) },
          el("span", { class: "genie-label" }, `GPU ${g.index}`),
          ...meter(`${node.name} GPU ${g.index} utilization`, g.utilization, formatNumber(g.utilization, "%")),
          ...meter(`${node.name} GPU ${g.index} memory`, mem, g.memory_total ? `${formatBytes(g.memory_used)} / ${formatBytes(g.memory_total)}` : "unknown"),
          el("span", { class: "genie-value" }, formatNumber(g.temperature, " °C")),
          el("span", { class: "genie-value" }, formatNumber(g.power_draw, " W")),
          el("span", { class: `genie-pool-holder${g.holder.startsWith("you") ? " genie-pool-yours" : ""}` }, g.holder));
        details.append(row);
        const series = poolSeries(buffer, shape, rows, node.id, g.index);
        if (series) details.append(historyChart(g, [{ name: "utilization", values: series[0] }, { name: "memory", values: series[1] }], model.get("pool_history_span") || 0));
      }
    }
    list.append(details);
  }
  performance.measure("genie-pool-draw", { start: t0 });  // in a Chromium performance trace (blink.user_timing)
  return box;
}

const SECTIONS = { gauges: drawGauges, health: drawHealth, backend: drawBackend, events: drawEvents, init: drawInit, jobs: drawJobs, pool: drawPool };

function draw(model, el_) {
  const root = el("div", { class: "genie-widget" });
  const status = model.get("status");
  if (status === "lost") {
    root.classList.add("genie-lost");
    const what = (model.get("sections") || []).includes("pool") ? "pool endpoint lost" : "server lost";
    root.append(el("div", { class: "genie-bad", role: "alert" }, `${what} · last seen ${ago(Date.now() / 1000 - model.get("last_seen"))}`));
  }
  for (const name of model.get("sections") || []) root.append(SECTIONS[name](model));
  el_.replaceChildren(root);
}

function render({ model, el: el_ }) {
  // One draw per update: the traits an update changes arrive in one message, and each fires its
  // own change event; the draw waits until all of them are in.
  let pending = false;
  const redraw = () => {
    if (pending) return;
    pending = true;
    queueMicrotask(() => { pending = false; draw(model, el_); });
  };
  for (const name of ["gpus", "history", "health", "backend", "events", "event_filter", "phases", "summary", "status", "last_seen", "sections", "jobs", "history_span",
    "pool", "controls", "expanded", "pool_history"]) {
    model.on(`change:${name}`, redraw);
  }
  redraw();
}

export default { render };
