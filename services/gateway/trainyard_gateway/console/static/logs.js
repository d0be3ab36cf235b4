// A job's live logs: GET /v1/jobs/{id}/logs?follow=true as server-sent events, resumed after a dropped
// connection from the last line's id (nothing twice, nothing left out), until the job ends.

import {follow, query} from "./api.js";
import {h, replace} from "./dom.js";

const MAX_LINES = 5000;
const TAIL = 500;

export function logPanel(jobId) {
  const status = h("span", {class: "stream-status", "data-testid": "log-status"}, "connecting");
  const pre = h("pre", {class: "logs", "data-testid": "job-logs", tabindex: 0});
  const onlyRank = h("input", {type: "number", min: 0, placeholder: "all ranks", "aria-label": "only this rank",
                               class: "rank-filter"});
  let stream = null;
  let lines = 0;

  function append(text, kind) {
    const atBottom = pre.scrollTop + pre.clientHeight >= pre.scrollHeight - 8;
    pre.append(h("span", {class: kind}, text + "\n"));
    lines += 1;
    if (lines > MAX_LINES) { pre.firstChild.remove(); lines -= 1; }
    if (atBottom) pre.scrollTop = pre.scrollHeight;
  }

  function start() {
    if (stream) stream.stop();
    replace(pre);
    lines = 0;
    const rank = onlyRank.value === "" ? undefined : Number(onlyRank.value);
    const path = `/v1/jobs/${encodeURIComponent(jobId)}/logs${query({follow: true, tail: TAIL, rank})}`;
    stream = follow(path, {
      onEvent({event, data}) {
        if (event === "line") append(`[rank ${data.rank}] ${data.text}`, data.stream === "stderr" ? "stderr" : "");
        else if (event === "warning") append(`[gateway] ${data.node}: ${data.message}`, "note");
        else if (event === "end") {
          append(`[gateway] the job ended: ${data.state}${data.exit_code !== null ? ` (exit code ${data.exit_code})` : ""}`,
                 "note");
        }
      },
      onStatus(state) { replace(status, state); status.className = `stream-status ${state}`; },
      onError(error) { append(`[console] ${error.message}`, "note"); },
    });
  }

  onlyRank.addEventListener("change", start);
  const panel = h("div", {class: "log-panel"},
    h("div", {class: "toolbar"}, "Following ", status, h("label", {}, " rank ", onlyRank),
      h("button", {type: "button", class: "quiet", onclick: () => { pre.scrollTop = pre.scrollHeight; }}, "Bottom")),
    pre);
  start();
  return {panel, stop() { if (stream) stream.stop(); }};
}
