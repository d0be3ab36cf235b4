// Queues: the waiting jobs in the order the scheduler's last cycle put them, with why each waits (GET
// /v1/pending), the queues (GET /v1/queues), and the teams' quotas with what they use and borrow (GET
// /v1/quotas). Every 5 seconds.

import {api, query} from "./api.js";
import {meter} from "./charts.js";
import {ago, badge, empty, h, link, replace, section, table, when} from "./dom.js";

const LIMIT = 500;

// The reason's first words name the kind of wait; the badge's colour follows it.
function reasonKind(job) {
  if (job.held) return "held";
  const r = job.reason.toLowerCase();
  for (const kind of ["quota", "reservation", "preempt", "restart", "topology", "fit"]) {
    if (r.includes(kind)) return kind;
  }
  return "waiting";
}

function pendingTable(pending) {
  if (!pending.jobs.length) return empty("no job is waiting");
  const rows = pending.jobs.map((j) => h("tr", {"data-job": j.job_id},
    h("td", {class: "num"}, j.held ? "held" : `${j.position} / ${j.queue_length}`),
    h("td", {}, j.queue),
    h("td", {}, link(`#/jobs/${encodeURIComponent(j.job_id)}`, j.job_id)),
    h("td", {}, `${j.team}/${j.user}`),
    h("td", {}, badge(reasonKind(j), `reason-${reasonKind(j)}`)),
    h("td", {class: "reason"}, j.reason),
    h("td", {}, j.queued_at ? ago(j.queued_at) : "—")));
  return h("div", {},
    h("p", {class: "muted"}, `${pending.total} waiting`, pending.total > pending.jobs.length ? ` (first ${pending.jobs.length} shown)` : "",
      pending.as_of ? `; order as of the scheduling cycle at ${when(pending.as_of)}` : "; no scheduling cycle has run yet"),
    table(["place", "queue", "job", "team/user", "why", "", "waiting"], rows, {"data-testid": "pending-table"}));
}

function queueTable(queues, pending) {
  const waiting = new Map();
  for (const j of pending.jobs) waiting.set(j.queue, (waiting.get(j.queue) || 0) + 1);
  const rows = queues.map((q) => h("tr", {"data-queue": q.name},
    h("td", {}, q.name), h("td", {class: "num"}, String(q.tier)),
    h("td", {class: "num"}, q.max_gpus ? String(q.max_gpus) : "no cap"),
    h("td", {class: "num"}, String(waiting.get(q.name) || 0)),
    h("td", {}, Object.entries(q.node_labels).map(([k, v]) => `${k}=${v}`).join(", ")),
    h("td", {class: "muted"}, q.description)));
  return table(["queue", "tier", "GPU cap", "waiting", "node labels", "description"], rows);
}

function quotaTable(quotas) {
  if (!quotas.length) return empty("no team has a quota: every team shares the idle GPUs");
  const rows = [];
  for (const q of quotas) {
    const keys = [...new Set([...Object.keys(q.limits), ...Object.keys(q.use)])].sort();
    keys.forEach((key, i) => {
      const limit = q.limits[key];
      const use = q.use[key] || {in_use: 0, borrowed: 0};
      const nominal = limit ? limit.nominal : 0;
      const cap = limit && limit.borrow_limit !== null ? nominal + limit.borrow_limit : null;
      const scale = Math.max(use.in_use, cap ?? nominal + Math.max(use.borrowed, 1), 1);
      rows.push(h("tr", {"data-team": q.team, "data-key": key},
        h("td", {}, i === 0 ? q.team : ""), h("td", {class: "num"}, i === 0 ? String(q.weight) : ""),
        h("td", {}, key),
        h("td", {class: "num"}, limit ? String(nominal) : "—"),
        h("td", {class: "num"}, limit ? (limit.borrow_limit === null ? "no limit" : String(limit.borrow_limit)) : "—"),
        h("td", {class: "num"}, String(use.in_use)),
        h("td", {class: "num"}, use.borrowed ? String(use.borrowed) : ""),
        h("td", {class: "wide"}, meter([
          {value: use.in_use - use.borrowed, color: "#2563eb", label: "in use within nominal"},
          {value: use.borrowed, color: "#f59e0b", label: "borrowed"},
          {value: Math.max(0, nominal - (use.in_use - use.borrowed)), color: "#dbeafe", label: "nominal unused"},
        ], scale))));
    });
  }
  return h("div", {},
    table(["team", "weight", "model", "nominal", "may borrow", "in use", "borrowed", ""], rows,
          {"data-testid": "quota-table"}),
    h("p", {class: "hint"}, h("i", {class: "swatch", style: "background:#2563eb"}), "in use within nominal ",
      h("i", {class: "swatch", style: "background:#f59e0b"}), "borrowed (reclaimed first) ",
      h("i", {class: "swatch", style: "background:#dbeafe"}), "nominal not in use"));
}

export function mount(main, ctx) {
  const pendingBox = h("div");
  const queueBox = h("div");
  const quotaBox = h("div");
  replace(main, h("div", {class: "page-head"}, h("h1", {}, "Queues")),
    section("Waiting jobs, in the order they would be placed", {}, pendingBox),
    h("div", {class: "columns"}, section("Queues", {}, queueBox), section("Quotas", {}, quotaBox)));
  ctx.every(5000, async () => {
    const [pending, {queues}, {quotas}] = await Promise.all([
      api(`/v1/pending${query({limit: LIMIT})}`), api("/v1/queues"), api("/v1/quotas")]);
    replace(pendingBox, pendingTable(pending));
    replace(queueBox, queueTable(queues, pending));
    replace(quotaBox, quotaTable(quotas));
  });
}
