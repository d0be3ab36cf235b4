// The console's shell: log in with a token, ask the gateway who it is (GET /v1/whoami), then show the page the
// location's hash names (#/fleet, #/nodes/<id>, #/queues, #/jobs, #/jobs/<id>, #/usage). Each page is a module
// whose mount(main, ctx, ...params) draws it and returns what stops its polling and streams when the user
// leaves it. The hash keeps ids out of the requests the page makes to the server.

import {ApiError, api, session, whenUnauthenticated} from "./api.js";
import {h, replace} from "./dom.js";
import * as fleet from "./fleet.js";
import * as job from "./job.js";
import * as jobs from "./jobs.js";
import * as node from "./node.js";
import * as queues from "./queues.js";
import * as usage from "./usage.js";

const ROUTES = [
  [/^\/fleet$/, fleet, "fleet"],
  [/^\/nodes\/([^/]+)$/, node, "fleet"],
  [/^\/queues$/, queues, "queues"],
  [/^\/jobs$/, jobs, "jobs"],
  [/^\/jobs\/([^/]+)$/, job, "jobs"],
  [/^\/usage$/, usage, "usage"],
];

const main = document.getElementById("main");
const banner = document.getElementById("banner");
let me = null;
let leave = null;

function showBanner(text) {
  if (!text) { banner.hidden = true; return; }
  replace(banner, text);
  banner.hidden = false;
}

// Runs `task` now and every `ms` while the page is shown, never two at once; a failure is shown in the
// banner and the next round tries again.
function poller(stops) {
  return (ms, task) => {
    let timer = null;
    let stopped = false;
    const round = async () => {
      try {
        await task();
        showBanner("");
      } catch (error) {
        if (!(error instanceof ApiError && error.status === 401)) showBanner(error.message);
      }
      if (!stopped) timer = setTimeout(round, ms);
    };
    round();
    stops.push(() => { stopped = true; clearTimeout(timer); });
  };
}

function can(action) {
  return Boolean(me && me.actions.includes(action));
}

function show() {
  if (leave) { leave(); leave = null; }
  showBanner("");
  if (!me) return;
  const path = decodeURIComponent(location.hash.replace(/^#/, "")) || "/fleet";
  for (const [pattern, page, tab] of ROUTES) {
    const match = pattern.exec(path);
    if (!match) continue;
    for (const a of document.querySelectorAll("#nav a")) a.classList.toggle("active", a.dataset.page === tab);
    const stops = [];
    const ctx = {me, can, every: poller(stops), onLeave: (f) => stops.push(f), banner: showBanner};
    replace(main);
    page.mount(main, ctx, ...match.slice(1));
    leave = () => stops.forEach((stop) => stop());
    return;
  }
  replace(main, h("section", {class: "panel"}, h("h2", {}, "Not found"),
                  h("p", {}, "No page at ", h("code", {}, path), ". ", h("a", {href: "#/fleet"}, "Fleet"))));
}

function header() {
  const signedIn = Boolean(me);
  document.getElementById("nav").hidden = !signedIn;
  document.getElementById("logout").hidden = !signedIn;
  const who = document.getElementById("whoami");
  who.hidden = !signedIn;
  if (signedIn) {
    const t = me.token;
    replace(who, `${t.team}/${t.user}`, " ", h("span", {class: `role ${t.role}`, "data-testid": "role"}, t.role));
    who.title = `token ${t.token_id}` + (t.expires_at ? `, expires ${new Date(t.expires_at).toLocaleString()}` : "");
  }
}

function login(message) {
  if (leave) { leave(); leave = null; }
  me = null;
  header();
  showBanner("");
  const input = h("input", {type: "password", id: "token", name: "token", autocomplete: "off", required: true,
                            placeholder: "ty_…", "aria-label": "API token", spellcheck: "false"});
  const error = h("p", {class: "error", "data-testid": "login-error"}, message || "");
  const form = h("form", {class: "login", "data-testid": "login"},
    h("h1", {}, "Trainyard console"),
    h("p", {}, "Log in with an API token (", h("code", {}, "trainyard tokens create"),
      ", or the local cluster's token in .trainyard/local.env). It is kept in this tab only."),
    h("label", {for: "token"}, "Token"), input,
    h("button", {type: "submit"}, "Log in"), error);
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const token = input.value.trim();
    try {
      me = await api("/v1/whoami", {token});
    } catch (failure) {
      replace(error, failure.message);
      return;
    }
    session.save(token);
    header();
    if (!location.hash || location.hash === "#/") location.hash = "#/fleet";
    else show();
  });
  replace(main, form);
  input.focus();
}

async function start() {
  whenUnauthenticated((message) => { session.clear(); login(message); });
  document.getElementById("logout").addEventListener("click", () => { session.clear(); login(""); });
  window.addEventListener("hashchange", show);
  try {
    const config = await (await fetch("config.json", {cache: "no-store"})).json();
    if (config.prometheus_url) {
      const link = document.getElementById("prometheus-link");
      link.href = config.prometheus_url;
      link.hidden = false;
    }
  } catch { /* no link */ }
  if (!session.token()) { login(""); return; }
  try {
    me = await api("/v1/whoami");
  } catch (error) {
    if (!(error instanceof ApiError && error.status === 401)) login(error.message);
    return;
  }
  header();
  show();
}

start();
