//! OpenAI-compatible wire types: `/v1/chat/completions`, `/v1/completions`, `/v1/models`.
//!
//! Requests keep numbers in wide, signed types (`i64`, `f64`) so that an out-of-range value
//! such as `"max_tokens": -1` reaches validation and gets an error naming the limit, instead of
//! a bare deserialization error. Unknown request fields are ignored, as OpenAI does.
//!
//! Every generated choice carries an `mlxd` extension with the token ids behind its text, so
//! that the proxy can resume a stream on a restarted engine without losing or repeating a token.
use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

pub const OBJECT_CHAT_COMPLETION: &str = "chat.completion";
pub const OBJECT_CHAT_COMPLETION_CHUNK: &str = "chat.completion.chunk";
pub const OBJECT_TEXT_COMPLETION: &str = "text_completion";
pub const OBJECT_LIST: &str = "list";
pub const OBJECT_MODEL: &str = "model";

/// The line that ends an OpenAI SSE stream (`data: [DONE]`).
pub const SSE_DONE: &str = "[DONE]";

// ---------------------------------------------------------------------------------------------
// Requests
// ---------------------------------------------------------------------------------------------

/// `POST /v1/chat/completions`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    /// Tool definitions (`{"type": "function", "function": {name, description,
    /// parameters}}`), checked by the engine and passed to the chat template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<Vec<serde_json::Value>>,
    /// `"auto"`, `"none"`, `"required"` or `{"type": "function", "function": {"name"}}`;
    /// checked by the engine against `tools`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_choice: Option<serde_json::Value>,
    /// Whether the model may call several tools in one turn (default true).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parallel_tool_calls: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub response_format: Option<ResponseFormat>,
    /// Extra variables for the chat template, e.g. Qwen3's `{"enable_thinking": false}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_kwargs: Option<serde_json::Map<String, serde_json::Value>>,
    /// Return the chosen tokens' log-probabilities.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<bool>,
    /// With `logprobs`: this many most likely alternatives per token (0–20).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<i64>,
    #[serde(flatten)]
    pub params: GenerationParams,
}

/// `response_format` of a chat request.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    Text,
    /// Any JSON object.
    JsonObject,
    /// JSON valid under `json_schema.schema`.
    JsonSchema {
        json_schema: JsonSchemaFormat,
    },
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JsonSchemaFormat {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// Absent: any JSON value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schema: Option<serde_json::Value>,
    /// Always enforced here (the output is constrained by the schema either way).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

/// `POST /v1/completions`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionRequest {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    pub prompt: Prompt,
    /// Return each chosen token's log-probability and this many most likely alternatives
    /// (0–20; the legacy API's integer form).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<i64>,
    #[serde(flatten)]
    pub params: GenerationParams,
}

/// The generation and sampling fields shared by both completion endpoints.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct GenerationParams {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<i64>,
    /// The newer name of `max_tokens`; wins when both are given (the rule lives in
    /// [`GenerationParams::max_tokens`], `request.rs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_completion_tokens: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f64>,
    /// 0 or -1 disable it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repetition_penalty: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f64>,
    /// Token id (as a decimal string) → bias added to its logit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logit_bias: Option<BTreeMap<String, f64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stop: Option<Stop>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    /// Number of choices, each generated as its own sequence.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub n: Option<i64>,
    /// Accepted and logged; no effect on generation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    /// Accepted; there is one tier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_tier: Option<String>,
    /// mlxd extension (used by the proxy to resume a stream on a restarted engine).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlxd: Option<RequestExtension>,
}

/// The `mlxd` request extension.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestExtension {
    /// Continue a response whose first tokens were already generated and sent: these ids are
    /// appended to the prompt as a forced continuation, their text is not sent again, they
    /// count towards `max_tokens` and `usage.completion_tokens`, and a resumed chat stream
    /// starts without the opening `role` chunk. Exactly the concatenated `mlxd.token_ids` of
    /// the chunks already received.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resume_token_ids: Vec<u32>,
}

impl GenerationParams {
    pub fn is_stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    /// The ids of an earlier, interrupted generation to continue from (empty: none).
    pub fn resume_token_ids(&self) -> &[u32] {
        self.mlxd
            .as_ref()
            .map_or(&[], |m| m.resume_token_ids.as_slice())
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }
}

/// `stop`: one string or a list of them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

impl Stop {
    /// The stop strings, in order, empty ones left out.
    pub fn to_vec(&self) -> Vec<String> {
        let all = match self {
            Stop::One(s) => vec![s.clone()],
            Stop::Many(v) => v.clone(),
        };
        all.into_iter().filter(|s| !s.is_empty()).collect()
    }
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "serde_json::Value")]
pub struct StreamOptions {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include_usage: Option<bool>,
}

impl TryFrom<serde_json::Value> for StreamOptions {
    type Error = String;

    /// Only a JSON object: serde's derived form would also read a sequence (`[]`, `[true]`)
    /// as the struct, silently accepting a malformed request.
    fn try_from(v: serde_json::Value) -> Result<Self, String> {
        let serde_json::Value::Object(map) = v else {
            return Err(format!("stream_options must be an object, got {v}"));
        };
        let include_usage = match map.get("include_usage") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::Bool(b)) => Some(*b),
            Some(other) => {
                return Err(format!(
                    "stream_options.include_usage must be a boolean, got {other}"
                ))
            }
        };
        Ok(StreamOptions { include_usage })
    }
}

/// One message of a chat.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: Role,
    /// `null` is allowed (an assistant turn that only calls tools).
    #[serde(default)]
    pub content: Option<MessageContent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: Some(MessageContent::Text(content.into())),
            name: None,
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Also accepts OpenAI's newer name for it, `developer`.
    #[serde(alias = "developer")]
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

/// Message content: a string, or an array of typed parts (only text parts are supported).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

impl MessageContent {
    /// The text of the content; text parts are joined with newlines.
    pub fn to_text(&self) -> String {
        match self {
            MessageContent::Text(s) => s.clone(),
            MessageContent::Parts(parts) => parts
                .iter()
                .map(|p| match p {
                    ContentPart::Text { text } => text.as_str(),
                })
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    Text { text: String },
}

/// `prompt` of `/v1/completions`: a string, a list of one string, token ids, or a list of one
/// list of token ids.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

// ---------------------------------------------------------------------------------------------
// Responses
// ---------------------------------------------------------------------------------------------

/// Token counts of one request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

impl Usage {
    pub fn new(prompt_tokens: u64, completion_tokens: u64, cached_tokens: u64) -> Self {
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens + completion_tokens,
            prompt_tokens_details: Some(PromptTokensDetails { cached_tokens }),
        }
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens that came from the prompt cache.
    pub cached_tokens: u64,
}

/// The `mlxd` extension on each generated choice: the token ids whose text this choice (or
/// chunk) carries. Concatenated over a stream, they are every token whose text was sent.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenIds {
    pub token_ids: Vec<u32>,
}

/// The SSE comment line that starts each streamed choice chunk from the engine:
/// `: mlxd {"token_ids":[...],"finish":true}\n`, followed by the chunk's `data:` line.
///
/// Streamed chunks carry their token ids here rather than in the chunk's JSON, so the proxy
/// records them from this short line and forwards the rest of the event as bytes, without
/// parsing and re-serializing the chunk (SSE clients ignore comment lines, so even an
/// unfiltered stream stays valid). Events with this line are choice chunks only: never the
/// opening `role` chunk, a usage chunk or an error. A chunk that still carries `mlxd` in its
/// JSON (an engine from before this line) is read the old way.
pub const SSE_META_PREFIX: &str = ": mlxd ";

/// What the [`SSE_META_PREFIX`] line says about its event's (single) choice.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventMeta {
    /// The ids of the tokens whose text the chunk carries (may be empty).
    pub token_ids: Vec<u32>,
    /// The chunk has a `finish_reason`: the choice is over.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub finish: bool,
}

impl EventMeta {
    /// The whole comment line, newline included.
    pub fn line(&self) -> String {
        let mut out = String::from(SSE_META_PREFIX);
        // A struct of numbers and a bool always serializes.
        out.push_str(&serde_json::to_string(self).unwrap_or_default());
        out.push('\n');
        out
    }

    /// Splits an event into its meta line's content and the offset where the rest (the
    /// `data:` line) starts; `None` when the event does not start with a meta line.
    /// `Some(Err)` when it does but the line does not parse.
    pub fn split(event: &[u8]) -> Option<(Result<Self, serde_json::Error>, usize)> {
        let rest = event.strip_prefix(SSE_META_PREFIX.as_bytes())?;
        let end = rest.iter().position(|&b| b == b'\n')?;
        let meta = serde_json::from_slice(&rest[..end]);
        Some((meta, SSE_META_PREFIX.len() + end + 1))
    }
}

/// Non-streaming `/v1/chat/completions` response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChoice {
    pub index: u32,
    pub message: AssistantMessage,
    pub finish_reason: Option<String>,
    #[serde(default)]
    pub logprobs: Option<ChatLogprobs>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlxd: Option<TokenIds>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AssistantMessage {
    pub role: Role,
    pub content: Option<String>,
    /// The model's thinking, split from `content` (`<think>…</think>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
}

/// A call the model made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    /// JSON text of the arguments object.
    pub arguments: String,
}

/// One tool call's part in a streaming delta: the first carries `id`, `type` and the name.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCallDelta {
    pub index: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub function: FunctionCallDelta,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCallDelta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arguments: Option<String>,
}

/// One SSE chunk of a streaming `/v1/chat/completions` response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    /// Only on the last chunk (which has no choices), with `stream_options.include_usage`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub finish_reason: Option<String>,
    #[serde(default)]
    pub logprobs: Option<ChatLogprobs>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlxd: Option<TokenIds>,
}

/// The change a chunk brings; the first chunk of a stream has `role`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatDelta {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<Role>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallDelta>>,
}

/// Non-streaming `/v1/completions` response; its SSE chunks have the same shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionResponse {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub finish_reason: Option<String>,
    #[serde(default)]
    pub logprobs: Option<CompletionLogprobs>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mlxd: Option<TokenIds>,
}

/// Log-probabilities of a chat choice's tokens (or of one chunk's tokens), in order.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

/// One generated token: its text, UTF-8 bytes and log-probability under the model, with the
/// most likely alternatives at its position (most likely first).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Option<Vec<u8>>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Option<Vec<u8>>,
}

/// The legacy completions shape: parallel lists, one entry per generated token.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    /// Alternatives by token text (tokens with the same text keep the likelier).
    pub top_logprobs: Vec<std::collections::BTreeMap<String, f32>>,
    /// Byte offset of each token's text in the choice's text.
    pub text_offset: Vec<usize>,
}

/// `GET /v1/models`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelList {
    pub object: String,
    pub data: Vec<ModelObject>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelObject {
    pub id: String,
    pub object: String,
    pub created: u64,
    pub owned_by: String,
    /// Extension: the model's context length in tokens, where known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub context_length: Option<u64>,
    /// Extension (as vLLM lists LoRA adapters): for an adapter, the model it applies to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn event_meta_line_round_trips_and_splits() {
        let m = EventMeta {
            token_ids: vec![3, 4],
            finish: true,
        };
        let ev = format!("{}data: {{}}\n\n", m.line());
        assert!(ev.starts_with(": mlxd {\"token_ids\":[3,4],\"finish\":true}\n"));
        let (got, at) = EventMeta::split(ev.as_bytes()).unwrap();
        assert_eq!(got.unwrap(), m);
        assert_eq!(&ev[at..], "data: {}\n\n");
        let plain = EventMeta::default().line();
        assert_eq!(plain, ": mlxd {\"token_ids\":[]}\n");
        assert!(EventMeta::split(b"data: {}\n\n").is_none());
        assert!(EventMeta::split(b": mlxd nope\ndata: {}\n\n")
            .unwrap()
            .0
            .is_err());
    }

    #[test]
    fn chat_request_with_string_and_part_contents() {
        let req: ChatCompletionRequest = serde_json::from_value(json!({
            "model": "m",
            "messages": [
                {"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "x"}]},
                {"role": "tool", "content": "42", "tool_call_id": "x"}
            ],
            "max_tokens": 5,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "logit_bias": {"42": -100, "7": 2.5},
            "seed": 3,
            "stop": ["\n\n", "END"],
            "stream": true,
            "stream_options": {"include_usage": true},
            "n": 1,
            "user": "ignored"
        }))
        .unwrap();
        assert_eq!(req.model.as_deref(), Some("m"));
        assert_eq!(req.messages.len(), 4);
        assert_eq!(req.messages[0].role, Role::System);
        assert_eq!(req.messages[1].content.as_ref().unwrap().to_text(), "a\nb");
        assert_eq!(req.messages[2].content, None);
        assert_eq!(req.messages[3].role, Role::Tool);
        let p = &req.params;
        assert_eq!(p.max_tokens().unwrap().map(|l| l.value), Some(5));
        assert_eq!(p.temperature, Some(0.5));
        assert_eq!(p.top_k, Some(40));
        assert_eq!(p.logit_bias.as_ref().unwrap()["42"], -100.0);
        assert_eq!(p.stop.as_ref().unwrap().to_vec(), vec!["\n\n", "END"]);
        assert!(p.is_stream());
        assert!(p.include_usage());
        assert_eq!(p.n, Some(1));
        assert_eq!(p.seed, Some(3));
    }

    #[test]
    fn max_completion_tokens_wins_and_negative_numbers_survive() {
        let p: GenerationParams =
            serde_json::from_value(json!({"max_tokens": -1, "max_completion_tokens": 9})).unwrap();
        assert_eq!(p.max_tokens().unwrap().map(|l| l.value), Some(9));
        let p: GenerationParams = serde_json::from_value(json!({"max_tokens": -1})).unwrap();
        assert_eq!(p.max_tokens, Some(-1));
        assert!(p.max_tokens().is_err());
        assert!(!p.is_stream());
        assert!(!p.include_usage());
    }

    #[test]
    fn resume_extension() {
        let p: GenerationParams =
            serde_json::from_value(json!({"mlxd": {"resume_token_ids": [4, 5]}})).unwrap();
        assert_eq!(p.resume_token_ids(), &[4, 5]);
        assert_eq!(
            serde_json::to_value(&p).unwrap(),
            json!({"mlxd": {"resume_token_ids": [4, 5]}})
        );
        assert!(GenerationParams::default().resume_token_ids().is_empty());
    }

    #[test]
    fn stop_as_single_string() {
        let p: GenerationParams = serde_json::from_value(json!({"stop": "x"})).unwrap();
        assert_eq!(p.stop, Some(Stop::One("x".into())));
        assert_eq!(Stop::Many(vec!["".into(), "y".into()]).to_vec(), vec!["y"]);
    }

    #[test]
    fn bad_role_and_part_type_are_rejected() {
        let err = serde_json::from_value::<ChatCompletionRequest>(
            json!({"messages": [{"role": "robot", "content": "x"}]}),
        );
        assert!(err.is_err());
        let err = serde_json::from_value::<ChatCompletionRequest>(json!({
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]
        }));
        assert!(err.is_err());
        assert!(serde_json::from_value::<ChatCompletionRequest>(json!({"model": "m"})).is_err());
    }

    #[test]
    fn completion_prompt_forms() {
        let cases = [
            (json!("hi"), Prompt::Text("hi".into())),
            (json!(["hi"]), Prompt::Texts(vec!["hi".into()])),
            (json!([1, 2, 3]), Prompt::Tokens(vec![1, 2, 3])),
            (json!([[1, 2]]), Prompt::TokenLists(vec![vec![1, 2]])),
        ];
        for (value, want) in cases {
            let req: CompletionRequest =
                serde_json::from_value(json!({"model": "m", "prompt": value})).unwrap();
            assert_eq!(req.prompt, want);
        }
    }

    #[test]
    fn chat_response_shape() {
        let resp = ChatCompletionResponse {
            id: "chatcmpl-1".into(),
            object: OBJECT_CHAT_COMPLETION.into(),
            created: 7,
            model: "m".into(),
            choices: vec![ChatChoice {
                index: 0,
                message: AssistantMessage {
                    role: Role::Assistant,
                    content: Some("hello".into()),
                    reasoning_content: None,
                    tool_calls: None,
                },
                finish_reason: Some("stop".into()),
                logprobs: None,
                mlxd: Some(TokenIds {
                    token_ids: vec![1, 2],
                }),
            }],
            usage: Usage::new(3, 2, 1),
        };
        let value = serde_json::to_value(&resp).unwrap();
        assert_eq!(
            value,
            json!({
                "id": "chatcmpl-1", "object": "chat.completion", "created": 7, "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"},
                             "finish_reason": "stop", "logprobs": null, "mlxd": {"token_ids": [1, 2]}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                          "prompt_tokens_details": {"cached_tokens": 1}}
            })
        );
        let back: ChatCompletionResponse = serde_json::from_value(value).unwrap();
        assert_eq!(back, resp);
    }

    #[test]
    fn chunk_shapes() {
        let first = ChatCompletionChunk {
            id: "c".into(),
            object: OBJECT_CHAT_COMPLETION_CHUNK.into(),
            created: 1,
            model: "m".into(),
            choices: vec![ChatChunkChoice {
                index: 0,
                delta: ChatDelta {
                    role: Some(Role::Assistant),
                    content: Some("".into()),
                    ..Default::default()
                },
                finish_reason: None,
                logprobs: None,
                mlxd: None,
            }],
            usage: None,
        };
        assert_eq!(
            serde_json::to_value(&first).unwrap(),
            json!({"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
                   "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                "finish_reason": null, "logprobs": null}]})
        );
        let usage_only = ChatCompletionChunk {
            choices: vec![],
            usage: Some(Usage::new(1, 1, 0)),
            ..first
        };
        let v = serde_json::to_value(&usage_only).unwrap();
        assert_eq!(v["choices"], json!([]));
        assert_eq!(v["usage"]["total_tokens"], 2);

        let text_chunk = CompletionResponse {
            id: "cmpl-1".into(),
            object: OBJECT_TEXT_COMPLETION.into(),
            created: 1,
            model: "m".into(),
            choices: vec![CompletionChoice {
                index: 0,
                text: "x".into(),
                finish_reason: None,
                logprobs: None,
                mlxd: Some(TokenIds { token_ids: vec![5] }),
            }],
            usage: None,
        };
        let v = serde_json::to_value(&text_chunk).unwrap();
        assert_eq!(v["choices"][0]["mlxd"]["token_ids"], json!([5]));
        assert!(v.get("usage").is_none());
    }

    #[test]
    fn model_list_shape() {
        let list = ModelList {
            object: OBJECT_LIST.into(),
            data: vec![ModelObject {
                id: "smollm2".into(),
                object: OBJECT_MODEL.into(),
                created: 0,
                owned_by: "mlxd".into(),
                context_length: Some(8192),
                parent: None,
            }],
        };
        assert_eq!(
            serde_json::to_value(&list).unwrap(),
            json!({"object": "list", "data": [{"id": "smollm2", "object": "model", "created": 0,
                   "owned_by": "mlxd", "context_length": 8192}]})
        );
    }

    #[test]
    fn stream_options_must_be_an_object() {
        let ok: StreamOptions = serde_json::from_str(r#"{"include_usage": true}"#).unwrap();
        assert_eq!(ok.include_usage, Some(true));
        for bad in ["[]", "[true]", "5", r#"{"include_usage": "yes"}"#] {
            assert!(
                serde_json::from_str::<StreamOptions>(bad).is_err(),
                "{bad} was accepted"
            );
        }
    }
}
