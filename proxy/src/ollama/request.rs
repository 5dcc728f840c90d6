//! Ollama requests (`/api/chat`, `/api/generate`) translated into the engine's OpenAI
//! requests (`/v1/chat/completions`, `/v1/completions`). Pure: bytes in, a JSON body out.
//!
//! The engine is always asked for a stream with usage, whatever the client wants: the
//! answer is translated back chunk by chunk ([`super::stream`]), and a non-streaming
//! Ollama answer is those chunks folded into one object, timed the same way.

use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::clock::{self, KeepAlive};
use crate::error::ProxyError;

/// Which Ollama route a request came in on (and so the shape of its answer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    Chat,
    Generate,
}

/// An Ollama request, translated.
#[derive(Debug, Clone, PartialEq)]
pub struct Translated {
    pub route: Route,
    /// As the client named it (resolved against the catalog by the caller).
    pub model: String,
    /// Whether the client wants NDJSON lines (Ollama's default) or one object.
    pub stream: bool,
    pub keep_alive: KeepAlive,
    /// Whether reasoning goes out as `thinking` (`think` not false).
    pub thinking: bool,
    /// Nothing to generate (no messages, an empty prompt): Ollama's way to load or
    /// unload a model; answered `done_reason: "load"` / `"unload"` without the engine
    /// generating anything.
    pub load_only: bool,
    /// The engine route and the OpenAI request body for it.
    pub path: &'static str,
    pub body: Value,
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    messages: Vec<Message>,
    #[serde(default)]
    tools: Option<Vec<Value>>,
    #[serde(default)]
    format: Value,
    #[serde(default)]
    options: Option<Map<String, Value>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    keep_alive: Value,
    #[serde(default)]
    think: Value,
}

#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    #[serde(default)]
    content: Option<String>,
    #[serde(default)]
    images: Option<Vec<Value>>,
    #[serde(default)]
    tool_calls: Option<Vec<ToolCall>>,
    #[serde(default)]
    tool_name: Option<String>,
}

#[derive(Debug, Deserialize)]
struct ToolCall {
    function: FunctionCall,
}

#[derive(Debug, Deserialize)]
struct FunctionCall {
    name: String,
    #[serde(default)]
    arguments: Value,
}

#[derive(Debug, Deserialize)]
struct GenerateRequest {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    prompt: Option<String>,
    #[serde(default)]
    suffix: Option<String>,
    #[serde(default)]
    system: Option<String>,
    #[serde(default)]
    template: Option<String>,
    #[serde(default)]
    context: Option<Vec<Value>>,
    #[serde(default)]
    raw: Option<bool>,
    #[serde(default)]
    images: Option<Vec<Value>>,
    #[serde(default)]
    format: Value,
    #[serde(default)]
    options: Option<Map<String, Value>>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    keep_alive: Value,
    #[serde(default)]
    think: Value,
}

fn bad(message: impl Into<String>) -> ProxyError {
    ProxyError::BadRequest(message.into())
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ProxyError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| bad(format!("request body is not valid JSON: {e}")))?;
    if !v.is_object() {
        return Err(bad("request body must be a JSON object"));
    }
    serde_json::from_value(v).map_err(|e| bad(format!("invalid request: {e}")))
}

fn required_model(model: Option<String>) -> Result<String, ProxyError> {
    model
        .filter(|m| !m.is_empty())
        .ok_or_else(|| bad("model is required"))
}

/// `POST /api/chat`.
pub fn chat(body: &[u8]) -> Result<Translated, ProxyError> {
    let r: ChatRequest = parse(body)?;
    let model = required_model(r.model)?;
    let keep_alive = clock::keep_alive(&r.keep_alive).map_err(bad)?;
    let load_only = r.messages.is_empty();
    let mut out = Map::new();
    out.insert("model".into(), Value::String(model.clone()));
    out.insert("messages".into(), Value::Array(messages(r.messages)?));
    if let Some(tools) = r.tools.filter(|t| !t.is_empty()) {
        out.insert("tools".into(), Value::Array(tools));
    }
    let thinking = common(&mut out, &r.format, r.options.as_ref(), &r.think)?;
    Ok(Translated {
        route: Route::Chat,
        model,
        stream: r.stream.unwrap_or(true),
        keep_alive,
        thinking,
        load_only,
        path: "/v1/chat/completions",
        body: Value::Object(out),
    })
}

/// `POST /api/generate`: a prompt through the chat template (with `system` before it),
/// or, with `raw`, the prompt as it is through `/v1/completions`.
pub fn generate(body: &[u8]) -> Result<Translated, ProxyError> {
    let r: GenerateRequest = parse(body)?;
    let model = required_model(r.model)?;
    let keep_alive = clock::keep_alive(&r.keep_alive).map_err(bad)?;
    if r.images.as_ref().is_some_and(|i| !i.is_empty()) {
        return Err(bad(
            "images are not supported: mlxd serves text-only models",
        ));
    }
    if r.suffix.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(bad("suffix (fill-in-the-middle) is not supported by mlxd"));
    }
    if r.template.as_ref().is_some_and(|s| !s.is_empty()) {
        return Err(bad(
            "template is not supported by mlxd: the model's own chat template is used (or send raw: true with a formatted prompt)",
        ));
    }
    if r.context.as_ref().is_some_and(|c| !c.is_empty()) {
        return Err(bad(
            "context is not supported by mlxd: send the conversation to /api/chat instead",
        ));
    }
    let prompt = r.prompt.unwrap_or_default();
    let load_only = prompt.is_empty();
    let raw = r.raw.unwrap_or(false);
    let mut out = Map::new();
    out.insert("model".into(), Value::String(model.clone()));
    let path = if raw {
        out.insert("prompt".into(), Value::String(prompt));
        "/v1/completions"
    } else {
        let mut messages = Vec::new();
        if let Some(system) = r.system.filter(|s| !s.is_empty()) {
            messages.push(json!({"role": "system", "content": system}));
        }
        messages.push(json!({"role": "user", "content": prompt}));
        out.insert("messages".into(), Value::Array(messages));
        "/v1/chat/completions"
    };
    if raw && !r.format.is_null() && r.format != json!("") {
        return Err(bad("format cannot be combined with raw: true"));
    }
    let thinking = common(&mut out, &r.format, r.options.as_ref(), &r.think)?;
    Ok(Translated {
        route: Route::Generate,
        model,
        stream: r.stream.unwrap_or(true),
        keep_alive,
        thinking,
        load_only,
        path,
        body: Value::Object(out),
    })
}

/// What chat and generate share: `format`, `options`, `think`, and the stream with usage.
/// Returns whether reasoning is shown.
fn common(
    out: &mut Map<String, Value>,
    format: &Value,
    options: Option<&Map<String, Value>>,
    think: &Value,
) -> Result<bool, ProxyError> {
    if let Some(rf) = response_format(format)? {
        out.insert("response_format".into(), rf);
    }
    if let Some(options) = options {
        map_options(options, out)?;
    }
    let thinking = match think {
        Value::Null => true,
        Value::Bool(b) => {
            out.insert("chat_template_kwargs".into(), json!({"enable_thinking": b}));
            *b
        }
        Value::String(level) if matches!(level.as_str(), "low" | "medium" | "high") => {
            out.insert(
                "chat_template_kwargs".into(),
                json!({"enable_thinking": true, "reasoning_effort": level}),
            );
            true
        }
        other => {
            return Err(bad(format!(
                "think must be true, false, \"low\", \"medium\" or \"high\", got {other}"
            )))
        }
    };
    out.insert("stream".into(), Value::Bool(true));
    out.insert("stream_options".into(), json!({"include_usage": true}));
    Ok(thinking)
}

/// `format`: `"json"` is any JSON object, an object is a JSON schema; both constrain the
/// output (the engine's structured decoding).
fn response_format(format: &Value) -> Result<Option<Value>, ProxyError> {
    match format {
        Value::Null => Ok(None),
        Value::String(s) if s.is_empty() => Ok(None),
        Value::String(s) if s == "json" => Ok(Some(json!({"type": "json_object"}))),
        Value::Object(_) => Ok(Some(json!({
            "type": "json_schema",
            "json_schema": {"name": "format", "schema": format, "strict": true},
        }))),
        other => Err(bad(format!(
            "invalid format: expected \"json\" or a JSON schema object, got {other}"
        ))),
    }
}

/// Chat messages in OpenAI's form. An assistant turn's tool calls get ids (`call_N`), and
/// each later `tool` message answers the earliest unanswered call of its `tool_name` (or
/// the earliest unanswered call, without one), as Ollama pairs them by order.
fn messages(input: Vec<Message>) -> Result<Vec<Value>, ProxyError> {
    let mut out = Vec::with_capacity(input.len());
    // (id, function name) of calls not yet answered.
    let mut open: Vec<(String, String)> = Vec::new();
    let mut next_call = 0usize;
    for (i, m) in input.into_iter().enumerate() {
        if m.images.as_ref().is_some_and(|v| !v.is_empty()) {
            return Err(bad(format!(
                "messages[{i}]: images are not supported: mlxd serves text-only models"
            )));
        }
        let content = m.content.unwrap_or_default();
        match m.role.as_str() {
            "system" | "user" => out.push(json!({"role": m.role, "content": content})),
            "assistant" => {
                let mut msg = json!({"role": "assistant", "content": content});
                if let Some(calls) = m.tool_calls.filter(|c| !c.is_empty()) {
                    let mut openai = Vec::with_capacity(calls.len());
                    for call in calls {
                        let id = format!("call_{next_call}");
                        next_call += 1;
                        let arguments = match call.function.arguments {
                            Value::Null => "{}".to_string(),
                            Value::String(s) => s,
                            v @ Value::Object(_) => v.to_string(),
                            other => {
                                return Err(bad(format!(
                                "messages[{i}]: tool call arguments must be an object, got {other}"
                            )))
                            }
                        };
                        open.push((id.clone(), call.function.name.clone()));
                        openai.push(json!({
                            "id": id,
                            "type": "function",
                            "function": {"name": call.function.name, "arguments": arguments},
                        }));
                    }
                    msg["tool_calls"] = Value::Array(openai);
                }
                out.push(msg);
            }
            "tool" => {
                let pos = match &m.tool_name {
                    Some(name) => open.iter().position(|(_, n)| n == name),
                    None => (!open.is_empty()).then_some(0),
                };
                let mut msg = json!({"role": "tool", "content": content});
                if let Some(pos) = pos {
                    msg["tool_call_id"] = Value::String(open.remove(pos).0);
                }
                out.push(msg);
            }
            other => {
                return Err(bad(format!(
                "messages[{i}]: unknown role {other:?}; expected system, user, assistant or tool"
            )))
            }
        }
    }
    Ok(out)
}

/// Ollama options the engine has no counterpart for (llama.cpp runtime settings); ignored,
/// as Ollama ignores options that do not apply.
const IGNORED_OPTIONS: &[&str] = &[
    "num_ctx",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "num_thread",
    "num_keep",
    "repeat_last_n",
    "typical_p",
    "tfs_z",
    "mirostat",
    "mirostat_tau",
    "mirostat_eta",
    "penalize_newline",
    "numa",
    "low_vram",
    "f16_kv",
    "vocab_only",
    "use_mmap",
    "use_mlock",
    "logits_all",
    "embedding_only",
];

/// Copies `options` into the OpenAI request under our names, checking each value's type
/// (a wrong type is the client's error, named); options we do not use are ignored.
fn map_options(
    options: &Map<String, Value>,
    out: &mut Map<String, Value>,
) -> Result<(), ProxyError> {
    for (key, value) in options {
        if value.is_null() {
            continue;
        }
        let float = |v: &Value| {
            v.as_f64()
                .ok_or_else(|| bad(format!("option {key:?} must be a number, got {v}")))
        };
        let int = |v: &Value| {
            v.as_i64()
                .or_else(|| {
                    v.as_f64()
                        .filter(|f| f.fract() == 0.0 && f.abs() < 9e15)
                        .map(|f| f as i64)
                })
                .ok_or_else(|| bad(format!("option {key:?} must be an integer, got {v}")))
        };
        match key.as_str() {
            "temperature" | "top_p" | "min_p" | "presence_penalty" | "frequency_penalty" => {
                out.insert(key.clone(), json!(float(value)?));
            }
            "repeat_penalty" => {
                out.insert("repetition_penalty".into(), json!(float(value)?));
            }
            "top_k" | "seed" => {
                out.insert(key.clone(), json!(int(value)?));
            }
            "num_predict" => match int(value)? {
                // -1: until the model stops; -2: until the context is full. Either way
                // the engine's own limit (the context) applies.
                -1 | -2 => {}
                n if n < 0 => {
                    return Err(bad(format!(
                        "option \"num_predict\" must be -1, -2 or a non-negative integer, got {n}"
                    )))
                }
                n => {
                    out.insert("max_tokens".into(), json!(n));
                }
            },
            "stop" => {
                let stops = value
                    .as_array()
                    .filter(|a| a.iter().all(Value::is_string))
                    .ok_or_else(|| {
                        bad(format!(
                            "option \"stop\" must be an array of strings, got {value}"
                        ))
                    })?;
                if !stops.is_empty() {
                    out.insert("stop".into(), Value::Array(stops.clone()));
                }
            }
            k if IGNORED_OPTIONS.contains(&k) => {
                tracing::debug!(
                    option = k,
                    "Ollama option without an mlxd counterpart; ignored"
                );
            }
            k => tracing::debug!(option = k, "unknown Ollama option; ignored"),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat_of(v: Value) -> Translated {
        chat(v.to_string().as_bytes()).unwrap()
    }

    fn err_of(r: Result<Translated, ProxyError>) -> String {
        let e = r.unwrap_err();
        assert_eq!(e.status().as_u16(), 400, "{e}");
        e.to_string()
    }

    #[test]
    fn chat_maps_messages_options_and_stream() {
        let t = chat_of(json!({
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "hi"}
            ],
            "options": {
                "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 7,
                "num_predict": 12, "stop": ["\n\n"], "repeat_penalty": 1.1,
                "num_ctx": 4096, "some_future_option": "x"
            },
            "stream": false
        }));
        assert_eq!(t.route, Route::Chat);
        assert_eq!(t.path, "/v1/chat/completions");
        assert!(!t.stream);
        assert!(!t.load_only);
        assert_eq!(t.keep_alive, KeepAlive::Default);
        assert_eq!(
            t.body,
            json!({
                "model": "m",
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hi"}
                ],
                "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 7,
                "max_tokens": 12, "stop": ["\n\n"], "repetition_penalty": 1.1,
                "stream": true, "stream_options": {"include_usage": true}
            })
        );
    }

    #[test]
    fn stream_is_the_default_and_empty_messages_only_load() {
        let t = chat_of(json!({"model": "m", "keep_alive": 0}));
        assert!(t.stream);
        assert!(t.load_only);
        assert_eq!(t.keep_alive, KeepAlive::Unload);
    }

    #[test]
    fn num_predict_unbounded_forms_leave_the_limit_to_the_engine() {
        for n in [-1, -2] {
            let t = chat_of(json!({"model": "m", "messages": [], "options": {"num_predict": n}}));
            assert!(t.body.get("max_tokens").is_none());
        }
        let e = err_of(chat(
            br#"{"model":"m","messages":[],"options":{"num_predict":-3}}"#,
        ));
        assert!(e.contains("num_predict"), "{e}");
    }

    #[test]
    fn option_types_are_checked() {
        for (options, needle) in [
            (
                json!({"temperature": "hot"}),
                "\"temperature\" must be a number",
            ),
            (json!({"top_k": 1.5}), "\"top_k\" must be an integer"),
            (json!({"seed": "1"}), "\"seed\" must be an integer"),
            (json!({"stop": "x"}), "\"stop\" must be an array of strings"),
            (json!({"stop": [1]}), "\"stop\" must be an array of strings"),
        ] {
            let body = json!({"model": "m", "messages": [], "options": options});
            let e = err_of(chat(body.to_string().as_bytes()));
            assert!(e.contains(needle), "{e}");
        }
        // Integral floats are integers, as JSON encoders often write them.
        let t = chat_of(json!({"model": "m", "messages": [], "options": {"top_k": 40.0}}));
        assert_eq!(t.body["top_k"], json!(40));
    }

    #[test]
    fn format_json_and_schema() {
        let t = chat_of(json!({"model": "m", "messages": [], "format": "json"}));
        assert_eq!(t.body["response_format"], json!({"type": "json_object"}));
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let t = chat_of(json!({"model": "m", "messages": [], "format": schema}));
        assert_eq!(t.body["response_format"]["type"], "json_schema");
        assert_eq!(t.body["response_format"]["json_schema"]["schema"], schema);
        let t = chat_of(json!({"model": "m", "messages": [], "format": ""}));
        assert!(t.body.get("response_format").is_none());
        let e = err_of(chat(br#"{"model":"m","messages":[],"format":"yaml"}"#));
        assert!(e.contains("invalid format"), "{e}");
    }

    #[test]
    fn tool_calls_get_ids_and_tool_results_answer_them() {
        let t = chat_of(json!({
            "model": "m",
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}],
            "messages": [
                {"role": "user", "content": "weather in Paris and Rome?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                    {"function": {"name": "get_time", "arguments": {}}}
                ]},
                {"role": "tool", "content": "12:00", "tool_name": "get_time"},
                {"role": "tool", "content": "sunny"}
            ]
        }));
        let m = &t.body["messages"];
        assert_eq!(m[1]["tool_calls"][0]["id"], "call_0");
        assert_eq!(m[1]["tool_calls"][0]["type"], "function");
        assert_eq!(
            m[1]["tool_calls"][0]["function"]["arguments"],
            json!("{\"city\":\"Paris\"}")
        );
        assert_eq!(m[2]["tool_call_id"], "call_1");
        assert_eq!(m[3]["tool_call_id"], "call_0");
        assert_eq!(t.body["tools"][0]["function"]["name"], "get_weather");
    }

    #[test]
    fn think_maps_to_the_template() {
        let t = chat_of(json!({"model": "m", "messages": [], "think": false}));
        assert!(!t.thinking);
        assert_eq!(
            t.body["chat_template_kwargs"],
            json!({"enable_thinking": false})
        );
        let t = chat_of(json!({"model": "m", "messages": [], "think": "high"}));
        assert!(t.thinking);
        assert_eq!(t.body["chat_template_kwargs"]["reasoning_effort"], "high");
        let e = err_of(chat(br#"{"model":"m","messages":[],"think":"max"}"#));
        assert!(e.contains("think"), "{e}");
    }

    #[test]
    fn bad_chat_requests() {
        assert!(err_of(chat(br#"{"messages":[]}"#)).contains("model is required"));
        assert!(err_of(chat(b"[]")).contains("JSON object"));
        assert!(err_of(chat(b"{")).contains("not valid JSON"));
        assert!(err_of(chat(
            br#"{"model":"m","messages":[{"role":"robot","content":"x"}]}"#
        ))
        .contains("unknown role"));
        assert!(err_of(chat(br#"{"model":"m","messages":"hi"}"#)).contains("invalid request"));
        assert!(err_of(chat(
            br#"{"model":"m","messages":[{"role":"user","content":"x","images":["aGk="]}]}"#
        ))
        .contains("images"));
        assert!(err_of(chat(br#"{"model":"m","keep_alive":"soon"}"#)).contains("keep_alive"));
    }

    #[test]
    fn generate_through_the_template_or_raw() {
        let t = generate(
            json!({"model": "m", "prompt": "Why?", "system": "Be short.", "stream": false})
                .to_string()
                .as_bytes(),
        )
        .unwrap();
        assert_eq!(t.route, Route::Generate);
        assert_eq!(t.path, "/v1/chat/completions");
        assert_eq!(
            t.body["messages"],
            json!([{"role": "system", "content": "Be short."}, {"role": "user", "content": "Why?"}])
        );
        let t = generate(br#"{"model":"m","prompt":"1, 2, 3,","raw":true}"#).unwrap();
        assert_eq!(t.path, "/v1/completions");
        assert_eq!(t.body["prompt"], "1, 2, 3,");
        assert!(t.body.get("messages").is_none());
        let t = generate(br#"{"model":"m"}"#).unwrap();
        assert!(t.load_only);
    }

    #[test]
    fn bad_generate_requests() {
        for (body, needle) in [
            (&br#"{"model":"m","prompt":"x","suffix":"y"}"#[..], "suffix"),
            (br#"{"model":"m","prompt":"x","images":["aGk="]}"#, "images"),
            (
                br#"{"model":"m","prompt":"x","template":"{{ .Prompt }}"}"#,
                "template",
            ),
            (br#"{"model":"m","prompt":"x","context":[1,2]}"#, "context"),
            (
                br#"{"model":"m","prompt":"x","raw":true,"format":"json"}"#,
                "raw",
            ),
            (br#"{"prompt":"x"}"#, "model is required"),
        ] {
            let e = err_of(generate(body));
            assert!(e.contains(needle), "{e}");
        }
    }
}
