// Job: its state (watched live: GET /v1/jobs/{id}/events?watch=true), a timeline of attempts, restarts and
// preemptions, its placement drawn on the fabric, the utilization of its GPUs over time (so a starved input
// pipeline shows), its live logs and its checkpoints; cancel, hold and release for who may.

import {ApiError, api, follow, query} from "./api.js";
import {color, lineChart, timeline} from "./charts.js";
import {checkpointsInto} from "./checkpoints.js";
import {badge, duration, empty, h, link, num, replace, section, table, when} from "./dom.js";
import {gpusOf, runtime} from "./jobs.js";
import {logPanel} from "./logs.js";
import {fabric, legend} from "./topology.js";

const TERMINAL = new Set(["succeeded", "failed", "cancelled"]);
const IDLE_PERCENT = 20;
const IDLE_WINDOW_MS = 5 * 60 * 1000;
const POINTS = 120;

function ms(iso) { return iso ? new Date(iso).getTime() : null; }

// When the current attempt's gang was placed: its last "admitted" event.
function currentStart(job) {
  const admitted = job.events.filter((e) => e.kind === "admitted");
  return admitted.length ? ms(admitted[admitted.length - 1].at) : ms(job.started_at);
}

function head(job, ctx, act) {
  const r = job.spec.resources;
  const mine = job.user === ctx.me.token.user;
  const controls = [];
  if (!TERMINAL.has(job.state) && !job.cancel_requested &&
      (ctx.can("jobs.cancel_any") || (ctx.can("jobs.cancel") && mine))) {
    controls.push(h("button", {type: "button", class: "admin-control danger", "data-testid": "cancel",
                               onclick: () => act("cancel")}, "Cancel"));
  }
  if (ctx.can("jobs.update_any") || (ctx.can("jobs.update") && mine)) {
    if (job.state === "pending" && !job.held_by) {
      controls.push(h("button", {type: "button", class: "admin-control", "data-testid": "hold",
                                 onclick: () => act("hold")}, "Hold"));
    } else if (job.held_by) {
      controls.push(h("button", {type: "button", class: "admin-control", "data-testid": "release",
                                 onclick: () => act("release")}, "Release"));
    }
  }
  return h("div", {class: "page-head"},
    h("h1", {}, link("#/jobs", "Jobs"), " › ", job.name),
    h("span", {"data-testid": "job-state"}, badge(job.state)),
    job.held_by ? badge(`held by ${job.held_by}`, "held") : null,
    h("span", {class: "mono job-id"}, job.id),
    h("div", {class: "spacer"}), ...controls,
    h("p", {class: "facts"}, [
      `${job.team}/${job.user}`, `queue ${job.spec.queue}`, `priority ${job.spec.priority}`,
      `${r.nodes} × ${r.gpus_per_node} ${r.accelerator || r.accelerators.join("|") || "GPUs"}`,
      `attempt ${job.attempt}`, `${job.restarts} restarts of ${job.spec.max_restarts}`,
      job.infra_restarts ? `${job.infra_restarts} after infrastructure failures` : "",
      job.preempted_by.length ? `preempted by ${job.preempted_by.join(", ")}` : "",
      job.started_at ? `ran ${duration(runtime(job))}` : "", job.exit_code !== null ? `exit code ${job.exit_code}` : "",
    ].filter(Boolean).join(" · ")),
    job.message ? h("p", {class: "message", "data-testid": "job-message"}, job.message) : null);
}

function history(job) {
  const now = Date.now();
  const start = ms(job.created_at) || now;
  const end = ms(job.finished_at) || now;
  const spans = job.attempts.map((a) => ({from: ms(a.started_at), to: ms(a.ended_at) || end, kind: a.outcome,
    label: `#${a.attempt} ${a.outcome}`,
    title: `attempt ${a.attempt} on ${a.nodes.join(", ")} (${a.gpus} ${a.model || "GPUs"}): ${a.outcome}` +
           (a.reason ? `, ${a.reason}` : "")})).filter((sp) => sp.from);
  const ended = new Set(job.attempts.map((a) => a.attempt));
  if (["admitted", "running"].includes(job.state) && !ended.has(job.attempt) && currentStart(job)) {
    spans.push({from: currentStart(job), to: end, kind: job.state, label: `#${job.attempt} ${job.state}`});
  }
  const marks = job.events.map((e) => ({at: ms(e.at), kind: e.kind, label: `${when(e.at)} ${e.kind}: ${e.message}`}));
  const attempts = job.attempts.length ? table(["attempt", "nodes", "GPUs", "model", "placed", "ended", "outcome", "why"],
    job.attempts.map((a) => h("tr", {}, h("td", {class: "num"}, String(a.attempt)), h("td", {}, a.nodes.join(", ")),
      h("td", {class: "num"}, String(a.gpus)), h("td", {}, a.model), h("td", {}, when(a.started_at)),
      h("td", {}, when(a.ended_at)), h("td", {}, badge(a.outcome)), h("td", {class: "muted"}, a.reason)))) : null;
  const events = table(["time", "event", "message"], [...job.events].reverse().map((e) => h("tr", {class: e.kind},
    h("td", {}, when(e.at)), h("td", {}, badge(e.kind)), h("td", {}, e.message))), {"data-testid": "job-events"});
  return h("div", {}, timeline({spans, marks, start, end, testid: "job-timeline"}), attempts,
           h("details", {}, h("summary", {}, `${job.events.length} events`), events));
}

async function placement(job) {
  if (!job.placement.length) return empty(TERMINAL.has(job.state) ? "the job holds no GPUs now" : "not placed yet");
  const {nodes} = await api("/v1/nodes");
  const mine = new Map(job.placement.map((a) => [a.node_id, new Set(a.gpu_indices)]));
  const rows = job.placement.map((a) => h("tr", {}, h("td", {class: "num"}, String(a.node_rank)),
    h("td", {}, link(`#/nodes/${encodeURIComponent(a.node_id)}`, a.node_id)), h("td", {}, a.gpu_indices.join(", ")),
    h("td", {}, a.model), h("td", {}, a.ranks.length > 8 ? `${a.ranks[0]}–${a.ranks[a.ranks.length - 1]}` : a.ranks.join(", "))));
  return h("div", {}, fabric(nodes.filter((n) => mine.has(n.node_id)), mine), legend(),
           table(["node rank", "node", "GPUs", "model", "ranks"], rows, {"data-testid": "placement-table"}));
}

async function utilization(job) {
  if (!job.placement.length) return empty("no GPUs held now");
  const end = Date.now();
  const since = currentStart(job) || end;
  const window = Math.min(3600, Math.max(60, Math.ceil((end - since) / 1000) + 30));
  const series = [];
  let interval = 1;
  await Promise.all(job.placement.map(async (a) => {
    const m = await api(`/v1/nodes/${encodeURIComponent(a.node_id)}/metrics${query({window, points: POINTS})}`);
    interval = Math.max(interval, m.interval_s);
    for (const g of m.gpus) {
      if (!a.gpu_indices.includes(g.index)) continue;
      series.push({name: `${a.node_id}/${g.index}`, points: g.samples.map((x) => [ms(x.time), x.utilization_percent])
        .filter(([t]) => t >= since)});
    }
  }));
  series.sort((a, b) => a.name.localeCompare(b.name)).forEach((x, i) => { x.color = color(i); });
  const recent = series.flatMap((x) => x.points.filter(([t]) => t >= end - IDLE_WINDOW_MS).map((p) => p[1]));
  const mean = recent.length ? recent.reduce((a, b) => a + b, 0) / recent.length : null;
  const note = mean === null ? null : mean < IDLE_PERCENT && job.state === "running"
    ? h("p", {class: "warn", "data-testid": "idle-warning"}, `The job's GPUs averaged ${num(mean)}% over the last 5 `
        + "minutes: they are mostly idle. Is the input pipeline (data loader) keeping up?")
    : h("p", {class: "muted"}, `mean utilization over the last 5 minutes: ${num(mean)}%`);
  return h("div", {}, lineChart({title: `Utilization of the job's ${gpusOf(job)} GPUs`, series, unit: "%", yMax: 100,
                                 start: Math.max(since, end - window * 1000), end, testid: "job-gpu-chart",
                                 gapMs: 3000 * Math.max(interval, window / POINTS)}), note);
}

export function mount(main, ctx, jobId) {
  const id = encodeURIComponent(jobId);
  const headBox = h("div");
  const historyBox = h("div");
  const placementBox = h("div");
  const utilBox = h("div");
  const checkpointBox = h("div");
  const logs = logPanel(jobId);
  let job = null;
  replace(main, headBox, section("Timeline", {}, historyBox),
    h("div", {class: "columns"}, section("Placement", {}, placementBox),
      section("GPU utilization", {}, utilBox)),
    section("Logs", {}, logs.panel), section("Checkpoints", {}, checkpointBox));
  ctx.onLeave(() => logs.stop());

  async function act(verb) {
    try {
      show(await api(`/v1/jobs/${id}:${verb}`, {method: "POST"}));
    } catch (error) {
      ctx.banner(error.message);
    }
  }

  function show(next) {
    job = next;
    replace(headBox, head(job, ctx, act));
    replace(historyBox, history(job));
  }

  const watch = follow(`/v1/jobs/${id}/events${query({watch: true})}`, {
    onEvent({event, data}) { if (event === "job") show(data); },
    onError(error) { if (error instanceof ApiError && error.status === 404) ctx.banner(`job ${jobId}: ${error.message}`); },
  });
  ctx.onLeave(() => watch.stop());

  ctx.every(5000, async () => {
    const current = job || await api(`/v1/jobs/${id}`);
    if (!job) show(current);
    replace(historyBox, history(job));  // the running attempt's span grows
    const [where, util] = await Promise.all([placement(job), utilization(job).catch((error) =>
      h("p", {class: "warn"}, `No telemetry: ${error.message}`))]);
    replace(placementBox, where);
    replace(utilBox, util);
    await checkpointsInto(checkpointBox, jobId);
  });
}
