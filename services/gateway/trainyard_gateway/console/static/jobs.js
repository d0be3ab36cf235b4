// Jobs: the newest jobs the caller may see (GET /v1/jobs), filtered by state, every 5 seconds.

import {api, query} from "./api.js";
import {ago, badge, duration, empty, h, link, replace, section, table} from "./dom.js";

const FILTERS = [["active", ["pending", "running", "restarting"]], ["pending", ["pending"]],
                 ["running", ["running", "restarting"]], ["finished", ["succeeded", "failed", "cancelled"]],
                 ["all", []]];

export function gpusOf(job) {
  const r = job.spec.resources;
  return r.nodes * r.gpus_per_node;
}

export function runtime(job) {
  if (!job.started_at) return null;
  const end = job.finished_at ? new Date(job.finished_at) : new Date();
  return (end - new Date(job.started_at)) / 1000;
}

function rows(jobs) {
  return jobs.map((j) => h("tr", {"data-job": j.id},
    h("td", {}, link(`#/jobs/${encodeURIComponent(j.id)}`, j.name)),
    h("td", {class: "mono"}, j.id),
    h("td", {}, badge(j.state)),
    h("td", {}, `${j.team}/${j.user}`),
    h("td", {}, j.spec.queue),
    h("td", {class: "num"}, `${j.spec.resources.nodes} × ${j.spec.resources.gpus_per_node}`),
    h("td", {class: "num"}, String(j.attempt)),
    h("td", {}, ago(j.created_at)),
    h("td", {}, duration(runtime(j))),
    h("td", {class: "muted reason"}, j.message)));
}

export function mount(main, ctx) {
  let filter = "active";
  const list = h("div");
  const picker = h("div", {class: "segmented"}, FILTERS.map(([name]) => h("button", {
    type: "button", class: name === filter ? "on" : "", "data-filter": name, onclick: (event) => {
      filter = name;
      for (const b of picker.children) b.classList.toggle("on", b === event.currentTarget);
      refresh().catch((error) => ctx.banner(error.message));
    }}, name)));
  replace(main, h("div", {class: "page-head"}, h("h1", {}, "Jobs")),
          section("Jobs, newest first", {}, picker, list));

  async function refresh() {
    const states = FILTERS.find(([name]) => name === filter)[1];
    const page = await api(`/v1/jobs${query({page_size: 200, state: states})}`);
    replace(list, page.jobs.length
      ? table(["name", "id", "state", "team/user", "queue", "nodes × GPUs", "attempt", "submitted", "ran", "message"],
              rows(page.jobs), {"data-testid": "job-table"})
      : empty(`no ${filter === "all" ? "" : `${filter} `}jobs`));
  }
  ctx.every(5000, refresh);
}
