// Node: its GPUs (health, memory, NVLink island), their utilization, memory, temperature and power over time,
// the XID and health history, where it sits in the fabric; for operators, cordon/uncordon and GPU health.
// GET /v1/nodes/{id}, GET /v1/nodes/{id}/metrics and GET /v1/nodes (its leaf's neighbours), every 5 seconds.

import {api, query} from "./api.js";
import {color, lineChart} from "./charts.js";
import {ago, badge, empty, h, link, num, replace, section, table, when} from "./dom.js";
import {nodeBox, placeOf} from "./topology.js";

const WINDOWS = [["15 min", 900], ["1 h", 3600], ["6 h", 21600]];
const CHARTS = [
  ["Utilization", "utilization_percent", "%", 100],
  ["Memory used", "memory_used_mb", " MB", 0],
  ["Temperature", "temperature_c", " °C", 0],
  ["Power", "power_w", " W", 0],
];

function header(node) {
  const p = placeOf(node);
  return h("div", {class: "page-head"},
    h("h1", {}, link("#/fleet", "Fleet"), " › ", node.node_id),
    badge(node.state.replace("_", " "), node.state),
    node.cordoned && node.state !== "cordoned" ? badge("cordoned", "cordoned") : null,
    h("span", {class: "muted", "data-testid": "node-facts"},
      [node.models.join(", "), `${node.gpus_total} GPUs, ${node.gpus_free} free`, `${node.cpus} CPUs`,
       `${Math.round(node.memory_mb / 1024)} GiB`, `driver ${node.driver_version || "?"}`,
       node.simulated ? "simulated" : "", `heartbeat ${ago(node.last_heartbeat)}`,
       [p.zone, p.spine, p.leaf].filter(Boolean).join(" › ")].filter(Boolean).join(" · ")),
    node.cordoned ? h("p", {class: "warn"}, `Cordoned: ${node.cordon_reason || "no reason given"}`) : null);
}

function cordonButton(node, act, reason) {
  const path = `/v1/nodes/${encodeURIComponent(node.node_id)}`;
  return node.cordoned
    ? h("button", {type: "button", class: "admin-control", "data-testid": "uncordon",
                   onclick: () => act(`${path}:uncordon`, undefined)}, "Uncordon")
    : h("button", {type: "button", class: "admin-control danger", "data-testid": "cordon",
                   onclick: () => act(`${path}:cordon`, {reason: reason.value.trim()})}, "Cordon");
}

function gpuRows(node, ctx, act, reasonOf) {
  return node.gpus.map((g) => h("tr", {"data-gpu": `${node.node_id}/${g.index}`, "data-health": g.health},
    h("td", {class: "num"}, String(g.index)), h("td", {}, g.model), h("td", {class: "num"}, num(g.memory_mb, 0)),
    h("td", {"data-testid": "gpu-health"}, badge(g.health)),
    h("td", {}, g.health_reason || "", g.health_action !== "none" ? h("small", {}, ` (${g.health_action})`) : null),
    h("td", {class: "num"}, g.nvlink_island >= 0 ? String(g.nvlink_island) : "—"),
    h("td", {class: "num"}, String(g.numa_node)),
    h("td", {}, g.allocated ? "held" : ""),
    ctx.can("nodes.write") ? h("td", {}, h("button", {
      type: "button", class: "admin-control small", "data-testid": `set-health-${g.index}`,
      onclick: () => act(`/v1/nodes/${encodeURIComponent(node.node_id)}/gpus/${g.index}:set-health`,
                         {healthy: g.health !== "healthy", reason: reasonOf() ||
                          (g.health !== "healthy" ? "repaired" : "taken out of service")}),
    }, g.health === "healthy" ? "Mark unhealthy" : "Mark healthy")) : null));
}

function charts(metrics) {
  const end = new Date(metrics.as_of).getTime();
  // From the window's start, or from the agent's oldest sample when it started later (no empty left part).
  const start = Math.max(end - metrics.window_s * 1000, metrics.retained_since ? new Date(metrics.retained_since).getTime()
    : end - metrics.window_s * 1000);
  const gap = Math.max(metrics.interval_s * 3000, (metrics.window_s * 1000) / 60);
  return h("div", {class: "chart-grid"}, CHARTS.map(([title, field, unit, yMax]) => lineChart({
    title, unit, yMax: yMax || undefined, start, end, gapMs: gap, testid: `chart-${field}`,
    series: metrics.gpus.map((g, i) => ({name: `GPU ${g.index}`, color: color(i),
                                          points: g.samples.map((x) => [new Date(x.time).getTime(), x[field]])})),
  })));
}

function events(metrics) {
  if (!metrics.events.length) return empty("no XIDs or health changes since the agent started");
  const rows = [...metrics.events].reverse().map((e) => h("tr", {class: e.kind, "data-gpu": e.gpu},
    h("td", {}, when(e.time)), h("td", {class: "num"}, String(e.gpu)),
    h("td", {}, e.kind === "xid" ? `XID ${e.xid}` : "health"), h("td", {}, badge(e.health)), h("td", {}, e.reason)));
  return table(["time", "GPU", "event", "health", "reason"], rows, {"data-testid": "gpu-events"});
}

function topology(node, all) {
  const p = placeOf(node);
  const neighbours = all.filter((n) => n.node_id !== node.node_id && placeOf(n).leaf === p.leaf && p.leaf);
  return h("div", {},
    h("p", {}, `zone ${p.zone || "—"} › spine ${p.spine || "—"} › leaf ${p.leaf || "—"} › ${node.node_id}`),
    nodeBox(node, new Set(), {href: false}),
    neighbours.length ? h("p", {class: "muted"}, `Same leaf (${p.leaf}): `,
      neighbours.map((n, i) => [i ? ", " : "", link(`#/nodes/${encodeURIComponent(n.node_id)}`, n.node_id)])) : null);
}

export function mount(main, ctx, nodeId) {
  let windowS = 900;
  const head = h("div");
  const admin = h("div");
  const gpus = h("div");
  const chartBox = h("div");
  const history = h("div");
  const topo = h("div");
  // Made once, so what the operator types survives the refreshes.
  const reason = h("input", {type: "text", maxlength: 500, placeholder: "reason (recorded)", "aria-label": "reason",
                             "data-testid": "admin-reason"});
  const cordonSlot = h("span");
  if (ctx.can("nodes.write")) {
    replace(admin, h("div", {class: "admin", "data-testid": "node-admin"}, h("strong", {}, "Operator"), reason,
                     cordonSlot, h("small", {class: "muted"}, "the GPU table's buttons record this reason too")));
  }
  const picker = h("div", {class: "segmented"}, WINDOWS.map(([label, seconds]) => h("button", {
    type: "button", class: seconds === windowS ? "on" : "", onclick: (event) => {
      windowS = seconds;
      for (const b of picker.children) b.classList.toggle("on", b === event.currentTarget);
      refresh().catch((error) => ctx.banner(error.message));
    }}, label)));
  replace(main, head, admin,
    section("GPUs", {}, gpus),
    section("Over time", {}, picker, chartBox),
    h("div", {class: "columns"}, section("XIDs and health history", {}, history), section("Topology", {}, topo)));

  async function act(path, body) {
    try {
      await api(path, {method: "POST", body});
      await refresh();
    } catch (error) {
      ctx.banner(error.message);
    }
  }

  async function refresh() {
    const id = encodeURIComponent(nodeId);
    const [node, {nodes}] = await Promise.all([api(`/v1/nodes/${id}`), api("/v1/nodes")]);
    replace(head, header(node));
    if (ctx.can("nodes.write")) replace(cordonSlot, cordonButton(node, act, reason));
    const headers = ["GPU", "model", "memory MB", "health", "reason", "NVLink island", "NUMA", "job"];
    if (ctx.can("nodes.write")) headers.push("");
    replace(gpus, table(headers, gpuRows(node, ctx, act, () => reason.value.trim()),
                        {"data-testid": "gpu-table"}));
    replace(topo, topology(node, nodes));
    try {
      const metrics = await api(`/v1/nodes/${id}/metrics${query({window: windowS, points: 180})}`);
      replace(chartBox, charts(metrics));
      replace(history, events(metrics));
    } catch (error) {
      replace(chartBox, h("p", {class: "warn"}, `No telemetry from the node's agent: ${error.message}`));
    }
  }
  ctx.every(5000, refresh);
}
