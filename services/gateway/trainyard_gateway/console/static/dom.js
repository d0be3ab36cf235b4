// Building the page: elements from data, never HTML from data. Every text the API returns goes into the page
// as a text node or an attribute value, so a job name or a log line can never become markup.

const SVG_NS = "http://www.w3.org/2000/svg";

function append(parent, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    parent.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
}

function apply(el, attrs) {
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") {
      el.addEventListener(key.slice(2), value);
    } else if (key === "text") {
      el.textContent = String(value);
    } else if (key === "style") {
      // Through the CSSOM: the Content-Security-Policy refuses style attributes written as markup.
      el.style.cssText = String(value);
    } else {
      el.setAttribute(key, value === true ? "" : String(value));
    }
  }
  return el;
}

// h("a", {href: "#/x", class: "link"}, "text", child, [more, children])
export function h(tag, attrs, ...children) {
  const el = apply(document.createElement(tag), attrs);
  append(el, children);
  return el;
}

export function s(tag, attrs, ...children) {
  const el = apply(document.createElementNS(SVG_NS, tag), attrs);
  append(el, children);
  return el;
}

export function replace(el, ...children) {
  el.replaceChildren();
  append(el, children);
  return el;
}

export function section(title, attrs, ...children) {
  return h("section", {class: "panel", ...attrs}, h("h2", {}, title), ...children);
}

export function table(headers, rows, attrs) {
  return h("table", {class: "grid", ...attrs},
    h("thead", {}, h("tr", {}, headers.map((x) => h("th", {}, x)))),
    h("tbody", {}, rows));
}

export function badge(text, kind) {
  return h("span", {class: `badge ${kind || text}`}, text);
}

export function empty(text) {
  return h("p", {class: "empty"}, text);
}

export function link(href, text, attrs) {
  return h("a", {href, ...attrs}, text);
}

// --- formatting ------------------------------------------------------------------------------------------

export function when(iso) {
  if (!iso) return "—";
  const d = new Date(iso);
  return d.toLocaleString([], {month: "short", day: "numeric", hour: "2-digit", minute: "2-digit",
                               second: "2-digit"});
}

export function duration(seconds) {
  if (seconds === null || seconds === undefined || !isFinite(seconds)) return "—";
  const s = Math.max(0, Math.round(seconds));
  if (s < 60) return `${s}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m ${s % 60}s`;
  if (s < 86400) return `${Math.floor(s / 3600)}h ${Math.floor((s % 3600) / 60)}m`;
  return `${Math.floor(s / 86400)}d ${Math.floor((s % 86400) / 3600)}h`;
}

export function ago(iso) {
  if (!iso) return "—";
  return duration((Date.now() - new Date(iso).getTime()) / 1000) + " ago";
}

export function bytes(n) {
  if (!n) return "0 B";
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
  return `${n.toFixed(i ? 1 : 0)} ${units[i]}`;
}

export function num(x, digits = 1) {
  if (x === null || x === undefined) return "—";
  const n = Number(x);
  // Small amounts (a few GPU-minutes) keep two significant digits rather than rounding to 0.
  if (n !== 0 && Math.abs(n) < 10 ** -digits * 5) return n.toPrecision(2);
  return n.toLocaleString([], {maximumFractionDigits: digits});
}

export function pct(part, whole) {
  return whole ? Math.round((100 * part) / whole) : 0;
}
