// Conversations kept in this browser (localStorage), so the page can be closed and reopened:
// each has a title, the model it talks to, its own settings (system prompt, temperature,
// top_p, max tokens) and its messages. One key holds them all; writes that fail (storage
// full, disabled) throw, and the page says so.

const KEY = "mlxd-chat-conversations-v1";

/// Settings a new conversation starts with: empty means the server's default.
export const DEFAULT_SETTINGS = { system: "", temperature: "", top_p: "", max_tokens: "" };

function newId() {
  return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
}

export function newConversation(model) {
  const now = Date.now();
  return {
    id: newId(), title: "", created: now, updated: now, model: model || "",
    settings: { ...DEFAULT_SETTINGS }, messages: [],
  };
}

/// Everything stored: `{ current, conversations }`, newest first; a stored value that cannot
/// be read is reported, not silently replaced.
export function load() {
  const raw = localStorage.getItem(KEY);
  if (!raw) return { current: null, conversations: [], problem: null };
  try {
    const v = JSON.parse(raw);
    const conversations = (Array.isArray(v.conversations) ? v.conversations : [])
      .filter((c) => c && typeof c.id === "string" && Array.isArray(c.messages))
      .map((c) => ({ ...newConversation(c.model), ...c, settings: { ...DEFAULT_SETTINGS, ...c.settings } }));
    return { current: v.current || null, conversations, problem: null };
  } catch (e) {
    // Keep the unreadable value aside rather than overwrite it with the next save.
    let kept = KEY + "-unreadable";
    try {
      localStorage.setItem(kept, raw);
      localStorage.removeItem(KEY);
    } catch (e2) {
      kept = null;
    }
    return {
      current: null, conversations: [],
      problem: "The saved conversations could not be read (" + e.message + ")" +
        (kept ? "; they are kept in this browser's storage under " + kept + "." : "."),
    };
  }
}

/// Writes `state`; throws with a sentence when the browser refuses.
export function save(state) {
  const sorted = [...state.conversations].sort((a, b) => b.updated - a.updated);
  try {
    localStorage.setItem(KEY, JSON.stringify({ current: state.current, conversations: sorted }));
  } catch (e) {
    throw new Error("This browser did not save the conversation (" + e.name + ": " + e.message +
      "). Delete old conversations to make room.");
  }
}

/// The title a conversation gets from its first question.
export function titleFrom(text) {
  const t = text.replace(/\s+/g, " ").trim();
  return t.length > 48 ? t.slice(0, 47) + "…" : t;
}

export const STORAGE_KEY = KEY;
