//! Anthropic Messages: `POST /v1/messages` (JSON, or SSE with the full event sequence) and
//! `POST /v1/messages/count_tokens`, with errors in Anthropic's shape.
//!
//! A request becomes the same [`Conversation`] the OpenAI route builds: `system` first,
//! `tool_use` blocks as assistant `tool_calls`, `tool_result` blocks as `tool` messages,
//! `thinking` as the template's `enable_thinking`. The output's thinking, text and calls
//! come back as `thinking`, `text` and `tool_use` blocks.
use std::convert::Infallible;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures::StreamExt;
use mlxd_protocol::anthropic::{
    BlockDelta, ContentBlock, CountTokensRequest, CountTokensResponse, DeltaUsage, ErrorResponse,
    Message, MessageDeltaBody, MessageRole, MessagesRequest, MessagesResponse, MessagesUsage,
    OutputFormat, StreamEvent, SystemPrompt, ThinkingConfig, Tool, ToolChoice as AnthChoice,
};
use mlxd_protocol::openai::{GenerationParams, Stop};
use serde_json::{json, Map, Value};

use super::conversation::{self, AgentGeneration, AgentStep, Conversation, Piece};
use super::error::ApiError;
use super::request::{parse_body, validate, MAX_BODY_BYTES};
use super::routes::{
    blocking, job, log_finish, new_id, refuse_impossible_prompt, start_with, Meta,
};
use super::tools::{self, ToolChoice, ToolSpec};
use super::ServerState;
use crate::constraint::grammar::Grammar;
use crate::runtime::request::FinishReason;

/// An [`ApiError`] answered in Anthropic's shape.
#[derive(Debug)]
pub struct AnthropicError(pub ApiError);

impl From<ApiError> for AnthropicError {
    fn from(e: ApiError) -> Self {
        AnthropicError(e)
    }
}

/// Anthropic's error body for `e` (also the SSE `error` event).
fn error_body(e: &ApiError) -> ErrorResponse {
    let body = e.body();
    let message = match &body.error.param {
        Some(param) if !body.error.message.contains(param.as_str()) => {
            format!("{}: {}", param, body.error.message)
        }
        _ => body.error.message,
    };
    ErrorResponse::new(e.status().as_u16(), message)
}

impl IntoResponse for AnthropicError {
    fn into_response(self) -> Response {
        let status = self.0.status();
        let mut response = (status, Json(error_body(&self.0))).into_response();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

/// A JSON body, refused in Anthropic's shape.
pub struct AnthropicJson<T>(pub T);

impl<S: Send + Sync, T: serde::de::DeserializeOwned> FromRequest<S> for AnthropicJson<T> {
    type Rejection = AnthropicError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            AnthropicError(if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
                ApiError::TooLarge {
                    limit: MAX_BODY_BYTES,
                }
            } else {
                ApiError::invalid_body(format!("cannot read the request body: {rejection}"))
            })
        })?;
        parse_body::<T>(&bytes).map(AnthropicJson).map_err(|e| {
            AnthropicError(match e {
                // Name what we do not support rather than serde's list of variants.
                ApiError::Invalid { message, param, code } if message.contains("unknown variant") && param.as_deref().is_some_and(|p| p.contains("content")) => ApiError::Invalid {
                    message: format!("{message} (supported content blocks: text, tool_use, tool_result, thinking)"),
                    param,
                    code,
                },
                other => other,
            })
        })
    }
}

/// The conversation of a Messages request (shared with count_tokens).
fn conversation(
    system: Option<&SystemPrompt>,
    messages: &[Message],
    tools: Option<&[Tool]>,
    tool_choice: Option<&AnthChoice>,
    thinking: Option<&ThinkingConfig>,
) -> Result<(Conversation, usize), ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "messages must contain at least one message",
        ));
    }
    let mut out = Vec::new();
    let mut bytes = 0;
    if let Some(system) = system {
        let text = system.to_text();
        bytes += text.len();
        out.push(json!({"role": "system", "content": text}));
    }
    let mut calls: Vec<String> = Vec::new();
    for (i, m) in messages.iter().enumerate() {
        let role = match m.role {
            MessageRole::User => "user",
            MessageRole::Assistant => "assistant",
        };
        let blocks = match &m.content {
            mlxd_protocol::anthropic::Content::Text(t) => {
                bytes += t.len();
                out.push(json!({"role": role, "content": t}));
                continue;
            }
            mlxd_protocol::anthropic::Content::Blocks(blocks) => blocks,
        };
        let mut text = Vec::new();
        let mut tool_calls = Vec::new();
        for (j, block) in blocks.iter().enumerate() {
            let at = format!("messages[{i}].content[{j}]");
            match (m.role, block) {
                (_, ContentBlock::Text { text: t }) => {
                    bytes += t.len();
                    text.push(t.clone());
                }
                (MessageRole::Assistant, ContentBlock::ToolUse { id, name, input }) => {
                    if !input.is_object() {
                        return Err(ApiError::invalid(
                            format!("{at}.input"),
                            "`input` must be an object",
                        ));
                    }
                    bytes += input.to_string().len();
                    calls.push(id.clone());
                    tool_calls.push(json!({"id": id, "type": "function",
                        "function": {"name": name, "arguments": input}}));
                }
                (
                    MessageRole::User,
                    ContentBlock::ToolResult {
                        tool_use_id,
                        content,
                        is_error,
                    },
                ) => {
                    if !calls.contains(tool_use_id) {
                        return Err(ApiError::invalid(
                            format!("{at}.tool_use_id"),
                            format!("tool_use_id {tool_use_id:?} answers no tool_use block of an earlier assistant message"),
                        ));
                    }
                    // Text before a result goes first, as its own user turn.
                    if !text.is_empty() {
                        out.push(json!({"role": "user", "content": text.join("\n")}));
                        text.clear();
                    }
                    let mut result = content.as_ref().map(|c| c.to_text()).unwrap_or_default();
                    if *is_error == Some(true) {
                        result = format!("Error: {result}");
                    }
                    bytes += result.len();
                    out.push(
                        json!({"role": "tool", "tool_call_id": tool_use_id, "content": result}),
                    );
                }
                // Earlier thinking is not shown to the model again, as Anthropic does.
                (MessageRole::Assistant, ContentBlock::Thinking { .. }) => {}
                (_, other) => {
                    let kind = match other {
                        ContentBlock::ToolUse { .. } => "tool_use",
                        ContentBlock::ToolResult { .. } => "tool_result",
                        ContentBlock::Thinking { .. } => "thinking",
                        ContentBlock::Text { .. } => "text",
                    };
                    return Err(ApiError::invalid(
                        format!("{at}.type"),
                        format!("a {role} message cannot hold a {kind} block"),
                    ));
                }
            }
        }
        if !text.is_empty() || !tool_calls.is_empty() {
            let mut msg = Map::new();
            msg.insert("role".into(), Value::from(role));
            msg.insert(
                "content".into(),
                if text.is_empty() {
                    Value::Null
                } else {
                    Value::from(text.join("\n"))
                },
            );
            if !tool_calls.is_empty() {
                msg.insert("tool_calls".into(), Value::Array(tool_calls));
            }
            out.push(Value::Object(msg));
        }
    }
    let mut specs: Vec<ToolSpec> = Vec::new();
    for (i, t) in tools.unwrap_or_default().iter().enumerate() {
        let spec = tools::tool_spec(
            Some(&Value::from(t.name.clone())),
            t.description
                .as_ref()
                .map(|d| Value::from(d.clone()))
                .as_ref(),
            Some(&t.input_schema),
            &format!("tools[{i}]"),
            "input_schema",
        )?;
        if specs.iter().any(|s| s.name == spec.name) {
            return Err(ApiError::invalid(
                format!("tools[{i}].name"),
                format!("tool name {:?} is given twice", spec.name),
            ));
        }
        specs.push(spec);
    }
    let (choice, parallel) = match tool_choice {
        None => (tools::default_choice(&specs), true),
        Some(AnthChoice::Auto {
            disable_parallel_tool_use,
        }) => (ToolChoice::Auto, disable_parallel_tool_use != &Some(true)),
        Some(AnthChoice::Any {
            disable_parallel_tool_use,
        }) => (
            ToolChoice::Required,
            disable_parallel_tool_use != &Some(true),
        ),
        Some(AnthChoice::Tool {
            name,
            disable_parallel_tool_use,
        }) => (
            ToolChoice::Named(name.clone()),
            disable_parallel_tool_use != &Some(true),
        ),
        Some(AnthChoice::None) => (ToolChoice::None, true),
    };
    let choice = tools::check_choice(choice, &specs, "tool_choice")?;
    let mut template_vars = Map::new();
    match thinking {
        Some(ThinkingConfig::Enabled { .. }) => {
            template_vars.insert("enable_thinking".into(), Value::Bool(true));
        }
        Some(ThinkingConfig::Disabled) => {
            template_vars.insert("enable_thinking".into(), Value::Bool(false));
        }
        None => {}
    }
    Ok((
        Conversation {
            messages: out,
            tools: specs,
            choice: Some(choice),
            parallel_tool_calls: parallel,
            output: None,
            template_vars,
            tool_schema_field: "input_schema",
        },
        bytes,
    ))
}

pub(super) async fn count_tokens(
    State(state): State<ServerState>,
    AnthropicJson(req): AnthropicJson<CountTokensRequest>,
) -> Result<Response, AnthropicError> {
    let (conv, bytes) = conversation(
        req.system.as_ref(),
        &req.messages,
        req.tools.as_deref(),
        req.tool_choice.as_ref(),
        req.thinking.as_ref(),
    )?;
    refuse_impossible_prompt(&state, bytes, "messages")?;
    let prepared = {
        let state = state.clone();
        blocking(move || conversation::prepare(&state, conv)).await?
    };
    Ok(Json(CountTokensResponse {
        input_tokens: prepared.prompt.len() as u64,
    })
    .into_response())
}

pub(super) async fn messages(
    State(state): State<ServerState>,
    AnthropicJson(req): AnthropicJson<MessagesRequest>,
) -> Result<Response, AnthropicError> {
    // The contract's fields as the proxy read them (`messages_params`), then sampling.
    let params = GenerationParams {
        temperature: req.temperature,
        top_p: req.top_p,
        top_k: req.top_k,
        stop: req.stop_sequences.clone().map(Stop::Many),
        ..mlxd_protocol::request::messages_params(req.max_tokens, req.stream)
    };
    let mut settings = validate(&params, &state.tokenizer).map_err(|e| match e {
        ApiError::Invalid {
            message,
            param: Some(p),
            code,
        } if p == "stop" => ApiError::Invalid {
            message,
            param: Some("stop_sequences".into()),
            code,
        },
        other => other,
    })?;
    settings.model = req.model.clone();
    if let Some(user) = req.metadata.as_ref().and_then(|m| m.get("user_id")) {
        tracing::debug!(user = %user, "messages request");
    }
    let (conv, bytes) = conversation(
        req.system.as_ref(),
        &req.messages,
        req.tools.as_deref(),
        req.tool_choice.as_ref(),
        req.thinking.as_ref(),
    )?;
    refuse_impossible_prompt(&state, bytes, "messages")?;
    let mut conv = conv;
    if let Some(OutputFormat::JsonSchema { schema }) =
        req.output_config.as_ref().and_then(|c| c.format.as_ref())
    {
        if !(schema.is_object() || schema.is_boolean()) {
            return Err(ApiError::invalid(
                "output_config.format.schema",
                format!("invalid JSON schema: a schema is an object or a boolean, got {schema}"),
            )
            .into());
        }
        conv.output = Some((
            Grammar::JsonSchema(schema.clone()),
            "output_config.format.schema".into(),
        ));
    }
    let prepared = {
        let state = state.clone();
        blocking(move || conversation::prepare(&state, conv)).await?
    };
    let job = job(&state, prepared.prompt, settings, "messages")?;
    let (mut generation, settings) =
        start_with(&state, job, prepared.constraint, !prepared.keep_special)?;
    generation.started().await?;
    let meta = Meta {
        id: format!("msg_{}", &new_id("x")[2..26]),
        created: 0,
        model: state.model_id.clone(),
    };
    let generation = AgentGeneration::new(generation, prepared.parser);
    if settings.stream {
        Ok(sse(meta, generation))
    } else {
        whole(meta, generation).await
    }
}

fn stop_reason(reason: FinishReason, called: bool, stop_sequence: Option<&str>) -> &'static str {
    match reason {
        FinishReason::Length => "max_tokens",
        FinishReason::Stop if called => "tool_use",
        FinishReason::Stop if stop_sequence.is_some() => "stop_sequence",
        FinishReason::Stop => "end_turn",
    }
}

fn usage(g: &AgentGeneration) -> MessagesUsage {
    let u = g.generation.usage();
    let cached = u.prompt_tokens_details.map_or(0, |d| d.cached_tokens);
    MessagesUsage {
        // Anthropic counts cache reads apart from input tokens.
        input_tokens: u.prompt_tokens - cached,
        output_tokens: u.completion_tokens,
        cache_read_input_tokens: cached,
        cache_creation_input_tokens: 0,
    }
}

/// A call as a `tool_use` block, with a fresh id in the shape `g`'s template accepts back.
fn tool_use(call: &tools::ParsedCall, g: &AgentGeneration) -> ContentBlock {
    ContentBlock::ToolUse {
        id: g.call_id("toolu"),
        name: call.name.clone(),
        input: call.arguments.clone(),
    }
}

async fn whole(meta: Meta, mut g: AgentGeneration) -> Result<Response, AnthropicError> {
    let mut content: Vec<ContentBlock> = Vec::new();
    let add = |pieces: Vec<Piece>, content: &mut Vec<ContentBlock>, g: &AgentGeneration| {
        for p in pieces {
            match (content.last_mut(), p) {
                (Some(ContentBlock::Thinking { thinking, .. }), Piece::Reasoning(t)) => {
                    thinking.push_str(&t)
                }
                (Some(ContentBlock::Text { text }), Piece::Content(t)) => text.push_str(&t),
                (_, Piece::Reasoning(t)) => content.push(ContentBlock::Thinking {
                    thinking: t,
                    signature: String::new(),
                }),
                (_, Piece::Content(t)) => content.push(ContentBlock::Text { text: t }),
                (_, Piece::Call(c)) => content.push(tool_use(&c, g)),
            }
        }
    };
    let reason = loop {
        match g.next().await {
            Some(AgentStep::Pieces(pieces, _)) => add(pieces, &mut content, &g),
            Some(AgentStep::Finished { pieces, reason, .. }) => {
                add(pieces, &mut content, &g);
                break reason;
            }
            Some(AgentStep::Failed(e)) => return Err(e.into()),
            None => {
                return Err(
                    ApiError::Internal("the generation ended without a finish".into()).into(),
                )
            }
        }
    };
    let called = content
        .iter()
        .any(|b| matches!(b, ContentBlock::ToolUse { .. }));
    if called {
        // Whitespace around calls is no answer.
        content.retain(|b| !matches!(b, ContentBlock::Text { text } if text.trim().is_empty()));
    }
    let stop_sequence = g.generation.stop_sequence().map(str::to_owned);
    log_finish(&meta, reason, &g.generation.usage(), g.generation.drafts());
    Ok(Json(MessagesResponse {
        id: meta.id,
        kind: "message".into(),
        role: "assistant".into(),
        model: meta.model,
        content,
        stop_reason: Some(stop_reason(reason, called, stop_sequence.as_deref()).into()),
        stop_sequence,
        usage: usage(&g),
    })
    .into_response())
}

/// `event: <name>\ndata: <json>\n\n`.
fn event(e: &StreamEvent) -> Bytes {
    let data = serde_json::to_string(e).unwrap_or_else(|e| {
        format!("{{\"type\":\"error\",\"error\":{{\"type\":\"api_error\",\"message\":\"{e}\"}}}}")
    });
    Bytes::from(format!("event: {}\ndata: {data}\n\n", e.name()))
}

/// Which content block is open in a stream.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    None,
    Thinking,
    Text,
}

struct Blocks {
    index: u32,
    open: Open,
    called: bool,
}

impl Blocks {
    fn close(&mut self, out: &mut Vec<Bytes>) {
        if self.open != Open::None {
            out.push(event(&StreamEvent::ContentBlockStop { index: self.index }));
            self.index += 1;
            self.open = Open::None;
        }
    }

    fn start(&mut self, kind: Open, block: ContentBlock, out: &mut Vec<Bytes>) {
        if self.open != kind {
            self.close(out);
            out.push(event(&StreamEvent::ContentBlockStart {
                index: self.index,
                content_block: block,
            }));
            self.open = kind;
        }
    }

    fn pieces(&mut self, pieces: Vec<Piece>, g: &AgentGeneration) -> Vec<Bytes> {
        let mut out = Vec::new();
        for p in pieces {
            match p {
                Piece::Reasoning(t) => {
                    self.start(
                        Open::Thinking,
                        ContentBlock::Thinking {
                            thinking: String::new(),
                            signature: String::new(),
                        },
                        &mut out,
                    );
                    out.push(event(&StreamEvent::ContentBlockDelta {
                        index: self.index,
                        delta: BlockDelta::ThinkingDelta { thinking: t },
                    }));
                }
                Piece::Content(t) => {
                    // Whitespace between calls opens no text block.
                    if self.open != Open::Text && t.trim().is_empty() {
                        continue;
                    }
                    self.start(
                        Open::Text,
                        ContentBlock::Text {
                            text: String::new(),
                        },
                        &mut out,
                    );
                    out.push(event(&StreamEvent::ContentBlockDelta {
                        index: self.index,
                        delta: BlockDelta::TextDelta { text: t },
                    }));
                }
                Piece::Call(c) => {
                    self.close(&mut out);
                    let ContentBlock::ToolUse { id, name, input } = tool_use(&c, g) else {
                        continue;
                    };
                    out.push(event(&StreamEvent::ContentBlockStart {
                        index: self.index,
                        content_block: ContentBlock::ToolUse {
                            id,
                            name,
                            input: json!({}),
                        },
                    }));
                    out.push(event(&StreamEvent::ContentBlockDelta {
                        index: self.index,
                        delta: BlockDelta::InputJsonDelta {
                            partial_json: input.to_string(),
                        },
                    }));
                    out.push(event(&StreamEvent::ContentBlockStop { index: self.index }));
                    self.index += 1;
                    self.called = true;
                }
            }
        }
        out
    }
}

fn sse(meta: Meta, g: AgentGeneration) -> Response {
    let start = MessagesResponse {
        id: meta.id.clone(),
        kind: "message".into(),
        role: "assistant".into(),
        model: meta.model.clone(),
        content: vec![],
        stop_reason: None,
        stop_sequence: None,
        usage: MessagesUsage {
            output_tokens: 1,
            ..usage(&g)
        },
    };
    let opening = [
        event(&StreamEvent::MessageStart { message: start }),
        event(&StreamEvent::Ping),
    ];
    let blocks = Blocks {
        index: 0,
        open: Open::None,
        called: false,
    };
    let body = futures::stream::unfold(Some((g, blocks, meta)), |st| async move {
        let (mut g, mut blocks, meta) = st?;
        match g.next().await {
            Some(AgentStep::Pieces(pieces, _)) => {
                let out = blocks.pieces(pieces, &g);
                Some((
                    Ok::<_, Infallible>(Bytes::from(out.concat())),
                    Some((g, blocks, meta)),
                ))
            }
            Some(AgentStep::Finished { pieces, reason, .. }) => {
                let mut out = blocks.pieces(pieces, &g);
                blocks.close(&mut out);
                let stop_sequence = g.generation.stop_sequence().map(str::to_owned);
                log_finish(&meta, reason, &g.generation.usage(), g.generation.drafts());
                out.push(event(&StreamEvent::MessageDelta {
                    delta: MessageDeltaBody {
                        stop_reason: Some(
                            stop_reason(reason, blocks.called, stop_sequence.as_deref()).into(),
                        ),
                        stop_sequence,
                    },
                    usage: DeltaUsage {
                        output_tokens: usage(&g).output_tokens,
                    },
                }));
                out.push(event(&StreamEvent::MessageStop));
                Some((Ok(Bytes::from(out.concat())), None))
            }
            Some(AgentStep::Failed(e)) => {
                tracing::warn!(request_id = %meta.id, error = %e, "generation failed mid-stream");
                let data = serde_json::to_string(&error_body(&e)).unwrap_or_default();
                Some((
                    Ok(Bytes::from(format!("event: error\ndata: {data}\n\n"))),
                    None,
                ))
            }
            None => None,
        }
    });
    let stream = futures::stream::iter(opening.into_iter().map(Ok::<_, Infallible>)).chain(body);
    super::routes::event_stream(stream)
}
