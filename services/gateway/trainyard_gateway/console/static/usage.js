// Usage: GPU-hours and cost by team, project, model (or user, queue) over the last days, from GET /v1/usage:
// one report per day for the chart, one for the whole period for the table, and the daily rows as CSV.

import {ApiError, api, query} from "./api.js";
import {stackedBars} from "./charts.js";
import {empty, h, num, replace, section, table} from "./dom.js";

const GROUPS = ["team", "project", "model", "user", "queue"];
const PERIODS = [7, 14, 30];
const TOP = 7;
const DAY_MS = 86400e3;

function days(count) {
  const today = new Date();
  today.setHours(0, 0, 0, 0);
  const out = [];
  for (let i = count - 1; i >= 0; i--) {
    const from = new Date(today.getTime() - i * DAY_MS);
    out.push({from, to: new Date(from.getTime() + DAY_MS)});
  }
  return out;
}

function label(group) { return group === "" ? "(none)" : group; }

function csv(period, groupBy, daily, currency) {
  const quote = (v) => (/[",\n]/.test(String(v)) ? `"${String(v).replace(/"/g, '""')}"` : String(v));
  const lines = [["day", groupBy, "gpu_hours", "cpu_hours", "cost", "currency", "unpriced_gpu_hours"].join(",")];
  daily.forEach((report, i) => {
    for (const row of report.rows) {
      lines.push([period[i].from.toISOString().slice(0, 10), row.group, row.gpu_hours.toFixed(4),
                  row.cpu_hours.toFixed(4), row.cost.toFixed(2), currency, row.unpriced_gpu_hours.toFixed(4)]
        .map(quote).join(","));
    }
  });
  return lines.join("\n") + "\n";
}

export function mount(main, ctx) {
  let groupBy = "team";
  let period = 14;
  let download = null;
  const totals = h("div");
  const chart = h("div");
  const rows = h("div");
  const exportLink = h("a", {class: "button", "data-testid": "usage-csv", download: "trainyard-usage.csv"},
                       "Export CSV");
  const groupSelect = h("select", {"aria-label": "group by", "data-testid": "usage-group"},
                        GROUPS.map((g) => h("option", {value: g}, g)));
  const periodSelect = h("select", {"aria-label": "period"},
                         PERIODS.map((d) => h("option", {value: d, selected: d === period}, `last ${d} days`)));
  const reload = () => refresh().catch((error) => ctx.banner(error.message));
  groupSelect.addEventListener("change", () => { groupBy = groupSelect.value; reload(); });
  periodSelect.addEventListener("change", () => { period = Number(periodSelect.value); reload(); });
  replace(main, h("div", {class: "page-head"}, h("h1", {}, "Usage"), h("div", {class: "spacer"}),
                  h("label", {}, "by ", groupSelect), periodSelect, exportLink),
          totals, section("GPU-hours per day", {}, chart), section("Over the period", {}, rows));
  ctx.onLeave(() => { if (download) URL.revokeObjectURL(download); });

  async function refresh() {
    const span = days(period);
    let whole;
    let daily;
    try {
      [whole, ...daily] = await Promise.all([
        api(`/v1/usage${query({from: span[0].from.toISOString(), to: span[span.length - 1].to.toISOString(),
                               group_by: groupBy})}`),
        ...span.map((d) => api(`/v1/usage${query({from: d.from.toISOString(), to: d.to.toISOString(),
                                                  group_by: groupBy, limit: 1000})}`))]);
    } catch (error) {
      if (error instanceof ApiError && error.status === 503) {
        replace(totals, h("p", {class: "warn"}, "Usage needs the scheduler's history store (its history_url "
          + `setting) and a reachable scheduler: ${error.message}`));
        replace(chart);
        replace(rows);
        return;
      }
      throw error;
    }
    const c = whole.currency;
    replace(totals, h("div", {class: "tiles"},
      h("div", {class: "tile", "data-testid": "usage-gpu-hours"}, h("div", {class: "value"}, num(whole.total.gpu_hours)),
        h("div", {class: "label"}, "GPU-hours")),
      h("div", {class: "tile"}, h("div", {class: "value"}, `${num(whole.total.cost, 2)} ${c}`),
        h("div", {class: "label"}, "cost")),
      h("div", {class: "tile"}, h("div", {class: "value"}, num(whole.total.cpu_hours)), h("div", {class: "label"}, "CPU-hours")),
      whole.unpriced_models.length ? h("div", {class: "tile"}, h("div", {class: "value"}, num(whole.total.unpriced_gpu_hours)),
        h("div", {class: "label"}, "GPU-hours without a price"), h("small", {}, whole.unpriced_models.join(", "))) : null));
    const top = whole.rows.slice(0, TOP).map((r) => r.group);
    const names = [...top.map(label), ...(whole.rows.length > TOP ? ["other"] : [])];
    const bars = daily.map((report, i) => ({
      label: span[i].from.toLocaleDateString([], {month: "short", day: "numeric"}),
      parts: report.rows.reduce((parts, r) => {
        const name = top.includes(r.group) ? label(r.group) : "other";
        const part = parts.find((p) => p.name === name);
        if (part) part.value += r.gpu_hours; else parts.push({name, value: r.gpu_hours});
        return parts;
      }, []),
    }));
    replace(chart, whole.rows.length ? stackedBars({title: `GPU-hours by ${groupBy}`, bars, names, unit: " h",
                                                    testid: "usage-chart"}) : empty("no use in this period"));
    replace(rows, whole.rows.length ? table([groupBy, "GPU-hours", "CPU-hours", `cost (${c})`, "unpriced GPU-hours"],
      whole.rows.map((r) => h("tr", {}, h("td", {}, label(r.group)), h("td", {class: "num"}, num(r.gpu_hours, 2)),
        h("td", {class: "num"}, num(r.cpu_hours, 2)), h("td", {class: "num"}, num(r.cost, 2)),
        h("td", {class: "num"}, r.unpriced_gpu_hours ? num(r.unpriced_gpu_hours, 2) : ""))),
      {"data-testid": "usage-table"}) : empty("no use in this period"));
    if (download) URL.revokeObjectURL(download);
    download = URL.createObjectURL(new Blob([csv(span, groupBy, daily, c)], {type: "text/csv"}));
    exportLink.href = download;
    exportLink.download = `trainyard-usage-${groupBy}-${period}d.csv`;
  }
  ctx.every(60000, refresh);
}
