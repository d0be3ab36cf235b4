// A job's checkpoints (GET /v1/jobs/{id}/checkpoints) with their lineage: each attempt's saves in order, the
// one a restart resumed from, and what each declared (code version, parameters).

import {api, query} from "./api.js";
import {badge, bytes, empty, h, replace, table, when} from "./dom.js";

const PAGE = 500;

function lineage(checkpoints) {
  const attempts = new Map();
  for (const c of checkpoints) {
    if (!attempts.has(c.attempt)) attempts.set(c.attempt, []);
    attempts.get(c.attempt).push(c);
  }
  let lastCommitted = null;
  return h("div", {class: "lineage", "data-testid": "checkpoint-lineage"},
    [...attempts.entries()].sort((a, b) => a[0] - b[0]).map(([attempt, saves]) => {
      const from = lastCommitted;
      const row = h("div", {class: "lineage-row"},
        h("span", {class: "lineage-attempt"}, `attempt ${attempt}`),
        from ? h("span", {class: "lineage-from", title: from.id}, `resumed from step ${from.step} ›`) : null,
        saves.map((c) => h("span", {class: `lineage-ckpt ${c.state}${c.latest ? " latest" : ""}`,
                                    title: `${c.id}: ${c.state}${c.tags.length ? `, tags ${c.tags.join(", ")}` : ""}`},
          `step ${c.step}`)));
      const committed = saves.filter((c) => c.state === "committed");
      if (committed.length) lastCommitted = committed[committed.length - 1];
      return row;
    }));
}

function rows(checkpoints) {
  return [...checkpoints].reverse().map((c) => h("tr", {"data-checkpoint": c.id},
    h("td", {class: "mono"}, c.id), h("td", {class: "num"}, String(c.step)), h("td", {class: "num"}, String(c.attempt)),
    h("td", {}, badge(c.state), c.latest ? badge("latest", "latest") : null),
    h("td", {}, c.tags.join(", ")), h("td", {class: "num"}, bytes(c.size_bytes)),
    h("td", {class: "num"}, String(c.world_size)), h("td", {}, when(c.committed_at || c.created_at)),
    h("td", {class: "mono"}, c.lineage.code_version || "—"),
    h("td", {}, Object.entries(c.lineage.parameters).map(([k, v]) => `${k}=${v}`).join(" ")),
    h("td", {class: "muted"}, c.abort_reason || c.damage)));
}

export async function checkpointsInto(box, jobId) {
  let answer;
  try {
    answer = await api(`/v1/jobs/${encodeURIComponent(jobId)}/checkpoints${query({page_size: PAGE})}`);
  } catch (error) {
    replace(box, h("p", {class: "muted"}, `Checkpoints cannot be read: ${error.message}`));
    return;
  }
  const list = answer.checkpoints;
  if (!list.length) {
    replace(box, empty("no checkpoints: the job has not saved one through the checkpoint client"));
    return;
  }
  replace(box, lineage(list),
          table(["checkpoint", "step", "attempt", "state", "tags", "size", "ranks", "saved", "code", "parameters", ""],
                rows(list), {"data-testid": "checkpoint-table"}));
}
