// The mlxd chat page: conversations kept in this browser (list, rename, delete, new), a model
// picker from /v1/models with each model's state (loading progress, a failed model's reason
// in words), answers streamed from /v1/chat/completions and rendered as markdown, reasoning
// shown collapsed, tool calls shown, the token rate of each answer, per-conversation system
// prompt and sampling settings, stop, regenerate, and edit of the last question.

import * as api from "./api.js";
import * as store from "./store.js";
import { renderMarkdown, splitThinking } from "./render.js";

const $ = (id) => document.getElementById(id);

const EXAMPLES = [
  "Explain what a KV cache is, in two sentences.",
  "Write a Python function that checks whether a string is a palindrome.",
  "Give me three names for a lighthouse keeper's cat, with a reason for each.",
  "Summarise the plot of Hamlet in four bullet points.",
];

let conversations = []; // stored conversations, newest first
let active = null; // the conversation on screen (maybe a draft not yet stored)
let models = [];
let controller = null; // the AbortController of the answer in flight
let pendingRender = null; // the streaming bubble's next repaint
let welcomeFor = null; // the model the welcome on screen names

// ---- storage ----------------------------------------------------------------------------

function persist() {
  try {
    store.save({ current: active && active.id, conversations });
    problem("");
  } catch (e) {
    problem(e.message);
  }
}

/// Puts the active conversation in the stored list (a draft becomes a conversation once it
/// has a message or settings of its own).
function keep(conv) {
  conv.updated = Date.now();
  if (!conversations.includes(conv)) conversations.unshift(conv);
  conversations.sort((a, b) => b.updated - a.updated);
  persist();
  renderList();
}

// ---- banners ----------------------------------------------------------------------------

function notice(text, bad) {
  const n = $("notice");
  n.textContent = text || "";
  n.className = text ? (bad ? "show bad" : "show") : "";
}

function problem(text) {
  const n = $("problem");
  n.textContent = text || "";
  n.className = text ? "show bad" : "";
}

// ---- models -----------------------------------------------------------------------------

async function refreshModels() {
  const r = await api.listModels();
  if (r.error) {
    if (r.status === 401) $("key").className = "show";
    $("state").textContent = r.status === 0 ? "server unreachable" : "";
    notice(r.error, true);
    return;
  }
  models = r.models;
  const select = $("model");
  const chosen = select.value;
  const ids = models.map((m) => m.id);
  if (select.options.length !== ids.length || ids.some((id, i) => select.options[i].value !== id)) {
    select.replaceChildren(...ids.map((id) => new Option(id, id)));
    const def = models.find((m) => m.default);
    const want = active && active.model;
    select.value = ids.includes(want) ? want : ids.includes(chosen) ? chosen : def ? def.id : ids[0] || "";
  }
  for (const o of select.options) {
    const m = models.find((x) => x.id === o.value);
    // Only states that need attention: an unloaded model loads on its first question.
    const label = m && (m.state === "loading" || m.state === "failed") ? o.value + " (" + m.state + ")" : o.value;
    if (o.textContent !== label) o.textContent = label;
  }
  showState();
  if (active && !active.messages.length && welcomeFor !== welcomeKey()) renderConversation();
}

function selectedModel() {
  return models.find((x) => x.id === $("model").value) || null;
}

function showState() {
  const m = selectedModel();
  if (!m) {
    $("state").textContent = models.length ? "" : "no models configured";
    notice(models.length ? "" : "This server has no models: add one to mlxd.toml or start mlxd with --model.", true);
    return;
  }
  $("state").textContent = m.state === "unloaded" ? "loads on the first question" : m.state;
  if (m.state === "loading") {
    notice("Loading " + m.id + "… " + loadingStep(m) + " The first answer starts when it is ready.");
  } else if (m.state === "failed") {
    notice(api.failedModelNotice(m), true);
  } else {
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

// ---- conversation list ------------------------------------------------------------------

function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
}

function button(cls, text, title) {
  const b = el("button", cls, text);
  b.type = "button";
  if (title) b.title = title;
  return b;
}

function renderList() {
  const nav = $("conversations");
  nav.replaceChildren(...conversations.map((c) => {
    const row = el("div", "conv" + (active && c.id === active.id ? " active" : ""));
    row.dataset.id = c.id;
    const open = button("conv-open", c.title || "New conversation", "Open");
    const rename = button("conv-rename", "✎", "Rename this conversation");
    const del = button("conv-delete", "✕", "Delete this conversation");
    rename.setAttribute("aria-label", "rename");
    del.setAttribute("aria-label", "delete");
    row.append(open, rename, del);
    return row;
  }));
}

function openConversation(conv) {
  if (controller) controller.abort();
  active = conv;
  if (conv.model && models.some((m) => m.id === conv.model)) $("model").value = conv.model;
  showState();
  showSettings();
  renderList();
  renderConversation();
  persist();
}

function startNew() {
  if (controller) controller.abort();
  active = store.newConversation($("model").value);
  showSettings();
  renderList();
  renderConversation();
  $("prompt").focus();
}

function startRename(row, conv) {
  const input = el("input", "conv-title");
  input.value = conv.title || "";
  input.setAttribute("aria-label", "conversation name");
  row.querySelector(".conv-open").replaceWith(input);
  input.focus();
  input.select();
  let done = false;
  const finish = (accept) => {
    if (done) return;
    done = true;
    const t = input.value.trim();
    if (accept && t) {
      conv.title = t;
      persist();
    }
    renderList();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") finish(true);
    if (e.key === "Escape") finish(false);
  });
  input.addEventListener("blur", () => finish(true));
}

function deleteConversation(conv) {
  if (active === conv && controller) controller.abort();
  conversations = conversations.filter((c) => c !== conv);
  if (active === conv) active = conversations[0] || store.newConversation($("model").value);
  persist();
  openConversation(active);
}

// ---- settings ---------------------------------------------------------------------------

const SETTING_IDS = ["system", "temperature", "top_p", "max_tokens"];

function showSettings() {
  for (const k of SETTING_IDS) $(k).value = active.settings[k] || "";
  checkSettings();
}

function checkSettings() {
  const problems = api.settingsProblems(active.settings);
  $("settings-problems").textContent = problems.join(" ");
  const changed = SETTING_IDS.some((k) => active.settings[k] !== "");
  $("settings-toggle").textContent = changed ? "Settings •" : "Settings";
  return problems;
}

function settingChanged(k) {
  active.settings[k] = k === "system" ? $(k).value : $(k).value.trim();
  checkSettings();
  keep(active);
}

// ---- messages ---------------------------------------------------------------------------

function renderConversation() {
  const box = $("messages");
  if (!active.messages.length) {
    box.replaceChildren(welcome());
    return;
  }
  box.replaceChildren(...active.messages.map((m, i) => bubble(m, i)));
  box.scrollTop = box.scrollHeight;
}

/// What the welcome depends on: the model picked and whether it failed.
function welcomeKey() {
  const m = selectedModel();
  return $("model").value + (m && m.state === "failed" ? " failed" : "");
}

function welcome() {
  const w = el("div", "welcome");
  const m = $("model").value;
  welcomeFor = welcomeKey();
  if (welcomeFor.endsWith(" failed")) {
    w.append(el("h2", "", m + " is not available"));
    w.append(el("p", "", "The banner above says why. Pick another model to start."));
    return w;
  }
  w.append(el("h2", "", m ? "Ask " + m + " anything" : "Pick a model to start"));
  w.append(el("p", "", "Answers stream in as the model writes them. Conversations stay in this browser; " +
    "Settings holds a system prompt and sampling for each conversation."));
  const list = el("div", "examples");
  for (const e of EXAMPLES) list.append(button("example", e, "Ask this"));
  w.append(list);
  return w;
}

function bubble(m, index) {
  const div = el("div", "msg " + m.role);
  div.dataset.index = String(index);
  if (m.role === "user") {
    div.append(el("div", "body", m.content));
  } else {
    fillAssistant(div, m, false);
  }
  addActions(div, m, index);
  return div;
}

/// The parts of an answer: reasoning (collapsed), tool calls, the markdown body, the meta
/// line and the error, if any.
function fillAssistant(div, m, streaming) {
  const split = splitThinking(m.content || "");
  const reasoning = [m.reasoning || "", split.reasoning].filter(Boolean).join("\n\n");
  const parts = [];
  if (reasoning) {
    const d = el("details", "reasoning");
    const old = div.querySelector("details.reasoning");
    if (old && old.open) d.open = true;
    const thinking = streaming && !split.content && !(m.tool_calls || []).length;
    d.append(el("summary", "", thinking ? "Thinking…" : "Reasoning (" + words(reasoning) + " words)"));
    const body = el("div", "reasoning-body md");
    renderMarkdown(body, reasoning);
    d.append(body);
    parts.push(d);
  }
  for (const t of m.tool_calls || []) {
    const card = el("div", "tool-call");
    card.append(el("div", "tool-name", "Tool call: " + (t.name || "(unnamed)")));
    card.append(el("pre", "tool-args", prettyJson(t.arguments || "")));
    parts.push(card);
  }
  const body = el("div", "body md");
  renderMarkdown(body, split.content);
  parts.push(body);
  if (m.meta && m.meta.error) parts.push(el("div", "error", m.meta.error));
  if (m.meta && !streaming) parts.push(el("div", "meta", metaLine(m.meta)));
  div.replaceChildren(...parts);
  div.classList.toggle("streaming", streaming);
  if (streaming) delete div.dataset.done;
  else div.dataset.done = "1";
}

function words(text) {
  return text.split(/\s+/).filter(Boolean).length;
}

function prettyJson(s) {
  try {
    return JSON.stringify(JSON.parse(s), null, 2);
  } catch (_) {
    return s;
  }
}

function metaLine(meta) {
  const parts = [meta.model];
  if (meta.tokens) parts.push((meta.approx ? "~" : "") + meta.tokens + " tokens");
  if (meta.rate) parts.push(meta.rate.toFixed(1) + " tok/s");
  if (typeof meta.ttft === "number") parts.push("first token " + meta.ttft.toFixed(2) + " s");
  if (typeof meta.secs === "number") parts.push(meta.secs.toFixed(1) + " s");
  if (meta.stopped) parts.push("stopped");
  if (meta.finish === "length") parts.push("cut at the max tokens limit");
  return parts.filter(Boolean).join(" · ");
}

function addActions(div, m, index) {
  const last = index === active.messages.length - 1;
  const lastUser = index === lastIndexOf("user");
  const bar = el("div", "actions");
  if (m.role === "assistant") {
    bar.append(button("copy-answer", "Copy", "Copy this answer's text"));
    if (last) bar.append(button("regenerate", "Regenerate", "Ask for a new answer"));
  } else if (lastUser) {
    bar.append(button("edit", "Edit", "Edit this question and ask again"));
  }
  if (bar.childElementCount) div.append(bar);
}

function lastIndexOf(role) {
  for (let i = active.messages.length - 1; i >= 0; i--) if (active.messages[i].role === role) return i;
  return -1;
}

function startEdit(div, index) {
  if (controller) return;
  const m = active.messages[index];
  const box = el("div", "edit-box");
  const ta = el("textarea", "edit-text");
  ta.value = m.content;
  ta.setAttribute("aria-label", "edit question");
  const save = button("edit-send", "Save & ask", "Replace the question and ask again");
  const cancel = button("edit-cancel", "Cancel");
  box.append(ta, el("div", "actions", ""));
  box.lastChild.append(save, cancel);
  div.replaceChildren(box);
  ta.focus();
  cancel.addEventListener("click", renderConversation);
  save.addEventListener("click", () => {
    const text = ta.value.trim();
    if (!text) return;
    m.content = text;
    active.messages.length = index + 1;
    if (index === 0) active.title = store.titleFrom(text);
    keep(active);
    renderConversation();
    answer();
  });
}

// ---- asking -----------------------------------------------------------------------------

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
  document.body.classList.toggle("busy", on);
}

function ask(text) {
  if (controller) return;
  if (!$("model").value) {
    problem("Pick a model first: this server lists none yet.");
    return;
  }
  const problems = checkSettings();
  if (problems.length) {
    $("settings").hidden = false;
    problem("Fix the settings first: " + problems.join(" "));
    return;
  }
  if (!active.messages.length) active.title = store.titleFrom(text);
  active.messages.push({ role: "user", content: text });
  keep(active);
  renderConversation();
  answer();
}

/// Streams an answer to the active conversation's messages into a new assistant message.
async function answer() {
  const conv = active;
  const model = $("model").value;
  conv.model = model;
  const history = conv.messages.slice();
  const msg = { role: "assistant", content: "", reasoning: "", tool_calls: [], meta: { model } };
  conv.messages.push(msg);
  const box = $("messages");
  const div = bubble(msg, conv.messages.length - 1);
  box.append(div);
  fillAssistant(div, msg, true);
  div.scrollIntoView({ block: "end" });
  controller = new AbortController();
  busy(true);
  problem("");
  const started = performance.now();
  let firstAt = null;
  let lastAt = null;
  let pieces = 0;
  let usage = null;
  const repaint = () => {
    if (pendingRender) return;
    pendingRender = requestAnimationFrame(() => {
      pendingRender = null;
      if (div.isConnected) {
        const near = box.scrollHeight - box.scrollTop - box.clientHeight < 80;
        fillAssistant(div, msg, true);
        if (near) box.scrollTop = box.scrollHeight;
      }
    });
  };
  try {
    await api.streamChat(api.requestBody(model, conv.settings, history), controller.signal, (v) => {
      if (v.usage) usage = v.usage;
      const choice = v.choices && v.choices[0];
      if (!choice) return;
      const d = choice.delta || {};
      let got = false;
      if (typeof d.content === "string" && d.content) {
        msg.content += d.content;
        got = true;
      }
      const r = d.reasoning_content || d.reasoning;
      if (typeof r === "string" && r) {
        msg.reasoning += r;
        got = true;
      }
      for (const t of d.tool_calls || []) {
        const i = typeof t.index === "number" ? t.index : msg.tool_calls.length;
        const call = msg.tool_calls[i] || (msg.tool_calls[i] = { id: "", name: "", arguments: "" });
        if (t.id) call.id = t.id;
        if (t.function && t.function.name) call.name += t.function.name;
        if (t.function && t.function.arguments) call.arguments += t.function.arguments;
        got = true;
      }
      if (choice.finish_reason) msg.meta.finish = choice.finish_reason;
      if (got) {
        pieces++;
        lastAt = performance.now();
        if (firstAt === null) firstAt = lastAt;
        repaint();
      }
    });
  } catch (e) {
    if (e.name === "AbortError") {
      msg.meta.stopped = true;
    } else if (e instanceof TypeError) {
      msg.meta.error = api.networkError(e);
    } else {
      msg.meta.error = (e.midStream ? "The answer was cut off: " : "") + e.message;
    }
  } finally {
    if (pendingRender) cancelAnimationFrame(pendingRender);
    pendingRender = null;
    controller = null;
    busy(false);
  }
  const end = performance.now();
  const tokens = usage ? usage.completion_tokens : pieces;
  msg.meta.tokens = tokens || 0;
  msg.meta.approx = !usage && pieces > 0;
  msg.meta.secs = (end - started) / 1000;
  if (firstAt !== null) msg.meta.ttft = (firstAt - started) / 1000;
  // A rate over less than 50 ms of decoding (an answer that arrived in one piece) says
  // nothing: leave it out.
  if (firstAt !== null && lastAt - firstAt >= 50 && tokens > 1) {
    msg.meta.rate = (tokens - 1) / ((lastAt - firstAt) / 1000);
  }
  keep(conv);
  if (conv === active) {
    // The regenerate and edit buttons move to the new last messages.
    renderConversation();
  }
}

// ---- wiring -----------------------------------------------------------------------------

async function copyText(text, btn) {
  try {
    await navigator.clipboard.writeText(text);
    btn.textContent = "Copied";
  } catch (e) {
    btn.textContent = "Copy failed";
    problem("The browser did not allow copying (" + e.message + "); select the text instead.");
  }
  setTimeout(() => (btn.textContent = "Copy"), 1500);
}

function onMessagesClick(e) {
  const b = e.target.closest("button");
  if (!b) return;
  const div = b.closest(".msg");
  const index = div ? Number(div.dataset.index) : -1;
  if (b.classList.contains("example")) {
    ask(b.textContent);
  } else if (b.classList.contains("copy-code")) {
    copyText(b.closest(".code").querySelector("code").textContent, b);
  } else if (b.classList.contains("copy-answer")) {
    copyText(active.messages[index].content, b);
  } else if (b.classList.contains("regenerate") && !controller) {
    active.messages.length = index;
    keep(active);
    renderConversation();
    answer();
  } else if (b.classList.contains("edit")) {
    startEdit(div, index);
  }
}

function onListClick(e) {
  const b = e.target.closest("button");
  if (!b) return;
  const row = b.closest(".conv");
  const conv = conversations.find((c) => c.id === row.dataset.id);
  if (!conv) return;
  if (b.classList.contains("conv-open")) openConversation(conv);
  else if (b.classList.contains("conv-rename")) startRename(row, conv);
  else if (b.classList.contains("conv-delete")) {
    if (b.dataset.confirm === "1") {
      deleteConversation(conv);
    } else {
      b.dataset.confirm = "1";
      b.textContent = "Delete?";
      b.title = "Click again to delete";
      setTimeout(() => {
        if (b.isConnected) {
          b.dataset.confirm = "";
          b.textContent = "✕";
          b.title = "Delete this conversation";
        }
      }, 4000);
    }
  }
}

function restore() {
  const saved = store.load();
  conversations = saved.conversations;
  if (saved.problem) problem(saved.problem);
  active = conversations.find((c) => c.id === saved.current) || conversations[0] || store.newConversation("");
  showSettings();
  renderList();
  renderConversation();
}

document.addEventListener("DOMContentLoaded", () => {
  restore();
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value.trim();
    if (!text || controller) return;
    $("prompt").value = "";
    ask(text);
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key === "Escape" && controller) controller.abort();
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("new").addEventListener("click", startNew);
  $("messages").addEventListener("click", onMessagesClick);
  $("conversations").addEventListener("click", onListClick);
  $("settings-toggle").addEventListener("click", () => {
    const s = $("settings");
    s.hidden = !s.hidden;
    $("settings-toggle").setAttribute("aria-expanded", String(!s.hidden));
  });
  for (const k of SETTING_IDS) $(k).addEventListener("change", () => settingChanged(k));
  $("model").addEventListener("change", () => {
    showState();
    if (!active.messages.length) renderConversation();
  });
  $("key").addEventListener("change", () => {
    localStorage.setItem("mlxd-api-key", $("key").value.trim());
    $("key").className = "";
    notice("");
    refreshModels();
  });
  // Another tab changed the stored conversations: show its list (this tab's answer in
  // flight is saved when it ends).
  window.addEventListener("storage", (e) => {
    if (e.key !== store.STORAGE_KEY || controller) return;
    const id = active && active.id;
    conversations = store.load().conversations;
    active = conversations.find((c) => c.id === id) || active;
    renderList();
    renderConversation();
  });
  refreshModels();
  setInterval(refreshModels, 2000);
  $("prompt").focus();
});
