// Fleet: nodes by state, GPUs by model and health, a heat map of every GPU's utilization, the allocation over
// time. GET /v1/nodes and GET /v1/fleet/metrics, every 5 seconds.

import {api, query} from "./api.js";
import {color, heatMap, lineChart, meter} from "./charts.js";
import {ago, badge, empty, h, link, pct, replace, section, table} from "./dom.js";

const STATES = ["ready", "cordoned", "not_ready", "unknown"];
const UP = new Set(["ready", "cordoned"]);
const HEALTH = [["healthy", "#16a34a"], ["degraded", "#f59e0b"], ["unhealthy", "#dc2626"], ["unknown", "#a1a1aa"]];
const WINDOWS = [["1 h", 3600], ["6 h", 21600], ["24 h", 86400]];

function tiles(nodes) {
  const count = (f) => nodes.filter(f).length;
  const gpus = nodes.flatMap((n) => n.gpus.map((g) => ({...g, ready: UP.has(n.state)})));
  const ready = gpus.filter((g) => g.ready);
  const held = ready.filter((g) => g.allocated).length;
  const tile = (label, value, note, testid) => h("div", {class: "tile", "data-testid": testid},
    h("div", {class: "value"}, String(value)), h("div", {class: "label"}, label), note ? h("small", {}, note) : null);
  return h("div", {class: "tiles"},
    tile("nodes", nodes.length, STATES.map((st) => `${count((n) => n.state === st)} ${st.replace("_", " ")}`)
      .join(" · "), "nodes-total"),
    tile("cordoned", count((n) => n.cordoned), "out of placement", "nodes-cordoned"),
    tile("GPUs", gpus.length, `${ready.length} on ready nodes`, "gpus-total"),
    tile("allocated", `${pct(held, ready.length)}%`, `${held} of ${ready.length} GPUs held by jobs`, "allocation"),
    tile("free", nodes.reduce((a, n) => a + n.gpus_free, 0), "healthy GPUs nobody holds", "gpus-free"),
    tile("not healthy", gpus.filter((g) => g.health !== "healthy").length, "degraded, unhealthy or unknown",
         "gpus-unhealthy"));
}

function byModel(nodes) {
  const models = new Map();
  for (const node of nodes) {
    for (const gpu of node.gpus) {
      const m = models.get(gpu.model) || {total: 0, held: 0, healthy: 0, degraded: 0, unhealthy: 0, unknown: 0};
      m.total += 1;
      m.held += gpu.allocated ? 1 : 0;
      m[gpu.health] = (m[gpu.health] || 0) + 1;
      models.set(gpu.model, m);
    }
  }
  const rows = [...models.entries()].sort().map(([model, m]) => h("tr", {"data-model": model},
    h("td", {}, model), h("td", {class: "num"}, String(m.total)), h("td", {class: "num"}, String(m.held)),
    h("td", {class: "wide"}, meter(HEALTH.map(([name, c]) => ({value: m[name] || 0, color: c, label: name})), m.total)),
    h("td", {}, HEALTH.filter(([name]) => m[name]).map(([name]) => `${m[name]} ${name}`).join(", "))));
  return table(["model", "GPUs", "held", "health", ""], rows);
}

function heat(nodes, latest) {
  const byKey = new Map(latest.map((g) => [`${g.node_id}/${g.index}`, g]));
  const rows = nodes.map((node) => ({
    label: node.node_id, href: `#/nodes/${encodeURIComponent(node.node_id)}`,
    cells: node.gpus.map((g) => {
      const key = `${node.node_id}/${g.index}`;
      const m = byKey.get(key);
      const util = m ? m.utilization_percent : null;
      return {key, value: util, health: g.health, allocated: g.allocated,
              title: `${key} ${g.model}\n${util === null ? "no reading" : `${Math.round(util)}% utilization`}` +
                     (m && m.memory_used_mb !== null ? `, ${Math.round(m.memory_used_mb)} / ${g.memory_mb} MB` : "") +
                     (m && m.temperature_c !== null ? `, ${Math.round(m.temperature_c)} °C` : "") +
                     `\n${g.health}${g.health_reason ? `: ${g.health_reason}` : ""}${g.allocated ? "\nheld by a job" : ""}`};
    }),
  }));
  return heatMap(rows);
}

function allocationChart(metrics) {
  const points = metrics.allocation;
  const end = new Date(metrics.as_of).getTime();
  // From the window's start, or from the first point when this gateway started recording later.
  const first = points.length ? new Date(points[0].time).getTime() : end;
  const start = Math.max(end - metrics.window_s * 1000, Math.min(first, end - 60e3));
  const models = [...new Set(points.flatMap((p) => Object.keys(p.models)))].sort();
  const series = [{name: "all GPUs", color: color(0),
                   points: points.map((p) => [new Date(p.time).getTime(), pct(p.gpus_allocated, p.gpus_total)])}];
  models.forEach((model, i) => series.push({name: model, color: color(i + 1), points: points
    .filter((p) => p.models[model])
    .map((p) => [new Date(p.time).getTime(), pct(p.models[model].allocated, p.models[model].total)])}));
  return lineChart({title: `GPUs held by jobs, % of those on ready nodes (recorded every ${metrics.sample_interval_s} s)`,
                    series, start, end, unit: "%", yMax: 100, gapMs: metrics.sample_interval_s * 3000, width: 1300,
                    height: 200,
                    testid: "allocation-chart"});
}

function nodeRows(nodes) {
  return nodes.map((n) => h("tr", {"data-node": n.node_id},
    h("td", {}, link(`#/nodes/${encodeURIComponent(n.node_id)}`, n.node_id)),
    h("td", {}, badge(n.state.replace("_", " "), n.state),
      n.cordoned && n.state !== "cordoned" ? badge("cordoned", "cordoned") : null),
    h("td", {}, n.models.join(", ") || "CPU only"),
    h("td", {class: "num"}, `${n.gpus_free} / ${n.gpus_total}`),
    h("td", {}, n.gpus.filter((g) => g.health !== "healthy").map((g) => badge(`GPU ${g.index} ${g.health}`, g.health))),
    h("td", {}, ago(n.last_heartbeat)),
    h("td", {class: "muted"}, n.cordon_reason)));
}

export function mount(main, ctx) {
  let windowS = 3600;
  const summary = h("div");
  const models = h("div");
  const heatBox = h("div");
  const chart = h("div");
  const list = h("div");
  const unreachable = h("div");
  const picker = h("div", {class: "segmented"}, WINDOWS.map(([label, seconds]) => h("button", {
    type: "button", class: seconds === windowS ? "on" : "", onclick: (event) => {
      windowS = seconds;
      for (const b of picker.children) b.classList.toggle("on", b === event.currentTarget);
      refresh().catch((error) => ctx.banner(error.message));
    }}, label)));
  replace(main,
    h("div", {class: "page-head"}, h("h1", {}, "Fleet")),
    summary,
    h("div", {class: "columns"},
      section("GPU utilization", {"data-testid": "fleet-heatmap"}, heatBox, unreachable),
      section("GPUs by model and health", {}, models)),
    section("Allocation over time", {}, picker, chart),
    section("Nodes", {}, list));

  async function refresh() {
    const [{nodes}, metrics] = await Promise.all([api("/v1/nodes"), api(`/v1/fleet/metrics${query({window: windowS})}`)]);
    nodes.sort((a, b) => a.node_id.localeCompare(b.node_id));
    replace(summary, tiles(nodes));
    replace(models, nodes.length ? byModel(nodes) : empty("no nodes have registered"));
    replace(heatBox, nodes.length ? heat(nodes, metrics.gpus) : empty("no nodes have registered"));
    replace(unreachable, metrics.unreachable.length ? h("p", {class: "warn"}, "No reading from: ",
      metrics.unreachable.map((u) => `${u.node_id} (${u.message})`).join("; ")) : null);
    replace(chart, allocationChart(metrics));
    replace(list, table(["node", "state", "models", "free / GPUs", "GPU health", "heartbeat", "cordon reason"],
                        nodeRows(nodes), {"data-testid": "node-table"}));
  }
  ctx.every(5000, refresh);
}
