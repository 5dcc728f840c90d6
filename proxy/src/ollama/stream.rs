//! The engine's OpenAI stream (SSE chunks) translated back into Ollama's answer: NDJSON
//! objects with `done: false`, then one `done: true` object with the reason, token counts
//! and durations; or, for `stream: false`, those objects folded into one. Pure: events and
//! instants in, JSON objects out.

use std::time::{Duration, Instant, SystemTime};

use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::clock;
use super::request::Route;

/// When things happened to one request, for the `done` object's durations (nanoseconds,
/// as Ollama reports them).
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// The request arrived.
    pub arrived: Instant,
    /// Waiting for the model's engine to be ready (zero when it already was).
    pub load: Duration,
    /// The generation request went to the engine.
    pub sent: Instant,
}

#[derive(Debug, Deserialize)]
struct Chunk {
    #[serde(default)]
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    error: Option<ErrorObject>,
}

#[derive(Debug, Deserialize)]
struct Choice {
    #[serde(default)]
    delta: Option<Delta>,
    /// `/v1/completions` chunks carry `text` instead of a delta.
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct Delta {
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    reasoning_content: Option<String>,
    #[serde(default)]
    tool_calls: Option<Vec<ToolCallDelta>>,
}

#[derive(Debug, Deserialize)]
struct ToolCallDelta {
    #[serde(default)]
    index: usize,
    #[serde(default)]
    function: Option<FunctionDelta>,
}

#[derive(Debug, Deserialize)]
struct FunctionDelta {
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    arguments: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Usage {
    prompt_tokens: u64,
    completion_tokens: u64,
}

#[derive(Debug, Deserialize)]
struct ErrorObject {
    message: String,
}

/// What one engine event became.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// Objects to send now (possibly none).
    Lines(Vec<Value>),
    /// The engine reported an error mid-stream: send `{"error": message}` and stop.
    Error(String),
}

/// Translates one request's engine stream.
#[derive(Debug)]
pub struct Translator {
    route: Route,
    model: String,
    /// Show reasoning as `thinking` (false: the client said `think: false`).
    thinking: bool,
    /// Tool calls being assembled from their deltas (name, arguments text), by index.
    calls: Vec<(String, String)>,
    finish_reason: Option<String>,
    usage: Option<(u64, u64)>,
    /// When the first text (content, reasoning or a tool call) arrived.
    first_token: Option<Instant>,
}

impl Translator {
    pub fn new(route: Route, model: impl Into<String>, thinking: bool) -> Self {
        Self {
            route,
            model: model.into(),
            thinking,
            calls: Vec::new(),
            finish_reason: None,
            usage: None,
            first_token: None,
        }
    }

    /// One SSE event of the engine's stream (`data: {...}`, comments, `[DONE]`).
    pub fn event(&mut self, event: &[u8], now: Instant) -> Step {
        let text = String::from_utf8_lossy(event);
        let mut lines = Vec::new();
        for line in text.lines() {
            let Some(data) = line.strip_prefix("data:") else {
                continue; // comments, event names, ids
            };
            let data = data.trim();
            if data == "[DONE]" || data.is_empty() {
                continue;
            }
            let chunk: Chunk = match serde_json::from_str(data) {
                Ok(c) => c,
                Err(e) => return Step::Error(format!("unreadable chunk from the engine: {e}")),
            };
            if let Some(err) = chunk.error {
                return Step::Error(err.message);
            }
            if let Some(u) = chunk.usage {
                self.usage = Some((u.prompt_tokens, u.completion_tokens));
            }
            for choice in chunk.choices {
                if let Some(r) = choice.finish_reason {
                    self.finish_reason = Some(r);
                }
                let delta = choice.delta.unwrap_or_default();
                if let Some(calls) = delta.tool_calls {
                    self.first_token.get_or_insert(now);
                    for c in calls {
                        if self.calls.len() <= c.index {
                            self.calls.resize(c.index + 1, Default::default());
                        }
                        if let Some(f) = c.function {
                            let slot = &mut self.calls[c.index];
                            slot.0.push_str(f.name.as_deref().unwrap_or(""));
                            slot.1.push_str(f.arguments.as_deref().unwrap_or(""));
                        }
                    }
                }
                let reasoning = delta.reasoning_content.filter(|s| !s.is_empty());
                let content = delta.content.or(choice.text).filter(|s| !s.is_empty());
                if reasoning.is_some() || content.is_some() {
                    self.first_token.get_or_insert(now);
                }
                if let Some(r) = reasoning.filter(|_| self.thinking) {
                    lines.push(self.piece("", Some(&r)));
                }
                if let Some(c) = content {
                    lines.push(self.piece(&c, None));
                }
            }
        }
        Step::Lines(lines)
    }

    /// A `done: false` object with `content` (and `thinking`).
    fn piece(&self, content: &str, thinking: Option<&str>) -> Value {
        let mut o = self.head();
        match self.route {
            Route::Chat => {
                let mut m = json!({"role": "assistant", "content": content});
                if let Some(t) = thinking {
                    m["thinking"] = Value::String(t.to_string());
                }
                o.insert("message".into(), m);
            }
            Route::Generate => {
                o.insert("response".into(), Value::String(content.to_string()));
                if let Some(t) = thinking {
                    o.insert("thinking".into(), Value::String(t.to_string()));
                }
            }
        }
        o.insert("done".into(), Value::Bool(false));
        Value::Object(o)
    }

    fn head(&self) -> Map<String, Value> {
        let mut o = Map::new();
        o.insert("model".into(), Value::String(self.model.clone()));
        o.insert(
            "created_at".into(),
            Value::String(clock::rfc3339(SystemTime::now())),
        );
        o
    }

    /// The stream ended: the assembled tool calls (Ollama sends them whole, in one
    /// message), then the `done` object. An error when the engine's tool call arguments
    /// are not a JSON object.
    pub fn finish(&mut self, timing: Timing, now: Instant) -> Result<Vec<Value>, String> {
        let mut out = Vec::new();
        if !self.calls.is_empty() {
            let mut calls = Vec::with_capacity(self.calls.len());
            for (name, args) in &self.calls {
                let arguments: Value = if args.trim().is_empty() {
                    json!({})
                } else {
                    serde_json::from_str(args).map_err(|e| {
                        format!("the model's call of {name} has arguments that are not JSON ({e}): {args}")
                    })?
                };
                calls.push(json!({"function": {"name": name, "arguments": arguments}}));
            }
            let mut o = self.head();
            o.insert(
                "message".into(),
                json!({"role": "assistant", "content": "", "tool_calls": calls}),
            );
            o.insert("done".into(), Value::Bool(false));
            out.push(Value::Object(o));
        }
        let reason = match self.finish_reason.as_deref() {
            None | Some("stop") | Some("tool_calls") => "stop",
            Some(other) => other,
        };
        let mut o = self.done_head(reason);
        let (prompt, completion) = self.usage.unwrap_or((0, 0));
        // The first generated text marks the end of prompt processing, as seen from here.
        let first = self.first_token.unwrap_or(now);
        let nanos = |d: Duration| json!(d.as_nanos() as u64);
        o.insert("total_duration".into(), nanos(now - timing.arrived));
        o.insert("load_duration".into(), nanos(timing.load));
        o.insert("prompt_eval_count".into(), json!(prompt));
        o.insert(
            "prompt_eval_duration".into(),
            nanos(first.saturating_duration_since(timing.sent)),
        );
        o.insert("eval_count".into(), json!(completion));
        o.insert(
            "eval_duration".into(),
            nanos(now.saturating_duration_since(first)),
        );
        out.push(Value::Object(o));
        Ok(out)
    }

    /// A `done: true` object with an empty message or response and `done_reason`.
    pub fn done_head(&self, reason: &str) -> Map<String, Value> {
        let mut o = self.head();
        match self.route {
            Route::Chat => {
                o.insert(
                    "message".into(),
                    json!({"role": "assistant", "content": ""}),
                );
            }
            Route::Generate => {
                o.insert("response".into(), Value::String(String::new()));
            }
        }
        o.insert("done".into(), Value::Bool(true));
        o.insert("done_reason".into(), Value::String(reason.to_string()));
        o
    }
}

/// The answer to `stream: false`: the stream's objects folded into one (text and
/// reasoning joined, tool calls gathered, the `done` object's fields kept).
pub fn fold(route: Route, lines: &[Value]) -> Value {
    let mut content = String::new();
    let mut thinking = String::new();
    let mut calls: Vec<Value> = Vec::new();
    let mut last = Map::new();
    for line in lines {
        let (text, think) = match route {
            Route::Chat => (&line["message"]["content"], &line["message"]["thinking"]),
            Route::Generate => (&line["response"], &line["thinking"]),
        };
        content.push_str(text.as_str().unwrap_or(""));
        thinking.push_str(think.as_str().unwrap_or(""));
        if let Some(c) = line["message"]["tool_calls"].as_array() {
            calls.extend(c.iter().cloned());
        }
        if let Value::Object(o) = line {
            if o.get("done") == Some(&Value::Bool(true)) {
                last = o.clone();
            }
        }
    }
    match route {
        Route::Chat => {
            let mut m = json!({"role": "assistant", "content": content});
            if !thinking.is_empty() {
                m["thinking"] = Value::String(thinking);
            }
            if !calls.is_empty() {
                m["tool_calls"] = Value::Array(calls);
            }
            last.insert("message".into(), m);
        }
        Route::Generate => {
            last.insert("response".into(), Value::String(content));
            if !thinking.is_empty() {
                last.insert("thinking".into(), Value::String(thinking));
            }
        }
    }
    Value::Object(last)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(v: Value) -> Vec<u8> {
        format!("data: {v}\n\n").into_bytes()
    }

    fn chunk(delta: Value, finish: Option<&str>) -> Vec<u8> {
        ev(
            json!({"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}),
        )
    }

    fn lines(step: Step) -> Vec<Value> {
        match step {
            Step::Lines(l) => l,
            Step::Error(e) => panic!("error {e}"),
        }
    }

    fn timing(t0: Instant) -> Timing {
        Timing {
            arrived: t0,
            load: Duration::from_millis(5),
            sent: t0 + Duration::from_millis(10),
        }
    }

    #[test]
    fn chat_stream_then_done_with_counts_and_durations() {
        let t0 = Instant::now();
        let mut t = Translator::new(Route::Chat, "smol", true);
        assert!(lines(t.event(&chunk(json!({"role": "assistant"}), None), t0)).is_empty());
        let first = t0 + Duration::from_millis(30);
        let l = lines(t.event(&chunk(json!({"content": "Hel"}), None), first));
        assert_eq!(l.len(), 1);
        assert_eq!(l[0]["model"], "smol");
        assert_eq!(
            l[0]["message"],
            json!({"role": "assistant", "content": "Hel"})
        );
        assert_eq!(l[0]["done"], false);
        assert!(l[0]["created_at"].as_str().unwrap().ends_with('Z'));
        let l = lines(t.event(&chunk(json!({"content": "lo"}), Some("length")), first));
        assert_eq!(l[0]["message"]["content"], "lo");
        let usage = ev(
            json!({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}}),
        );
        assert!(lines(t.event(&usage, first)).is_empty());
        assert!(lines(t.event(b"data: [DONE]\n\n", first)).is_empty());
        let end = t0 + Duration::from_millis(100);
        let done = t.finish(timing(t0), end).unwrap();
        assert_eq!(done.len(), 1);
        let d = &done[0];
        assert_eq!(d["done"], true);
        assert_eq!(d["done_reason"], "length");
        assert_eq!(d["message"], json!({"role": "assistant", "content": ""}));
        assert_eq!(d["prompt_eval_count"], 9);
        assert_eq!(d["eval_count"], 2);
        assert_eq!(d["total_duration"], 100_000_000u64);
        assert_eq!(d["load_duration"], 5_000_000u64);
        assert_eq!(d["prompt_eval_duration"], 20_000_000u64);
        assert_eq!(d["eval_duration"], 70_000_000u64);
    }

    #[test]
    fn reasoning_is_thinking_unless_think_is_false() {
        let now = Instant::now();
        let mut t = Translator::new(Route::Chat, "m", true);
        let l = lines(t.event(&chunk(json!({"reasoning_content": "hmm"}), None), now));
        assert_eq!(l[0]["message"]["thinking"], "hmm");
        assert_eq!(l[0]["message"]["content"], "");
        let mut t = Translator::new(Route::Chat, "m", false);
        assert!(lines(t.event(&chunk(json!({"reasoning_content": "hmm"}), None), now)).is_empty());
        let mut t = Translator::new(Route::Generate, "m", true);
        let l = lines(t.event(&chunk(json!({"reasoning_content": "hmm"}), None), now));
        assert_eq!(l[0]["thinking"], "hmm");
        assert_eq!(l[0]["response"], "");
    }

    #[test]
    fn tool_call_deltas_become_one_message_with_object_arguments() {
        let now = Instant::now();
        let mut t = Translator::new(Route::Chat, "m", true);
        let d1 = json!({"tool_calls": [{"index": 0, "id": "call_x", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\":"}}]});
        let d2 = json!({"tool_calls": [{"index": 0, "function": {"arguments": "\"Paris\"}"}}]});
        assert!(lines(t.event(&chunk(d1, None), now)).is_empty());
        assert!(lines(t.event(&chunk(d2, Some("tool_calls")), now)).is_empty());
        let out = t.finish(timing(now), now).unwrap();
        assert_eq!(out.len(), 2);
        assert_eq!(
            out[0]["message"]["tool_calls"],
            json!([{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}])
        );
        assert_eq!(out[1]["done_reason"], "stop");
        let folded = fold(Route::Chat, &out);
        assert_eq!(
            folded["message"]["tool_calls"][0]["function"]["name"],
            "get_weather"
        );
        assert_eq!(folded["done"], true);

        let mut t = Translator::new(Route::Chat, "m", true);
        let bad =
            json!({"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "{oops"}}]});
        t.event(&chunk(bad, Some("tool_calls")), now);
        let e = t.finish(timing(now), now).unwrap_err();
        assert!(e.contains("not JSON"), "{e}");
    }

    #[test]
    fn completions_chunks_and_generate_shape() {
        let now = Instant::now();
        let mut t = Translator::new(Route::Generate, "m", true);
        let c = ev(json!({"choices": [{"index": 0, "text": " 4,", "finish_reason": null}]}));
        let mut all = lines(t.event(&c, now));
        assert_eq!(all[0]["response"], " 4,");
        assert_eq!(all[0]["done"], false);
        let c = ev(json!({"choices": [{"index": 0, "text": " 5", "finish_reason": "stop"}]}));
        all.extend(lines(t.event(&c, now)));
        all.extend(t.finish(timing(now), now).unwrap());
        let folded = fold(Route::Generate, &all);
        assert_eq!(folded["response"], " 4, 5");
        assert_eq!(folded["done"], true);
        assert_eq!(folded["done_reason"], "stop");
        assert!(folded.get("message").is_none());
    }

    #[test]
    fn engine_errors_mid_stream() {
        let now = Instant::now();
        let mut t = Translator::new(Route::Chat, "m", true);
        let e = ev(json!({"error": {"message": "engine died", "type": "engine_crashed"}}));
        assert_eq!(t.event(&e, now), Step::Error("engine died".into()));
        match t.event(b"data: {not json\n\n", now) {
            Step::Error(e) => assert!(e.contains("unreadable"), "{e}"),
            other => panic!("{other:?}"),
        }
        // Comments and other fields are not data.
        assert!(lines(t.event(b": keep-alive\n\n", now)).is_empty());
    }
}
