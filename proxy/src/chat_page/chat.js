// The mlxd chat page: a model picker from /v1/models, streamed answers from
// /v1/chat/completions, a stop button, the conversation kept in the page, and notices when a
// model is loading (with its progress), has failed, or its engine restarted mid-answer.
"use strict";

const $ = (id) => document.getElementById(id);
const conversation = []; // {role, content} turns sent with every request
let controller = null; // the AbortController of the answer in flight
let models = [];

function headers() {
  const h = { "content-type": "application/json" };
  const key = localStorage.getItem("mlxd-api-key");
  if (key) h.authorization = "Bearer " + key;
  return h;
}

function notice(text, bad) {
  const n = $("notice");
  n.textContent = text || "";
  n.className = text ? (bad ? "show bad" : "show") : "";
}

/// A 401 asks for the API key (kept in this browser's storage).
function needKey(resp) {
  if (resp.status !== 401) return false;
  $("key").className = "show";
  notice("This server requires an API key: enter it above.", true);
  return true;
}

async function errorText(resp) {
  try {
    const v = await resp.json();
    return (v.error && v.error.message) || JSON.stringify(v);
  } catch (_) {
    return resp.status + " " + resp.statusText;
  }
}

/// Refreshes the picker and the selected model's state; called every two seconds.
async function refreshModels() {
  let resp;
  try {
    resp = await fetch("/v1/models", { headers: headers() });
  } catch (e) {
    $("state").textContent = "server unreachable";
    return;
  }
  if (needKey(resp)) return;
  if (!resp.ok) {
    $("state").textContent = await errorText(resp);
    return;
  }
  models = (await resp.json()).data || [];
  const select = $("model");
  const chosen = select.value;
  const ids = models.map((m) => m.id);
  if (select.options.length !== ids.length || ids.some((id, i) => select.options[i].value !== id)) {
    select.replaceChildren(...ids.map((id) => new Option(id, id)));
    const def = models.find((m) => m.default);
    select.value = ids.includes(chosen) ? chosen : def ? def.id : ids[0] || "";
  }
  showState();
}

function showState() {
  const m = models.find((x) => x.id === $("model").value);
  if (!m) {
    $("state").textContent = "";
    return;
  }
  $("state").textContent = m.state;
  if (m.state === "loading") {
    notice("Loading " + m.id + "… " + loadingStep(m) + " The first answer starts when it is ready.");
  } else if (m.state === "failed") {
    notice(m.id + " failed: " + (m.failure || "see mlxd's log") + ".", true);
  } else if (!controller) {
    notice("");
  }
}

// What the engine is doing while it loads: "reading weights 40%", "converting…".
function loadingStep(m) {
  const pct = typeof m.loading_progress === "number" ? " " + Math.round(m.loading_progress * 100) + "%" : "";
  switch (m.loading_phase) {
    case "starting":
      return "(starting the engine)";
    case "downloading":
      return "(downloading" + pct + ")";
    case "converting":
      return "(converting to MLX" + pct + ")";
    case "weights":
      return "(reading weights" + pct + ")";
    default:
      return pct ? "(" + pct.trim() + ")" : "";
  }
}

function bubble(role, text) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  div.textContent = text;
  $("messages").append(div);
  div.scrollIntoView({ block: "end" });
  return div;
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

async function send(text) {
  const model = $("model").value;
  conversation.push({ role: "user", content: text });
  bubble("user", text);
  const out = bubble("assistant", "");
  out.classList.add("streaming");
  controller = new AbortController();
  busy(true);
  let answer = "";
  let usage = null;
  const started = performance.now();
  let firstAt = null;
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST",
      headers: headers(),
      body: JSON.stringify({
        model, messages: conversation, stream: true, stream_options: { include_usage: true },
      }),
      signal: controller.signal,
    });
    if (needKey(resp) || !resp.ok) {
      throw new Error(resp.status === 401 ? "an API key is required" : await errorText(resp));
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
        for (const line of event.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const data = line.slice(5).trim();
          if (data === "[DONE]") continue;
          const v = JSON.parse(data);
          if (v.error) {
            const restarted = /restart|crash|exited|killed/i.test(v.error.message || "");
            notice((restarted ? "The engine restarted: " : "Error: ") + v.error.message, true);
            continue;
          }
          if (v.usage) usage = v.usage;
          const piece = v.choices && v.choices[0] && v.choices[0].delta && v.choices[0].delta.content;
          if (piece) {
            if (firstAt === null) {
              firstAt = performance.now();
              if (!$("notice").classList.contains("bad")) notice("");
            }
            answer += piece;
            out.textContent = answer;
            out.scrollIntoView({ block: "end" });
          }
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") {
      notice("Stopped.");
    } else {
      notice("Error: " + e.message, true);
    }
  } finally {
    out.classList.remove("streaming");
    controller = null;
    busy(false);
  }
  conversation.push({ role: "assistant", content: answer });
  const meta = document.createElement("span");
  meta.className = "meta";
  const secs = ((performance.now() - started) / 1000).toFixed(1);
  meta.textContent = model + " · " + secs + " s" + (usage ? " · " + usage.completion_tokens + " tokens" : "");
  out.append(meta);
  out.dataset.done = "1";
}

document.addEventListener("DOMContentLoaded", () => {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || controller) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("new").addEventListener("click", () => {
    if (controller) controller.abort();
    conversation.length = 0;
    $("messages").replaceChildren();
    notice("");
  });
  $("model").addEventListener("change", showState);
  $("key").addEventListener("change", () => {
    localStorage.setItem("mlxd-api-key", $("key").value.trim());
    $("key").className = "";
    notice("");
    refreshModels();
  });
  refreshModels();
  setInterval(refreshModels, 2000);
  $("prompt").focus();
});
