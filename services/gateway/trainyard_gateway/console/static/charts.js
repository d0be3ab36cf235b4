// The console's charts, drawn as SVG from data: a time-series line chart, a utilization heat map, stacked bars,
// a horizontal meter and a timeline. No library: each is a function from data to an element.

import {h, s} from "./dom.js";

export const PALETTE = ["#2563eb", "#16a34a", "#dc2626", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777",
                        "#4b5563", "#65a30d", "#7c3aed", "#0d9488"];

export function color(i) { return PALETTE[i % PALETTE.length]; }

// 0% pale, 100% deep blue: an idle GPU stands out as a pale cell among busy ones.
const SCALE = [[0, [226, 232, 240]], [50, [96, 165, 250]], [100, [30, 58, 138]]];

export function utilColor(value) {
  if (value === null || value === undefined) return "#d4d4d8";
  const v = Math.max(0, Math.min(100, value));
  for (let i = 1; i < SCALE.length; i++) {
    const [x1, c1] = SCALE[i];
    const [x0, c0] = SCALE[i - 1];
    if (v <= x1) {
      const f = (v - x0) / (x1 - x0);
      const mix = c0.map((c, k) => Math.round(c + f * (c1[k] - c)));
      return `rgb(${mix.join(",")})`;
    }
  }
  return "rgb(30,58,138)";
}

function niceMax(value) {
  if (!(value > 0)) return 1;
  const magnitude = 10 ** Math.floor(Math.log10(value));
  for (const step of [1, 2, 2.5, 5, 10]) {
    if (value <= step * magnitude) return step * magnitude;
  }
  return 10 * magnitude;
}

function clock(ms, spanMs) {
  const d = new Date(ms);
  const opts = spanMs > 2 * 86400e3 ? {month: "short", day: "numeric"}
    : spanMs < 600e3 ? {hour: "2-digit", minute: "2-digit", second: "2-digit"} : {hour: "2-digit", minute: "2-digit"};
  return d.toLocaleString([], opts);
}

function nearest(points, t) {
  let lo = 0;
  let hi = points.length - 1;
  while (lo < hi) {
    const mid = (lo + hi) >> 1;
    if (points[mid][0] < t) lo = mid + 1; else hi = mid;
  }
  if (lo > 0 && Math.abs(points[lo - 1][0] - t) < Math.abs(points[lo][0] - t)) lo -= 1;
  return points[lo];
}

// series: [{name, color, points: [[time ms, value], ...] oldest first}]; start/end in ms; yMax fixed (e.g. 100
// for percentages) or from the data. A gap of more than `gapMs` between two points breaks the line. `width`: of
// the drawing in its own units, about the pixels it takes on a laptop screen, so its text keeps its size.
export function lineChart({title, series, start, end, unit = "", yMax, width = 560, height = 170, gapMs, testid}) {
  const W = width;
  const H = height;
  const M = {l: 60, r: 10, t: 10, b: 22};
  const all = series.flatMap((x) => x.points.map((p) => p[1]));
  const top = yMax || niceMax(Math.max(0, ...all) * 1.1);
  const span = Math.max(1, end - start);
  const x = (t) => M.l + ((t - start) / span) * (W - M.l - M.r);
  const y = (v) => H - M.b - (Math.max(0, Math.min(v, top)) / top) * (H - M.t - M.b);
  const svg = s("svg", {viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img", "aria-label": title});
  for (let i = 0; i <= 4; i++) {
    const v = (top * i) / 4;
    svg.append(s("line", {x1: M.l, x2: W - M.r, y1: y(v), y2: y(v), class: "gridline"}),
               s("text", {x: M.l - 6, y: y(v) + 4, class: "tick", "text-anchor": "end"},
                 `${Number(v.toPrecision(3))}${unit}`));
  }
  for (let i = 0; i <= 4; i++) {
    const t = start + (span * i) / 4;
    svg.append(s("text", {x: x(t), y: H - 6, class: "tick",
                          "text-anchor": i === 0 ? "start" : i === 4 ? "end" : "middle"}, clock(t, span)));
  }
  const gap = gapMs || span / 20;
  series.forEach((line) => {
    let run = [];
    const flush = () => {
      if (run.length === 1) svg.append(s("circle", {cx: run[0][0], cy: run[0][1], r: 2, fill: line.color}));
      else if (run.length > 1) {
        svg.append(s("polyline", {points: run.map((p) => p.join(",")).join(" "), fill: "none",
                                  stroke: line.color, "stroke-width": 1.6, "stroke-linejoin": "round"}));
      }
      run = [];
    };
    line.points.forEach((p, i) => {
      if (i > 0 && p[0] - line.points[i - 1][0] > gap) flush();
      run.push([x(p[0]).toFixed(1), y(p[1]).toFixed(1)]);
    });
    flush();
  });
  const cursor = s("line", {y1: M.t, y2: H - M.b, class: "cursor", visibility: "hidden"});
  const readout = h("div", {class: "readout"}, "\u00a0");
  const overlay = s("rect", {x: M.l, y: M.t, width: W - M.l - M.r, height: H - M.t - M.b, fill: "transparent"});
  overlay.addEventListener("mousemove", (event) => {
    const box = svg.getBoundingClientRect();
    const px = ((event.clientX - box.left) / box.width) * W;
    const t = start + ((px - M.l) / (W - M.l - M.r)) * span;
    cursor.setAttribute("x1", px);
    cursor.setAttribute("x2", px);
    cursor.setAttribute("visibility", "visible");
    const parts = series.filter((l) => l.points.length).map((l) => {
      const p = nearest(l.points, t);
      return h("span", {}, h("i", {class: "swatch", style: `background:${l.color}`}),
               `${l.name} ${Number(p[1].toFixed(1))}${unit}`);
    });
    readout.replaceChildren(new Date(t).toLocaleTimeString(), " ", ...parts);
  });
  overlay.addEventListener("mouseleave", () => {
    cursor.setAttribute("visibility", "hidden");
    readout.replaceChildren("\u00a0");
  });
  svg.append(cursor, overlay);
  const legend = h("div", {class: "legend"}, series.map((l) => h("span", {},
    h("i", {class: "swatch", style: `background:${l.color}`}), l.name,
    l.points.length ? ` ${Number(l.points[l.points.length - 1][1].toFixed(1))}${unit}` : " —")));
  return h("figure", {class: "chart-box", "data-testid": testid}, h("figcaption", {}, title),
           all.length ? svg : h("p", {class: "empty"}, "no samples in this window yet"), legend, readout);
}

// rows: [{label, href, cells: [{value 0-100 | null, title, health, allocated, key}]}]
export function heatMap(rows, {cell = 18, gap = 3, labelWidth = 110} = {}) {
  const widest = Math.max(1, ...rows.map((r) => r.cells.length));
  const W = labelWidth + widest * (cell + gap);
  const H = rows.length * (cell + gap) + 4;
  const svg = s("svg", {viewBox: `0 0 ${W} ${H}`, class: "heatmap", width: W, height: H, role: "img",
                        "aria-label": "GPU utilization by node", "data-testid": "heatmap"});
  rows.forEach((row, r) => {
    const top = r * (cell + gap) + 2;
    const label = s("text", {x: labelWidth - 8, y: top + cell * 0.72, "text-anchor": "end", class: "label"},
                    row.label);
    svg.append(row.href ? s("a", {href: row.href}, label) : label);
    row.cells.forEach((c, i) => {
      const left = labelWidth + i * (cell + gap);
      const g = s("g", {class: `cell ${c.health}`, "data-gpu": c.key, "data-health": c.health,
                        "data-util": c.value === null ? "" : Math.round(c.value)},
        s("title", {}, c.title),
        s("rect", {x: left, y: top, width: cell, height: cell, rx: 3, fill: utilColor(c.value)}));
      if (c.health === "unhealthy" || c.health === "degraded") {
        g.append(s("rect", {x: left + 1, y: top + 1, width: cell - 2, height: cell - 2, rx: 3, fill: "none",
                            class: `ring ${c.health}`}));
      }
      if (c.health === "unhealthy") {
        g.append(s("path", {d: `M${left + 5},${top + 5}L${left + cell - 5},${top + cell - 5}` +
                               `M${left + cell - 5},${top + 5}L${left + 5},${top + cell - 5}`, class: "cross"}));
      }
      if (c.allocated) g.append(s("circle", {cx: left + cell - 4, cy: top + 4, r: 2.2, class: "held"}));
      svg.append(g);
    });
  });
  const scale = h("div", {class: "scale"}, "0%",
    h("span", {class: "ramp"}, [0, 25, 50, 75, 100].map((v) => h("i", {style: `background:${utilColor(v)}`}))),
    "100% utilization", h("i", {class: "swatch held-key"}), "held by a job",
    h("i", {class: "swatch ring-key unhealthy"}), "unhealthy", h("i", {class: "swatch ring-key degraded"}),
    "degraded", h("i", {class: "swatch", style: `background:${utilColor(null)}`}), "no reading");
  return h("div", {class: "heatmap-box"}, h("div", {class: "scroll"}, svg), scale);
}

// A horizontal bar of parts: [{value, color, label}] out of `total`.
export function meter(parts, total, attrs) {
  return h("div", {class: "meter", ...attrs}, parts.filter((p) => p.value > 0).map((p) => h("i", {
    style: `width:${(100 * p.value) / Math.max(total, 1)}%;background:${p.color}`, title: `${p.label}: ${p.value}`,
  })));
}

// bars: [{label, parts: [{name, value}]}], stacked, one color per part name (`names` in order).
export function stackedBars({title, bars, names, unit = "", width = 1300, height = 240, testid}) {
  const W = width;
  const H = height;
  const M = {l: 50, r: 10, t: 10, b: 24};
  const totals = bars.map((b) => b.parts.reduce((a, p) => a + p.value, 0));
  const top = niceMax(Math.max(0, ...totals) * 1.05);
  const slot = (W - M.l - M.r) / Math.max(1, bars.length);
  const y = (v) => H - M.b - (v / top) * (H - M.t - M.b);
  const svg = s("svg", {viewBox: `0 0 ${W} ${H}`, class: "chart", role: "img", "aria-label": title});
  for (let i = 0; i <= 4; i++) {
    const v = (top * i) / 4;
    svg.append(s("line", {x1: M.l, x2: W - M.r, y1: y(v), y2: y(v), class: "gridline"}),
               s("text", {x: M.l - 6, y: y(v) + 4, class: "tick", "text-anchor": "end"},
                 `${Number(v.toPrecision(3))}${unit}`));
  }
  const every = Math.ceil(bars.length / 10);
  bars.forEach((bar, i) => {
    let base = 0;
    const left = M.l + i * slot + slot * 0.15;
    for (const part of bar.parts) {
      if (!(part.value > 0)) continue;
      const k = names.indexOf(part.name);
      svg.append(s("rect", {x: left, width: slot * 0.7, y: y(base + part.value), height: y(base) - y(base + part.value),
                            fill: color(k < 0 ? names.length : k)},
                   s("title", {}, `${bar.label} ${part.name}: ${Number(part.value.toFixed(2))}${unit}`)));
      base += part.value;
    }
    if (i % every === 0) {
      svg.append(s("text", {x: left + slot * 0.35, y: H - 8, class: "tick", "text-anchor": "middle"}, bar.label));
    }
  });
  const legend = h("div", {class: "legend"}, names.map((name, k) => h("span", {},
    h("i", {class: "swatch", style: `background:${color(k)}`}), name || "(none)")));
  return h("figure", {class: "chart-box", "data-testid": testid}, h("figcaption", {}, title), svg, legend);
}

// spans: [{from, to, label, kind}] and marks: [{at, label, kind}] over [start, end] (ms).
export function timeline({spans, marks, start, end, testid}) {
  const W = 1300;
  const H = 84;
  const M = {l: 10, r: 10};
  const span = Math.max(1, end - start);
  const x = (t) => M.l + ((t - start) / span) * (W - M.l - M.r);
  const svg = s("svg", {viewBox: `0 0 ${W} ${H}`, class: "chart timeline", role: "img",
                        "aria-label": "the job's attempts and events over time", "data-testid": testid});
  svg.append(s("line", {x1: M.l, x2: W - M.r, y1: 34, y2: 34, class: "axis"}));
  for (const sp of spans) {
    const x0 = x(sp.from);
    const x1 = Math.max(x0 + 2, x(sp.to));
    svg.append(s("g", {class: `span ${sp.kind}`},
      s("rect", {x: x0, y: 24, width: x1 - x0, height: 20, rx: 3}),
      s("title", {}, sp.title || sp.label),
      x1 - x0 > 50 ? s("text", {x: x0 + 4, y: 38, class: "span-label"}, sp.label) : null));
  }
  marks.forEach((m, i) => {
    const px = x(m.at);
    svg.append(s("g", {class: `mark ${m.kind}`},
      s("line", {x1: px, x2: px, y1: 16, y2: 52}),
      s("circle", {cx: px, cy: i % 2 ? 56 : 12, r: 4}),
      s("title", {}, m.label)));
  });
  svg.append(s("text", {x: M.l, y: H - 6, class: "tick"}, new Date(start).toLocaleString()),
             s("text", {x: W - M.r, y: H - 6, class: "tick", "text-anchor": "end"}, new Date(end).toLocaleString()));
  return svg;
}
