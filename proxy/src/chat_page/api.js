// The page's side of mlxd's public API: the request headers (with the API key kept in this
// browser), the model list, a streamed chat completion read event by event, and errors
// turned into sentences a person can act on.

export function headers() {
  const h = { "content-type": "application/json" };
  const key = localStorage.getItem("mlxd-api-key");
  if (key) h.authorization = "Bearer " + key;
  return h;
}

const sentence = (s) => {
  const t = s.trim().replace(/\s+/g, " ");
  if (!t) return t;
  const first = t.charAt(0).toUpperCase() + t.slice(1);
  return /[.!?…]$/.test(first) ? first : first + ".";
};

/// The message of one engine log line: its JSON form (`{"level":…,"fields":{"message":…}}`,
/// or `msg`/`message` at the top) or the line itself.
function logLineMessage(line) {
  const t = line.trim();
  if (!t.startsWith("{")) return t;
  try {
    const v = JSON.parse(t);
    const f = v.fields || {};
    const msg = f.message || v.message || v.msg || "";
    const extra = f.error || v.error || "";
    const text = [msg, typeof extra === "string" ? extra : ""].filter(Boolean).join(": ");
    return text || null;
  } catch (_) {
    // A JSON line cut at the stderr line limit: pull the message out by hand.
    const m = /"(?:message|msg)"\s*:\s*"((?:[^"\\]|\\.)*)/.exec(t);
    return m ? m[1].replace(/\\"/g, '"').replace(/\\n/g, " ") : null;
  }
}

/// A failure reason from mlxd (a failed model's `failure`, or an error message) as
/// sentences: the cause first, then what the engine last logged, never a raw JSON line.
export function readableReason(text) {
  if (!text) return "";
  const cut = text.indexOf("; last log line: ");
  if (cut < 0) {
    // An error message may end in a JSON log line of its own.
    const j = text.indexOf("{\"");
    if (j > 0) {
      const msg = logLineMessage(text.slice(j));
      if (msg !== null) return sentence(text.slice(0, j).replace(/[:;,\s]+$/, "") + (msg ? ": " + msg : ""));
    }
    return sentence(text);
  }
  const cause = text.slice(0, cut);
  const last = logLineMessage(text.slice(cut + "; last log line: ".length));
  return sentence(cause) + (last ? " Its last log line: “" + last.replace(/[.\s]+$/, "") + "”." : "");
}

/// mlxd's exit causes (`crashed (exit code 3)`, `load failed (…)`) as the start of a
/// sentence about the model.
const CAUSES = [
  [/^crashed\b/i, "its engine crashed"],
  [/^load failed\b/i, "it failed to load"],
  [/^out of memory\b/i, "it ran out of memory"],
];

/// The reason a model is not serving, as the banner shows it.
export function failedModelNotice(m) {
  let reason = readableReason(m.failure || "");
  for (const [re, words] of CAUSES) {
    if (re.test(reason)) {
      reason = reason.replace(re, words);
      break;
    }
  }
  reason = reason ? reason.charAt(0).toLowerCase() + reason.slice(1) : "it failed; mlxd's log says why.";
  return m.id + " is not available: " + reason + " Pick another model, or fix it and restart mlxd.";
}

/// An HTTP error response as a sentence.
export async function responseError(resp) {
  let message = "";
  try {
    const v = await resp.json();
    message = (v.error && (v.error.message || v.error.type)) || "";
  } catch (_) {
    message = "";
  }
  switch (resp.status) {
    case 401:
      return "This server needs an API key: enter it at the top of the page.";
    case 429:
      return "The model is busy (" + (message ? readableReason(message).replace(/\.$/, "") : "too many requests") + "). Try again in a moment.";
    default:
      if (message) return readableReason(message);
      return "The server answered " + resp.status + (resp.statusText ? " " + resp.statusText : "") + ".";
  }
}

/// A failed fetch (the network, not an HTTP status) as a sentence.
export function networkError(e) {
  if (e instanceof TypeError) return "mlxd could not be reached: is it still running?";
  return sentence(e.message || String(e));
}

/// `GET /v1/models`: `{ models }`, or `{ error, status }`.
export async function listModels() {
  let resp;
  try {
    resp = await fetch("/v1/models", { headers: headers() });
  } catch (e) {
    return { error: networkError(e), status: 0 };
  }
  if (!resp.ok) return { error: await responseError(resp), status: resp.status };
  const v = await resp.json();
  return { models: v.data || [] };
}

/// The request body for a conversation: its messages (with the system prompt first) and
/// the sampling settings that are set.
export function requestBody(model, settings, messages) {
  const body = { model, messages: [], stream: true, stream_options: { include_usage: true } };
  if (settings.system && settings.system.trim()) {
    body.messages.push({ role: "system", content: settings.system });
  }
  for (const m of messages) body.messages.push({ role: m.role, content: m.content || "" });
  if (settings.temperature !== "") body.temperature = Number(settings.temperature);
  if (settings.top_p !== "") body.top_p = Number(settings.top_p);
  if (settings.max_tokens !== "") body.max_tokens = Number(settings.max_tokens);
  return body;
}

/// Checks the settings a person typed; a sentence per problem.
export function settingsProblems(s) {
  const out = [];
  const num = (v) => (v === "" ? null : Number(v));
  const t = num(s.temperature);
  if (t !== null && !(t >= 0 && t <= 2)) out.push("Temperature must be a number from 0 to 2 (it is " + s.temperature + ").");
  const p = num(s.top_p);
  if (p !== null && !(p > 0 && p <= 1)) out.push("Top p must be a number above 0 and at most 1 (it is " + s.top_p + ").");
  const m = num(s.max_tokens);
  if (m !== null && !(Number.isInteger(m) && m >= 1)) out.push("Max tokens must be a whole number of at least 1 (it is " + s.max_tokens + ").");
  return out;
}

/// Streams `body` to /v1/chat/completions; calls `onChunk(parsed)` for every data event.
/// Resolves when the stream ends; throws Error(sentence) for HTTP and stream errors, and
/// the AbortError of `signal` when stopped.
export async function streamChat(body, signal, onChunk) {
  const resp = await fetch("/v1/chat/completions", {
    method: "POST", headers: headers(), body: JSON.stringify(body), signal,
  });
  if (!resp.ok) {
    const e = new Error(await responseError(resp));
    e.status = resp.status;
    throw e;
  }
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
      if (!data || data === "[DONE]") continue;
      let v;
      try {
        v = JSON.parse(data);
      } catch (e) {
        throw new Error("The server sent a streaming event that is not JSON: " + data.slice(0, 80));
      }
      if (v.error) {
        const e = new Error(readableReason(v.error.message || v.error.type || "unknown error"));
        e.midStream = true;
        throw e;
      }
      onChunk(v);
    }
  }
}
