import { test } from "node:test";
import assert from "node:assert/strict";
import { formatBytes, gaugeRows, sparklinePoints, historySeries, visibleEvents, level, ago, timeLabel, processLines } from "../src/widgets.js";

test("bytes read like a person writes them", () => {
  assert.equal(formatBytes(0), "0 B");
  assert.equal(formatBytes(80 * 1024 ** 3), "80.0 GiB");
  assert.equal(formatBytes(null), "unknown");
});

test("gauges say unknown instead of inventing a number", () => {
  const rows = gaugeRows({ index: 0, utilization: null, memory_used: null, memory_total: null, temperature: null, power_draw: null, power_limit: null });
  assert.deepEqual(rows.map((r) => r.text), ["unknown", "unknown", "unknown", "unknown"]);
  assert.ok(rows.every((r) => r.pct === null));
});

test("gauges scale to the GPU's own limits", () => {
  const [util, mem, temp, power] = gaugeRows({ utilization: 50, memory_used: 40, memory_total: 80, temperature: 87, temperature_slowdown: 87, power_draw: 350, power_limit: 700 });
  assert.equal(util.pct, 50);
  assert.equal(mem.pct, 50);
  assert.equal(temp.pct, 100);
  assert.equal(power.pct, 50);
  assert.equal(level(temp.pct), "high");
  assert.equal(level(util.pct), "ok");
});

test("sparklines skip missing readings and need two points", () => {
  assert.equal(sparklinePoints([5], 100, 10), "");
  assert.equal(sparklinePoints([0, 100], 100, 10), "0.0,10.0 100.0,0.0");
  assert.equal(sparklinePoints([0, NaN, 100], 100, 10), "0.0,10.0 100.0,0.0");
});

test("history comes from a binary float32 buffer by gpu and metric", () => {
  const shape = [2, 2, 3];
  const data = new Float32Array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]);
  const view = new DataView(data.buffer);
  assert.deepEqual(historySeries(view, shape, 1, 0), [7, 8, 9]);
  assert.deepEqual(historySeries(view, shape, 0, 1), [4, 5, 6]);
});

test("the event log filters by type and stays bounded", () => {
  const events = Array.from({ length: 300 }, (_, i) => ({ type: i % 2 ? "GPU_OVERHEATED" : "NODE_LOST", time: i }));
  assert.equal(visibleEvents(events, "").length, 200);
  assert.ok(visibleEvents(events, "gpu_overheated").every((e) => e.type === "GPU_OVERHEATED"));
  assert.equal(visibleEvents(events, "NODE_LOST, GPU_OVERHEATED", 10).length, 10);
});

test("time since last seen", () => {
  assert.equal(ago(5), "5 s ago");
  assert.equal(ago(180), "3 min ago");
});

test("the history chart's time axis reads in seconds, then minutes", () => {
  assert.equal(timeLabel(0), "now");
  assert.equal(timeLabel(30), "-30 s");
  assert.equal(timeLabel(299), "-5 min");
  assert.equal(timeLabel(150), "-2.5 min");
});

test("who holds a GPU: sessions by name, other processes said plainly", () => {
  const lines = processLines({ processes: [
    { pid: 7, memory_used: 3 * 1024 ** 3, sm_util: 45.2, session: "ab12cd34", name: "work", user: "alice", host: "lap" },
    { pid: 9, memory_used: null, sm_util: null },
  ] });
  assert.deepEqual(lines, ["pid 7 · 3.0 GiB · SM 45% · session 'work' (alice@lap)", "pid 9 · memory unknown · not a genie session"]);
});

import { poolNodes, gpuTypes, poolSeries } from "../src/widgets.js";

const mean = (u) => { const k = u.filter((v) => v !== null); return k.length ? k.reduce((a, b) => a + b, 0) / k.length : null; };
const node = (name, free, type, util) => ({ id: name, name, free, type, utilization: mean(util), gpu_count: util.length, gpus: [] });

test("pool nodes sort with free GPUs first, busiest first or by name, and filter by GPU type", () => {
  const nodes = [node("b", 1, "A100", [90, 10]), node("a", 1, "T4", [20, 20]), node("c", 2, "A100", [null, 5])];
  assert.deepEqual(poolNodes(nodes, "free").map((n) => n.name), ["c", "a", "b"]);
  assert.deepEqual(poolNodes(nodes, "busy").map((n) => n.name), ["b", "a", "c"]);
  assert.deepEqual(poolNodes(nodes, "name").map((n) => n.name), ["a", "b", "c"]);
  assert.deepEqual(poolNodes(nodes, "free", "A100").map((n) => n.name), ["c", "b"]);
  assert.deepEqual(gpuTypes(nodes), ["A100", "T4"]);
  assert.deepEqual(nodes.map((n) => n.name), ["b", "a", "c"]);  // the model's list is left as it was
});

test("a pool GPU's history is found by node and index in the float32 rows", () => {
  const values = new Float32Array([1, 2, 3, 4, 5, 6, 7, 8]);  // 2 rows x 2 metrics x 2 points
  const rows = [["n1", 0], ["n1", 1]];
  assert.deepEqual(poolSeries(new Uint8Array(values.buffer), [2, 2, 2], rows, "n1", 1), [[5, 6], [7, 8]]);
  assert.equal(poolSeries(new Uint8Array(values.buffer), [2, 2, 2], rows, "n2", 0), null);  // a closed node: none sent
});
