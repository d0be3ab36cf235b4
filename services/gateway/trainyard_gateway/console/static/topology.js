// Where GPUs sit: NVLink islands inside a node, nodes under leaf switches, leaves under spines (the nodes'
// labels: `switch` or `leaf`, `spine`, `zone`, as the scheduler's topology scoring reads them).

import {h} from "./dom.js";

export function placeOf(node) {
  const labels = node.labels || {};
  return {zone: labels.zone || "", spine: labels.spine || "", leaf: labels.switch || labels.leaf || ""};
}

function islands(node) {
  const groups = new Map();
  for (const gpu of node.gpus) {
    const key = gpu.nvlink_island >= 0 ? `island ${gpu.nvlink_island}` : `PCIe GPU ${gpu.index}`;
    if (!groups.has(key)) groups.set(key, []);
    groups.get(key).push(gpu);
  }
  return [...groups.entries()];
}

// A node with its GPUs grouped by NVLink island; `mine`: indices to highlight (a job's).
export function nodeBox(node, mine = new Set(), {href = true} = {}) {
  const title = href ? h("a", {href: `#/nodes/${encodeURIComponent(node.node_id)}`}, node.node_id) : node.node_id;
  return h("div", {class: `topo-node ${node.state}${node.cordoned ? " cordoned" : ""}`, "data-node": node.node_id},
    h("div", {class: "topo-title"}, title, h("small", {}, ` ${node.models.join(", ")}`)),
    h("div", {class: "topo-islands"}, islands(node).map(([name, gpus]) => h("div", {class: "topo-island", title: name},
      gpus.map((g) => h("span", {
        class: `topo-gpu ${g.health}${g.allocated ? " held" : ""}${mine.has(g.index) ? " mine" : ""}`,
        title: `GPU ${g.index} ${g.model}: ${g.health}${g.allocated ? ", held" : ""}${mine.has(g.index) ? ", this job's" : ""}`,
        "data-gpu": `${node.node_id}/${g.index}`,
      }, String(g.index)))))));
}

// Nodes grouped by spine, then leaf; `highlight`: node id -> Set of GPU indices.
export function fabric(nodes, highlight = new Map()) {
  const spines = new Map();
  for (const node of nodes) {
    const p = placeOf(node);
    const spine = [p.zone, p.spine].filter(Boolean).join(" / ") || "no spine label";
    if (!spines.has(spine)) spines.set(spine, new Map());
    const leaves = spines.get(spine);
    const leaf = p.leaf || "no leaf label";
    if (!leaves.has(leaf)) leaves.set(leaf, []);
    leaves.get(leaf).push(node);
  }
  return h("div", {class: "topo", "data-testid": "topology"},
    [...spines.entries()].sort().map(([spine, leaves]) => h("div", {class: "topo-spine"},
      h("div", {class: "topo-label"}, `spine ${spine}`),
      h("div", {class: "topo-leaves"}, [...leaves.entries()].sort().map(([leaf, members]) => h("div", {class: "topo-leaf"},
        h("div", {class: "topo-label"}, `leaf ${leaf}`),
        h("div", {class: "topo-nodes"}, members.map((n) => nodeBox(n, highlight.get(n.node_id))))))))));
}

export const LEGEND = h("p", {class: "hint"},
  h("span", {class: "topo-gpu mine"}, "n"), " this job's GPU ",
  h("span", {class: "topo-gpu held"}, "n"), " held ",
  h("span", {class: "topo-gpu healthy"}, "n"), " free ",
  h("span", {class: "topo-gpu unhealthy"}, "n"), " unhealthy; boxes inside a node are NVLink islands");

export function legend() {
  return LEGEND.cloneNode(true);
}
