// The console's one way to the gateway's JSON API: the bearer token from this tab's sessionStorage in the
// Authorization header of each request (never in a URL or a cookie), errors as ApiError with the API's own
// message, and server-sent events read from fetch() (EventSource cannot send a header).

const TOKEN_KEY = "trainyard.token";

export class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
}

export const session = {
  token() { return sessionStorage.getItem(TOKEN_KEY); },
  save(token) { sessionStorage.setItem(TOKEN_KEY, token); },
  clear() { sessionStorage.removeItem(TOKEN_KEY); },
};

// Told when a request is answered 401: the token expired or was revoked (app.js shows the login again).
let onUnauthenticated = () => {};
export function whenUnauthenticated(handler) { onUnauthenticated = handler; }

function headers(token, extra) {
  return {Authorization: `Bearer ${token}`, ...extra};
}

async function failure(response) {
  let code = "error";
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body && body.error) ({code, message} = body.error);
  } catch { /* not the API's error body (a proxy's page): keep the status line */ }
  if (response.status === 401) onUnauthenticated(message);
  return new ApiError(response.status, code, message);
}

// GET (or another method with a JSON body). `token` overrides the session's (the login form tries one).
export async function api(path, {method = "GET", body, signal, token} = {}) {
  const secret = token || session.token();
  if (!secret) throw new ApiError(401, "unauthenticated", "not logged in");
  const extra = body === undefined ? {} : {"Content-Type": "application/json"};
  const response = await fetch(path, {method, signal, headers: headers(secret, extra), cache: "no-store",
                                      body: body === undefined ? undefined : JSON.stringify(body)});
  if (!response.ok) throw await failure(response);
  const type = response.headers.get("content-type") || "";
  return type.includes("application/json") ? response.json() : response.text();
}

export function query(params) {
  const q = new URLSearchParams();
  for (const [key, value] of Object.entries(params)) {
    if (value === undefined || value === null || value === "") continue;
    for (const v of Array.isArray(value) ? value : [value]) q.append(key, String(v));
  }
  const text = q.toString();
  return text ? `?${text}` : "";
}

// One server-sent-events response: calls onEvent({id, event, data}) for each event until the stream ends
// (returns) or fails (throws). Comments (keepalives) are skipped.
async function readEvents(path, {lastEventId, signal, onEvent}) {
  const extra = {Accept: "text/event-stream"};
  if (lastEventId) extra["Last-Event-ID"] = lastEventId;
  const response = await fetch(path, {headers: headers(session.token(), extra), signal, cache: "no-store"});
  if (!response.ok) throw await failure(response);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += value.replace(/\r\n?/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const event = {id: "", event: "message", data: ""};
      for (const line of block.split("\n")) {
        if (!line || line.startsWith(":")) continue;
        const colon = line.indexOf(":");
        const field = colon < 0 ? line : line.slice(0, colon);
        const text = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
        if (field === "data") event.data += (event.data ? "\n" : "") + text;
        else if (field === "id" || field === "event") event[field] = text;
      }
      if (!event.data) continue;
      onEvent({...event, data: JSON.parse(event.data)});
    }
  }
}

// Follows a stream across dropped connections: reconnects (1 s, doubling to 15 s) with the last event id, so
// the gateway resumes where it left off, until an `end` event, a refusal (4xx), or stop(). onStatus tells
// the page "live", "reconnecting" or "ended".
export function follow(path, {onEvent, onStatus = () => {}, onError = () => {}}) {
  const controller = new AbortController();
  let lastEventId = "";
  let ended = false;
  let delay = 1000;
  (async () => {
    while (!ended && !controller.signal.aborted) {
      try {
        onStatus("live");
        await readEvents(path, {lastEventId, signal: controller.signal, onEvent: (event) => {
          if (event.id) lastEventId = event.id;
          delay = 1000;
          if (event.event === "end") ended = true;
          onEvent(event);
        }});
      } catch (error) {
        if (controller.signal.aborted) return;
        if (error instanceof ApiError && error.status < 500 && error.status !== 429) {
          onError(error);
          onStatus("ended");
          return;
        }
        onError(error);
      }
      if (ended || controller.signal.aborted) break;
      onStatus("reconnecting");
      await new Promise((resolve) => setTimeout(resolve, delay));
      delay = Math.min(delay * 2, 15000);
    }
    if (!controller.signal.aborted) onStatus("ended");
  })();
  return {stop() { controller.abort(); }};
}
